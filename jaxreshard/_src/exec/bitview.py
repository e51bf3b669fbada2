"""Arrays as their bit patterns: how every exact comparison and copy sees values.

Copying and comparing unsigned integers of a value's width keeps NaN payloads,
-0.0, infinities and subnormals exactly; no float arithmetic ever touches them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["UINT", "bits"]

# The unsigned integer type of each value width, in bytes.
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x: Any) -> np.ndarray:
  """The flat bit patterns of an array as unsigned integers of its width.

  A view (no copy) of a contiguous numpy array; a value of a width without an
  unsigned type (complex128) comes back flat and unchanged.
  """
  a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
  uint = UINT.get(a.dtype.itemsize)
  return a if uint is None else a.view(uint)
