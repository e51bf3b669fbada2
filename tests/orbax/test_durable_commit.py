"""Orbax commits that are durable when a save returns, and saves racing on one directory."""

import asyncio
import json
import os
import shutil
import threading
import time

import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import jaxreshard as jr
from jaxreshard._src.orbax import durable as _durable
from jaxreshard._src.orbax import handler as _handler
from tests._core_util import adam_records, assert_records_equal, device_mesh


@pytest.fixture
def io_log(monkeypatch):
  """Every rename and fsync this process makes, in order, with the paths involved."""
  log = []
  rename, replace, fsync = os.rename, os.replace, os.fsync

  def logged(fn):
    def call(src, dst, *args, **kwargs):
      log.append(("rename", os.fspath(src), os.fspath(dst)))
      return fn(src, dst, *args, **kwargs)

    return call

  def logged_fsync(fd):
    log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    return fsync(fd)

  monkeypatch.setattr(os, "rename", logged(rename))
  monkeypatch.setattr(os, "replace", logged(replace))
  monkeypatch.setattr(os, "fsync", logged_fsync)
  return log


def _assert_durable_renames(log, under, expected):
  """Each rename below ``under``: the directory fsync'ed before it, its parent after."""
  renames = [
    (i, e[1], e[2]) for i, e in enumerate(log) if e[0] == "rename" and e[2].startswith(under)
  ]
  assert [os.path.relpath(dst, under) for _, _, dst in renames] == expected, log
  synced = [(i, e[1]) for i, e in enumerate(log) if e[0] == "fsync"]
  for at, src, dst in renames:
    assert any(i < at and p == src for i, p in synced), (src, log)
    assert any(i > at and p == os.path.dirname(dst) for i, p in synced), (dst, log)
    # And the renamed directory after orbax's own last files were made in it.
    assert any(i > at and p == dst for i, p in synced), (dst, log)


def test_a_manager_with_the_durable_rename_fsyncs_around_every_commit(tmp_path, io_log):
  records = adam_records(3)
  options = ocp.CheckpointManagerOptions(temporary_path_class=jr.DurableRenameTemporaryPath)
  with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
    manager.save(1, args=jr.ReshardSave(records))
    manager.wait_until_finished()
    got = manager.restore(1, args=jr.ReshardRestore())
  for a, b in zip(got, records, strict=True):
    assert_records_equal(a, b)
  # The item directory inside the step's temporary one, then the step.
  _assert_durable_renames(
    io_log, str(tmp_path / "run"), [os.path.join("1.orbax-checkpoint-tmp", "default"), "1"]
  )


def test_save_sharded_commits_durably(tmp_path, io_log):
  params = {"w": jnp.arange(12.0)}
  opt = optax.adam(1e-3)
  mesh = device_mesh((4,), ("fsdp",))
  state = jr.shard_to_mesh(opt, params, opt.init(params), mesh).state
  jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert len(jr.load_records(tmp_path / "ck")) == 4
  _assert_durable_renames(io_log, str(tmp_path), ["ck"])


def test_archives_of_another_save_in_the_shared_temporary_directory_commit_nothing(
  tmp_path, monkeypatch
):
  """Two saves of one step share orbax's temporary directory. When the other
  save's archive is what this save's finalize finds there, nothing is committed
  (its index beside the other's archives would name a checkpoint that does not
  load) and the error says why."""
  other = tmp_path / "other"
  jr.save_records(other, adam_records(3, seed=9))
  finalize = _handler.ReshardCheckpointHandler.finalize

  def other_save_wrote_archive_1(self, directory):
    shutil.rmtree(os.path.join(directory, "archive_00001"))
    shutil.copytree(other / "archive_00001", os.path.join(directory, "archive_00001"))
    return finalize(self, directory)

  monkeypatch.setattr(_handler.ReshardCheckpointHandler, "finalize", other_save_wrote_archive_1)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(adam_records(3)))
    with pytest.raises(
      jr.ArchiveError, match=r"does not load \(archive 1 .* belongs to checkpoint"
    ):
      manager.wait_until_finished()
    assert manager.all_steps() == []


@pytest.fixture
def blocking_orbax_metadata(monkeypatch):
  """Orbax's step metadata written at once, by the thread that asks for it.

  Orbax writes it from a thread of its own: once the temporary directory is made,
  and again just before the handler's ``finalize``, each write landing some time
  later. A test that removes the directory there (as another save or a clean
  would) saw ``Directory not empty`` from its own ``rmtree`` now and then: a late
  write of orbax's into it, not the library's doing.
  """
  from orbax.checkpoint._src.metadata import checkpoint as orbax_metadata

  store = orbax_metadata._NonBlockingMetadataStore  # pylint: disable=protected-access

  def write(self, file_path, metadata):
    self._store_impl.write(file_path, metadata)

  def update(self, file_path, **kwargs):
    self._store_impl.update(file_path, **kwargs)

  monkeypatch.setattr(store, "write", write)
  monkeypatch.setattr(store, "update", update)


def test_save_sharded_is_not_reported_done_when_another_save_was_committed(
  tmp_path, monkeypatch, blocking_orbax_metadata
):
  """Between this save's finalize and orbax's rename another save of the same
  directory removes the shared temporary directory and makes it anew, complete:
  the rename puts the other save's directory in place; this one finds that it is
  not the directory it holds, moves it aside and raises instead of returning."""
  other = tmp_path / "other"
  jr.save_records(other, adam_records(4, seed=9))
  finalize = _handler.ReshardCheckpointHandler.finalize

  def then_replaced(self, directory):
    finalize(self, directory)
    shutil.rmtree(directory)
    shutil.copytree(other, directory)

  monkeypatch.setattr(_handler.ReshardCheckpointHandler, "finalize", then_replaced)
  params = {"w": jnp.arange(12.0)}
  opt = optax.adam(1e-3)
  mesh = device_mesh((4,), ("fsdp",))
  state = jr.shard_to_mesh(opt, params, opt.init(params), mesh).state
  with pytest.raises(jr.ArchiveError, match="not the one the save wrote.*moved aside"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert not (tmp_path / "ck").exists()


def test_save_sharded_is_not_reported_done_when_what_was_committed_has_no_index(
  tmp_path, monkeypatch, blocking_orbax_metadata
):
  """Between this save's finalize and orbax's rename another save of the same
  directory empties the shared temporary directory (in place: the directory the
  save holds is the one renamed): what is committed holds no index, and the save
  says so instead of returning."""
  finalize = _handler.ReshardCheckpointHandler.finalize

  def then_emptied(self, directory):
    finalize(self, directory)
    for name in os.listdir(directory):
      path = os.path.join(directory, name)
      shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)

  monkeypatch.setattr(_handler.ReshardCheckpointHandler, "finalize", then_emptied)
  opt, state, mesh = _mesh_state()
  with pytest.raises(jr.ArchiveError, match="was committed without this save's index"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)


