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

from jscale import metrics as metrics_lib
from jscale import runtime
from jscale.ckpt import checkpoint as ckpt_lib
from jscale.config import Config
from jscale.infer import evaluate
from jscale.run import console as console_lib
from jscale.run import preemption, scheduled
from jscale.step import state as state_lib


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


def log_due(cfg: Config, done: int, end: int) -> bool:
  """A metrics row and console line after step `done`: every `logging.every`, and the last."""
  return done % cfg.logging.every == 0 or done == end


def eval_due(cfg: Config, done: int, has_eval: bool) -> bool:
  """A validation pass after step `done`: every `train.eval_every` (0: never) and at
  `train.steps`, when there is validation data."""
  t = cfg.train
  return bool(has_eval and t.eval_every and (done % t.eval_every == 0 or done == t.steps))


class Profile:
  """`train.profile_steps` [first, last]: a trace from before step `first` to after `last`."""

  def __init__(self, steps: list[int] | None, output_dir: str):
    self.steps, self.directory, self.tracing = steps, os.path.join(output_dir, "profile"), False

  def before(self, step: int) -> None:
    if self.steps and step == self.steps[0]:
      jax.profiler.start_trace(self.directory)
      self.tracing = True

  def after(self, step: int, metrics: Any) -> None:
    if self.tracing and step == self.steps[1]:
      jax.block_until_ready(metrics)
      self.close()

  def close(self) -> None:
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False


class StepClock:
  """Step times from the end of the first step (it includes compilation); evals and saves are
  left out by restarting the clock after them."""

  def __init__(self, start: int):
    self.time: float | None = None
    self.step = start

  def restart(self, done: int) -> None:
    self.time, self.step = time.perf_counter(), done

  def per_step(self, done: int) -> float | None:
    """Seconds per step since the last restart (None if no step ran since), and restarts."""
    now = time.perf_counter()
    since = self.time if self.time is not None else now
    step_time = (now - since) / max(done - self.step, 1) if done > self.step else None
    self.time, self.step = now, done
    return step_time


def train(cfg: Config, rt: runtime.Runtime, state: Any, start: int, end: int, train_iter,
          eval_sets: dict[str, list], ckptr: ckpt_lib.Checkpointer,
          writer: metrics_lib.MetricsWriter, console: console_lib.Console,
          signals: preemption.StopSignals) -> Outcome:
  """Runs steps `start`..`end` (exclusive of `start`: the state is after step `start`).
  `eval_sets`: each source's validation batches by its label (`data.make_eval_sets`)."""
  train_step, eval_step = scheduled.train_step(cfg, rt), rt.eval_step()
  batch_sharding = rt.layouts.batch()
  timer, stopper = preemption.SaveTimer(cfg.checkpoint.every_minutes), preemption.StopStep(signals)
  multi = jax.process_count() > 1
  out = Outcome({}, None, start, state)
  nonfinite = _NonFinite(cfg.train.on_nan, writer.nonfinite_steps)
  profile, clock = Profile(cfg.train.profile_steps, cfg.train.output_dir), StepClock(start)
  previous = None  # the metrics of the step before this one
  for step in range(start, end):
    profile.before(step)
    state, m = train_step(state, evaluate.to_global(next(train_iter), batch_sharding))
    done = signals.started = step + 1
    out.state, out.final_step = state, done
    nonfinite.pending.append((done, m))
    if clock.time is None:  # the first step includes compilation: time from its end
      jax.block_until_ready(m)
      clock.restart(done)
    elif previous is not None:  # one step queued behind the running one, never more
      jax.block_until_ready(previous["loss"])
    previous = m
    profile.after(step, m)
    console.advance()
    log, evals = log_due(cfg, done, end), eval_due(cfg, done, bool(eval_sets))
    check = log or evals or ckptr.due(done) or done == end  # the host syncs here anyway
    if check and nonfinite.settle():
      out.stopped, out.message = "nonfinite", nonfinite.message(_last(ckptr))
      break
    if log:
      _log(cfg, rt, done, m, clock.per_step(done), nonfinite.total, out, writer, console)
    if evals:
      _evaluate(eval_step, batch_sharding, state, eval_sets, done, out, writer, console)
      clock.restart(done)  # step times leave the eval out
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
    if ckptr.save(done, state_lib.as_saved(state), train_iter, force=saving):
      timer.reset()
      clock.restart(done)  # ... and the save's wait
    if stop:
      out.stopped, out.message = "preempted", _preempted(ckptr, stopper, signals, done)
      break
  profile.close()
  return out


