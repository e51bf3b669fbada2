"""The gather kernels: compiled once per layout, bucketed, reading only overlaps.

Compile counts come from two independent counters: jaxreshard's own
``kernel_cache_info().traces`` and jax's backend-compile monitoring event
(every XLA compilation in the process, whoever asked for it).
"""

import contextlib
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard import _kernels
from tests._core_util import (
    BF16, F16, F32, assert_bits_equal, assert_trees_bit_equal, oracle_shard, special_values,
)

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_xla_compiles():
  """Counts XLA backend compilations inside the block (jax.monitoring)."""
  counter = {"n": 0}

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == _BACKEND_COMPILE:
      counter["n"] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counter
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


CYCLIC = [(17,), (64, 3), (5, 7), (128,), (3, 3, 3), (1,), (), (250,)]


def _adam_records(n_params, world, seed=0, distinct=False):
  """A full Adam state of ``n_params`` parameters, sharded.

  Shapes repeat in a cycle of 8 (a model of repeated layers) or, with
  ``distinct``, every parameter has its own size (the worst case for reuse).
  """
  rng = np.random.default_rng(seed)
  # Distinct sizes are multiples of 8 so that shard_state (8 ranks, the setup,
  # not what is measured) compiles one set of programs for all its ranks.
  shape = lambda i: (8 * (i + 1),) if distinct else CYCLIC[i % len(CYCLIC)]
  params = {f"layer{i:03d}": jnp.zeros(shape(i), jnp.float32) for i in range(n_params)}
  opt = optax.adam(1e-3)
  adam, rest = opt.init(params)
  fill = lambda t: jax.tree.map(
      lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)), t)
  state = (adam._replace(mu=fill(adam.mu), nu=fill(adam.nu)), rest)
  return jr.shard_state(opt, params, state, world), state


def test_second_reshard_of_the_same_layout_compiles_nothing():
  records, _ = _adam_records(40, 8)
  # Same layout, different values: a restart from a later checkpoint.
  later, _ = _adam_records(40, 8, seed=1)
  migrations = jr.plan(records, world_size=6, rank=3)
  jr.clear_kernel_cache()
  first = jr.reshard(records, migrations)
  info = jr.kernel_cache_info()
  assert info.traces > 0 and info.programs > 0
  with count_xla_compiles() as compiles:
    second = jr.reshard(later, jr.plan(later, world_size=6, rank=3))
    again = jr.reshard(records, migrations)
  assert jr.kernel_cache_info() == info, "a repeated layout must not trace a kernel"
  assert compiles["n"] == 0, f"{compiles['n']} XLA compilations on a repeated layout"
  assert_bits_equal(again.state[0].mu["layer003"], first.state[0].mu["layer003"])
  # ... and the second result really holds the new values.
  assert not np.array_equal(np.asarray(second.state[0].mu["layer003"]),
                            np.asarray(first.state[0].mu["layer003"]))


