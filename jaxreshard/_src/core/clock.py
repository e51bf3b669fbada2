"""How a clock scalar (step count, injected hyper-parameter) is handed back.

One rule for every read path (the host restore, the mesh paths, a target
sharding): a Python number stays a Python number (it has no dtype to keep and
no placement), a value whose dtype jax cannot hold (``float64``, ``int64`` and
``uint64`` while ``jax_enable_x64`` is off) stays a numpy value with every bit,
and anything else becomes a jax array. jax would silently cut a 64-bit value
to 32 bits (``2**40 + 3`` to ``3``, a float64 NaN payload to another one).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["is_python_number", "python_dtype", "stays_on_host"]


def is_python_number(x: Any) -> bool:
  """A plain Python ``bool``/``int``/``float``/``complex`` (not a numpy scalar)."""
  return isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic)


def python_dtype(x: Any) -> np.dtype:
  """The dtype jax gives a Python number (``int`` is int32 while x64 is off), any value."""
  return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(type(x))))


def stays_on_host(x: Any) -> bool:
  """Whether a clock scalar is handed back as it is rather than as a jax array.

  Examples:
    >>> import numpy as np
    >>> stays_on_host(3), stays_on_host(np.float32(1.0))
    (True, False)
    >>> import jax
    >>> stays_on_host(np.int64(2**40 + 3)) == (not jax.config.jax_enable_x64)
    True
  """
  if is_python_number(x):
    return True
  dtype = getattr(x, "dtype", None)
  if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return False
  return np.dtype(jax.dtypes.canonicalize_dtype(dtype)) != np.dtype(dtype)
