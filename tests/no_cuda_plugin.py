"""`python tests/no_cuda_plugin.py MODULE ARGS...`: runs `python -m MODULE ARGS...` as on an
install without JAX's CUDA plugin (the `gpu-compile` extra): importing the plugin is refused,
as it is where the wheel is absent (JAX still finds the installed wheel's entry point and logs
one warning that a true uninstall would not)."""

import importlib.abc
import runpy
import sys


class _NoCudaPlugin(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.startswith("jax_plugins.xla_cuda"):
      raise ModuleNotFoundError(f"No module named {name!r}")
    return None


sys.meta_path.insert(0, _NoCudaPlugin())
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
