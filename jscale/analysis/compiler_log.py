"""What XLA's compiler says while it compiles (its C++ log, written to file descriptor 2): read,
not lost.

XLA:GPU's rematerialization pass warns when it cannot get a program under the memory it may
plan for: `Can't reduce memory use below 68.33GiB (73367548986 bytes) by rematerialization;
only reduced to 95.61GiB (102656804077 bytes)`. That is its own estimate, made before the final
schedule and buffer assignment, which may still fit (llama3_1b, batch 4 without recomputation,
for one H100: warned at 95.6 GiB, assigned 59.7 GiB). So a warning is a figure beside the
compiled memory, marked, and only a run settles it (`scripts/gpu_session.py run memory`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from typing import Iterator

_REMAT = re.compile(r"Can't reduce memory use below \S+ \((\d+) bytes\) by rematerialization; "
                    r"only reduced to \S+ \((\d+) bytes\)")


@dataclasses.dataclass(frozen=True)
class RematShortfall:
  """The remat pass's limit and the bytes it could not get under it (its estimate)."""
  limit_bytes: int
  reached_bytes: int


def shortfalls(log: str) -> list[RematShortfall]:
  """The remat warnings in compiler output `log`."""
  return [RematShortfall(int(m.group(1)), int(m.group(2))) for m in _REMAT.finditer(log)]


@contextlib.contextmanager
def remat_shortfalls() -> Iterator[list[RematShortfall]]:
  """Collects the remat pass's warnings of the compiles run meanwhile, in the list it yields;
  every other line the compiler writes to file descriptor 2 is passed on to stderr."""
  found: list[RematShortfall] = []
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as log:
    os.dup2(log.fileno(), 2)
    try:
      yield found
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      log.seek(0)
      text = log.read().decode(errors="replace")
      found.extend(shortfalls(text))
      rest = "".join(line for line in text.splitlines(keepends=True) if not _REMAT.search(line))
      if rest:
        sys.stderr.write(rest)
        sys.stderr.flush()
