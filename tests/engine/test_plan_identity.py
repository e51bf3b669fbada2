"""A plan handed back is recognised by the identity of its migrations, in one C-level
comparison (``placement.same_migrations``): never by equality, and never for a list
that the full validation would refuse."""

import contextlib
import dataclasses
import gc

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.core import placement as _placement
from jaxreshard._src.core.placement import same_migrations
from jaxreshard._src.engine import pipeline as _pipeline
from jaxreshard._src.engine import sources as _sources
from tests._core_util import STORAGE_SHAPES, assert_records_equal, bits, random_params, random_state


def _records(w=2, seed=0):
  opt = optax.sgd(0.1, momentum=0.9)
  params = random_params({"a": ((5,), jnp.float32), "b": ((3,), jnp.float32)}, seed)
  return jr.shard_state(opt, params, random_state(opt, params), world_size=w)


def _m(param="a", shape=(5,), rank=0, world=3, sources=(0, 1)):
  return jr.Migration(param, shape, rank, world, sources)


def test_migration_equality_is_the_dataclass_rule():
  """Equal exactly when the class and every field are equal; the hash follows."""
  a, b = _m(), _m()
  assert a == b and not (a != b) and hash(a) == hash(b)
  for field, value in [
    ("param", "b"),
    ("shape", (6,)),
    ("rank", 1),
    ("world_size", 4),
    ("sources", (1, 0)),
  ]:
    c = dataclasses.replace(a, **{field: value})
    assert a != c and not (a == c)
  assert a.__eq__(("a", (5,), 0, 3, (0, 1))) is NotImplemented
  assert a != ("a", (5,), 0, 3, (0, 1))
  # Equal values of another type are equal, as they were (``True == 1``).
  assert _m(sources=(False, True)) == _m(sources=(0, 1))


def test_same_migrations_is_identity_of_every_item():
  ms = [_m(rank=r) for r in range(4)]
  assert same_migrations(list(ms), ms)
  assert same_migrations(tuple(ms), tuple(ms))
  # Equal but not the same objects; equal through ``True == 1``; reordered; short.
  assert not same_migrations([dataclasses.replace(m) for m in ms], ms)
  forged = list(ms)
  forged[2] = dataclasses.replace(ms[2], sources=(False, True))
  assert forged == ms and not same_migrations(forged, ms)
  assert not same_migrations(ms[::-1], ms)
  assert not same_migrations(ms[:3], ms)
  # Only a list against a list and a tuple against a tuple.
  assert not same_migrations(tuple(ms), ms)
  assert not same_migrations(list(ms), tuple(ms))

  class Sub(list):
    pass

  assert not same_migrations(Sub(ms), ms)


def test_same_migrations_is_not_fooled_by_an_item_s_own_equality():
  ms = [_m(rank=r) for r in range(3)]

  class Liar:
    def __eq__(self, other):
      return True

  class Raiser:
    def __eq__(self, other):
      raise RuntimeError("no")

  for stranger in (Liar(), Raiser()):
    items = list(ms)
    items[1] = stranger
    assert not same_migrations(items, ms)


def test_a_subclass_that_overrides_equality_disables_the_c_level_comparison():
  ms = [_m(rank=r) for r in range(3)]

  class Always(jr.Migration):
    def __eq__(self, other):
      return True

    __hash__ = jr.Migration.__hash__

  liar = Always("a", (5,), 1, 3, (True, 1))
  items = list(ms)
  items[1] = liar
  assert items == ms
  assert not same_migrations(items, ms)
  # While the subclass lives, nothing is trusted to the comparison.
  assert not same_migrations(list(ms), ms)
  del Always, liar, items
  gc.collect()
  assert same_migrations(list(ms), ms)


def test_a_replaced_equality_disables_the_c_level_comparison(monkeypatch):
  ms = [_m(rank=r) for r in range(3)]
  monkeypatch.setattr(jr.Migration, "__eq__", lambda self, other: True)
  assert not same_migrations(list(ms), ms)