def _wait_for_refused_save_threads():
  """A save refused while orbax made its directories leaves orbax's commit thread
  waiting for that creation's signal until coordination_timeout (which the tests
  that refuse there cut short): it ends here, not in a later test (its join would
  raise orbax's TimeoutError)."""
  import threading
  import time

  waiting = [t for t in threading.enumerate() if t.name == "jaxreshard_save"]
  deadline = time.monotonic() + 60
  while any(t.is_alive() for t in waiting) and time.monotonic() < deadline:
    time.sleep(0.05)


def test_save_sharded_refuses_when_another_save_made_orbax_s_directory_first(tmp_path, monkeypatch):
  """Another save (one that takes no lock) makes orbax's temporary directory right
  before orbax makes it for this save: the save is refused, nothing is committed.
  Orbax's commit thread of the refused save waits for coordination_timeout, cut short."""
  from orbax.checkpoint._src.path import async_path, atomicity

  mkdir = async_path.mkdir

  async def other_save_first(path, *args, **kwargs):
    os.mkdir(path)
    return await mkdir(path, *args, **kwargs)

  monkeypatch.setattr(atomicity.async_path, "mkdir", other_save_first)
  monkeypatch.setattr(ocp.multihost, "coordination_timeout", lambda: 2)
  opt, state, mesh = _mesh_state()
  with pytest.raises(
    jr.ArchiveExistsError, match="ck was not committed: another save is writing it"
  ):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert not (tmp_path / "ck").exists()
  _wait_for_refused_save_threads()


_REFUSED_THEN_EXIT = """
import os, sys, time
import jax, jax.numpy as jnp, optax
from orbax.checkpoint._src.path import async_path, atomicity
import jaxreshard as jr

mkdir = async_path.mkdir

async def other_save_first(path, *args, **kwargs):  # another save made it just now
  os.mkdir(path)
  return await mkdir(path, *args, **kwargs)

atomicity.async_path.mkdir = other_save_first
params, opt = {"w": jnp.arange(12.0)}, optax.adam(1e-3)
mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
state = jr.shard_to_mesh(opt, params, opt.init(params), mesh).state
try:
  jr.save_sharded(os.path.join(sys.argv[1], "ck"), opt, state, {"w": (12,)}, mesh)
except jr.ArchiveExistsError as e:
  print("refused:", e, flush=True)
"""


def _run_script(script: str, tmp_path):
  """``script`` run by a fresh Python with ``tmp_path`` as its argument (8 CPU devices)."""
  import subprocess
  import sys

  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-c", script, str(tmp_path)],
    env=env,
    capture_output=True,
    text=True,
    timeout=150,
  )


