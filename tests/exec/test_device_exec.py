"""The device executor: gather, pack and split against a numpy oracle, bit for bit.

The oracle is a loop of slice assignments into ``np.zeros``. Buffers hold
uniformly random bit patterns with NaN payloads (signalling and quiet), -0.0,
subnormals and infinities mixed in, and results are compared as unsigned
integers, never as floats. Program counts come from the executor's own cache
and from jax's backend-compile monitoring event.
"""

from __future__ import annotations

import contextlib
import math

import hypothesis.strategies as st
import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import jaxreshard as jr
from jaxreshard._src.exec import device as dx
from tests._core_util import (
  BF16,
  F16,
  F32,
  F64,
  assert_bits_equal,
  bits,
  count_xla_compiles,
  random_bits_array,
)

DTYPES = [F32, F16, BF16, F64]
SETTINGS = dict(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Quiet NaN, NaN with a payload and the sign set, two signalling NaNs, +inf,
# -inf, -0.0, the smallest positive and the largest negative subnormal, +0.0.
SPECIAL_BITS = {
  "float16": [0x7E00, 0xFE55, 0x7C01, 0x7DFF, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x83FF, 0],
  "bfloat16": [0x7FC0, 0xFFC1, 0x7F81, 0x7FBF, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F, 0],
  "float32": [
    0x7FC00000,
    0xFFC00123,
    0x7F800001,
    0x7FBFFFFF,
    0x7F800000,
    0xFF800000,
    0x80000000,
    0x00000001,
    0x807FFFFF,
    0,
  ],
  "float64": [
    0x7FF8000000000000,
    0xFFF8000000000123,
    0x7FF0000000000001,
    0x7FF7FFFFFFFFFFFF,
    0x7FF0000000000000,
    0xFFF0000000000000,
    0x8000000000000000,
    0x0000000000000001,
    0x800FFFFFFFFFFFFF,
    0,
  ],
}


def random_bits(rng: np.random.Generator, n: int, dtype) -> np.ndarray:
  """``n`` values of ``dtype``: random bits, about a third of them special patterns."""
  raw = bits(random_bits_array(rng, (n,), dtype))
  special = np.array(SPECIAL_BITS[np.dtype(dtype).name], raw.dtype)
  pick = rng.random(n) < 0.35
  raw[pick] = special[rng.integers(0, special.size, int(pick.sum()))]
  return raw.view(dtype)


def oracle(sources, src_index, src_start, dst_start, length, size, dtype) -> np.ndarray:
  out = np.zeros(size, dtype)
  for k, s, d, n in zip(src_index, src_start, dst_start, length):
    out[d : d + n] = sources[k][s : s + n]
  return out


def tables(*columns) -> tuple[np.ndarray, ...]:
  return tuple(np.asarray(c, np.int64).reshape(-1) for c in columns)


def random_runs(rng, src_sizes, size, max_runs):
  """Non-overlapping output runs (a random subset of a random cut of the
  output), each read from a random source that is long enough, plus a few
  zero-length runs, in random order."""
  cuts = np.unique(
    np.concatenate([[0, size], rng.integers(0, size + 1, rng.integers(0, max_runs))])
  )
  rows = []
  for a, b in zip(cuts[:-1], cuts[1:]):
    n = min(int(b - a), max(src_sizes))
    if rng.random() < 0.2 or n == 0:
      continue
    fits = [k for k, m in enumerate(src_sizes) if m >= n]
    k = int(rng.choice(fits))
    rows.append((k, int(rng.integers(0, src_sizes[k] - n + 1)), int(a), n))
  for _ in range(int(rng.integers(0, 4))):
    k = int(rng.integers(0, len(src_sizes)))
    rows.append((k, int(rng.integers(0, src_sizes[k] + 1)), int(rng.integers(0, size + 1)), 0))
  rng.shuffle(rows)
  return tables(*zip(*rows)) if rows else tables([], [], [], [])


def x64_context():
  """float64 needs x64: jax.experimental.enable_x64 where it exists, else the config state."""
  if hasattr(jax.experimental, "enable_x64"):
    return jax.experimental.enable_x64()
  return jax.enable_x64(True)


def dtype_context(dtype):
  return x64_context() if np.dtype(dtype).itemsize == 8 else contextlib.nullcontext()


@contextlib.contextmanager
def patched(**values):
  """Module constants of the executor replaced inside the block."""
  old = {name: getattr(dx, name) for name in values}
  for name, value in values.items():
    setattr(dx, name, value)
  try:
    yield
  finally:
    for name, value in old.items():
      setattr(dx, name, value)


# Fixed source and output sizes keep the hypothesis tests to a few programs.
SRC_SIZES = (97, 1, 256)
OUT_SIZE = 200


def _check_random_gather(dtype, n_sources, seed, max_runs):
  rng = np.random.default_rng(seed)
  src_sizes = SRC_SIZES[:n_sources]
  host = [random_bits(rng, m, dtype) for m in src_sizes]
  run_tables = random_runs(rng, src_sizes, OUT_SIZE, max_runs)
  out = dx.gather([jnp.asarray(x) for x in host], *run_tables, OUT_SIZE)
  assert_bits_equal(out, oracle(host, *run_tables, OUT_SIZE, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@settings(**SETTINGS)
@given(
  n_sources=st.integers(1, 3),
  seed=st.integers(0, 2**32 - 1),
  max_runs=st.sampled_from([1, 4, 12, 40]),
)
def test_gather_matches_oracle_bit_for_bit(dtype, n_sources, seed, max_runs):
  with dtype_context(dtype):
    _check_random_gather(dtype, n_sources, seed, max_runs)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  dtype=st.sampled_from([F32, BF16]), n_sources=st.integers(1, 3), seed=st.integers(0, 2**32 - 1)
)
def test_gather_cut_into_many_calls_matches_oracle(dtype, n_sources, seed):
  # Tiny caps: long runs are cut and the runs spread over many kernel calls.
  with patched(_MAX_RUNS_PER_CALL=3, _MAX_ELEMENTS_PER_CALL=7):
    _check_random_gather(dtype, n_sources, seed, 40)


@pytest.mark.slow
def test_special_values_survive_every_dtype():
  for dtype in DTYPES:
    with dtype_context(dtype):
      special = np.array(SPECIAL_BITS[np.dtype(dtype).name], f"u{dtype.itemsize}").view(dtype)
      n = special.size
      out = dx.gather([jnp.asarray(special)], *tables([0, 0], [n - 3, 0], [0, 3], [3, n - 3]), n)
      assert_bits_equal(out, np.concatenate([special[n - 3 :], special[: n - 3]]))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: d.name)
def test_program_count_does_not_grow_with_run_count(dtype):
  size = 4096
  rng = np.random.default_rng(7)
  host = random_bits(rng, size, dtype)
  src = jnp.asarray(host)
  dx.clear_kernel_cache()
  programs, layouts = [], []
  for n in (10, 100, 1000):
    # n parameters of a packed archive, laid out in another order in the output.
    cuts = np.sort(rng.choice(np.arange(1, size), n - 1, replace=False))
    src_start = np.concatenate([[0], cuts])
    length = np.diff(np.concatenate([src_start, [size]]))
    order = rng.permutation(n)
    dst_start = np.empty(n, np.int64)
    dst_start[order] = np.cumsum(length[order]) - length[order]
    layout = tables(np.zeros(n), src_start, dst_start, length)
    out = dx.gather([src], *layout, size)
    assert_bits_equal(out, oracle([host], *layout, size, dtype))
    programs.append(dx.kernel_cache_info().programs)
    layouts.append(layout)
  assert programs[-1] - programs[0] <= 2, programs
  assert programs[-1] <= 4, programs  # zeros + one gather program per run bucket
  info = dx.kernel_cache_info()
  with count_xla_compiles() as compiles:
    for layout in layouts:
      out = dx.gather([src], *layout, size)
  assert_bits_equal(out, oracle([host], *layouts[-1], size, dtype))
  assert dx.kernel_cache_info() == info, "a repeated layout must not trace a program"
  assert compiles["n"] == 0, f"{compiles['n']} XLA compilations on a repeated layout"


def test_many_outputs_of_one_layout_share_programs():
  # The same layout applied to many different parameters' worth of outputs
  # (mu and nu, repeated layers) compiles once.
  rng = np.random.default_rng(3)
  srcs = [jnp.asarray(random_bits(rng, 300, F32)) for _ in range(2)]
  layout = random_runs(rng, (300, 300), 256, 20)
  dx.gather(srcs, *layout, 256)
  info = dx.kernel_cache_info()
  for _ in range(5):
    srcs = [jnp.asarray(random_bits(rng, 300, F32)) for _ in range(2)]
    dx.gather(srcs, *layout, 256)
  assert dx.kernel_cache_info() == info


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_pack_split_round_trip(dtype):
  rng = np.random.default_rng(11)
  shapes = [(), (3,), (0,), (2, 5), (4, 1, 3), (1,), (17,)]
  with dtype_context(dtype):
    host = [random_bits(rng, math.prod(s), dtype).reshape(s) for s in shapes]
    leaves = [jnp.asarray(x) for x in host]
    flat = dx.pack(leaves)
    assert_bits_equal(flat, np.concatenate([x.reshape(-1) for x in host]))
    sizes = [x.size for x in host]
    pieces = dx.split(flat, sizes)
    assert len(pieces) == len(host)
    for piece, x in zip(pieces, host):
      assert_bits_equal(piece, x.reshape(-1))
    info = dx.kernel_cache_info()
    again = dx.pack([jnp.asarray(x) for x in host])
    dx.split(again, sizes)
    assert dx.kernel_cache_info() == info, "a repeated layout must not trace a program"
    # A prefix of the flat buffer; the rest is ignored.
    head = dx.split(flat, [2, 0, 4])
    assert_bits_equal(head[0], np.asarray(flat)[:2])
    assert head[1].shape == (0,)
    assert_bits_equal(head[2], np.asarray(flat)[2:6])


def test_gather_of_packed_sources_round_trips():
  rng = np.random.default_rng(5)
  host = [random_bits(rng, n, BF16) for n in (5, 0, 9)]
  flat = dx.pack([jnp.asarray(x) for x in host])
  # The packed leaves in reverse order, then split back.
  n0, n2 = 5, 9
  out = dx.gather([flat], *tables([0, 0], [n0, 0], [0, n2], [n2, n0]), n0 + n2 + 2)
  a, b, pad = dx.split(out, [n2, n0, 2])
  assert_bits_equal(a, host[2])
  assert_bits_equal(b, host[0])
  assert not bits(pad).any()


def test_empty_run_table_gives_zeros():
  src = jnp.asarray(random_bits(np.random.default_rng(0), 10, BF16))
  out = dx.gather([src], *tables([], [], [], []), 33)
  assert_bits_equal(out, np.zeros(33, BF16))


def test_zero_length_runs_only_give_zeros():
  src = jnp.asarray(random_bits(np.random.default_rng(0), 10, F32))
  out = dx.gather([src], *tables([0, 0, 0], [0, 10, 4], [0, 33, 7], [0, 0, 0]), 33)
  assert_bits_equal(out, np.zeros(33, F32))


def test_zero_size_output():
  src = jnp.asarray(random_bits(np.random.default_rng(0), 10, F16))
  out = dx.gather([src], *tables([], [], [], []), 0)
  assert out.shape == (0,) and out.dtype == F16
  out = dx.gather([src], *tables([0], [3], [0], [0]), 0)
  assert out.shape == (0,) and out.dtype == F16


def test_runs_at_the_very_end_of_output_and_source():
  rng = np.random.default_rng(1)
  host = [random_bits(rng, 8, F32), random_bits(rng, 5, F32)]
  layout = tables([1, 0, 1], [0, 5, 4], [16, 19, 0], [3, 3, 1])  # 19 + 3 == size, 5 + 3 == 8
  out = dx.gather([jnp.asarray(x) for x in host], *layout, 22)
  assert_bits_equal(out, oracle(host, *layout, 22, F32))
  # One run that is the whole output.
  out = dx.gather([jnp.asarray(host[0])], *tables([0], [0], [0], [8]), 8)
  assert_bits_equal(out, host[0])


def test_int64_offsets():
  # A lowered int32 limit stands in for a buffer past 2**31 - 1 elements.
  rng = np.random.default_rng(2)
  host = [random_bits(rng, 300, F32)]
  layout = random_runs(rng, (300,), 200, 12)
  with patched(_INT32_MAX=150):
    with x64_context():
      out = dx.gather([jnp.asarray(host[0])], *layout, 200)
      assert_bits_equal(out, oracle(host, *layout, 200, F32))
      assert dx._index_dtype(300) == np.int64  # the offsets past the limit are int64
    # A ShapeError (it was a bare ValueError) that says both ways out.
    with pytest.raises(jr.ShapeError, match="enable it, or pass executor='host'"):
      dx.gather([jnp.asarray(host[0])], *layout, 200)


def test_output_stays_on_the_sources_device():
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip("needs two devices")
  device = devices[-1]
  rng = np.random.default_rng(4)
  host = [random_bits(rng, 40, BF16), random_bits(rng, 9, BF16)]
  srcs = [jax.device_put(x, device) for x in host]
  layout = random_runs(rng, (40, 9), 30, 8)
  out = dx.gather(srcs, *layout, 30)
  assert out.devices() == {device}
  assert_bits_equal(out, oracle(host, *layout, 30, BF16))
  flat = dx.pack(srcs)
  assert flat.devices() == {device}
  assert all(p.devices() == {device} for p in dx.split(flat, [40, 9]))
  with pytest.raises(ValueError, match="one device"):
    dx.gather([srcs[0], jax.device_put(host[1], devices[0])], *layout, 30)


def test_refusals():
  src = jnp.zeros(10, jnp.float32)
  with pytest.raises(ValueError, match="overlap"):
    dx.gather([src], *tables([0, 0], [0, 0], [0, 2], [3, 3]), 10)
  with pytest.raises(ValueError, match="outside source"):
    dx.gather([src], *tables([0], [8], [0], [3]), 10)
  with pytest.raises(ValueError, match="outside the output"):
    dx.gather([src], *tables([0], [0], [9], [2]), 10)
  with pytest.raises(ValueError, match="source index"):
    dx.gather([src], *tables([1], [0], [0], [2]), 10)
  with pytest.raises(ValueError, match="different lengths"):
    dx.gather([src], *tables([0], [0], [0, 1], [2]), 10)
  with pytest.raises(ValueError, match="negative run length"):
    dx.gather([src], *tables([0], [0], [0], [-1]), 10)
  with pytest.raises(ValueError, match="one dtype"):
    dx.gather([src, jnp.zeros(3, jnp.float16)], *tables([], [], [], []), 10)
  with pytest.raises(ValueError, match="no sources"):
    dx.gather([], *tables([], [], [], []), 10)
  with pytest.raises(ValueError, match="no leaves"):
    dx.pack([])
  with pytest.raises(ValueError, match="sizes sum"):
    dx.split(src, [6, 5])
  with pytest.raises(ValueError, match="1-D"):
    dx.split(jnp.zeros((2, 2)), [1])
  with pytest.raises(ValueError, match=r"split: negative size in \(3, -1\)"):
    dx.split(src, [3, -1])
  with pytest.raises(ValueError, match=r"gather: source 1 must be 1-D, got shape \(2, 2\)"):
    dx.gather([src, jnp.zeros((2, 2))], *tables([], [], [], []), 10)
  with pytest.raises(ValueError, match="gather: negative output size -1"):
    dx.gather([src], *tables([], [], [], []), -1)
  with pytest.raises(ValueError, match="nonzero_runs: no sources"):
    dx.nonzero_runs([], *tables([], [], []))
  with pytest.raises(TypeError, match="gather: expected jax.Array, got ndarray"):
    dx.gather([np.zeros(10, np.float32)], *tables([], [], [], []), 10)
  with x64_context():  # complex128 exists with x64 only; no unsigned type is 16 bytes wide
    with pytest.raises(ValueError, match="pack: unsupported dtype complex128"):
      dx.pack([jnp.zeros(3, jnp.complex128)])


def test_clear_device_cache():
  dx.gather([jnp.zeros(4, jnp.float32)], *tables([0], [0], [0], [4]), 4)
  assert dx.kernel_cache_info().programs > 0
  dx.clear_kernel_cache()
  assert dx.kernel_cache_info() == (0, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_pack_split_keep_special_values_and_one_program_each(dtype, monkeypatch):
  # Signalling NaNs, -0.0 and subnormals through pack and split, 300 leaves in
  # programs (the staging bound raised past them): one pack program and one
  # split program, whatever the leaf count.
  monkeypatch.setattr(dx, "STAGE_ABOVE", 1000)
  with dtype_context(dtype):
    special = np.array(SPECIAL_BITS[np.dtype(dtype).name], f"u{dtype.itemsize}").view(dtype)
    rng = np.random.default_rng(9)
    host = [special[rng.integers(0, special.size, int(n))] for n in rng.integers(0, 5, 300)]
    dx.clear_kernel_cache()
    flat = dx.pack([jnp.asarray(x) for x in host])
    assert_bits_equal(flat, np.concatenate(host))
    pieces = dx.split(flat, [x.size for x in host])
    for piece, x in zip(pieces, host):
      assert_bits_equal(piece, x)
    assert dx.kernel_cache_info() == (2, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_staged_pack_split_keep_every_bit_and_compile_nothing(dtype):
  # Past ``STAGE_ABOVE`` leaves, packs and splits go through host memory: the same
  # bits (special values, scalars, empty leaves, several shapes), on the leaves'
  # own device, and no program traced or compiled by XLA.
  with dtype_context(dtype):
    rng = np.random.default_rng(13)
    shapes = [(), (0,), (2, 3), (1,), (4, 1, 2)] + [(int(n),) for n in rng.integers(0, 9, 400)]
    assert len(shapes) > dx.STAGE_ABOVE
    host = [random_bits(rng, math.prod(s), dtype).reshape(s) for s in shapes]
    leaves = [jnp.asarray(x) for x in host]
    dx.clear_kernel_cache()
    with count_xla_compiles() as compiles:
      flat = dx.pack(leaves)
      pieces = dx.split(flat, [x.size for x in host])
    assert compiles["n"] == 0 and dx.kernel_cache_info() == (0, 0)
    assert flat.dtype == dtype and flat.devices() == leaves[0].devices()
    assert_bits_equal(flat, np.concatenate([x.reshape(-1) for x in host]))
    assert len(pieces) == len(host)
    for piece, x in zip(pieces, host):
      assert piece.shape == (x.size,) and piece.dtype == dtype
      assert piece.devices() == flat.devices()
      assert_bits_equal(piece, x.reshape(-1))
    # A prefix of the flat buffer; the rest is ignored, as the program's split does.
    sizes = [1] * (dx.STAGE_ABOVE + 1)
    head = dx.split(flat, sizes)
    for k, piece in enumerate(head):  # compared on the host: a jax op may quiet a bf16 NaN
      assert_bits_equal(piece, np.asarray(flat)[k : k + 1])


def test_staging_keeps_programs_for_dtypes_device_put_would_narrow():
  # With x64 off, jax.device_put turns a 64-bit numpy array into a 32-bit one:
  # such dtypes never go through host memory, whatever the leaf count.
  many = dx.STAGE_ABOVE + 1
  assert not jax.config.jax_enable_x64
  for name in ("float64", "int64", "uint64"):
    assert not dx._staged(many, np.dtype(name)), name
  for dtype in (F32, F16, BF16, np.dtype("uint8")):
    assert dx._staged(many, np.dtype(dtype)) and not dx._staged(dx.STAGE_ABOVE, np.dtype(dtype))
  with x64_context():
    assert dx._staged(many, np.dtype("float64"))
