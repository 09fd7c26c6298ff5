"""Pallas kernels, standalone (they import nothing from jscale), one folder per op, each the
same shape:

  * public ops, differentiable through a `jax.custom_vjp`: `kernel.py` (portable: Triton-lowered,
    runs in the Pallas interpreter) and `hopper.py` (Mosaic GPU, Hopper) side by side, their
    helpers beside them (`hopper_*.py`);
  * `reference.py`: the plain-jnp op every kernel is checked against;
  * `why_not(...)`: why a kernel cannot take these shapes, naming the fix (None when it can),
    and `check_shapes(...)`, which raises it as a ValueError; `jscale.validate` and the
    model's dispatch ask `why_not` before anything is traced.
"""
