"""Records restored from two different saves are never combined, even at the same step
and layout: every path that combines records refuses them, as ``jaxreshard merge``
refuses parts of two saves. Records of one save combine, whatever copy of it they
were read from, and so do records a checkpoint resharded from it holds."""

from __future__ import annotations

import pickle
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.cli.commands import app

OPT = optax.adam(1e-3)
PARAMS = {"x": jnp.ones((8,)), "y": jnp.ones((3,))}


def _state(seed):
  """An Adam state at step 0 whose moments are random: two runs, one step."""
  rng = np.random.default_rng(seed)
  with jax.numpy_dtype_promotion("standard"):
    state = OPT.init(PARAMS)
  return jax.tree.map(
    lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype)) if x.ndim else x, state
  )


@pytest.fixture
def two(tmp_path):
  a, b = tmp_path / "A", tmp_path / "B"
  jr.save_records(a, jr.shard_state(OPT, PARAMS, _state(1), world_size=4))
  jr.save_records(b, jr.shard_state(OPT, PARAMS, _state(2), world_size=4))
  return a, b


def _mixed(two, how):
  a, b = two
  if how == "restore":
    return [jr.restore(a, world_size=2, rank=0), jr.restore(b, world_size=2, rank=1)]
  if how == "restore_ranks":
    return jr.restore_ranks(a, [0, 1], world_size=3)[:2] + jr.restore_ranks(b, [2], world_size=3)
  loaded_a, loaded_b = jr.load_records(a), jr.load_records(b)
  return loaded_a[:2] + loaded_b[2:]


@pytest.mark.parametrize("how", ["restore", "restore_ranks", "load_records"])
@pytest.mark.parametrize(
  "path", ["reshard", "reshard_ranks", "unshard_state", "save_records", "ReshardSave"]
)
def test_records_of_two_saves_are_refused_on_every_path(two, tmp_path, how, path):
  records = _mixed(two, how)
  ids = {jr.open_checkpoint(p).id for p in two}
  assert {r.checkpoint_id for r in records} == ids
  world = len(records)
  out = tmp_path / "out"
  run = {
    "reshard": lambda: jr.reshard(records, jr.plan(records, world_size=1, rank=0)),
    "reshard_ranks": lambda: jr.reshard_ranks(
      records, [jr.plan(records, world_size=world + 1, rank=r) for r in range(world + 1)]
    ),
    "unshard_state": lambda: jr.unshard_state(records),
    "save_records": lambda: jr.save_records(out, records),
  }.get(path)
  with pytest.raises(jr.PlacementError, match=r"hold the states of two checkpoints \(") as e:
    if run is not None:
      run()
    else:
      with ocp.CheckpointManager(out) as manager:
        manager.save(1, args=jr.ReshardSave(records))
        manager.wait_until_finished()
  assert all(i in str(e.value) for i in ids) and "combining parts of two saves" in str(e.value)
  assert not out.exists() or not any(out.iterdir())