def test_a_tick_from_elsewhere_only_sends_the_check_element_by_element(monkeypatch):
  """``same_migrations`` trusts nothing when ``Migration.__eq__`` ran meanwhile
  (in any thread); ``PlanCache.match`` then compares item by item."""
  records = _records()
  p = jr.plan(records, world_size=3, rank=1)
  src = _sources.record_sources(records)
  ticks = iter(range(0, 10**6, 2))  # every read skips a value: as if __eq__ ran
  monkeypatch.setattr(_placement, "_EQ_CALLS", ticks)
  assert not same_migrations(list(p), _pipeline_plan_list(src, p))
  assert src.plan_cache.match(p) is not None


def _pipeline_plan_list(src, p):
  key, plan = src.plan_cache.match(p)
  return list(plan)


def _refusal(records_factory, migrations):
  with pytest.raises(jr.ReshardError) as got:
    jr.reshard(records_factory(), migrations)
  return type(got.value), str(got.value)


@pytest.mark.parametrize(
  "forge",
  [
    # Equal to the plan's migration through ``True == 1`` in its sources.
    lambda p: dataclasses.replace(p[-1], sources=tuple(bool(s) for s in p[-1].sources)),
    # Equal through ``1.0 == 1`` in its rank.
    lambda p: dataclasses.replace(p[-1], rank=float(p[-1].rank)),
  ],
)
@pytest.mark.parametrize("how", ["setitem", "list.__setitem__", "tuple"])
def test_a_forged_plan_list_is_refused_as_the_full_validation_refuses_it(forge, how):
  """A plan's list with its last item replaced by an equal but different migration,
  however it was replaced (even bypassing list methods), is refused, in the words
  of records that never saw a plan."""
  records = _records()
  p = jr.plan(records, world_size=3, rank=1)
  jr.reshard(records, p)  # the plan's family is validated and remembered
  bad = forge(p)
  assert bad == p[-1] and bad is not p[-1]
  if how == "setitem":
    items = p
    items[-1] = bad
  elif how == "list.__setitem__":
    items = p
    list.__setitem__(items, len(p) - 1, bad)
  else:
    items = (*p[:-1], bad)
  assert items[-1] is bad and items[0] is p[0]
  got = _refusal(lambda: records, items)
  want = _refusal(_records, [*[dataclasses.replace(m) for m in items[:-1]], bad])
  assert got == want


@pytest.mark.parametrize("w, m", [(2, 3), (3, 4), (5, 7), (4, 6), (8, 6)])
def test_plan_lists_and_tuples_are_recognised_and_equal_the_full_path(w, m):
  """Uneven worlds, trailing all-padding ranks, a scalar, a size-1 and an empty
  param, bf16/f16/f32 buffers with NaN payloads and -0.0, a float64 clock scalar:
  each rank of a plan (a list, or a tuple of it) takes the family; equal
  migrations made elsewhere are validated in full; the records are the same bits."""
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=jnp.float32(1e-3))
  params = random_params({**STORAGE_SHAPES, "tiny": ((1,), jnp.float32)}, seed=w)
  records = jr.shard_state(opt, params, random_state(opt, params, seed=m), world_size=w)
  scalar = np.asarray(-0.0, np.float64)
  records = [
    jr.ShardRecord(r.version, r.placements, (r.state, scalar), r.roles + (None,)) for r in records
  ]
  src = _sources.record_sources(records)
  plans = [jr.plan(records, world_size=m, rank=r) for r in range(m)]
  fast = jr.reshard_ranks(records, plans)
  as_tuples = jr.reshard_ranks(records, [tuple(p) for p in plans])
  for r, p in enumerate(plans):
    assert src.plan_cache.match(p) is not None
    assert src.plan_cache.match(tuple(p)) is not None
    equal = [dataclasses.replace(x) for x in p]
    assert src.plan_cache.match(equal) is None
    assert _pipeline.validate(src, equal).family is None
    slow = jr.reshard(records, equal)
    assert_records_equal(fast[r], slow)
    assert_records_equal(as_tuples[r], slow)
    assert bits(slow.state[1]) == bits(scalar)


