"""The public surface: names, keyword-only ``world_size`` then ``rank``, versions, typing."""

import inspect
import json
import os
import pathlib
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import reader as _checkpoint
from tests._core_util import bits

PARAMS = {"dense": {"kernel": jnp.arange(12.0).reshape(3, 4) - 5.0, "bias": jnp.ones((5,))}}


def _records(world_size):
  opt = optax.sgd(0.1, momentum=0.9)
  state = opt.update(PARAMS, opt.init(PARAMS))[1]
  return jr.shard_state(opt, PARAMS, state, world_size)


def _kw_only_order(fn):
  params = inspect.signature(fn).parameters
  names = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
  return [n for n in names if n in ("world_size", "rank")]


@pytest.mark.parametrize("fn", [jr.restore, jr.plan, jr.ReshardRestore])
def test_world_size_then_rank_keyword_only(fn):
  assert _kw_only_order(fn) == ["world_size", "rank"]


def test_restore_ranks_takes_world_size_keyword_only():
  assert _kw_only_order(jr.restore_ranks) == ["world_size"]


def test_positional_world_size_or_rank_is_refused(tmp_path):
  records = _records(4)
  jr.save_records(tmp_path / "ckpt", records)
  with pytest.raises(TypeError):
    jr.restore(tmp_path / "ckpt", 3, 1)  # pylint: disable=too-many-function-args
  with pytest.raises(TypeError):
    jr.plan(records, 3, 1)  # pylint: disable=too-many-function-args
  with pytest.raises(TypeError):
    jr.ReshardRestore(3, 1)  # pylint: disable=too-many-function-args


def test_restore_by_keyword_is_the_planned_reshard_bit_for_bit(tmp_path):
  records = _records(4)
  jr.save_records(tmp_path / "ckpt", records)
  for rank in range(3):  # 4 -> 3: uneven, the last rank padded
    got = jr.restore(tmp_path / "ckpt", world_size=3, rank=rank)
    want = jr.reshard(records, jr.plan(records, world_size=3, rank=rank))
    assert got.placements == want.placements
    for x, y in zip(jax.tree.leaves(got.state), jax.tree.leaves(want.state)):
      np.testing.assert_array_equal(bits(x), bits(y))
  args = jr.ReshardRestore(world_size=3, rank=2)
  assert (args.world_size, args.rank) == (3, 2)


def test_shard_state_takes_world_size_positionally_as_the_contract_shows():
  opt = optax.adam(1e-3)
  state = opt.init(PARAMS)
  assert len(jr.shard_state(opt, PARAMS, state, 5)) == 5
  assert len(jr.shard_state(opt, PARAMS, state, world_size=5)) == 5


def test_top_level_names():
  for name in jr.__all__:
    assert hasattr(jr, name), name
  assert "FORMAT_VERSION" not in jr.__all__ and not hasattr(jr, "FORMAT_VERSION")
  assert "mesh_ranks" not in jr.__all__ and not hasattr(jr, "mesh_ranks")
  # The sub-namespace is reachable but not star-exported: it would shadow orbax itself.
  assert "orbax" not in jr.__all__
  assert jr.orbax.ReshardSave is jr.ReshardSave
  assert jr.orbax.ReshardRestore is jr.ReshardRestore
  assert jr.orbax.ReshardCheckpointHandler is jr.ReshardCheckpointHandler
  assert jr.orbax.DurableRenameTemporaryPath is jr.DurableRenameTemporaryPath
  assert sorted(jr.orbax.__all__) == [
    "DurableRenameTemporaryPath",
    "ReshardCheckpointHandler",
    "ReshardRestore",
    "ReshardSave",
  ]


def test_versions_say_what_they_version(tmp_path):
  records = _records(2)
  assert {r.version for r in records} == {jr.RECORD_VERSION} == {1}
  jr.save_records(tmp_path / "ckpt", records)
  index = json.loads((tmp_path / "ckpt" / _checkpoint.INDEX_FILE).read_text())
  assert index["format_version"] == jr.CHECKPOINT_FORMAT_VERSION
  assert index["record_version"] == jr.RECORD_VERSION
  assert jr.CHECKPOINT_FORMAT_VERSION != jr.RECORD_VERSION


