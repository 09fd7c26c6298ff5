"""Grouped (ragged) matmul Pallas kernels for Hopper GPUs (Mosaic GPU), with references."""

from pallas_kernels.grouped_matmul.hopper import (
           check_shapes,
           fp8_matmul,
           grouped_matmul,
           weight_gradient,
           why_not,
)
from pallas_kernels.grouped_matmul.hopper_config import DEFAULT, DEFAULT_FP8, GmmBlocks
from pallas_kernels.grouped_matmul.reference import loop_reference, reference

__all__ = ["DEFAULT", "DEFAULT_FP8", "GmmBlocks", "check_shapes", "fp8_matmul",
           "grouped_matmul", "loop_reference", "reference", "weight_gradient", "why_not"]
