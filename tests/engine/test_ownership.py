"""What a result shares with its sources and with other results: nothing a caller can
write into. History buffers are fresh memory per target; numpy clock scalars, which
numpy lets a caller write in place, are copies of their own in every state built."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr


def _numpy_clock_records(world):
  """Adam records over ``world`` ranks whose step count is a 0-d numpy array."""
  opt = optax.adam(1e-3)
  params = {"w": jnp.arange(6.0, dtype=jnp.float32)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=world)
  out = []
  for r in records:
    s = r.state[0]
    adam = s._replace(
      count=np.asarray(3, np.int32), mu={"w": np.array(s.mu["w"])}, nu={"w": np.array(s.nu["w"])}
    )
    out.append(jr.ShardRecord(r.version, r.placements, (adam, *r.state[1:]), r.roles))
  return out


@pytest.mark.parametrize("how", ["reshard", "reshard_ranks"])
def test_a_write_into_one_target_s_clock_reaches_no_other_state(how):
  src = _numpy_clock_records(2)
  plans = [jr.plan(src, world_size=3, rank=r) for r in range(3)]
  if how == "reshard":
    targets = [jr.reshard(src, p) for p in plans]
  else:
    targets = jr.reshard_ranks(src, plans)
  counts = [t.state[0].count for t in targets]
  assert all(isinstance(c, np.ndarray) and c.dtype == np.int32 for c in counts)
  counts[0][...] = 99
  assert [int(t.state[0].count) for t in targets] == [99, 3, 3]
  assert [int(r.state[0].count) for r in src] == [3, 3]
  again = jr.reshard(src, plans[1])
  assert int(again.state[0].count) == 3


def test_a_clock_written_in_place_into_remembered_records_is_checked_afresh():
  """A source's numpy clock written in place after the records were first resharded:
  the same record objects are taken apart and checked again, so one record's new
  step is refused (as a save and a restore of them refuse it, and as fresh records
  are), and a step written into every record is carried to the targets."""
  src = _numpy_clock_records(2)
  plan = jr.plan(src, world_size=3, rank=0)
  assert int(jr.reshard(src, plan).state[0].count) == 3
  src[0].state[0].count[...] = 99
  with pytest.raises(jr.PlacementError, match=r"clock scalar \[0\]\.count"):
    jr.reshard(src, plan)
  fresh = [jr.ShardRecord(r.version, r.placements, r.state, r.roles) for r in src]
  with pytest.raises(jr.PlacementError):
    jr.reshard(fresh, jr.plan(fresh, world_size=3, rank=0))
  src[1].state[0].count[...] = 99
  assert int(jr.reshard(src, plan).state[0].count) == 99
  assert [int(t.state[0].count) for t in jr.reshard_ranks(src, [plan])] == [99]


@pytest.mark.parametrize(
  "change",
  [
    pytest.param(lambda c: setattr(c, "dtype", np.uint32), id="dtype"),
    pytest.param(lambda c: setattr(c, "shape", (1,)), id="shape"),
  ],
)
def test_a_clock_s_dtype_or_shape_changed_in_place_in_remembered_records_is_seen(change):
  """A source's numpy clock whose dtype (the same bits) or shape is changed in place
  after the records were first resharded: the records are taken apart afresh, and
  archives whose clocks now differ are refused, as a new list of them is."""
  src = _numpy_clock_records(2)
  plan = jr.plan(src, world_size=3, rank=0)
  assert int(jr.reshard(src, plan).state[0].count) == 3
  change(src[0].state[0].count)
  with pytest.raises(jr.PlacementError, match="count"):
    jr.reshard(src, plan)
  with pytest.raises(jr.PlacementError, match="count"):
    jr.reshard(list(src), plan)


def test_buffers_are_read_at_each_call_and_a_new_record_is_checked_afresh():
  """Writes into a source buffer are seen by the next call, and so is a buffer
  replaced in a remembered record's dicts; the same state in a new record
  (``dataclasses.replace``) is read and checked afresh."""
  import dataclasses

  src = _numpy_clock_records(2)
  plan = jr.plan(src, world_size=1, rank=0)
  jr.reshard(src, plan)
  src[1].state[0].mu["w"][...] = 7.0  # rank 1 owns elements 3..5
  got = jr.reshard(src, plan).state[0].mu["w"]
  np.testing.assert_array_equal(np.asarray(got)[3:], [7.0, 7.0, 7.0])
  src[1].state[0].mu["w"] = np.full((3,), 9.0, np.float32)  # replaced: seen
  np.testing.assert_array_equal(np.asarray(jr.reshard(src, plan).state[0].mu["w"])[3:], [9.0] * 3)
  fresh = [dataclasses.replace(r) for r in src]
  np.testing.assert_array_equal(np.asarray(jr.reshard(fresh, plan).state[0].mu["w"])[3:], [9.0] * 3)
  src[1].state[0].mu["w"] = np.full((4,), 9.0, np.float32)  # of another shape: refused afresh
  with pytest.raises(jr.ShapeError):
    jr.reshard([dataclasses.replace(r) for r in src], plan)


def _hyper_records(world, lr=1e-3):
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
  params = {"w": jnp.arange(6.0, dtype=jnp.float32), "b": jnp.ones((), jnp.float32)}
  return jr.shard_state(opt, params, opt.init(params), world_size=world)


def _lr_bits(state):
  return np.asarray(state.hyperparams["learning_rate"]).view(np.uint32).item()


def _state_by(how, src):
  """Target rank 1 of 3 of ``src`` by ``how``, or the whole state by ``unshard_state``."""
  if how == "unshard_state":
    return jr.unshard_state(src)
  if how == "reshard_ranks":
    return jr.reshard_ranks(src, [jr.plan(src, world_size=3, rank=r) for r in range(3)])[1].state
  return jr.reshard(src, jr.plan(src, world_size=3, rank=1)).state


@pytest.mark.parametrize("how", ["reshard", "reshard_ranks", "unshard_state"])
def test_a_clock_scalar_replaced_in_a_remembered_record_s_dict_is_seen(how):
  """optax's idiom ``state.hyperparams["learning_rate"] = x`` on source records
  already resharded once: the next call takes the records apart afresh and carries
  the new value (bits of 0.25 are 0x3E800000), never the one seen before."""
  src = _hyper_records(2)

  run = lambda: _state_by(how, src)

  assert _lr_bits(run()) == np.float32(1e-3).view(np.uint32)
  for r in src:
    r.state.hyperparams["learning_rate"] = jnp.asarray(0.25, jnp.float32)
  assert _lr_bits(run()) == 0x3E800000
  for r in src:
    r.state.hyperparams["learning_rate"] = np.asarray(0.5, np.float32)
  assert _lr_bits(run()) == 0x3F000000


def test_a_clock_replaced_in_one_remembered_record_only_is_refused():
  """The records are checked afresh, so archives whose clocks now differ are refused
  as a new list of them is, with the scalar's path in the message."""
  src = _hyper_records(2)
  plan = jr.plan(src, world_size=1, rank=0)
  jr.reshard(src, plan)
  src[1].state.hyperparams["learning_rate"] = jnp.asarray(0.25, jnp.float32)
  with pytest.raises(jr.PlacementError, match="learning_rate"):
    jr.reshard(src, plan)
  with pytest.raises(jr.PlacementError, match="learning_rate"):
    jr.reshard(list(src), plan)


