"""Every read path of a checkpoint refuses what ``reshard(load_records(...))`` refuses.

The in-memory pipeline is the reference: ``reshard(load_records(ck), plan(...))``.
``restore``, ``restore_ranks``, the CLI, ``restore_sharded`` (flat and
``target=``) and the orbax handler must refuse exactly the checkpoints it
refuses, and return its bits otherwise.
"""

import os
import subprocess
import sys

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from tests import _target_util as T
from tests._archive_util import set_unchecked
from tests._core_util import assert_records_equal, device_mesh, nest, random_params, random_state
from tests._shapes import DRAWN_SHAPES


def _records(opt, specs, world, seed):
  """Records of ``opt`` over ``world`` ranks for ``{id: (shape, dtype)}``, random bits."""
  params = random_params(specs, seed)
  return jr.shard_state(opt, params, random_state(opt, params, seed + 1), world_size=world)


def _adam_and_chain_records(world_a=2, world_b=3):
  """``a`` under adam, ``b`` under chain(trace, scale_by_adam): one step count (1234)
  each, the two params' histories in differently structured states."""
  ra = _records(optax.adam(1e-3), {"a": ((10,), jnp.float32)}, world_a, 0)
  rb = _records(
    optax.chain(optax.trace(0.9), optax.scale_by_adam()), {"b": ((7,), jnp.float32)}, world_b, 5
  )
  assert int(ra[0].state[0].count) == int(rb[0].state[1].count) == 1234
  return ra + rb


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
  path = tmp_path_factory.mktemp("mixed") / "ckpt"
  with set_unchecked():  # a save refuses it (tested below); another writer may not
    jr.save_records(path, _adam_and_chain_records())
  return path


def _memory_refusal(path, world, rank):
  loaded = jr.load_records(path)
  with pytest.raises(jr.ReshardError) as e:
    jr.reshard(loaded, jr.plan(loaded, world_size=world, rank=rank))
  return e.value


def test_the_reference_refuses_the_mixed_structures(mixed):
  e = _memory_refusal(mixed, 3, 0)
  assert isinstance(e, jr.PlacementError)
  assert "optimizer state structure" in str(e) and "TraceState" in str(e)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_restore_and_restore_ranks_refuse_what_memory_refuses(mixed, world):
  expected = _memory_refusal(mixed, world, 0)
  with pytest.raises(type(expected)) as e:
    jr.restore(mixed, world_size=world, rank=0)
  assert str(e.value) == str(expected)
  with pytest.raises(type(expected)) as e:
    jr.restore_ranks(mixed, range(world), world_size=world)
  assert str(e.value) == str(expected)


@pytest.mark.slow
def test_the_cli_reshard_refuses_it_and_writes_nothing(mixed, tmp_path):
  out = tmp_path / "out"
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(
      [os.path.dirname(os.path.dirname(os.path.abspath(jr.__file__)))]
      + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ),
  )
  run = subprocess.run(
    [sys.executable, "-m", "jaxreshard", "reshard", str(mixed), str(out), "--world-size", "3"],
    capture_output=True,
    text=True,
    env=env,
    check=False,
    timeout=300,
  )
  assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
  assert "optimizer state structure" in run.stderr, run.stderr
  assert not out.exists()


def test_restore_sharded_flat_and_target_refuse_it(mixed):
  expected = _memory_refusal(mixed, 8, 0)
  mesh = device_mesh((8,), ("fsdp",))
  with pytest.raises(type(expected)) as e:
    jr.restore_sharded(mixed, mesh, axis="fsdp")
  assert str(e.value) == str(expected)
  # An abstract target the saved state could have had (adam over both params).
  params = nest({"a": jnp.zeros((10,), jnp.float32), "b": jnp.zeros((7,), jnp.float32)})
  target = T.abstract(optax.adam(1e-3), params, T.spec_or_replicated(mesh, P()))
  expected = _memory_refusal(mixed, 1, 0)
  with pytest.raises(type(expected)) as e:
    jr.restore_sharded(mixed, mesh, target=target)
  assert str(e.value) == str(expected)


def test_the_orbax_handler_refuses_it(tmp_path):
  """Refused when the save's arguments are made, with the words of the reshard; the
  handler's own check before its commit (past that one) is tested with the saves."""
  records = _adam_and_chain_records()
  with pytest.raises(jr.PlacementError, match="optimizer state structure"):
    jr.ReshardSave(records)


