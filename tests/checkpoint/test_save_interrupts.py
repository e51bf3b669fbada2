"""An interrupt (Ctrl-C, a signal turned into an exception) at any point of a save:
the checkpoint is either not there or whole, and nothing stays held.

Interrupts are raised where a real ``KeyboardInterrupt`` lands: inside the system
calls' Python wrappers, and on the return of the commit's rename (a trace hook).
"""

import gc
import os
import sys
import threading
import warnings

import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import shardfile, tempdir, tempname
from jaxreshard._src.core import gcpause
from tests._core_util import adam_records, assert_records_equal


def _deleted_files_held() -> list[str]:
  """Files this process holds open that are no longer in any directory."""
  out = []
  for fd in os.listdir("/proc/self/fd"):
    try:
      target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
      continue
    if target.endswith(" (deleted)"):
      out.append(target)
  return out


pytestmark = pytest.mark.skipif(
  not os.path.isdir("/proc/self/fd"), reason="needs /proc to see open descriptors"
)


def test_an_interrupt_just_after_the_commit_rename_keeps_the_checkpoint(tmp_path):
  """The rename has put the checkpoint in place when the interrupt arrives: the save
  raises it, and the checkpoint stays whole (the cleanup of a failed save must not
  empty a directory that is no longer its temporary one)."""
  records = adam_records(3)
  out = str(tmp_path / "ckpt")

  def tracer(frame, event, arg):
    if frame.f_code is tempdir.commit_dir.__code__:
      if event == "return":
        raise KeyboardInterrupt("just after the rename")
      return tracer
    return None

  sys.settrace(tracer)
  try:
    with pytest.raises(KeyboardInterrupt, match="just after the rename"):
      jr.save_records(out, records)
  finally:
    sys.settrace(None)
  for a, b in zip(jr.load_records(out), records, strict=True):
    assert_records_equal(a, b)
  assert tempdir.remove_temp_dirs(out) == []
  # Nothing of the save's own is left in it: its lock file goes as on a commit.
  assert not os.path.exists(os.path.join(out, tempdir.LOCK_FILE))
  with pytest.raises(jr.ArchiveExistsError):
    jr.save_records(out, records)


@pytest.mark.parametrize("call", [1, 2, 5])
def test_an_interrupt_inside_a_write_leaves_no_file_held(tmp_path, monkeypatch, call):
  """A ``KeyboardInterrupt`` from inside a write (where a real SIGINT arrives): the
  temporary directory is removed, and no descriptor of its files stays open to
  keep their blocks allocated."""
  records = adam_records(3)
  out = str(tmp_path / "ckpt")
  real, seen = shardfile._writev, []

  def writev(fd, parts):
    seen.append(fd)
    if len(seen) == call:
      raise KeyboardInterrupt("inside a write")
    return real(fd, parts)

  monkeypatch.setattr(shardfile, "_writev", writev)
  before = _deleted_files_held()
  with pytest.raises(KeyboardInterrupt, match="inside a write"):
    jr.save_records(out, records)
  assert _deleted_files_held() == before
  assert not os.path.lexists(out)
  assert os.listdir(tmp_path) == []
  monkeypatch.setattr(shardfile, "_writev", real)
  jr.save_records(out, records)
  for a, b in zip(jr.load_records(out), records, strict=True):
    assert_records_equal(a, b)


@pytest.mark.parametrize("where", ["open", "flock", "fstat"])
def test_an_interrupt_while_the_temporary_directory_is_taken_leaves_nothing(
  tmp_path, monkeypatch, where
):
  """Between the temporary directory's making and the save's hold on it (its
  descriptor, its lock file, the lock), a ``KeyboardInterrupt`` left the directory
  behind in a process that goes on (a notebook): it is removed as an error's is."""
  records = adam_records(3)
  out = str(tmp_path / "ckpt")
  module = tempdir.fcntl if where == "flock" else tempdir.os
  real = getattr(module, where)
  calls = []

  def interrupted(*args, **kwargs):
    calls.append(args)
    if len(calls) == 2 or where == "flock":  # the lock file's open, the lock, a check
      raise KeyboardInterrupt(f"inside {where}")
    return real(*args, **kwargs)

  made = tempdir.os.mkdir
  monkeypatch.setattr(
    tempdir.os,
    "mkdir",
    lambda *a, **k: (made(*a, **k), monkeypatch.setattr(module, where, interrupted))[0],
  )
  with pytest.raises(KeyboardInterrupt, match=f"inside {where}"):
    jr.save_records(out, records)
  monkeypatch.undo()
  assert calls, "the interrupt was never raised"
  assert os.listdir(tmp_path) == []
  jr.save_records(out, records)
  for a, b in zip(jr.load_records(out), records, strict=True):
    assert_records_equal(a, b)


