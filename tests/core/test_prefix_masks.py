"""Masks and labels that are a prefix of the params tree: one ``MaskedNode`` for a subtree.

``optax.masked`` takes a mask that is a prefix of the params tree and
``optax.multi_transform`` prefix labels (``{"backbone": "frozen", "head":
"train"}``, the "freeze the backbone" pattern); the inner state then holds one
``optax.MaskedNode`` where a whole subtree of params would be. Such a state was
refused ("param 'backbone': archive 0 holds a history for it but does not list
it"). The rule now: a ``MaskedNode`` at the id of a subtree masks every listed
param under it, and every path gives optax's own tree back (one ``MaskedNode``,
not one per param), bit for bit, so that ``opt.update`` takes it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.core.roleinference import infer_roles
from tests._core_util import (
  assert_records_equal,
  assert_trees_bit_equal,
  device_mesh,
  random_grads,
  standard,
)


def _array(seed, shape):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def _backbone_params():
  return {
    "backbone": {"enc": {"w": _array(0, (5, 3)), "b": _array(1, (3,))}, "emb": _array(2, (7,))},
    "head": {"w": _array(3, (4, 2)), "b": _array(4, (2,))},
  }


def _prefix_labels():
  labels = {"backbone": "frozen", "head": "train"}
  opt = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
  return opt, _backbone_params()


def _nested_prefixes():
  labels = {"backbone": {"enc": "frozen", "emb": "momentum"}, "head": "train"}
  transforms = {
    "train": optax.adam(1e-2),
    "frozen": optax.set_to_zero(),
    "momentum": optax.sgd(1e-2, momentum=0.9),
  }
  return optax.multi_transform(transforms, labels), _backbone_params()


def _nested_with_a_list():
  # The adam mirror masks the list of layers; only the momentum mirror holds it.
  params = {
    "backbone": {
      "enc": {"w": _array(10, (5, 3))},
      "layers": [_array(11, (4,)), _array(12, (2, 2))],
    },
    "head": {"w": _array(13, (3,))},
  }
  labels = {"backbone": {"enc": "frozen", "layers": "momentum"}, "head": "train"}
  transforms = {
    "train": optax.adam(1e-2),
    "frozen": optax.set_to_zero(),
    "momentum": optax.sgd(1e-2, momentum=0.9),
  }
  return optax.multi_transform(transforms, labels), params


def _integer_keys():
  params = {
    "layers": {0: {"w": _array(5, (6,)), "b": _array(6, (2,))}, 1: {"w": _array(7, (3, 3))}},
    "head": {"w": _array(8, (5,))},
  }
  labels = {"layers": {0: "frozen", 1: "train"}, "head": "train"}
  opt = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
  return opt, params


def _masked_prefix():
  a = _array(9, (4,))
  params = {"a": {"w": a}, "b": a + 1.0, "trace": {"b": a + 2.0}}
  return optax.masked(optax.trace(0.9), {"a": False, "b": True, "trace": True}), params


CASES = {
  "prefix_labels": _prefix_labels,
  "nested_prefixes": _nested_prefixes,
  "nested_with_a_list": _nested_with_a_list,
  "integer_keys": _integer_keys,
  "masked_prefix": _masked_prefix,
}
# The masked subtree of each case (its key path's end).
SUBTREE = {
  "prefix_labels": "['backbone']",
  "nested_prefixes": "['backbone']['enc']",
  "nested_with_a_list": "['backbone']['layers']",
  "integer_keys": "['layers'][0]",
  "masked_prefix": "['a']",
}


def _masked_places(tree):
  is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  return [
    jax.tree_util.keystr(p)
    for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_masked)[0]
    if is_masked(x)
  ]


def _trained(name):
  """(optimizer, params, state) after two steps: every history nonzero."""
  opt, params = CASES[name]()
  state = standard(opt.init, params)
  for step in range(2):
    _, state = standard(opt.update, random_grads(params, step), state, params)
  # One MaskedNode stands for a subtree of params: the case this module is about.
  assert any(place.endswith(SUBTREE[name]) for place in _masked_places(state))
  return opt, params, state


def _assert_same_state(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  assert _masked_places(actual) == _masked_places(expected)
  assert_trees_bit_equal(actual, expected)


def _assert_same_step(opt, params, actual, expected):
  """One ``opt.update`` on each state gives the same updates and states, bit for bit."""
  grads = random_grads(params, 7)
  got = standard(opt.update, grads, actual, params)
  want = standard(opt.update, grads, expected, params)
  assert_trees_bit_equal(got, want)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("name", sorted(CASES))
def test_resharded_states_are_optax_own_bit_for_bit(name, world):
  opt, params, state = _trained(name)
  records = jr.shard_state(opt, params, state, world_size=world)
  _assert_same_state(jr.unshard_state(records), state)
  other = {1: 3, 2: 5, 3: 2, 5: 1}[world]
  targets = jr.reshard_ranks(
    records, [jr.plan(records, world_size=other, rank=r) for r in range(other)]
  )
  assert [t.roles for t in targets] == [
    r.roles for r in jr.shard_state(opt, params, state, world_size=other)
  ]
  whole = jr.unshard_state(targets)
  _assert_same_state(whole, state)
  _assert_same_step(opt, params, whole, state)


@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_loaded_and_restored_alike(tmp_path, name):
  opt, params, state = _trained(name)
  records = jr.shard_state(opt, params, state, world_size=3)
  jr.save_records(tmp_path / "ck", records)
  for got, want in zip(jr.load_records(tmp_path / "ck"), records, strict=True):
    assert_records_equal(got, want)
  memory = jr.reshard_ranks(records, [jr.plan(records, world_size=5, rank=r) for r in range(5)])
  disk = jr.restore_ranks(tmp_path / "ck", range(5), world_size=5)
  for got, want in zip(disk, memory, strict=True):
    assert_records_equal(got, want)
  _assert_same_state(jr.unshard_state(disk), state)
  _assert_same_step(opt, params, jr.unshard_state(disk), state)
  assert jr.digest(records) == jr.digest(tmp_path / "ck") == jr.digest(memory)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hand_built_records_infer_the_roles_optax_gives(name):
  opt, params, state = _trained(name)
  records = jr.shard_state(opt, params, state, world_size=2)
  hand = [dataclasses.replace(r, roles=None) for r in records]
  assert infer_roles(hand[0].state, sorted(p.param for p in hand[0].placements)) == records[0].roles
  plans = [jr.plan(records, world_size=3, rank=r) for r in range(3)]
  for got, want in zip(
    jr.reshard_ranks(hand, plans), jr.reshard_ranks(records, plans), strict=True
  ):
    assert_records_equal(got, want)
  _assert_same_state(jr.unshard_state(hand), state)


@pytest.mark.parametrize("name", sorted(CASES))
def test_on_a_mesh_of_four_devices(name):
  opt, params, state = _trained(name)
  mesh = device_mesh((4,), ("fsdp",))
  laid = jr.shard_to_mesh(opt, params, state, mesh)
  shapes = {p.param: p for p in laid.placements[0]}
  _assert_same_state(jr.gather_from_mesh(opt, laid.state, shapes, mesh), state)
  wrapped = jr.flat_sharded(opt, mesh)
  flat = standard(wrapped.init, params)
  plain = standard(opt.init, params)
  assert _masked_places(flat) == _masked_places(plain)
  for step in range(2):
    grads = random_grads(params, step)
    got, flat = standard(wrapped.update, grads, flat, params)
    want, plain = standard(opt.update, grads, plain, params)
    assert_trees_bit_equal(got, want)
  _assert_same_state(jr.gather_from_mesh(opt, flat, shapes, mesh), plain)


def test_a_list_under_a_masked_place_is_found_in_an_unmasked_mirror(tmp_path):
  """MultiSteps' accumulated grads hold the params' list where the adam mirror holds one
  MaskedNode: gathers and saves on a mesh take the params' tree from the mirror that
  holds it (they rebuilt the list as a dict of "0", "1" and refused the state)."""
  params = {"backbone": [_array(14, (4,)), _array(15, (3,))], "head": _array(16, (2,))}
  labels = {"backbone": "frozen", "head": "train"}
  inner = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
  opt = optax.MultiSteps(inner, every_k_schedule=2)
  state = standard(opt.init, params)
  _, state = standard(opt.update, random_grads(params, 0), state, params)
  mesh = device_mesh((4,), ("fsdp",))
  laid = jr.shard_to_mesh(opt, params, state, mesh)
  shapes = {p.param: p for p in laid.placements[0]}
  _assert_same_state(jr.gather_from_mesh(opt, laid.state, shapes, mesh), state)
  jr.save_sharded(tmp_path / "ck", opt, laid.state, shapes, mesh)
  _assert_same_state(jr.unshard_state(jr.load_records(tmp_path / "ck")), state)


def test_groups_of_other_world_sizes_keep_one_masked_node():
  """The masked backbone at world size 2, the head at 3: archives 0 and 1 hold every
  param (optax's tree), archive 2 the head alone; back at one world size it is
  optax's state again."""
  opt, params, state = _trained("prefix_labels")
  records = jr.shard_state(opt, params, state, world_size=6)
  shapes = {p.param: p.shape for p in records[0].placements}
  backbone = [p for p in shapes if p.startswith("backbone/")]
  mixed = []
  for rank in range(3):
    migrations = [jr.Migration(p, shapes[p], rank, 3, tuple(range(6))) for p in shapes]
    migrations = [
      m if m.param not in backbone else dataclasses.replace(m, world_size=2)
      for m in migrations
      if m.param not in backbone or rank < 2
    ]
    mixed.append(jr.reshard(records, migrations))
  assert _masked_places(mixed[0].state) == _masked_places(state)
  assert _masked_places(mixed[2].state) == []
  _assert_same_state(jr.unshard_state(mixed), state)
  targets = jr.reshard_ranks(mixed, [jr.plan(mixed, world_size=4, rank=r) for r in range(4)])
  _assert_same_state(jr.unshard_state(targets), state)
  for got, want in zip(targets, jr.shard_state(opt, params, state, world_size=4), strict=True):
    assert_records_equal(got, want)


def _without(record, gone):
  return dataclasses.replace(
    record, placements=tuple(p for p in record.placements if not p.param.startswith(gone))
  )


def test_a_masked_subtree_with_no_listed_param_is_refused_by_name():
  opt, params, state = _trained("prefix_labels")
  records = [_without(r, "backbone/") for r in jr.shard_state(opt, params, state, world_size=2)]
  words = r"param 'backbone': archive 0 holds an optax.MaskedNode for it.*lists neither it nor"
  with pytest.raises(jr.PlacementError, match=words):
    jr.plan(records, world_size=3, rank=0)
  with pytest.raises(jr.PlacementError, match=words):
    jr.unshard_state(records)
  with pytest.raises(jr.PlacementError, match=words):
    jr.digest(records)


def test_a_masked_subtree_listing_some_of_its_params_is_refused_by_name(tmp_path):
  """``mu`` masks the whole backbone, ``nu`` each of its params: the placements list
  ``backbone/emb`` but not the others ``nu`` shows."""
  opt, params, state = _trained("prefix_labels")
  record = jr.shard_state(opt, params, state, world_size=1)[0]
  adam = record.state.inner_states["train"].inner_state[0]
  nu = dict(adam.nu, backbone=jax.tree.map(lambda _: optax.MaskedNode(), params["backbone"]))
  inner = (adam._replace(nu=nu), *record.state.inner_states["train"].inner_state[1:])
  train = record.state.inner_states["train"]._replace(inner_state=inner)
  bad = dataclasses.replace(
    _without(record, "backbone/enc"),
    state=record.state._replace(inner_states=dict(record.state.inner_states, train=train)),
  )
  words = r"param 'backbone/enc/b': archive 0 holds an optax.MaskedNode for it"
  with pytest.raises(jr.PlacementError, match=words):
    jr.unshard_state([bad])
  with pytest.raises(jr.PlacementError, match=words):
    jr.save_records(tmp_path / "ck", [bad])
  with pytest.raises(jr.PlacementError, match=words):
    jr.unshard_state([dataclasses.replace(bad, roles=None)])
