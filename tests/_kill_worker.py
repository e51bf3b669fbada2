"""Kills saves at chosen filesystem calls: the worker of ``test_kill_points``.

``python -m tests._kill_worker BASE KILLS`` imports jax once, then for each
kill point ``i`` of each scenario of the JSON object ``KILLS`` (a scenario's
name -> its list of kill points) forks a child that runs that save into the new
directory ``BASE/SCENARIO/i``. In the child every call
that changes the file system below that directory (the ``os`` functions a save
uses, ``open`` for writing and the writes and close of the file it returns, and
the commit's ``renameat2``) is counted; the one a kill point names ends the
child at once with ``os._exit(137)``, as a SIGKILL would: no ``finally``, no
cleanup, no flush. A kill point is ``[call, path, nth]``: the ``nth`` call named
``call`` whose path relative to the directory matches the regex ``path``. A
kill point with ``call`` null makes no kill (the whole save runs).

A scenario may run the CLI (``clean``, ``reshard``, ``merge``) in the child, as
``python -m jaxreshard`` runs it; what it prints goes nowhere.

Prints one JSON line: per scenario, per kill point, the child's exit code and the
call it died in (``[call, path]``, or null).
"""

import builtins
import functools
import io
import json
import os
import re
import signal
import sys
import threading

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import warnings  # noqa: E402

warnings.simplefilter("ignore")  # jax warns of the fork

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import jaxreshard as jr  # noqa: E402
from jaxreshard._src.checkpoint import tempdir as _tempdir  # noqa: E402
from jaxreshard._src.checkpoint import tempname as _tempname  # noqa: E402
from tests._core_util import adam_records, device_mesh  # noqa: E402

SHAPES = {"w": ((6, 5), jnp.float32), "b": ((7,), jnp.bfloat16)}
# Enough history buffers (two per param) for an index with a binary table.
TABLE_SHAPES = {f"p{i:03d}": ((3,), jnp.float32) for i in range(130)}


@functools.cache
def records(seed: int = 0, table: bool = False) -> list:
  """The records the scenarios save (two ranks, two dtypes; ``table``: 130 params)."""
  return adam_records(2, TABLE_SHAPES if table else SHAPES, seed=seed)


@functools.cache
def mesh_args() -> tuple:
  """``save_sharded``'s optimizer, state, shapes and mesh (four devices)."""
  params = {"w": jnp.arange(12.0), "b": jnp.arange(5.0).astype(jnp.bfloat16)}
  opt = optax.adam(1e-3)
  mesh = device_mesh((4,), ("fsdp",))
  return (
    opt,
    jr.shard_to_mesh(opt, params, opt.init(params), mesh).state,
    {"w": (12,), "b": (5,)},
    mesh,
  )


def manager(run: str) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(temporary_path_class=jr.DurableRenameTemporaryPath)
  return ocp.CheckpointManager(run, options=options)


# --- scenarios: each prepares its directory, then arms the kill and saves ----------


def save_records(root, arm):
  jr.save_records(os.path.join(root, "old"), records(1))
  arm()
  jr.save_records(os.path.join(root, "ckpt"), records())


def save_records_table(root, arm):
  jr.save_records(os.path.join(root, "old"), records(1))
  saved = records(table=True)
  arm()
  jr.save_records(os.path.join(root, "ckpt"), saved)


def save_over_leftover(root, arm):
  """A save to a path whose earlier save was killed just before its rename: the new
  save removes that directory first (its lock is free), and is killed in it too."""
  jr.save_records(os.path.join(root, "old"), records(1))
  jr.save_records(os.path.join(root, "seed"), records())
  tmp = os.path.join(root, f".ckpt.tmp-{'a' * 32}-999999-{_tempname.host()}")
  os.rename(os.path.join(root, "seed"), tmp)
  open(os.path.join(tmp, _tempdir.LOCK_FILE), "w").close()
  arm()
  jr.save_records(os.path.join(root, "ckpt"), records())


def save_sharded(root, arm):
  opt, state, shapes, mesh = mesh_args()
  jr.save_records(os.path.join(root, "old"), records(1))
  arm()
  jr.save_sharded(os.path.join(root, "ck"), opt, state, shapes, mesh)


def manager_save(root, arm):
  with manager(os.path.join(root, "run")) as m:
    m.save(1, args=jr.ReshardSave(records(1)))
    m.wait_until_finished()
    arm()
    m.save(2, args=jr.ReshardSave(records()))
    m.wait_until_finished()


# --- the CLI's writes and removals: clean, reshard, merge -----------------------------


def cli(*args) -> None:
  """Runs ``python -m jaxreshard ARGS`` in this process; an exit code other than 0 raises."""
  from jaxreshard._src.cli.commands import main

  try:
    main([str(a) for a in args])
  except SystemExit as e:
    if e.code:
      raise RuntimeError(f"jaxreshard {' '.join(map(str, args))}: exit code {e.code}") from None


