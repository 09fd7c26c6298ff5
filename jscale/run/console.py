"""What a run prints while it trains: one plain line per logged step and one per eval, and, in a
terminal, a progress bar kept below them.

The lines go to stdout and read the same in a terminal and in a batch log (SLURM, nohup, a
pipe): no carriage returns, one line per event. The bar goes to stderr, only when stderr is a
terminal and `logging.progress` is on; the lines print above it.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def duration(seconds: float) -> str:
  """3725 -> '1h02m', 125 -> '2m05s', 7.5 -> '8s'."""
  s = int(round(seconds))
  if s >= 3600:
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
  if s >= 60:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s}s"


def step_line(step: int, total: int, row: dict[str, Any]) -> str:
  """One logged step: loss, gradient norm, learning rate, throughput, MFU and device memory
  where known, the time left at this pace."""
  width = len(str(total))
  parts = [f"step {step:>{width}}/{total}", f"loss {row['loss']:.4f}",
           f"grad {row['grad_norm']:.3g}", f"lr {row['lr']:.2e}"]
  step_time = row.get("step_time_s")
  if step_time:
    parts += [f"{row['tokens_per_sec']:,.0f} tok/s", f"{step_time:.3g} s/step"]
  if row.get("mfu") is not None:
    parts.append(f"mfu {100 * row['mfu']:.1f}%")
  if row.get("peak_memory_bytes") is not None:
    parts.append(f"mem {row['peak_memory_bytes'] / 2**30:.1f} GiB")
  if row.get("nonfinite_steps"):
    parts.append(f"skipped {row['nonfinite_steps']} non-finite")
  if step_time and step < total:
    parts.append(f"eta {duration((total - step) * step_time)}")
  return "  ".join(parts)


def covered(row: dict[str, Any]) -> str:
  """What a val loss covered: '4 batches, 8,192 tokens of the val split'."""
  return f"{row['val_batches']} batches, {row['val_tokens']:,} tokens of the val split"


def eval_line(step: int, total: int, row: dict[str, Any]) -> str:
  width = len(str(total))
  sources = ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in row.items()
                      if k.startswith("val_loss/"))
  return (f"eval {step:>{width}}/{total}  val_loss {row['val_loss']:.4f}"
          f"{f' ({sources})' if sources else ''}  ({covered(row)})")


class Console:
  """The run's lines and bar, on the process that logs (`active`); elsewhere it does nothing."""

  def __init__(self, total_steps: int, start_step: int, *, progress: bool, active: bool = True):
    self.total, self.active = total_steps, active
    self._bar = None
    if active and progress and sys.stderr.isatty():
      self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                       file=sys.stderr)

  def write(self, step: int, row: dict[str, Any]) -> None:
    """The line for a metrics row: a train step's (with `loss`) or an eval's (`val_loss`)."""
    if not self.active:
      return
    if "loss" in row:
      if self._bar is not None:  # before the line: printing it redraws the bar
        self._bar.set_postfix(loss=f"{row['loss']:.3f}", refresh=False)
      self.print(step_line(step, self.total, row))
    if "val_loss" in row:
      self.print(eval_line(step, self.total, row))

  def print(self, text: str) -> None:
    """A line on stdout, above the bar."""
    if self._bar is not None:
      tqdm.write(text, file=sys.stdout)
    else:
      print(text, flush=True)

  def advance(self, n: int = 1) -> None:
    if self._bar is not None:
      self._bar.update(n)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
