"""The command line and the orbax CheckpointManager against the library on the same inputs.

Each test feeds one input (an optax state saved by ``save_records`` and by a
manager, as records and as a mesh state; or a damaged copy of it) through every
path: ``restore``, ``restore_ranks``, ``load_records`` + ``reshard``, the
manager's ``ReshardRestore`` (every archive, one rank, a mesh), ``jaxreshard
reshard`` (all ranks, and ``--rank`` then ``merge``) and ``verify``. What comes
back is compared, as unsigned integers, with a plain-numpy oracle of the flat
shard geometry (``oracle_shard``); what is refused must be refused by every path
that reads it, with a library error in Python and one line with exit code 2 from
the command line, leaving nothing behind.
"""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.cli.commands import EXIT_DIFFERENT, EXIT_ERROR, app
from jaxreshard._src.core import structure as _structure
from tests._archive_util import read_json, write_consistent_index
from tests._core_util import bits, oracle_shard, random_bits_array, special_values, standard

# Uneven sizes, a scalar and a size-1 param, bf16 and f16, and keys with spaces,
# dots, slashes, percent signs, unicode, digits and an empty key.
PARAMS = {
  "a b": jnp.zeros((5, 7), jnp.float32),
  "x.y": jnp.zeros((13,), jnp.bfloat16),
  "p/q": jnp.zeros((3,), jnp.float16),
  "ü": jnp.zeros((), jnp.float32),
  "": jnp.zeros((1,), jnp.float32),
  "0": jnp.zeros((11,), jnp.float32),
  "n": {"w": jnp.zeros((9, 2), jnp.bfloat16), "%": jnp.zeros((4,), jnp.float32)},
}
_TRAIN = jax.tree.map(lambda x: x.size > 1, PARAMS)
OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-3),
  "adamw_inject_f64": lambda: optax.inject_hyperparams(optax.adamw)(
    learning_rate=1e-3, weight_decay=0.1
  ),
  "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "masked": lambda: optax.masked(optax.adam(1e-3), _TRAIN),
  "multi_transform": lambda: optax.multi_transform(
    {"t": optax.adam(1e-3), "f": optax.sgd(0.1, momentum=0.5)},
    jax.tree.map(lambda t: "t" if t else "f", _TRAIN),
  ),
  "chain_clip": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
}
_JR_HANDLER = "jaxreshard._src.orbax.handler.ReshardCheckpointHandler"  # as orbax records it
W = 5  # the source world size; targets 3 and 8 (8 ranks over 1, 3 or 4 elements: all padding)


def _run(*args):
  result = CliRunner().invoke(app, [str(a) for a in args])
  assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
  return result


def _ok(result):
  assert result.exit_code == 0, result.output
  return result


def _one_line_error(result):
  """The one error line of a refusal (after the line that says which orbax step and
  item a run directory gave, if any); nothing on stdout."""
  assert result.exit_code == EXIT_ERROR, result.output
  lines = result.stderr.strip().splitlines()
  errors = [line for line in lines if line.startswith("jaxreshard: error: ")]
  assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
  assert all(": step " in line for line in lines[:-1]), result.stderr
  assert "Traceback" not in result.output and result.stdout == ""
  return errors[0]


def _leftovers(path):
  parent, name = os.path.split(os.fspath(path))
  return [e for e in os.listdir(parent) if e == name or e.startswith(f".{name}.tmp-")]


def _state(opt, seed=0, flip=False):
  """``opt.init(PARAMS)`` with every history buffer (0-d ones included) random bits,
  NaN payloads, infinities, -0.0 and subnormals up front, the integer clock at 1234.
  ``flip``: the same state with the lowest bit of every history element flipped (a
  state that differs from it in every element)."""
  state = standard(opt.init, PARAMS)
  roles = _structure.history_roles(opt, PARAMS, state)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  rng = np.random.default_rng(seed)
  out = []
  for x, role in zip(leaves, roles, strict=True):
    if role is None:
      floating = jnp.issubdtype(x.dtype, jnp.floating)
      out.append(x if floating else jnp.asarray(1234, x.dtype))
      continue
    a = random_bits_array(rng, x.shape, x.dtype).reshape(-1)
    sv = special_values(x.dtype)
    a[: min(a.size, sv.size)] = sv[: a.size]
    if flip:
      a = (bits(a) ^ 1).view(a.dtype)
    out.append(jnp.asarray(a.reshape(x.shape)))
  return jax.tree_util.tree_unflatten(treedef, out)


def _histories(opt, state):
  """The key paths of ``state``'s history buffers."""
  roles = _structure.history_roles(opt, PARAMS, state)
  paths = jax.tree_util.tree_flatten_with_path(state)[0]
  return {
    jax.tree_util.keystr(p) for (p, _), role in zip(paths, roles, strict=True) if role is not None
  }


def _with_f64_learning_rate(state):
  """inject_hyperparams' learning rate as a float64 that float32 cannot hold (x64 on)."""
  with jax.enable_x64(True):
    hp = dict(state.hyperparams, learning_rate=jnp.asarray(1e-3 + 2**-40, jnp.float64))
  return state._replace(hyperparams=hp)


def _by_path(tree):
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_oracle(record, full, world_size, rank, what):
  """``record`` is target rank ``rank`` of ``world_size``: every history buffer the
  oracle's slice of ``full``'s buffer at its key path, every clock scalar ``full``'s,
  dtypes and bits included."""
  want = _by_path(full)
  leaves = jax.tree_util.tree_flatten_with_path(record.state)[0]
  assert sorted(want) == sorted(jax.tree_util.keystr(p) for p, _ in leaves), what
  for (path, leaf), role in zip(leaves, record.roles, strict=True):
    key = jax.tree_util.keystr(path)
    expected = np.asarray(want[key])
    if role is not None:
      expected = oracle_shard(expected, world_size, rank)
    got = np.asarray(leaf)
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape), (what, key)
    assert np.array_equal(bits(got), bits(expected)), (what, key, rank)
  assert all((p.rank, p.world_size) == (rank, world_size) for p in record.placements), what


