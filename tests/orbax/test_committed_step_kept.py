"""A committed step is never replaced or removed by another manager's save of it.

Two ``CheckpointManager``s on one run directory (in one process or two) each
list the steps they saw; the second one's save of a step the first committed
since is made by orbax with ``force=True``, which removes the step before
writing its own. With ``DurableRenameTemporaryPath`` that save is refused
(``ArchiveExistsError`` naming the step), whenever the other commit lands: before
the save starts, between its look and orbax's removal, or while it writes.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxreshard as jr
from jaxreshard._src.orbax import durable as _durable
from tests._core_util import adam_records

A, B = adam_records(2, seed=0), adam_records(2, seed=1)


def _manager(run):
  options = ocp.CheckpointManagerOptions(temporary_path_class=jr.DurableRenameTemporaryPath)
  return ocp.CheckpointManager(run, options=options)


def _bits(records):
  """Every leaf of ``records`` as its bytes, unsigned (NaN payloads and -0 compare)."""
  out = []
  for r in records:
    leaves, tree = jax.tree_util.tree_flatten(r.state)
    out.append((r.placements, tree))
    for x in leaves:
      x = np.asarray(x)
      out.append((x.dtype.str, x.shape, np.ascontiguousarray(x).reshape(-1).view(np.uint8)))
  return out


def _assert_same_bits(got, want):
  g, w = _bits(got), _bits(want)
  assert len(g) == len(w)
  for a, b in zip(g, w, strict=True):
    if isinstance(a[-1], np.ndarray):
      assert a[:2] == b[:2] and np.array_equal(a[2], b[2])
    else:
      assert a == b


def _restored(run, step):
  with ocp.CheckpointManager(run) as m:
    assert step in m.all_steps()
    return m.restore(step, args=jr.ReshardRestore())


def _saves_step_3(manager, run):
  """The manager that was refused saves its next step."""
  manager.save(3, args=jr.ReshardSave(B))
  manager.wait_until_finished()
  _assert_same_bits(_restored(run, 3), B)


def test_the_two_states_differ():
  with pytest.raises(AssertionError):
    _assert_same_bits(A, B)


def test_a_second_manager_s_save_of_a_step_the_first_committed_is_refused(tmp_path):
  run = tmp_path / "run"
  with _manager(run) as first, _manager(run) as second:  # both list no step
    first.save(2, args=jr.ReshardSave(A))
    first.wait_until_finished()
    with pytest.raises(jr.ArchiveExistsError) as info:
      second.save(2, args=jr.ReshardSave(B))
    assert str(info.value) == (
      f"{run / '2'} already exists; jaxreshard never overwrites a checkpoint (a step another"
      " manager or process committed included): this save removed nothing"
    )
    assert sorted(os.listdir(run)) == ["2"]
    _assert_same_bits(_restored(run, 2), A)
    _saves_step_3(second, run)
  _assert_same_bits(_restored(run, 2), A)


def _committed_elsewhere(run, tmp_path):
  """Step 2 holding A, committed by another manager, moved out of ``run`` (to be put
  back as another process's commit would land)."""
  with _manager(run) as other:
    other.save(2, args=jr.ReshardSave(A))
    other.wait_until_finished()
  aside = tmp_path / "aside"
  os.rename(run / "2", aside)
  return aside


def test_a_step_committed_after_the_save_looked_is_not_removed(tmp_path, monkeypatch):
  """The other commit lands after orbax asked for the save's temporary path, before
  orbax removes the step's path (``force=True``): the removal refuses, removing nothing."""
  run = tmp_path / "run"
  aside = _committed_elsewhere(run, tmp_path)
  from_final = _durable.DurableRenameTemporaryPath.from_final.__func__

  def then_committed(cls, final_path, **kwargs):
    path = from_final(cls, final_path, **kwargs)
    if os.fspath(final_path) == str(run / "2") and aside.exists():
      os.rename(aside, run / "2")
    return path

  monkeypatch.setattr(
    _durable.DurableRenameTemporaryPath, "from_final", classmethod(then_committed)
  )
  with _manager(run) as second:
    assert second.all_steps() == []
    with pytest.raises(jr.ArchiveExistsError, match="this save removed nothing") as info:
      second.save(2, args=jr.ReshardSave(B))
    assert str(info.value).startswith(f"{run / '2'} already exists; jaxreshard never overwrites")
    assert not aside.exists() and sorted(os.listdir(run)) == ["2"]
    _assert_same_bits(_restored(run, 2), A)
    _saves_step_3(second, run)


def test_a_step_committed_while_the_save_wrote_is_not_replaced(tmp_path, monkeypatch):
  """The other commit lands while the save writes: its rename is refused, the step
  keeps what was committed, and the refused save's directory is removed (after
  orbax's metadata write into it, from a thread of orbax's own, here slow)."""
  import time

  from orbax.checkpoint._src.metadata import checkpoint as _metadata

  run = tmp_path / "run"
  aside = _committed_elsewhere(run, tmp_path)
  fsync_tree, write = _durable.fsync_tree, _metadata._MetadataStoreImpl.write

  def slow_write(self, file_path, metadata):
    if str(run / "2.orbax-checkpoint-tmp") in os.fspath(file_path):
      time.sleep(0.5)
    return write(self, file_path, metadata)

  monkeypatch.setattr(_metadata._MetadataStoreImpl, "write", slow_write)

  def then_committed(path):
    fsync_tree(path)
    if path == str(run / "2.orbax-checkpoint-tmp") and aside.exists():
      os.rename(aside, run / "2")

  monkeypatch.setattr(_durable, "fsync_tree", then_committed)
  with _manager(run) as second:
    second.save(2, args=jr.ReshardSave(B))
    with pytest.raises(Exception) as info:
      second.wait_until_finished()
    assert isinstance(info.value, jr.ArchiveExistsError), repr(info.value)
    assert str(info.value) == (
      f"{run / '2'} already exists; jaxreshard never overwrites a checkpoint (a step another"
      " manager or process committed included): this save is not committed (its directory,"
      " never renamed over it, is removed)"
    )
    assert not aside.exists() and sorted(os.listdir(run)) == ["2"]
    _assert_same_bits(_restored(run, 2), A)
    _saves_step_3(second, run)


_OTHER_PROCESS = """
import sys
import orbax.checkpoint as ocp
import jaxreshard as jr
from tests._core_util import adam_records
options = ocp.CheckpointManagerOptions(temporary_path_class=jr.DurableRenameTemporaryPath)
with ocp.CheckpointManager(sys.argv[1], options=options) as m:
  m.save(2, args=jr.ReshardSave(adam_records(2, seed=0)))
  m.wait_until_finished()
print("committed", flush=True)
"""


def test_a_step_another_process_committed_is_refused(tmp_path):
  run = tmp_path / "run"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  with _manager(run) as second:  # opened before the other process saves
    done = subprocess.run(
      [sys.executable, "-c", _OTHER_PROCESS, str(run)],
      env=env,
      cwd=root,
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert done.returncode == 0 and "committed" in done.stdout, done.stderr[-3000:]
    assert second.all_steps() == []
    with pytest.raises(jr.ArchiveExistsError, match="this save removed nothing"):
      second.save(2, args=jr.ReshardSave(B))
    _assert_same_bits(_restored(run, 2), A)
    _saves_step_3(second, run)
