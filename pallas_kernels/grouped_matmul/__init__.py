"""Grouped (ragged) matmul Pallas kernels for Hopper GPUs (Mosaic GPU), with references."""

from pallas_kernels.grouped_matmul.hopper import check_shapes, grouped_matmul, why_not
from pallas_kernels.grouped_matmul.hopper_config import DEFAULT, GmmBlocks
from pallas_kernels.grouped_matmul.reference import loop_reference, reference

__all__ = ["DEFAULT", "GmmBlocks", "check_shapes", "grouped_matmul", "loop_reference",
           "reference", "why_not"]
