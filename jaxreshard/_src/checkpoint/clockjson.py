"""The optimizer clock's scalars in a checkpoint's JSON: one object per scalar.

A scalar keeps its dtype, shape, weak type and bits (as base64 of its bytes);
a Python number keeps its type (a float as ``float.hex``); a typed PRNG key
keeps its implementation and its uint32 key data. Decoding is as strict as the
rest of the format (``encoding``): nothing from the file is executed, and every
size is bounded before anything is allocated.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import jax
import numpy as np

from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.errors import ArchiveError, ReshardError

__all__ = ["decode_scalar", "encode_scalar"]


def encode_scalar(x: Any, where: str) -> dict:
  why = _clock.unstorable(x)
  if why is not None:
    raise ReshardError(f"{where}: cannot store {why}")
  if _clock.is_python_number(x):
    kind = type(x).__name__
    return {"py": kind, "v": x.hex() if kind == "float" else x}
  if _clock.is_key(x):  # a typed PRNG key: its implementation and its key data
    impl = str(jax.random.key_impl(x))
    return {"key": impl, **encode_scalar(jax.random.key_data(x), where)}
  a = np.asarray(x)
  why = _clock.unstorable(a)  # what numpy made of it, when ``x`` only said its dtype
  if why is not None:
    raise ReshardError(f"{where}: cannot store {why}")
  return {
    "dtype": a.dtype.name,
    "shape": list(a.shape),
    "weak": bool(getattr(x, "weak_type", False)),
    "bytes": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii"),
  }


def decode_scalar(d: Any, where: str) -> Any:
  fmt.expect(d, dict, where)
  if "py" in d and "key" in d:
    raise ArchiveError(f"{where}: a scalar is either a Python number or a PRNG key")
  if "py" in d:
    kind, v = d.get("py"), d.get("v")
    if kind == "bool" and isinstance(v, bool):
      return v
    if kind == "int" and isinstance(v, int) and not isinstance(v, bool) and (-(2**63) <= v < 2**63):
      return v
    if kind == "float" and isinstance(v, str) and len(v) < 64:
      try:
        return float.fromhex(v)
      except (ValueError, OverflowError):
        pass
    raise ArchiveError(f"{where}: invalid Python scalar {fmt.short(d)}")
  if "key" in d:
    impl = d["key"]
    if impl not in _clock.KEY_IMPLS:  # the implementations a checkpoint may name
      raise ArchiveError(f"{where}: PRNG key implementation {fmt.short(impl)} is not one jax has")
    data = decode_scalar({k: v for k, v in d.items() if k != "key"}, where)
    if not (isinstance(data, np.ndarray | jax.Array) and data.dtype == np.uint32):
      # Every key implementation's data is uint32; device_put would cut wider words.
      raise ArchiveError(f"{where}: {impl} key data must be uint32 words")
    try:
      return jax.random.wrap_key_data(jax.device_put(data), impl=impl)
    except (TypeError, ValueError) as e:
      raise ArchiveError(f"{where}: invalid {impl} key data: {e}") from None
  if set(d) != {"dtype", "shape", "weak", "bytes"}:
    raise ArchiveError(f"{where}: scalar keys {sorted(d)} are not a scalar")
  dtype = fmt.np_dtype(d["dtype"], where)
  shape = fmt.shape_of(d["shape"], where)
  # An empty scalar is bounded as if its zero dimensions were ones: (2**29, 2**29, 0)
  # holds no bytes, yet listing it for display builds 2**58 lists.
  if math.prod(n or 1 for n in shape) * dtype.itemsize > fmt.MAX_SCALAR_BYTES:
    raise ArchiveError(f"{where}: scalar of shape {fmt.short(shape)} is larger than a clock's")
  nbytes = math.prod(shape) * dtype.itemsize
  data = fmt.expect(d["bytes"], str, where)
  if nbytes > fmt.MAX_SCALAR_BYTES or len(data) != 4 * ((nbytes + 2) // 3):
    raise ArchiveError(f"{where}: scalar of shape {shape} does not match its {len(data)} bytes")
  try:
    raw = base64.b64decode(data, validate=True)
  except ValueError:
    raise ArchiveError(f"{where}: scalar bytes are not base64") from None
  if len(raw) != nbytes:  # base64 padding can shorten what the text's length allows
    raise ArchiveError(
      f"{where}: scalar of shape {shape} and dtype {dtype.name} needs"
      f" {nbytes} bytes, not {len(raw)}"
    )
  a = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
  weak = fmt.expect(d["weak"], bool, where)
  if _clock.stays_on_host(a):
    # A 64-bit scalar while x64 is off: jax would cut it to 32 bits, so it stays
    # a numpy scalar with every bit (one that says it is weak, when it was).
    return a.view(_clock.WeakHostScalar) if weak else a
  # ``device_put``, not ``jnp.asarray``: that compiles a program per dtype (~80 ms).
  if weak and a.ndim == 0:
    # A weak-typed scalar (from a Python number) is rebuilt as one; only when
    # the round trip is exact, otherwise the strong scalar is the safe answer.
    rebuilt = jax.device_put(a.item())
    if rebuilt.dtype == a.dtype and np.asarray(rebuilt).tobytes() == a.tobytes():
      return rebuilt
  return jax.device_put(a)