@pytest.mark.parametrize("distinct", [False, True], ids=["cyclic_shapes", "distinct_shapes"])
def test_compiled_programs_for_200_parameter_adam_state(distinct):
  n_params, src, dst = 200, 8, 6
  records, state = _adam_records(n_params, src, distinct=distinct)
  n_buffers = 2 * n_params  # mu and nu
  buckets = math.ceil(n_buffers / _kernels.BUCKET_SIZE)
  kind = "distinct" if distinct else "cyclic"

  jr.clear_kernel_cache()
  t0 = time.perf_counter()
  with count_xla_compiles() as compiles:
    target = jr.reshard(records, jr.plan(records, world_size=dst, rank=2))
  seconds = time.perf_counter() - t0
  one = jr.kernel_cache_info()
  print(f"\n200-parameter Adam state ({n_buffers} buffers, {kind} shapes), {src} -> {dst},"
        f" one target rank: {one.programs} programs, {one.traces} traces,"
        f" {compiles['n']} XLA compiles, {seconds:.2f} s cold"
        f" (bucket size {_kernels.BUCKET_SIZE}: {buckets} buckets per rank)")
  assert one.programs <= buckets <= n_buffers // 10
  assert one.traces == one.programs  # each program traced exactly once
  # The kernel programs are the only XLA compiles a reshard does (no per-buffer
  # eager ops); the slack allows a few tiny helpers.
  assert compiles["n"] <= one.programs + 4
  for pid in ("layer001", "layer007", "layer150"):
    assert_bits_equal(target.state[0].nu[pid], oracle_shard(state[0].nu[pid], dst, 2))
  if distinct:
    return  # every rank of distinct shapes compiles 6x as much: too slow for CI

  with count_xla_compiles() as compiles:
    targets = [jr.reshard(records, jr.plan(records, world_size=dst, rank=r))
               for r in range(dst)]
  every = jr.kernel_cache_info()
  print(f"  all {dst} target ranks: {every.programs} programs, {every.traces} traces,"
        f" {one.programs + compiles['n']} XLA compiles")
  assert every.programs <= dst * buckets
  assert every.traces == every.programs
  assert compiles["n"] <= every.programs - one.programs + 4
  full = state[0].mu["layer001"]
  for r, t in enumerate(targets):
    assert_bits_equal(t.state[0].mu["layer001"], oracle_shard(full, dst, r))


