"""Hugging Face interop: `load_hf` / `save_hf`, and the `python -m jscale.convert` CLI."""

from jscale.convert.hf_config import config_from_hf, config_to_hf
from jscale.convert.hf_io import load_hf, save_hf

__all__ = ["load_hf", "save_hf", "config_from_hf", "config_to_hf"]
