"""Records whose placements and state are made from packed buffers when first read.

A deferred record must be indistinguishable from one built with its fields:
equal, printed, flattened, copied and pickled alike, the same objects on every
read, and bit for bit the oracle's shards.
"""

import copy
import dataclasses
import gc
import pickle
import threading

import jax
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.core.record import deferred_parts
from tests._core_util import (
  OPTIMIZERS,
  assert_bits_equal,
  assert_records_equal,
  bits,
  leaf_at,
  oracle_shard,
  random_state,
  small_params,
)


def _eager(record: jr.ShardRecord) -> jr.ShardRecord:
  """The same record built with its fields (the constructor's way)."""
  return jr.ShardRecord(record.version, record.placements, record.state, record.roles)


@pytest.fixture(scope="module")
def adam():
  opt = optax.adam(1e-2)
  params = small_params()
  state = random_state(opt, params)
  return params, state, jr.shard_state(opt, params, state, world_size=3)


def _target(records, rank=1, world=4):
  return jr.reshard(records, jr.plan(records, world_size=world, rank=rank))


def test_a_host_reshard_is_deferred_and_reads_the_same_objects(adam):
  _, _, records = adam
  target = _target(records)
  assert deferred_parts(target) is not None
  assert "state" not in vars(target) and "placements" not in vars(target)
  state, placements = target.state, target.placements
  assert target.state is state and target.placements is placements
  assert isinstance(placements, tuple) and all(isinstance(p, jr.ParamPlacement) for p in placements)


def test_a_deferred_record_equals_and_prints_as_an_eager_one(adam):
  _, _, records = adam
  target = _target(records)
  eager = _eager(_target(records))
  assert_records_equal(target, eager)
  assert repr(_target(records)) == repr(eager)
  # Dataclass equality compares placements and roles, and the state's leaves.
  assert _target(records).placements == eager.placements


def test_the_leaves_are_the_oracle_shards(adam):
  """Each history buffer is the oracle's shard of the full buffer, bit for bit."""
  _, state, records = adam
  target = _target(records, rank=2, world=5)
  checked = 0
  for (path, leaf), role in zip(
    jax.tree_util.tree_flatten_with_path(target.state)[0], target.roles
  ):
    if role is not None:
      assert_bits_equal(leaf, oracle_shard(leaf_at(state, path), 5, 2), jax.tree_util.keystr(path))
      checked += 1
  assert checked > 0


def test_a_deferred_record_flattens_copies_and_pickles_as_an_eager_one(adam):
  _, _, records = adam
  leaves, treedef = jax.tree_util.tree_flatten(_target(records))
  eager_leaves, eager_def = jax.tree_util.tree_flatten(_eager(_target(records)))
  assert treedef == eager_def
  for a, b in zip(leaves, eager_leaves):
    assert_bits_equal(a, b)
  rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
  assert deferred_parts(rebuilt) is None
  assert_records_equal(rebuilt, _eager(_target(records)))
  for made in (
    copy.copy(_target(records)),
    copy.deepcopy(_target(records)),
    pickle.loads(pickle.dumps(_target(records))),
    dataclasses.replace(_target(records)),
  ):
    assert deferred_parts(made) is None
    assert_records_equal(made, _eager(_target(records)))


def test_a_deferred_record_is_still_frozen(adam):
  _, _, records = adam
  target = _target(records)
  with pytest.raises(dataclasses.FrozenInstanceError):
    target.state = None  # type: ignore[misc]
  with pytest.raises(AttributeError, match="no attribute 'nothing'"):
    target.nothing  # noqa: B018


