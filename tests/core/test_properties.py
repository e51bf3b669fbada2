"""Property tests against the numpy oracle (flatten, pad to W*slots, slice).

Buffers are built from uniformly random bit patterns, so NaN payloads, -0.0,
inf and subnormals occur on their own; one explicit test pins them anyway.
"""

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings

import jaxreshard as jr
from tests._core_util import (
  BF16,
  F16,
  F32,
  assert_bits_equal,
  assert_records_equal,
  assert_trees_bit_equal,
  bits,
  nest,
  oracle_shard,
  random_bits_array,
  special_values,
)
from tests._shapes import ORACLE_SHAPES

SHAPES = st.one_of(
  st.sampled_from(ORACLE_SHAPES), st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
)
DTYPES = st.sampled_from([F32, F16, BF16])
WORLDS = st.integers(1, 17)
OPT = optax.adam(1e-3)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ids(n):
  # Nested and flat ids: "p0", "blk/p1", "blk/sub/p2", ...
  return ["p0", "blk/p1", "blk/sub/p2", "z"][:n]


def _state(specs, seed):
  """Full params and an Adam state whose mu/nu are random bits of each dtype."""
  rng = np.random.default_rng(seed)
  ids = _ids(len(specs))
  params = nest({pid: jnp.zeros(shape, dtype) for pid, (shape, dtype) in zip(ids, specs)})
  mu = nest(
    {
      pid: jnp.asarray(random_bits_array(rng, shape, dtype))
      for pid, (shape, dtype) in zip(ids, specs)
    }
  )
  nu = nest(
    {
      pid: jnp.asarray(random_bits_array(rng, shape, dtype))
      for pid, (shape, dtype) in zip(ids, specs)
    }
  )
  adam, rest = OPT.init(params)
  state = (
    adam._replace(count=jnp.asarray(rng.integers(0, 2**31 - 1), jnp.int32), mu=mu, nu=nu),
    rest,
  )
  return params, state, dict(zip(ids, specs))


def _buffers(state):
  """{(mirror, pid): buffer} of an Adam state, mirrors 'mu' and 'nu'."""
  out = {}
  for name in ("mu", "nu"):
    for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(state[0], name))[0]:
      out[(name, "/".join(k.key for k in path))] = leaf
  return out


def _check_layout(records, full_state, world):
  full = _buffers(full_state)
  assert [r.placements[0].rank for r in records] == list(range(world))
  for rank, rec in enumerate(records):
    local = _buffers(rec.state)
    assert local.keys() == full.keys()
    for key, buf in local.items():
      g = jr.FlatShard(np.shape(full[key]), rank, world)
      assert_bits_equal(buf, oracle_shard(full[key], world, rank), f"{key} r{rank}/{world}")
      assert not bits(buf)[g.owned :].any(), "padding must be exactly zero"
    assert_bits_equal(rec.state[0].count, full_state[0].count, "count")


def _all_ranks(records, world):
  return [jr.reshard(records, jr.plan(records, world_size=world, rank=r)) for r in range(world)]


@pytest.mark.slow
@settings(max_examples=40, **SETTINGS)
@given(
  specs=st.lists(st.tuples(SHAPES, DTYPES), min_size=1, max_size=3),
  w1=WORLDS,
  w2=WORLDS,
  seed=st.integers(0, 2**32 - 1),
)
def test_reshard_matches_oracle_and_round_trips(specs, w1, w2, seed):
  params, state, _ = _state(specs, seed)
  records = jr.shard_state(OPT, params, state, w1)
  _check_layout(records, state, w1)

  targets = _all_ranks(records, w2)
  _check_layout(targets, state, w2)
  for t in targets:
    assert t.version == 1
    assert [p.param for p in t.placements] == sorted(p.param for p in records[0].placements)

  assert_trees_bit_equal(jr.unshard_state(targets), state)

  back = _all_ranks(targets, w1)
  for original, returned in zip(records, back, strict=True):
    assert_records_equal(returned, original)