def test_a_process_whose_save_sharded_was_refused_in_orbax_s_directory_creation_exits(tmp_path):
  """Refused there, the save raises at once; orbax's commit thread of it waits for the
  directory's signal until orbax's coordination timeout (300 s), and the process's
  exit does not wait for it. (Before: the process lived those 300 s on.)"""
  done = _run_script(_REFUSED_THEN_EXIT, tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "refused: save_sharded:" in done.stdout and "another save is writing it" in done.stdout
  assert not (tmp_path / "ck").exists()


_REFUSED_THEN_COLLECTED = (
  _REFUSED_THEN_EXIT.replace(
    "atomicity.async_path.mkdir = other_save_first",
    "atomicity.async_path.mkdir = other_save_first\n"
    "import orbax.checkpoint as ocp\n"
    "ocp.multihost.coordination_timeout = lambda: 2",
  )
  + """
import gc, threading
waiting = [t for t in threading.enumerate() if t.name == "jaxreshard_save"]
deadline = time.monotonic() + 60
while any(t.is_alive() for t in waiting) and time.monotonic() < deadline:
  time.sleep(0.05)  # orbax's join of the thread raises its TimeoutError
del waiting
gc.collect()
print("collected", flush=True)
"""
)


def test_a_save_refused_in_orbax_s_directory_creation_leaves_no_unawaited_coroutine(tmp_path):
  """Orbax never runs the archive writes of such a save: they are a coroutine made
  only when run, so none is reported as never awaited when orbax's objects go."""
  done = _run_script(_REFUSED_THEN_COLLECTED, tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "another save is writing it" in done.stdout and "collected" in done.stdout, done.stdout
  assert "_write' was never awaited" not in done.stderr, done.stderr[-3000:]


def test_save_sharded_refuses_when_a_clean_removes_every_directory_it_makes(
  tmp_path, monkeypatch, blocking_orbax_metadata
):
  """A ``clean`` removes orbax's temporary directory each time right after this
  save made it and before it holds its lock: the save makes it anew a few times,
  then is refused rather than write a directory it does not hold."""
  from jaxreshard._src.checkpoint import tempdir as _tempdir

  hold = _tempdir.hold

  def removed_by_a_clean(path):
    held = hold(path)
    for fd in held or ():
      os.close(fd)
    shutil.rmtree(path)
    return None

  monkeypatch.setattr(_tempdir, "hold", removed_by_a_clean)
  monkeypatch.setattr(ocp.multihost, "coordination_timeout", lambda: 2)
  opt, state, mesh = _mesh_state()
  with pytest.raises(jr.ArchiveExistsError, match="every directory made for this save was taken"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert os.listdir(tmp_path) == []
  _wait_for_refused_save_threads()


def _weak_clock_mesh_state(mesh):
  params = {"w": jnp.zeros((5,), jnp.float32)}
  opt = optax.adam(1e-3)
  state = opt.init(params)
  state = (state[0]._replace(count=jnp.asarray(3)),) + state[1:]  # a weakly typed int32 clock
  assert state[0].count.weak_type
  return opt, params, jr.shard_to_mesh(opt, params, state, mesh).state


def test_a_weakly_typed_clock_is_saved_as_one_on_every_orbax_path(tmp_path):
  """The index (made from the state) and each archive (made from host copies) both
  record the clock as weakly typed: the checkpoint loads, and the clock comes back
  weak. (Host copies made it strong: every reader refused the checkpoint, whose
  index and archives disagreed on the clock.)"""
  mesh = device_mesh((2,), ("fsdp",))
  opt, params, state = _weak_clock_mesh_state(mesh)
  jr.save_sharded(tmp_path / "ck", opt, state, {"w": (5,)}, mesh)
  restored = jr.restore_sharded(tmp_path / "ck", mesh).state
  assert restored[0].count.weak_type and int(restored[0].count) == 3
  records = jr.load_records(tmp_path / "ck")
  assert all(r.state[0].count.weak_type for r in records)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(records))
    manager.wait_until_finished()
    got = manager.restore(1, args=jr.ReshardRestore(world_size=2, rank=1))
  assert got.state[0].count.weak_type and int(got.state[0].count) == 3


def test_finalize_commits_nothing_that_does_not_load(tmp_path, monkeypatch):
  """Archives whose host copies disagree with the index made from the state (here a
  clock the copies changed): finalize checks the written checkpoint as a restore
  would, and nothing is committed."""
  from jaxreshard._src.distributed import sharded as _sharded

  host_record = _sharded.host_record

  def advanced(record):
    out = host_record(record)
    return jr.ShardRecord(
      out.version,
      out.placements,
      (out.state[0]._replace(count=out.state[0].count + 1),) + out.state[1:],
      out.roles,
    )

  monkeypatch.setattr(_sharded, "host_record", advanced)
  mesh = device_mesh((2,), ("fsdp",))
  opt, _, state = _weak_clock_mesh_state(mesh)
  with pytest.raises(jr.ArchiveError, match="does not load.*clock"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (5,)}, mesh)
  assert not (tmp_path / "ck").exists()


def test_save_sharded_refuses_a_state_with_nonzero_padding_before_making_a_directory(tmp_path):
  """Padding is data: the host copies save_sharded takes are checked before orbax
  makes its temporary directory, so a refused save leaves nothing. (It was refused
  in orbax's writer thread, leaving ``ck.orbax-checkpoint-tmp`` behind.)"""
  import jax
  import numpy as np

  params = {"w": jnp.arange(5.0)}  # 5 elements over 2 ranks: one slot of padding
  opt = optax.sgd(0.1, momentum=0.9)
  mesh = device_mesh((2,), ("fsdp",))
  state = jr.shard_to_mesh(opt, params, opt.init(params), mesh).state
  trace = np.zeros(6, np.float32)
  trace[5] = -0.0  # a sign bit is not zero bits
  sharding = state[0].trace["w"].sharding
  state = (state[0]._replace(trace={"w": jax.device_put(trace, sharding)}),) + state[1:]
  with pytest.raises(jr.PlacementError, match="padding"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (5,)}, mesh)
  assert os.listdir(tmp_path) == []


def test_a_typed_prng_key_is_saved_on_every_orbax_path(tmp_path):
  """noisy_sgd keeps a typed PRNG key: save_records stored it, while the orbax paths
  (whose host copies went through numpy) raised a TypeError."""
  import jax
  import numpy as np

  params = {"w": jnp.arange(5.0)}
  opt = optax.noisy_sgd(0.1, key=jax.random.key(42))
  state = opt.init(params)
  records = jr.shard_state(opt, params, state, world_size=2)
  jr.save_records(tmp_path / "plain", records)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(records))
    manager.wait_until_finished()
  mesh = device_mesh((2,), ("fsdp",))
  # noisy_sgd keeps no history: the param's dtype comes with its shape.
  shapes = {"w": jax.ShapeDtypeStruct((5,), jnp.float32)}
  jr.save_sharded(
    tmp_path / "s", opt, jr.shard_to_mesh(opt, params, state, mesh).state, shapes, mesh
  )

  def keys(tree):
    return [x for x in jax.tree.leaves(tree) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]

  (want,) = keys(state)
  for path in (tmp_path / "plain", tmp_path / "run" / "1" / "default", tmp_path / "s"):
    for record in jr.load_records(path):
      (key,) = keys(record.state)
      assert jax.random.key_impl(key) == jax.random.key_impl(want), path
      assert np.array_equal(jax.random.key_data(key), jax.random.key_data(want)), path


def _mesh_state():
  params = {"w": jnp.arange(12.0)}
  opt = optax.adam(1e-3)
  mesh = device_mesh((4,), ("fsdp",))
  return opt, jr.shard_to_mesh(opt, params, opt.init(params), mesh).state, mesh


def test_a_temporary_directory_whose_writer_holds_its_lock_is_never_taken(tmp_path):
  """Orbax gives every save to one path one temporary directory and removes what is
  there; a save that finds another live writer's (its lock held) is refused and
  removes nothing. Once the lock is free, the next save takes the leftover."""
  from jaxreshard._src.checkpoint import tempdir as _tempdir

  opt, state, mesh = _mesh_state()
  final = tmp_path / "ck"
  tmp = tmp_path / "ck.orbax-checkpoint-tmp"
  tmp.mkdir()
  (tmp / "archive_00000").mkdir()  # what the live writer has written so far
  held = _tempdir.hold(str(tmp))
  assert held is not None
  try:
    with pytest.raises(jr.ArchiveExistsError, match="another save to .* is writing it"):
      jr.save_sharded(final, opt, state, {"w": (12,)}, mesh)
    assert (tmp / "archive_00000").is_dir() and not final.exists()
    assert _tempdir.temp_dirs(str(final)) == [(str(tmp), False)]
  finally:
    os.close(held[1])
    os.close(held[0])
  assert _tempdir.temp_dirs(str(final)) == [(str(tmp), True)]
  jr.save_sharded(final, opt, state, {"w": (12,)}, mesh)
  assert len(jr.load_records(final)) == 4 and not tmp.exists()
  assert _tempdir.LOCK_FILE not in os.listdir(final)


