"""A save never reports success for a checkpoint that does not load.

A writer holds an exclusive ``flock`` on its temporary directory's lock file for
the whole save; ``clean`` (plain or ``--all``) and the next save remove only
directories whose lock is free, never by process id or host name. The writer
holds its directory by descriptor and, right before the rename, checks that the
directory at its path is still its own and holds every file it wrote.
Every case runs real saves and real ``clean`` processes on the real file system.
"""

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import jax.numpy as jnp
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import store as _archive_io
from jaxreshard._src.checkpoint import tempname as _tempname
from tests._core_util import adam_records, assert_records_equal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")


# Every test here is slow: `pytest -m "not slow"` skips them, plain `pytest` runs them.
pytestmark = pytest.mark.slow


def _cli(*args: str) -> subprocess.CompletedProcess:
  """``python -m jaxreshard ARGS`` in a process of its own."""
  return subprocess.run(
    [sys.executable, "-m", "jaxreshard", *args],
    capture_output=True,
    text=True,
    timeout=300,
    env=ENV,
  )


class _PausedSave:
  """``save_records`` in a thread, stopped after archive ``at`` until released."""

  def __init__(self, path, records, at: int):
    self.reached, self.release = threading.Event(), threading.Event()
    self.error = None

    def progress(p):
      if p.done == at + 1:
        self.reached.set()
        assert self.release.wait(300)

    def run():
      try:
        jr.save_records(path, records, progress=progress)
      except BaseException as e:  # pylint: disable=broad-except
        self.error = e

    self.thread = threading.Thread(target=run)
    self.thread.start()
    assert self.reached.wait(300), "the save never reached its pause"

  def finish(self):
    self.release.set()
    self.thread.join(300)
    assert not self.thread.is_alive()


def _temp_dir(parent) -> str:
  (name,) = [n for n in os.listdir(parent) if ".tmp-" in n]
  return os.path.join(parent, name)


@pytest.mark.parametrize("flags", [[], ["--all"]])
def test_clean_from_another_process_never_removes_a_live_save(tmp_path, flags):
  out = tmp_path / "ckpt"
  records = adam_records(40, {"w": ((160,), jnp.float32), "b": ((41,), jnp.float32)})
  save = _PausedSave(out, records, at=19)
  try:
    tmp = _temp_dir(tmp_path)
    result = _cli("clean", str(out), *flags)
    assert result.returncode == 0, result.stderr
    assert f"kept (its writer holds its lock): {tmp}" in result.stdout, result.stdout
    assert "0 of 1 temporary directory" in result.stdout
    assert os.path.isdir(os.path.join(tmp, "archive_00019"))
  finally:
    save.finish()
  assert save.error is None, save.error
  assert os.listdir(tmp_path) == ["ckpt"]
  loaded = jr.load_records(out)
  assert len(loaded) == len(records)
  for x, y in zip(loaded, records):
    assert_records_equal(x, y)


def test_a_save_racing_clean_all_commits_every_archive_or_raises(tmp_path):
  # clean --all in a loop for the whole save: whatever it does, the save
  # either commits a checkpoint that loads completely or raises.
  out = tmp_path / "ckpt"
  world = 1000
  records = adam_records(world, {"w": ((4 * world,), jnp.float32)})
  stop, removed = threading.Event(), []

  def cleaner():
    while not stop.is_set():
      removed.extend(_archive_io.remove_temp_dirs(str(out), everything=True))

  thread = threading.Thread(target=cleaner)
  thread.start()
  try:
    jr.save_records(out, records)
  except (jr.ReshardError, OSError):
    assert not out.exists()
    return
  finally:
    stop.set()
    thread.join()
  # A clean may win a brand-new directory before its writer locks it; the writer
  # then starts over in another, so what was removed is never what was committed.
  assert str(out) not in removed
  loaded = jr.load_records(out)
  assert len(loaded) == world
  for x, y in zip(loaded, records):
    assert_records_equal(x, y)


