"""What a result shares with its sources and with other results: nothing a caller can
write into. History buffers are fresh memory per target; numpy clock scalars, which
numpy lets a caller write in place, are copies of their own in every state built."""

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


def test_targets_keep_the_clock_their_sources_were_validated_with():
  """A source's clock written in place after the records were first resharded: the
  same record objects are remembered as validated, and their targets carry the clock
  that validation saw, never the one written later; fresh records are validated anew
  and refused, since their clocks now differ."""
  src = _numpy_clock_records(2)
  plan = jr.plan(src, world_size=3, rank=0)
  assert int(jr.reshard(src, plan).state[0].count) == 3
  src[0].state[0].count[...] = 99
  assert int(jr.reshard(src, plan).state[0].count) == 3
  fresh = [jr.ShardRecord(r.version, r.placements, r.state, r.roles) for r in src]
  with pytest.raises(jr.PlacementError):
    jr.reshard(fresh, jr.plan(fresh, world_size=3, rank=0))


def test_buffers_are_read_at_each_call_and_a_new_record_is_checked_afresh():
  """Writes into a source buffer are seen by the next call; a buffer replaced in a
  remembered record's dicts is not (the README says so); the same state in a new
  record (``dataclasses.replace``) is read and checked afresh."""
  import dataclasses

  src = _numpy_clock_records(2)
  plan = jr.plan(src, world_size=1, rank=0)
  jr.reshard(src, plan)
  src[1].state[0].mu["w"][...] = 7.0  # rank 1 owns elements 3..5
  got = jr.reshard(src, plan).state[0].mu["w"]
  np.testing.assert_array_equal(np.asarray(got)[3:], [7.0, 7.0, 7.0])
  src[1].state[0].mu["w"] = np.full((3,), 9.0, np.float32)  # replaced: not seen
  np.testing.assert_array_equal(np.asarray(jr.reshard(src, plan).state[0].mu["w"])[3:], [7.0] * 3)
  fresh = [dataclasses.replace(r) for r in src]
  np.testing.assert_array_equal(np.asarray(jr.reshard(fresh, plan).state[0].mu["w"])[3:], [9.0] * 3)
  src[1].state[0].mu["w"] = np.full((4,), 9.0, np.float32)  # of another shape: refused afresh
  with pytest.raises(jr.ShapeError):
    jr.reshard([dataclasses.replace(r) for r in src], plan)
