"""A save killed at any of its file system calls leaves what loads exactly or is refused.

Each save (``save_records``, with a JSON index and with a binary table, one over a
killed save's leftover, ``save_sharded`` and a ``CheckpointManager`` step through
``DurableRenameTemporaryPath``) is killed in a child process at one call of each
kind and place it makes: the worker, ``tests/_kill_worker.py``, ends the child with
``os._exit(137)`` in that call, as a SIGKILL would (no cleanup runs). Then, in this
process: every way to read the path (``load_records``, ``restore``,
``restore_sharded``, the manager's ``latest_step`` and ``restore``, ``locate``, the
CLI's ``inspect`` and ``verify``) returns the saved bits or refuses with the
library's error, never other bits or another exception; the latest step is never a
half-written one; ``clean`` removes what was left and never a checkpoint; a
checkpoint saved before is untouched; and the same save, run again, commits what
loads exactly (or is refused where the killed one had committed). Last, what orbax
writes while it commits and fsyncs only after the rename, lost in a crash, changes
nothing a reader gives.

The CLI is killed the same way: ``clean`` while it removes those leftovers (every
committed checkpoint still reads exactly, a leftover named explicitly is read whole or
refused, and a rerun of ``clean`` leaves nothing), and ``reshard`` (whole and
``--rank``) and ``merge`` while they write OUT (absent, refused by every reader
naming it, or whole and exact; a rerun writes what loads exactly).
"""

import functools
import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import locate as _locate
from jaxreshard._src.checkpoint import tempdir, tempname
from jaxreshard._src.cli.commands import app
from tests import _kill_worker as worker
from tests._core_util import assert_records_equal, assert_trees_bit_equal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc"),
]

