"""The training loop: steps, metrics, eval, checkpoints, and the three ways a run ends early.

Steps are dispatched asynchronously, one step queued behind the one running: after dispatching
step s the host waits for step s-1, so the device never idles between steps and the host is
never more than one step ahead of it. After every step the loop reads the stop request
(SIGTERM / SIGINT, `jscale.run.preemption`; agreed on by every process): it saves and ends the
run within one step of the signal, whatever `logging.every`. At logging intervals, evals and
saves (where the host fetches values anyway) it also settles what the steps since the last one
reported:

- a non-finite loss or gradient norm (the step already dropped that update): `train.on_nan=stop`
  ends the run without saving, naming the step; `skip` counts it (`nonfinite_steps`);
- a due timed save, agreed on by every process: save.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import jax

from jscale.ckpt import checkpoint as ckpt_lib
from jscale import metrics as metrics_lib
from jscale.run import console as console_lib
from jscale.run import preemption
from jscale import runtime
from jscale.config import Config
from jscale.infer import evaluate


@dataclasses.dataclass
class Outcome:
  """How the loop ended. `stopped`: None (reached its end), "preempted" or "nonfinite";
  `message`: what to tell the user in that case."""
  losses: dict[int, float]
  val_loss: float | None
  final_step: int
  state: Any
  stopped: str | None = None
  message: str = ""
  val_batches: int = 0  # what the last val loss covered
  val_tokens: int = 0


def _row(m: dict[str, Any]) -> dict[str, Any]:
  return {k: (v.tolist() if getattr(v, "ndim", 0) else float(v))
          for k, v in m.items() if k not in ("tokens", "nonfinite")}


def train(cfg: Config, rt: runtime.Runtime, state: Any, start: int, end: int, train_iter,
          eval_batches: list, ckptr: ckpt_lib.Checkpointer, writer: metrics_lib.MetricsWriter,
          console: console_lib.Console, signals: preemption.StopSignals) -> Outcome:
  """Runs steps `start`..`end` (exclusive of `start`: the state is after step `start`)."""
  t = cfg.train
  train_step, eval_step = rt.train_step(), rt.eval_step()
  batch_sharding = rt.layouts.batch()
  tokens_per_step = t.batch_size * t.seq_len
  flops_per_step = metrics_lib.flops_per_token(cfg.model, t.seq_len) * tokens_per_step
  peak = t.peak_flops or metrics_lib.device_peak_flops()
  timer = preemption.SaveTimer(cfg.checkpoint.every_minutes)
  multi = jax.process_count() > 1
  stopper = preemption.StopStep(signals)
  out = Outcome({}, None, start, state)
  nonfinite = _NonFinite(t.on_nan, writer.nonfinite_steps)
  last_time, last_step, tracing = None, start, False
  previous = None  # the metrics of the step before this one
  for step in range(start, end):
    if t.profile_steps and step == t.profile_steps[0]:
      jax.profiler.start_trace(os.path.join(t.output_dir, "profile"))
      tracing = True
    state, m = train_step(state, evaluate.to_global(next(train_iter), batch_sharding))
    done = signals.started = step + 1
    out.state, out.final_step = state, done
    nonfinite.pending.append((done, m))
    if last_time is None:  # the first step includes compilation: time from its end
      jax.block_until_ready(m)
      last_time, last_step = time.perf_counter(), done
    elif previous is not None:  # one step queued behind the running one, never more
      jax.block_until_ready(previous["loss"])
    previous = m
    if tracing and step == t.profile_steps[1]:
      jax.block_until_ready(m)
      jax.profiler.stop_trace()
      tracing = False
    console.advance()
    log = done % cfg.logging.every == 0 or done == end
    evals = bool(eval_batches and t.eval_every and (done % t.eval_every == 0 or done == t.steps))
    check = log or evals or ckptr.due(done) or done == end  # the host syncs here anyway
    if check and nonfinite.settle():
      out.stopped, out.message = "nonfinite", nonfinite.message(_last(ckptr))
      break
    if log:
      m = jax.device_get(m)
      now = time.perf_counter()
      step_time = (now - last_time) / max(done - last_step, 1) if done > last_step else None
      last_time, last_step = now, done
      row = _row(m)
      out.losses[done] = row["loss"]
      if step_time:
        row.update(step_time_s=step_time, tokens_per_sec=tokens_per_step / step_time,
                   mfu=metrics_lib.mfu(flops_per_step, step_time, rt.mesh.size, peak))
      row["peak_memory_bytes"] = metrics_lib.peak_memory_bytes()
      row["nonfinite_steps"] = nonfinite.total
      writer.write(done, row)
      console.write(done, row)
    if evals:
      result = evaluate.mean_loss(eval_step, state["params"], eval_batches, batch_sharding,
                                  state.get("dot_state"))
      out.val_loss, out.val_tokens, out.val_batches = result.loss, result.tokens, len(eval_batches)
      row = {"val_loss": result.loss, "val_batches": len(eval_batches), "val_tokens": result.tokens}
      writer.write(done, row)
      console.write(done, row)
      last_time, last_step = time.perf_counter(), done  # step times leave the eval out
    # Read after the log and the eval: a signal during them counts at this step. The last step
    # saves and ends the run anyway.
    stop = stopper.reached(done) and done < end
    # Each process's clock is its own: timed saves are agreed at steps every process checks.
    timed = (preemption.agree(timer.due())[0] if check else False) if multi else timer.due()
    if not (check or stop or timed):
      continue
    if not check and nonfinite.settle():  # never save past a non-finite step unchecked
      out.stopped, out.message = "nonfinite", nonfinite.message(_last(ckptr))
      break
    if done == end:
      signals.phase = "the final checkpoint save"
    saving = cfg.checkpoint.every > 0 and (done == end or stop or timed)
    if ckptr.save(done, state, train_iter, force=saving):
      timer.reset()
      last_time, last_step = time.perf_counter(), done  # ... and the save's wait
    if stop:
      ckptr.wait()
      where = (f"checkpoint step {done} saved in {ckptr.directory}" if ckptr.last_saved == done
               else "no checkpoint saved (checkpoint.every=0)")
      at = f" (received at step {signals.at})" if signals.at else ""
      out.stopped, out.message = "preempted", (
          f"stopped by {stopper.by} after step {done}{at}: {where}. "
          "Rerun the same command to resume.")
      break
  if tracing:
    jax.profiler.stop_trace()
  return out


class _NonFinite:
  """The steps whose loss or gradient norm was non-finite (their update already dropped by the
  step), found among the `pending` ones when the host fetches values anyway."""

  def __init__(self, on_nan: str, total: int):
    self.on_nan, self.total = on_nan, total
    self.pending: list[tuple[int, Any]] = []  # (step, its metrics) not yet checked
    self.first: tuple[int, dict[str, Any]] | None = None

  def settle(self) -> bool:
    """Checks the pending steps; True when the run must stop (`train.on_nan=stop`)."""
    flags = jax.device_get([m["nonfinite"] for _, m in self.pending])
    bad = [(s, _row(jax.device_get(m))) for (s, m), f in zip(self.pending, flags) if bool(f)]
    self.pending.clear()
    if bad and self.on_nan == "stop":
      self.first = bad[0]
      return True
    if bad:
      self.total += len(bad)
      print(f"warning: non-finite loss or gradient norm at step(s) "
            f"{', '.join(str(s) for s, _ in bad)}: update(s) skipped (train.on_nan=skip)",
            file=sys.stderr, flush=True)
    return False

  def message(self, last_checkpoint: str) -> str:
    s, r = self.first
    return (f"non-finite loss or gradient norm at step {s} (loss {r['loss']}, grad_norm "
            f"{r['grad_norm']}): stopped without saving (train.on_nan=stop); its update was not "
            f"applied. Last checkpoint: {last_checkpoint}. To go on past it: train.on_nan=skip "
            "(drops such updates), or a lower train.lr / train.clip_norm")


def _last(ckptr: ckpt_lib.Checkpointer) -> str:
  steps = ckpt_lib.complete_steps(ckptr.directory)
  return f"step {steps[-1]} in {ckptr.directory}" if steps else "none"