def _oracle(seed, world):
  """Each param's moments as ``world`` flat, zero-padded shards, from the state itself."""
  state = _state(seed)[0]
  out = []
  for rank in range(world):
    per = {}
    for kind in ("mu", "nu"):
      for pid, x in getattr(state, kind).items():
        flat = np.asarray(x).reshape(-1)
        slots = -(-flat.size // world)
        padded = np.zeros(slots * world, flat.dtype)
        padded[: flat.size] = flat
        per[kind, pid] = padded[rank * slots : (rank + 1) * slots]
    out.append(per)
  return out


def test_records_of_one_save_combine_from_any_copy_and_carry_its_identity(two, tmp_path):
  a, _ = two
  copy = tmp_path / "copy_of_A"
  shutil.copytree(a, copy)
  records = [jr.restore(a, world_size=2, rank=0), jr.restore(copy, world_size=2, rank=1)]
  ident = jr.open_checkpoint(a).id
  targets = jr.reshard_ranks(records, [jr.plan(records, world_size=3, rank=r) for r in range(3)])
  want = _oracle(1, 3)
  for rank, t in enumerate(targets):
    assert t.checkpoint_id == ident
    for kind in ("mu", "nu"):
      for pid in PARAMS:
        got = np.asarray(getattr(t.state[0], kind)[pid])
        assert got.view(np.uint32).tolist() == want[rank][kind, pid].view(np.uint32).tolist()
  # Saved, the targets make a new checkpoint of their own.
  jr.save_records(tmp_path / "again", targets)
  assert (
    jr.load_records(tmp_path / "again")[0].checkpoint_id
    == jr.open_checkpoint(tmp_path / "again").id
  )


def test_a_part_resharded_from_a_save_combines_with_that_save(two, tmp_path):
  """A part ``jaxreshard reshard --rank`` wrote holds the state of the checkpoint it
  names: its records combine with that checkpoint's, not with another's."""
  a, b = two
  part = tmp_path / "part0"
  result = CliRunner().invoke(app, ["reshard", str(a), str(part), "-w", "2", "--rank", "0"])
  assert result.exit_code == 0, result.output
  p0 = jr.load_records(part)[0]
  assert p0.checkpoint_id == jr.open_checkpoint(a).id != jr.open_checkpoint(part).id
  records = [p0, jr.restore(a, world_size=2, rank=1)]
  target = jr.reshard(records, jr.plan(records, world_size=1, rank=0))
  assert (
    np.asarray(target.state[0].mu["x"]).view(np.uint32).tolist()
    == _oracle(1, 1)[0]["mu", "x"].view(np.uint32).tolist()
  )
  with pytest.raises(jr.PlacementError, match="two checkpoints"):
    jr.unshard_state([p0, jr.restore(b, world_size=2, rank=1)])


def test_records_not_read_from_a_checkpoint_combine_with_any(two):
  a, _ = two
  r0 = jr.restore(a, world_size=2, rank=0)
  hand = jr.ShardRecord(r0.version, r0.placements, r0.state, r0.roles)
  assert hand.checkpoint_id is None and hand == r0
  r1 = jr.restore(a, world_size=2, rank=1)
  target = jr.reshard([hand, r1], jr.plan([hand, r1], world_size=1, rank=0))
  assert target.checkpoint_id == r1.checkpoint_id


def test_the_identity_is_no_part_of_the_record_s_value(two):
  a, _ = two
  r = jr.restore(a, world_size=2, rank=0)
  assert r.checkpoint_id is not None and "checkpoint_id" not in repr(r)
  assert pickle.loads(pickle.dumps(r)).checkpoint_id == r.checkpoint_id
  # A record rebuilt from its leaves holds what the caller put there: no identity.
  rebuilt = jax.tree.map(lambda x: x, r)
  assert rebuilt.checkpoint_id is None
  assert jax.tree.structure(rebuilt) == jax.tree.structure(r)


def test_a_chain_of_reshards_holds_the_state_of_the_first_checkpoint(two, tmp_path):
  """X resharded to Y (all ranks), Y to a part Z0: every one holds X's state, so their
  records combine (a part named Y, one hop back only, and was refused beside Y's)."""
  a, _ = two
  y, z0 = tmp_path / "Y", tmp_path / "Z0"
  for args in ([str(a), str(y), "-w", "2"], [str(y), str(z0), "-w", "3", "--rank", "0"]):
    result = CliRunner().invoke(app, ["reshard", *args])
    assert result.exit_code == 0, result.output
  ident = jr.open_checkpoint(a).id
  parts = [jr.load_records(z0)[0], *jr.restore_ranks(y, [1, 2], world_size=3)]
  assert {r.checkpoint_id for r in parts} == {ident}
  target = jr.reshard(parts, jr.plan(parts, world_size=1, rank=0))
  for kind in ("mu", "nu"):
    for pid in PARAMS:
      got = np.asarray(getattr(target.state[0], kind)[pid])
      assert got.view(np.uint32).tolist() == _oracle(1, 1)[0][kind, pid].view(np.uint32).tolist()


def test_records_of_an_opened_checkpoint_carry_its_identity_and_a_digest_names_two(two):
  a, b = two
  mixed = [jr.open_checkpoint(a).record(i) for i in (0, 1)] + [
    jr.open_checkpoint(b).record(i) for i in (2, 3)
  ]
  with pytest.raises(jr.PlacementError, match="hold the states of two checkpoints"):
    jr.unshard_state(mixed)
  problems = jr.digest(mixed).problems
  assert any("hold the states of two checkpoints" in p for p in problems), problems
  assert jr.digest(jr.load_records(a)).problems == ()