# A kill point: (call, regex of the path below the test's directory, nth such call),
# and whether the checkpoint is committed once the save is killed there.
TMP = r"^/\.ckpt\.tmp-(?!a{32})[^/]+"
LEFT = r"^/\.ckpt\.tmp-a{32}-999999-[^/]+"
SAVE_RECORDS = {
  "temp dir made, no lock yet": (("mkdir", TMP + "$", 1), False),
  "lock file": (("open", TMP + r"/\.jaxreshard-save\.lock$", 1), False),
  "archive dir": (("mkdir", TMP + "/archive_00000$", 1), False),
  "dtype dir": (("mkdir", TMP + "/archive_00001/float32$", 1), False),
  "shard file made": (("open", TMP + "/archive_00000/bfloat16/c/0$", 1), False),
  "shard data": (("writev", TMP + "/archive_00001/float32/c/0$", 1), False),
  "zarr.json data": (("writev", TMP + "/archive_00000/float32/zarr.json$", 1), False),
  "last archive.json": (("writev", TMP + "/archive_00001/archive.json$", 1), False),
  "fsync of a shard": (("fsync", TMP + "/archive_00000/bfloat16/c/0$", 1), False),
  "fsync of an archive dir": (("fsync", TMP + "/archive_00001$", 1), False),
  "close of an archive dir": (("close", TMP + "/archive_00000$", 1), False),
  "index made empty": (("open", TMP + "/jaxreshard.json$", 1), False),
  "index data": (("writev", TMP + "/jaxreshard.json$", 1), False),
  "fsync of the temp dir": (("fsync", TMP + "$", 1), False),
  "the rename": (("renameat2", "^/ckpt$", 1), False),
  "lock file removed after the rename": (("unlink", r"^/ckpt/\.jaxreshard-save\.lock$", 1), True),
  "fsync of the checkpoint after the unlink": (("fsync", "^/ckpt$", 1), True),
  "fsync of the parent after the rename": (("fsync", "^$", 1), True),
  "lock released": (("close", r"^/ckpt/\.jaxreshard-save\.lock \(deleted\)$", 1), True),
  "not killed": ((None, "", 0), True),
}
SAVE_RECORDS_TABLE = {  # an index with a binary table: the table first, then the index
  "table made empty": (("open", TMP + "/jaxreshard.table$", 1), False),
  "table data": (("writev", TMP + "/jaxreshard.table$", 1), False),
  "fsync of the table": (("fsync", TMP + "/jaxreshard.table$", 1), False),
  "index data after the table": (("writev", TMP + "/jaxreshard.json$", 1), False),
  "the rename": (("renameat2", "^/ckpt$", 1), False),
  "not killed": ((None, "", 0), True),
}
SAVE_OVER_LEFTOVER = {
  "leftover's shard removed": (("unlink", LEFT + "/archive_00000/float32/c/0$", 1), False),
  "leftover's index removed": (("unlink", LEFT + "/jaxreshard.json$", 1), False),
  "leftover's archive dir removed": (("rmdir", LEFT + "/archive_00001$", 1), False),
  "leftover's lock removed last": (("unlink", LEFT + r"/\.jaxreshard-save\.lock$", 1), False),
  "leftover's dir removed": (("rmdir", LEFT + "$", 1), False),
  "new temp dir made": (("mkdir", TMP + "$", 1), False),
  "not killed": ((None, "", 0), True),
}
ORB = r"^/ck\.orbax-checkpoint-tmp"
SAVE_SHARDED = {
  "orbax's temp dir made": (("mkdir", ORB + "$", 1), False),
  "orbax's first metadata": (("file.open", ORB + "/_CHECKPOINT_METADATA$", 1), False),
  "lock file": (("open", ORB + r"/\.jaxreshard-save\.lock$", 1), False),
  "archive dir": (("mkdir", ORB + "/archive_00000$", 1), False),
  "last shard data": (("writev", ORB + "/archive_00003/float32/c/0$", 1), False),
  "index data": (("writev", ORB + "/jaxreshard.json$", 1), False),
  "fsync of the tree before the rename": (
    ("fsync", ORB + "/archive_00002/archive.json$", 2),
    False,
  ),
  "metadata rewritten at the commit": (("file.write", ORB + "/_CHECKPOINT_METADATA$", 3), False),
  "commit_success.txt removed": (("remove", ORB + "/commit_success.txt$", 1), False),
  "commit_success.txt data": (("file.write", ORB + "/commit_success.txt$", 1), False),
  "the rename": (("rename", "^/ck$", 1), False),
  "lock file removed after the rename": (("unlink", r"^/ck/\.jaxreshard-save\.lock$", 1), True),
  "fsync of the parent after the rename": (("fsync", "^$", 1), True),
  "fsync of the metadata after the rename": (("fsync", "^/ck/_CHECKPOINT_METADATA$", 1), True),
  "fsync of the checkpoint after the rename": (("fsync", "^/ck$", 1), True),
  "not killed": ((None, "", 0), True),
}
STEP = r"^/run/2\.orbax-checkpoint-tmp"
ITEM = STEP + r"/default\.orbax-checkpoint-tmp"
MANAGER_SAVE = {
  "step's temp dir made": (("mkdir", STEP + "$", 1), False),
  "step's lock file": (("open", STEP + r"/\.jaxreshard-save\.lock$", 1), False),
  "step's first metadata": (("file.write", STEP + "/_CHECKPOINT_METADATA$", 1), False),
  "item's temp dir made": (("mkdir", ITEM + "$", 1), False),
  "item's lock file": (("open", ITEM + r"/\.jaxreshard-save\.lock$", 1), False),
  "last shard data": (("writev", ITEM + "/archive_00001/float32/c/0$", 1), False),
  "index data": (("writev", ITEM + "/jaxreshard.json$", 1), False),
  "item's commit_success.txt": (("file.write", ITEM + "/commit_success.txt$", 1), False),
  "item's rename": (("rename", STEP + "/default$", 1), False),
  "item's lock removed after its rename": (
    ("unlink", STEP + r"/default/\.jaxreshard-save\.lock$", 1),
    False,
  ),
  "step's metadata rewritten at the commit": (
    ("file.write", STEP + "/_CHECKPOINT_METADATA$", 3),
    False,
  ),
  "step's commit_success.txt": (("file.write", STEP + "/commit_success.txt$", 1), False),
  "step's rename": (("rename", "^/run/2$", 1), False),
  "step's lock removed after its rename": (
    ("unlink", r"^/run/2/\.jaxreshard-save\.lock$", 1),
    True,
  ),
  "fsync of the run dir after the rename": (("fsync", "^/run$", 2), True),
  "fsync of the step after the rename": (("fsync", "^/run/2$", 1), True),
  "not killed": ((None, "", 0), True),
}
# ``clean --all`` killed, at a call in one of the leftovers of killed saves (A: this
# host's, B: another host's, with a binary table, C: a save's killed before it made its
# lock). A clean removes a leftover's files and directories depth first, its lock file
# last, then the directory; nothing committed is ever touched, and a rerun leaves nothing.
CA, CB, CC = (rf"^/\.ckpt\.tmp-{c * 32}-[^/]+" for c in "abc")
LOCK = r"/\.jaxreshard-save\.lock"
CLEAN_RECORDS = {
  "probe of a leftover's lock released": ("close", CA + LOCK + "$", 1),
  "lock made in the lockless leftover": ("open", CC + LOCK + "$", 1),
  "first file removed": ("unlink", CA + "/.", 1),
  "a shard file removed": ("unlink", CA + "/archive_00000/float32/c/0$", 1),
  "an archive.json removed": ("unlink", CA + "/archive_00001/archive.json$", 1),
  "a dtype dir removed": ("rmdir", CA + "/archive_00000/bfloat16$", 1),
  "an archive dir closed": ("close", CA + "/archive_00000$", 1),
  "index removed": ("unlink", CA + "/jaxreshard.json$", 1),
  "table removed": ("unlink", CB + "/jaxreshard.table$", 1),
  "lock removed last": ("unlink", CA + LOCK + "$", 1),
  "leftover's dir removed": ("rmdir", CA + "$", 1),
  "lock released after the removal": ("close", CA + LOCK + r" \(deleted\)$", 1),
  "other host's leftover's first removal": ("unlink", CB + "/.", 1),
  "lockless leftover's lock removed": ("unlink", CC + LOCK + "$", 1),
  "not killed": (None, "", 0),
}
# Orbax's temporary directory, or the name a clean gives it, emptied, before its lock goes.
CO = r"^/(ck\.orbax-checkpoint-tmp|\.ck\.tmp-[0-9a-f]{32}-[^/]+)"
CLEAN_ORBAX = {
  "renamed to a name of this host's": ("renameat2", CO + "$", 1),
  "orbax's metadata removed": ("unlink", CO + "/_CHECKPOINT_METADATA$", 1),
  "a shard file removed": ("unlink", CO + "/archive_00000/float32/c/0$", 1),
  "index removed": ("unlink", CO + "/jaxreshard.json$", 1),
  "lock removed last": ("unlink", CO + LOCK + "$", 1),
  "leftover's dir removed": ("rmdir", CO + "$", 1),
  "not killed": (None, "", 0),
}
CS = r"^/run/(2\.orbax-checkpoint-tmp|\.2\.tmp-[0-9a-f]{32}-[^/]+)"
CLEAN_MANAGER = {
  "renamed to a name of this host's": ("renameat2", CS + "$", 1),
  "step's metadata removed": ("unlink", CS + "/_CHECKPOINT_METADATA$", 1),
  "item's index removed": ("unlink", CS + "/default/jaxreshard.json$", 1),
  "item's shard file removed": ("unlink", CS + "/default/archive_00001/float32/c/0$", 1),
  "item's lock removed": ("unlink", CS + "/default" + LOCK + "$", 1),
  "item's dir removed": ("rmdir", CS + "/default$", 1),
  "step's lock removed last": ("unlink", CS + LOCK + "$", 1),
  "step's dir removed": ("rmdir", CS + "$", 1),
  "not killed": (None, "", 0),
}
# The CLI's outputs: ``reshard`` (whole and ``--rank``) and ``merge`` write through
# ``save_records``; one point per call site of its commit protocol, and whether OUT
# is committed once it is killed there.
OUT = r"^/\.out\.tmp-[^/]+"
RESHARD_WHOLE = {
  "temp dir made": (("mkdir", OUT + "$", 1), False),
  "lock file": (("open", OUT + LOCK + "$", 1), False),
  "archive dir": (("mkdir", OUT + "/archive_00000$", 1), False),
  "last shard data": (("writev", OUT + "/archive_00002/float32/c/0$", 1), False),
  "last archive.json": (("writev", OUT + "/archive_00002/archive.json$", 1), False),
  "index data": (("writev", OUT + "/jaxreshard.json$", 1), False),
  "fsync of the temp dir": (("fsync", OUT + "$", 1), False),
  "the rename": (("renameat2", "^/out$", 1), False),
  "lock file removed after the rename": (("unlink", "^/out" + LOCK + "$", 1), True),
  "fsync of the parent after the rename": (("fsync", "^$", 1), True),
  "not killed": ((None, "", 0), True),
}
PART = r"^/\.part1\.tmp-[^/]+"
RESHARD_RANK = {
  "temp dir made": (("mkdir", PART + "$", 1), False),
  "shard data": (("writev", PART + "/archive_00000/float32/c/0$", 1), False),
  "index data": (("writev", PART + "/jaxreshard.json$", 1), False),
  "the rename": (("renameat2", "^/part1$", 1), False),
  "lock file removed after the rename": (("unlink", "^/part1" + LOCK + "$", 1), True),
  "not killed": ((None, "", 0), True),
}
MERGE = {
  "temp dir made": (("mkdir", OUT + "$", 1), False),
  "lock file": (("open", OUT + LOCK + "$", 1), False),
  "a shard data": (("writev", OUT + "/archive_00001/bfloat16/c/0$", 1), False),
  "last archive.json": (("writev", OUT + "/archive_00002/archive.json$", 1), False),
  "index data": (("writev", OUT + "/jaxreshard.json$", 1), False),
  "fsync of the temp dir": (("fsync", OUT + "$", 1), False),
  "the rename": (("renameat2", "^/out$", 1), False),
  "lock file removed after the rename": (("unlink", "^/out" + LOCK + "$", 1), True),
  "not killed": ((None, "", 0), True),
}
POINTS = {
  "save_records": SAVE_RECORDS,
  "save_records_table": SAVE_RECORDS_TABLE,
  "save_over_leftover": SAVE_OVER_LEFTOVER,
  "save_sharded": SAVE_SHARDED,
  "manager_save": MANAGER_SAVE,
  "clean_records": {n: (p, True) for n, p in CLEAN_RECORDS.items()},
  "clean_orbax": {n: (p, True) for n, p in CLEAN_ORBAX.items()},
  "clean_manager": {n: (p, True) for n, p in CLEAN_MANAGER.items()},
  "reshard_whole": RESHARD_WHOLE,
  "reshard_rank": RESHARD_RANK,
  "merge_parts": MERGE,
}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
  """Runs every kill point (one worker process, a fork per point); returns scenario
  -> name -> (its directory, what the child reported)."""
  base = str(tmp_path_factory.mktemp("killed"))
  kills = {s: [p for p, _ in points.values()] for s, points in POINTS.items()}
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", OPENBLAS_NUM_THREADS="1")
  proc = subprocess.run(
    [sys.executable, "-m", "tests._kill_worker", base, json.dumps(kills)],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  return {
    s: {n: (os.path.join(base, s, str(i)), out[s][i]) for i, n in enumerate(points)}
    for s, points in POINTS.items()
  }


def _cli(*args) -> tuple[int, str]:
  """Exit code and output of the CLI; an exception other than the CLI's exit fails."""
  result = CliRunner().invoke(app, [str(a) for a in args], env={"JAXRESHARD_TRACEBACK": "1"})
  if result.exception is not None and not isinstance(result.exception, SystemExit):
    raise result.exception
  assert "internal error" not in result.output
  return result.exit_code, result.output


def _exact_or_refused(read, expected, where: str | None = None) -> bool:
  """``read()`` gives ``expected``'s records bit for bit (True) or refuses with an
  ``ArchiveError`` naming ``where`` (False); any other outcome fails."""
  try:
    got = read()
  except jr.ArchiveError as e:
    assert where is None or where in str(e), (where, e)
    return False
  for a, b in zip(got, expected, strict=True):
    assert_records_equal(a, b)
  return True


def _leftovers(directory: str) -> list[str]:
  return sorted(
    os.path.join(d, n)
    for d, dirs, _ in os.walk(directory)
    for n in dirs
    if tempname.is_temporary(n)
  )


def _check_reached(at, point, rc):
  """The child died in the call the kill point names (or, not killed, saved)."""
  call, pattern, _ = point
  if call is None:
    assert rc == 0 and at is None, at
  else:
    assert rc == 137 and at is not None and at[0] == call and re.search(pattern, at[1]), (rc, at)


def _check_clean(final: str, before_lock: bool = False) -> None:
  """``clean`` removes every temporary directory a killed save left, but one of
  orbax's made before the save's lock was in it (only when ``before_lock``): without
  a lock nothing says that its writer is gone, so it is kept (and the next save of
  the path removes it, as orbax does)."""
  parent = os.path.dirname(final)
  unlocked = [
    os.path.join(parent, n)
    for n in sorted(os.listdir(parent))
    if tempname.ORBAX_TEMP_SUFFIX in n and not tempdir.has_lock_file(os.path.join(parent, n))
  ]
  assert before_lock or not unlocked
  code, out = _cli("clean", final, "--all", "--json")
  assert code == 0, out
  assert _leftovers(parent) == unlocked, json.loads(out)


# --- save_records -------------------------------------------------------------------


@functools.cache
def _reference(base: str, scenario: str) -> str:
  """The records ``scenario`` saves, saved whole (what ``verify`` compares with)."""
  path = os.path.join(base, f"reference-{scenario}")
  jr.save_records(path, worker.records(table=scenario == "save_records_table"))
  return path


@pytest.mark.parametrize(
  "scenario,name",
  [(s, n) for s in ("save_records", "save_records_table", "save_over_leftover") for n in POINTS[s]],
)
def test_save_records_killed(killed, scenario, name):
  point, committed = POINTS[scenario][name]
  root, report = killed[scenario][name]
  _check_reached(report["at"], point, report["rc"])
  records, old = worker.records(table=scenario == "save_records_table"), worker.records(1)
  final = os.path.join(root, "ckpt")
  assert os.path.isdir(final) is committed
  if committed:
    assert _exact_or_refused(lambda: jr.load_records(final), records)
    for rank in range(2):
      assert_records_equal(jr.restore(final, world_size=2, rank=rank), records[rank])
    assert _cli("inspect", final)[0] == 0
    assert (
      _cli("verify", _reference(os.path.dirname(os.path.dirname(root)), scenario), final)[0] == 0
    )
  else:
    with pytest.raises(FileNotFoundError):
      jr.load_records(final)
    code, out = _cli("inspect", final)
    assert code == 2 and "error:" in out
  # Named explicitly, what a killed save left is read as whole or refused.
  for tmp in _leftovers(root):
    _exact_or_refused(lambda: jr.load_records(tmp), records, tmp)
    assert _cli("inspect", tmp)[0] in (0, 2)
  _check_clean(final)
  assert _exact_or_refused(lambda: jr.load_records(os.path.join(root, "old")), old)
  if committed:
    assert _exact_or_refused(lambda: jr.load_records(final), records)
    with pytest.raises(jr.ArchiveExistsError, match="already exists"):
      jr.save_records(final, records)
  else:
    jr.save_records(final, records)
  assert _exact_or_refused(lambda: jr.load_records(final), records)


# --- save_sharded -------------------------------------------------------------------


@functools.cache
def _sharded_reference(base: str) -> tuple:
  """What ``save_sharded`` of the worker's state commits, read back: records and state."""
  opt, state, shapes, mesh = worker.mesh_args()
  path = os.path.join(base, "reference")
  jr.save_sharded(path, opt, state, shapes, mesh)
  return jr.load_records(path), jr.restore_sharded(path, mesh, "fsdp").state


@pytest.mark.parametrize("name", list(SAVE_SHARDED))
def test_save_sharded_killed(killed, tmp_path_factory, name):
  point, committed = SAVE_SHARDED[name]
  root, report = killed["save_sharded"][name]
  _check_reached(report["at"], point, report["rc"])
  records, state = _sharded_reference(str(tmp_path_factory.getbasetemp()))
  opt, _, shapes, mesh = worker.mesh_args()
  final = os.path.join(root, "ck")
  assert os.path.isdir(final) is committed
  if committed:
    assert _exact_or_refused(lambda: jr.load_records(final), records)
    assert_trees_bit_equal(jr.restore_sharded(final, mesh, "fsdp").state, state)
    assert _cli("inspect", final)[0] == 0
  for tmp in _leftovers(root):
    _exact_or_refused(lambda: jr.load_records(tmp), records, tmp)
  _check_clean(final, before_lock=name in ("orbax's first metadata", "lock file"))
  assert _exact_or_refused(lambda: jr.load_records(os.path.join(root, "old")), worker.records(1))
  if committed:
    with pytest.raises(jr.ArchiveExistsError, match="already exists"):
      jr.save_sharded(final, opt, state, shapes, mesh)
  else:
    jr.save_sharded(final, opt, state, shapes, mesh)
  assert _exact_or_refused(lambda: jr.load_records(final), records)
  assert _leftovers(root) == []


# --- a CheckpointManager step -------------------------------------------------------


@pytest.mark.parametrize("name", list(MANAGER_SAVE))
def test_manager_save_killed(killed, name):
  point, committed = MANAGER_SAVE[name]
  root, report = killed["manager_save"][name]
  _check_reached(report["at"], point, report["rc"])
  records, first = worker.records(), worker.records(1)
  run = os.path.join(root, "run")
  assert os.path.isdir(os.path.join(run, "2")) is committed
  latest = 2 if committed else 1
  with worker.manager(run) as manager:
    assert manager.latest_step() == latest
    got = manager.restore(latest, args=jr.ReshardRestore())
  for a, b in zip(got, records if committed else first, strict=True):
    assert_records_equal(a, b)
  found = _locate.locate(run)
  assert found.step == latest
  assert _exact_or_refused(lambda: jr.load_records(found.path), records if committed else first)
  code, out = _cli("inspect", run)
  assert code == 0 and f"step {latest}" in out
  for tmp in _leftovers(run):
    _exact_or_refused(lambda: jr.load_records(tmp), records, tmp)
    assert _cli("inspect", tmp)[0] in (0, 2)
  step = os.path.join(run, "2")
  _check_clean(step, before_lock=name in ("step's lock file", "step's first metadata"))
  assert _exact_or_refused(lambda: jr.load_records(os.path.join(run, "1", "default")), first)
  with worker.manager(run) as manager:
    if not committed:
      manager.save(2, args=jr.ReshardSave(records))
      manager.wait_until_finished()
    got = manager.restore(2, args=jr.ReshardRestore())
  for a, b in zip(got, records, strict=True):
    assert_records_equal(a, b)
  assert _leftovers(run) == []


# --- what orbax writes while it commits, lost in a crash ----------------------------


def test_a_commit_whose_orbax_files_a_crash_lost_still_reads_exactly(tmp_path):
  """Orbax rewrites ``_CHECKPOINT_METADATA`` (in place) and writes
  ``commit_success.txt`` after the durable rename's fsync of the tree, just before its
  rename; both are fsync'ed only after the rename, and the lock file's removal after
  it too. A crash then keeps the rename but may lose them: the metadata empty, the
  success file gone, the lock file back. Every reader still gives the saved bits."""
  records = worker.records()
  opt, state, shapes, mesh = worker.mesh_args()
  run, ck = tmp_path / "run", tmp_path / "ck"
  with worker.manager(str(run)) as manager:
    manager.save(1, args=jr.ReshardSave(records))
    manager.wait_until_finished()
  jr.save_sharded(ck, opt, state, shapes, mesh)
  saved = jr.load_records(ck)
  for top in (run / "1", ck):
    (top / "_CHECKPOINT_METADATA").write_bytes(b"")
    (top / "commit_success.txt").unlink()
    (top / tempdir.LOCK_FILE).write_bytes(b"")
  with worker.manager(str(run)) as manager:
    assert manager.latest_step() == 1
    got = manager.restore(1, args=jr.ReshardRestore())
  for a, b in zip(got, records, strict=True):
    assert_records_equal(a, b)
  assert _locate.locate(run).step == 1
  assert _cli("inspect", run)[0] == 0
  assert _exact_or_refused(lambda: jr.load_records(ck), saved)
  assert_trees_bit_equal(jr.restore_sharded(ck, mesh, "fsdp").state, state)
  assert _cli("verify", ck, ck)[0] == 0
  _check_clean(str(ck))
  assert (ck / "_CHECKPOINT_METADATA").exists() and (run / "1" / "default").is_dir()


# --- clean, killed ------------------------------------------------------------------


def _readers_of_a_leftover(tmp: str, records: list) -> None:
  """Named explicitly, what a killed save or clean left gives its save's bits or is
  refused naming it: by every reader, none laxer than ``load_records``."""
  whole = _exact_or_refused(lambda: jr.load_records(tmp), records, tmp)
  for rank in range(len(records)):
    _exact_or_refused(
      lambda: [jr.restore(tmp, world_size=len(records), rank=rank)], [records[rank]], tmp
    )
  code, out = _cli("inspect", tmp)
  assert code in (0, 2), out
  code, out = _cli("verify", tmp, tmp)
  assert code == (0 if whole else 2), out


def _rerun_clean(final: str, parent: str) -> None:
  """A rerun of ``clean`` finishes the job: no temporary directory is left."""
  code, out = _cli("clean", final, "--all", "--json")
  assert code == 0, out
  assert _leftovers(parent) == [], json.loads(out)


@pytest.mark.parametrize("name", list(CLEAN_RECORDS))
def test_clean_killed(killed, name):
  point = CLEAN_RECORDS[name]
  root, report = killed["clean_records"][name]
  _check_reached(report["at"], point, report["rc"])
  records, old = worker.records(), worker.records(1)
  final = os.path.join(root, "ckpt")
  base = os.path.dirname(os.path.dirname(root))
  for ckpt, saved in ((final, records), (os.path.join(root, "old"), old)):
    assert _exact_or_refused(lambda: jr.load_records(ckpt), saved)
    for rank in range(2):
      assert_records_equal(jr.restore(ckpt, world_size=2, rank=rank), saved[rank])
  assert _cli("inspect", final)[0] == 0
  assert _cli("verify", _reference(base, "save_records"), final)[0] == 0
  for tmp in _leftovers(root):
    table = os.path.basename(tmp).startswith(".ckpt.tmp-b")
    _readers_of_a_leftover(tmp, worker.records(table=table))
  _rerun_clean(final, root)
  assert _exact_or_refused(lambda: jr.load_records(final), records)
  assert _exact_or_refused(lambda: jr.load_records(os.path.join(root, "old")), old)


@pytest.mark.parametrize("name", list(CLEAN_ORBAX))
def test_clean_of_an_orbax_leftover_killed(killed, tmp_path_factory, name):
  point = CLEAN_ORBAX[name]
  root, report = killed["clean_orbax"][name]
  _check_reached(report["at"], point, report["rc"])
  final = os.path.join(root, "ck")
  with pytest.raises(FileNotFoundError):
    jr.load_records(final)
  for tmp in _leftovers(root):
    _readers_of_a_leftover(tmp, worker.records())
  _rerun_clean(final, root)
  assert _exact_or_refused(lambda: jr.load_records(os.path.join(root, "old")), worker.records(1))
  opt, state, shapes, mesh = worker.mesh_args()
  jr.save_sharded(final, opt, state, shapes, mesh)
  records, _ = _sharded_reference(str(tmp_path_factory.getbasetemp()))
  assert _exact_or_refused(lambda: jr.load_records(final), records)


@pytest.mark.parametrize("name", list(CLEAN_MANAGER))
def test_clean_of_a_manager_step_killed(killed, name):
  point = CLEAN_MANAGER[name]
  root, report = killed["clean_manager"][name]
  _check_reached(report["at"], point, report["rc"])
  records, first = worker.records(), worker.records(1)
  run = os.path.join(root, "run")
  with worker.manager(run) as manager:
    assert manager.latest_step() == 1
    got = manager.restore(1, args=jr.ReshardRestore())
  for a, b in zip(got, first, strict=True):
    assert_records_equal(a, b)
  assert _locate.locate(run).step == 1
  code, out = _cli("inspect", run)
  assert code == 0 and "step 1" in out, out
  assert _exact_or_refused(lambda: jr.load_records(os.path.join(run, "1", "default")), first)
  for tmp in _leftovers(run):
    if os.path.isdir(os.path.join(tmp, "default")):
      _readers_of_a_leftover(os.path.join(tmp, "default"), records)
  _rerun_clean(os.path.join(run, "2"), run)
  with worker.manager(run) as manager:
    manager.save(2, args=jr.ReshardSave(records))
    manager.wait_until_finished()
    assert manager.latest_step() == 2
    got = manager.restore(2, args=jr.ReshardRestore())
  for a, b in zip(got, records, strict=True):
    assert_records_equal(a, b)
  assert _exact_or_refused(lambda: jr.load_records(os.path.join(run, "1", "default")), first)


# --- the CLI's outputs, killed ------------------------------------------------------


@functools.cache
def _resharded(base: str) -> tuple[list, list]:
  """What ``reshard -w 3`` of the worker's records writes, read back: the whole
  output's records, and each ``--rank`` part's."""
  ck, out = os.path.join(base, "reshard-source"), os.path.join(base, "reshard-out")
  jr.save_records(ck, worker.records())
  assert _cli("reshard", ck, out, "-w", 3)[0] == 0
  parts = []
  for r in range(3):
    assert _cli("reshard", ck, os.path.join(base, f"reshard-part{r}"), "-w", 3, "--rank", r)[0] == 0
    parts.append(jr.load_records(os.path.join(base, f"reshard-part{r}")))
  return jr.load_records(out), parts


def _check_output(out: str, committed: bool, expected: list, source: str) -> None:
  """OUT of a killed reshard or merge: absent (every reader refuses it, naming it) or
  whole and exact (every reader gives its bits, and the source's back)."""
  assert os.path.isdir(out) is committed
  if committed:
    assert _exact_or_refused(lambda: jr.load_records(out), expected)
    back = worker.records()
    for rank in range(2):  # 2 -> 3 -> 2 gives the source back, bit for bit
      assert_records_equal(jr.restore(out, world_size=2, rank=rank), back[rank])
    assert _cli("inspect", out)[0] == 0
    assert _cli("verify", source, out)[0] == 0
  else:
    with pytest.raises(FileNotFoundError, match=re.escape(out)):
      jr.load_records(out)
    with pytest.raises(FileNotFoundError, match=re.escape(out)):
      jr.restore(out, world_size=2, rank=0)
    for args in (("inspect", out), ("verify", source, out)):
      code, text = _cli(*args)
      assert code == 2 and f"{out} does not exist" in text, text
  for tmp in _leftovers(os.path.dirname(out)):
    _exact_or_refused(lambda: jr.load_records(tmp), expected, tmp)
    code, text = _cli("verify", source, tmp)
    assert code in (0, 2), text


@pytest.mark.parametrize(
  "scenario,name", [(s, n) for s in ("reshard_whole", "merge_parts") for n in POINTS[s]]
)
def test_reshard_or_merge_killed(killed, tmp_path_factory, scenario, name):
  point, committed = POINTS[scenario][name]
  root, report = killed[scenario][name]
  _check_reached(report["at"], point, report["rc"])
  expected, _ = _resharded(str(tmp_path_factory.getbasetemp()))
  ck, out = os.path.join(root, "ck"), os.path.join(root, "out")
  _check_output(out, committed, expected, ck)
  assert _exact_or_refused(lambda: jr.load_records(ck), worker.records())
  if scenario == "reshard_whole":
    again = ("reshard", ck, out, "-w", 3)
  else:
    again = ("merge", out, *(os.path.join(root, f"part{r}") for r in range(3)))
  code, text = _cli(*again)
  if committed:
    assert code == 2 and "already exists" in text, text
  else:
    assert code == 0, text
  _check_output(out, True, expected, ck)
  _check_clean(out)
  assert _leftovers(root) == []


@pytest.mark.parametrize("name", list(RESHARD_RANK))
def test_reshard_of_one_rank_killed(killed, tmp_path_factory, name):
  point, committed = RESHARD_RANK[name]
  root, report = killed["reshard_rank"][name]
  _check_reached(report["at"], point, report["rc"])
  expected, parts = _resharded(str(tmp_path_factory.getbasetemp()))
  part = os.path.join(root, "part1")
  assert os.path.isdir(part) is committed
  for tmp in _leftovers(root):
    _exact_or_refused(lambda: jr.load_records(tmp), parts[1], tmp)
  merged = os.path.join(root, "merged")
  merge = ("merge", merged, *(os.path.join(root, f"part{r}") for r in range(3)))
  code, text = _cli(*merge)
  if committed:
    assert _exact_or_refused(lambda: jr.load_records(part), parts[1])
    assert code == 0, text
  else:
    with pytest.raises(FileNotFoundError, match=re.escape(part)):
      jr.load_records(part)
    assert code == 2 and f"{part} does not exist" in text, text
    assert not os.path.exists(merged)
    code, text = _cli("reshard", os.path.join(root, "ck"), part, "-w", 3, "--rank", 1)
    assert code == 0, text
    assert _cli(*merge)[0] == 0
  assert _exact_or_refused(lambda: jr.load_records(part), parts[1])
  assert _exact_or_refused(lambda: jr.load_records(merged), expected)
  _check_clean(part)
  assert _leftovers(root) == []
