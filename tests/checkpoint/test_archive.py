"""save_records / load_records: exact round trips of every optimizer, streaming, layout."""

import collections
import glob
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from tests._core_util import (
  OPTIMIZERS,
  STORAGE_SHAPES,
  adam_records,
  assert_records_equal,
  assert_trees_bit_equal,
  random_params,
  random_state,
  small_params,
)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_round_trips_exactly(tmp_path, name):
  opt = OPTIMIZERS[name]()
  prm = small_params()  # the shapes the optimizers' masks and labels are written for
  state = random_state(opt, prm)
  records = jr.shard_state(opt, prm, state, 3)
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=8)
  loaded = jr.load_records(tmp_path / "ckpt")
  assert len(loaded) == 3
  for a, b in zip(loaded, records, strict=True):
    assert_records_equal(a, b)  # structure (NamedTuple classes, MaskedNode), roles, bits
  # A loaded checkpoint is as good as the records: the core reshards it identically.
  assert_records_equal(
    jr.reshard(loaded, jr.plan(loaded, world_size=2, rank=1)),
    jr.reshard(records, jr.plan(records, world_size=2, rank=1)),
  )


def test_random_bits_every_storage_dtype(tmp_path):
  opt = optax.chain(optax.adamw(1e-3, mu_dtype=jnp.bfloat16), optax.scale_by_schedule(lambda c: c))
  prm = random_params(STORAGE_SHAPES)
  records = jr.shard_state(opt, prm, random_state(opt, prm), 5)
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=6)  # chunks of 1 f32 / 3 bf16
  for a, b in zip(jr.load_records(tmp_path / "ckpt"), records, strict=True):
    assert_records_equal(a, b)


def _files(directory):
  return sorted(
    os.path.relpath(os.path.join(r, f), directory) for r, _, fs in os.walk(directory) for f in fs
  )


def test_layout_on_disk(tmp_path):
  records = adam_records(2)
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=16)
  assert sorted(os.listdir(tmp_path / "ckpt")) == [
    "archive_00000",
    "archive_00001",
    "jaxreshard.json",
  ]
  index = json.loads((tmp_path / "ckpt" / "jaxreshard.json").read_text())
  assert index["format"] == "jaxreshard-checkpoint" and index["format_version"] == 4
  # Both ranks share one layout, one clock and one group: the index does not
  # grow with the ranks beyond their [archive, rank] pairs.
  assert index["archives"] == [["archive_00000", 0, 0], ["archive_00001", 0, 0]]
  assert len(index["layouts"]) == 1 and len(index["clocks"]) == 1
  (group,) = index["groups"]
  assert group["world_size"] == 2 and group["ranks"] == [[0, 0], [1, 1]]
  assert sorted(index["params"][i][0] for i in group["params"]) == sorted(
    p.param for p in records[0].placements
  )
  # Files grow with ranks x dtypes: per archive its metadata and, per dtype,
  # zarr.json and one shard file.
  dtypes = ["bfloat16", "float16", "float32"]
  assert _files(tmp_path / "ckpt" / "archive_00001") == ["archive.json"] + [
    f"{d}/{f}" for d in dtypes for f in ("c/0", "zarr.json")
  ]
  meta = json.loads((tmp_path / "ckpt" / "archive_00001" / "archive.json").read_text())
  assert meta["checkpoint"] == index["checkpoint"] and sorted(meta["buffers"]) == dtypes
  assert not glob.glob(str(tmp_path / ".ckpt.tmp-*"))  # the temporary sibling is gone


def test_plain_tensorstore_reads_a_saved_buffer(tmp_path):
  """The buffers are ordinary zarr v3 arrays: tensorstore opens them by path alone."""
  import tensorstore as ts

  records = adam_records(3)
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=12)
  rec = records[1]
  # float32 buffers of rank 1, in packing order: params by id, then mu before nu.
  expected = []
  for pid in sorted(p.param for p in rec.placements):
    for sub in (rec.state[0].mu, rec.state[0].nu):
      leaf = nest_get(sub, pid)
      if leaf is not None and np.asarray(leaf).dtype == np.float32:
        expected.append(np.asarray(leaf))
  store = ts.open(
    {
      "driver": "zarr3",
      "kvstore": {"driver": "file", "path": str(tmp_path / "ckpt" / "archive_00001" / "float32")},
    }
  ).result()
  got = store.read().result()
  want = np.concatenate(expected)
  assert got.dtype == np.float32 and got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


def nest_get(tree, pid):
  node = tree
  for k in pid.split("/"):
    if not isinstance(node, dict) or k not in node:
      return None
    node = node[k]
  return node


def test_records_are_streamed_one_at_a_time(tmp_path):
  records = adam_records(4)
  seen = []

  def gen():
    for _i, rec in enumerate(records):
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
  rec = jr.ShardRecord(
    1,
    (jr.ParamPlacement("w", (5,), 0, 1),),
    UserState(jnp.asarray(3), {"w": jnp.arange(5.0)}),
    (None, "w"),
  )
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
  rec = jr.ShardRecord(
    1,
    (jr.ParamPlacement("w", (3,), 0, 1),),
    {"count": jnp.asarray(7), "mu": {"w": jnp.asarray([1.0, -0.0, 2.0])}},
  )
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