def test_a_failed_save_sharded_leaves_nothing_and_saves_again(tmp_path, monkeypatch):
  """A failed save removes its temporary directory and frees its lock: the same
  process saves again at once."""
  opt, state, mesh = _mesh_state()
  finalize = _handler.ReshardCheckpointHandler.finalize

  def fails(self, directory):
    raise OSError(5, "injected failure of the index write")

  monkeypatch.setattr(_handler.ReshardCheckpointHandler, "finalize", fails)
  with pytest.raises(Exception, match="injected failure"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert os.listdir(tmp_path) == []  # nothing committed, its temporary directory removed
  monkeypatch.setattr(_handler.ReshardCheckpointHandler, "finalize", finalize)
  jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert len(jr.load_records(tmp_path / "ck")) == 4


def test_a_commit_future_orbax_cannot_make_fails_the_save_and_leaves_nothing(tmp_path, monkeypatch):
  """save_sharded's commit futures are made in a daemon thread: orbax's error there is
  the save's own error (never a future that is an exception), and nothing is left."""
  opt, state, mesh = _mesh_state()
  make = ocp.future.CommitFutureAwaitingContractedSignals

  def cannot_start(coro, **kwargs):
    raise RuntimeError("can't start new thread")

  monkeypatch.setattr(ocp.future, "CommitFutureAwaitingContractedSignals", cannot_start)
  with pytest.raises(jr.ArchiveError, match=r"not committed \(RuntimeError: can't start new"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert os.listdir(tmp_path) == []
  monkeypatch.setattr(ocp.future, "CommitFutureAwaitingContractedSignals", make)
  jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert len(jr.load_records(tmp_path / "ck")) == 4


@pytest.mark.parametrize("late", ["mkdir", "start"])
def test_a_save_that_fails_while_orbax_makes_its_directory_leaves_nothing(
  tmp_path, monkeypatch, late
):
  """Orbax makes a save's temporary directory in a thread of its own while the
  handler starts writing. A save that fails first waits for a creation that has
  started and removes what it made (``mkdir``: orbax's directory made late); a
  creation that starts after the failure makes nothing (``start``). Either way
  nothing is left once the creation is over."""
  opt, state, mesh = _mesh_state()
  make_dir = ocp.path.atomicity.AtomicRenameTemporaryPath.create
  create = _durable.DurableRenameTemporaryPath.create
  over = threading.Event()

  async def slow_mkdir(self):
    await asyncio.sleep(0.5 if late == "mkdir" else 0.0)
    return await make_dir(self)

  async def watched(self):
    try:
      await asyncio.sleep(0.5 if late == "start" else 0.0)
      return await create(self)
    finally:
      over.set()

  def cannot_start(coro, **kwargs):
    coro.close()
    raise RuntimeError("can't start new thread")

  monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "create", slow_mkdir)
  monkeypatch.setattr(_durable.DurableRenameTemporaryPath, "create", watched)
  monkeypatch.setattr(ocp.future, "CommitFutureAwaitingContractedSignals", cannot_start)
  with pytest.raises(jr.ArchiveError, match=r"not committed \(RuntimeError: can't start new"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert over.wait(30)
  assert os.listdir(tmp_path) == []
  monkeypatch.undo()
  jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert len(jr.load_records(tmp_path / "ck")) == 4


@pytest.mark.parametrize("held", ["parent", "directory"])
def test_a_failed_save_s_creation_waiting_for_a_lock_ends_with_the_save(
  tmp_path, monkeypatch, held
):
  """The save fails while orbax's creation of its directory waits for a lock another
  writer holds (the parent's, or the temporary directory's own): the creation ends
  with the save, which returns at once, not once that writer lets go (orbax's
  coordination timeout, minutes), and the other writer's directory is left as it is."""
  import fcntl

  from jaxreshard._src.checkpoint import tempdir as _tempdir

  opt, state, mesh = _mesh_state()
  create = _durable.DurableRenameTemporaryPath.create
  fds, other = [], []
  gone, waits, over = threading.Lock(), threading.Event(), threading.Event()

  def release():  # the other writer lets go (once)
    with gone:
      while fds:
        os.close(fds.pop())

  async def contended(self):
    if held == "parent":
      fds.append(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY))
      fcntl.flock(fds[0], fcntl.LOCK_EX)
    else:  # another save took the directory after this one looked (refuse_if_held)
      os.mkdir(self.get())
      (self.get() / _tempdir.LOCK_FILE).touch()
      fds.extend(_tempdir.hold(os.fspath(self.get())))
      other.append(self.get().name)
    waits.set()
    try:
      return await create(self)
    finally:
      over.set()

  def cannot_start(coro, **kwargs):
    coro.close()
    assert waits.wait(10)  # the save fails while its creation waits for the lock
    time.sleep(0.2)
    raise RuntimeError("can't start new thread")

  monkeypatch.setattr(_durable.DurableRenameTemporaryPath, "create", contended)
  monkeypatch.setattr(ocp.future, "CommitFutureAwaitingContractedSignals", cannot_start)
  releaser = threading.Timer(20, release)  # a save that waits for the writer ends, late
  releaser.start()
  start = time.monotonic()
  try:
    with pytest.raises(jr.ArchiveError, match=r"not committed \(RuntimeError: can't start new"):
      jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
    took = time.monotonic() - start
    assert over.wait(30)
    assert sorted(os.listdir(tmp_path)) == other
  finally:
    releaser.cancel()
    release()
  assert took < 10, f"the failed save returned after {took:.1f} s"


def test_a_creation_that_fails_once_orbax_made_the_directory_leaves_nothing(tmp_path, monkeypatch):
  """Orbax's creation of the directory fails after it made it (a disk error writing
  what it adds): the save is refused and the directory it made goes with it.
  Orbax's commit thread of the refused save waits for coordination_timeout, cut short."""
  opt, state, mesh = _mesh_state()
  make_dir = ocp.path.atomicity.AtomicRenameTemporaryPath.create

  async def failing(self):
    await make_dir(self)
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "create", failing)
  monkeypatch.setattr(ocp.multihost, "coordination_timeout", lambda: 2)
  with pytest.raises(jr.ArchiveError, match="not committed"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh, timeout_s=5)
  assert os.listdir(tmp_path) == []
  _wait_for_refused_save_threads()