def _assert_mesh_oracle(state, full, histories, world_size, what):
  """A state laid out on a mesh of ``world_size``: every history (``histories``: their
  key paths) the oracle's slices of ``full``'s buffer in rank order, every clock
  scalar ``full``'s."""
  want = _by_path(full)
  assert sorted(want) == sorted(_by_path(state)), what
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    key = jax.tree_util.keystr(path)
    expected, got = np.asarray(want[key]), np.asarray(leaf)
    if key in histories:
      expected = np.concatenate([oracle_shard(expected, world_size, r) for r in range(world_size)])
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape), (what, key)
    assert np.array_equal(bits(got), bits(expected)), (what, key)


# --- 1. the same state through every path: the oracle's bits --------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_path_gives_the_oracles_bits(tmp_path, name):
  """One state saved three ways (``save_records``; a manager's ``ReshardSave`` of the
  records and of the state on a 5-device mesh, as two items of one step) comes back
  from every path as the oracle's flat shards for 3 and 8 target ranks; ``verify``
  says identical between all of them and their reshards, parts and merges."""
  opt = OPTIMIZERS[name]()
  state = _state(opt)
  x64 = name == "adamw_inject_f64"
  if x64:
    state = _with_f64_learning_rate(state)
  with jax.enable_x64(x64):
    records = jr.shard_state(opt, PARAMS, state, world_size=W)
    jr.save_records(tmp_path / "ck", records)
    mesh = jax.make_mesh((W,), ("fsdp",), devices=jax.devices()[:W])
    laid = jr.shard_to_mesh(opt, PARAMS, state, mesh, "fsdp")
    with ocp.CheckpointManager(tmp_path / "run", item_names=("rec", "mesh")) as manager:
      manager.save(
        1,
        args=ocp.args.Composite(
          rec=jr.ReshardSave(records),
          mesh=jr.ReshardSave(
            state=laid.state, optimizer=opt, params=PARAMS, mesh=mesh, axis="fsdp"
          ),
        ),
      )
      manager.wait_until_finished()
  # Read without x64: the float64 clock scalar keeps its dtype and bits everywhere.
  sources = {
    "ck": (tmp_path / "ck", ()),
    "rec": (tmp_path / "run" / "1" / "rec", ("--item", "rec")),
    "mesh": (tmp_path / "run" / "1" / "mesh", ("--item", "mesh")),
  }
  for key, (path, _) in sources.items():
    for r, record in enumerate(jr.load_records(path)):
      _assert_oracle(record, state, W, r, (key, "load_records"))
    assert _ok(_run("verify", tmp_path / "ck", path)).stdout.startswith("identical: 8 params")

  for m in (3, 8):
    for key, (path, item) in sources.items():
      loaded = jr.load_records(path)
      for r in range(m):
        _assert_oracle(jr.restore(path, world_size=m, rank=r), state, m, r, (key, "restore"))
        got = jr.reshard(loaded, jr.plan(loaded, world_size=m, rank=r))
        _assert_oracle(got, state, m, r, (key, "reshard"))
      for r, got in enumerate(jr.restore_ranks(path, range(m), world_size=m)):
        _assert_oracle(got, state, m, r, (key, "restore_ranks"))
      # The command line, from the plain checkpoint or from the manager's run directory.
      src = path if key == "ck" else tmp_path / "run"
      out = tmp_path / f"{key}{m}"
      _ok(_run("reshard", src, out, "-w", m, *item))
      for r, got in enumerate(jr.load_records(out)):
        _assert_oracle(got, state, m, r, (key, "cli reshard", m))
      assert _ok(_run("verify", src, out, *item)).stdout.startswith("identical: 8 params")
      if (key, m) not in (("ck", 3), ("mesh", 8), ("rec", 8)):
        continue  # (a part per target rank is one run each: a few suffice)
      parts = [tmp_path / f"{key}{m}.{r}" for r in range(m)]
      for r, part in enumerate(parts):
        _ok(_run("reshard", src, part, "-w", m, "-r", r, *item))
        (got,) = jr.load_records(part)
        _assert_oracle(got, state, m, r, (key, "cli reshard --rank", m))
      merged = tmp_path / f"{key}{m}.merged"
      _ok(_run("merge", merged, *reversed(parts)))
      for r, got in enumerate(jr.load_records(merged)):
        _assert_oracle(got, state, m, r, (key, "cli merge", m))
      assert _ok(_run("verify", src, merged, *item)).stdout.startswith("identical: 8 params")

    mesh_m = jax.make_mesh((m,), ("fsdp",), devices=jax.devices()[:m])
    with ocp.CheckpointManager(tmp_path / "run", item_names=("rec", "mesh")) as manager:
      for item in ("rec", "mesh"):

        def restore(item=item, **kwargs):
          args = ocp.args.Composite(**{item: jr.ReshardRestore(**kwargs)})
          return manager.restore(1, args=args)[item]

        for r, got in enumerate(restore()):
          _assert_oracle(got, state, W, r, (item, "manager, every archive"))
        for r in range(m):
          got = restore(world_size=m, rank=r)
          _assert_oracle(got, state, m, r, (item, "manager, one rank"))
        on_mesh = restore(mesh=mesh_m, axis="fsdp")
        _assert_mesh_oracle(on_mesh, state, _histories(opt, state), m, (item, "manager mesh"))


