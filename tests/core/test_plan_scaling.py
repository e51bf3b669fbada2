"""Planning costs work in proportion to the parameters, whatever their grouping.

Work is counted, not timed: the number of function calls (Python and builtin,
as ``cProfile`` counts them) of a plan, reshard or restore. Constant costs
cancel in the differences ``calls(4n) - calls(2n)`` and ``calls(2n) - calls(n)``,
whose ratio is 2 for linear work and 4 for quadratic work.
"""

import cProfile
import dataclasses
import itertools
import pstats

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr

W = 8


# Every test here is slow: `pytest -m "not slow"` skips them, plain `pytest` runs them.
pytestmark = pytest.mark.slow


class _Id(str):
  """A param id whose comparisons are function calls, so that the count sees them.

  Each archive gets its own objects, as ids read on different hosts are.
  """

  __hash__ = str.__hash__

  def __eq__(self, other):
    return str.__eq__(self, other)

  def __ne__(self, other):
    return str.__ne__(self, other)


def _one_group_per_param(n):
  """``n`` params over the same 8 archives, each param with its own rank order:
  one group per parameter. Archive 0 holds rank 0 of every param (an archive of
  one rank); the others hold a different rank of each."""
  orders = list(itertools.permutations(range(1, W)))
  picks = np.random.default_rng(n).choice(len(orders), n, replace=False)
  perms = [(0,) + orders[i] for i in picks.tolist()]
  opt = optax.adam(1e-3)
  p = {"w": jnp.zeros((3,), jnp.float32)}
  base = jr.shard_state(opt, p, opt.init(p), world_size=1)[0]
  pids = [f"p{i:05d}" for i in range(n)]
  records = []
  for a in range(W):
    ids = [_Id(pid) for pid in pids]
    state = (
      base.state[0]._replace(
        mu={pid: np.full(2, a, np.float32) for pid in pids},
        nu={pid: np.full(2, -a, np.float32) for pid in pids},
      ),
      base.state[1],
    )
    placements = tuple(
      jr.ParamPlacement(ids[i], (2 * W,), perms[i][a], W, jnp.float32, True) for i in range(n)
    )
    records.append(jr.ShardRecord(1, placements, state, tuple([None] + pids + pids)))
  return records


def _calls(fn):
  prof = cProfile.Profile()
  prof.enable()
  try:
    fn()
  finally:
    prof.disable()
  return pstats.Stats(prof).total_calls


def _growth(measure, sizes=(300, 600, 1200)):
  """(calls(4n) - calls(2n)) / (calls(2n) - calls(n)) of ``measure(n)``."""
  measure(sizes[0])  # first calls (imports, caches) are not part of the growth
  c = [measure(n) for n in sizes]
  return (c[2] - c[1]) / (c[1] - c[0])


def test_one_group_per_param_plans_and_reshards_in_linear_work():
  def measure(n):
    records = _one_group_per_param(n)
    return _calls(lambda: jr.reshard(records, jr.plan(records, world_size=3, rank=1)))

  assert _growth(measure) < 2.4


def test_one_group_per_param_restores_in_linear_work(tmp_path):
  paths = {}

  def measure(n):
    if n not in paths:
      paths[n] = tmp_path / f"ckpt{n}"
      jr.save_records(paths[n], _one_group_per_param(n))
    return _calls(lambda: jr.restore_ranks(paths[n], [0, 2], world_size=3))

  assert _growth(measure) < 2.4


def test_one_group_per_param_restores_the_bits_reshard_gives(tmp_path):
  records = _one_group_per_param(50)
  jr.save_records(tmp_path / "ckpt", records)
  loaded = jr.load_records(tmp_path / "ckpt")
  for rank in range(3):
    expected = jr.reshard(loaded, jr.plan(loaded, world_size=3, rank=rank))
    got = jr.restore(tmp_path / "ckpt", world_size=3, rank=rank)
    assert got.placements == expected.placements
    for a, b in zip(got.state[0].mu.values(), expected.state[0].mu.values(), strict=True):
      assert np.asarray(a).view(np.uint32).tobytes() == np.asarray(b).view(np.uint32).tobytes()


def test_placements_that_cannot_be_hashed_are_refused_by_name():
  """Archives are compared by numbered layout keys; a placement with a list for its
  shape or dtype still reaches the refusal that names it (not a TypeError)."""
  opt = optax.adam(1e-3)
  params = {"w": jnp.zeros((4,), jnp.float32)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  for field, value, error in (("shape", [4.5], jr.PlacementError), ("dtype", [1], jr.DtypeError)):
    bad = [
      jr.ShardRecord(
        r.version, (dataclasses.replace(r.placements[0], **{field: value}),), r.state, r.roles
      )
      for r in records
    ]
    with pytest.raises(error, match="param 'w': archive 0"):
      jr.reshard(bad, [jr.Migration("w", (4,), 0, 1, (0, 1))])