def test_a_failed_save_stopped_before_its_last_rmdir_leaves_what_clean_removes(
  tmp_path, monkeypatch
):
  """A failed save removes its orbax directory under a name of this host's: stopped
  between unlinking the directory's lock and removing it (here its rmdir fails, as
  a kill there would leave it), what is left is no orbax directory without a lock
  (which no clean may remove) but one that the next clean removes."""
  from typer.testing import CliRunner

  from jaxreshard._src.cli.commands import app

  opt, state, mesh = _mesh_state()
  rmdir = os.rmdir

  def fails_for_the_save_s_directory(path, *args, **kwargs):
    if os.path.dirname(os.path.abspath(path)) == str(tmp_path):
      raise OSError(5, "injected failure", path)
    return rmdir(path, *args, **kwargs)

  def cannot_start(coro, **kwargs):
    # Orbax makes the directory in a thread of its own: the save fails once it is there.
    deadline = time.monotonic() + 30
    while not os.listdir(tmp_path) and time.monotonic() < deadline:
      time.sleep(0.01)
    coro.close()
    raise RuntimeError("can't start new thread")

  monkeypatch.setattr(os, "rmdir", fails_for_the_save_s_directory)
  monkeypatch.setattr(ocp.future, "CommitFutureAwaitingContractedSignals", cannot_start)
  with pytest.raises(jr.ArchiveError, match="not committed"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  monkeypatch.undo()
  (left,) = os.listdir(tmp_path)
  assert left.startswith(".ck.tmp-") and os.listdir(tmp_path / left) == []
  done = CliRunner().invoke(app, ["clean", str(tmp_path / "ck")])
  assert done.exit_code == 0, done.output
  assert os.listdir(tmp_path) == []


def test_clean_removes_a_killed_save_sharded_s_directory_only_when_its_lock_is_free(tmp_path):
  from typer.testing import CliRunner

  from jaxreshard._src.checkpoint import tempdir as _tempdir
  from jaxreshard._src.cli.commands import app

  final = tmp_path / "ck"
  stale, live = tmp_path / "ck.orbax-checkpoint-tmp", tmp_path / "ck.orbax-checkpoint-tmp-17"
  plain = tmp_path / "ck.orbax-checkpoint-tmp-18"  # orbax's own writers take no lock
  for d in (stale, live, plain):
    (d / "archive_00000").mkdir(parents=True)
  for d in (stale, live):
    (d / _tempdir.LOCK_FILE).touch()
  held = _tempdir.hold(str(live))
  try:
    text = CliRunner().invoke(app, ["clean", str(final)]).stdout  # without --all: kept
    assert (
      f"kept (orbax's, of a host it does not name; its lock is free here, --all removes it): {stale}"
      in text
    )
    # No lock in it (orbax made it; the save was killed before locking it): listed, kept.
    assert (
      "kept (orbax's, with no lock in it: nothing tells whether its save still runs;"
      f" the next save of this checkpoint replaces it): {plain}" in text
    )
    assert f"0 of 3 temporary directories of {final} removed" in text
    result = CliRunner().invoke(app, ["clean", str(final), "--all", "--json"])
  finally:
    os.close(held[1])
    os.close(held[0])
  assert result.exit_code == 0, result.output
  assert not stale.exists() and live.exists() and plain.exists()
  report = json.loads(result.stdout)
  assert report["removed"] == [str(stale)] and sorted(report["kept"]) == [str(live), str(plain)]


def test_every_file_of_a_manager_step_is_fsynced_before_its_rename(tmp_path, io_log):
  """orbax's own handlers (a StandardSave item beside jaxreshard's) do not fsync what
  they write; the durable rename fsyncs every file and directory of the step before
  it is renamed into place, and what orbax writes after that at its final path."""
  import numpy as np

  options = ocp.CheckpointManagerOptions(temporary_path_class=jr.DurableRenameTemporaryPath)
  run = tmp_path / "new" / "run"  # made by orbax, with its parent
  with ocp.CheckpointManager(run, options=options, item_names=("opt", "params")) as manager:
    manager.save(
      1,
      args=ocp.args.Composite(
        opt=jr.ReshardSave(adam_records(2)),
        params=ocp.args.StandardSave({"w": np.arange(6.0, dtype=np.float32)}),
      ),
    )
    manager.wait_until_finished()
  rename_at = next(i for i, e in enumerate(io_log) if e[0] == "rename" and e[2] == str(run / "1"))
  synced = {e[1] for e in io_log[:rename_at] if e[0] == "fsync"}
  step = run / "1"
  files = [
    os.path.join(root, n)
    for root, _, names in os.walk(step)
    for n in names + [""]
    if n != "commit_success.txt"
  ]
  in_tmp = {f.replace(str(step), str(run / "1.orbax-checkpoint-tmp"), 1).rstrip("/") for f in files}
  assert in_tmp - synced == set()
  after = {e[1] for e in io_log[rename_at:] if e[0] == "fsync"}
  assert {str(run), str(run.parent)} <= after  # the rename, and the run directory made for it
  # What orbax writes while it commits, after the tree's fsync: fsync'ed at its final path
  # before the save returns.
  top = {str(step / n) for n in os.listdir(step) if (step / n).is_file()}
  assert {str(step / "commit_success.txt"), str(step / "_CHECKPOINT_METADATA")} <= top
  assert top - after == set()
  assert "params" in os.listdir(step) and not any(".jaxreshard-save.lock" in f for f in files)


def _durable_manager(path, **kwargs):
  options = ocp.CheckpointManagerOptions(temporary_path_class=jr.DurableRenameTemporaryPath)
  return ocp.CheckpointManager(path, options=options, **kwargs)


def test_a_step_whose_item_a_killed_save_committed_saves_again(tmp_path):
  """A save killed after its item's rename and before its step's leaves
  ``RUN/2.orbax-checkpoint-tmp/default`` in place. The next save of step 2 raised
  ``ArchiveExistsError`` ("already exists; ... this save removed nothing") although
  that item was never committed and orbax removed it during that save: only a
  second retry saved the step. It now saves at once, with the exact bits."""
  import shutil

  records = adam_records(3)
  with _durable_manager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(adam_records(3, seed=1)))
    manager.wait_until_finished()
  leftover = tmp_path / "run" / "2.orbax-checkpoint-tmp" / "default"
  shutil.copytree(tmp_path / "run" / "1" / "default", leftover)
  with _durable_manager(tmp_path / "run") as manager:
    assert manager.all_steps() == [1]
    assert manager.save(2, args=jr.ReshardSave(records))
    manager.wait_until_finished()
    got = manager.restore(2, args=jr.ReshardRestore())
  for a, b in zip(got, records, strict=True):
    assert_records_equal(a, b)
  assert sorted(os.listdir(tmp_path / "run")) == ["1", "2"]


