"""`jscale.model.phases`: a layer as phases, micro-batches run skewed by one phase with an
optimization barrier after every step. The same values and gradients as each run alone, and
the barriers where the skew puts them."""

import jax
import jax.numpy as jnp
import numpy as np

from jscale.model import phases


def _layer(w, x):
  """Three phases: a product, a "transfer" (a roll), a product; the input yielded first."""
  x = yield x
  h = yield jnp.tanh(x @ w)
  h = yield jnp.roll(h, 1, axis=0)
  return jnp.sum(jnp.tanh(h @ w) ** 2)


def _alone(w, xs):
  return sum(phases.run(_layer(w, x)) for x in xs)


def _skewed(w, xs):
  return sum(phases.skewed([_layer(w, x) for x in xs]))


def test_run_and_finished():
  assert phases.run(phases.finished(3)) == 3
  w, x = jnp.eye(4), jnp.ones((2, 4))
  np.testing.assert_allclose(phases.run(_layer(w, x)), _layer_value(w, x), rtol=1e-6)


def _layer_value(w, x):
  return jnp.sum(jnp.tanh(jnp.roll(jnp.tanh(x @ w), 1, axis=0) @ w) ** 2)


def test_skewed_gives_the_values_and_gradients_of_each_alone():
  w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
  xs = [jax.random.normal(jax.random.key(i + 1), (4, 8)) for i in range(3)]
  np.testing.assert_allclose(_skewed(w, xs), _alone(w, xs), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(_skewed)(w, xs), jax.grad(_alone)(w, xs), rtol=1e-5,
                             atol=1e-6)


def test_one_barrier_per_step_tying_the_phases_side_by_side():
  """Two micro-batches of three phases (three boundaries: the input, and after the first two
  phases) run in 4 steps: a barrier per step, the middle ones holding both micro-batches'
  states; the backward transposes each into one on the cotangents."""
  w, xs = jnp.eye(4), [jnp.ones((2, 4))] * 2
  eqns = jax.make_jaxpr(_skewed)(w, xs).jaxpr.eqns
  barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
  assert [len(e.invars) for e in barriers] == [1, 2, 2, 1]
  grad_eqns = jax.make_jaxpr(jax.grad(_skewed))(w, xs).jaxpr.eqns
  paired = [e for e in grad_eqns if e.primitive.name == "optimization_barrier"
            and len(e.invars) == 2]
  assert len(paired) == 4  # 2 forward, 2 on the cotangents


def test_a_micro_batch_without_boundaries_mixes_in():
  """A layer that does not split (`finished`) beside one that does."""
  w, x = jnp.eye(4), jnp.ones((2, 4))
  out = phases.skewed([phases.finished(jnp.float32(7)), _layer(w, x)])
  np.testing.assert_allclose(out[0], 7)
  np.testing.assert_allclose(out[1], _layer_value(w, x), rtol=1e-6)


def test_alongside_ties_the_extra_into_the_first_phase_window():
  """`alongside`: the extra runs after the barrier the first micro-batch's input passes and
  its value passes the next barrier with that micro-batch's first phase (the second's input
  beside them): the window where micro-batch 0's first phase runs alone. The values are those
  of each alone."""
  w, xs = jnp.eye(4), [jnp.ones((2, 4)), 2 * jnp.ones((2, 4))]

  def fn(w, xs):
    first, rest = phases.alongside(_layer(w, xs[0]), lambda: jnp.sin(w)), _layer(w, xs[1])
    (a, extra), b = phases.skewed([first, rest])
    return a + b, extra

  eqns = jax.make_jaxpr(fn)(w, xs).jaxpr.eqns
  barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
  assert [len(e.invars) for e in barriers] == [1, 3, 2, 1]
  sin = next(e for e in eqns if e.primitive.name == "sin")
  assert eqns.index(barriers[0]) < eqns.index(sin) < eqns.index(barriers[1])
  assert sin.outvars[0] in barriers[1].invars
  value, extra = fn(w, xs)
  np.testing.assert_allclose(value, _alone(w, xs), rtol=1e-6)
  np.testing.assert_allclose(extra, jnp.sin(w))