def leftover(root: str, name: str, records_, tag: str, host: str | None = None) -> str:
  """A checkpoint of ``records_`` renamed to the temporary directory of a save of
  ``NAME`` killed just before its rename, its lock file back in it: jaxreshard's
  ``.NAME.tmp-TAG...`` (``TAG`` one hex digit, 32 times), or (``tag`` "orbax")
  orbax's ``NAME.orbax-checkpoint-tmp`` of a ``save_sharded``."""
  seed = os.path.join(root, f"seed-{tag}")
  jr.save_records(seed, records_)
  if tag == "orbax":
    base = name + _tempname.ORBAX_TEMP_SUFFIX
  else:
    base = f".{name}.tmp-{tag * 32}-999999-{host or _tempname.host()}"
  tmp = os.path.join(root, base)
  os.rename(seed, tmp)
  open(os.path.join(tmp, _tempdir.LOCK_FILE), "w").close()
  return tmp


def clean_records(root, arm):
  """``clean`` of a committed checkpoint's path with three leftovers: one of this host,
  one (with a binary table) of another host, and a save's killed before its lock."""
  jr.save_records(os.path.join(root, "old"), records(1))
  jr.save_records(os.path.join(root, "ckpt"), records())
  leftover(root, "ckpt", records(), "a")
  leftover(root, "ckpt", records(table=True), "b", host="elsewhere")
  os.mkdir(os.path.join(root, f".ckpt.tmp-{'c' * 32}-999990-{_tempname.host()}"))
  arm()
  cli("clean", os.path.join(root, "ckpt"), "--all")


def clean_orbax(root, arm):
  """``clean`` of a ``save_sharded`` path (never committed) whose orbax temporary
  directory a killed save left, locked."""
  jr.save_records(os.path.join(root, "old"), records(1))
  tmp = leftover(root, "ck", records(), "orbax")
  open(os.path.join(tmp, "_CHECKPOINT_METADATA"), "w").close()
  arm()
  cli("clean", os.path.join(root, "ck"), "--all")


def clean_manager(root, arm):
  """``clean`` of a manager's step 2, killed after its item's commit: step 1 committed."""
  run = os.path.join(root, "run")
  with manager(run) as m:
    for step, seed in ((1, 1), (2, 0)):
      m.save(step, args=jr.ReshardSave(records(seed)))
      m.wait_until_finished()
  tmp = os.path.join(run, f"2{_tempname.ORBAX_TEMP_SUFFIX}")
  os.rename(os.path.join(run, "2"), tmp)
  open(os.path.join(tmp, _tempdir.LOCK_FILE), "w").close()
  open(os.path.join(tmp, "default", _tempdir.LOCK_FILE), "w").close()
  arm()
  cli("clean", os.path.join(run, "2"), "--all")


def reshard_whole(root, arm):
  jr.save_records(os.path.join(root, "ck"), records())
  arm()
  cli("reshard", os.path.join(root, "ck"), os.path.join(root, "out"), "-w", 3)


def reshard_rank(root, arm):
  """``reshard --rank 1``, its other ranks' parts written before (to merge it with)."""
  ck = os.path.join(root, "ck")
  jr.save_records(ck, records())
  for r in (0, 2):
    cli("reshard", ck, os.path.join(root, f"part{r}"), "-w", 3, "--rank", r)
  arm()
  cli("reshard", ck, os.path.join(root, "part1"), "-w", 3, "--rank", 1)


def merge_parts(root, arm):
  ck = os.path.join(root, "ck")
  jr.save_records(ck, records())
  parts = [os.path.join(root, f"part{r}") for r in range(3)]
  for r, part in enumerate(parts):
    cli("reshard", ck, part, "-w", 3, "--rank", r)
  arm()
  cli("merge", os.path.join(root, "out"), *parts)


SCENARIOS = {
  f.__name__: f
  for f in (
    save_records,
    save_records_table,
    save_over_leftover,
    save_sharded,
    manager_save,
    clean_records,
    clean_orbax,
    clean_manager,
    reshard_whole,
    reshard_rank,
    merge_parts,
  )
}


# --- the counting wrappers -----------------------------------------------------------


class Killer:
  """Counts the file system calls below ``root`` and dies at the one ``point`` names."""

  def __init__(self, root: str, point: list):
    self.root, self.point, self.armed, self.seen = os.path.realpath(root), point, False, 0
    self.lock = threading.Lock()

  def hit(self, call: str, path: str) -> None:
    if not self.armed or self.point[0] is None:
      return
    if path != self.root and not path.startswith(self.root + "/"):
      return
    rel = path[len(self.root) :]
    name, pattern, nth = self.point
    if call != name or not re.search(pattern, rel):
      return
    with self.lock:
      self.seen += 1
      if self.seen == nth:
        _REAL["write"](2, (json.dumps([call, rel]) + "\n").encode())
        _REAL["_exit"](137)