def test_float64_clock_scalars_keep_dtype_and_bits_with_x64_on_and_off(tmp_path):
  """A float64 scalar of the clock is never cut to float32, whatever the reader's x64."""
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
  prm = {"w": np.arange(10.0, dtype=np.float32)}
  third = np.float64(1 / 3)
  with jax.enable_x64(True):
    state = opt.init(prm)
    state = state._replace(hyperparams={**state.hyperparams, "learning_rate": jnp.asarray(third)})
    records = jr.shard_state(opt, prm, state, 4)
    target = jr.reshard(records, jr.plan(records, world_size=3, rank=1))
    assert np.asarray(target.state.hyperparams["learning_rate"]).tobytes() == third.tobytes()
    jr.save_records(tmp_path / "ckpt", records)
    on = jr.restore(tmp_path / "ckpt", world_size=3, rank=1).state.hyperparams["learning_rate"]
  off = jr.restore(tmp_path / "ckpt", world_size=3, rank=1).state.hyperparams["learning_rate"]
  assert not jax.config.jax_enable_x64
  for x in (on, off, jr.load_records(tmp_path / "ckpt")[2].state.hyperparams["learning_rate"]):
    assert np.asarray(x).dtype == np.float64 and np.asarray(x).tobytes() == third.tobytes()


def test_keys_with_slashes_percent_and_empty_keys_keep_their_structure(tmp_path):
  """Param ids are injective: haiku's '/' in keys, '%', and '' never collide or re-nest."""
  prm = {
    "mlp/~/linear_0": {"w": np.arange(6.0, dtype=np.float32), "b": np.ones(3, np.float32)},
    "mlp": {"~": {"linear_0": {"w": np.arange(7.0, dtype=np.float32)}}},
    "": np.arange(5.0, dtype=np.float32),
    "a%2Fb": np.ones(4, np.float32),
    "a/b": np.zeros(2, np.float32),
  }
  opt = optax.adam(1e-3)
  state = random_state(opt, prm)
  records = jr.shard_state(opt, prm, state, 3)
  ids = [p.param for p in records[0].placements]
  assert len(set(ids)) == 6 and "mlp%2F~%2Flinear_0/w" in ids and "mlp/~/linear_0/w" in ids
  targets = [jr.reshard(records, jr.plan(records, world_size=2, rank=r)) for r in range(2)]
  assert_trees_bit_equal(jr.unshard_state(targets), state)
  # A restricted set of parameters keeps the group's tree: the keys come back.
  part = [m for m in jr.plan(records, world_size=2, rank=0) if m.param.startswith("mlp%2F")]
  mu = jr.reshard(records, part).state[0].mu
  assert list(mu) == ["mlp/~/linear_0"] and sorted(mu["mlp/~/linear_0"]) == ["b", "w"]
  jr.save_records(tmp_path / "ckpt", records)
  for a, b in zip(jr.load_records(tmp_path / "ckpt"), records, strict=True):
    assert_records_equal(a, b)
  assert_records_equal(jr.restore(tmp_path / "ckpt", world_size=2, rank=1), targets[1])


def test_typed_prng_key_in_the_state_round_trips(tmp_path):
  # noisy_sgd keeps a typed PRNG key (key<fry>) among its scalars: stored as
  # its implementation and key data, it comes back a key with the same data.
  params = {"w": jnp.arange(5.0)}
  opt = optax.noisy_sgd(0.1, key=jax.random.key(42))
  state = opt.init(params)
  records = jr.shard_state(opt, params, state, world_size=2)
  jr.save_records(tmp_path / "c", records)
  for rec in jr.load_records(tmp_path / "c") + [jr.restore(tmp_path / "c", world_size=3, rank=2)]:
    (key,) = [
      x for x in jax.tree.leaves(rec.state) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]
    assert key.dtype == state[0].rng_key.dtype
    assert np.array_equal(jax.random.key_data(key), jax.random.key_data(state[0].rng_key))
  assert jr.compare_digests(jr.digest(records), jr.digest(tmp_path / "c")) == []
  changed = (state[0]._replace(rng_key=jax.random.key(7)),) + tuple(state[1:])
  other = jr.shard_state(opt, params, changed, world_size=2)
  assert any("rng_key" in d for d in jr.compare_digests(jr.digest(records), jr.digest(other)))


_COUNT_COMPILES = """
import sys
import jax.monitoring
import jaxreshard as jr
compiles = []
jax.monitoring.register_event_duration_secs_listener(
  lambda event, seconds, **kw: compiles.append(event) if "backend_compile" in event else None
)
target = jr.restore(sys.argv[1], world_size=3, rank=1)
print(len(compiles), type(target.state[0].count).__name__, target.state[0].count.dtype)
"""


def test_a_restore_in_a_fresh_process_compiles_no_program(tmp_path):
  """A restarted process restores a rank without compiling anything: its clock
  scalars are transferred, not made by ``jnp.asarray`` (a program per dtype,
  ~80 ms on XLA:CPU at every restart)."""
  opt = optax.adam(1e-3)
  prm = {"w": jnp.arange(10.0), "b": jnp.ones(3, jnp.bfloat16)}
  jr.save_records(tmp_path / "ckpt", jr.shard_state(opt, prm, opt.init(prm), 4))
  out = subprocess.run(
    [sys.executable, "-c", _COUNT_COMPILES, str(tmp_path / "ckpt")],
    capture_output=True,
    text=True,
    check=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.stdout.split() == ["0", "ArrayImpl", "int32"], out.stdout + out.stderr