def test_same_migrations_each_is_identity_of_every_item_of_every_list(monkeypatch):
  lists = [[_m(rank=r, world=w) for r in range(3)] for w in (3, 4)]
  assert _placement.same_migrations_each([list(x) for x in lists], lists)
  forged = [list(x) for x in lists]
  forged[1][2] = dataclasses.replace(lists[1][2], sources=(False, True))
  assert forged == lists and not _placement.same_migrations_each(forged, lists)
  # A tuple, a list subclass, a short list, one list too few: not the plan's lists.
  assert not _placement.same_migrations_each([tuple(lists[0]), list(lists[1])], lists)

  class Sub(list):
    pass

  assert not _placement.same_migrations_each([Sub(lists[0]), list(lists[1])], lists)
  assert not _placement.same_migrations_each([lists[0][:2], list(lists[1])], lists)
  assert not _placement.same_migrations_each([list(lists[0])], lists)
  # A tick from elsewhere while comparing: nothing is trusted.
  monkeypatch.setattr(_placement, "_EQ_CALLS", iter(range(0, 10**6, 2)))
  assert not _placement.same_migrations_each([list(x) for x in lists], lists)


def test_plans_recognised_together_take_their_families_and_refuse_as_one_by_one():
  """``reshard_ranks`` recognises the lists ``plan`` handed out all at once; a
  forged or empty list among them is refused in the words of one-by-one validation."""
  records = _records(w=4)
  src = _sources.record_sources(records)
  plans = [jr.plan(records, world_size=w, rank=r) for w in (3, 6) for r in range(w)]
  tables = _pipeline.validate_ranks(src, plans)
  assert [t.uniform_rank for t in tables] == [0, 1, 2, 0, 1, 2, 3, 4, 5]
  assert tables[0].family is tables[2].family is not tables[3].family
  together = jr.reshard_ranks(records, plans)
  for got, p in zip(together, plans):
    assert_records_equal(got, jr.reshard(_records(w=4), [dataclasses.replace(m) for m in p]))
  forged = [list(p) for p in plans]
  bad = dataclasses.replace(forged[4][-1], rank=float(forged[4][-1].rank))
  forged[4][-1] = bad
  got = _refusal(lambda: _records(w=4), [*[dataclasses.replace(m) for m in forged[4][:-1]], bad])
  with pytest.raises(jr.ReshardError) as together_err:
    jr.reshard_ranks(records, forged)
  assert (type(together_err.value), str(together_err.value)) == got
  with pytest.raises(jr.PlacementError, match="no migrations: a target rank needs"):
    jr.reshard_ranks(records, [plans[0], []])


def test_ranks_resharded_in_turn_keep_their_programs_when_their_records_are_read(monkeypatch):
  """Every target rank of a world resharded in turn, each result read whole (its
  state's leaves and its placements made): from the second pass on, no rank's copy
  program is made again. A rank keeps several values (its runs, its padding plan,
  its placements); those of one kind must not push out the other ranks' runs."""
  import jax  # pylint: disable=g-import-not-at-top

  from jaxreshard._src.exec import host  # pylint: disable=g-import-not-at-top

  opt = optax.adam(1e-3)
  params = {f"p{i}": np.arange(i + 5, dtype=np.float32) for i in range(12)}
  records = [jax.tree.map(jnp.asarray, r) for r in jr.shard_state(opt, params, opt.init(params), 8)]
  plans = [jr.plan(records, world_size=6, rank=r) for r in range(6)]
  made = []
  real = host.Program.__init__

  def counted(self, *args, **kwargs):
    made.append(1)
    real(self, *args, **kwargs)

  monkeypatch.setattr(host.Program, "__init__", counted)
  for _ in range(3):
    for p in plans:
      out = jr.reshard(records, p)
      jax.tree.leaves(out.state)
      assert out.placements
  assert len(made) == len(plans), len(made)


def _outcome(records, migrations):
  """What ``reshard`` makes of ``migrations``: ("ok", its record) or its refusal's
  (type, words)."""
  try:
    return "ok", jr.reshard(records, migrations)
  except jr.ReshardError as e:
    return type(e), str(e)


def _assert_same_outcome(got, want):
  assert got[0] == want[0], (got, want)
  if got[0] == "ok":
    assert_records_equal(got[1], want[1])
  else:
    assert got[1] == want[1]


