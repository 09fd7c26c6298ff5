"""The training loop: steps, metrics, eval, checkpoints, and the three ways a run ends early.

Steps are dispatched asynchronously; the host waits on the device only at logging intervals,
evals and saves. At those points the loop also settles what the steps since the last one
reported:

- a non-finite loss or gradient norm (the step already dropped that update): `train.on_nan=stop`
  ends the run without saving, naming the step; `skip` counts it (`nonfinite_steps`);
- a stop request (SIGTERM / SIGINT, `jscale.run.preemption`) or a due timed save, agreed on by every
  process: save, and for a stop, end the run.
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


def _row(m: dict[str, Any]) -> dict[str, Any]:
  return {k: (v.tolist() if getattr(v, "ndim", 0) else float(v))
          for k, v in m.items() if k not in ("tokens", "nonfinite")}


def train(cfg: Config, rt: runtime.Runtime, state: Any, start: int, end: int, train_iter,
          eval_batches: list, ckptr: ckpt_lib.Checkpointer, writer: metrics_lib.MetricsWriter,
          signals: preemption.StopSignals) -> Outcome:
  """Runs steps `start`..`end` (exclusive of `start`: the state is after step `start`)."""
  t = cfg.train
  train_step, eval_step = rt.train_step(), rt.eval_step()
  batch_sharding = rt.layouts.batch()
  tokens_per_step = t.batch_size * t.seq_len
  flops_per_step = metrics_lib.flops_per_token(cfg.model, t.seq_len) * tokens_per_step
  peak = t.peak_flops or metrics_lib.device_peak_flops()
  timer = preemption.SaveTimer(cfg.checkpoint.every_minutes)
  multi = jax.process_count() > 1
  out = Outcome({}, None, start, state)
  nonfinite_total = writer.nonfinite_steps
  pending: list[tuple[int, Any]] = []  # (step, its metrics) not yet checked for non-finites
  last_time, last_step, tracing = None, start, False
  for step in range(start, end):
    if t.profile_steps and step == t.profile_steps[0]:
      jax.profiler.start_trace(os.path.join(t.output_dir, "profile"))
      tracing = True
    state, m = train_step(state, evaluate.to_global(next(train_iter), batch_sharding))
    done = step + 1
    out.state, out.final_step = state, done
    pending.append((done, m))
    if last_time is None:  # the first step includes compilation: time from its end
      jax.block_until_ready(m)
      last_time, last_step = time.perf_counter(), done
    if tracing and step == t.profile_steps[1]:
      jax.block_until_ready(m)
      jax.profiler.stop_trace()
      tracing = False
    writer.advance()
    log = done % cfg.logging.every == 0 or done == end
    evals = bool(eval_batches and t.eval_every and (done % t.eval_every == 0 or done == t.steps))
    check = log or evals or ckptr.due(done) or done == end  # the host syncs here anyway
    if not (check or not multi):  # processes agree only at steps every one of them checks
      continue
    stop, timed = preemption.agree(signals.requested is not None, timer.due())
    if not (check or stop or timed):
      continue
    bad = _nonfinite(pending)
    pending.clear()
    if bad and t.on_nan == "stop":
      s, r = bad[0]
      out.stopped, out.message = "nonfinite", (
          f"non-finite loss or gradient norm at step {s} (loss {r['loss']}, grad_norm "
          f"{r['grad_norm']}): stopped without saving (train.on_nan=stop); its update was not "
          f"applied. Last checkpoint: {_last(ckptr)}. To go on past it: train.on_nan=skip (drops "
          "such updates), or a lower train.lr / train.clip_norm")
      break
    if bad:
      nonfinite_total += len(bad)
      print(f"warning: non-finite loss or gradient norm at step(s) "
            f"{', '.join(str(s) for s, _ in bad)}: update(s) skipped (train.on_nan=skip)",
            file=sys.stderr, flush=True)
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
      row["nonfinite_steps"] = nonfinite_total
      writer.write(done, row)
    if evals:
      out.val_loss = evaluate.mean_loss(eval_step, state["params"], eval_batches, batch_sharding,
                                        state.get("dot_state")).loss
      writer.write(done, {"val_loss": out.val_loss})
    saving = cfg.checkpoint.every > 0 and (done == end or stop or timed)
    if ckptr.save(done, state, train_iter, force=saving):
      timer.reset()
    if stop:
      ckptr.wait()
      where = (f"checkpoint step {done} saved in {ckptr.directory}" if ckptr.last_saved == done
               else "no checkpoint saved (checkpoint.every=0)")
      out.stopped, out.message = "preempted", (
          f"stopped by {signals.requested or 'a peer process'} after step {done}: {where}. "
          "Rerun the same command to resume.")
      break
  if tracing:
    jax.profiler.stop_trace()
  return out


def _nonfinite(pending: list[tuple[int, Any]]) -> list[tuple[int, dict[str, Any]]]:
  """The steps among `pending` whose update was dropped, with their metrics."""
  flags = jax.device_get([m["nonfinite"] for _, m in pending])
  return [(s, _row(jax.device_get(m))) for (s, m), f in zip(pending, flags) if bool(f)]


def _last(ckptr: ckpt_lib.Checkpointer) -> str:
  steps = ckpt_lib.complete_steps(ckptr.directory)
  return f"step {steps[-1]} in {ckptr.directory}" if steps else "none"