def _hold_lock(directory) -> subprocess.Popen:
  """A live process holding ``directory``'s writer lock, as a writer does."""
  proc = subprocess.Popen(
    [
      sys.executable,
      "-c",
      textwrap.dedent(f"""
      import fcntl, os, sys
      fd = os.open({os.path.join(str(directory), _archive_io.LOCK_FILE)!r},
                   os.O_RDWR | os.O_CREAT, 0o644)
      fcntl.flock(fd, fcntl.LOCK_EX)
      print("locked", flush=True)
      sys.stdin.read()
      """),
    ],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_liveness_is_the_lock_not_the_pid_or_host(tmp_path):
  from typer.testing import CliRunner

  from jaxreshard._src.cli.commands import app

  out = tmp_path / "ckpt"
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  host = _tempname.host()
  stale = tmp_path / f".ckpt.tmp-{'a' * 32}-{dead.pid}-{host}"
  # A dead pid in its name (a writer in another pid namespace), its lock held.
  locked = tmp_path / f".ckpt.tmp-{'b' * 32}-{dead.pid}-{host}"
  # A live pid in its name, but no lock held: its writer is gone.
  unlocked = tmp_path / f".ckpt.tmp-{'e' * 32}-{os.getpid()}-{host}"
  other = tmp_path / f".ckpt.tmp-{'c' * 32}-1-some.other.host"
  unrelated = tmp_path / f".ckpt2.tmp-{'d' * 32}-{dead.pid}-{host}"
  for d in (stale, locked, unlocked, other, unrelated):
    (d / "archive_00000").mkdir(parents=True)
  # A link named like a temporary directory: no save's, never followed or removed
  # (it was listed as kept because "its writer holds its lock": there is none).
  (tmp_path / "elsewhere").mkdir()
  link = tmp_path / f".ckpt.tmp-{'f' * 32}-{dead.pid}-{host}"
  os.symlink(tmp_path / "elsewhere", link)
  holder = _hold_lock(locked)
  try:
    result = CliRunner().invoke(app, ["clean", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path)) == sorted(
      [locked.name, other.name, unrelated.name, "elsewhere", link.name]
    )
    assert f"removed: {stale}" in result.stdout and f"removed: {unlocked}" in result.stdout
    assert f"kept (its writer holds its lock): {locked}" in result.stdout
    assert link.name not in result.stdout and (tmp_path / "elsewhere").is_dir()
    os.unlink(link)
    os.rmdir(tmp_path / "elsewhere")
    assert f"kept (another host's; its lock is free here, --all removes it): {other}" in (
      result.stdout
    )
    assert "2 of 4 temporary directories" in result.stdout
    result = CliRunner().invoke(app, ["clean", str(out), "--all"])
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path)) == sorted([locked.name, unrelated.name])
    # The next save's own clean-up keeps it too.
    jr.save_records(out, adam_records(2))
    assert sorted(os.listdir(tmp_path)) == sorted([locked.name, unrelated.name, "ckpt"])
  finally:
    holder.stdin.close()
    holder.wait()
  result = _cli("clean", str(out))
  assert result.returncode == 0 and f"removed: {locked}" in result.stdout, result.stdout
  assert sorted(os.listdir(tmp_path)) == sorted([unrelated.name, "ckpt"])


@contextlib.contextmanager
def _unremovable(path):
  """``path`` (a file) made impossible to remove for as long as the block runs."""
  if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
    if os.geteuid() == 0:
      pytest.skip("no chattr +i here, and root removes any file")
    os.chmod(path.parent, 0o500)  # not root: a directory it may not change
  try:
    yield
  finally:
    subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    os.chmod(path.parent, 0o755)


