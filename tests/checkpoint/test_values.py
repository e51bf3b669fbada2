"""How values read: the shortest decimal of a float's own dtype, checked against the bits."""

import warnings

import ml_dtypes
import numpy as np
import pytest

from jaxreshard._src.checkpoint import values

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_shortest_reads_back_as_the_same_bits_with_no_more_digits_than_needed(dtype):
  info = ml_dtypes.finfo(dtype)
  special = [0.9, 0.1, 1 / 3, -0.0, 1.0, float(info.max), -float(info.max), float(info.tiny)]
  special.append(float(info.smallest_subnormal))
  rng = np.random.default_rng(0)
  uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
  random = rng.integers(0, np.iinfo(uint).max, 2000, dtype=uint, endpoint=True).view(dtype)
  xs = np.concatenate([np.asarray(special, np.float64).astype(dtype), random])
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no overflow warning from candidates past the max
    for x in xs:
      x = np.asarray(x)
      if not np.isfinite(float(x)):
        continue
      v = values.shortest(x)
      assert np.asarray(v).astype(dtype).tobytes() == x.tobytes(), (x, v)
      # One digit fewer never gives these bits back.
      digits = len(repr(abs(v)).split("e")[0].replace(".", "").strip("0"))
      if digits > 1:
        shorter = float(f"{v:.{digits - 1}g}")
        with np.errstate(over="ignore"):
          assert np.asarray(shorter).astype(dtype).tobytes() != x.tobytes(), (x, v, shorter)
  assert values.shortest(np.asarray(0.9, ml_dtypes.bfloat16)) == 0.9