def test_threads_reading_a_deferred_record_at_once_see_one_state(adam):
  _, _, records = adam
  target = _target(records)
  seen, barrier = [], threading.Barrier(4)

  def read():
    barrier.wait()
    seen.append((target.state, target.placements))

  threads = [threading.Thread(target=read) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert all(s is seen[0][0] and p is seen[0][1] for s, p in seen)


@pytest.mark.parametrize("name", ["masked", "multi_transform", "inject_hyperparams", "lion"])
def test_deferred_records_of_every_kind_of_state_round_trip(name):
  """W -> M -> W through deferred records gives the original archives, bit for bit."""
  opt = OPTIMIZERS[name]()
  params = small_params()
  state = random_state(opt, params)
  records = jr.shard_state(opt, params, state, world_size=3)
  middle = jr.reshard_ranks(records, [jr.plan(records, world_size=5, rank=r) for r in range(5)])
  back = jr.reshard_ranks(middle, [jr.plan(middle, world_size=3, rank=r) for r in range(3)])
  for a, b in zip(back, records):
    assert_records_equal(a, _eager(b))


def test_the_leaves_view_the_packed_buffers(adam):
  """A rank's history buffers are views of one buffer per dtype: writing through a
  leaf is seen in the packed buffer (nothing was copied per leaf)."""
  _, _, records = adam
  target = _target(records)
  parts = deferred_parts(target)
  for leaf, role in zip(jax.tree_util.tree_leaves(target.state), target.roles):
    if role is not None and np.size(leaf):
      assert any(np.shares_memory(leaf, b) for b in parts.buffers.values())
  assert sum(int(bits(b).size) for b in parts.buffers.values()) == sum(
    int(np.size(x)) for x, r in zip(jax.tree_util.tree_leaves(target.state), target.roles) if r
  )


@pytest.mark.parametrize(
  "name", ["adam", "masked", "multi_transform", "inject_hyperparams", "chain_clip_schedule"]
)
@pytest.mark.parametrize("subset", ["every param", "some params"])
def test_a_deferred_record_is_the_eager_record(monkeypatch, name, subset):
  """The structure worked out once (markers in place of the buffers) gives the record
  the eager build gives: placements, roles, tree structure and bits, also for a
  target holding some of the params (its subtrees rebuilt from the group's)."""
  from jaxreshard._src.engine import pipeline as _pipeline

  opt = OPTIMIZERS[name]()
  params = small_params()
  records = jr.shard_state(opt, params, random_state(opt, params), world_size=3)
  plan = jr.plan(records, world_size=4, rank=2)
  if subset == "some params":
    plan = [m for m in plan if m.param in ("dense/bias", "emb", "scale")]
  got = jr.reshard(records, plan)
  assert deferred_parts(got) is not None
  monkeypatch.setattr(
    _pipeline,
    "deferred",
    lambda src, groups, layout, buffers: _pipeline.eager(
      src, groups, layout, buffers, logical=False
    ),
  )
  want = jr.reshard(records, [jr.Migration(**vars(m)) for m in plan])
  assert deferred_parts(want) is None
  assert_records_equal(got, want)


@pytest.mark.parametrize("field", ["state", "placements"])
def test_reading_a_deferred_field_runs_no_garbage_collection(field):
  """Making a field allocates an object or more per parameter and no reference
  cycle: the cyclic collector stays paused (with a live model's state, each
  collection the allocations would trigger walks every object), and is enabled
  again afterwards."""
  opt = optax.sgd(0.1, momentum=0.9)
  params = {f"p{i:03d}": jax.numpy.zeros((3,)) for i in range(300)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  target = _target(records, rank=0, world=3)
  collections = []
  callback = lambda phase, info: collections.append(phase) if phase == "start" else None
  threshold = gc.get_threshold()
  gc.callbacks.append(callback)
  gc.set_threshold(1)  # a collection at nearly every allocation, were the collector running
  try:
    getattr(target, field)
    inside = len(collections)
  finally:
    gc.set_threshold(*threshold)
    gc.callbacks.remove(callback)
  assert gc.isenabled()
  # A few around the pause (the record's own lookups); unpaused, one or more
  # per parameter.
  assert inside <= 10
