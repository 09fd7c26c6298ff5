"""Flash attention Pallas GPU kernels (forward + backward), with a plain-jnp reference."""

from pallas_kernels.flash_attention.kernel import flash_attention
from pallas_kernels.flash_attention.kernel_config import BlockSizes, check_shapes, why_not
from pallas_kernels.flash_attention.reference import reference

__all__ = ["BlockSizes", "check_shapes", "flash_attention", "reference", "why_not"]