def _log(cfg: Config, rt: runtime.Runtime, done: int, m: dict, step_time: float | None,
         nonfinite_total: int, out: Outcome, writer: metrics_lib.MetricsWriter,
         console: console_lib.Console) -> None:
  """Step `done`'s metrics row: loss and friends, step time, tokens/s and MFU, memory."""
  t = cfg.train
  tokens_per_step = t.batch_size * t.seq_len
  row = _row(jax.device_get(m))
  out.losses[done] = row["loss"]
  if step_time:
    flops = metrics_lib.flops_per_token(cfg.model, t.seq_len) * tokens_per_step
    peak = t.peak_flops or metrics_lib.device_peak_flops()
    row.update(step_time_s=step_time, tokens_per_sec=tokens_per_step / step_time,
               mfu=metrics_lib.mfu(flops, step_time, rt.mesh.size, peak))
  row["peak_memory_bytes"] = metrics_lib.peak_memory_bytes()
  row["nonfinite_steps"] = nonfinite_total
  writer.write(done, row)
  console.write(done, row)


def _evaluate(eval_step, batch_sharding, state: Any, eval_sets: dict[str, list], done: int,
              out: Outcome, writer: metrics_lib.MetricsWriter,
              console: console_lib.Console) -> None:
  """The validation loss after step `done` (over every source's tokens; a mixture's sources
  each as val_loss/<label> too), recorded in `out`, the metrics and the console."""
  results = {label: evaluate.mean_loss(eval_step, state["params"], batches, batch_sharding,
                                       state.get("dot_state"))
             for label, batches in eval_sets.items()}
  tokens = sum(r.tokens for r in results.values())
  loss = sum(r.loss * r.tokens for r in results.values()) / max(tokens, 1)
  batches = sum(len(b) for b in eval_sets.values())
  out.val_loss, out.val_tokens, out.val_batches = loss, tokens, batches
  row = {"val_loss": loss, "val_batches": batches, "val_tokens": tokens,
         **{f"val_loss/{label}": r.loss for label, r in results.items() if label}}
  writer.write(done, row)
  console.write(done, row)


def _preempted(ckptr: ckpt_lib.Checkpointer, stopper: preemption.StopStep,
               signals: preemption.StopSignals, done: int) -> str:
  """What to tell the user of a run stopped by a signal after step `done` (its save waited)."""
  ckptr.wait()
  where = (f"checkpoint step {done} saved in {ckptr.directory}" if ckptr.last_saved == done
           else "no checkpoint saved (checkpoint.every=0)")
  at = f" (received at step {signals.at})" if signals.at else ""
  return (f"stopped by {stopper.by} after step {done}{at}: {where}. "
          "Rerun the same command to resume.")


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
    if self.first is None:
      raise RuntimeError("no non-finite step to report: settle() found none")
    s, r = self.first
    return (f"non-finite loss or gradient norm at step {s} (loss {r['loss']}, grad_norm "
            f"{r['grad_norm']}): stopped without saving (train.on_nan=stop); its update was not "
            f"applied. Last checkpoint: {last_checkpoint}. To go on past it: train.on_nan=skip "
            "(drops such updates), or a lower train.lr / train.clip_norm")


def _last(ckptr: ckpt_lib.Checkpointer) -> str:
  steps = ckpt_lib.complete_steps(ckptr.directory)
  return f"step {steps[-1]} in {ckptr.directory}" if steps else "none"
