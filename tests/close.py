"""Shared by the kernel tests: closeness relative to the reference's scale."""

import numpy as np


def assert_close(name, got, want, tol):
  """|got - want| <= tol * max|want| elementwise (plus rtol), printing the measured error."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = float(np.max(np.abs(want)))
  err = float(np.max(np.abs(got - want)))
  print(f"{name}: max abs err {err:.3g} (ref max abs {scale:.3g}, rel {err / scale:.3g})")
  np.testing.assert_allclose(got, want, atol=tol * scale, rtol=tol, err_msg=name)