def test_a_partial_removal_is_an_error_naming_what_is_left(tmp_path):
  out = tmp_path / "ckpt"
  stale = tmp_path / f".ckpt.tmp-{'a' * 32}-1-{_tempname.host()}"
  (stale / "archive_00000").mkdir(parents=True)
  (stale / "archive_00001").mkdir()
  stuck = stale / "archive_00000" / "archive.json"
  stuck.write_text("{}")
  with _unremovable(stuck):
    result = _cli("clean", str(out))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "removed only partly" in result.stderr and str(stuck) in result.stderr
    assert "removed:" not in result.stdout
    with pytest.raises(jr.ArchiveError, match="removed only partly; left: .*archive.json"):
      _archive_io.remove_temp_dirs(str(out))
  assert _archive_io.remove_temp_dirs(str(out)) == [str(stale)]
  assert os.listdir(tmp_path) == []


def test_a_partial_removal_after_others_also_names_what_was_removed_before_it(tmp_path):
  """The directories removed before the one that could not be are gone: the error
  says which, since no list of them is returned."""
  out = tmp_path / "ckpt"
  host = _tempname.host()
  gone = tmp_path / f".ckpt.tmp-{'a' * 32}-1-{host}"  # sorted first: removed first
  stale = tmp_path / f".ckpt.tmp-{'b' * 32}-1-{host}"
  for d in (gone, stale):
    (d / "archive_00000").mkdir(parents=True)
  stuck = stale / "archive_00000" / "archive.json"
  stuck.write_text("{}")
  with _unremovable(stuck):
    with pytest.raises(jr.ArchiveError) as e:
      _archive_io.remove_temp_dirs(str(out))
    message = str(e.value)
    assert message.startswith(f"{stale} was removed only partly; left: {stuck} ("), message
    assert message.endswith(f" (removed before it: {gone})"), message
    assert not gone.exists()
  assert _archive_io.remove_temp_dirs(str(out)) == [str(stale)]
  assert os.listdir(tmp_path) == []


def test_a_directory_replaced_while_a_clean_removed_it_is_left_as_it_is(tmp_path, monkeypatch):
  """Someone renames a dead writer's directory away and makes another at its path
  while a clean empties it: the clean stops short of removing the new one."""
  from jaxreshard._src.checkpoint import tempdir as _tempdir

  out = tmp_path / "ckpt"
  stale = tmp_path / f".ckpt.tmp-{'a' * 32}-1-{_tempname.host()}"
  (stale / "archive_00000").mkdir(parents=True)
  remove_below = _tempdir._remove_below  # pylint: disable=protected-access

  def then_replaced(dfd, path, keep=""):
    left = remove_below(dfd, path, keep)
    if path == str(stale):
      os.rename(stale, tmp_path / "moved")
      stale.mkdir()  # another directory, empty, at the same path
    return left

  monkeypatch.setattr(_tempdir, "_remove_below", then_replaced)
  with pytest.raises(jr.ArchiveError, match="was replaced while it was removed; it is left as it"):
    _archive_io.remove_temp_dirs(str(out))
  assert stale.is_dir() and os.listdir(stale) == []
  assert os.listdir(tmp_path / "moved") == []  # the one it held: emptied, its lock file too


def test_a_save_whose_every_temporary_directory_a_clean_takes_first_writes_nothing(
  tmp_path, monkeypatch
):
  """A clean may take a new temporary directory's lock before its writer does (it
  finds no writer's lock yet); the save then starts over in another, and gives up
  after 8 such directories, having written nothing."""
  from jaxreshard._src.checkpoint import tempdir as _tempdir

  out = tmp_path / "ckpt"
  mkdir, taken = os.mkdir, []

  def then_taken(path, *args, **kwargs):
    mkdir(path, *args, **kwargs)
    if os.path.basename(path).startswith(".ckpt.tmp-"):
      taken.append((path, _tempdir.hold(path)))  # the clean's probe, as it does first

  monkeypatch.setattr(os, "mkdir", then_taken)
  try:
    with pytest.raises(jr.ArchiveError, match="taken by a concurrent clean; nothing was written"):
      jr.save_records(out, adam_records(2))
  finally:
    monkeypatch.undo()
    for _, held in taken:
      if held is not None:
        os.close(held[1])
        os.close(held[0])
  assert len(taken) == 8 and all(held is not None for _, held in taken)
  for path, _ in taken:
    assert os.listdir(path) == [_archive_io.LOCK_FILE]
  assert sorted(_archive_io.remove_temp_dirs(str(out))) == sorted(p for p, _ in taken)
  assert os.listdir(tmp_path) == []


