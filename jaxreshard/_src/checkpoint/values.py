"""Values as people read them in a difference: numbers, with the bits where numbers hide them.

An integer or bool is its number. A float is the shortest decimal of its own
dtype (float32 and bfloat16 ``0.1``, never the float64 it widens to nor six
digits of it; it reads back as the same bits); ``-0.0`` and
``inf`` read as themselves. A NaN is ``nan(0x7fc00001)``: its bit pattern,
since NaNs of different payloads are different bits. When two different
values would still read the same, both get their bits, ``(0x...)``. Arrays
show their first ``SHOWN`` elements, then how many there are.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxreshard._src.exec import bitview as _bitview

__all__ = [
  "CLOCK_ELEMENTS_SHOWN",
  "SHOWN",
  "clock_text",
  "clock_value",
  "decode_scalar",
  "pair_text",
  "shortest",
  "type_text",
  "value_text",
]

SHOWN = 16


def shortest(x: np.ndarray) -> float:
  """A finite or infinite float element (0-d) as the float with the fewest significant
  digits that, converted to ``x``'s dtype, has ``x``'s bits.

  numpy's ``str`` is that for its own float types, but ml_dtypes' (bfloat16) gives
  six digits: bfloat16 0.9 is ``0.898438`` there, ``0.9`` here.
  """
  want = _bitview.bits(x).tobytes()
  v = float(x)
  if not np.isfinite(v):
    return v
  for digits in range(1, 18):
    c = float(f"{v:.{digits}g}")
    with np.errstate(over="ignore"):  # a candidate past the dtype's largest value
      cast = np.asarray(c).astype(x.dtype)
    if _bitview.bits(cast).tobytes() == want:
      return c
  return v  # float64 needs at most 17 digits: never reached


def _element(x: np.ndarray) -> str:
  """One element (a 0-d array) as text."""
  if jax.dtypes.issubdtype(x.dtype, np.floating):
    if np.isnan(x):
      return f"nan(0x{int(_bitview.bits(x)[0]):0{2 * x.dtype.itemsize}x})"
    return repr(shortest(x))
  if x.dtype == np.bool_:
    return str(bool(x))
  if x.dtype.kind in "iu":
    return str(int(x))
  return str(x[()])


def value_text(a: Any) -> str:
  """A value as text: a scalar as one number, an array as its first elements."""
  a = np.asarray(a)
  if a.ndim == 0:
    return _element(a)
  flat = a.reshape(-1)
  shown = [_element(flat[i : i + 1].reshape(())) for i in range(min(flat.size, SHOWN))]
  if flat.size <= SHOWN and a.ndim == 1:
    return f"[{', '.join(shown)}]"
  return f"[{', '.join(shown)}{', ...' if flat.size > SHOWN else ''}] ({a.size} elements of shape {a.shape})"


def _bits_text(a: np.ndarray) -> str:
  raw = _bitview.bits(a).tobytes().hex()
  if len(raw) > 4 * SHOWN:
    return f"0x{raw[: 4 * SHOWN]}... ({len(raw) // 2} bytes)"
  return f"0x{raw}"


def pair_text(a: Any, b: Any) -> str:
  """``a != b`` for two values whose bits differ; their bits too where the numbers read the same.

  Values of different dtypes or shapes name them: ``int32 8 != float32 8.0``.
  """
  a, b = np.asarray(a), np.asarray(b)
  ta, tb = value_text(a), value_text(b)
  if (a.dtype, a.shape) != (b.dtype, b.shape):
    return f"{type_text(a)} {ta} != {type_text(b)} {tb}"
  if ta == tb:
    ta, tb = f"{ta} ({_bits_text(a)})", f"{tb} ({_bits_text(b)})"
  return f"{ta} != {tb}"


def type_text(a: np.ndarray) -> str:
  """A value's dtype, and its shape unless it is 0-d: ``int32``, ``float32(3,)``."""
  return a.dtype.name + ("" if a.ndim == 0 else str(a.shape))


def decode_scalar(type_text: str, hexbits: str) -> np.ndarray | None:
  """A clock scalar back from a digest's ``("int32()", hex of its bits)``; None if unknown.

  A typed PRNG key's dtype (``key<fry>``) has no plain array to give back.
  """
  name, sep, shape_text = type_text.partition("(")
  if not sep:
    return None
  try:
    dtype = np.dtype(jax.numpy.dtype(name))
    shape = tuple(int(s) for s in shape_text.rstrip(")").split(",") if s.strip())
    return np.frombuffer(bytes.fromhex(hexbits), dtype).reshape(shape)
  except (TypeError, ValueError):
    return None


# A clock leaf is shown by its first elements only: an index may hold arrays of
# tens of thousands of elements as optimizer scalars, and no screen, message
# or JSON document is made better by all of them.
CLOCK_ELEMENTS_SHOWN = 16


def clock_value(a: np.ndarray) -> tuple[Any, bool]:
  """A clock scalar for reading, and whether it is cut to its first elements.

  A float is the shortest decimal of its own dtype: float32 0.9 is ``0.9``,
  not the float64 ``0.8999999761581421`` it widens to; parsing the decimal
  back at that dtype gives the same bits. JSON has no NaN or infinity: those
  are strings. An array of more than ``CLOCK_ELEMENTS_SHOWN`` elements gives
  its first ones, flat; work and memory never grow with its size.
  """
  cut = a.size > CLOCK_ELEMENTS_SHOWN
  if cut:
    a = a.reshape(-1)[:CLOCK_ELEMENTS_SHOWN]
  if not jax.dtypes.issubdtype(a.dtype, np.floating):
    return (a.item() if a.ndim == 0 else a.tolist()), cut

  def one(x: Any) -> Any:
    v = shortest(x)
    return v if np.isfinite(v) else str(v)

  values = [one(x) for x in a.reshape(-1)]
  if a.ndim == 0:
    return values[0], cut
  return np.array(values, object).reshape(a.shape).tolist(), cut


def clock_text(a: np.ndarray) -> str:
  """A clock scalar in a message or a table cell: its value, cut when long."""
  value, cut = clock_value(a)
  if not cut:
    return repr(value)
  return f"{repr(value)[:-1]}, ...] ({a.size} elements of shape {tuple(a.shape)})"
