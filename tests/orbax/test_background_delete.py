"""A step deleted by a manager (``delete``, or past ``max_to_keep``) may be saved
again under its number, background deletion on or off.

Orbax's background deleter queues the step number and removes the step's
directory later; a save of that number through ``DurableRenameTemporaryPath``
waits for that removal (the old step is the manager's own, not another's
committed step), commits the new state, and nothing removes it after.
"""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxreshard as jr
from tests import _mp_util as U
from tests._core_util import adam_records, bits

A, B = adam_records(2, seed=0), adam_records(2, seed=1)


def _manager(run, **options):
  options = ocp.CheckpointManagerOptions(
    temporary_path_class=jr.DurableRenameTemporaryPath, **options
  )
  return ocp.CheckpointManager(run, options=options)


def _assert_is(got, want):
  """``got`` holds ``want``'s records: placements, tree and every leaf's bits."""
  assert len(got) == len(want)
  for g, w in zip(got, want, strict=True):
    assert g.placements == w.placements
    gl, gt = jax.tree_util.tree_flatten(g.state)
    wl, wt = jax.tree_util.tree_flatten(w.state)
    assert gt == wt
    for a, b in zip(gl, wl, strict=True):
      a, b = np.asarray(a), np.asarray(b)
      assert a.dtype == b.dtype and a.shape == b.shape
      assert np.array_equal(bits(a), bits(b))


def _only_committed(run, steps):
  """``run`` holds the committed ``steps`` and nothing else (no temporary directory)."""
  names = sorted(n for n in os.listdir(run) if n != "trash")
  assert names == sorted(str(s) for s in steps), names


def _reopened(run, step):
  """``step`` as a new manager finds it once the first is closed (its deleter done)."""
  with ocp.CheckpointManager(run) as m:
    assert step in m.all_steps()
    return m.restore(step, args=jr.ReshardRestore())


def test_the_two_states_differ():
  with pytest.raises(AssertionError):
    _assert_is(A, B)


@pytest.mark.parametrize("trash", [None, "trash"])
@pytest.mark.parametrize("background", [False, True])
def test_a_deleted_step_is_saved_again(tmp_path, background, trash):
  run = tmp_path / "run"
  with _manager(run, enable_background_delete=background, todelete_subdir=trash) as m:
    m.save(1, args=jr.ReshardSave(A))
    m.wait_until_finished()
    m.delete(1)
    m.save(1, args=jr.ReshardSave(B))
    m.wait_until_finished()
    assert m.all_steps() == [1]
    _assert_is(m.restore(1, args=jr.ReshardRestore()), B)
  _only_committed(run, [1])
  _assert_is(_reopened(run, 1), B)


@pytest.mark.parametrize("background", [False, True])
def test_the_last_of_several_deleted_steps_is_saved_again(tmp_path, background):
  """The deleter is still at the steps queued before this one when the save starts."""
  run = tmp_path / "run"
  with _manager(run, enable_background_delete=background) as m:
    for step in (1, 2, 3):
      m.save(step, args=jr.ReshardSave(A))
    m.wait_until_finished()
    for step in (1, 2, 3):
      m.delete(step)
    m.save(3, args=jr.ReshardSave(B))
    m.wait_until_finished()
    _assert_is(m.restore(3, args=jr.ReshardRestore()), B)
  _only_committed(run, [3])
  _assert_is(_reopened(run, 3), B)


@pytest.mark.parametrize("background", [False, True])
def test_a_step_past_max_to_keep_is_saved_again(tmp_path, background):
  """A run that rewinds saves the number of a step ``max_to_keep`` removed."""
  run = tmp_path / "run"
  with _manager(run, max_to_keep=1, enable_background_delete=background) as m:
    m.save(1, args=jr.ReshardSave(A))
    m.save(2, args=jr.ReshardSave(A))  # removes step 1 once it commits
    # A step before the latest is saved only when forced; step 2 goes once it commits.
    assert m.save(1, args=jr.ReshardSave(B), force=True)
    m.wait_until_finished()
    assert m.all_steps() == [1]
    _assert_is(m.restore(1, args=jr.ReshardRestore()), B)
  _only_committed(run, [1])
  _assert_is(_reopened(run, 1), B)


@pytest.mark.parametrize("background", [False, True])
def test_a_restarted_run_saves_a_step_it_deleted(tmp_path, background):
  """A restarted job's new manager deletes a step it rewinds past and saves its number."""
  run = tmp_path / "run"
  with _manager(run) as m:
    for step in (1, 2):
      m.save(step, args=jr.ReshardSave(A))
  with _manager(run, enable_background_delete=background) as m:
    assert m.all_steps() == [1, 2]
    m.delete(2)
    m.save(2, args=jr.ReshardSave(B))
    m.wait_until_finished()
    _assert_is(m.restore(2, args=jr.ReshardRestore()), B)
    _assert_is(m.restore(1, args=jr.ReshardRestore()), A)
  _only_committed(run, [1, 2])
  _assert_is(_reopened(run, 2), B)


def test_a_committed_step_is_still_refused_with_background_delete(tmp_path):
  """Waiting is for this process's queued deletions only: another manager's
  committed step is refused at once, and kept."""
  run = tmp_path / "run"
  with _manager(run, enable_background_delete=True) as first:
    with _manager(run, enable_background_delete=True) as second:
      first.save(1, args=jr.ReshardSave(A))
      first.wait_until_finished()
      first.delete(1)  # queued in the first manager's deleter, not the second's
      first.save(1, args=jr.ReshardSave(A))
      first.wait_until_finished()
      with pytest.raises(jr.ArchiveExistsError, match="this save removed nothing"):
        second.save(1, args=jr.ReshardSave(B))
  _only_committed(run, [1])
  _assert_is(_reopened(run, 1), A)


