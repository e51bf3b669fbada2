"""FlatShard geometry against hand-computed values.

A param of ``count`` elements over ``W`` ranks has ``slots = ceil(count / W)`` elements
per rank; rank ``r`` owns ``[min(r * slots, count), min((r + 1) * slots, count))`` of the
flattened param and pads the rest of its slots with zeros.
"""

import dataclasses

import numpy as np
import pytest

import jaxreshard as jr
from tests._core_util import oracle_shard, oracle_slots


@pytest.mark.parametrize(
  "shape, rank, world, count, slots, start, stop",
  [
    ((3, 4), 1, 5, 12, 3, 3, 6),  # 12 elements over 5 ranks: 3 slots each
    ((), 0, 1, 1, 1, 0, 1),  # scalar: count 1
    ((), 0, 3, 1, 1, 0, 1),
    ((), 2, 3, 1, 1, 1, 1),  # scalar over 3 ranks: ranks 1, 2 are all padding
    ((1,), 0, 1, 1, 1, 0, 1),
    ((1,), 5, 8, 1, 1, 1, 1),
    ((0,), 0, 4, 0, 0, 0, 0),  # zero-size: no slots at all
    ((3, 0, 2), 2, 3, 0, 0, 0, 0),
    ((5,), 0, 4, 5, 2, 0, 2),
    ((5,), 2, 4, 5, 2, 4, 5),  # owns [4, 5) plus one pad
    ((5,), 3, 4, 5, 2, 5, 5),  # trailing rank: all padding
    ((7,), 5, 6, 7, 2, 7, 7),  # ranks 4 and 5 of 6 own nothing
    ((17,), 16, 17, 17, 1, 16, 17),
    ((2, 3, 4), 2, 5, 24, 5, 10, 15),
  ],
)
def test_flat_shard_values(shape, rank, world, count, slots, start, stop):
  g = jr.FlatShard(shape=shape, rank=rank, world_size=world)
  assert (g.count, g.slots, g.start, g.stop) == (count, slots, start, stop)
  assert g.owned == stop - start
  assert g.shape == tuple(shape)


def test_trailing_all_padding_ranks_cover_exactly_once():
  # count 5, W 4 and count 1, W 7: ranks partition [0, count).
  for shape, world in [((5,), 4), ((), 7), ((13, 1), 12), ((3,), 16)]:
    gs = [jr.FlatShard(shape, r, world) for r in range(world)]
    owned = [i for g in gs for i in range(g.start, g.stop)]
    assert owned == list(range(gs[0].count))
    assert all(g.slots == gs[0].slots for g in gs)
    assert gs[-1].owned == 0  # every one of these layouts ends in an all-padding rank


@pytest.mark.parametrize("count", [0, 1, 2, 5, 7, 12, 17, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 16, 17])
def test_geometry_matches_numpy_oracle(count, world):
  full = np.arange(1, count + 1, dtype=np.float32)
  for r in range(world):
    g = jr.FlatShard((count,), r, world)
    shard = oracle_shard(full, world, r)
    assert g.slots == oracle_slots(count, world) == shard.size
    # The owned range holds exactly the non-padding values (all are >= 1).
    np.testing.assert_array_equal(shard[: g.owned], full[g.start : g.stop])
    assert not shard[g.owned :].any()


def test_numpy_integer_inputs_are_normalized():
  g = jr.FlatShard(shape=np.array([3, 4]), rank=np.int64(1), world_size=np.int32(5))
  assert g.shape == (3, 4) and type(g.rank) is int and type(g.world_size) is int
  assert g == jr.FlatShard((3, 4), 1, 5)