def test_a_step_of_many_items_saves(tmp_path):
  """Orbax creates a step's items at once: each waits for the parent's lock without
  holding one of the threads that making the directories needs (more items than
  threads deadlocked)."""
  import numpy as np

  names = tuple(f"i{k}" for k in range((os.cpu_count() or 1) + 6))
  with _durable_manager(tmp_path / "run", item_names=names) as manager:
    manager.save(
      1,
      args=ocp.args.Composite(
        **{n: ocp.args.StandardSave({"w": np.full(3, k, np.float32)}) for k, n in enumerate(names)}
      ),
    )
    manager.wait_until_finished()
  assert set(names) <= set(os.listdir(tmp_path / "run" / "1"))


def test_a_manager_saves_a_step_again_after_a_failed_save_of_it(tmp_path, monkeypatch):
  """Orbax keeps a failed save's temporary paths alive; a retry of the step in the
  same process takes over the directory they hold instead of waiting for it."""
  records = adam_records(2)
  finalize = _handler.ReshardCheckpointHandler.finalize

  def fails(self, directory):
    raise OSError(5, "injected failure of the index write")

  with _durable_manager(tmp_path / "run") as manager:
    monkeypatch.setattr(_handler.ReshardCheckpointHandler, "finalize", fails)
    manager.save(1, args=jr.ReshardSave(records))
    with pytest.raises(Exception, match="injected failure"):
      manager.wait_until_finished()
    monkeypatch.setattr(_handler.ReshardCheckpointHandler, "finalize", finalize)
    manager.save(1, args=jr.ReshardSave(records), force=True)
    manager.wait_until_finished()
    assert manager.all_steps() == [1]
    for a, b in zip(manager.restore(1, args=jr.ReshardRestore()), records, strict=True):
      assert_records_equal(a, b)


@pytest.mark.parametrize("level", ["item", "step"])
def test_a_directory_replaced_between_its_fsync_and_orbax_s_rename_commits_nothing(
  tmp_path, monkeypatch, level
):
  """Another process gives a temporary path (the item's, or the step's around it) a
  copy of its directory after the durable rename fsynced it and before orbax's
  rename (which goes by path): the copy, never fsynced, would be committed. The
  save finds that the directory in place is not the one it holds, moves it aside
  and fails: no step is listed or left at the step's path."""
  fsync_tree, calls = _durable.fsync_tree, []

  def then_replaced(path):
    fsync_tree(path)
    calls.append(path)
    if len(calls) == (1 if level == "item" else 2):
      shutil.copytree(path, path + "-copy")
      os.rename(path, path + "-moved")  # the save's own directory, still held
      os.rename(path + "-copy", path)

  monkeypatch.setattr(_durable, "fsync_tree", then_replaced)
  with _durable_manager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(adam_records(2)))
    with pytest.raises(Exception, match="not the one the save wrote") as info:
      manager.wait_until_finished()
    assert "nothing of this save is committed" in str(info.value)
    assert manager.all_steps() == [] and manager.latest_step() is None
  assert not (tmp_path / "run" / "1").exists()
  aside = str(info.value).split("it is moved aside to ")[1].split(";")[0]
  assert ".not-this-save-" in aside and os.path.isdir(aside)
  with _durable_manager(tmp_path / "run") as manager:
    assert manager.all_steps() == []


