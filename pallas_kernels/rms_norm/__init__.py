"""Fused RMSNorm (+ residual add) Pallas GPU kernels, with a plain-jnp reference.

`rms_norm` is the portable kernel (Triton-lowered; runs in the Pallas interpreter);
`pallas_kernels.rms_norm.hopper.rms_norm` the Mosaic GPU one for Hopper (same contract).

`triton_kernel` (the same op through jax-triton) is not imported here: it needs the `triton`
extra and a GPU; import `pallas_kernels.rms_norm.triton_kernel` explicitly.
"""

from pallas_kernels.rms_norm.kernel import BlockSizes, check_shapes, rms_norm, why_not
from pallas_kernels.rms_norm.reference import reference

__all__ = ["BlockSizes", "check_shapes", "reference", "rms_norm", "why_not"]
