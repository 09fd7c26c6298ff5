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
import threading
from typing import Iterator

_REMAT = re.compile(r"Can't reduce memory use below \S+ \((\d+) bytes\) by rematerialization; "
                    r"only reduced to \S+ \((\d+) bytes\)")


@dataclasses.dataclass(frozen=True)
class RematShortfall:
  """The remat pass's limit and the bytes it could not get under it (its estimate)."""
  limit_bytes: int
  reached_bytes: int


def of_compile(info: dict[str, float]) -> RematShortfall | None:
  """The shortfall `introspect.compile_train_step`'s info records (None: no warning)."""
  if "remat_limit_bytes" not in info:
    return None
  return RematShortfall(int(info["remat_limit_bytes"]), int(info["remat_reached_bytes"]))


def shortfalls(log: str) -> list[RematShortfall]:
  """The remat warnings in compiler output `log`."""
  return [RematShortfall(int(m.group(1)), int(m.group(2))) for m in _REMAT.finditer(log)]


@contextlib.contextmanager
def remat_shortfalls() -> Iterator[list[RematShortfall]]:
  """Collects the remat pass's warnings of the compiles run meanwhile, in the list it yields.
  File descriptor 2 goes through a pipe that a thread reads line by line as it fills, passing
  every other line on at once: what a compiler that aborts writes first (its check failure)
  still reaches the terminal."""
  found: list[RematShortfall] = []
  sys.stderr.flush()
  saved = os.dup(2)
  read_end, write_end = os.pipe()
  os.dup2(write_end, 2)
  os.close(write_end)
  reader = threading.Thread(target=_forward, args=(read_end, saved, found), daemon=True)
  reader.start()
  try:
    yield found
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)  # the pipe's last write end closes: the reader sees its end
    reader.join()
    os.close(read_end)
    os.close(saved)


def _forward(read_end: int, out: int, found: list[RematShortfall]) -> None:
  """Copies lines from `read_end` to `out` until the pipe closes, keeping remat warnings."""
  pending = b""
  while chunk := os.read(read_end, 1 << 16):
    *lines, pending = (pending + chunk).split(b"\n")
    for line in lines:
      _one(line + b"\n", out, found)
  if pending:
    _one(pending, out, found)


def _one(line: bytes, out: int, found: list[RematShortfall]) -> None:
  said = shortfalls(line.decode(errors="replace"))
  if said:
    found.extend(said)
  else:
    os.write(out, line)