def test_plans_the_cache_dropped_are_recognised_by_their_fields(monkeypatch):
  """More plans than the cache holds (a world of thousands of ranks and params):
  a plan it dropped holds the very objects ``plan`` makes every migration of, so
  it takes its world's family as a held one does. The world's rows are validated
  in full once, not once per rank, and every rank is the full path's record."""
  from jaxreshard._src.engine import plans as _plans

  monkeypatch.setattr(_plans.PlanCache, "MAX_MIGRATIONS", 4)
  records = _records(w=3)
  src = _sources.record_sources(records)
  plans = [jr.plan(records, world_size=7, rank=r) for r in range(7)]
  assert src.plan_cache.match(plans[0]) is None  # dropped: 14 migrations, 4 held
  assert src.plan_cache.made_again(plans[0]) == (7, 0)
  assert src.plan_cache.made_again(tuple(plans[6])) == (7, 6)
  full = []
  real = _pipeline._validate_all
  monkeypatch.setattr(_pipeline, "_validate_all", lambda s, m: full.append(m) or real(s, m))
  together = jr.reshard_ranks(records, plans)
  assert len(full) == 1
  one_by_one = [jr.reshard(records, p) for p in plans]
  assert len(full) == 1
  for r, p in enumerate(plans):
    want = jr.reshard(_records(w=3), [dataclasses.replace(m) for m in p])
    assert_records_equal(together[r], want)
    assert_records_equal(one_by_one[r], want)
    assert [x.rank for x in want.placements] == [r, r]


def _set_all(migrations, field, value):
  for m in migrations:
    object.__setattr__(m, field, value)


@pytest.mark.parametrize(
  "forge",
  [
    # Equal to the plan's item, but not its objects: sources of bools, a float rank,
    # a shape made again, another list's sources tuple of the same ints.
    lambda p: p.__setitem__(
      -1, dataclasses.replace(p[-1], sources=tuple(map(bool, p[-1].sources)))
    ),
    lambda p: p.__setitem__(-1, dataclasses.replace(p[-1], rank=float(p[-1].rank))),
    lambda p: p.__setitem__(-1, dataclasses.replace(p[-1], shape=tuple(list(p[-1].shape)))),
    lambda p: p.__setitem__(-1, dataclasses.replace(p[-1], sources=tuple(list(p[-1].sources)))),
    # Another target rank, world size or order; one item fewer or twice.
    lambda p: p.__setitem__(-1, dataclasses.replace(p[-1], rank=0)),
    lambda p: p.__setitem__(-1, dataclasses.replace(p[-1], world_size=8)),
    lambda p: p.reverse(),
    lambda p: p.pop(),
    lambda p: p.append(p[0]),
    # Items written in place (bypassing the frozen dataclass): one, or every item
    # given one rank object that is no int (a float, a bool).
    lambda p: object.__setattr__(p[-1], "rank", float(p[-1].rank)),
    lambda p: object.__setattr__(p[-1], "world_size", 6),
    lambda p: _set_all(p, "rank", float(p[0].rank)),
    lambda p: _set_all(p, "rank", True),
  ],
)
def test_a_dropped_plan_edited_is_validated_in_full(monkeypatch, forge):
  """A list of a plan the cache dropped, then edited: recognised by nothing, it is
  validated in full, and gives what records that never saw a plan give (the same
  record, or the same refusal in the same words)."""
  from jaxreshard._src.engine import plans as _plans

  monkeypatch.setattr(_plans.PlanCache, "MAX_MIGRATIONS", 4)
  records = _records(w=3)
  src = _sources.record_sources(records)
  plans = [jr.plan(records, world_size=7, rank=r) for r in range(7)]
  jr.reshard_ranks(records, plans)  # the world's family is validated and remembered
  p = plans[1]
  assert src.plan_cache.match(p) is None
  forge(p)
  assert src.plan_cache.made_again(p) is None
  want = _outcome(_records(w=3), [dataclasses.replace(m) for m in p])
  _assert_same_outcome(_outcome(records, p), want)
  with pytest.raises(jr.ReshardError) if want[0] != "ok" else contextlib.nullcontext():
    jr.reshard_ranks(records, [plans[0], p])
