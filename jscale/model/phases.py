"""A layer as phases, so that micro-batches side by side run skewed: one's all-to-alls under
another's compute, as DeepSeek-V3's dual micro-batch overlap pairs them (playbook, "Expert
parallelism"; DeepSeek-V3 report §3.2.1: attention, dispatch, MLP, combine).

An MoE layer alternates compute and transfers: attention and the router (A), the exchange's
dispatch (D), the experts' grouped matmuls (E), its combine (C), the shared expert and the
residual (F). Two micro-batches in one step of a layer's loop are independent, and XLA:GPU's
latency-hiding scheduler interleaves them op by op: both attentions, then both dispatches
with nothing to compute beside them, then both grouped matmuls with the collective stream
idle (DeepSeek-V3 671B compiled for 1,024 H100s, docs/deepseek.md). Skewed, micro-batch i
runs phase k while micro-batch i+1 runs phase k-1, and an optimization barrier after every
step leaves the scheduler nothing else to put beside a transfer:

    step:   1    2    3    4    5    6
    mb 0:   A    D    E    C    F
    mb 1:        A    D    E    C    F

A layer's code is a generator (`Phases`): at each boundary it yields the arrays the next
phase starts from and continues with what it is sent back (`x = yield x`); `run` sends each
back as it is (one micro-batch, the plain layer), `skewed` through the barrier. Autodiff
transposes each barrier into one on the cotangents, so the backward pairs phases alike, in
reverse. What a single SPMD program cannot say: that a transfer must start before the compute
beside it; the barriers only leave nothing else in its window.

Rules for phase code: yield only arrays (pytrees of them); never yield inside a traced
sub-function (jax.checkpoint, custom_vjp, a loop body: the generators interleave in Python,
and their values must share one trace), nor inside a context manager.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Sequence, TypeVar

import jax

T = TypeVar("T")
Phases = Generator[Any, Any, T]  # yields the state at each boundary, is sent it back


def run(phases: Phases[T]) -> T:
  """`phases` alone, to its end: each boundary's state sent back as it is."""
  try:
    state = next(phases)
    while True:
      state = phases.send(state)
  except StopIteration as stop:
    return stop.value


def finished(value: T) -> Phases[T]:
  """Phases with no boundary: `value`, at once (a seam or layer that does not split)."""
  return value
  yield  # unreachable: makes this a generator


def alongside(phases: Phases[T], extra: Callable[[], Any]) -> Phases[tuple[T, Any]]:
  """`phases`, with `extra()` run in the window of its first phase: issued after the barrier
  its inputs pass, its value tied into the barrier its first phase's result passes (`skewed`:
  micro-batch 0's first phase runs alone there, e.g. a transfer beside its attention with no
  exchange of another in flight). Returns (`phases`' value, `extra()`'s)."""
  state = yield next(phases)
  got = extra()
  try:
    state = phases.send(state)
  except StopIteration as stop:
    return stop.value, got
  state, got = yield state, got
  value = yield from _run_on(phases, state)
  return value, got


def _run_on(phases: Phases[T], state: Any) -> Phases[T]:
  """`phases` (started) from `state`, each later boundary yielded to the caller as it is."""
  while True:
    try:
      state = phases.send(state)
    except StopIteration as stop:
      return stop.value
    state = yield state


def skewed(all_phases: Sequence[Phases[T]]) -> list[T]:
  """The results of `all_phases` (one generator per micro-batch, each yielding its inputs
  first), micro-batch i started i steps after the first, all boundary states of a step tied
  by one optimization barrier (module docstring)."""
  states: dict[int, Any] = {}
  results: dict[int, T] = {}

  def advance(i: int, state: Any = None, first: bool = False) -> None:
    try:
      states[i] = next(all_phases[i]) if first else all_phases[i].send(state)
    except StopIteration as stop:
      results[i] = stop.value
      states.pop(i, None)

  step = 0
  while step < len(all_phases) or states:
    if step < len(all_phases):
      advance(step, first=True)
    live = sorted(states)
    if live:
      for i, state in zip(live, jax.lax.optimization_barrier([states[i] for i in live])):
        advance(i, state)
    step += 1
  return [results[i] for i in range(len(all_phases))]