@pytest.mark.filterwarnings("error")
def test_verify_names_the_one_element_that_differs_and_every_path_shows_it(tmp_path):
  """Two checkpoints of states that differ in two elements of a bf16 buffer (a NaN's
  payload, a random element's lowest bit): ``verify`` exits 1 naming the param, the
  buffer and the first element with its bits, and warns of nothing (its bfloat16 NaN
  cast to float64 printed numpy's RuntimeWarning, with a line of its source, on
  stderr); each restore gives its own state's oracle bits."""
  opt = optax.adam(1e-3)
  state = _state(opt)
  mu = state[0].mu
  other = np.asarray(mu["x.y"]).copy()
  assert other.view(np.uint16)[2] == 0x7F81  # a NaN (special_values)
  other.view(np.uint16)[2] ^= 0x0002  # another NaN: only its payload changes
  other.view(np.uint16)[12] ^= 0x0001  # a random element's lowest bit
  changed = (state[0]._replace(mu=dict(mu, **{"x.y": jnp.asarray(other)})),) + tuple(state[1:])
  jr.save_records(tmp_path / "a", jr.shard_state(opt, PARAMS, state, world_size=W))
  jr.save_records(tmp_path / "b", jr.shard_state(opt, PARAMS, changed, world_size=3))
  result = _run("verify", tmp_path / "a", tmp_path / "b")
  assert result.exit_code == EXIT_DIFFERENT, result.output
  assert result.stdout.startswith("different: 1 difference: 1 of 16 buffers (1 param)")
  assert re.search(
    r"param 'x\.y' buffer 0: bits differ in 2 of 13 elements, first \[2\]: nan\(0x7f81\) !="
    r" nan\(0x7f83\)",
    result.stdout,
  ), result.stdout
  for r in range(3):
    a, b = (jr.restore(tmp_path / n, world_size=3, rank=r) for n in "ab")
    _assert_oracle(a, state, 3, r, "a")
    _assert_oracle(b, changed, 3, r, "b")


# --- 2. hostile checkpoints: every path refuses alike, none returns other bits --------


def _flip(path, at):
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    data[at] ^= 0x01
    f.seek(0)
    f.write(data)


def _truncate(path, n=1):
  os.truncate(path, os.path.getsize(path) - n)


def _replace_dir(src, dst):
  shutil.rmtree(dst)
  shutil.copytree(src, dst)


def _rename_param(root):
  """The param "0" renamed "1" in the index, re-signed with every archive.json agreeing."""
  index = read_json(os.path.join(root, "jaxreshard.json"))
  for entry in index["params"]:
    if entry[0] == "0":
      entry[0] = "1"
  write_consistent_index(root, index)


def _swap_archives(root):
  a, b = (os.path.join(root, f"archive_{i:05d}") for i in (1, 2))
  os.rename(a, a + ".x")
  os.rename(b, a)
  os.rename(a + ".x", b)


# name: (edit(checkpoint, others), error type, words every whole read's refusal holds).
# ``others``: the paths of the same records saved again, of other values and of
# another step (same shapes, keys and world size).
HOSTILE = {
  "flipped_f32_chunk_byte": (
    lambda d, o: _flip(os.path.join(d, "archive_00001", "float32", "c", "0"), 3),
    jr.ArchiveError,
    r"archive 1 .*archive_00001/float32/c/0: chunk \d+ fails its crc32c check",
  ),
  "flipped_bf16_chunk_byte_of_the_last_archive": (
    lambda d, o: _flip(os.path.join(d, "archive_00004", "bfloat16", "c", "0"), 0),
    jr.ArchiveError,
    r"archive 4 .*archive_00004/bfloat16/c/0: chunk \d+ fails its crc32c check",
  ),
  "flipped_shard_index_byte": (
    lambda d, o: _flip(os.path.join(d, "archive_00000", "float32", "c", "0"), -3),
    jr.ArchiveError,
    r"archive 0 .*: the shard index fails its crc32c",
  ),
  "flipped_index_byte": (
    lambda d, o: _flip(os.path.join(d, "jaxreshard.json"), 200),
    jr.ArchiveError,
    r"jaxreshard\.json fails its checksum",
  ),
  "flipped_archive_json_byte": (
    lambda d, o: _flip(os.path.join(d, "archive_00002", "archive.json"), -10),
    jr.ArchiveError,
    r"archive 2: .*archive\.json fails its checksum",
  ),
  "truncated_buffer_file": (
    lambda d, o: _truncate(os.path.join(d, "archive_00003", "float32", "c", "0")),
    jr.ArchiveError,
    r"archive 3 .*float32/c/0 has \d+ bytes but its metadata .* needs \d+",
  ),
  "truncated_index": (
    lambda d, o: _truncate(os.path.join(d, "jaxreshard.json"), 5),
    jr.ArchiveError,
    r"jaxreshard\.json fails its checksum",
  ),
  "archive_of_another_save_of_the_same_bits": (
    lambda d, o: _replace_dir(
      os.path.join(o["same"], "archive_00002"), os.path.join(d, "archive_00002")
    ),
    jr.ArchiveError,
    r"archive 2 \(.*\) belongs to checkpoint '[0-9a-f]{32}', not to this checkpoint",
  ),
  "archive_of_other_values": (
    lambda d, o: _replace_dir(
      os.path.join(o["other"], "archive_00002"), os.path.join(d, "archive_00002")
    ),
    jr.ArchiveError,
    r"archive 2 \(.*\) belongs to checkpoint '[0-9a-f]{32}', not to this checkpoint",
  ),
  "archive_of_another_step": (
    lambda d, o: _replace_dir(
      os.path.join(o["step"], "archive_00004"), os.path.join(d, "archive_00004")
    ),
    jr.ArchiveError,
    r"archive 4 \(.*\) belongs to checkpoint '[0-9a-f]{32}', not to this checkpoint",
  ),
  "buffer_directory_of_other_values": (
    lambda d, o: _replace_dir(
      os.path.join(o["other"], "archive_00001", "float32"),
      os.path.join(d, "archive_00001", "float32"),
    ),
    jr.ArchiveError,
    r"archive 1 .*archive_00001/float32/c/0: chunk \d+ fails its crc32c check",
  ),
  "index_of_another_save_of_the_same_bits": (
    lambda d, o: shutil.copy(
      os.path.join(o["same"], "jaxreshard.json"), os.path.join(d, "jaxreshard.json")
    ),
    jr.ArchiveError,
    r"archive 0 \(.*\) belongs to checkpoint '[0-9a-f]{32}', not to this checkpoint",
  ),
  "index_of_another_step": (
    lambda d, o: shutil.copy(
      os.path.join(o["step"], "jaxreshard.json"), os.path.join(d, "jaxreshard.json")
    ),
    jr.ArchiveError,
    r"archive 0 \(.*\) belongs to checkpoint '[0-9a-f]{32}', not to this checkpoint",
  ),
  "missing_archive": (
    lambda d, o: shutil.rmtree(os.path.join(d, "archive_00002")),
    jr.ArchiveError,
    r"archive 2: .*archive_00002 is missing",
  ),
  "renamed_archive": (
    lambda d, o: os.rename(os.path.join(d, "archive_00004"), os.path.join(d, "archive_00007")),
    jr.ArchiveError,
    r"archive 4: .*archive_00004 is missing",
  ),
  "missing_buffer_file": (
    lambda d, o: os.unlink(os.path.join(d, "archive_00002", "bfloat16", "c", "0")),
    jr.ArchiveError,
    r"archive_00002/bfloat16/c/0 is missing",
  ),
  "swapped_archives": (
    lambda d, o: _swap_archives(d),
    jr.ArchiveError,
    r"archive 1 \(.*/archive_00001\): archive\.json names archive 'archive_00002'",
  ),
  "renamed_param_resigned": (
    lambda d, o: _rename_param(d),
    jr.PlacementError,
    r"param '0': archive 0 holds a history for it but does not list it in its placements",
  ),
}