def test_a_save_whose_temporary_directory_lost_files_raises_and_commits_nothing(tmp_path):
  # Someone removes an archive from the temporary directory by hand while the
  # save runs: the save checks what it wrote before the rename.
  out = tmp_path / "ckpt"
  records = adam_records(6)
  save = _PausedSave(out, records, at=4)
  try:
    shutil.rmtree(os.path.join(_temp_dir(tmp_path), "archive_00002"))
  finally:
    save.finish()
  assert isinstance(save.error, jr.ArchiveError), save.error
  assert "was removed or changed while it was written" in str(save.error)
  assert "archive_00002" in str(save.error)
  assert os.listdir(tmp_path) == []


def test_a_temporary_directory_replaced_between_the_check_and_the_rename_commits_nothing(
  tmp_path, monkeypatch
):
  """Another process gives the temporary path another checkpoint after the save
  checked its files and before its rename (which goes by path): the rename puts
  that one in place. The save finds that what it renamed is not its directory,
  moves it aside under a name a clean leaves alone, and raises: nothing is at the
  path, where the save used to return as if it had committed its own state."""
  from jaxreshard._src.checkpoint import tempdir as _tempdir

  out, other = tmp_path / "ckpt", tmp_path / "other"
  mine, theirs = adam_records(4), adam_records(4, seed=1)
  jr.save_records(other, theirs)
  rename, swapped = _tempdir.commit_dir, []

  def swapped_first(tmp, final):
    if not swapped:
      swapped.append(tmp)
      os.rename(tmp, tmp_path / "moved")  # the save's own directory, still held
      os.rename(other, tmp)
    rename(tmp, final)

  monkeypatch.setattr(_tempdir, "commit_dir", swapped_first)
  with pytest.raises(jr.ArchiveError) as info:
    jr.save_records(out, mine)
  monkeypatch.undo()
  assert "the directory renamed into place is not the one the save wrote" in str(info.value)
  assert "nothing of this save is committed" in str(info.value)
  assert not out.exists()
  (aside,) = [n for n in os.listdir(tmp_path) if ".not-this-save-" in n]
  assert aside in str(info.value)
  loaded = jr.load_records(tmp_path / aside)
  assert len(loaded) == len(theirs)
  for a, b in zip(loaded, theirs):
    assert_records_equal(a, b)
  assert _archive_io.remove_temp_dirs(str(out)) == []  # a clean leaves it alone
  assert (tmp_path / aside).exists()


def test_a_save_whose_temporary_directory_was_replaced_raises(tmp_path):
  # The directory at the temporary path is swapped for another one (complete
  # or not): the save's descriptor tells them apart and nothing is committed.
  out = tmp_path / "ckpt"
  save = _PausedSave(out, adam_records(4), at=3)
  try:
    tmp = _temp_dir(tmp_path)
    os.rename(tmp, tmp_path / "moved")
    shutil.copytree(tmp_path / "moved", tmp)
  finally:
    save.finish()
  assert isinstance(save.error, jr.ArchiveError), save.error
  assert not out.exists()


def test_a_directory_moved_aside_from_a_path_with_a_trailing_slash_lands_beside_it(tmp_path):
  """``not_this_save`` of ``ck/``: the directory at ``ck`` goes beside it (the name
  of ``ck/`` split at its last ``/`` is empty, and the aside path fell inside it)."""
  from jaxreshard._src.checkpoint import rename

  (tmp_path / "ck").mkdir()
  words = rename.not_this_save(str(tmp_path / "tmp"), str(tmp_path / "ck") + "/")
  assert not (tmp_path / "ck").exists()
  (aside,) = os.listdir(tmp_path)
  assert aside.startswith(".ck.not-this-save-") and aside in words
