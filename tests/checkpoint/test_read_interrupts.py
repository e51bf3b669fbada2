"""An interrupt (Ctrl-C) at any line of opening and reading a checkpoint: the read
raises it, and no descriptor it opened outlives it.

A ``KeyboardInterrupt`` lands between any two bytecodes of the main thread: between
an open and its owner's hold, in a ``with`` block's exit, in a ``close`` between the
close and its record. Interrupts are raised at one line of a function by a trace
hook (a trace function may raise: the exception appears at that line).
"""

import contextlib
import gc
import os
import sys

import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import archivejson, archives, reader, restore, shardread, store
from tests._core_util import adam_records, assert_records_equal

pytestmark = pytest.mark.skipif(
  not os.path.isdir("/proc/self/fd"), reason="needs /proc to see open descriptors"
)


def _open_files() -> dict[int, str]:
  out = {}
  for fd in os.listdir("/proc/self/fd"):
    try:
      out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
      continue
  return out


# Right after one of these returns, an interrupt loses the descriptor with the result,
# in any Python code: not a place a fix can reach.
_OPENS = (os.open, os.dup)


def _landing(frame, event, arg) -> tuple[object, int, str] | None:
  """Where a signal's handler can run, seen by a profile hook: at the entry of a
  Python function (``call``: the site is its caller's line) and at the return of a
  builtin (``c_return``), which is where CPython runs it; never at ``try:`` or
  ``fd, self.fd = self.fd, -1``, which a line trace sees too. (``arg``: the builtin.)"""
  if event == "call" and frame.f_back is not None:
    return frame.f_back.f_code, frame.f_back.f_lineno, event
  if event == "c_return" and arg not in _OPENS:
    return frame.f_code, frame.f_lineno, event
  return None


def _landings(codes, run) -> list[tuple[object, int, str]]:
  """Each place in ``codes`` where a signal can land while ``run`` runs, once, in order."""
  seen = {}

  def hook(frame, event, arg):
    site = _landing(frame, event, arg)
    if site is not None and site[0] in codes:
      seen.setdefault(site, None)

  sys.setprofile(hook)
  try:
    run()
  finally:
    sys.setprofile(None)
  return list(seen)


@contextlib.contextmanager
def _interrupt_at(site):
  """Raises ``KeyboardInterrupt`` where ``site`` (of ``_landings``) is first reached."""
  fired = []

  def hook(frame, event, arg):
    if not fired and _landing(frame, event, arg) == site:
      fired.append(site)
      sys.setprofile(None)
      raise KeyboardInterrupt(f"at {site[0].co_name}:{site[1]} ({site[2]})")

  sys.setprofile(hook)
  try:
    yield fired
  finally:
    sys.setprofile(None)


def _interrupted_everywhere(codes, run) -> list[str]:
  """Runs ``run`` once per place of ``codes`` where a signal can land, interrupted
  there; returns where a descriptor it opened outlived the dropped interrupt."""
  leaks = []
  sites = _landings(codes, run)
  assert sites
  for site in sites:
    gc.collect()
    before = _open_files()
    with _interrupt_at(site) as fired:
      try:
        run()
      except KeyboardInterrupt:
        pass
    assert fired, f"{site} was not reached again"
    gc.collect()  # what is dropped, with its frames, is closed
    left = {fd: p for fd, p in _open_files().items() if before.get(fd) != p}
    if left:
      code, line, event = site
      leaks.append(
        f"{code.co_qualname}:{line - code.co_firstlineno} {event}: {sorted(left.values())}"
      )
  return leaks


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  records = adam_records(3)
  path = str(tmp_path_factory.mktemp("read_interrupts") / "ckpt")
  jr.save_records(path, records)
  return path, records


def test_an_interrupt_while_a_checkpoint_is_opened_leaves_no_descriptor(saved):
  """At every line of opening a checkpoint (its root, before and after its finalizer is
  registered, its index, its archives' reader): the root's descriptor goes. (Before:
  one landing between the root's open and its finalizer's registration kept it open
  for the life of the process.)"""
  path, _ = saved
  codes = {reader.Checkpoint.__init__.__code__, shardread.Dir.root.__func__.__code__}
  assert _interrupted_everywhere(codes, lambda: jr.load_records(path)) == []