def test_a_saved_step_is_not_removed_by_a_deletion_queued_before_it(tmp_path):
  """A manager whose list of steps is stale queues the deletion of a step already
  gone, behind others; orbax's deleter, finding its number when it gets to it,
  would remove the new save's directory or the step it committed."""
  run = tmp_path / "run"
  with _manager(run) as first:
    for step in range(1, 9):
      first.save(step, args=jr.ReshardSave(A))
  with _manager(run) as first, _manager(run, enable_background_delete=True) as second:
    assert second.all_steps() == list(range(1, 9))
    first.delete(1)  # gone; the second manager still lists it
    for step in (*range(2, 9), 1):
      second.delete(step)
    second.save(1, args=jr.ReshardSave(B))
    second.wait_until_finished()
  _only_committed(run, [1])
  _assert_is(_reopened(run, 1), B)


@pytest.mark.parametrize("spelling", ["same", "symlink", "dotdot", "dotdot_after_link"])
def test_a_deletion_queued_under_another_spelling_of_the_run_is_waited_for(tmp_path, spelling):
  """Two managers in one process spell the run directory two ways (a link to it, a
  path through ``..``, or a ``..`` after a link, which the kernel takes from the
  link's target): the save of one still waits for the other's deleter, which has
  the step queued behind others, instead of committing a step that deleter then
  removes."""
  run = tmp_path / "deep" / "run"
  run.mkdir(parents=True)
  (tmp_path / "deep" / "x").mkdir()
  os.symlink(run, tmp_path / "link")
  os.symlink(tmp_path / "deep" / "x", tmp_path / "L")
  other = {
    "same": run,
    "symlink": tmp_path / "link",
    "dotdot": run / ".." / "run",
    "dotdot_after_link": tmp_path / "L" / ".." / "run",
  }[spelling]
  with _manager(run) as first:
    for step in range(1, 9):
      first.save(step, args=jr.ReshardSave(A))
  with _manager(run) as first, _manager(other, enable_background_delete=True) as second:
    first.delete(1)  # gone; the second manager still lists it
    for step in (*range(2, 9), 1):
      second.delete(step)
    assert first.save(1, args=jr.ReshardSave(B), force=True)
    first.wait_until_finished()
  _only_committed(run, [1])
  _assert_is(_reopened(run, 1), B)


def test_a_step_its_stopped_deleter_left_is_refused_by_name(tmp_path, monkeypatch):
  """Orbax's deleter thread stops at its first error (here an I/O error removing step
  1): the steps queued after it stay, a save of one is refused naming the stopped
  deleter (not another manager's step), and nothing is kept waiting for it."""
  from orbax.checkpoint._src.path import deleter as deleter_lib

  from jaxreshard._src.orbax import deletes

  remove = deleter_lib.PathDeleter.delete

  def failing(self, path, **kwargs):
    if os.path.basename(str(path)) == "1":
      raise OSError(5, "Input/output error (injected)", str(path))
    return remove(self, path, **kwargs)

  monkeypatch.setattr(deleter_lib.PathDeleter, "delete", failing)
  run = tmp_path / "run"
  manager = _manager(run, enable_background_delete=True)
  for step in (1, 2, 3):
    manager.save(step, args=jr.ReshardSave(A))
  manager.wait_until_finished()
  for step in (1, 2, 3):
    manager.delete(step)
  for step in (1, 2):  # the step it stopped at, and one queued after it
    with pytest.raises(jr.ArchiveExistsError, match="whose thread stopped at an error"):
      manager.save(step, args=jr.ReshardSave(B))
  with pytest.raises(OSError, match="injected"):
    manager.close()
  assert not any(str(run) in key for key in deletes._PENDING)
  _only_committed(run, [1, 2, 3])
  _assert_is(_reopened(run, 2), A)


@pytest.mark.parametrize("slow_s", [0, 2])
def test_every_process_saves_a_step_the_primary_deletes_in_the_background(tmp_path, slow_s):
  """Two processes: only orbax's primary removes a deleted step, the other's deleter
  is done with it at once. That process's save of the step waits, as the primary's
  does, until the step's directory is gone: both save it again (before, it refused
  the step as another's committed one while the primary went on into the save and
  waited for it there)."""
  run = str(tmp_path / "run")
  args = {"run": run, "slow_s": slow_s}
  with U.ProcessGroup(2, 4, "background_resave", str(tmp_path / "out"), args, timeout=150) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  for r in results:
    assert r["error"] is None and r["listing"] == ["1"], results
    assert r["seconds"] >= slow_s, results
    assert r["left_to_wait_for"] == 0, results  # nothing kept once the step is gone


def test_a_reload_of_the_bookkeeping_keeps_the_steps_queued_before_it(tmp_path):
  """``importlib.reload`` of the module that records queued steps (a notebook's
  autoreload) keeps what it recorded: a step queued behind others before the reload
  is still waited for, and the save made after it is not removed by the deleter."""
  import importlib

  from jaxreshard._src.orbax import deletes

  run = tmp_path / "run"
  with _manager(run) as first:
    for step in range(1, 9):
      first.save(step, args=jr.ReshardSave(A))
  with _manager(run) as first, _manager(run, enable_background_delete=True) as second:
    first.delete(1)  # gone; the second manager still lists it
    for step in (*range(2, 9), 1):
      second.delete(step)
    tracked = len(deletes._TRACKED)
    assert importlib.reload(deletes) is deletes
    assert len(deletes._TRACKED) == tracked
    second.save(1, args=jr.ReshardSave(B))
    second.wait_until_finished()
  _only_committed(run, [1])
  _assert_is(_reopened(run, 1), B)
