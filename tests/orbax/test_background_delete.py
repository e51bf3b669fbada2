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
