"""Archives a reader reads no byte of: every reader checks what the index says of them.

A state of clock scalars alone (``inject_hyperparams(sgd)`` without momentum), one
whose params all have zero elements, and a frozen group placed on ranks of its own
leave archives with an ``archive.json`` and no buffer; an index edited and
re-signed on its own can leave others unread (a group relabelled with another's
layout has no history to read). The record a restore builds still takes their
placements, and its skeleton and clock, from the index: their signed
``archive.json`` must vouch for it. Each target rank checks the first archive of
each group and its share of each group's archives (a process among all, in a
restore onto a mesh), so a restore of every target rank, like ``load_records``
and ``verify``, finds any of them damaged, and such an edit is refused on every
path.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.cli.commands import EXIT_ERROR, app
from tests._archive_util import read_json, write_signed_json
from tests._core_util import assert_records_equal, device_mesh


def _filled(state):
  """Every float leaf of ``state`` set to distinct non-zero values (a trained state)."""
  leaves, treedef = jax.tree_util.tree_flatten(state)
  out = []
  for i, x in enumerate(leaves):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
      x = (jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) + 0.5 + i).astype(x.dtype)
    out.append(x)
  return jax.tree_util.tree_unflatten(treedef, out)


def _clock_only():
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
  params = {"w": jnp.ones((6,))}
  return opt, params, jr.shard_state(opt, params, opt.init(params), world_size=4)


def _zero_size():
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.5)
  params = {"z": jnp.ones((0,))}
  return opt, params, jr.shard_state(opt, params, opt.init(params), world_size=4)


def _frozen_apart():
  """A frozen backbone over 3 ranks of its own (archives 0-2, no byte), the head over 2."""
  params = {"backbone": {"w": jnp.ones((7, 3))}, "head": {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}}
  opt = optax.multi_transform(
    {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()},
    {"backbone": "frozen", "head": "train"},
  )
  records = jr.shard_state(opt, params, _filled(opt.init(params)), world_size=4)
  shape = {p.param: p.shape for p in records[0].placements}
  every = tuple(range(4))
  out = [
    jr.reshard(records, [jr.Migration("backbone/w", shape["backbone/w"], r, 3, every)])
    for r in range(3)
  ]
  for r in range(2):
    out.append(
      jr.reshard(records, [jr.Migration(p, shape[p], r, 2, every) for p in ("head/b", "head/w")])
    )
  return opt, params, out


STATES = {"clock_only": _clock_only, "zero_size": _zero_size, "frozen_apart": _frozen_apart}


def _saved(tmp_path, name):
  opt, params, records = STATES[name]()
  path = tmp_path / "ckpt"
  jr.save_records(path, records)
  empty = [
    a for a in range(len(records)) if os.listdir(path / f"archive_{a:05d}") == ["archive.json"]
  ]
  assert empty, "the state leaves an archive without a buffer"
  return opt, params, records, path, empty


def _readers(path, opt, params, tmp_path):
  """Every reader of a whole world of target ranks: name -> a call returning its records
  (or a state), each run on its own."""
  mesh = device_mesh((3,), ("fsdp",))
  target = jax.tree.map(
    lambda x: (
      x
      if isinstance(x, optax.MaskedNode)
      else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
    ),
    jax.eval_shape(opt.init, params),
    is_leaf=lambda x: isinstance(x, optax.MaskedNode),
  )

  def cli():
    out = tmp_path / "cli-out"
    shutil.rmtree(out, ignore_errors=True)
    result = CliRunner().invoke(app, ["reshard", str(path), str(out), "-w", "3"])
    if result.exit_code == EXIT_ERROR:
      raise jr.ReshardError(result.stderr)
    assert result.exit_code == 0, result.output
    return jr.load_records(out)

  return {
    "load_records": lambda: jr.load_records(path),
    "restore_ranks 2": lambda: jr.restore_ranks(path, range(2), world_size=2),
    "restore_ranks 3": lambda: jr.restore_ranks(path, range(3), world_size=3),
    "restore_ranks 5": lambda: jr.restore_ranks(path, range(5), world_size=5),
    "restore_sharded": lambda: jr.restore_sharded(path, mesh, "fsdp"),
    "restore_sharded target": lambda: jr.restore_sharded(path, mesh, "fsdp", target=target),
    "CLI reshard": cli,
  }


def _outcomes(calls):
  """Each call's refusal (its message), or None where it returned."""
  out = {}
  for name, call in calls.items():
    try:
      call()
    except jr.ReshardError as e:
      out[name] = str(e)
    else:
      out[name] = None
  return out