@pytest.fixture(scope="module")
def hostile_sources(tmp_path_factory):
  """Adam over ``PARAMS`` on 5 ranks, saved in 2-element chunks, as a plain checkpoint
  and as step 1 of a manager; the same records saved again, other values (every
  element differs) and another step, for the edits that mix saves."""
  root = tmp_path_factory.mktemp("hostile")
  opt = optax.adam(1e-3)
  state = _state(opt)
  records = jr.shard_state(opt, PARAMS, state, world_size=W)
  jr.save_records(root / "ck", records, chunk_bytes=8)
  jr.save_records(root / "same", records, chunk_bytes=8)
  jr.save_records(
    root / "other", jr.shard_state(opt, PARAMS, _state(opt, flip=True), world_size=W), chunk_bytes=8
  )
  step = (state[0]._replace(count=jnp.asarray(77, jnp.int32)),) + tuple(state[1:])
  jr.save_records(root / "step", jr.shard_state(opt, PARAMS, step, world_size=W), chunk_bytes=8)
  with ocp.CheckpointManager(root / "run") as manager:
    manager.save(1, args=jr.ReshardSave(records, chunk_bytes=8))
    manager.wait_until_finished()
  others = {k: os.fspath(root / k) for k in ("same", "other", "step")}
  return root, state, others


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_checkpoint_is_refused_alike_by_every_path(hostile_sources, tmp_path, case):
  """Every reader of the whole checkpoint (``load_records``, ``reshard`` of it,
  ``restore_ranks`` of every rank, ``digest``, ``restore_sharded``, a manager's
  restore of every archive and onto a mesh, ``jaxreshard reshard`` of the checkpoint
  and of the run, ``verify`` either way) refuses it with the same error and words;
  a reader of one target rank (``restore``, the manager's ``rank=``, ``reshard
  --rank``) refuses it or gives the oracle's bits, and reading every rank one by one
  refuses it somewhere. A refused ``reshard`` or ``merge`` leaves nothing."""
  root, state, others = hostile_sources
  edit, kind, words = HOSTILE[case]
  ck = tmp_path / "ck"
  shutil.copytree(root / "ck", ck)
  edit(os.fspath(ck), others)
  run = tmp_path / "run"
  shutil.copytree(root / "run", run)
  edit(os.fspath(run / "1" / "default"), others)
  m = 3
  mesh = jax.make_mesh((m,), ("fsdp",), devices=jax.devices()[:m])

  def manager_restore(**kwargs):
    with ocp.CheckpointManager(run) as manager:
      return manager.restore(1, args=jr.ReshardRestore(**kwargs))

  whole = {
    "load_records": lambda: jr.load_records(ck),
    "reshard of load_records": lambda: jr.reshard(
      jr.load_records(ck), jr.plan(jr.load_records(ck), world_size=m, rank=0)
    ),
    "restore_ranks": lambda: jr.restore_ranks(ck, range(m), world_size=m),
    "digest": lambda: jr.digest(ck),
    "restore_sharded": lambda: jr.restore_sharded(ck, mesh, "fsdp"),
    "manager, every archive": manager_restore,
    "manager, mesh": lambda: manager_restore(mesh=mesh, axis="fsdp"),
  }
  for name, call in whole.items():
    with pytest.raises(kind) as info:
      call()
    assert re.search(words, str(info.value)), (name, str(info.value))

  # A reader of one rank reads other archives first: the same words, maybe of another.
  any_archive = re.sub(r"archive \d|archive_0000\d", lambda x: x[0][:-1] + r"\d", words)
  refused = 0
  for r in range(m):
    for name, call in (
      ("restore", lambda r=r: jr.restore(ck, world_size=m, rank=r)),
      ("manager, one rank", lambda r=r: manager_restore(world_size=m, rank=r)),
    ):
      try:
        got = call()
      except kind as e:
        assert re.search(any_archive, str(e)), (name, r, str(e))
        refused += 1
      else:
        _assert_oracle(got, state, m, r, (name, r))
    part = tmp_path / f"part{r}"
    result = _run("reshard", ck, part, "-w", m, "-r", r)
    if result.exit_code:
      assert re.search(any_archive, _one_line_error(result)), (r, result.stderr)
      assert _leftovers(part) == []
    else:
      (got,) = jr.load_records(part)
      _assert_oracle(got, state, m, r, ("reshard --rank", r))
  assert refused, "no target rank's restore read the damage"

  for args, out in (
    (("reshard", ck, tmp_path / "o", "-w", m), tmp_path / "o"),
    (("reshard", run, tmp_path / "orun", "-w", m), tmp_path / "orun"),
    (("verify", ck, root / "ck"), None),
    (("verify", root / "ck", ck), None),
    (("verify", run, root / "ck"), None),
  ):
    line = _one_line_error(_run(*args))
    assert re.search(words, line), (args, line)
    if out is not None:
      assert _leftovers(out) == []
  assert not all((tmp_path / f"part{r}").exists() for r in range(m)), "no part read the damage"