def test_a_temporary_directory_dropped_unclosed_releases_its_lock(tmp_path):
  """An interrupt between a temporary directory's making and its caller's hold on
  it drops the object: its lock goes with it, so a later save removes the
  directory (a held lock would keep it for the life of the process)."""
  final = str(tmp_path / "ckpt")
  tmp = tempdir.new_temp_dir(final)
  path = tmp.path
  assert tempdir.remove_temp_dirs(final) == []  # held: kept
  del tmp
  assert tempdir.remove_temp_dirs(final) == [path]
  assert os.listdir(tmp_path) == []


def test_pauses_of_the_collector_in_several_threads_end_with_the_last():
  """One thread's pause ending inside another's keeps the collector paused; the
  last to end enables it again, in either order."""
  assert gc.isenabled()
  for first_out in ("a", "b"):
    a_in, b_in, a_go, b_go, done = (threading.Event() for _ in range(5))
    states = {}

    def worker(name, entered, go):
      with gcpause.no_gc():
        entered.set()
        go.wait(10)
      states[name] = gc.isenabled()
      if len(states) == 2:
        done.set()

    threads = [
      threading.Thread(target=worker, args=("a", a_in, a_go)),
      threading.Thread(target=worker, args=("b", b_in, b_go)),
    ]
    threads[0].start()
    assert a_in.wait(10)
    threads[1].start()
    assert b_in.wait(10)
    (a_go if first_out == "a" else b_go).set()
    threads[0 if first_out == "a" else 1].join(10)
    assert not gc.isenabled(), "the collector came back while a pause was still on"
    (b_go if first_out == "a" else a_go).set()
    for t in threads:
      t.join(10)
    assert done.is_set() and gc.isenabled()
  with gcpause.no_gc(), gcpause.no_gc():  # nested in one thread
    assert not gc.isenabled()
  assert gc.isenabled()


