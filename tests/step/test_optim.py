"""The fused AdamW (clip folded into the moments) against optax's clip + adamw chain."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jscale import optim


def _tree(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {"blocks": {"w": jax.random.normal(k1, (2, 4, 8)), "norm": jnp.ones((2, 4))},
          "embed": jax.random.normal(k2, (16, 4)), "final_norm": jax.random.normal(k3, (4,))}


@pytest.mark.parametrize("clip_norm", [0.0, 0.5, 1e3])  # off, active, inactive
def test_matches_optax_chain(clip_norm):
  schedule = optax.linear_schedule(1e-2, 1e-3, 5)
  kw = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
  ours = optim.adamw(schedule, **kw, clip_norm=clip_norm)
  ref = optax.adamw(schedule, **kw, mask=optim.decay_mask)
  if clip_norm:
    ref = optax.chain(optax.clip_by_global_norm(clip_norm), ref)
  params = _tree(jax.random.key(0))
  p_ours, p_ref = params, params
  s_ours, s_ref = ours.init(params), ref.init(params)
  for step in range(4):
    grads = jax.tree.map(lambda x: 3 * x, _tree(jax.random.key(step + 1)))
    u, s_ours = jax.jit(ours.update)(grads, s_ours, p_ours)
    p_ours = optax.apply_updates(p_ours, u)
    u, s_ref = ref.update(grads, s_ref, p_ref)
    p_ref = optax.apply_updates(p_ref, u)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7),
                 p_ours, p_ref)


def test_global_norm_is_plain_norm():
  tree = _tree(jax.random.key(3))
  np.testing.assert_allclose(optim.global_norm(tree), optax.tree.norm(tree), rtol=1e-6)


def test_norms_are_not_decayed():
  mask = optim.decay_mask(_tree(jax.random.key(0)))
  assert mask == {"blocks": {"w": True, "norm": False}, "embed": True, "final_norm": False}


def test_a_nonfinite_step_is_dropped_whole():
  """finite=False: zero updates, moments and count unchanged; the next finite step is the one
  an optimizer that never saw the bad step would take."""
  opt = optim.adamw(optax.constant_schedule(1e-2), 0.9, 0.95, 1e-8, 0.1, clip_norm=1.0)
  params = _tree(jax.random.key(0))
  good = jax.tree.map(lambda x: 0.5 * x, _tree(jax.random.key(1)))
  nan = jax.tree.map(lambda x: x * jnp.nan, good)
  update = jax.jit(opt.update)
  state = opt.init(params)
  u, skipped = update(nan, state, params, finite=jnp.array(False))
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u))
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), skipped, state))
  u_after, _ = update(good, skipped, params, finite=jnp.array(True))
  u_direct, _ = update(good, state, params)
  jax.tree.map(np.testing.assert_array_equal, u_after, u_direct)