def test_what_no_reader_reads_changes_no_path(hostile_sources, tmp_path):
  """Files the index does not list (an archive directory past the last, a file or a
  dtype directory the layout does not name) are never read: every path gives the
  oracle's bits, and a copy of a buffer file of another save of the same bits is
  those bits."""
  root, state, others = hostile_sources
  ck = tmp_path / "ck"
  shutil.copytree(root / "ck", ck)
  shutil.copytree(os.path.join(others["other"], "archive_00004"), ck / "archive_00005")
  (ck / "archive_00001" / "notes.txt").write_text("x")
  shutil.copytree(ck / "archive_00001" / "float32", ck / "archive_00001" / "float64")
  shutil.copy(
    os.path.join(others["same"], "archive_00003", "float16", "c", "0"),
    ck / "archive_00003" / "float16" / "c" / "0",
  )
  for r, got in enumerate(jr.load_records(ck)):
    _assert_oracle(got, state, W, r, "load_records")
  for r, got in enumerate(jr.restore_ranks(ck, range(3), world_size=3)):
    _assert_oracle(got, state, 3, r, "restore_ranks")
  _ok(_run("reshard", ck, tmp_path / "o", "-w", 3))
  for r, got in enumerate(jr.load_records(tmp_path / "o")):
    _assert_oracle(got, state, 3, r, "cli reshard")
  assert _ok(_run("verify", root / "ck", ck)).stdout.startswith("identical")


def test_a_dry_run_refuses_an_index_whose_archives_its_run_refuses(hostile_sources, tmp_path):
  """An index re-signed with a param renamed in its list of params only (every
  archive.json re-signed to agree): its archives' layouts hold a history of a param
  they do not list, which every reader refuses from the index alone, before any
  chunk is read. ``reshard --dry-run`` (of every rank, and of one) refused nothing
  and printed the plans of a run that is refused."""
  root, _, _ = hostile_sources
  ck = tmp_path / "ck"
  shutil.copytree(root / "ck", ck)
  _rename_param(ck)
  words = "param '0': archive 0 holds a history for it but does not list it in its placements"
  run_line = _one_line_error(_run("reshard", ck, tmp_path / "o", "-w", 3))
  assert words in run_line, run_line
  for extra in ((), ("-r", "0"), ("--json",), ("--reads",)):
    line = _one_line_error(_run("reshard", ck, tmp_path / "o", "-w", 3, "--dry-run", *extra))
    assert words in line, (extra, line)
  assert _leftovers(tmp_path / "o") == []


# --- 3. merge: parts that are not every rank of one reshard ----------------------------


@pytest.fixture(scope="module")
def merge_parts(tmp_path_factory):
  """Per-rank outputs (``reshard --rank``, 5 -> 3) of: a checkpoint, another save of
  the same records, other values, another step, the same checkpoint again (a second
  run of the job), a 4-rank target, and steps 1 and 2 of a manager run."""
  root = tmp_path_factory.mktemp("merge")
  opt = optax.adam(1e-3)
  state = _state(opt)
  records = jr.shard_state(opt, PARAMS, state, world_size=W)
  jr.save_records(root / "A", records)
  jr.save_records(root / "same", records)
  jr.save_records(root / "other", jr.shard_state(opt, PARAMS, _state(opt, flip=True), world_size=W))
  step = (state[0]._replace(count=jnp.asarray(77, jnp.int32)),) + tuple(state[1:])
  step_records = jr.shard_state(opt, PARAMS, step, world_size=W)
  jr.save_records(root / "step", step_records)
  with ocp.CheckpointManager(root / "run") as manager:
    manager.save(1, args=jr.ReshardSave(records))
    manager.save(2, args=jr.ReshardSave(step_records))
    manager.wait_until_finished()

  def parts(src, tag, m=3, extra=()):
    out = []
    for r in range(m):
      _ok(_run("reshard", src, root / f"{tag}{r}", "-w", m, "-r", r, *extra))
      out.append(root / f"{tag}{r}")
    return out

  p = dict(
    a=parts(root / "A", "a"),
    again=parts(root / "A", "again"),
    same=parts(root / "same", "same"),
    other=parts(root / "other", "other"),
    step=parts(root / "step", "step"),
    four=parts(root / "A", "four", m=4),
    run1=parts(root / "run", "run1_", extra=("--step", 1)),
    run2=parts(root / "run", "run2_", extra=("--step", 2)),
  )
  _ok(_run("reshard", root / "A", root / "whole", "-w", 3))
  return root, state, p


def _copy_with(root, part, name, fn):
  out = root / name
  if not out.exists():
    shutil.copytree(part, out)
    fn(out)
  return out