def test_package_is_typed():
  root = pathlib.Path(jr.__file__).parent
  assert (root / "py.typed").is_file()
  pyproject = (root.parent / "pyproject.toml").read_text()
  assert 'jaxreshard = ["py.typed"]' in pyproject


@pytest.mark.parametrize(
  "fn",
  [
    jr.shard_state,
    jr.unshard_state,
    jr.flat_sharded,
    jr.save_sharded,
    jr.restore_sharded,
    jr.shard_to_mesh,
    jr.gather_from_mesh,
    jr.save_records,
    jr.load_records,
    jr.restore,
    jr.restore_ranks,
    jr.plan,
    jr.reshard,
    jr.reshard_ranks,
    jr.digest,
  ],
)
def test_public_signatures_say_their_types(fn):
  hints = inspect.signature(fn, eval_str=True)
  for name, p in hints.parameters.items():
    assert p.annotation is not inspect.Parameter.empty, (fn.__name__, name)
    if name in ("directory", "optimizer", "params", "state", "records"):
      assert p.annotation is not typing.Any, (fn.__name__, name)
  assert hints.return_annotation is not inspect.Parameter.empty


def test_directory_arguments_take_path_like(tmp_path):
  records = _records(2)
  jr.save_records(os.fspath(tmp_path / "a"), records)
  jr.save_records(tmp_path / "b", records)
  for path in (os.fspath(tmp_path / "a"), tmp_path / "b"):
    assert len(jr.load_records(path)) == 2


# Modules where a built-in ValueError/TypeError/RuntimeError may be raised: private
# kernel invariants, and parsers whose errors are converted where they are caught.
_BUILTIN_RAISES_ALLOWED = {"_device_exec.py", "_archive_format.py", "_target_restore.py"}


def test_public_code_raises_reshard_errors_not_builtins():
  root = pathlib.Path(jr.__file__).parent
  offenders = []
  for path in sorted(root.glob("*.py")):
    if path.name in _BUILTIN_RAISES_ALLOWED:
      continue
    for n, line in enumerate(path.read_text().splitlines(), 1):
      stripped = line.strip()
      if stripped.startswith(("raise ValueError", "raise TypeError", "raise RuntimeError")):
        offenders.append(f"{path.name}:{n}: {stripped}")
  assert offenders == []


def test_refusals_of_arguments_are_reshard_errors(tmp_path):
  records = _records(2)
  for call in (
    lambda: jr.save_records(b"bytes-path", records),
    lambda: jr.save_records(tmp_path / "x", records, chunk_bytes=0),
    lambda: jr.load_records(3),
    lambda: jr.restore(tmp_path / "x", world_size=2, rank=0, progress=object()),
  ):
    with pytest.raises(jr.ReshardError):
      call()
  assert os.listdir(tmp_path) == []


def test_importing_every_module_starts_no_jax_backend(tmp_path):
  """``jax.distributed.initialize`` must come before jax starts a backend, and a
  process that forks after importing must not hold one: importing the package
  (every module of it) runs no jax computation."""
  import socket
  import subprocess
  import sys

  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  script = f"""
import importlib, pkgutil
import jaxreshard
for m in pkgutil.walk_packages(jaxreshard.__path__, "jaxreshard."):
  if not m.name.endswith(("._blockcopy", ".__main__")):  # a C library; the command line
    importlib.import_module(m.name)
import jax
jax.distributed.initialize("localhost:{port}", num_processes=1, process_id=0)
print("initialized", jax.process_count())
"""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = pathlib.Path(__file__).resolve().parent.parent
  out = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root, timeout=120
  )
  assert out.returncode == 0 and "initialized 1" in out.stdout, out.stderr[-2000:]
