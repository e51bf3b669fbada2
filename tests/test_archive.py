"""save_records / load_records: exact round trips of every optimizer, streaming, layout."""

import collections
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from tests._archive_util import adam_records, params, random_state
from tests._core_util import assert_records_equal
from tests.test_optimizers import OPTIMIZERS, _params


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_round_trips_exactly(tmp_path, name):
  opt = OPTIMIZERS[name]()
  prm = _params()  # the shapes the optimizers' masks and labels are written for
  state = random_state(opt, prm)
  records = jr.shard_state(opt, prm, state, 3)
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=8)
  loaded = jr.load_records(tmp_path / "ckpt")
  assert len(loaded) == 3
  for a, b in zip(loaded, records, strict=True):
    assert_records_equal(a, b)  # structure (NamedTuple classes, MaskedNode), roles, bits
  # A loaded checkpoint is as good as the records: the core reshards it identically.
  assert_records_equal(jr.reshard(loaded, jr.plan(loaded, 2, 1)),
                       jr.reshard(records, jr.plan(records, 2, 1)))


def test_random_bits_every_storage_dtype(tmp_path):
  opt = optax.chain(optax.adamw(1e-3, mu_dtype=jnp.bfloat16), optax.scale_by_schedule(lambda c: c))
  prm = params()
  records = jr.shard_state(opt, prm, random_state(opt, prm), 5)
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=6)  # chunks of 1 f32 / 3 bf16
  for a, b in zip(jr.load_records(tmp_path / "ckpt"), records, strict=True):
    assert_records_equal(a, b)


def test_layout_on_disk(tmp_path):
  jr.save_records(tmp_path / "ckpt", adam_records(2), chunk_bytes=16)
  names = sorted(os.listdir(tmp_path / "ckpt"))
  assert names == ["archive_00000", "archive_00001", "jaxreshard.json"]
  index = json.loads((tmp_path / "ckpt" / "jaxreshard.json").read_text())
  assert index == {"format": "jaxreshard-checkpoint", "format_version": 1,
                   "archives": ["archive_00000", "archive_00001"]}
  meta = json.loads((tmp_path / "ckpt" / "archive_00001" / "record.json").read_text())
  assert meta["version"] == 1 and meta["placements"][0]["rank"] == 1
  zarr = glob.glob(str(tmp_path / "ckpt" / "archive_00001" / "b*" / "zarr.json"))
  assert zarr and all(json.loads(open(z).read())["zarr_format"] == 3 for z in zarr)
  assert not glob.glob(str(tmp_path / ".ckpt.tmp-*"))  # the temporary sibling is gone


def test_records_are_streamed_one_at_a_time(tmp_path):
  records = adam_records(4)
  seen = []

  def gen():
    for i, rec in enumerate(records):
      # Every earlier record is already on disk when the next one is asked for.
      tmp = glob.glob(str(tmp_path / ".ckpt.tmp-*"))
      assert len(tmp) == 1
      seen.append(sorted(n for n in os.listdir(tmp[0]) if n.startswith("archive_")))
      yield rec

  jr.save_records(tmp_path / "ckpt", gen(), chunk_bytes=16)
  assert seen == [[f"archive_{j:05d}" for j in range(i)] for i in range(4)]
  for a, b in zip(jr.load_records(tmp_path / "ckpt"), records, strict=True):
    assert_records_equal(a, b)


class UserState(collections.namedtuple("UserState", ["count", "trace"])):
  """A NamedTuple from a module jaxreshard will not import classes from."""


def test_unknown_namedtuple_becomes_a_plain_namedtuple(tmp_path):
  prm = {"w": jnp.arange(5.0)}
  rec = jr.ShardRecord(1, (jr.ParamPlacement("w", (5,), 0, 1),),
                       UserState(jnp.asarray(3), {"w": jnp.arange(5.0)}), (None, "w"))
  jr.save_records(tmp_path / "ckpt", [rec])
  (back,) = jr.load_records(tmp_path / "ckpt")
  assert type(back.state) is not UserState  # never found by importing from the checkpoint
  assert type(back.state).__name__ == "UserState" and back.state._fields == ("count", "trace")
  assert np.asarray(back.state.trace["w"]).tobytes() == np.arange(5.0, dtype=np.float32).tobytes()
  # Two loads share one class, so their structures (the clock) still agree.
  (again,) = jr.load_records(tmp_path / "ckpt")
  assert jax.tree.structure(again.state) == jax.tree.structure(back.state)
  del prm


def test_optax_classes_come_back_as_themselves(tmp_path):
  records = adam_records(2)
  jr.save_records(tmp_path / "ckpt", records)
  back = jr.load_records(tmp_path / "ckpt")
  assert type(back[0].state[0]) is optax.ScaleByAdamState


def test_hand_built_record_without_roles(tmp_path):
  rec = jr.ShardRecord(1, (jr.ParamPlacement("w", (3,), 0, 1),),
                       {"count": jnp.asarray(7), "mu": {"w": jnp.asarray([1.0, -0.0, 2.0])}})
  jr.save_records(tmp_path / "ckpt", [rec])
  (back,) = jr.load_records(tmp_path / "ckpt")
  assert back.roles == (None, "w")
  assert_records_equal(back, jr.ShardRecord(1, rec.placements, rec.state, (None, "w")))


def test_unstorable_node_type_is_refused_and_leaves_nothing(tmp_path):
  class Box:
    pass

  jax.tree_util.register_pytree_node(Box, lambda b: ((), None), lambda _, c: Box())
  rec = jr.ShardRecord(1, (), (Box(),), ())
  with pytest.raises(jr.ReshardError, match="cannot store"):
    jr.save_records(tmp_path / "ckpt", [rec])
  assert os.listdir(tmp_path) == []


def test_no_records_is_refused(tmp_path):
  with pytest.raises(jr.PlacementError, match="no archives"):
    jr.save_records(tmp_path / "ckpt", iter([]))
  assert os.listdir(tmp_path) == []


def test_weak_typed_scalars_keep_their_type(tmp_path):
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
  prm = {"w": jnp.arange(4.0)}
  records = jr.shard_state(opt, prm, opt.init(prm), 2)
  jr.save_records(tmp_path / "ckpt", records)
  for a, b in zip(jr.load_records(tmp_path / "ckpt"), records):
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)):
      assert getattr(x, "weak_type", False) == getattr(y, "weak_type", False)