MERGE_REFUSED = {
  # name: (parts(root, p), words)
  "a_part_twice": (
    lambda root, p: [p["a"][0], p["a"][1], p["a"][1], p["a"][2]],
    r"/a1 is one part given twice; parts must hold disjoint ranks",
  ),
  "a_part_under_two_spellings": (
    lambda root, p: [p["a"][0], p["a"][1], root / "a0" / ".." / "a1", p["a"][2]],
    r"/a1 and .*/a0/\.\./a1 are one part given twice; parts must hold disjoint ranks",
  ),
  "a_copy_of_a_part": (
    lambda root, p: [
      p["a"][0],
      p["a"][1],
      _copy_with(root, p["a"][1], "a1copy", lambda d: None),
      p["a"][2],
    ],
    r"rank 1 of 3 is in both .*/a1 and .*/a1copy",
  ),
  "incomplete": (
    lambda root, p: [p["a"][0], p["a"][2]],
    r"ranks \[1\] of 3 are in none of the parts",
  ),
  "other_world_sizes": (
    lambda root, p: [p["a"][0], p["a"][1], p["four"][2], p["four"][3]],
    r".*/four2 has world size 4 but .*/a0 has 3; merge combines parts of one world size",
  ),
  "another_save_of_the_same_bits": (
    lambda root, p: [p["a"][0], p["same"][1], p["a"][2]],
    r".*/same1 was resharded from checkpoint [0-9a-f]{32} but .*/a0 from checkpoint"
    r" [0-9a-f]{32}; parts of two different saves are never merged",
  ),
  "other_values": (
    lambda root, p: [p["a"][0], p["other"][1], p["a"][2]],
    r".*/other1 was resharded from checkpoint [0-9a-f]{32} but .*/a0 from checkpoint",
  ),
  "another_step": (
    lambda root, p: [p["a"][0], p["step"][1], p["a"][2]],
    r".*/step1 has \[0\]\.count = 77 but .*/a0 has \[0\]\.count = 1234; parts of different steps",
  ),
  "two_steps_of_a_run": (
    lambda root, p: [p["run1"][0], p["run2"][1], p["run1"][2]],
    r".*/run2_1 has \[0\]\.count = 77 but .*/run1_0 has \[0\]\.count = 1234",
  ),
  "a_run_and_a_plain_save_of_the_same_bits": (
    lambda root, p: [p["run1"][0], p["a"][1], p["a"][2]],
    r".*/a1 was resharded from checkpoint [0-9a-f]{32} but .*/run1_0 from checkpoint",
  ),
  "a_whole_output_and_a_part": (
    lambda root, p: [root / "whole", p["a"][1]],
    r"rank 1 of 3 is in both .*/whole and .*/a1",
  ),
  "the_source_itself": (
    lambda root, p: [*p["a"], root / "A"],
    r".*/A names no checkpoint it was resharded from \(not an output of `jaxreshard reshard`\)",
  ),
  "an_archive_of_another_part": (
    lambda root, p: [
      p["a"][0],
      _copy_with(
        root,
        p["a"][1],
        "a1swapped",
        lambda d: _replace_dir(p["a"][2] / "archive_00000", d / "archive_00000"),
      ),
      p["a"][2],
    ],
    r"archive 0 \(.*/a1swapped/archive_00000\) belongs to checkpoint '[0-9a-f]{32}', not to"
    r" this checkpoint",
  ),
  "the_index_of_another_part": (
    lambda root, p: [
      p["a"][0],
      _copy_with(
        root,
        p["a"][1],
        "a1index",
        lambda d: shutil.copy(p["a"][2] / "jaxreshard.json", d / "jaxreshard.json"),
      ),
      p["a"][2],
    ],
    r"archive 0 \(.*/a1index/archive_00000\) belongs to checkpoint",
  ),
  "a_flipped_byte_in_the_last_part": (
    lambda root, p: [
      p["a"][0],
      p["a"][1],
      _copy_with(
        root,
        p["a"][2],
        "a2flipped",
        lambda d: _flip(d / "archive_00000" / "float32" / "c" / "0", 0),
      ),
    ],
    r"archive 0 .*/a2flipped/archive_00000/float32/c/0: chunk \d+ fails its crc32c check",
  ),
  "a_truncated_last_part": (
    lambda root, p: [
      p["a"][0],
      p["a"][1],
      _copy_with(
        root,
        p["a"][2],
        "a2truncated",
        lambda d: _truncate(d / "archive_00000" / "bfloat16" / "c" / "0"),
      ),
    ],
    r"archive 0 .*/a2truncated/archive_00000/bfloat16/c/0 has \d+ bytes but its metadata",
  ),
  "a_part_without_its_archive": (
    lambda root, p: [
      p["a"][0],
      _copy_with(root, p["a"][1], "a1empty", lambda d: shutil.rmtree(d / "archive_00000")),
      p["a"][2],
    ],
    r"archive 0: .*/a1empty/archive_00000 is missing",
  ),
}


@pytest.mark.parametrize("case", sorted(MERGE_REFUSED))
def test_merge_refuses_parts_that_are_not_one_reshard_naming_them(merge_parts, tmp_path, case):
  """Each refusal is one line, exit 2, naming the parts (or the part's file) at fault,
  with nothing left at OUT, in any order of the parts."""
  root, _, p = merge_parts
  make, words = MERGE_REFUSED[case]
  parts = make(root, p)
  for order in (parts, parts[::-1]):
    out = tmp_path / "out"
    line = _one_line_error(_run("merge", out, *order))
    if order is parts:
      assert re.search(words, line), line
    assert _leftovers(out) == [], line


def test_merge_of_parts_of_two_runs_of_one_reshard_is_the_oracle(merge_parts, tmp_path):
  """Parts of the same source checkpoint written by two runs of the job (a rank
  resharded again) are parts of one reshard: merged in any order they are the
  oracle's ranks, and a whole output merged alone is itself again."""
  root, state, p = merge_parts
  for name, parts in (
    ("mixed", [p["again"][2], p["a"][0], p["again"][1]]),
    ("whole", [root / "whole"]),
  ):
    _ok(_run("merge", tmp_path / name, *parts))
    for r, got in enumerate(jr.load_records(tmp_path / name)):
      _assert_oracle(got, state, 3, r, name)
    assert _ok(_run("verify", root / "A", tmp_path / name)).stdout.startswith("identical")


# --- verify reads weak clock scalars as numbers -----------------------------------------


def test_verify_reads_a_weak_clock_scalar_as_its_number_and_says_which_is_weak(tmp_path):
  """A weakly typed clock scalar (``jnp.asarray(0.1)``, as jax promotes an injected
  learning rate) is compared by value: ``verify`` printed its raw bytes in memory
  order (``float32() weak 0xcdcccc3d``) beside the other's number, never the value."""
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  params = {"w": jnp.zeros((5,))}
  state = opt.init(params)

  def save(name, lr):
    changed = state._replace(hyperparams=dict(state.hyperparams, learning_rate=lr))
    jr.save_records(tmp_path / name, jr.shard_state(opt, params, changed, world_size=2))

  save("strong", jnp.asarray(0.1, jnp.float32))
  save("weak", jnp.asarray(0.1))
  save("weak2", jnp.asarray(0.2))
  assert jnp.asarray(0.1).weak_type
  for a, b, words in (
    ("strong", "weak", "scalar .hyperparams['learning_rate']: 0.1 (not weak) != 0.1 (weak)"),
    ("weak", "weak2", "scalar .hyperparams['learning_rate']: 0.1 != 0.2 (both weak)"),
  ):
    result = _run("verify", tmp_path / a, tmp_path / b)
    assert result.exit_code == EXIT_DIFFERENT, result.output
    assert words in result.stdout, result.stdout
  assert _ok(_run("verify", tmp_path / "weak", tmp_path / "weak")).stdout.startswith("identical")