def test_a_save_waits_while_another_process_holds_the_step_s_directory(tmp_path, monkeypatch):
  """Another process's live save of the step: nothing of it is removed while its
  lock is held; once free (its writer gone), this save takes the directory."""
  import subprocess
  import sys
  import threading

  from jaxreshard._src.orbax import durable as _durable

  run = tmp_path / "run"
  tmp = run / "1.orbax-checkpoint-tmp"
  (tmp / "theirs").mkdir(parents=True)
  (tmp / ".jaxreshard-save.lock").touch()
  # The holder keeps the lock until told (no clock involved), lists the directory
  # while it still holds it, and lets go by exiting.
  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import fcntl, os, sys\n"
      "fd = os.open(sys.argv[1], os.O_RDWR)\n"
      "fcntl.flock(fd, fcntl.LOCK_EX)\n"
      "print('held', flush=True)\n"
      "sys.stdin.readline()\n"
      "print(sorted(os.listdir(os.path.dirname(sys.argv[1]))), flush=True)\n",
      str(tmp / ".jaxreshard-save.lock"),
    ],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    live, found_held, committed_while_held = _durable._live, threading.Event(), []

    def watched(path):
      held = live(path)
      if held:
        found_held.set()
      return held

    monkeypatch.setattr(_durable, "_live", watched)

    def let_go():
      found_held.wait(60)  # the save found the directory held: it waits now
      committed_while_held.append(os.path.exists(run / "1"))
      holder.stdin.write("go\n")
      holder.stdin.flush()

    releaser = threading.Thread(target=let_go)
    releaser.start()
    records = adam_records(2)
    with _durable_manager(run) as manager:
      manager.save(1, args=jr.ReshardSave(records))
      manager.wait_until_finished()
      got = manager.restore(1, args=jr.ReshardRestore())
    releaser.join(60)
    seen = holder.stdout.readline()
    assert holder.wait(60) == 0
  finally:
    if holder.poll() is None:
      holder.kill()
      holder.wait()
  assert found_held.is_set() and committed_while_held == [False], committed_while_held
  assert "'theirs'" in seen  # untouched while its writer held it
  for a, b in zip(got, records, strict=True):
    assert_records_equal(a, b)
  assert not tmp.exists() and "theirs" not in os.listdir(run / "1")


def test_a_save_gives_up_on_a_directory_another_writer_holds_past_orbax_s_timeout(
  tmp_path, monkeypatch
):
  """Another writer holds the step's directory for longer than orbax waits for a
  directory: the save is refused a little before that timeout, removing nothing."""
  import threading

  from jaxreshard._src.checkpoint import tempdir as _tempdir

  run = tmp_path / "run"
  tmp = run / "1.orbax-checkpoint-tmp"
  (tmp / "theirs").mkdir(parents=True)
  held = _tempdir.hold(str(tmp))
  assert held is not None
  monkeypatch.setattr(ocp.multihost, "coordination_timeout", lambda: 2)
  errors = []

  def save():
    try:
      with _durable_manager(run) as manager:
        manager.save(1, args=jr.ReshardSave(adam_records(2)))
        manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-exception-caught
      errors.append(e)

  saver = threading.Thread(target=save, daemon=True)  # a save that never gives up stays here
  try:
    saver.start()
    saver.join(60)
    assert not saver.is_alive()
  finally:
    os.close(held[1])
    os.close(held[0])
  assert [type(e) for e in errors] == [jr.ArchiveExistsError], errors
  assert "has been writing it for longer than orbax waits for a directory" in str(errors[0])
  assert (tmp / "theirs").is_dir() and not (run / "1").exists()
  _wait_for_refused_save_threads()


def test_a_lock_taken_on_a_file_a_clean_removed_meanwhile_is_not_held(tmp_path, monkeypatch):
  """``hold`` checks, once locked, that the lock file and the directory are still the
  ones at their paths: a clean that removed them in between leaves the writer
  holding nothing, and it makes its directory anew rather than write unprotected."""
  from jaxreshard._src.checkpoint import tempdir as _tempdir

  d = tmp_path / "ck.orbax-checkpoint-tmp"
  d.mkdir()
  probe = _tempdir._lock_probe  # pylint: disable=protected-access

  def then_removed(path):
    got = probe(path)
    os.unlink(os.path.join(path, _tempdir.LOCK_FILE))  # what a clean does before rmdir
    return got

  monkeypatch.setattr(_tempdir, "_lock_probe", then_removed)
  assert _tempdir.hold(str(d)) is None
  monkeypatch.setattr(_tempdir, "_lock_probe", probe)
  held = _tempdir.hold(str(d))
  assert held is not None
  os.close(held[1])
  os.close(held[0])


def test_a_save_sharded_that_timed_out_returns_after_its_writes_stopped(tmp_path, monkeypatch):
  """Orbax gives up on a save past its timeout while the commit future that writes
  the archives goes on in its own thread. save_sharded returns only once that
  thread stopped (at its next archive): before, it went on writing into the
  directory the failed save removed, or into the next save's of the same path
  (orbax names them alike), which a retry then refused as another save's."""
  import threading

  from jaxreshard._src.checkpoint import reader as _reader

  opt, state, mesh = _mesh_state()
  write, result = _reader.write_archive, ocp.future.ChainedFuture.result
  timed_out, returned, writers = threading.Event(), threading.Event(), []

  def timing_out(self, timeout=None):
    try:
      return result(self, timeout=timeout)
    except TimeoutError:
      timed_out.set()
      raise

  def slow_disk(directory, index, *args, **kwargs):
    if not writers:  # the first archive of the first save: still writing when orbax gives up
      writers.append(threading.current_thread())
      returned.wait(2.5)  # not set while save_sharded waits for this write
    return write(directory, index, *args, **kwargs)

  monkeypatch.setattr(ocp.future.ChainedFuture, "result", timing_out)
  monkeypatch.setattr(_reader, "write_archive", slow_disk)
  try:
    with pytest.raises(jr.ArchiveError, match=r"ck was not committed \(TimeoutError"):
      jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh, timeout_s=1)
    assert timed_out.is_set()  # orbax gave up while the archive was being written
    assert not writers[0].is_alive()  # no write of the failed save is left running
  finally:
    returned.set()
    for writer in writers:
      threading.Thread.join(writer, 60)  # orbax's join raises the thread's error
  assert os.listdir(tmp_path) == []
  jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert len(jr.load_records(tmp_path / "ck")) == 4


def test_a_timed_out_save_sharded_writes_no_archive_after_it_gave_up(tmp_path, monkeypatch):
  """Each archive takes longer than the save's timeout: once orbax gave up, the
  archive being written is the last one (the save waits for it), not the first of
  four that the failed save then writes into a directory it removes."""
  from jaxreshard._src.checkpoint import reader as _reader

  opt, state, mesh = _mesh_state()
  write, written = _reader.write_archive, []

  def slow_disk(directory, index, *args, **kwargs):
    time.sleep(1.5)
    written.append(index)
    return write(directory, index, *args, **kwargs)

  monkeypatch.setattr(_reader, "write_archive", slow_disk)
  with pytest.raises(jr.ArchiveError, match=r"ck was not committed \(TimeoutError"):
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh, timeout_s=1)
  assert len(written) == 1, written
  assert os.listdir(tmp_path) == []