@pytest.mark.slow
@settings(max_examples=30, **SETTINGS)
@given(
  specs=st.lists(st.tuples(SHAPES, DTYPES), min_size=1, max_size=3),
  w1=WORLDS,
  w2=WORLDS,
  rank_frac=st.floats(0, 1, exclude_max=True),
  seed=st.integers(0, 2**32 - 1),
)
def test_unshard_of_any_layout_is_the_full_state(specs, w1, w2, rank_frac, seed):
  params, state, _ = _state(specs, seed)
  records = jr.shard_state(OPT, params, state, w1)
  assert_trees_bit_equal(jr.unshard_state(records), state)
  # One target rank of another layout, checked alone (no round trip needed).
  rank = int(rank_frac * w2)
  target = jr.reshard(records, jr.plan(records, world_size=w2, rank=rank))
  _check_layout_one(target, state, w2, rank)
  # Archives given in any order unshard to the same state.
  shuffled = records[::-1]
  assert_trees_bit_equal(jr.unshard_state(shuffled), state)


def _check_layout_one(rec, full_state, world, rank):
  full = _buffers(full_state)
  for key, buf in _buffers(rec.state).items():
    assert_bits_equal(buf, oracle_shard(full[key], world, rank), f"{key} r{rank}/{world}")


def test_special_values_survive_every_path():
  # NaN payloads (quiet and signalling, both signs), +-inf, +-0, subnormals.
  mu, nu = {}, {}
  for name, dt in (("f32", F32), ("f16", F16), ("bf16", BF16)):
    v = special_values(dt)
    mu[name] = jnp.asarray(v)
    nu[name] = jnp.asarray(v[::-1].copy())
  params = {k: jnp.zeros(v.shape, v.dtype) for k, v in mu.items()}
  adam, rest = OPT.init(params)
  state = (adam._replace(mu=mu, nu=nu), rest)
  for w1, w2 in ((3, 5), (4, 7), (14, 1)):
    records = jr.shard_state(OPT, params, state, w1)
    _check_layout(records, state, w1)
    targets = _all_ranks(records, w2)
    _check_layout(targets, state, w2)
    assert_trees_bit_equal(jr.unshard_state(targets), state)
    for a, b in zip(_all_ranks(targets, w1), records, strict=True):
      assert_records_equal(a, b)
  # The values really are the special ones (the test would be vacuous otherwise).
  m = np.asarray(mu["f32"])
  assert np.isnan(m).sum() >= 4 and np.isinf(m).sum() == 2 and np.signbit(m[m == 0]).any()
  assert bits(mu["f32"])[0] != bits(mu["f32"])[1]  # distinct NaN payloads


def test_random_bits_cover_special_classes():
  # The generator the properties rely on does produce NaN/inf/-0/subnormals.
  rng = np.random.default_rng(0)
  for dt in (F16, BF16):
    raw = random_bits_array(rng, (1 << 18,), dt)
    x = raw.astype(np.float32)
    assert np.isnan(x).any() and np.isinf(x).any() and (bits(raw) == 0x8000).any()
    assert ((np.abs(x) > 0) & (np.abs(x) < float(ml_dtypes.finfo(dt).tiny))).any()


def test_trailing_all_padding_ranks_in_reshard():
  # count 5 over 4 ranks: rank 3 is all padding, and resharding onto it is zeros.
  params = {"w": jnp.zeros((5,), jnp.float32)}
  rng = np.random.default_rng(1)
  adam, rest = OPT.init(params)
  mu = {"w": jnp.asarray(random_bits_array(rng, (5,), F32))}
  state = (adam._replace(mu=mu, nu=mu), rest)
  records = jr.shard_state(OPT, params, state, 2)
  target = jr.reshard(records, jr.plan(records, world_size=4, rank=3))
  assert_bits_equal(target.state[0].mu["w"], np.zeros(2, np.float32))
  assert math.prod(target.placements[0].shape) == 5
  # and from a layout with an all-padding rank back to one rank.
  recs4 = _all_ranks(records, 4)
  assert_trees_bit_equal(jr.unshard_state(recs4), state)


@settings(max_examples=200, **SETTINGS)
@given(
  st.lists(st.integers(-(2**63), 2**63 - 1), max_size=60),
  st.sampled_from([np.int64, np.int32, np.intp]),
)
def test_unique_ints_is_the_sorted_set_of_the_values(values, dtype):
  from jaxreshard._src.core.copyplan import unique_ints

  info = np.iinfo(dtype)
  x = np.array([v for v in values if info.min <= v <= info.max], dtype)
  got = unique_ints(x)
  assert got.dtype == x.dtype
  assert got.tolist() == sorted(set(x.tolist()))
  assert unique_ints(x.reshape(-1, 1)).tolist() == got.tolist()  # any shape, flattened