def test_a_clock_in_a_hand_built_record_s_dict_state_is_guarded():
  """A hand-built record whose state is a dict: its step replaced is seen."""
  buf = np.arange(4.0, dtype=np.float32)
  placement = jr.ParamPlacement("w", (4,), 0, 1)
  rec = jr.ShardRecord(1, (placement,), {"step": np.asarray(3, np.int32), "mu": {"w": buf}})
  src = [rec]
  assert int(jr.unshard_state(src)["step"]) == 3
  rec.state["step"] = np.asarray(4, np.int32)
  assert int(jr.unshard_state(src)["step"]) == 4


def _read_only_clock_records(world, counts):
  """Adam records whose step counts are read-only 0-d views of ``counts``' elements."""
  out = []
  for i, r in enumerate(_numpy_clock_records(world)):
    count = counts[i : i + 1].reshape(())
    count.flags.writeable = False
    out.append(
      jr.ShardRecord(
        r.version, r.placements, (r.state[0]._replace(count=count), *r.state[1:]), r.roles
      )
    )
  return out


@pytest.mark.parametrize("how", ["reshard", "reshard_ranks", "unshard_state"])
def test_a_read_only_clock_written_through_its_base_is_seen(how):
  """A count that was read-only when the records were first taken apart, written
  through the array it views: the next call builds the new count, and archives
  whose counts now differ are refused, as a new list of the records is."""
  counts = np.zeros(2, np.int32)
  src = _read_only_clock_records(2, counts)

  run = lambda: _state_by(how, src)

  assert int(run()[0].count) == 0
  counts[:] = 42
  assert int(run()[0].count) == 42
  counts[1] = 9
  with pytest.raises(jr.PlacementError, match="count"):
    run()