def test_a_save_that_fails_after_its_commit_does_not_say_it_was_not_committed(
  tmp_path, monkeypatch
):
  """A process whose wait fails after the directory was renamed (another process's
  rename, then a barrier that times out) said "was not committed" of a checkpoint
  that is complete: a retry trusting it met "already exists". It now says that the
  directory exists and may be complete, and it loads."""
  opt, state, mesh = _mesh_state()
  wait = ocp.AsyncCheckpointer.wait_until_finished

  def then_fails(self):
    wait(self)
    if os.path.isdir(tmp_path / "ck"):  # orbax also waits before it starts a save
      raise TimeoutError("the commit barrier timed out")

  monkeypatch.setattr(ocp.AsyncCheckpointer, "wait_until_finished", then_fails)
  with pytest.raises(jr.ArchiveError) as e:
    jr.save_sharded(tmp_path / "ck", opt, state, {"w": (12,)}, mesh)
  assert "was not committed" not in str(e.value), e.value
  assert "ck exists, but this process could not see its save through" in str(e.value)
  assert "TimeoutError: the commit barrier timed out" in str(e.value)
  assert len(jr.load_records(tmp_path / "ck")) == 4


@pytest.mark.parametrize("durable", [False, True])
def test_a_manager_step_orbax_gave_up_on_saves_again_at_once(tmp_path, monkeypatch, durable):
  """A CheckpointManager gives up on a save past its timeout and tells the handler
  nothing: the archive writes of that save stop (the archive being written is its
  last) before the manager's wait returns, so a retry of the step in the same process
  commits the exact bits. (Before: the abandoned save went on writing into the
  retry's directory, which orbax names alike, and the retry was refused as another
  save's.)"""
  from jaxreshard._src.checkpoint import reader as _reader

  records = adam_records(4)
  write, first, written = _reader.write_archive, [], []
  retried, old_wrote = threading.Event(), threading.Event()

  def slow_disk(directory, index, *args, **kwargs):
    if not first:
      first.append(threading.current_thread())
    if threading.current_thread() is first[0]:  # the first save: slower than the timeout
      retried.wait(2)
      try:
        return write(directory, index, *args, **kwargs)
      finally:
        written.append(index)
        old_wrote.set()
    retried.set()
    old_wrote.wait(2)
    return write(directory, index, *args, **kwargs)

  monkeypatch.setattr(_reader, "write_archive", slow_disk)
  options = ocp.CheckpointManagerOptions(
    async_options=ocp.AsyncOptions(timeout_secs=1),
    **({"temporary_path_class": jr.DurableRenameTemporaryPath} if durable else {}),
  )
  with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
    manager.save(1, args=jr.ReshardSave(records))
    with pytest.raises(TimeoutError):
      manager.wait_until_finished()
    manager.save(1, args=jr.ReshardSave(records), force=True)
    manager.wait_until_finished()
    assert manager.all_steps() == [1]
    got = manager.restore(1, args=jr.ReshardRestore())
  assert written == [0] and not first[0].is_alive()  # nothing of the first save wrote on
  for a, b in zip(got, records, strict=True):
    assert_records_equal(a, b)


def test_a_manager_that_gives_up_on_a_composite_stops_the_writes_of_every_item(
  tmp_path, monkeypatch
):
  """Orbax waits for a Composite's commit futures one after another and, once one of
  them times out, asks none of those after it: the archive writes of every ReshardSave
  item of the save it gave up on stop (the archive being written is each one's last)
  before the manager's wait returns, and a retry of the step commits the exact bits."""
  from jaxreshard._src.checkpoint import reader as _reader

  records = adam_records(4)
  write, first_save, old, late = _reader.write_archive, [True], set(), []
  gave_up = threading.Event()

  def slow_disk(directory, index, *args, **kwargs):
    if first_save[0]:
      old.add(threading.current_thread())
    if threading.current_thread() in old:  # each item of the first save outlasts the timeout
      if gave_up.is_set():
        late.append((os.path.basename(directory), index))
      time.sleep(0.7)
    return write(directory, index, *args, **kwargs)

  def items(make):
    return ocp.args.Composite(a=make(), b=make())

  monkeypatch.setattr(_reader, "write_archive", slow_disk)
  options = ocp.CheckpointManagerOptions(async_options=ocp.AsyncOptions(timeout_secs=1))
  with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
    manager.save(1, args=items(lambda: jr.ReshardSave(records)))
    with pytest.raises(TimeoutError):
      manager.wait_until_finished()
    gave_up.set()
    first_save[0] = False
    deadline = time.monotonic() + 1  # the writes' threads end as they stop
    while any(t.is_alive() for t in old) and time.monotonic() < deadline:
      time.sleep(0.01)
    assert len(old) == 2 and not any(t.is_alive() for t in old)
    manager.save(1, args=items(lambda: jr.ReshardSave(records)), force=True)
    manager.wait_until_finished()
    got = manager.restore(1, args=items(jr.ReshardRestore))
  assert late == []  # no archive of the first save began after the manager gave up on it
  for name in ("a", "b"):
    for x, y in zip(got[name], records, strict=True):
      assert_records_equal(x, y)


def test_save_sharded_into_a_directory_reached_through_a_link(tmp_path):
  """The checkpoint's parent is the caller's choice, a link to a directory included
  (a scratch mount linked into the home directory): save_sharded refused it with
  NotADirectoryError (the parent's lock was taken with O_NOFOLLOW)."""
  (tmp_path / "real").mkdir()
  os.symlink(tmp_path / "real", tmp_path / "link")
  opt, state, mesh = _mesh_state()
  jr.save_sharded(tmp_path / "link" / "ck", opt, state, {"w": (12,)}, mesh)
  assert os.listdir(tmp_path / "real") == ["ck"]
  import jax
  import numpy as np

  restored, _ = jr.restore_sharded(tmp_path / "real" / "ck", mesh)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
