"""Jitted gather kernels that build flat target buffers from source slices.

A target buffer is the concatenation of the overlapping slices of a few source
buffers, followed by zero padding. The kernels do exactly that and nothing
else: every slice is a ``lax.dynamic_slice`` of a source reinterpreted as
unsigned integers (so NaN payloads, -0.0 and subnormals cannot be touched by
any float arithmetic), concatenated with zeros and reinterpreted back.

Compilation is the cost that matters: XLA compiles each program once per
distinct *signature*, and a signature here holds only lengths and shapes.
Slice *offsets* are runtime arguments, so ranks whose slices have the same
lengths (all interior ranks of a parameter in an even split, the same layout on
every restart) share one program. Buffers are *bucketed*: outputs with the
same signature (dtype, shape, slice lengths: mu and nu of a parameter, the
repeated layers of a model) are cut into homogeneous buckets of
``REPEAT_SIZE`` that share one program; the others are fused ``BUCKET_SIZE``
to a program. So the number of compiled programs grows with the number of
*distinct* buckets, not with the number of buffers, and a repeated layout
compiles nothing.

Bit exactness on every backend: XLA:CPU has no bfloat16 arithmetic and
rewrites a same-width bitcast *into* bfloat16 through float32 (quieting
signalling NaNs, flushing subnormals). A bitcast between bfloat16 and bytes
(``uint8[..., 2]``) is left alone, so bfloat16 buffers are moved as byte pairs;
the other dtypes as same-width unsigned integers.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, NamedTuple, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Piece", "Output", "assemble", "kernel_cache_info", "clear_kernel_cache", "BUCKET_SIZE"]

BUCKET_SIZE = 32
REPEAT_SIZE = 8
_INT32_MAX = 2**31 - 1
# The kernels only move bits, so XLA's optimizations buy nothing at run time,
# and on XLA:CPU compilation dominates a cold run. Measured on the 200-parameter
# test (one target rank, 13 programs): default options ~7.4 s, backend level 0
# ~4.5 s, plus the classic (non-"fusion emitter") CPU codegen ~1.8 s.
# tests/test_properties.py::test_special_values_survive_every_path guards that
# this stays bit exact (it does, with the byte-pair bfloat16 path below). Other
# backends compile with their defaults.
_CPU_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_cpu_use_fusion_emitters": False,
}


def _compiler_options() -> dict[str, Any]:
  return dict(_CPU_COMPILER_OPTIONS) if jax.default_backend() == "cpu" else {}


_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@dataclasses.dataclass(frozen=True, eq=False)
class Piece:
  """``source.reshape(-1)[start:start + length]``; ``source`` is any array."""

  source: Any
  start: int
  length: int


@dataclasses.dataclass(frozen=True, eq=False)
class Output:
  """A target buffer: ``pieces`` concatenated, zero-padded to ``size(shape)``."""

  shape: tuple[int, ...]
  dtype: Any
  pieces: tuple[Piece, ...]


class KernelCacheInfo(NamedTuple):
  programs: int  # distinct compiled kernel programs held in the cache
  traces: int  # times any kernel was traced (== compiled) since the cache was cleared


class _Cache:

  def __init__(self):
    self.lock = threading.Lock()
    self.programs: dict[Any, Any] = {}
    self.traces = 0


_CACHE = _Cache()


def kernel_cache_info() -> KernelCacheInfo:
  """Programs held and traces done by the kernel cache (for tests and benchmarks).

  Examples:
    >>> info = kernel_cache_info()
    >>> info.programs >= 0 and info.traces >= 0
    True
  """
  return KernelCacheInfo(len(_CACHE.programs), _CACHE.traces)


def clear_kernel_cache() -> None:
  """Drops every compiled kernel (the next call compiles afresh)."""
  with _CACHE.lock:
    _CACHE.programs.clear()
    _CACHE.traces = 0


def _bits_dtype(dtype: Any) -> Any:
  dtype = np.dtype(dtype)
  return jnp.uint8 if dtype.name == "bfloat16" else _UINT_OF_WIDTH[dtype.itemsize]


def _bits_tail(dtype: Any) -> tuple[int, ...]:
  return (2,) if np.dtype(dtype).name == "bfloat16" else ()


def _to_bits(x: jax.Array) -> jax.Array:
  """A flat unsigned view of ``x``: ``(n,)``, or ``(n, 2)`` bytes for bfloat16."""
  bits = lax.bitcast_convert_type(x, _bits_dtype(x.dtype))
  return bits.reshape((-1,) + _bits_tail(x.dtype))


def _from_bits(bits: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
  return lax.bitcast_convert_type(bits.reshape(tuple(shape) + _bits_tail(dtype)), dtype)


def _make_kernel(signature):
  out_specs, in_specs, static_starts = signature

  def kernel(inputs, starts):
    with _CACHE.lock:
      _CACHE.traces += 1
    chex.assert_equal(len(inputs), len(in_specs))
    flat = []
    for x, (shape, dtype, _) in zip(inputs, in_specs):
      chex.assert_shape(x, shape)
      chex.assert_type(x, dtype)
      flat.append(_to_bits(x))
    outs, j = [], 0
    for shape, dtype, pieces in out_specs:
      size = int(np.prod(shape, dtype=np.int64))
      parts = []
      for index, length in pieces:
        src = flat[index]
        chex.assert_equal(src.shape[1:], _bits_tail(dtype))  # same width in, same width out
        if static_starts is not None:  # offsets past int32: compiled-in static slices
          start = static_starts[j]
          parts.append(lax.slice_in_dim(src, start, start + length))
        else:
          parts.append(lax.dynamic_slice_in_dim(src, starts[j], length))
        j += 1
      used = sum(length for _, length in pieces)
      if size > used or not parts:
        parts.append(jnp.zeros((size - used,) + _bits_tail(dtype), _bits_dtype(dtype)))
      buf = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
      chex.assert_shape(buf, (size,) + _bits_tail(dtype))
      outs.append(_from_bits(buf, shape, dtype))
    return outs

  return jax.jit(kernel, compiler_options=_compiler_options())


def _run_bucket(outputs: Sequence[Output]) -> list[jax.Array]:
  inputs, index_of = [], {}
  out_specs, starts = [], []
  for out in outputs:
    pieces = []
    for piece in out.pieces:
      if piece.length == 0:
        continue
      key = id(piece.source)
      if key not in index_of:
        index_of[key] = len(inputs)
        inputs.append(piece.source)
      pieces.append((index_of[key], int(piece.length)))
      starts.append(int(piece.start))
    out_specs.append((tuple(out.shape), np.dtype(out.dtype), tuple(pieces)))
  in_specs = tuple(
      (tuple(np.shape(x)), np.dtype(x.dtype), bool(getattr(x, "weak_type", False))) for x in inputs
  )
  # Offsets beyond int32 (a >2**31-element shard) are compiled in instead.
  static = tuple(starts) if starts and max(starts) > _INT32_MAX else None
  signature = (tuple(out_specs), in_specs, static)
  with _CACHE.lock:
    fn = _CACHE.programs.get(signature)
    if fn is None:
      fn = _CACHE.programs[signature] = _make_kernel(signature)
  dyn = np.asarray(starts if static is None else [], dtype=np.int32)
  return fn(_on_one_device(inputs), dyn)


def _on_one_device(inputs: list[Any]) -> list[Any]:
  """Sources committed to different devices (each rank's archive restored onto
  its own device) cannot feed one jitted program: gather them on the default
  device. Sources on a single device stay there (GPU/TPU arrays stay put)."""
  devices = {d for x in inputs if isinstance(x, jax.Array) for d in x.devices()}
  if len(devices) <= 1:
    return inputs
  target = jax.config.jax_default_device
  if target is None or isinstance(target, str):
    target = jax.devices(target)[0]
  return [jax.device_put(x, target) if isinstance(x, jax.Array) else x for x in inputs]


def assemble(outputs: Sequence[Output]) -> list[jax.Array]:
  """Builds every output buffer with bucketed jitted kernels, in order.

  Args:
    outputs: target buffers; each piece's ``source`` is a jax or numpy array
      whose flattened ``[start, start + length)`` is copied in order.

  Returns:
    One array per output on the default device (or the sources' device), with
    the output's shape and dtype, bit-identical to the slices it was built from
    and zero elsewhere.
  """
  results: list[Any] = [None] * len(outputs)
  for chunk in _buckets(outputs):
    for i, out in zip(chunk, _run_bucket([outputs[i] for i in chunk])):
      results[i] = out
  return results


def _buckets(outputs: Sequence[Output]) -> list[list[int]]:
  """Groups output indices into fused programs.

  Outputs with an identical signature (the repeated layers of a model, mu and
  nu of one parameter), when there are at least ``REPEAT_SIZE`` of them, go
  into homogeneous buckets of ``REPEAT_SIZE``: one small program is compiled
  and called once per bucket. The rest are fused in
  order, ``BUCKET_SIZE`` per program.
  """
  groups: dict[Any, list[int]] = {}
  for i, out in enumerate(outputs):
    groups.setdefault(_output_key(out), []).append(i)
  buckets, rest = [], []
  for members in groups.values():
    full = len(members) - len(members) % REPEAT_SIZE
    buckets.extend(members[k:k + REPEAT_SIZE] for k in range(0, full, REPEAT_SIZE))
    rest.extend(members[full:])
  rest.sort()
  buckets.extend(rest[k:k + BUCKET_SIZE] for k in range(0, len(rest), BUCKET_SIZE))
  return buckets


def _output_key(out: Output) -> tuple[Any, ...]:
  return (np.dtype(out.dtype).name, tuple(out.shape),
          tuple((p.length, tuple(np.shape(p.source)), np.dtype(p.source.dtype).name)
                for p in out.pieces if p.length))
