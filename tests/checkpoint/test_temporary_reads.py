"""A save's temporary directory is never read as a checkpoint.

A save writes into a temporary directory (``.NAME.tmp-*``, or orbax's
``NAME.orbax-checkpoint-tmp*`` for ``save_sharded`` and a manager's steps) and
renames it at its commit. One killed between writing its index and the rename
leaves a directory that looks complete; every read path loaded it, and the CLI
converted it, although the save was never reported done.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import tempdir as _tempdir
from jaxreshard._src.checkpoint import tempname as _tempname
from jaxreshard._src.cli.commands import EXIT_ERROR, app
from tests._core_util import device_mesh

OPT = optax.adam(1e-2)


def _records():
  params = {"w": jnp.arange(10.0), "b": jnp.ones((3,))}
  state = OPT.init(params)
  state = (state[0]._replace(mu={"w": jnp.arange(10.0) * 3, "b": jnp.ones((3,)) * 2}), state[1])
  return jr.shard_state(OPT, params, state, world_size=4)


def _leftovers(root):
  """A committed checkpoint renamed to each kind of temporary directory, its lock file
  back in it (as a save killed just before its rename leaves it)."""
  seed = os.path.join(root, "seed")
  jr.save_records(seed, _records())
  out = []
  names = [
    f".ckpt.tmp-{'a' * 32}-999999-{_tempname.host()}",
    "ckpt" + _tempname.ORBAX_TEMP_SUFFIX,
    os.path.join("run", "2" + _tempname.ORBAX_TEMP_SUFFIX, "state"),  # a manager's step
  ]
  for name in names:
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    shutil.copytree(seed, path)
    open(os.path.join(path, _tempdir.LOCK_FILE), "w").close()
    out.append(path)
  return seed, out


def _links(root, leftovers):
  """Symbolic links whose own names hide the temporary directory they lead to: a
  ``latest`` link to a leftover, and a manager's step named by a link to another
  step's temporary directory."""
  latest = os.path.join(root, "latest")
  os.symlink(leftovers[0], latest)
  os.symlink("2" + _tempname.ORBAX_TEMP_SUFFIX, os.path.join(root, "run", "3"))
  return [latest, os.path.join(root, "run", "3", "state")]


def test_every_read_path_refuses_a_save_s_temporary_directory(tmp_path):
  seed, leftovers = _leftovers(str(tmp_path))
  mesh = device_mesh((4,), ("fsdp",))
  for path in leftovers + _links(str(tmp_path), leftovers):
    reads = {
      "open_checkpoint": lambda: jr.open_checkpoint(path),
      "load_records": lambda: jr.load_records(path),
      "restore": lambda: jr.restore(path, world_size=3, rank=0),
      "restore_ranks": lambda: jr.restore_ranks(path, range(3), world_size=3),
      "restore_sharded": lambda: jr.restore_sharded(path, mesh, "fsdp"),
      "digest": lambda: jr.digest(path),
    }
    for name, read in reads.items():
      with pytest.raises(jr.ArchiveError, match="a save's temporary directory") as e:
        read()
      assert path in str(e.value), (name, str(e.value))
    for args in (
      ["inspect", path],
      ["verify", path, seed],
      ["reshard", path, str(tmp_path / "out"), "-w", "3"],
    ):
      result = CliRunner().invoke(app, args)
      assert result.exit_code == EXIT_ERROR, (args, result.output)
      assert "a save's temporary directory" in result.stderr, result.stderr
    assert not os.path.exists(tmp_path / "out")
  # The same files under a committed name load, bit for bit.
  os.rename(leftovers[1], tmp_path / "committed")
  got = jr.unshard_state(jr.load_records(tmp_path / "committed"))
  want = jr.unshard_state(_records())
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_save_is_refused_inside_a_save_s_temporary_directory(tmp_path):
  """A checkpoint saved there would never load, and ``clean`` would remove it with the
  directory it lies in."""
  inside = [
    tmp_path / f".run.tmp-{'b' * 32}-1-{_tempname.host()}" / "ckpt",
    tmp_path / ("keep" + _tempname.ORBAX_TEMP_SUFFIX + "-old") / "ckpt",
  ]
  os.makedirs(tmp_path / "real.orbax-checkpoint-tmp")
  os.symlink(tmp_path / "real.orbax-checkpoint-tmp", tmp_path / "plain")
  inside.append(tmp_path / "plain" / "ckpt")  # a link's name hides where it leads
  for path in inside:
    os.makedirs(path.parent, exist_ok=True)
    with pytest.raises(jr.ReshardError, match="a save's temporary directory by its name"):
      jr.save_records(path, _records())
    assert not os.path.exists(path)
  seed = tmp_path / "seed"
  jr.save_records(seed, _records())
  result = CliRunner().invoke(app, ["reshard", str(seed), str(inside[0]), "-w", "2"])
  assert result.exit_code == EXIT_ERROR, result.output
  assert "a save's temporary directory by its name" in result.stderr, result.stderr
  assert not os.path.exists(inside[0])