def test_a_read_only_clock_made_writable_and_written_is_seen():
  counts = np.zeros(2, np.int32)
  src = _read_only_clock_records(2, counts)
  plan = jr.plan(src, world_size=3, rank=0)
  assert int(jr.reshard(src, plan).state[0].count) == 0
  count = src[1].state[0].count
  count.flags.writeable = True
  count[...] = 9
  with pytest.raises(jr.PlacementError, match="count"):
    jr.reshard(src, plan)


@pytest.mark.parametrize(
  "how", ["shard_state", "unshard_state", "reshard-host", "reshard-device", "reshard_ranks"]
)
def test_a_step_donating_one_result_s_state_leaves_every_other_clock_alive(how):
  """jax clock leaves (a step count, injected hyper-parameters) are copies in every
  state built: a jitted step donating one result's state deletes its buffers, and
  deleted the sources' and the other targets' clocks with them (one object)."""
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
  params = {"w": jnp.arange(5.0)}
  state = opt.init(params)
  records = jr.shard_state(opt, params, state, world_size=2)
  if how == "shard_state":
    sources, results = [state], [r.state for r in records]
  elif how == "unshard_state":
    sources, results = [r.state for r in records], [jr.unshard_state(records)]
  elif how == "reshard_ranks":
    plans = [jr.plan(records, world_size=3, rank=r) for r in range(3)]
    sources, results = (
      [r.state for r in records],
      [t.state for t in jr.reshard_ranks(records, plans)],
    )
  else:
    plan = jr.plan(records, world_size=3, rank=1)
    executor = how.split("-")[1]
    sources = [r.state for r in records]
    results = [jr.reshard(records, plan, executor=executor).state for _ in range(2)]
  clocks = lambda s: [x for x in jax.tree.leaves(s) if getattr(x, "ndim", None) == 0]
  assert all(isinstance(x, jax.Array) for x in clocks(results[0]))
  for x in jax.tree.leaves(results[0]):
    if isinstance(x, jax.Array):
      x.delete()  # what a step donating the state does to its buffers
  for s in sources + results[1:]:
    assert [x.is_deleted() for x in clocks(s)] == [False] * len(clocks(s))
    assert np.asarray(s.hyperparams["learning_rate"]).tolist() == np.float32(1e-3).tolist()
  if how != "shard_state":
    again = jr.reshard(records, jr.plan(records, world_size=3, rank=0))
    assert int(again.state.count) == 0
