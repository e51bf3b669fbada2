"""Every target rank at once: the block copy, the source stacks and the plan cache,
each against an independent oracle (flatten, pad to W*slots, slice) compared as bits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxreshard as jr
from jaxreshard._src.core.copyplan import Blocks
from jaxreshard._src.engine import pipeline as _pipeline
from jaxreshard._src.engine import sources as _sources
from jaxreshard._src.exec import host as _host_exec
from jaxreshard._src.exec import native as _native
from tests._core_util import (
  OPTIMIZERS,
  STORAGE_SHAPES,
  assert_bits_equal,
  assert_records_equal,
  bits,
  leaf_at,
  oracle_shard,
  random_params,
  random_state,
  small_params,
)


def _oracle_rows(flats, world):
  """``(world, width)``: each row one rank's oracle shards of ``flats``, back to back."""
  return np.stack(
    [np.concatenate([oracle_shard(f, world, r) for f in flats]) for r in range(world)]
  )


@settings(max_examples=150, deadline=None)
@given(
  counts=st.lists(st.integers(0, 200), min_size=1, max_size=6),
  w=st.integers(1, 13),
  m=st.integers(1, 13),
  span=st.tuples(st.integers(0, 12), st.integers(1, 13)),
  chunk=st.sampled_from([1, 3, 7, 1 << 16]),
  tile=st.sampled_from([(0, 16, 1 << 30), (4, 64, 8), (32, 1 << 20, 1)]),
  tiled=st.sampled_from([0, 8, 1 << 20]),
  compiled=st.booleans() if _native.available() else st.just(False),
  seed=st.integers(0, 2**16),
)
def test_copy_blocks_is_the_flat_shard_rule(counts, w, m, span, chunk, tile, tiled, compiled, seed):
  """Target rows ``first .. first + n - 1`` of every buffer equal the oracle's shards,
  for any two world sizes, row ranges, chunk and tile sizes, copied with numpy alone
  or through the compiled block copy (which takes runs of narrow buffers whose
  slots average over ``tiled`` elements); padding stays zero."""
  first = min(span[0], m - 1)
  n = min(span[1], m - first)
  rng = np.random.default_rng(seed)
  flats = [rng.integers(0, 2**32, c, dtype=np.uint64).astype(np.uint32) for c in counts]
  src = _oracle_rows(flats, w)
  # Source padding that is not zero must never reach a target.
  for i, c in enumerate(counts):
    ss = -(-c // w)
    start = sum(-(-x // w) for x in counts[:i])
    for k in range(w):
      own = max(0, min(ss, c - k * ss))
      src[k, start + own : start + ss] = 0xDEADBEEF
  ss = np.array([-(-c // w) for c in counts], np.int64)
  ts = np.array([-(-c // m) for c in counts], np.int64)
  blocks = Blocks(
    np.concatenate([[0], np.cumsum(ss)[:-1]]).astype(np.int64),
    ss,
    np.concatenate([[0], np.cumsum(ts)[:-1]]).astype(np.int64),
    ts,
    np.array(counts, np.int64),
  )
  out = np.zeros((n, int(ts.sum())), np.uint32)
  again = np.zeros_like(out)
  tables = {}
  names = ("_CHUNK", "_NARROW", "_TILE_BYTES", "_DIRECT", "_TILED_SLOTS")
  old = [getattr(_host_exec, k) for k in names]
  was_compiled = _native.enabled
  for k, v in zip(names, (chunk, *tile, tiled)):
    setattr(_host_exec, k, v)
  _native.enabled = compiled
  try:
    _host_exec.copy_blocks(src, out, blocks, first, tables)
    # The second call copies narrow tiles by the gather tables the first one made.
    _host_exec.copy_blocks(src, again, blocks, first, tables)
  finally:
    for k, v in zip(names, old):
      setattr(_host_exec, k, v)
    _native.enabled = was_compiled
  want = _oracle_rows(flats, m)[first : first + n]
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(again, want)


def _spy(monkeypatch):
  """Counts the block copies ``reshard_ranks`` makes, blocks taken wherever they apply."""
  monkeypatch.setattr(_pipeline, "_BLOCK_RUNS", -1)
  calls = []
  real = _host_exec.copy_blocks

  def spy(*args):
    calls.append(args)
    return real(*args)

  monkeypatch.setattr(_host_exec, "copy_blocks", spy)
  return calls


COPIES = ["numpy"] + (["compiled"] if _native.available() else [])


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("name", ["adam", "masked", "multi_transform", "inject_hyperparams"])
@pytest.mark.parametrize("w, m", [(8, 6), (5, 7), (2, 9), (3, 1), (1, 4)])
def test_every_rank_by_blocks_equals_rank_by_rank(monkeypatch, name, w, m, copy):
  """``reshard_ranks`` of a whole plan copies by blocks (with numpy alone, or through
  the compiled block copy); each rank equals ``reshard`` of that rank alone (run by
  run) and the oracle (uneven worlds, trailing all-padding ranks, scalars, size-1
  params, masked and frozen histories)."""
  monkeypatch.setattr(_native, "enabled", copy == "compiled")
  opt = OPTIMIZERS[name]()
  params = small_params()
  state = random_state(opt, params)
  records = jr.shard_state(opt, params, state, world_size=w)
  plans = [jr.plan(records, world_size=m, rank=r) for r in range(m)]
  calls = _spy(monkeypatch)
  targets = jr.reshard_ranks(records, plans)
  assert calls or m < _pipeline.MIN_BLOCK_RANKS
  monkeypatch.undo()
  for t, p in zip(targets, plans):
    assert_records_equal(t, jr.reshard(records, [jr.Migration(**vars(x)) for x in p]))
  for (path, leaf), role in zip(
    jax.tree_util.tree_flatten_with_path(targets[m - 1].state)[0], targets[m - 1].roles
  ):
    if role is not None:
      full = leaf_at(state, path)
      assert_bits_equal(leaf, oracle_shard(full, m, m - 1), jax.tree_util.keystr(path))


def test_storage_dtypes_and_float64_scalars_by_blocks(monkeypatch):
  """bf16, f16 and f32 buffers (one packed buffer each), an empty param, and float64
  clock scalars kept with their bits."""
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=jnp.float32(1e-3))
  params = random_params(STORAGE_SHAPES)
  state = random_state(opt, params)
  records = jr.shard_state(opt, params, state, world_size=3)
  # A float64 clock scalar, whatever x64 says.
  scalar = np.asarray(np.pi, np.float64)
  records = [
    jr.ShardRecord(r.version, r.placements, (r.state, scalar), r.roles + (None,)) for r in records
  ]
  plans = [jr.plan(records, world_size=5, rank=r) for r in range(5)]
  calls = _spy(monkeypatch)
  targets = jr.reshard_ranks(records, plans)
  assert len(calls) == 3  # one per dtype
  monkeypatch.undo()
  back = jr.reshard_ranks(targets, [jr.plan(targets, world_size=3, rank=r) for r in range(3)])
  for a, b in zip(back, records):
    assert_records_equal(a, b)
  for t in targets:
    assert t.state[1].dtype == np.float64 and bits(t.state[1]) == bits(scalar)


@pytest.mark.parametrize("gather", ["compiled", "numpy"])
@pytest.mark.parametrize("int32_max", [None, 0])
@pytest.mark.parametrize("w, m", [(8, 6), (5, 7), (3, 11), (13, 4), (2, 9)])
def test_narrow_tiles_by_gather_tables_equal_rank_by_rank(monkeypatch, w, m, int32_max, gather):
  """Every buffer narrow, several tiles: each rank of ``reshard_ranks`` (its tiles
  gathered by tables made on the first call and reused on the second, through the
  compiled tile gather where the library is and the table is int32, else numpy's
  ``take``) equals
  ``reshard`` of an equal, fresh migration list (validated and copied run by run),
  bit for bit: uneven worlds, trailing all-padding ranks, a scalar and a size-1
  param, bf16/f16/f32 buffers with NaN payloads and -0.0, an empty param, a
  float64 clock scalar."""
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=jnp.float32(1e-3))
  params = random_params({**STORAGE_SHAPES, "tiny": ((1,), jnp.float32)}, seed=w * m)
  records = jr.shard_state(opt, params, random_state(opt, params, seed=m), world_size=w)
  scalar = np.asarray(-0.0, np.float64)
  records = [
    jr.ShardRecord(r.version, r.placements, (r.state, scalar), r.roles + (None,)) for r in records
  ]
  plans = [jr.plan(records, world_size=m, rank=r) for r in range(m)]
  monkeypatch.setattr(_pipeline, "_BLOCK_RUNS", -1)
  monkeypatch.setattr(_host_exec, "_NARROW", 1 << 20)
  monkeypatch.setattr(_host_exec, "_TILED_SLOTS", 1 << 20)  # tiles, even beside a compiled copy
  monkeypatch.setattr(_host_exec, "_TILE_BYTES", 96)
  if int32_max is not None:  # every table of int64 positions, as a huge tile's
    monkeypatch.setattr(_host_exec._tiles, "_INT32_MAX", int32_max)
  if gather == "compiled" and not _native.available():
    pytest.skip("built without a C compiler")
  monkeypatch.setattr(_native, "enabled", gather == "compiled")
  tiles, compiled = [], []
  real = _host_exec._tiles.copy_tile
  monkeypatch.setattr(_host_exec._tiles, "copy_tile", lambda *a: tiles.append(a) or real(*a))
  real_gather = _native.gather_tile
  monkeypatch.setattr(_native, "gather_tile", lambda *a: compiled.append(a) or real_gather(*a))
  first = jr.reshard_ranks(records, plans)
  made = len(tiles)
  again = jr.reshard_ranks(records, plans)
  assert made and len(tiles) == 2 * made
  # Only int32 tables go through the compiled gather; every one of them does.
  assert len(compiled) == (len(tiles) if gather == "compiled" and int32_max is None else 0)
  kind = np.int32 if int32_max is None else np.int64
  assert all(a[2].index.dtype == kind for a in tiles)
  # The second call gathered by the very tables the first one made.
  assert sorted(id(a[2]) for a in tiles[:made]) == sorted(id(a[2]) for a in tiles[made:])
  monkeypatch.undo()
  for r, p in enumerate(plans):
    want = jr.reshard(records, [jr.Migration(**vars(x)) for x in p])
    assert_records_equal(first[r], want)
    assert_records_equal(again[r], want)
    assert bits(first[r].state[1]) == bits(scalar)


def _records_with_leaves(records, make):
  """The records with every history buffer replaced by ``make(archive, buffers)``'s
  arrays (same bits)."""
  out = []
  for i, r in enumerate(records):
    leaves, treedef = jax.tree_util.tree_flatten(r.state)
    hist = [j for j, role in enumerate(r.roles) if role is not None]
    # Packing order: by param id, then mirror (the k-th buffer of a param is mirror k).
    seen: dict = {}
    keys = [
      (r.roles[j], seen.setdefault(r.roles[j], []).append(j) or len(seen[r.roles[j]])) for j in hist
    ]
    packing = sorted(range(len(hist)), key=keys.__getitem__)
    new = make(i, [np.asarray(leaves[j]) for j in hist], packing)
    for j, x in zip(hist, new):
      leaves[j] = x
    out.append(jr.ShardRecord(r.version, r.placements, treedef.unflatten(leaves), r.roles))
  return out


def _one_buffer(bufs, order, into=None):
  """The buffers as views of one allocation (``into``, or a new one), laid out in
  ``order``."""
  whole = np.zeros(sum(b.size for b in bufs), np.float32) if into is None else into
  at, views = 0, [None] * len(bufs)
  for j in order:
    views[j] = whole[at : at + bufs[j].size]
    views[j][...] = bufs[j]
    at += bufs[j].size
  return views


@pytest.mark.parametrize(
  "layout",
  ["rows of one array", "one buffer per archive", "reversed in one buffer", "one array each"],
)
def test_every_source_layout_gives_the_same_bits(monkeypatch, layout):
  """Sources that lie back to back (viewed as they are), scattered in one allocation
  (never read as if packed), or one array per buffer: the same targets."""
  monkeypatch.setattr(_pipeline, "_BLOCK_RUNS", -1)
  opt = optax.adam(1e-2)
  params = random_params(
    {"a": ((13,), jnp.float32), "b": ((5, 3), jnp.float32), "c": ((), jnp.float32)}
  )
  state = random_state(opt, params)
  records = jr.shard_state(opt, params, state, world_size=4)
  if layout == "rows of one array":
    width = sum(
      int(np.size(x)) for x, r in zip(jax.tree.leaves(records[0].state), records[0].roles) if r
    )
    whole = np.zeros((len(records), width), np.float32)
    records = _records_with_leaves(records, lambda i, b, p: _one_buffer(b, p, into=whole[i]))
  elif layout == "one buffer per archive":
    records = _records_with_leaves(records, lambda i, b, p: _one_buffer(b, p))
  elif layout == "reversed in one buffer":
    records = _records_with_leaves(records, lambda i, b, p: _one_buffer(b, p[::-1]))
  elif layout == "one array each":
    records = _records_with_leaves(records, lambda i, b, p: [x.copy() for x in b])
  plans = [jr.plan(records, world_size=3, rank=r) for r in range(3)]
  targets = jr.reshard_ranks(records, plans)
  full = jr.unshard_state(targets)
  for (path, leaf), (_, want) in zip(
    jax.tree_util.tree_flatten_with_path(full)[0], jax.tree_util.tree_flatten_with_path(state)[0]
  ):
    assert_bits_equal(leaf, want, jax.tree_util.keystr(path))
  stack = _sources.record_sources(records).stacked((0, 1, 2, 3), np.dtype(np.float32))
  whole = stack.array()
  # Which way the stack reads them: a view, rows stacked, or every buffer concatenated.
  kind = "view" if stack._whole is not None else "rows" if stack._rows is not None else "all"
  assert kind == {"rows of one array": "view", "one buffer per archive": "rows"}.get(layout, "all")
  assert (stack.copied == 0) == (kind == "view")
  for k, r in enumerate(records):
    row = np.concatenate(
      [bits(x).reshape(-1) for x, role in zip(jax.tree.leaves(r.state), r.roles) if role]
    )
    # The row holds the archive's buffers in packing order (the same bits, any order
    # of leaves in memory).
    assert sorted(row.tolist()) == sorted(whole[k].tolist())


@pytest.mark.parametrize("copy", ["numpy", "compiled"])
@pytest.mark.parametrize(
  "gap, start", [(2, 0), (1, 0), (4, 2), (0, 1)], ids=["2 bytes", "1 byte", "unaligned", "odd"]
)
def test_archive_rows_apart_by_a_part_of_an_element(monkeypatch, copy, gap, start):
  """Archives whose buffers fill rows of one byte buffer, ``gap`` bytes between rows
  (a row stride of no whole number of elements) from byte ``start``: the stack is
  a view of them, and both ways of copying give the oracle's bits."""
  if copy == "compiled" and not _native.available():
    pytest.skip("built without a C compiler")
  monkeypatch.setattr(_native, "enabled", copy == "compiled")
  monkeypatch.setattr(_pipeline, "_BLOCK_RUNS", -1)
  opt = optax.adam(1e-2)
  params = random_params({"a": ((130,), jnp.float32), "b": ((5, 3), jnp.float32)})
  state = random_state(opt, params)
  records = jr.shard_state(opt, params, state, world_size=4)
  width = sum(
    int(np.size(x)) for x, r in zip(jax.tree.leaves(records[0].state), records[0].roles) if r
  )
  step = width * 4 + gap
  raw = np.zeros(start + len(records) * step, np.uint8)
  rows = [raw[start + i * step :][: width * 4].view(np.float32) for i in range(len(records))]
  records = _records_with_leaves(records, lambda i, b, p: _one_buffer(b, p, into=rows[i]))
  stack = _sources.record_sources(records).stacked((0, 1, 2, 3), np.dtype(np.float32))
  assert stack._whole is not None and stack._whole.strides[0] == step
  targets = jr.reshard_ranks(records, [jr.plan(records, world_size=3, rank=r) for r in range(3)])
  full = jr.unshard_state(targets)
  for (path, leaf), (_, want) in zip(
    jax.tree_util.tree_flatten_with_path(full)[0], jax.tree_util.tree_flatten_with_path(state)[0]
  ):
    assert_bits_equal(leaf, want, jax.tree_util.keystr(path))


def test_a_stack_reads_the_sources_as_they_are_now(monkeypatch):
  """Nothing is kept but views: a source buffer written in place between two calls is
  read anew, whether it is viewed, stacked or copied (a strided array's host view is
  a copy, made again at every call), by ``reshard_ranks`` and by ``reshard``."""
  monkeypatch.setattr(_pipeline, "_BLOCK_RUNS", -1)
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": jnp.zeros((10,), jnp.float32)}
  for layout in ("packed", "separate", "strided"):
    records = jr.shard_state(opt, params, opt.init(params), world_size=2)
    if layout == "separate":
      records = _records_with_leaves(records, lambda i, b, p: [x.copy() for x in b])
    elif layout == "strided":  # every other element of a larger array
      records = _records_with_leaves(
        records, lambda i, b, p: [np.zeros(2 * x.size, x.dtype)[::2] for x in b]
      )
    plans = [jr.plan(records, world_size=5, rank=r) for r in range(5)]
    first = jr.reshard_ranks(records, plans)
    alone = jr.reshard(records, plans[0])
    for t in (first[0], alone):
      assert not np.asarray(t.state[0].trace["w"]).any()
    leaf = records[0].state[0].trace["w"]
    assert isinstance(leaf, np.ndarray) and leaf.flags.writeable
    assert leaf.flags.c_contiguous == (layout != "strided")
    leaf[...] = 7.0
    again = jr.reshard_ranks(records, plans)
    alone = jr.reshard(records, plans[0])
    for t in (again[0], alone):
      assert np.asarray(t.state[0].trace["w"]).tolist() == [7.0, 7.0], layout


@pytest.mark.parametrize("layout", ["as shard_state lays them out", "one jax array each"])
def test_a_zero_size_param_alone_in_its_dtype_by_blocks(monkeypatch, layout):
  """A dtype whose only buffer is empty stacks as rows of width 0: every rank of
  ``reshard_ranks`` equals ``reshard`` of that rank alone and the oracle."""
  monkeypatch.setattr(_pipeline, "_BLOCK_RUNS", -1)
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"a": jnp.ones((64,), jnp.float32), "z": jnp.ones((0,), jnp.bfloat16)}
  state = random_state(opt, params)
  records = jr.shard_state(opt, params, state, world_size=16)
  if layout == "one jax array each":
    records = _records_with_leaves(records, lambda i, b, p: [jnp.asarray(x) for x in b])
  plans = [jr.plan(records, world_size=12, rank=r) for r in range(12)]
  targets = jr.reshard_ranks(records, plans)
  for r, (t, p) in enumerate(zip(targets, plans)):
    assert_records_equal(t, jr.reshard(records, [jr.Migration(**vars(x)) for x in p]))
    assert_bits_equal(t.state[0].trace["a"], oracle_shard(state[0].trace["a"], 12, r), "a")
    assert np.shape(t.state[0].trace["z"]) == (0,)


def test_plan_hands_out_the_same_migrations_and_validates_them_once():
  opt = optax.adam(1e-2)
  records = jr.shard_state(opt, small_params(), opt.init(small_params()), world_size=4)
  a, b = jr.plan(records, world_size=3, rank=1), jr.plan(records, world_size=3, rank=1)
  assert a == b and a is not b and all(x is y for x, y in zip(a, b))
  src = _sources.record_sources(records)
  g1, g2 = _pipeline.validate(src, a), _pipeline.validate(src, b)
  assert g1.family is not None and g1.family is g2.family
  # Another rank of the same world size shares the family: its rows were validated once.
  assert _pipeline.validate(src, jr.plan(records, world_size=3, rank=2)).family is g1.family


def test_a_list_that_is_not_plan_s_own_is_validated_in_full():
  """Equal migrations made elsewhere, an edited list, a float rank: every path keeps
  its refusal and its words."""
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"a": jnp.zeros((5,)), "b": jnp.zeros((3,))}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  p = jr.plan(records, world_size=3, rank=1)
  src = _sources.record_sources(records)
  equal = [jr.Migration(**vars(m)) for m in p]
  assert _pipeline.validate(src, equal).family is None
  assert_records_equal(jr.reshard(records, equal), jr.reshard(records, p))
  with pytest.raises(jr.PlacementError, match="two migrations target it"):
    jr.reshard(records, p + [p[0]])
  bad = [jr.Migration(m.param, m.shape, 1.0, m.world_size, m.sources) for m in p]
  fresh = jr.shard_state(opt, params, opt.init(params), world_size=2)
  with pytest.raises(jr.ReshardError) as got:
    jr.reshard(records, bad)
  with pytest.raises(jr.ReshardError) as want:
    jr.reshard(fresh, [jr.Migration(m.param, m.shape, 1.0, m.world_size, m.sources) for m in p])
  assert str(got.value) == str(want.value)
  edited = list(p)
  edited[0] = jr.Migration(p[0].param, p[0].shape, 0, 3, p[0].sources)
  target = jr.reshard(records, edited)
  assert [x.rank for x in target.placements] == [0, 1]


def test_the_plan_cache_holds_a_bounded_number_of_migrations(monkeypatch):
  from jaxreshard._src.engine import plans as _plans

  monkeypatch.setattr(_plans.PlanCache, "MAX_MIGRATIONS", 5)
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"a": jnp.zeros((5,)), "b": jnp.zeros((3,))}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  plans = [jr.plan(records, world_size=7, rank=r) for r in range(7)]
  cache = _sources.record_sources(records).plan_cache
  assert cache._held <= 5
  # An evicted plan is recognised by its fields (see test_plan_identity) and still correct.
  for r, p in enumerate(plans):
    assert [x.rank for x in jr.reshard(records, p).placements] == [r, r]


@pytest.mark.parametrize("w, m, blocks", [(8, 6, False), (32, 24, True), (1, 64, True)])
def test_blocks_are_taken_where_they_cost_less_than_runs(monkeypatch, w, m, blocks):
  """Few ranks on each side: run by run (a few runs per buffer); many: by blocks.
  The records are the same either way."""
  opt = optax.adam(1e-2)
  params = random_params({"a": ((700,), jnp.float32), "b": ((300, 2), jnp.float32)})
  records = jr.shard_state(opt, params, random_state(opt, params), world_size=w)
  plans = [jr.plan(records, world_size=m, rank=r) for r in range(m)]
  calls = []
  real = _host_exec.copy_blocks
  monkeypatch.setattr(_host_exec, "copy_blocks", lambda *a: calls.append(a) or real(*a))
  targets = jr.reshard_ranks(records, plans)
  assert bool(calls) == blocks
  monkeypatch.undo()
  for t, p in zip(targets[:3], plans):
    assert_records_equal(t, jr.reshard(records, p))


def test_buffers_of_many_archives_are_each_key_s_buffer():
  """The look-up of every archive's buffers at once gives, object for object, what
  asking key by key gives: any order of (param, mirror), a key an archive lacks."""
  from jaxreshard._src.engine import stacks as _stacks

  opt = optax.adam(1e-2)
  params = random_params({"a": ((13,), jnp.float32), "b": ((5, 3), jnp.float32)})
  records = jr.shard_state(opt, params, random_state(opt, params), world_size=4)
  src = _sources.record_sources(records)
  order = src._packing_of(0, np.dtype(np.float32))
  assert len({m for _, m in order}) == 2
  for keys in (order, order[::-1], order[1:2], [*order, ("missing", 0)]):
    got = _stacks.buffers_of(src, [3, 0, 2], keys)
    want = [src.buffer((a, pid, m)) for a in (3, 0, 2) for pid, m in keys]
    assert len(got) == len(want) and all(x is y for x, y in zip(got, want))
  assert src.buffer((0, "missing", 0)) is None
