"""A rank that holds only frozen params: its mirrors hold ``optax.MaskedNode`` places alone.

The frozen backbone placed over 3 ranks and the trained head over 2: rank 2 holds
the backbone alone, and the state optax builds for it has Adam's ``mu`` and ``nu``
as ``MaskedNode`` places with no buffer (one for the subtree under a prefix mask,
one per param under a full-shape mask). Those records, which ``reshard`` itself
makes, were refused by ``unshard_state``, ``plan`` and ``save_records`` ("its
history is present in some optimizer subtrees of archive 2 and absent from them
in archive 0") and given another digest than the state's. Every path takes them
and gives back the original state, bit for bit; an archive that truly lacks the
history is refused as before.
"""

import dataclasses
import os

import jax
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import table as _table
from tests._core_util import assert_records_equal, assert_trees_bit_equal, random_grads, standard


def _params(extra=0):
  """The backbone (``extra`` more params in it) and the head."""
  rng = np.random.default_rng(0)
  draw = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  backbone = {"enc": {"w": draw(5, 3), "b": draw(3)}, "emb": draw(7)}
  if extra:
    backbone["more"] = {f"{i:03d}": draw(i % 5) for i in range(extra)}
  return {"backbone": backbone, "head": {"w": draw(4, 2), "b": draw(2)}}


def _full(params, labels_of_subtree):
  """Labels (or mask values) of the params, one per param: a full-shape tree."""
  return {k: jax.tree.map(lambda _, v=v: v, params[k]) for k, v in labels_of_subtree.items()}


def _adam_or_zero(labels):
  return optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)


CASES = {
  # One MaskedNode for the backbone in each Adam mirror.
  "prefix_labels": lambda p: _adam_or_zero({"backbone": "frozen", "head": "train"}),
  # One MaskedNode per backbone param.
  "full_labels": lambda p: _adam_or_zero(_full(p, {"backbone": "frozen", "head": "train"})),
  "masked_prefix": lambda p: optax.masked(optax.adam(1e-2), {"backbone": False, "head": True}),
  "masked_full": lambda p: optax.masked(
    optax.adam(1e-2), _full(p, {"backbone": False, "head": True})
  ),
  # Rank 2's momentum trace holds a buffer (backbone/emb), its Adam mirrors none.
  "with_momentum": lambda p: optax.multi_transform(
    {
      "train": optax.adam(1e-2),
      "frozen": optax.set_to_zero(),
      "momentum": optax.sgd(1e-2, momentum=0.9),
    },
    {"backbone": dict.fromkeys(p["backbone"], "frozen") | {"emb": "momentum"}, "head": "train"},
  ),
}


def _trained(name, extra=0):
  """(optimizer, params, state) after two steps: the oracle every test compares with."""
  params = _params(extra)
  opt = CASES[name](params)
  state = standard(opt.init, params)
  for step in range(2):
    _, state = standard(opt.update, random_grads(params, step), state, params)
  return opt, params, state


