"""A save never leaves half a checkpoint: full disks, killed saves, races and bad paths.

Every case runs the real writer on the real file system: a full disk is a file
size limit (``RLIMIT_FSIZE``, any user) and, where this process may mount one,
a tiny tmpfs; a killed save is a real process killed mid-write.
"""

import dataclasses
import enum
import errno
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import FrozenDict
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxreshard as jr
from jaxreshard._src.checkpoint import shardfile as _shardfile
from jaxreshard._src.checkpoint import store as _archive_io
from jaxreshard._src.checkpoint import tempname as _tempname
from tests._core_util import (
  adam_records,
  assert_records_equal,
  bits,
  device_mesh,
  oracle_slots,
  replace_history,
  retyped_adam_records,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str, *, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=env,
    **kwargs,
  )


@pytest.mark.slow
def test_a_full_disk_is_an_os_error_naming_the_checkpoint_and_leaves_nothing(tmp_path):
  # A file size limit makes the writer's writes fail the way a full disk does.
  out = tmp_path / "ckpt"
  result = _python(f"""
      import resource, signal
      import jax.numpy as jnp, optax, jaxreshard as jr
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      params = {{"w": jnp.arange(200_000.0)}}
      opt = optax.adam(1e-3)
      records = jr.shard_state(opt, params, opt.init(params), world_size=3)
      resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
      try:
        jr.save_records({str(out)!r}, records)
      except OSError as e:
        print("errno", e.errno, "filename", e.filename, "|", e)
      """)
  assert result.returncode == 0, result.stderr
  assert f"errno {errno.EFBIG} filename {out} |" in result.stdout, result.stdout
  assert os.listdir(tmp_path) == []  # no checkpoint, no temporary directory


@pytest.mark.parametrize("failing", ["fsync", "open"])
def test_a_failed_fsync_after_the_rename_says_the_checkpoint_is_in_place(
  tmp_path, monkeypatch, failing
):
  """The rename is done when the parent's fsync fails, or opening the parent for it
  (a directory writable but not readable): the save raises (it is not known
  durable), saying that the checkpoint is in place, complete; and it is."""
  records = adam_records(3)
  fsync, open_ = os.fsync, os.open
  code = errno.EIO if failing == "fsync" else errno.EACCES

  def parent_fails(fd):
    if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path):
      raise OSError(code, os.strerror(code))
    return fsync(fd)

  def parent_unreadable(path, flags, *args, **kwargs):
    if os.fspath(path) == str(tmp_path) and "dir_fd" not in kwargs and flags & os.O_DIRECTORY:
      raise OSError(code, os.strerror(code), os.fspath(path))
    return open_(path, flags, *args, **kwargs)

  if failing == "fsync":
    monkeypatch.setattr(os, "fsync", parent_fails)
  else:
    monkeypatch.setattr(os, "open", parent_unreadable)
  with pytest.raises(OSError, match="in place and complete, but its rename may not survive") as e:
    jr.save_records(tmp_path / "ckpt", records)
  assert e.value.errno == code and e.value.filename == str(tmp_path / "ckpt")
  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "open", open_)
  for a, b in zip(jr.load_records(tmp_path / "ckpt"), records, strict=True):
    assert_records_equal(a, b)
  assert os.listdir(tmp_path) == ["ckpt"]
  # The writer's lock file is gone from it (it was left when the fsync failed).
  assert ".jaxreshard-save.lock" not in os.listdir(tmp_path / "ckpt")


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.float64])
def test_a_history_buffer_of_a_dtype_no_reader_copies_is_refused_as_reshard_does(tmp_path, dtype):
  """An integer, bool or (x64 off) float64 history buffer: the save refuses it with
  reshard's own error and writes nothing (it crashed with a bare KeyError, or
  wrote a checkpoint every reader refuses)."""
  records = retyped_adam_records(mu_dtype=dtype)
  with pytest.raises(jr.ShapeError) as want:
    jr.reshard(records, jr.plan(records, world_size=3, rank=0))
  with pytest.raises(jr.ShapeError) as got:
    jr.save_records(tmp_path / "ckpt", records)
  assert str(got.value) == str(want.value)
  assert os.listdir(tmp_path) == []
  with pytest.raises(jr.ShapeError, match="is not a floating dtype jaxreshard copies"):
    jr.ReshardSave(records)