def test_a_pause_left_on_by_a_thread_that_a_fork_drops_ends_in_the_child():
  """In a forked child only the forking thread lives: another thread's pause,
  on at the fork, never ends there, so the child's collector runs again."""
  entered, release = threading.Event(), threading.Event()

  def hold():
    with gcpause.no_gc():
      entered.set()
      release.wait(30)

  t = threading.Thread(target=hold)
  t.start()
  try:
    assert entered.wait(10) and not gc.isenabled()
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # jax warns that a fork of a threaded process may hang
      pid = os.fork()
    if pid == 0:
      os._exit(0 if gc.isenabled() else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
  finally:
    release.set()
    t.join(10)
  assert gc.isenabled()


def test_a_checkpoint_name_of_up_to_255_bytes_is_saved_and_its_leftovers_found(tmp_path):
  """A legal name too long for the temporary sibling's name with its suffix (uuid, pid,
  host) raised ENAMETOOLONG "making the temporary directory of a save". The sibling
  carries it cut, with a hash of the whole: names alike but for their ends stay apart."""
  records = adam_records(3)
  for name in ("a" * 255, "a" * 254 + "b", "é" * 100 + "x" * 50):
    out = str(tmp_path / name)
    jr.save_records(out, records)
    for a, b in zip(jr.load_records(out), records, strict=True):
      assert_records_equal(a, b)
  stems = {tempname.temp_stem(n) for n in ("a" * 255, "a" * 254 + "b")}
  assert len(stems) == 2
  # A killed save's sibling of a long name: found and removed by the next save's
  # cleanup (``clean``), and never taken for another name's.
  final = str(tmp_path / ("c" * 240))
  tmp = tempdir.new_temp_dir(final)
  leftover = tmp.path
  assert len(os.path.basename(leftover).encode()) <= 255
  del tmp  # its lock goes with it, as with a killed writer's
  assert tempdir.remove_temp_dirs(str(tmp_path / ("c" * 239 + "d"))) == []
  assert tempdir.remove_temp_dirs(final) == [leftover]


class _InterruptedAppend(list):
  """A list whose next ``append`` raises ``KeyboardInterrupt``, as a Ctrl-C landing
  right after the fsync pool took a job; with ``wait``, once that job has run."""

  def __init__(self, wait: bool):
    super().__init__()
    self.wait = wait

  def append(self, future):
    if self.wait:
      future.exception()  # the worker fsynced and closed the descriptor, and freed its slot
    raise KeyboardInterrupt


def _free_slots(syncer, limit: int) -> int:
  """How many of the syncer's ``limit`` slots can be taken now (all are given back)."""
  taken = 0
  while taken <= limit and syncer._slots.acquire(blocking=False):
    taken += 1
  for _ in range(taken):
    syncer._slots.release()
  return taken


@pytest.mark.parametrize("worker_first", [True, False])
def test_an_interrupt_while_a_file_is_handed_to_the_fsync_pool_closes_it_once(
  tmp_path, worker_first
):
  """Ctrl-C lands between the fsync pool taking a file and the writer recording it,
  with the fsync run already (``worker_first``) or still queued: the interrupt is
  what is raised, the descriptor is closed exactly once, and its slot is freed once.
  (Before: the writer closed it and freed its slot too: "ValueError: Semaphore
  released too many times" came out of a reshard interrupted by Ctrl-C, exit code 2,
  and the second close could have closed another file given the same number.)"""
  limit = 4
  syncer = shardfile._Syncer(threads=1, limit=limit)
  gate = threading.Event()
  if not worker_first:  # the pool's one thread is busy until the interrupt is raised
    syncer._pool.submit(gate.wait)
  fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
  syncer._pending = _InterruptedAppend(wait=worker_first)
  try:
    with pytest.raises(KeyboardInterrupt):
      syncer.submit([fd], str(tmp_path / "f"))
    with pytest.raises(OSError):
      os.fstat(fd)  # closed, by the worker or by the failed hand-over
    # Another file takes the freed number while a queued fsync job may still hold it.
    reused = os.open(tmp_path / "g", os.O_CREAT | os.O_WRONLY)
  finally:
    gate.set()
  syncer._pending = []
  syncer.shutdown()
  try:
    assert _free_slots(syncer, limit) == limit
    os.fstat(reused)  # no late close of the old number closed it
  finally:
    os.close(reused)


class _InterruptedSlots:
  """The fsync pool's slots, all taken: Ctrl-C lands while the writer waits for one."""

  def __init__(self):
    self.released = 0

  def acquire(self):
    raise KeyboardInterrupt("waiting for an fsync slot")

  def release(self):
    self.released += 1


def test_an_interrupt_while_waiting_for_an_fsync_slot_closes_the_file(tmp_path):
  """Every slot taken (64 files waiting for their fsync on a slow disk), the writer
  waits in ``submit``; Ctrl-C there: the file handed over is closed, and no slot it
  never took is freed. (Before: its descriptor stayed open, on a file its save then
  removed, for the life of the process.)"""
  syncer = shardfile._Syncer(threads=1, limit=4)
  syncer._slots = slots = _InterruptedSlots()
  fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
  with pytest.raises(KeyboardInterrupt, match="waiting for an fsync slot"):
    syncer.submit([fd], str(tmp_path / "f"))
  with pytest.raises(OSError):
    os.fstat(fd)
  assert slots.released == 0
  syncer.shutdown()


def _interrupt_on_call(code, nth: int):
  """A profile hook raising ``KeyboardInterrupt`` on the ``nth`` entry into ``code``
  (where a signal lands: a function's entry), once; and the count of entries."""
  calls = []

  def hook(frame, event, arg):
    if event == "call" and frame.f_code is code:
      calls.append(frame)
      if len(calls) == nth:
        sys.setprofile(None)
        raise KeyboardInterrupt(f"entering {code.co_qualname} #{nth}")

  return hook, calls


@pytest.mark.parametrize(
  "where, nth",
  [
    ("OutDir.__exit__", 1),
    ("OutDir.__exit__", 2),
    ("OutDir.__exit__", 6),
    ("OutDir.finish", 1),
    ("OutDir.finish", 2),
    ("_Syncer.submit", 1),
    ("_Syncer.submit", 3),  # the ``c`` directory's, from ``sync``
  ],
)
def test_an_interrupt_as_a_written_file_or_directory_is_let_go_leaves_no_descriptor(
  tmp_path, where, nth
):
  """Ctrl-C where it lands as a written file is handed over to be fsync'ed and closed
  (the entry of ``finish`` or ``submit``: a function's entry is where a signal's handler
  runs), as a directory is handed over, or as a ``with`` block of an archive's
  directory (or its ``c`` subdirectory) ends: once the interrupt is dropped, no
  descriptor of the removed files is left. (Before: each was kept open, on a removed
  file, for the life of the process, one more per interrupted save.)"""
  records = adam_records(3)
  out = str(tmp_path / "ckpt")
  cls, name = where.split(".")
  hook, calls = _interrupt_on_call(getattr(getattr(shardfile, cls), name).__code__, nth)
  before, held = set(os.listdir("/proc/self/fd")), _deleted_files_held()
  sys.setprofile(hook)
  try:
    with pytest.raises(KeyboardInterrupt, match=f"entering {where} #{nth}"):
      jr.save_records(out, records)
  finally:
    sys.setprofile(None)
  del calls[:]  # the frames
  gc.collect()
  assert _deleted_files_held() == held
  assert set(os.listdir("/proc/self/fd")) <= before
  assert os.listdir(tmp_path) == []
  jr.save_records(out, records)
  for a, b in zip(jr.load_records(out), records, strict=True):
    assert_records_equal(a, b)


class _InterruptedWait:
  """A pending fsync whose wait Ctrl-C interrupts (a slow disk's fsync)."""

  def result(self):
    raise KeyboardInterrupt("waiting for an fsync")


def test_an_interrupt_while_the_fsync_pool_is_shut_down_ends_its_threads(tmp_path):
  """Ctrl-C while a failing save's cleanup waits for the fsyncs it handed over: the
  pool's threads still end (once their fsyncs are done), not left idle for as long
  as the interrupt's traceback keeps the pool alive."""
  syncer = shardfile._Syncer(threads=2, limit=4)
  fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
  syncer.submit([fd], str(tmp_path / "f"))  # starts a thread
  threads = [t for t in threading.enumerate() if t.name.startswith("jaxreshard-fsync")]
  assert threads
  syncer._pending.append(_InterruptedWait())
  with pytest.raises(KeyboardInterrupt, match="waiting for an fsync"):
    syncer.shutdown()
  for t in threads:
    t.join(10)
  assert not any(t.is_alive() for t in threads), "the fsync pool's threads were left running"


def test_an_interrupt_as_the_collector_is_paused_leaves_it_running():
  """Ctrl-C where it can land while a pause of the collector begins (after a builtin
  returns: ``gc.disable``, the count, the lock's exit) or ends: the interrupt comes
  out, and the collector runs again with nothing left counted. (Before: landing after
  ``gc.disable`` or after the count, before the ``try``, left it off for the rest of
  the process: every later pause found it off and kept it so.)"""
  code = gcpause.no_gc.__wrapped__.__code__
  sites = []

  def record(frame, event, arg):
    if event == "c_return" and frame.f_code is code:
      sites.append((frame.f_lineno, len([s for s in sites if s[0] == frame.f_lineno])))

  sys.setprofile(record)
  try:
    with gcpause.no_gc():
      pass
  finally:
    sys.setprofile(None)
  assert len(sites) >= 4
  for site in sites:
    seen = []

    def hook(frame, event, arg, site=site, seen=seen):
      if event == "c_return" and frame.f_code is code:
        at = (frame.f_lineno, len([s for s in seen if s[0] == frame.f_lineno]))
        seen.append(at)
        if at == site:
          sys.setprofile(None)
          raise KeyboardInterrupt(f"at line {site[0] - code.co_firstlineno}")

    sys.setprofile(hook)
    try:
      with pytest.raises(KeyboardInterrupt, match="at line"), gcpause.no_gc():
        pass
    finally:
      sys.setprofile(None)
    assert gc.isenabled(), f"the collector was left off by an interrupt at {site}"
    assert gcpause._HELD == {} and not gcpause._LOCK.locked(), site