def _refusals(path, opt, params, tmp_path):
  return _outcomes(_readers(path, opt, params, tmp_path))


@pytest.mark.parametrize("name", sorted(STATES))
def test_an_undamaged_checkpoint_restores_as_memory_reshards_it(tmp_path, name):
  opt, params, records, path, _ = _saved(tmp_path, name)
  for world in (2, 3, 5):
    want = jr.reshard_ranks(
      records, [jr.plan(records, world_size=world, rank=r) for r in range(world)]
    )
    got = jr.restore_ranks(path, range(world), world_size=world)
    for g, w in zip(got, want, strict=True):
      assert_records_equal(g, w)
  for name_, read in _readers(path, opt, params, tmp_path).items():
    assert read() is not None, name_


@pytest.mark.parametrize("damage", ["archive.json removed", "archive.json cut", "archive removed"])
@pytest.mark.parametrize("name", sorted(STATES))
def test_a_damaged_archive_without_bytes_is_found_by_every_reader_of_a_world(
  tmp_path, name, damage
):
  opt, params, _, path, empty = _saved(tmp_path, name)
  victim = path / f"archive_{empty[-1]:05d}"
  if damage == "archive removed":
    shutil.rmtree(victim)
  elif damage == "archive.json removed":
    os.remove(victim / "archive.json")
  else:
    raw = (victim / "archive.json").read_bytes()
    (victim / "archive.json").write_bytes(raw[: len(raw) // 2])
  outcomes = _refusals(path, opt, params, tmp_path)
  silent = [reader for reader, msg in outcomes.items() if msg is None]
  assert not silent, f"{silent} read past archive {empty[-1]} ({damage})"
  for reader, msg in outcomes.items():
    assert f"archive {empty[-1]}" in msg, (reader, msg)


def _clock_edit(index):
  """learning_rate 0.5 -> 0.25 in the index's clock scalars (float32 bits, base64)."""
  text = json.dumps(index)
  assert text.count('"AAAAPw=="') == 1, text[:400]  # 0.5: 0x3f000000, little-endian
  index.update(json.loads(text.replace('"AAAAPw=="', '"AACAPg=="')))


def _shape_edit(index):
  """The frozen backbone's (7, 3) -> (3, 7): the same slots, no byte of it anywhere."""
  (entry,) = [e for e in index["params"] if e[0] == "backbone/w"]
  assert entry[1] == [7, 3]
  entry[1] = [3, 7]


@pytest.mark.parametrize(
  "name, edit",
  [("clock_only", _clock_edit), ("zero_size", _clock_edit), ("frozen_apart", _shape_edit)],
)
def test_an_index_re_signed_on_its_own_is_refused_by_every_reader(tmp_path, name, edit):
  opt, params, _, path, _ = _saved(tmp_path, name)
  index = read_json(path / "jaxreshard.json")
  edit(index)
  write_signed_json(path / "jaxreshard.json", index)
  outcomes = _refusals(path, opt, params, tmp_path)
  # One target rank alone reads no byte either: its template archive and its share vouch.
  outcomes |= _outcomes(
    {f"restore rank {r}": (lambda r=r: jr.restore(path, world_size=3, rank=r)) for r in range(3)}
  )
  silent = [reader for reader, msg in outcomes.items() if msg is None]
  assert not silent, f"{silent} returned what the edited index says"
  for reader, msg in outcomes.items():
    assert "the index does not describe this archive as it was written" in msg, (reader, msg)


def test_a_restore_of_every_rank_reads_each_archive_json_of_a_clock_only_state(tmp_path):
  # Every archive holds no byte; each target rank checks its share and its template.
  _, _, records, path, empty = _saved(tmp_path, "clock_only")
  ckpt = jr.open_checkpoint(path)
  got = jr.restore_ranks(path, range(4), world_size=4, checkpoint=ckpt)
  assert sorted(ckpt.archives.metas._meta) == list(range(4)) == empty
  for r, g in enumerate(got):
    assert_records_equal(g, jr.reshard(records, jr.plan(records, world_size=4, rank=r)))
  assert (
    np.asarray(got[0].state.hyperparams["learning_rate"]).tobytes() == np.float32(0.5).tobytes()
  )


# --- archives whose bytes an edited index keeps from being read ------------------------


def _two_groups_apart(tmp_path):
  """Adam: param a on archives 0-1, param b on archives 2-4, each archive with bytes."""
  params = {"a": jnp.ones((6,)), "b": jnp.ones((10,))}
  opt = optax.adam(1e-3)
  records = jr.shard_state(opt, params, _filled(opt.init(params)), world_size=2)
  shape = {p.param: p.shape for p in records[0].placements}
  out = [jr.reshard(records, [jr.Migration("a", shape["a"], r, 2, (0, 1))]) for r in range(2)]
  out += [jr.reshard(records, [jr.Migration("b", shape["b"], r, 3, (0, 1))]) for r in range(3)]
  path = tmp_path / "apart"
  jr.save_records(path, out)
  return path


def _frozen_on_the_template(tmp_path):
  """a over archives 0-1; frozen b (no history) on archive 0 alone, the template."""
  params = {"a": jnp.ones((8,)), "b": jnp.ones((3,))}
  opt = optax.multi_transform(
    {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, {"a": "train", "b": "frozen"}
  )
  records = jr.shard_state(opt, params, _filled(opt.init(params)), world_size=2)
  shape = {p.param: p.shape for p in records[0].placements}
  a = [jr.Migration("a", shape["a"], r, 2, (0, 1)) for r in range(2)]
  out = [
    jr.reshard(records, [a[0], jr.Migration("b", shape["b"], 0, 1, (0, 1))]),
    jr.reshard(records, [a[1]]),
  ]
  path = tmp_path / "template"
  jr.save_records(path, out)
  return path


def _relabel(path, archives, like):
  """The index gives ``archives`` the layout entry of archive ``like`` (re-signed)."""
  index = read_json(path / "jaxreshard.json")
  for a in archives:
    index["archives"][a][1] = index["archives"][like][1]
  write_signed_json(path / "jaxreshard.json", index)


def test_a_group_an_edited_layout_keeps_from_being_read_is_refused_by_every_reader(tmp_path):
  # Archives 0-1 given b's layout: a then has no history, no byte of 0-1 is read, and
  # the readers returned a without its moments; load_records refused.
  path = _two_groups_apart(tmp_path)
  _relabel(path, (0, 1), like=2)
  mesh = device_mesh((3,), ("fsdp",))
  calls = {
    f"restore w=8 r={r}": (lambda r=r: jr.restore(path, world_size=8, rank=r)) for r in range(8)
  }
  calls |= {
    f"restore_ranks {ranks}": (lambda ranks=ranks: jr.restore_ranks(path, ranks, world_size=8))
    for ranks in ([5], [4, 5], [5, 6, 7], list(range(8)))
  }
  calls |= {
    f"restore_ranks w={w}": (lambda w=w: jr.restore_ranks(path, range(w), world_size=w))
    for w in (1, 2, 3, 5)
  }
  calls["restore_sharded"] = lambda: jr.restore_sharded(path, mesh, "fsdp")
  calls["load_records"] = lambda: jr.load_records(path)
  outcomes = _outcomes(calls)
  silent = [name for name, msg in outcomes.items() if msg is None]
  assert not silent, f"{silent} returned a without its history"
  result = CliRunner().invoke(
    app, ["reshard", str(path), str(tmp_path / "o"), "-w", "8", "-r", "6"]
  )
  assert result.exit_code == EXIT_ERROR and not (tmp_path / "o").exists(), result.output


def test_a_template_given_another_archive_s_layout_is_refused_by_one_rank_s_restore(tmp_path):
  # The template (archive 0, holding frozen b) given archive 1's layout: rank 1 of 2
  # reads only archive 1, whose layout the edit names; it returned a state without
  # b's masked places.
  path = _frozen_on_the_template(tmp_path)
  _relabel(path, (0,), like=1)
  for rank in range(2):
    with pytest.raises(jr.ReshardError, match="disagree on its state layout"):
      jr.restore(path, world_size=2, rank=rank)
  result = CliRunner().invoke(
    app, ["reshard", str(path), str(tmp_path / "o"), "-w", "2", "-r", "1"]
  )
  assert result.exit_code == EXIT_ERROR and "disagree on its state layout" in result.stderr
  dry = CliRunner().invoke(
    app, ["reshard", str(path), str(tmp_path / "o"), "-w", "2", "-r", "1", "--dry-run"]
  )
  assert dry.exit_code == EXIT_ERROR and "disagree on its state layout" in dry.stderr