def test_a_history_buffer_of_another_length_than_its_flat_layout_is_refused_by_the_save(tmp_path):
  """Rank 2's first history buffer of a param one slot too long: refused with the
  archive, the buffer and both lengths named, as a reshard refuses it, and nothing is
  written."""
  records = adam_records(4)
  p = records[2].placements[0]
  slots = oracle_slots(math.prod(p.shape), 4)
  records[2] = replace_history(records[2], p.param, 0, lambda h: np.zeros(slots + 1, h.dtype))
  pid = p.param
  with pytest.raises(jr.ShapeError, match=f"has shape \\({slots + 1},\\), not \\({slots},\\)"):
    jr.reshard(records, jr.plan(records, world_size=3, rank=0))
  with pytest.raises(jr.ShapeError) as got:
    jr.save_records(tmp_path / "ckpt", records)
  # Refused by the writer's own check of the record, not only by its check, after
  # writing, that the save would restore.
  assert str(got.value).startswith(
    f"param {pid!r}: archive 2, history buffer 0 has shape ({slots + 1},), not ({slots},) of"
    " its flat layout"
  )
  assert os.listdir(tmp_path) == []


def test_a_storage_dtype_no_reader_takes_is_refused_by_the_save(tmp_path):
  """Placements whose storage dtype is int32: the save refuses them with the
  refusal every restore makes, and writes nothing (it wrote them)."""
  records = retyped_adam_records(storage_dtype=np.int32)
  with pytest.raises(jr.DtypeError) as want:
    jr.reshard(records, jr.plan(records, world_size=3, rank=0))
  with pytest.raises(jr.DtypeError) as got:
    jr.save_records(tmp_path / "ckpt", records)
  assert (
    str(got.value)
    == str(want.value)
    == ("param 'a': archive 0: storage dtype int32 is not one of float32, float16, bfloat16")
  )
  assert os.listdir(tmp_path) == []


def test_a_full_tmpfs_is_enospc_and_leaves_nothing(tmp_path):
  mnt = tmp_path / "small"
  mnt.mkdir()
  if subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
  ).returncode:
    pytest.skip("this process may not mount a tmpfs (needs root); the RLIMIT_FSIZE case covers it")
  try:
    records = adam_records(3, {"w": ((200_000,), jnp.float32)})
    with pytest.raises(OSError) as info:
      jr.save_records(mnt / "ckpt", records)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(mnt / "ckpt")
    assert os.listdir(mnt) == []
    jr.save_records(
      mnt / "ckpt", adam_records(3, {"w": ((10,), jnp.float32)})
    )  # room again: it saves
  finally:
    subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.slow
