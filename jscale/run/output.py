"""Where a run's output goes: jscale's own lines to the console, whatever happens to it, and in a
multi-process run the libraries' chatter to a log file.

- `ClosableOutput`: `python -m jscale.train ... | head` closes the pipe; the run trains on, its
  output going to /dev/null (a BrokenPipeError killed it).
- `libraries_to_log`: the libraries under jscale write to the process's file descriptors from
  C++, not through Python. Gloo prints a "[Gloo] Rank r is connected to n peer ranks" line per
  device and communicator to stdout (16 in a 4-step run of 2 processes x 4 devices). In a
  multi-process run file descriptor 1 is pointed at `<output_dir>/logs/process<i>.log`, while
  Python's `sys.stdout` (jscale's lines) keeps the console. Descriptor 2 is left alone: what XLA
  and absl write there is rare and says why a run failed (a peer's lost heartbeat, a fatal
  error), which the console must show.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Iterator


class ClosableOutput:
  """An output stream that outlives its reader: once the pipe is closed, output goes to
  /dev/null and the run trains on."""

  def __init__(self, stream):
    self._stream = stream

  def write(self, text: str) -> int:
    try:
      return self._stream.write(text)
    except BrokenPipeError:
      self._to_devnull()
      return len(text)

  def flush(self) -> None:
    try:
      self._stream.flush()
    except BrokenPipeError:
      self._to_devnull()

  def _to_devnull(self) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, self._stream.fileno())  # the fd too: the interpreter's last flush succeeds
    os.close(null)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._stream, name)


def log_path(output_dir: str, process: int) -> str:
  """The file a process's library output goes to."""
  return os.path.join(output_dir, "logs", f"process{process}.log")


@contextlib.contextmanager
def libraries_to_log(path: str) -> Iterator[None]:
  """While active, file descriptor 1 writes to `path` (appended); `sys.stdout` writes where it
  wrote before, through a copy of the old descriptor."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  stream = sys.stdout
  stream.flush()
  saved = os.dup(1)
  console = os.fdopen(saved, "w", buffering=1, encoding=stream.encoding, errors=stream.errors,
                      closefd=False)
  log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  os.write(log, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n".encode())
  os.dup2(log, 1)
  os.close(log)
  sys.stdout = ClosableOutput(console)
  try:
    yield
  finally:
    console.flush()
    os.dup2(saved, 1)
    os.close(saved)
    sys.stdout = stream