def test_inspect_says_which_clock_scalars_are_weak_as_verify_does(tmp_path):
  """``inspect`` showed a weak and a strong learning rate alike, in its table and its
  JSON, while ``verify`` and the digest tell them apart."""
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  params = {"w": jnp.zeros((5,))}
  state = opt.init(params)
  for name, lr in (("strong", jnp.asarray(0.1, jnp.float32)), ("weak", jnp.asarray(0.1))):
    changed = state._replace(hyperparams=dict(state.hyperparams, learning_rate=lr))
    jr.save_records(tmp_path / name, jr.shard_state(opt, params, changed, world_size=2))
    clocks = {
      c["path"]: c
      for c in json.loads(_ok(_run("inspect", tmp_path / name, "--json")).stdout)["clocks"]
    }
    assert clocks[".hyperparams['learning_rate']"]["weak"] is (name == "weak")
    assert clocks[".count"]["weak"] is False  # optax's own count: an int32 array
    rows = [
      l for l in _ok(_run("inspect", tmp_path / name)).stdout.splitlines() if "learning_rate" in l
    ]
    dtype = [l.split("│")[2].strip() for l in rows]
    assert dtype == (["float32 (weak)"] if name == "weak" else ["float32"]), rows


# --- the latest step of a run: the manager's and the command line's -------------------


@pytest.mark.parametrize("damage", ["index", "item"])
def test_a_run_whose_latest_step_lost_its_item_is_refused_not_read_at_an_older_step(
  tmp_path, damage
):
  """The latest step's jaxreshard item lost its index (or the whole item directory):
  the manager's ``latest_step()`` is still that step and its restore refuses it. The
  command line took the latest step that still held an index instead, reading and
  resharding step 1 as the run's latest ("step 1 (of 1)") with exit code 0: an older
  optimizer state than the params orbax restores from step 2."""
  opt = optax.adam(1e-3)
  states = {s: _state(opt, seed=s) for s in (1, 2)}
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    for s, state in states.items():
      manager.save(s, args=jr.ReshardSave(jr.shard_state(opt, PARAMS, state, world_size=W)))
    manager.wait_until_finished()
  item = tmp_path / "run" / "2" / "default"
  if damage == "index":
    os.unlink(item / "jaxreshard.json")
  else:
    shutil.rmtree(item)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    assert manager.latest_step() == 2
    if damage == "index":
      with pytest.raises(jr.ArchiveError, match="is not a jaxreshard checkpoint"):
        manager.restore(2, args=jr.ReshardRestore(world_size=3, rank=0))
  words = (
    f"step 2 is later than step 1, and orbax recorded jaxreshard item 'default' in it,"
    f" but {item} holds no jaxreshard.json (the step is damaged); give --step 1"
  )
  good = tmp_path / "good"
  jr.save_records(good, jr.shard_state(opt, PARAMS, states[1], world_size=W))
  for args, out in (
    (("inspect", tmp_path / "run"), None),
    (("reshard", tmp_path / "run", tmp_path / "o", "-w", 3), tmp_path / "o"),
    (("reshard", tmp_path / "run", tmp_path / "o", "-w", 3, "-r", 1), tmp_path / "o"),
    (("reshard", tmp_path / "run", tmp_path / "o", "-w", 3, "--dry-run"), None),
    (("verify", tmp_path / "run", good), None),
    (("verify", good, tmp_path / "run"), None),
    (("merge", tmp_path / "o", tmp_path / "run"), tmp_path / "o"),
  ):
    line = _one_line_error(_run(*args))
    assert words in line, (args, line)
    if out is not None:
      assert _leftovers(out) == []
  # The step named: read as it is.
  _ok(_run("reshard", tmp_path / "run", tmp_path / "o", "-w", 3, "--step", 1))
  for r, got in enumerate(jr.load_records(tmp_path / "o")):
    _assert_oracle(got, states[1], 3, r, "--step 1")
  assert _ok(_run("verify", tmp_path / "run", good, "--step", 1)).stdout.startswith("identical")


@pytest.mark.parametrize(
  "metadata",
  [
    "fifo",
    "garbage",
    "link",
    "other_handler",
    "similar_handler",
    "deep",
    "list",
    "handlers_str",
    "huge",
    "odd_names",
  ],
)
def test_a_later_step_without_a_jaxreshard_item_leaves_the_latest_one_read(tmp_path, metadata):
  """A later step that holds no jaxreshard item (orbax's metadata naming another
  handler, one whose name ends as jaxreshard's among them, or metadata that is no
  JSON, a FIFO or a link) is not a damaged step of
  the run: the latest step with a jaxreshard item is read, and nothing blocks."""
  opt = optax.adam(1e-3)
  state = _state(opt)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(jr.shard_state(opt, PARAMS, state, world_size=W)))
    manager.wait_until_finished()
  later = tmp_path / "run" / "2"
  (later / "default").mkdir(parents=True)
  meta = later / "_CHECKPOINT_METADATA"
  if metadata == "fifo":
    os.mkfifo(meta)
  elif metadata == "garbage":
    meta.write_bytes(b"\xff{" * 100)
  elif metadata == "link":
    os.symlink(tmp_path / "run" / "1" / "_CHECKPOINT_METADATA", meta)
  elif metadata == "other_handler":
    meta.write_text('{"item_handlers": {"default": "orbax.JsonCheckpointHandler"}}')
  elif metadata == "similar_handler":  # other handlers whose names end as jaxreshard's
    others = ["mylib.NotAReshardCheckpointHandler", "mylib.ReshardCheckpointHandler"]
    others += ["ReshardCheckpointHandler", "jaxreshardx.ReshardCheckpointHandler"]
    meta.write_text(json.dumps({"item_handlers": {f"i{k}": h for k, h in enumerate(others)}}))
  elif metadata == "deep":  # nesting past Python's recursion limit
    meta.write_bytes(b"[" * 100_000 + b"]" * 100_000)
  elif metadata == "list":
    meta.write_text(f'[{{"item_handlers": {{"default": "{_JR_HANDLER}"}}}}]')
  elif metadata == "handlers_str":
    meta.write_text(f'{{"item_handlers": "{_JR_HANDLER}"}}')
  elif metadata == "huge":  # orbax's JSON, then more than is ever read
    meta.write_text(f'{{"item_handlers": {{"default": "{_JR_HANDLER}"}}}}' + " " * (2 << 20))
  else:  # names that are no item of the step: the run directory, an absolute path, ...
    names = ["..", ".", "", "/", os.fspath(tmp_path), "1/default", "a\x00b"]
    meta.write_text(json.dumps({"item_handlers": {n: _JR_HANDLER for n in names}}))
  _ok(_run("reshard", tmp_path / "run", tmp_path / "o", "-w", 3))
  for r, got in enumerate(jr.load_records(tmp_path / "o")):
    _assert_oracle(got, state, 3, r, metadata)