def test_a_killed_save_is_cleaned_by_the_next_save(tmp_path):
  out = tmp_path / "ckpt"
  # A save killed between its archives: the generator blocks until killed.
  proc = subprocess.Popen(
    [
      sys.executable,
      "-c",
      textwrap.dedent(f"""
      import sys, time
      import jax.numpy as jnp, optax, jaxreshard as jr
      params = {{"w": jnp.arange(100.0)}}
      opt = optax.adam(1e-3)
      records = jr.shard_state(opt, params, opt.init(params), world_size=4)
      def slow():
        yield records[0]
        print("written", flush=True)
        time.sleep(600)
        yield from records[1:]
      jr.save_records({str(out)!r}, slow())
      """),
    ],
    stdout=subprocess.PIPE,
    text=True,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  try:
    assert proc.stdout.readline().strip() == "written"
    (leftover,) = os.listdir(tmp_path)
    assert leftover.startswith(".ckpt.tmp-") and not out.exists()
    # While its writer lives, nothing removes it.
    assert _archive_io.temp_dirs(str(out)) == [(str(tmp_path / leftover), False)]
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert _archive_io.temp_dirs(str(out)) == [(str(tmp_path / leftover), True)]
  records = adam_records(2)
  jr.save_records(out, records)
  assert os.listdir(tmp_path) == ["ckpt"]
  for x, y in zip(jr.load_records(out), records):
    assert_records_equal(x, y)


def test_clean_command_removes_what_a_dead_writer_left(tmp_path):
  # Liveness is the writer's lock: `live` carries this process's id but nobody
  # holds its lock, so it is stale too (test_save_liveness holds locks).
  from typer.testing import CliRunner

  from jaxreshard._src.cli.commands import app

  out = tmp_path / "ckpt"
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  stale = tmp_path / f".ckpt.tmp-{'a' * 32}-{dead.pid}-{_tempname.host()}"
  other = tmp_path / f".ckpt.tmp-{'c' * 32}-1-some.other.host"
  unrelated = tmp_path / f".ckpt2.tmp-{'d' * 32}-{dead.pid}-{_tempname.host()}"
  for d in (stale, other, unrelated):
    (d / "archive_00000").mkdir(parents=True)
  result = CliRunner().invoke(app, ["clean", str(out)])
  assert result.exit_code == 0, result.output
  assert sorted(os.listdir(tmp_path)) == sorted([other.name, unrelated.name])
  assert f"removed: {stale}" in result.stdout and "1 of 2 temporary directories" in result.stdout
  result = CliRunner().invoke(app, ["clean", str(out), "--all"])
  assert result.exit_code == 0 and os.listdir(tmp_path) == [unrelated.name]


def test_the_commit_never_replaces_what_appeared_meanwhile(tmp_path):
  # An empty directory made at the destination while the save ran: a plain
  # rename would silently replace it; the commit refuses.
  final = str(tmp_path / "ckpt")
  held = _archive_io.new_temp_dir(final)
  tmp = held.path
  os.mkdir(final)
  with pytest.raises(jr.ArchiveExistsError, match="appeared while it was being written"):
    held.commit(final)
  assert os.listdir(final) == [] and os.path.isdir(tmp)
  held.close()


def test_a_parent_that_is_a_file_is_named_as_such(tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(NotADirectoryError, match="is not a directory"):
    jr.save_records(tmp_path / "file" / "ckpt", adam_records(2))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    jr.save_records(tmp_path / "nope" / "ckpt", adam_records(2))


@pytest.mark.parametrize("bad", [None, 3, b"/tmp/x", ""])
def test_a_path_argument_that_is_not_a_path_is_refused_by_name(bad):
  for fn in (
    lambda: jr.save_records(bad, adam_records(2)),
    lambda: jr.load_records(bad),
    lambda: jr.restore(bad, world_size=2, rank=0),
    lambda: jr.open_checkpoint(bad),
  ):
    with pytest.raises(jr.ReshardError, match="directory"):
      fn()


@pytest.mark.slow
def test_an_unreadable_file_is_a_permission_error_not_corruption(tmp_path):
  jr.save_records(tmp_path / "ckpt", adam_records(2))
  target = tmp_path / "ckpt" / "archive_00001" / "archive.json"
  os.chmod(target, 0)
  # Root reads everything, so as root the reader gives up the two capabilities
  # that bypass file modes (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) and keeps its
  # uid: the checkout, its virtual environment and the checkpoint stay readable
  # to it as their owner wherever they sit, even in a private (0700) directory,
  # while the file of mode 0 does not.
  code = f"""
      import ctypes, os, jaxreshard as jr
      if os.geteuid() == 0:
        class Header(ctypes.Structure):
          _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure):
          _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                      ("inheritable", ctypes.c_uint32)]
        libc = ctypes.CDLL(None, use_errno=True)
        header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
        assert libc.capget(ctypes.byref(header), data) == 0, ctypes.get_errno()
        dac = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        data[0].effective &= ~dac
        data[0].permitted &= ~dac
        data[0].inheritable &= ~dac
        assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
        try:
          open({str(target)!r}, "rb")
          raise SystemExit("the capabilities were not dropped: root still reads mode 0")
        except PermissionError:
          pass
      try:
        jr.load_records({str(tmp_path / "ckpt")!r})
      except PermissionError as e:
        print("permission", e.filename)
      except Exception as e:
        print("other", type(e).__name__, e)
      """
  result = _python(code)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == f"permission {target}", result.stdout


def test_frozen_dict_state_nodes_round_trip_through_every_path(tmp_path):
  params = FrozenDict({"dense": {"kernel": jnp.arange(12.0).reshape(3, 4)}, "b": jnp.ones(5)})
  opt = optax.adam(1e-3)
  state = opt.init(params)
  assert type(state[0].mu) is FrozenDict
  records = jr.shard_state(opt, params, state, world_size=3)
  jr.save_records(tmp_path / "ckpt", records)
  loaded = jr.load_records(tmp_path / "ckpt")
  assert type(loaded[0].state[0].mu) is FrozenDict
  for x, y in zip(loaded, records):
    assert_records_equal(x, y)
  for full in (jr.unshard_state(records), jr.unshard_state(loaded)):
    assert jax.tree_util.tree_structure(full) == jax.tree_util.tree_structure(state)
    assert all(
      np.array_equal(bits(a), bits(b))
      for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(state))
    )
  target = jr.restore(tmp_path / "ckpt", world_size=2, rank=1)
  assert type(target.state[0].mu) is FrozenDict


def test_a_frozen_dict_checkpoint_read_where_flax_is_missing_is_refused_by_name(tmp_path):
  params = FrozenDict({"w": jnp.arange(6.0)})
  opt = optax.adam(1e-3)
  jr.save_records(tmp_path / "ckpt", jr.shard_state(opt, params, opt.init(params), world_size=2))
  result = _python(f"""
      import sys
      sys.modules["flax"] = None  # not installed: any import of it fails
      import jaxreshard as jr
      for call in (lambda: jr.load_records({str(tmp_path / "ckpt")!r}),
                   lambda: jr.restore({str(tmp_path / "ckpt")!r}, world_size=3, rank=0)):
        try:
          call()
          print("loaded")
        except jr.ArchiveError as e:
          print("refused:", e)
      """)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.strip().splitlines()
  assert len(lines) == 2, result.stdout
  for line in lines:
    assert line.startswith("refused:"), result.stdout
    assert "holds a flax FrozenDict; loading it needs flax installed" in line


class _Swapped(NamedTuple):
  a: Any
  b: Any


# Flattened b first: a NamedTuple a user registered with its own order of children.
jax.tree_util.register_pytree_node(
  _Swapped, lambda p: ((p.b, p.a), None), lambda _, children: _Swapped(children[1], children[0])
)


def test_a_namedtuple_registered_with_its_own_child_order_is_refused_at_save(tmp_path):
  # The archive's tree stores a NamedTuple's fields in order; read back, this one
  # would flatten the other way round: its leaves would swap places.
  params = _Swapped(jnp.arange(4.0), jnp.ones(3))
  opt = optax.adam(1e-3)
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  with pytest.raises(jr.ReshardError, match="the state's tree structure cannot be stored exactly"):
    jr.save_records(tmp_path / "ckpt", records)
  assert not os.path.lexists(tmp_path / "ckpt")


class _Window(NamedTuple):
  window: Any


# Clock leaves (state no param mirrors) an archive's clock cannot hold: past its size
# bound (64 KiB) or of a dtype it does not store.
_UNSTORED_CLOCKS = {
  "past_the_bound": (lambda: np.zeros(16385, np.float32), "float32 leaf of shape (16385,)"),
  "complex_scalar": (lambda: np.complex64(1 + 2j), "complex64 leaf of shape ()"),
  "float8_array": (lambda: jnp.zeros(2, jnp.float8_e4m3fn), "float8_e4m3fn leaf of shape (2,)"),
}


def _window(leaf):
  """SGD with momentum after a stage whose state is one clock leaf (no param mirrors it)."""
  window = optax.GradientTransformation(lambda p: _Window(leaf), lambda u, s, p=None: (u, s))
  return optax.chain(window, optax.sgd(0.1, momentum=0.9))


@pytest.mark.parametrize("case", sorted(_UNSTORED_CLOCKS))
def test_a_clock_leaf_the_format_cannot_hold_is_refused_in_memory_as_by_a_save(tmp_path, case):
  """One rule on every path: no path takes a clock leaf that a save refuses, so a run
  learns of it when its state is first sharded, not at its first checkpoint."""
  make, words = _UNSTORED_CLOCKS[case]
  words = re.escape(f"cannot store a {words} as a scalar")
  params = {"w": jnp.arange(5.0)}
  opt = _window(make())
  with pytest.raises(jr.PlacementError, match=r"archive 0, clock scalar \[0\]\.window: " + words):
    jr.shard_state(opt, params, opt.init(params), world_size=2)

  # Records built by hand around it: every reshard refuses them, and so does a save.
  fine = _window(np.float32(0.0))
  records = [
    dataclasses.replace(r, state=(_Window(make()), r.state[1]))
    for r in jr.shard_state(fine, params, fine.init(params), world_size=2)
  ]
  for call in (
    lambda: jr.plan(records, world_size=3, rank=0),
    lambda: jr.unshard_state(records),
    lambda: jr.save_records(tmp_path / "ckpt", records),
  ):
    with pytest.raises(jr.PlacementError, match=r"clock scalar \[0\]\.window: " + words):
      call()
  assert not os.path.lexists(tmp_path / "ckpt")

  # The mesh path, which never takes records apart: its save refuses it by the same rule.
  mesh = device_mesh((2,), ("fsdp",))
  flat = jr.flat_sharded(opt, mesh, axis="fsdp")
  with pytest.raises(jr.ReshardError, match=words):
    jr.save_sharded(tmp_path / "mesh", opt, flat.init(params), {"w": (5,)}, mesh, axis="fsdp")
  assert not os.path.lexists(tmp_path / "mesh")


@pytest.mark.parametrize(
  "value, words",
  [
    (2**63, "the Python int 9223372036854775808 (outside int64)"),
    (-(2**63) - 1, "the Python int -9223372036854775809 (outside int64)"),
    (enum.IntEnum("Mode", "A B").B, "a Python Mode (a subclass of IntEnum)"),
    (1 + 2j, "a complex128 leaf of shape () as a scalar"),
  ],
)
def test_a_python_clock_value_a_checkpoint_cannot_read_back_is_refused_by_name(
  tmp_path, value, words
):
  """A Python int past int64 (or an int subclass) was written, then refused by the save's
  read-back with no word of why; a complex one was taken in memory."""
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  params = {"w": jnp.arange(4.0)}
  state = opt.init(params)
  state = state._replace(hyperparams={**state.hyperparams, "learning_rate": value})
  with pytest.raises(jr.PlacementError, match=re.escape(words)):
    jr.shard_state(opt, params, state, world_size=2)
  fine = jr.shard_state(opt, params, opt.init(params), world_size=2)
  for r in fine:
    r.state.hyperparams["learning_rate"] = value  # optax's own idiom, after the fact
  with pytest.raises(jr.ReshardError, match=re.escape(f"cannot store {words}")):
    jr.save_records(tmp_path / "ckpt", fine)
  assert not os.path.lexists(tmp_path / "ckpt")


@pytest.mark.parametrize("chunk_bytes", [0, -1, True, 2.0, "x", (1 << 30) + 1, 1 << 31])
def test_chunk_bytes_a_save_could_not_read_back_is_refused_before_writing(tmp_path, chunk_bytes):
  """One rule on every save path: a chunk is read back in one read call (Linux caps one
  call below 2 GiB), so chunk_bytes is a positive integer of at most 1 GiB."""
  from jaxreshard import orbax as jro

  records = adam_records(world=2)
  path = tmp_path / "ckpt"
  with pytest.raises(jr.ReshardError, match="chunk_bytes"):
    jr.save_records(path, records, chunk_bytes=chunk_bytes)
  assert not os.path.lexists(path)
  with pytest.raises(jr.ReshardError, match="chunk_bytes"):
    jro.ReshardSave(records=records, chunk_bytes=chunk_bytes)
  mesh = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
  params = {"w": jnp.arange(5.0)}
  opt = optax.adam(1e-3)
  state = jr.shard_to_mesh(opt, params, opt.init(params), mesh).state
  with pytest.raises(jr.ReshardError, match="chunk_bytes"):
    jr.save_sharded(path, opt, state, {"w": (5,)}, mesh, chunk_bytes=chunk_bytes)
  assert not os.path.lexists(path)
  # The handler given to a CheckpointManager (item_handlers=) takes the same rule.
  with pytest.raises(jr.ReshardError, match="chunk_bytes"):
    jr.ReshardCheckpointHandler(chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("durable", [None, 0, 1, "no", np.bool_(True)])
def test_a_durable_that_is_not_a_bool_is_refused_before_writing(tmp_path, durable):
  """``durable=0`` or ``None`` would have saved with no fsync, ``"no"`` with every one."""
  path = tmp_path / "ckpt"
  with pytest.raises(jr.ReshardError, match=f"durable {re.escape(repr(durable))} must be True or"):
    jr.save_records(path, adam_records(world=2), durable=durable)
  assert os.listdir(tmp_path) == []


def test_the_largest_chunk_bytes_is_accepted(tmp_path):
  records = adam_records(world=2)
  jr.save_records(tmp_path / "ckpt", records, chunk_bytes=1 << 30)
  loaded = jr.load_records(tmp_path / "ckpt")
  assert len(loaded) == len(records)
  for got, want in zip(loaded, records):
    assert_records_equal(got, want)


def test_a_big_endian_host_is_refused_before_any_file_is_written_or_read(tmp_path, monkeypatch):
  """Buffer files hold little-endian bytes moved without conversion: on a host of
  the other byte order a save leaves nothing and a restore reads nothing."""
  records = adam_records(3)
  jr.save_records(tmp_path / "ok", records)
  monkeypatch.setattr(sys, "byteorder", "big")
  with pytest.raises(jr.ArchiveError, match="this host is big-endian: buffer files hold little"):
    jr.save_records(tmp_path / "new", records)
  assert sorted(os.listdir(tmp_path)) == ["ok"]
  with pytest.raises(jr.ArchiveError, match="this host is big-endian"):
    jr.restore(tmp_path / "ok", world_size=2, rank=0)
  monkeypatch.setattr(sys, "byteorder", "little")
  assert_records_equal(
    jr.restore(tmp_path / "ok", world_size=2, rank=0),
    jr.reshard(records, jr.plan(records, world_size=2, rank=0)),
  )


def _with_padding_bits(record, pid, mirror, local, value):
  """``record`` with element ``local`` of ``pid``'s history buffer ``mirror`` set to
  the raw bits ``value`` (every other leaf the same object)."""
  leaves, tree = jax.tree.flatten(record.state)
  hist = [i for i, role in enumerate(record.roles) if role == pid]
  a = np.array(leaves[hist[mirror]])
  a.view(f"u{a.dtype.itemsize}")[local] = value
  leaves[hist[mirror]] = a
  return jr.ShardRecord(
    record.version, record.placements, jax.tree.unflatten(tree, leaves), record.roles
  )


@pytest.mark.parametrize(
  "dtype, rank, local, value",
  [
    (np.float32, 2, 1, 0x80000000),  # -0.0 past the one element rank 2 owns
    (np.float32, 3, 0, 1),  # a subnormal in a rank that is all padding
    (jnp.bfloat16, 3, 1, 0x7FC1),  # a NaN payload
  ],
)
def test_a_save_refuses_padding_that_is_not_zero_and_writes_nothing(
  tmp_path, dtype, rank, local, value
):
  """What a reader refuses is never written: nonzero bits past the elements a rank
  owns refuse the save, in records checked leaf by leaf and in deferred records
  (a later rank of a layout the save has registered) written into in place."""
  opt = optax.adam(1e-3)
  params = {"a": jnp.zeros((5,), dtype), "b": jnp.zeros((3, 2), dtype)}
  # "a": 5 elements over 4 ranks, slots 2: rank 2 owns one element, rank 3 none.
  records = jr.shard_state(opt, params, opt.init(params), world_size=4)
  bad = list(records)
  bad[rank] = _with_padding_bits(records[rank], "a", 1, local, value)
  with pytest.raises(jr.PlacementError) as e:
    jr.save_records(tmp_path / "eager", bad)
  assert str(e.value).startswith(f"param 'a': history buffer 1 of archive {rank}: padding is")
  assert f"nonzero bits at local index {local}" in str(e.value)
  # Deferred records, a later rank of a registered layout written into in place.
  deferred = jr.reshard_ranks(records, [jr.plan(records, world_size=4, rank=r) for r in range(4)])
  a = deferred[rank].state[0].nu["a"]
  a.view(f"u{a.dtype.itemsize}")[local] = value
  with pytest.raises(jr.PlacementError, match=f"archive {rank}: padding is not zero"):
    jr.save_records(tmp_path / "deferred", deferred)
  assert os.listdir(tmp_path) == []
  a.view(f"u{a.dtype.itemsize}")[local] = 0  # made zero again: saved and loaded
  jr.save_records(tmp_path / "ok", deferred)
  for got, want in zip(jr.load_records(tmp_path / "ok"), records):
    assert_records_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(
  counts=st.lists(st.integers(0, 9), min_size=1, max_size=4),
  w=st.integers(1, 7),
  m=st.integers(2, 9),
  pick=st.tuples(st.integers(0, 2**16), st.integers(0, 2**16), st.integers(0, 2**16)),
  bf16=st.booleans(),
)
def test_a_save_of_deferred_records_refuses_exactly_the_padding_bits_it_finds(
  tmp_path_factory, counts, w, m, pick, bf16
):
  """One element of one target rank's history buffer is given nonzero bits: the
  save refuses when, by the flat-shard rule (slots ceil(count / m), the rank owns
  [rank * slots, count)), that element is padding, naming its param, mirror and
  local index, and saves otherwise; checked against that rule, not the code."""
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  params = {f"p{i}": jnp.zeros((c,), dtype) for i, c in enumerate(counts)}
  opt = optax.adam(1e-3)
  records = jr.shard_state(opt, params, opt.init(params), world_size=w)
  targets = jr.reshard_ranks(records, [jr.plan(records, world_size=m, rank=r) for r in range(m)])
  live = [pid for pid, c in zip(params, counts) if c > 0]
  if not live:
    return
  pid = live[pick[0] % len(live)]
  count = counts[int(pid[1:])]
  slots = -(-count // m)
  rank, mirror = 1 + pick[1] % (m - 1), pick[2] % 2  # rank 0 is registered leaf by leaf
  local = (pick[2] // 2) % slots
  buffer = (targets[rank].state[0].mu, targets[rank].state[0].nu)[mirror][pid]
  buffer.view(f"u{buffer.dtype.itemsize}")[local] = 0x3C01
  owned = max(0, min(slots, count - rank * slots))
  path = tmp_path_factory.mktemp("ck") / "c"
  if local < owned:
    jr.save_records(path, targets)
    assert (
      bits(jr.load_records(path)[rank].state[0][1 + mirror][pid]).tolist() == bits(buffer).tolist()
    )
  else:
    with pytest.raises(jr.PlacementError) as e:
      jr.save_records(path, targets)
    assert str(e.value).startswith(
      f"param '{pid}': history buffer {mirror} of archive {rank}: padding is not zero"
      f" (nonzero bits at local index {local})"
    )
    assert not path.exists()


def test_a_save_out_of_descriptors_leaves_no_temporary_directory(tmp_path, monkeypatch):
  """EMFILE while the new temporary directory is taken (its lock file opened): the
  save raises and removes the directory it made (it stayed, with a free lock)."""
  open_ = os.open

  def no_descriptors(name, flags, *args, **kwargs):
    if os.fspath(name) == ".jaxreshard-save.lock":
      raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    return open_(name, flags, *args, **kwargs)

  monkeypatch.setattr(os, "open", no_descriptors)
  with pytest.raises(OSError) as e:
    jr.save_records(tmp_path / "ckpt", adam_records(2))
  assert e.value.errno == errno.EMFILE
  assert os.listdir(tmp_path) == []


# Every file a save creates: a buffer's zarr.json and shard file, archive.json, the index.
_SAVED_FILES = ["zarr.json", "0", "archive.json", "jaxreshard.json"]


@pytest.mark.parametrize("name", _SAVED_FILES)
@pytest.mark.parametrize("failing", ["create", "write"])
def test_a_file_that_cannot_be_made_or_written_is_an_os_error_naming_the_checkpoint(
  tmp_path, monkeypatch, failing, name
):
  """ENOSPC when any one file is created (no inode left) or written (no block left):
  the save raises it, named by the checkpoint, and leaves nothing."""
  open_, writev = os.open, _shardfile._writev

  def create_fails(file, flags, *args, **kwargs):
    if os.fspath(file) == name and flags & os.O_EXCL:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return open_(file, flags, *args, **kwargs)

  def write_fails(fd, parts):
    if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == name:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return writev(fd, parts)

  if failing == "create":
    monkeypatch.setattr(os, "open", create_fails)
  else:
    monkeypatch.setattr(_shardfile, "_writev", write_fails)
  with pytest.raises(OSError) as e:
    jr.save_records(tmp_path / "ckpt", adam_records(2))
  assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "ckpt")), e.value
  assert "(saving a checkpoint)" in str(e.value)
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", _SAVED_FILES)
def test_a_failed_fsync_of_a_file_fails_the_save_and_commits_nothing(tmp_path, monkeypatch, name):
  """A file's fsync runs in the background while the next is written: its EIO (the
  bytes may never reach the disk) is the save's error, and nothing is committed."""
  fsync = os.fsync

  def file_fails(fd):
    if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == name:
      raise OSError(errno.EIO, os.strerror(errno.EIO))
    return fsync(fd)

  monkeypatch.setattr(os, "fsync", file_fails)
  with pytest.raises(OSError) as e:
    jr.save_records(tmp_path / "ckpt", adam_records(2))
  assert (e.value.errno, e.value.filename) == (errno.EIO, str(tmp_path / "ckpt")), e.value
  assert os.listdir(tmp_path) == []


def _left(tmp_path) -> list[str]:
  return sorted(os.listdir(tmp_path))


def test_a_param_id_no_reader_takes_is_refused_before_a_save_and_nothing_is_left(tmp_path):
  """A reader refuses param ids of more than 4,096 characters; the save refused none and
  reported done a checkpoint that every load refused. Memory refuses them first (a
  save of records built by hand with one: tests/core/test_storable_trees.py)."""
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"k" * 5000: jnp.ones(3), "short": jnp.ones(2)}
  with pytest.raises(jr.PlacementError, match="5000 characters.*4096 characters a checkpoint"):
    jr.shard_state(opt, params, opt.init(params), world_size=2)
  assert _left(tmp_path) == []
  # One character less than the bound saves and loads exactly.
  params = {"k" * 4096: jnp.arange(3.0)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  jr.save_records(str(tmp_path / "ok"), records)
  for got, want in zip(jr.load_records(str(tmp_path / "ok")), records, strict=True):
    assert_records_equal(got, want)


def test_more_optimizer_scalars_than_a_reader_takes_are_refused_by_the_save(tmp_path):
  """A reader takes at most 1,024 + 8 per param optimizer scalars (1,032 here)."""
  opt = optax.chain(*[optax.scale_by_schedule(lambda c: 1.0) for _ in range(1040)])
  params = {"w": jnp.ones(3)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  # Named by the checkpoint the caller gave, not the hidden sibling it was written in;
  # records from a generator alike.
  for as_given in (records, iter(records)):
    with pytest.raises(jr.ArchiveError, match="would not load.*1040 optimizer scalars") as e:
      jr.save_records(str(tmp_path / "ck"), as_given)
    assert f"nothing is committed: {tmp_path / 'ck'}/jaxreshard.json" in str(e.value)
    assert _left(tmp_path) == []


def test_an_index_larger_than_a_reader_reads_is_refused_by_the_save(tmp_path, monkeypatch):
  """A reader reads at most ``MAX_INDEX_BYTES`` of an index (64 MiB, some 10**5 params;
  lowered here to this index's size): one byte more is refused before the index is
  written, and nothing is left; at the bound it saves and loads exactly."""
  from jaxreshard._src.checkpoint import reader as _reader
  from jaxreshard._src.checkpoint import writer as _writer

  records = adam_records(2)
  jr.save_records(tmp_path / "measured", records)
  size = os.path.getsize(tmp_path / "measured" / "jaxreshard.json")
  shutil.rmtree(tmp_path / "measured")
  for module in (_writer, _reader):
    monkeypatch.setattr(module, "MAX_INDEX_BYTES", size - 1)
  with pytest.raises(jr.ArchiveError) as e:
    jr.save_records(tmp_path / "ck", records)
  expected = (
    f"{tmp_path / 'ck'}/jaxreshard.json would have {size} bytes (a reader takes {size - 1})"
  )
  assert expected in str(e.value)
  assert _left(tmp_path) == []
  for module in (_writer, _reader):
    monkeypatch.setattr(module, "MAX_INDEX_BYTES", size)
  jr.save_records(tmp_path / "ok", records)
  for got, want in zip(jr.load_records(tmp_path / "ok"), records, strict=True):
    assert_records_equal(got, want)
  # A reshard's output, committed with no restore's check (it may be some ranks): its
  # index names its source, so it is larger than its source's.
  from typer.testing import CliRunner

  from jaxreshard._src.cli.commands import app

  def reshard(out):
    return CliRunner().invoke(app, ["reshard", str(tmp_path / "ok"), str(out), "-w", "3"])

  for module in (_writer, _reader):
    monkeypatch.setattr(module, "MAX_INDEX_BYTES", 64 << 20)
  assert reshard(tmp_path / "out").exit_code == 0
  out_size = os.path.getsize(tmp_path / "out" / "jaxreshard.json")
  assert out_size > size
  shutil.rmtree(tmp_path / "out")
  for module in (_writer, _reader):
    monkeypatch.setattr(module, "MAX_INDEX_BYTES", out_size - 1)
  result = reshard(tmp_path / "out")
  assert result.exit_code == 2, result.output
  expected = f"{tmp_path / 'out'}/jaxreshard.json would have {out_size} bytes"
  assert expected in " ".join(result.output.split()), result.output
  assert _left(tmp_path) == ["ok"]


@pytest.mark.parametrize("n", [4, 300])  # the JSON index; the binary table (>= 256 buffers)
def test_a_param_id_with_a_lone_surrogate_round_trips_through_either_index(tmp_path, n):
  """Any str is a dict key; the binary table's UTF-8 encoder raised UnicodeEncodeError
  (not a refusal) on a lone surrogate that the JSON index holds."""
  opt = optax.sgd(0.1, momentum=0.9)
  params = {f"p{i}": jnp.full((3,), float(i)) for i in range(n - 1)}
  params["\udcff"] = jnp.arange(5.0)
  _, state = opt.update(jax.tree.map(jnp.sin, params), opt.init(params), params)
  records = jr.shard_state(opt, params, state, world_size=2)
  jr.save_records(str(tmp_path / "ck"), records)
  assert os.path.exists(tmp_path / "ck" / "jaxreshard.table") == (n > 256)
  back = jr.load_records(str(tmp_path / "ck"))
  for got, want in zip(back, records, strict=True):
    assert_records_equal(got, want)
  assert "\udcff" in {p.param for p in back[0].placements}


def test_a_read_error_of_the_records_source_is_not_called_a_failed_write(tmp_path):
  """Records streamed from a source (the CLI's reshard and merge read them from another
  checkpoint): an OSError the source raises names the file it read, not the save."""
  records = adam_records(3)
  source = str(tmp_path / "src" / "archive_00001" / "float32" / "c" / "0")

  def streamed():
    yield records[0]
    raise OSError(errno.EIO, os.strerror(errno.EIO), source)

  with pytest.raises(OSError) as info:
    jr.save_records(str(tmp_path / "out"), streamed())
  assert info.value.errno == errno.EIO and info.value.filename == source, info.value
  assert "saving a checkpoint" not in str(info.value)
  assert _left(tmp_path) == []


def test_a_temporary_directory_that_cannot_be_made_is_named_by_the_checkpoint():
  """The error named the hidden `.x.tmp-<hex>-<pid>-<host>` sibling, not the checkpoint."""
  final = "/proc/jaxreshard-no-such-checkpoint"  # a directory no one can make in
  with pytest.raises(OSError) as info:
    jr.save_records(final, adam_records(2))
  assert info.value.filename == final and "temporary directory" in str(info.value), info.value