@pytest.mark.parametrize(
  "shape, rank, world, needle",
  [
    ((4,), 0, 0, "world_size 0"),
    ((4,), 0, -3, "world_size -3"),
    ((4,), -1, 4, "rank -1"),
    ((4,), 4, 4, "rank 4"),
    ((4,), 9, 4, "rank 9"),
    ((), 1, 1, "rank 1"),
    ((3, -1), 0, 2, "negative"),
    ((-5,), 0, 1, "negative"),
    ((2**40, 2**40), 0, 1, "64-bit"),  # 2**80 elements overflow an int64 index
    ((2**63,), 0, 1, "64-bit"),
    ((2.5,), 0, 1, "integers"),
    ((4,), 0.0, 1, "rank must be an integer"),
    ((4,), True, 2, "rank must be an integer, not the bool True"),
    ((4,), 0, True, "world_size must be an integer, not the bool"),
    ((4,), 0, None, "world_size must be an integer, not NoneType"),
    ((True, 2), 0, 1, "bool"),
    ((4,), 0, 2**20 + 1, "more than the 1048576 ranks"),
  ],
)
def test_invalid_geometry_is_a_placement_error(shape, rank, world, needle):
  with pytest.raises(jr.PlacementError, match=needle):
    jr.FlatShard(shape, rank, world)


def test_placement_error_is_a_reshard_error_and_value_error():
  with pytest.raises(ValueError):
    jr.FlatShard((1,), 1, 1)
  assert issubclass(jr.PlacementError, jr.ReshardError)
  assert issubclass(jr.ShapeError, jr.ReshardError)
  assert issubclass(jr.DtypeError, jr.PlacementError) and issubclass(jr.DtypeError, jr.ShapeError)


def test_flat_shard_is_frozen_and_hashable():
  g = jr.FlatShard((5,), 1, 4)
  with pytest.raises(dataclasses.FrozenInstanceError):
    g.rank = 2  # type: ignore[misc]
  assert len({g, jr.FlatShard((5,), 1, 4)}) == 1


def test_all_padding_ranks_are_each_checked_and_spread_over_the_target_ranks():
  """``copyplan.padding_ranks`` against the rule written out rank by rank: a source
  rank holding only padding is checked by every target rank whose slots meet its
  slots, or, past the target world's padded buffer, by target rank
  ``k * T // S`` alone; together every such rank is checked, and no target rank
  checks more than the ranks meeting its slots plus ``ceil(S / T)``. Asked for one
  target rank at a time and for ranges of them, it gives the same pairs."""
  from jaxreshard._src.core.copyplan import padding_ranks

  rng = np.random.default_rng(0)
  cases = [(n, s, t) for n in (0, 1, 2, 3, 7, 40) for s in (1, 2, 3, 8, 13) for t in (1, 2, 5, 8)]
  cases += [tuple(int(x) for x in rng.integers([0, 1, 1], [300, 70, 70])) for _ in range(300)]
  for n, S, T in cases:
    ss, ts = -(-n // S), -(-n // T)
    want = {}
    for k in range(S):
      if ss == 0 or k * ss < n:
        continue  # owns data (or the param has no elements: no slots)
      if k * ss < T * ts:
        want[k] = [t for t in range(T) if t * ts < (k + 1) * ss and k * ss < (t + 1) * ts]
      else:
        want[k] = [k * T // S]
    one = lambda a: np.asarray([a], np.int64)  # noqa: E731
    got = {}
    for t in range(T):
      row, ks = padding_ranks(one(n), one(ss), one(S), one(t), one(t + 1), one(ts), one(T))
      assert (row == 0).all() and list(ks) == sorted(set(ks.tolist()))
      for k in ks.tolist():
        got.setdefault(k, []).append(t)
      meeting = sum(1 for k in range(S) if ss and t * ts < (k + 1) * ss and k * ss < (t + 1) * ts)
      assert len(ks) <= meeting + -(-S // T), (n, S, T, t)
    assert got == want, (n, S, T)
    # Ranges of target ranks, several rows at once: the union of their ranks' pairs.
    cut = int(rng.integers(0, T + 1))
    ranges = [(0, cut), (cut, T)]
    rows = len(ranges)
    row, ks = padding_ranks(
      np.full(rows, n),
      np.full(rows, ss),
      np.full(rows, S),
      np.asarray([a for a, _ in ranges]),
      np.asarray([b for _, b in ranges]),
      np.full(rows, ts),
      np.full(rows, T),
    )
    for i, (a, b) in enumerate(ranges):
      mine = sorted(k for k, ts_ in want.items() if any(a <= x < b for x in ts_))
      assert ks[row == i].tolist() == mine, (n, S, T, a, b)