def _overlapping_source_ranks(count, src, dst, rank):
  s, t = -(-count // src), -(-count // dst)
  lo, hi = rank * t, min((rank + 1) * t, count)
  return [r for r in range(src) if max(lo, r * s) < min(hi, (r + 1) * s, count)]


@pytest.mark.parametrize("count, src, dst", [(48, 8, 6), (1000, 8, 6), (37, 5, 7),
                                             (1000, 16, 3), (5, 4, 2)])
def test_a_target_rank_reads_only_overlapping_source_buffers(count, src, dst):
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": jnp.zeros((count,), jnp.float32)}
  full = jnp.arange(1, count + 1, dtype=jnp.float32)
  state = (optax.TraceState(trace={"w": full}),) + tuple(opt.init(params)[1:])
  records = jr.shard_state(opt, params, state, src)
  s = -(-count // src)
  for rank in range(dst):
    jr.clear_kernel_cache()
    target = jr.reshard(records, jr.plan(records, world_size=dst, rank=rank))
    assert_bits_equal(target.state[0].trace["w"], oracle_shard(full, dst, rank))
    # The one compiled program's signature: its inputs and pieces.
    (signature,) = _kernels._CACHE.programs
    out_specs, in_specs, _ = signature
    (out_shape, _, pieces), = out_specs
    overlapping = _overlapping_source_ranks(count, src, dst, rank)
    # Inputs are source shards of (slots,), one per overlapping source rank:
    # never the whole flat parameter, never a non-overlapping rank.
    assert [shape for shape, _, _ in in_specs] == [(s,)] * len(overlapping)
    assert len(pieces) == len(overlapping)
    assert sum(length for _, length in pieces) == jr.FlatShard((count,), rank, dst).owned
    assert sum(math.prod(shape) for shape, _, _ in in_specs) < count or src <= 2


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_assemble_is_bit_exact_for_special_values(dtype):
  # Regression: at XLA backend optimization level 0, bf16 subnormals were
  # flushed and signalling NaNs quieted inside the kernel.
  v = jnp.asarray(special_values(dtype))
  n = v.shape[0]
  outputs = [
      _kernels.Output((n + 3,), dtype, (_kernels.Piece(v, 0, n),)),
      _kernels.Output((4,), dtype, (_kernels.Piece(v, n - 2, 2),)),  # slice + padding
      _kernels.Output((n,), dtype, (_kernels.Piece(v, 5, n - 5), _kernels.Piece(v, 0, 5))),
      _kernels.Output((2, 5), dtype, (_kernels.Piece(v, 0, 10),)),
  ]
  a, b, c, d = _kernels.assemble(outputs)
  base = np.asarray(v)
  assert_bits_equal(a, np.concatenate([base, np.zeros(3, dtype)]))
  assert_bits_equal(b, np.concatenate([base[n - 2:], np.zeros(2, dtype)]))
  assert_bits_equal(c, np.concatenate([base[5:], base[:5]]))
  assert_bits_equal(d, base[:10].reshape(2, 5))


def test_buckets_hold_at_most_bucket_size_outputs():
  v = jnp.arange(7, dtype=jnp.float32)
  n = 3 * _kernels.BUCKET_SIZE + 1
  outputs = [_kernels.Output((3,), F32, (_kernels.Piece(v, i % 5, 3),)) for i in range(n)]
  jr.clear_kernel_cache()
  built = _kernels.assemble(outputs)
  assert len(built) == n
  for i, x in enumerate(built):
    assert_bits_equal(x, np.asarray(v)[i % 5:i % 5 + 3])
  # Identical outputs go into homogeneous buckets of REPEAT_SIZE that share one
  # program (offsets are runtime arguments); the remainder is one more program.
  assert n % _kernels.REPEAT_SIZE != 0
  assert jr.kernel_cache_info().programs == 2


def test_offsets_beyond_int32_are_compiled_in(monkeypatch):
  # A shard of more than 2**31 elements cannot be built here; lower the
  # threshold so that the static-offset program runs on small data.
  monkeypatch.setattr(_kernels, "_INT32_MAX", 3)
  for dtype in (F32, BF16):
    v = jnp.asarray(special_values(dtype))
    n = v.shape[0]
    out = _kernels.assemble([_kernels.Output(
        (n + 2,), dtype, (_kernels.Piece(v, 5, n - 5), _kernels.Piece(v, 0, 5)))])[0]
    base = np.asarray(v)
    assert_bits_equal(out, np.concatenate([base[5:], base[:5], np.zeros(2, dtype)]))


def _small_records():
  opt = optax.adam(1e-2)
  params = {"a": jnp.zeros((5,), jnp.float32), "b": {"c": jnp.zeros((3, 2), jnp.bfloat16)}}
  rng = np.random.default_rng(3)
  state = jax.tree.map(
      lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype) if x.ndim else x,
      opt.init(params))
  return jr.shard_state(opt, params, state, 4), state


def test_sources_committed_to_different_devices():
  # Each rank's archive restored onto its own device (8 simulated CPU devices):
  # one program must still read them all (this raised jax's "incompatible
  # devices" ValueError before sources were gathered on one device).
  assert jax.device_count() >= 4
  records, state = _small_records()
  placed = [dataclasses.replace(r, state=jax.device_put(r.state, jax.devices()[i]))
            for i, r in enumerate(records)]
  assert {next(iter(x.devices())).id for r in placed for x in jax.tree.leaves(r.state)} == {
      0, 1, 2, 3}
  for rank in range(3):
    target = jr.reshard(placed, jr.plan(placed, world_size=3, rank=rank))
    assert_bits_equal(target.state[0].mu["a"], oracle_shard(state[0].mu["a"], 3, rank))
  assert_trees_bit_equal(jr.unshard_state(placed), state)


def test_numpy_sources():
  # Archives read from disk hold numpy arrays, not jax arrays.
  records, state = _small_records()
  as_numpy = [dataclasses.replace(r, state=jax.tree.map(np.asarray, r.state)) for r in records]
  assert_trees_bit_equal(jr.unshard_state(as_numpy), state)
  target = jr.reshard(as_numpy, jr.plan(as_numpy, world_size=7, rank=6))
  assert_bits_equal(target.state[0].nu["b"]["c"], oracle_shard(state[0].nu["b"]["c"], 7, 6))