def _two_step_run(run) -> optax.GradientTransformation:
  """A manager's run of steps 1 and 2 (Adam states of seeds 1 and 2); its optimizer."""
  opt = optax.adam(1e-3)
  with ocp.CheckpointManager(run) as manager:
    for s in (1, 2):
      manager.save(
        s, args=jr.ReshardSave(jr.shard_state(opt, PARAMS, _state(opt, s), world_size=W))
      )
    manager.wait_until_finished()
  return opt


def test_a_later_step_whose_jaxreshard_item_is_a_link_is_refused_not_passed_over(tmp_path):
  """The latest step's recorded jaxreshard item is a symbolic link (to a whole
  checkpoint): orbax's ``latest_step()`` is that step and its restore follows the
  link; the command line never takes a link inside a run, so it must refuse the
  run, not read step 1 as the run's latest."""
  _two_step_run(tmp_path / "run")
  item = tmp_path / "run" / "2" / "default"
  os.rename(item, tmp_path / "elsewhere")
  os.symlink(tmp_path / "elsewhere", item)
  line = _one_line_error(_run("inspect", tmp_path / "run"))
  assert "step 2 is later than step 1" in line and f"{item} is a symbolic link" in line, line
  _ok(_run("inspect", tmp_path / "run", "--step", 1))


def test_a_later_step_that_is_a_link_is_refused_not_passed_over(tmp_path):
  """The latest step's directory is a symbolic link (to a step kept elsewhere):
  orbax's ``latest_step()`` follows it, the command line never takes a link inside a
  run, so it must refuse the run, not read step 1 as the run's latest. (Before: it
  read step 1.) A later link to a directory holding no jaxreshard item is passed over,
  as such a directory is; the link itself given as the path is read."""
  opt = _two_step_run(tmp_path / "run")
  step = tmp_path / "run" / "2"
  os.rename(step, tmp_path / "kept")
  os.symlink(tmp_path / "kept", step)
  (tmp_path / "other").mkdir()
  os.symlink(tmp_path / "other", tmp_path / "run" / "3")
  line = _one_line_error(_run("inspect", tmp_path / "run"))
  assert f"step 2 is later than step 1, and {step} is a symbolic link" in line, line
  assert "give --step 1 to read step 1" in line, line
  _ok(_run("inspect", tmp_path / "run", "--step", 1))
  _ok(_run("reshard", step, tmp_path / "o", "-w", 3))
  for r, got in enumerate(jr.load_records(tmp_path / "o")):
    _assert_oracle(got, _state(opt, 2), 3, r, "step 2 through the link given")


def test_a_step_that_lost_one_of_its_two_jaxreshard_items_is_refused_without_item(tmp_path):
  """A step of two jaxreshard items ('a', 'b') is read only with ``--item``; once 'b'
  lost its index the command line took 'a' as the step's one item, where the
  manager's restore of the step refuses it (a damaged step read as a healthy one)."""
  opt = optax.adam(1e-3)
  with ocp.CheckpointManager(tmp_path / "run", item_names=("a", "b")) as manager:
    for s in (1, 2):
      records = jr.shard_state(opt, PARAMS, _state(opt, s), world_size=W)
      manager.save(s, args=ocp.args.Composite(a=jr.ReshardSave(records), b=jr.ReshardSave(records)))
    manager.wait_until_finished()
  os.unlink(tmp_path / "run" / "2" / "b" / "jaxreshard.json")
  words = "orbax recorded jaxreshard item 'b' in it"
  for args in ((tmp_path / "run",), (tmp_path / "run", "--step", 2), (tmp_path / "run" / "2",)):
    line = _one_line_error(_run("inspect", *args))
    assert words in line and "holds no jaxreshard.json" in line, (args, line)
  _ok(_run("inspect", tmp_path / "run", "--item", "a"))
  assert "holds 2 jaxreshard items" in _one_line_error(
    _run("inspect", tmp_path / "run", "--step", 1)
  )


def test_item_given_a_later_step_that_lost_another_item_is_refused_as_a_healthy_one_is(tmp_path):
  """``--item a`` where the latest step holds only a jaxreshard item 'b': the run is
  refused (step 2 has no item 'a'). Once 'b' lost its index, the command line read
  'a' at step 1 instead: a damaged step made the path laxer than a healthy one."""
  opt = optax.adam(1e-3)
  records = jr.shard_state(opt, PARAMS, _state(opt), world_size=W)
  for run in ("healthy", "damaged"):
    with ocp.CheckpointManager(tmp_path / run, item_names=("a", "b")) as manager:
      manager.save(1, args=ocp.args.Composite(a=jr.ReshardSave(records), b=jr.ReshardSave(records)))
      manager.save(2, args=ocp.args.Composite(b=jr.ReshardSave(records)))
      manager.wait_until_finished()
  assert "has no item 'a'" in _one_line_error(_run("inspect", tmp_path / "healthy", "--item", "a"))
  os.unlink(tmp_path / "damaged" / "2" / "b" / "jaxreshard.json")
  line = _one_line_error(_run("inspect", tmp_path / "damaged", "--item", "a"))
  assert "step 2 is later than step 1, and orbax recorded jaxreshard item 'b'" in line, line
  _ok(_run("inspect", tmp_path / "damaged", "--item", "a", "--step", 1))