def test_inspect_says_the_archives_disagree(mixed):
  from jaxreshard._src.checkpoint import reader as _checkpoint  # pylint: disable=g-import-not-at-top
  from jaxreshard._src.cli import commands as _cli

  assert _cli.inspect_info(_checkpoint.open_checkpoint(mixed))["clocks_agree"] is False


# --- the property: random mixed checkpoints, disk == memory or both refuse -----


MENU = {
  "adam": lambda: optax.adam(1e-3),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
  "trace_adam": lambda: optax.chain(optax.trace(0.9), optax.scale_by_adam()),
  "adamw_masked": lambda: optax.adamw(
    1e-3, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  ),
}
SHAPES = DRAWN_SHAPES
DTYPES = [jnp.float32, jnp.bfloat16]


def _set_counts(records, count):
  """Every int32 clock scalar of every record set to ``count``."""

  def one(r):
    leaves, treedef = jax.tree_util.tree_flatten(r.state)
    leaves = [
      jnp.asarray(count, jnp.int32)
      if role is None and np.ndim(x) == 0 and np.dtype(x.dtype) == np.int32
      else x
      for x, role in zip(leaves, r.roles)
    ]
    return jr.ShardRecord(
      r.version, r.placements, jax.tree_util.tree_unflatten(treedef, leaves), r.roles
    )

  return [one(r) for r in records]


@st.composite
def _checkpoints(draw):
  """Groups of params, each under its own optimizer, world size and step count."""
  n_groups = draw(st.integers(1, 3))
  records, k, first = [], 0, None
  for g in range(n_groups):
    n = draw(st.integers(1, 2))
    specs = {}
    for _ in range(n):
      specs[f"g{g}/p{k}"] = (draw(st.sampled_from(SHAPES)), draw(st.sampled_from(DTYPES)))
      k += 1
    # Mostly the first group's optimizer again (one checkpoint), sometimes another.
    if g == 0:
      opt = first = draw(st.sampled_from(sorted(MENU)))
    else:
      opt = draw(st.sampled_from([first] * 3 + sorted(MENU)))
    world = draw(st.integers(1, 4))
    count = draw(st.sampled_from([7, 7, 7, 9]))  # mostly one step, sometimes another
    records += _set_counts(_records(MENU[opt](), specs, world, seed=g), count)
  if draw(st.integers(0, 4)) == 0:  # now and then one archive a step ahead of the rest
    i = draw(st.integers(0, len(records) - 1))
    records[i] = _set_counts([records[i]], 11)[0]
  order = draw(st.permutations(range(len(records))))
  return [records[i] for i in order]


@pytest.mark.slow
@settings(
  max_examples=40,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(records=_checkpoints(), world=st.integers(1, 5), data=st.data())
def test_random_mixed_checkpoints_restore_as_memory_reshards(
  tmp_path_factory, records, world, data
):
  rank = data.draw(st.integers(0, world - 1))
  root = tmp_path_factory.mktemp("prop")
  # A save refuses what every target rank's reshard refuses, with its class and
  # words, and commits nothing; what another writer may put on a disk is then
  # refused by a restore as by the memory path.
  refused_at_save = None
  try:
    jr.save_records(root / "checked", records)
  except jr.ReshardError as e:
    refused_at_save = e
    assert not os.path.exists(root / "checked")
  path = root / "ckpt"
  with set_unchecked():
    jr.save_records(path, records)
  loaded = jr.load_records(path)
  try:
    expected = jr.reshard(loaded, jr.plan(loaded, world_size=world, rank=rank))
  except jr.ReshardError as e:
    with pytest.raises(jr.ReshardError) as got:
      jr.restore(path, world_size=world, rank=rank)
    assert type(got.value) is type(e), (got.value, e)
    assert type(refused_at_save) is type(e), (refused_at_save, e)
    assert str(refused_at_save).endswith(str(e)), (refused_at_save, e)
    return
  assert refused_at_save is None, refused_at_save
  got = jr.restore(path, world_size=world, rank=rank)
  assert_records_equal(got, expected)  # placements, roles, tree structure, every leaf's bits