def test_a_save_is_refused_inside_a_committed_checkpoint(tmp_path):
  """Its files would join the outer checkpoint's (``inspect`` counted them as its
  own); ``reshard`` refused an output inside its input, ``save_records`` took it."""
  outer = tmp_path / "outer"
  jr.save_records(outer, _records())
  os.symlink(outer / "archive_00000", tmp_path / "alias")
  for path in (
    outer / "nested",
    outer / "archive_00000" / "float32" / "nested",
    tmp_path / "alias" / "nested",  # a link's name hides where it leads
  ):
    with pytest.raises(jr.ReshardError, match=f"lies inside the checkpoint {outer}"):
      jr.save_records(path, _records())
    assert not os.path.exists(path)
  other = tmp_path / "other"
  jr.save_records(other, _records())
  result = CliRunner().invoke(app, ["reshard", str(other), str(outer / "out"), "-w", "2"])
  assert result.exit_code == EXIT_ERROR, result.output
  assert f"lies inside the checkpoint {outer}" in result.stderr, result.stderr
  assert jr.digest(outer) == jr.digest(other)  # nothing joined it
  # A stray file of the index's name does not make its directory a checkpoint.
  stray = tmp_path / "home"
  os.makedirs(stray / "runs")
  (stray / "jaxreshard.json").write_text("{}")
  jr.save_records(stray / "runs" / "ckpt", _records())
  assert jr.digest(stray / "runs" / "ckpt") == jr.digest(other)


@pytest.mark.parametrize(
  "where", ["in a temporary directory", "at an orbax temporary name", "in a checkpoint"]
)
def test_a_manager_s_save_is_refused_where_save_records_refuses_it(tmp_path, where):
  """The orbax handler writes into orbax's temporary directories, never through
  ``save_records``: it checks the path orbax commits to as ``save_records`` checks its own."""
  words = "a save's temporary directory by its name"
  if where == "in a temporary directory":
    root = tmp_path / f".run.tmp-{'c' * 32}-1-{_tempname.host()}" / "run"
  elif where == "at an orbax temporary name":  # the manager's own directory: not orbax's
    root = tmp_path / ("run" + _tempname.ORBAX_TEMP_SUFFIX + "-old")
  else:
    jr.save_records(tmp_path / "outer", _records())
    root = tmp_path / "outer" / "archive_00000" / "run"
    words = f"lies inside the checkpoint {tmp_path / 'outer'}"
  with ocp.CheckpointManager(root) as manager:
    with pytest.raises(jr.ReshardError, match=words):
      manager.save(1, args=jr.ReshardSave(_records()))
      manager.wait_until_finished()
    assert manager.all_steps() == []
  assert not os.path.exists(root / "1")


def test_a_checkpointer_s_save_is_refused_below_an_orbax_temporary_name(tmp_path):
  parent = tmp_path / ("keep" + _tempname.ORBAX_TEMP_SUFFIX + "-old")
  os.makedirs(parent)
  checkpointer = ocp.Checkpointer(jr.ReshardCheckpointHandler())
  with pytest.raises(jr.ReshardError, match="a save's temporary directory by its name"):
    checkpointer.save(parent / "c1", args=jr.ReshardSave(_records()))
  checkpointer.close()
  assert not os.path.exists(parent / "c1")
