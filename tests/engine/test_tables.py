"""The validated groups as a table, and the per-pair costs it removes, against oracles."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxreshard as jr
from jaxreshard._src.core import groups as _groups
from jaxreshard._src.core.copyplan import Runs
from jaxreshard._src.engine import pipeline as _pipeline
from jaxreshard._src.engine import sources as _sources
from jaxreshard._src.exec import host as _host_exec
from tests._core_util import assert_records_equal


def _oracle_range(count, rank, world):
  """Owned range of a rank: the chunk of ``ceil(count / world)`` elements, clipped."""
  slots = -(-count // world)
  return slots, min(rank * slots, count), min((rank + 1) * slots, count)


@settings(max_examples=200, deadline=None)
@given(
  st.lists(
    st.tuples(
      st.one_of(st.integers(0, 10**6), st.integers(2**61, 2**63 - 1)),
      st.integers(1, 1 << 20),
      st.integers(0, (1 << 20) - 1),
    ),
    min_size=1,
    max_size=20,
  )
)
def test_the_table_geometry_is_the_flat_shard_rule(rows):
  """Target slots, start and stop per row equal the flat-shard rule in Python ints,
  also for counts where ``(rank + 1) * slots`` passes 2**63."""
  rows = [(c, r % w, w) for c, w, r in rows]
  facts = [_facts(f"p{i}", (c,)) for i, (c, _, _) in enumerate(rows)]
  migrations = [jr.Migration(f"p{i}", (c,), r, w, (0,)) for i, (c, r, w) in enumerate(rows)]
  table = _groups.Groups(migrations, facts)
  for i, (c, r, w) in enumerate(rows):
    assert (int(table.slots[i]), int(table.start[i]), int(table.stop[i])) == _oracle_range(c, r, w)
    g = table[i]
    assert (g.target.slots, g.target.start, g.target.stop) == _oracle_range(c, r, w)


def _facts(pid, shape):
  from jaxreshard._src.core import validate as _validate

  return _validate.SourceFacts(
    pid,
    shape,
    jr.FlatShard(shape, 0, 1),
    (0,),
    np.dtype(np.float32),
    True,
    (True,),
    (np.dtype(np.float32),),
    0,
  )


@pytest.mark.parametrize(
  "rank, world, refused",
  [(0, 3, False), (2, 3, False), (3, 3, True), (-1, 3, True), (0, 0, True), (True, 3, True)],
)
def test_targets_checked_at_once_agrees_with_the_geometry(rank, world, refused):
  m = jr.Migration("w", (5,), rank, world, (0,))
  assert _groups.targets_checked([jr.Migration("v", (5,), 0, 1, (0,)), m]) is not refused
  if refused:
    with pytest.raises(jr.PlacementError):
      jr.FlatShard((5,), rank, world)


def test_an_invalid_target_is_refused_with_its_words():
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"a": jnp.zeros((5,)), "b": jnp.zeros((3,))}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  migrations = jr.plan(records, world_size=3, rank=1)
  bad = jr.Migration("b", (3,), 3, 3, migrations[1].sources)
  with pytest.raises(jr.PlacementError, match=r"param 'b': invalid target placement: rank 3 is"):
    jr.reshard(records, [migrations[0], bad])
  # An integer of another type is a rank like any other.
  ok = jr.Migration("b", (3,), np.int64(1), np.int32(3), migrations[1].sources)
  target = jr.reshard(records, [migrations[0], ok])
  assert [p.rank for p in target.placements] == [1, 1]


class _IntLike:
  """An integer type whose ``__int__`` disagrees with its ``__index__``."""

  def __init__(self, value):
    self.value = value

  def __index__(self):
    return self.value

  def __int__(self):
    return self.value + 1


def test_an_int_like_rank_is_read_as_its_index():
  """The table reads a target's rank and world size as the geometry check does
  (``operator.index``), never through ``__int__``."""
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"a": jnp.arange(5.0)}
  state = opt.update(params, opt.init(params))[1]
  records = jr.shard_state(opt, params, state, world_size=4)
  target = jr.reshard(records, [jr.Migration("a", (5,), _IntLike(1), _IntLike(3), (0, 1, 2, 3))])
  want = jr.reshard(records, [jr.Migration("a", (5,), 1, 3, (0, 1, 2, 3))])
  assert_records_equal(target, want)
  assert (target.placements[0].rank, target.placements[0].world_size) == (1, 3)


class _CountingTuple(tuple):
  """A tuple that counts how often it is hashed."""

  hashes = 0

  def __hash__(self):
    type(self).hashes += 1
    return tuple.__hash__(self)


def test_a_source_tuple_is_hashed_once_per_object():
  """Looking facts up for every (target rank, param) pair does not hash the W sources
  each time: that cost grows as W per pair, W^2 x params over all target ranks."""
  cache = _sources.FactsCache()
  t = _CountingTuple(range(4096))
  first = cache.key(t)
  _CountingTuple.hashes = 0
  numbers = {cache.key(t) for _ in range(1000)}
  assert numbers == {first} and _CountingTuple.hashes == 0
  # An equal tuple (another object) gets the same number.
  assert cache.key(tuple(range(4096))) == first


def test_facts_lookups_do_not_hash_the_sources_again():
  opt = optax.adam(1e-3)
  params = {f"p{i}": jnp.arange(7.0) for i in range(20)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=16)
  src = _sources.record_sources(records)
  t = _CountingTuple(range(16))
  for pid in params:
    src.facts(pid, t)
  _CountingTuple.hashes = 0
  for _ in range(5):
    for pid in params:
      src.facts(pid, t)
  assert _CountingTuple.hashes == 0


def _leaf_roles(state, params):
  """Roles read off key paths: a leaf whose path ends with a param's keys is its
  history buffer; every other leaf (the clock's scalars) has none."""
  ids = {tuple(k.key for k in p): "/".join(k.key for k in p) for p, _ in _paths(params)}
  out = []
  for path, _ in _paths(state):
    keys = tuple(getattr(k, "key", None) for k in path)
    out.append(next((pid for k, pid in ids.items() if keys[-len(k) :] == k), None))
  return tuple(out)


def _paths(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


@pytest.mark.parametrize("name", ["adam", "masked", "multi", "inject", "subset", "subset_masked"])
def test_target_roles_match_the_leaves(name):
  """The roles of a built record, read off the template when its subtrees hold the
  template's params, are those of its leaves; with a subset of the params
  too (the subtrees are rebuilt)."""
  params = {"enc": {"w": jnp.arange(6.0), "b": jnp.arange(3.0)}, "head": jnp.arange(5.0)}
  mask = {"enc": {"w": True, "b": False}, "head": True}
  opt = {
    "adam": optax.adam(1e-3),
    "masked": optax.chain(optax.masked(optax.adam(1e-3), mask), optax.sgd(0.1, momentum=0.9)),
    "multi": optax.multi_transform(
      {"a": optax.adam(1e-3), "s": optax.sgd(0.1, momentum=0.9)},
      {"enc": {"w": "a", "b": "s"}, "head": "a"},
    ),
    "inject": optax.inject_hyperparams(optax.adamw)(learning_rate=0.1),
    "subset": optax.adam(1e-3),
    "subset_masked": optax.masked(optax.adam(1e-3), mask),
  }[name]
  state = opt.init(params)
  records = jr.shard_state(opt, params, state, world_size=4)
  for rank in range(3):
    migrations = jr.plan(records, world_size=3, rank=rank)
    if name.startswith("subset"):
      migrations = [m for m in migrations if m.param != "enc/w"]
      kept = {"enc": {"b": params["enc"]["b"]}, "head": params["head"]}
    else:
      kept = params
    target = jr.reshard(records, migrations)
    assert target.roles == _leaf_roles(target.state, kept)
    if not name.startswith("subset"):
      assert_records_equal(target, jr.shard_state(opt, params, state, world_size=3)[rank])


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_host_execute_places_runs_in_any_order_with_gaps(data):
  """Runs in any order, with gaps (padding) between them, against a copy loop."""
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
  sources = [
    rng.integers(0, 2**32, size=int(rng.integers(1, 40)), dtype=np.uint32) for _ in range(4)
  ]
  size = data.draw(st.integers(1, 200))
  runs, pos = [], 0
  while pos < size:
    gap = data.draw(st.integers(0, 3))
    s = data.draw(st.integers(0, 3))
    n = data.draw(st.integers(1, 10))
    a = data.draw(st.integers(0, len(sources[s]) - 1))
    n = min(n, len(sources[s]) - a, size - pos - gap)
    if n <= 0:
      break
    runs.append((s, a, pos + gap, n))
    pos += gap + n
  order = data.draw(st.permutations(range(len(runs))))
  runs = [runs[i] for i in order]
  table = Runs(*(np.asarray([r[i] for r in runs], np.int64).reshape(-1) for i in range(4)))
  got = _host_exec.execute(sources, table, size, np.uint32)
  want = np.zeros(size, np.uint32)
  for s, a, b, n in runs:
    want[b : b + n] = sources[s][a : a + n]
  np.testing.assert_array_equal(got, want)


def test_validate_returns_a_table_sorted_by_param():
  opt = optax.adam(1e-3)
  params = {"b": jnp.arange(4.0), "a": jnp.arange(9.0), "c%2Fd": jnp.arange(2.0)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=3)
  src = _sources.record_sources(records)
  migrations = list(reversed(jr.plan(records, world_size=2, rank=1)))
  groups = _pipeline.validate(src, migrations)
  assert groups.params == sorted(m.param for m in migrations)
  for i, g in enumerate(groups):
    assert g.param == groups.params[i]
    assert g.target == jr.FlatShard(g.facts.shape, 1, 2)