_REAL = {
  n: getattr(os, n)
  for n in (
    "open",
    "write",
    "pwrite",
    "writev",
    "fsync",
    "fdatasync",
    "rename",
    "replace",
    "mkdir",
    "unlink",
    "remove",
    "rmdir",
    "close",
    "ftruncate",
    "readlink",
    "_exit",
  )
}
_REAL_OPEN = io.open
_MUTATES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _path(name, dir_fd=None) -> str:
  try:
    if isinstance(name, int):
      return _REAL["readlink"](f"/proc/self/fd/{name}")
    name = os.fsdecode(name)
    if dir_fd is None:
      return os.path.abspath(name)
    return os.path.join(_REAL["readlink"](f"/proc/self/fd/{dir_fd}"), name)
  except OSError:
    return "?"


class _File:
  """A file opened for writing: its writes and close are counted too."""

  def __init__(self, f, path, killer):
    self._f, self._path, self._killer = f, path, killer

  def write(self, data):
    self._killer.hit("file.write", self._path)
    return self._f.write(data)

  def close(self):
    self._killer.hit("file.close", self._path)
    return self._f.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __getattr__(self, name):
    return getattr(self._f, name)


def install(killer: Killer) -> None:
  """Wraps every call a save makes that changes the file system."""

  def open_(path, flags, mode=0o777, *, dir_fd=None):
    if flags & _MUTATES:
      killer.hit("open", _path(path, dir_fd))
    return _REAL["open"](path, flags, mode, dir_fd=dir_fd)

  def on_fd(name):
    def call(fd, *args, **kwargs):
      killer.hit(name, _path(fd))
      return _REAL[name](fd, *args, **kwargs)

    return call

  def on_path(name):
    def call(path, *args, dir_fd=None, **kwargs):
      killer.hit(name, _path(path, dir_fd))
      if dir_fd is not None:
        kwargs["dir_fd"] = dir_fd
      return _REAL[name](path, *args, **kwargs)

    return call

  def on_rename(name):
    def call(src, dst, *args, **kwargs):
      killer.hit(name, _path(dst))
      return _REAL[name](src, dst, *args, **kwargs)

    return call

  def file_open(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
      path = _path(os.fspath(file))
      killer.hit("file.open", path)
      return _File(_REAL_OPEN(file, mode, *args, **kwargs), path, killer)
    return _REAL_OPEN(file, mode, *args, **kwargs)

  commit_dir = _tempdir.commit_dir

  def renameat2(tmp, final):
    killer.hit("renameat2", _path(final))
    return commit_dir(tmp, final)

  os.open = open_
  for n in ("write", "pwrite", "writev", "fsync", "fdatasync", "close", "ftruncate"):
    setattr(os, n, on_fd(n))
  for n in ("mkdir", "unlink", "remove", "rmdir"):
    setattr(os, n, on_path(n))
  for n in ("rename", "replace"):
    setattr(os, n, on_rename(n))
  io.open = builtins.open = file_open
  _tempdir.commit_dir = renameat2


def main(base: str, kills: dict) -> None:
  # Forked with one thread: jax's runtime is started in each child, never here (a
  # fork of a process whose runtime threads run may deadlock in the child).
  assert threading.active_count() == 1, threading.enumerate()
  jobs = [
    (SCENARIOS[s], os.path.join(base, s, str(i)), point)
    for s, points in kills.items()
    for i, point in enumerate(points)
  ]
  reports = run(jobs, max(1, min(4, os.cpu_count() or 1)))
  out, at = {}, 0
  for s, points in kills.items():
    out[s], at = reports[at : at + len(points)], at + len(points)
  print(json.dumps(out))


def child(save, root: str, point: list) -> None:
  """Runs one save with its kill point armed; never returns."""
  signal.alarm(120)  # a save that hangs ends (-14) rather than stalling the test
  fd = os.open(root + ".said", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  os.dup2(fd, 2)
  os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what a CLI prints is not the worker's report
  killer = Killer(root, point)
  install(killer)
  try:
    save(root, lambda: setattr(killer, "armed", True))
  except BaseException as e:  # noqa: BLE001 - reported to the test
    _REAL["write"](2, (json.dumps(["raised", f"{type(e).__name__}: {e}"]) + "\n").encode())
    _REAL["_exit"](3)
  _REAL["_exit"](0)


def run(jobs: list, at_once: int) -> list:
  """Forks a child per job, ``at_once`` at a time; returns each one's report."""
  out: list = [None] * len(jobs)
  running: dict[int, int] = {}
  for i, (save, root, point) in enumerate(jobs):
    os.makedirs(root)
    while len(running) >= at_once:
      pid, status = os.wait()
      out[running.pop(pid)] = status
    pid = os.fork()
    if pid == 0:
      child(save, root, point)
    running[pid] = i
  while running:
    pid, status = os.wait()
    out[running.pop(pid)] = status
  reports = []
  for (_, root, _), status in zip(jobs, out):
    with open(root + ".said") as f:
      lines = [line for line in f.read().splitlines() if line.startswith("[")]
    os.unlink(root + ".said")
    reports.append(
      {"rc": os.waitstatus_to_exitcode(status), "at": json.loads(lines[-1]) if lines else None}
    )
  return reports


if __name__ == "__main__":
  main(sys.argv[1], json.loads(sys.argv[2]))