def _split(opt, params, state):
  """The backbone over 3 ranks and the head over 2, by hand-made migrations."""
  records = jr.shard_state(opt, params, state, world_size=4)
  shapes = {p.param: p.shape for p in records[0].placements}
  out = []
  for rank in range(3):
    migrations = [
      jr.Migration(p, shape, rank, 3 if p.startswith("backbone/") else 2, tuple(range(4)))
      for p, shape in shapes.items()
      if p.startswith("backbone/") or rank < 2
    ]
    out.append(jr.reshard(records, migrations))
  # Rank 2 holds the backbone alone; Adam's mirrors there hold no buffer.
  assert [p.param for p in out[2].placements] == sorted(p for p in shapes if "backbone/" in p)
  adam = _adam_state(out[2].state)
  assert jax.tree.leaves(adam.mu) == [] and jax.tree.leaves(adam.nu) == []
  assert jax.tree.leaves(adam.mu, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  return out


def _adam_state(state):
  found = [
    x
    for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    if isinstance(x, optax.ScaleByAdamState)
  ]
  assert len(found) == 1
  return found[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_unshard_gives_the_original_state(name):
  opt, params, state = _trained(name)
  split = _split(opt, params, state)
  assert_trees_bit_equal(jr.unshard_state(split), state)
  hand = [dataclasses.replace(r, roles=None) for r in split]
  assert_trees_bit_equal(jr.unshard_state(hand), state)
  assert jr.digest(split) == jr.digest(jr.shard_state(opt, params, state, world_size=1))


@pytest.mark.parametrize("name", sorted(CASES))
def test_planned_back_to_one_world_size(name):
  opt, params, state = _trained(name)
  split = _split(opt, params, state)
  targets = jr.reshard_ranks(split, [jr.plan(split, world_size=5, rank=r) for r in range(5)])
  for got, want in zip(targets, jr.shard_state(opt, params, state, world_size=5), strict=True):
    assert_records_equal(got, want)
  assert_trees_bit_equal(jr.unshard_state(targets), state)


@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_loaded_restored_and_digested(tmp_path, name):
  opt, params, state = _trained(name)
  split = _split(opt, params, state)
  jr.save_records(tmp_path / "ck", split)
  for got, want in zip(jr.load_records(tmp_path / "ck"), split, strict=True):
    assert_records_equal(got, want)
  assert_trees_bit_equal(jr.unshard_state(jr.load_records(tmp_path / "ck")), state)
  whole = jr.shard_state(opt, params, state, world_size=5)
  disk = jr.restore_ranks(tmp_path / "ck", range(5), world_size=5)
  for got, want in zip(disk, whole, strict=True):
    assert_records_equal(got, want)
  assert jr.digest(split) == jr.digest(tmp_path / "ck") == jr.digest(whole)


def test_an_archive_that_truly_lacks_the_history_is_refused(tmp_path):
  """Rank 2's Adam mirrors emptied (no MaskedNode): the backbone's history is absent
  there, not masked, and every path refuses it by name."""
  opt, params, state = _trained("prefix_labels")
  split = _split(opt, params, state)
  adam = _adam_state(split[2].state)
  bare = adam._replace(mu={}, nu={})
  lacking = dataclasses.replace(
    split[2],
    state=jax.tree.map(
      lambda x: bare if x is adam else x, split[2].state, is_leaf=lambda x: x is adam
    ),
  )
  records = [split[0], split[1], lacking]
  words = r"param 'backbone/emb': its history is present in some optimizer subtrees of archive"
  with pytest.raises(jr.PlacementError, match=words):
    jr.unshard_state(records)
  with pytest.raises(jr.PlacementError, match=words):
    jr.reshard(records, jr.plan(records, world_size=5, rank=0))
  with pytest.raises(jr.PlacementError, match=words):
    jr.save_records(tmp_path / "ck", records)


@pytest.mark.parametrize("name", ["full_labels", "masked_full"])
def test_a_checkpoint_of_a_binary_table_index(tmp_path, name):
  """130 more frozen params, a MaskedNode each: the index's layouts go in its table."""
  opt, params, state = _trained(name, extra=130)
  split = _split(opt, params, state)
  jr.save_records(tmp_path / "ck", split)
  assert os.path.exists(tmp_path / "ck" / _table.TABLE_FILE)
  for got, want in zip(jr.load_records(tmp_path / "ck"), split, strict=True):
    assert_records_equal(got, want)
  whole = jr.shard_state(opt, params, state, world_size=5)
  disk = jr.restore_ranks(tmp_path / "ck", range(5), world_size=5)
  for got, want in zip(disk, whole, strict=True):
    assert_records_equal(got, want)
  assert_trees_bit_equal(jr.unshard_state(disk), state)
  assert jr.digest(split) == jr.digest(tmp_path / "ck") == jr.digest(whole)


def _apart(opt, params, apart):
  """``params`` and the optimizer's state after two steps, and its records with the
  params of ``apart`` over 3 ranks and the others over 2 (rank 2: ``apart`` alone)."""
  state = standard(opt.init, params)
  for step in range(2):
    _, state = standard(opt.update, random_grads(params, step), state, params)
  records = jr.shard_state(opt, params, state, world_size=4)
  shapes = {p.param: p.shape for p in records[0].placements}
  split = []
  for rank in range(3):
    migrations = [
      jr.Migration(p, shape, rank, 3 if p in apart else 2, tuple(range(4)))
      for p, shape in shapes.items()
      if p in apart or rank < 2
    ]
    split.append(jr.reshard(records, migrations))
  return state, split


def _ids_that_spell_more_nodes():
  d = lambda n: np.arange(n, dtype=np.float32) + 1  # noqa: E731
  return {
    # Param id '': the MaskedNode place itself spells it, as does the mirror holding it.
    "empty_id": (_adam_or_zero({"": "frozen", "a": "train"}), {"": d(5), "a": d(3)}, {""}),
    # Params 'a' and 'trace/a': rank 2's TraceState(trace={'a': MaskedNode}) spells
    # 'trace/a' from the state node, a param rank 2 does not list.
    "trace_a": (
      optax.masked(optax.trace(0.9), {"a": False, "trace": {"a": True}, "h": True}),
      {"a": d(5), "trace": {"a": d(3)}, "h": d(4)},
      {"a"},
    ),
  }


@pytest.mark.parametrize("name", sorted(_ids_that_spell_more_nodes()))
def test_a_save_takes_apart_what_memory_takes_apart(tmp_path, name):
  """Mirrors of ``MaskedNode`` places alone are found by the params the archive
  lists, on disk as in memory: a save of records memory took (ids that the place
  itself or the state node above the mirror also spell) is written, and gives
  the state back bit for bit."""
  opt, params, apart = _ids_that_spell_more_nodes()[name]
  state, split = _apart(opt, params, apart)
  assert_trees_bit_equal(jr.unshard_state(split), state)
  jr.save_records(tmp_path / "ck", split)
  for got, want in zip(jr.load_records(tmp_path / "ck"), split, strict=True):
    assert_records_equal(got, want)
  assert_trees_bit_equal(jr.unshard_state(jr.load_records(tmp_path / "ck")), state)
  whole = jr.shard_state(opt, params, state, world_size=5)
  for got, want in zip(jr.restore_ranks(tmp_path / "ck", range(5), world_size=5), whole):
    assert_records_equal(got, want)
  assert jr.digest(split) == jr.digest(tmp_path / "ck") == jr.digest(whole)