@pytest.mark.slow
def test_an_interrupt_while_a_buffer_file_is_opened_or_read_leaves_no_descriptor(saved):
  """At every line of opening an archive's directory and files and reading a whole
  buffer (``load_records``), and of the partial reads of a ``restore``: every
  descriptor goes, the directories' and the buffer files'. (Before: one landing in
  a ``with`` block's exit, between an open and the ``try`` that closes it, in a
  ``finally``'s ``close``, or between a restore's opening of a buffer file and its
  record among the held ones, left the descriptor open for the life of the process:
  neither ``Dir`` nor ``ShardFile`` closed itself when dropped.)"""
  path, records = saved
  codes = {
    getattr(f, "__wrapped__", f).__code__  # a context manager's generator
    for f in (
      archivejson.ArchiveMetas.get,
      archives.ArchiveReader.open_buffer,
      archives.ArchiveReader.read_buffer,
      archives.ArchiveReader.read_runs,
      shardread.Dir.dir,
      shardread.Dir.file,
      shardread.Dir.read_bytes,
      shardread.Dir.close,
      shardread.ShardFile.__init__,
      shardread.ShardFile.close,
      restore.opened_archives,
    )
  }
  assert _interrupted_everywhere(codes, lambda: jr.load_records(path)) == []
  assert _interrupted_everywhere(codes, lambda: jr.restore(path, world_size=2, rank=1)) == []
  for a, b in zip(jr.load_records(path), records, strict=True):
    assert_records_equal(a, b)


@pytest.mark.parametrize("cls", [shardread.Dir, shardread.ShardFile])
def test_an_interrupt_inside_close_never_closes_another_file_later(saved, cls):
  """At every line of ``close``: a later close (the finalizer's, or the owner's again)
  never closes the number again once another file was given it. (Before: one landing
  between the close and its record left the number recorded, and the next close closed
  whatever file had been given it since.)"""
  path, _ = saved

  def opened():
    d = shardread.Dir.root(path)
    if cls is shardread.Dir:
      return d
    with d:
      ckpt = reader.open_checkpoint(path)
      try:
        return ckpt.archives.open_buffer(0, next(iter(ckpt.layout(0).sizes)))
      finally:
        ckpt.close()

  code = cls.close.__code__
  sites = _landings({code}, lambda: opened().close())
  assert sites
  for site in sites:
    obj = opened()
    with _interrupt_at(site) as fired, contextlib.suppress(KeyboardInterrupt):
      obj.close()
    assert fired
    other = os.open(os.devnull, os.O_RDONLY)  # takes the lowest free number
    try:
      obj.close()
      del obj
      gc.collect()
      os.fstat(other)  # still open
    finally:
      os.close(other)


def test_an_interrupt_while_a_save_checks_its_checkpoint_holds_no_deleted_directory(tmp_path):
  """The save reads back its temporary directory's index before the commit; an
  interrupt while that reader is made: the directory is removed, and the reader's
  descriptor of it is closed while the interrupt is still alive (a notebook keeps
  its last error), not held on a deleted directory. (Before: it stayed open as long
  as the traceback.)"""
  records = adam_records(3)
  out = str(tmp_path / "ckpt")
  code = archives.ArchiveReader.__init__.__code__

  def tracer(frame, event, arg):
    if frame.f_code is code and event == "call":
      raise KeyboardInterrupt("while the save reads its index")
    return None

  before = _open_files()
  sys.settrace(tracer)
  try:
    with pytest.raises(KeyboardInterrupt, match="reads its index") as info:
      jr.save_records(out, records)
  finally:
    sys.settrace(None)
  assert any(f.name == store.check_restorable.__name__ for f in info.traceback)
  assert {fd: p for fd, p in _open_files().items() if before.get(fd) != p} == {}
  assert os.listdir(tmp_path) == []
  jr.save_records(out, records)
  for a, b in zip(jr.load_records(out), records, strict=True):
    assert_records_equal(a, b)
