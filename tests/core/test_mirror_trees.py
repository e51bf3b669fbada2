"""The tree of a target holding params of several groups (or some of one group's).

Such a target cannot take one template's tree whole: each history mirror is the
union of its groups' trees, every dict at its own keys (integer and tuple keys
kept; ``test_mirror_containers`` has the other containers). Integer keys came
back as strings ('0'), so a merged state no longer fed an
``nnx.List`` model's optimizer and a round trip did not give the archives back.
Groups whose params no one tree holds at their own keys (a list beside a dict,
keys of two kinds in one dict) are refused on every path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.core import archivecheck as _archivecheck
from tests._core_util import assert_records_equal, device_mesh

OPT = optax.adam(1e-2)


def _records(params, world, seed):
  rng = np.random.default_rng(seed)
  state = jax.tree.map(
    lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype) if x.ndim else x, OPT.init(params)
  )
  return params, state, jr.shard_state(OPT, params, state, world_size=world)


def _groups():
  a = {"layers": {0: jnp.zeros((5,)), 1: jnp.zeros((2,))}}  # an nnx.List's plain form
  b = {"a": jnp.zeros((3,)), "t": {("x", 1): jnp.zeros((4,))}}  # flatten_dict keys
  return _records(a, 4, 0), _records(b, 2, 1)


def _key_types(tree):
  return {k: _key_types(v) if isinstance(v, dict) else type(k) for k, v in tree.items()}


WANT = {"a": str, "layers": {0: int, 1: int}, "t": {("x", 1): tuple}}


def test_a_merge_of_two_groups_keeps_integer_and_tuple_keys_in_memory():
  (pa, sa, ra), (_, sb, rb) = _groups()
  merged = [jr.reshard(ra + rb, jr.plan(ra + rb, world_size=3, rank=r)) for r in range(3)]
  for record in merged:
    assert _key_types(record.state[0].mu) == WANT
    assert _key_types(record.state[0].nu) == WANT
  whole = jr.unshard_state(merged)
  for pid, (x, want) in {
    "layers/0": (whole[0].mu["layers"][0], sa[0].mu["layers"][0]),
    "a": (whole[0].nu["a"], sb[0].nu["a"]),
    "t": (whole[0].mu["t"][("x", 1)], sb[0].mu["t"][("x", 1)]),
  }.items():
    assert np.asarray(x).view(np.uint32).tolist() == np.asarray(want).view(np.uint32).tolist(), pid
  # Group A's params back on its 4 ranks: its own archives, trees and bits.
  ids = [p.param for p in ra[0].placements]
  shapes = {p.param: p.shape for p in ra[0].placements}
  for rank in range(4):
    back = jr.reshard(merged, [jr.Migration(i, shapes[i], rank, 4, (0, 1, 2)) for i in ids])
    assert_records_equal(back, ra[rank])


def test_a_merge_of_two_groups_keeps_integer_and_tuple_keys_from_disk(tmp_path):
  (_, _, ra), (_, _, rb) = _groups()
  jr.save_records(tmp_path / "ck", ra + rb)
  memory = jr.reshard(ra + rb, jr.plan(ra + rb, world_size=3, rank=1))
  assert_records_equal(jr.restore(tmp_path / "ck", world_size=3, rank=1), memory)
  mesh = device_mesh((3,), ("fsdp",))
  state, _ = jr.restore_sharded(tmp_path / "ck", mesh)
  assert _key_types(state[0].mu) == WANT


def test_a_merge_of_two_groups_has_the_digest_of_its_sources(tmp_path):
  """The digest names each mirror's tree as a whole state has it: for groups of
  integer and tuple keys, the nested dicts at those keys (``unshard_state``'s), not
  at the ids' pieces. It named the latter, so a merge that kept every key had
  another digest than its sources, and ``verify`` called them different."""
  (_, _, ra), (_, _, rb) = _groups()
  records = ra + rb
  whole = jr.unshard_state(records)
  trees = dict(jr.digest(records).trees)
  for field in ("mu", "nu"):
    assert trees[f"[0].{field}"] == str(jax.tree_util.tree_structure(getattr(whole[0], field)))
  merged = jr.reshard_ranks(records, [jr.plan(records, world_size=3, rank=r) for r in range(3)])
  assert jr.digest(merged) == jr.digest(records)
  jr.save_records(tmp_path / "src", records)
  jr.save_records(tmp_path / "out", merged)
  assert jr.digest(tmp_path / "out") == jr.digest(tmp_path / "src") == jr.digest(records)


def _refused_on_every_path(ra, rb, needle, tmp_path, monkeypatch):
  """Groups whose params no one tree holds, each at its own key path: refused with one
  message by every call in memory, by a save, by the digest and, in a checkpoint
  written before the rule (the check patched out of its save), by every reader."""
  records = ra + rb
  sources = {0: tuple(range(len(ra))), 1: tuple(range(len(ra), len(records)))}
  migrations = [
    jr.Migration(p.param, p.shape, 0, 3, sources[g])
    for g, rs in enumerate((ra, rb))
    for p in rs[0].placements
  ]
  calls = {
    "plan": lambda: jr.plan(records, world_size=3, rank=0),
    "reshard": lambda: jr.reshard(records, migrations),
    "reshard_ranks": lambda: jr.reshard_ranks(records, [migrations]),
    "unshard_state": lambda: jr.unshard_state(records),
    "save_records": lambda: jr.save_records(tmp_path / "refused", records),
  }
  messages = set()
  for name, call in calls.items():
    with pytest.raises(jr.PlacementError) as got:
      call()
    assert needle in str(got.value), (name, str(got.value))
    messages.add(str(got.value))
  assert len(messages) == 1, messages
  assert not (tmp_path / "refused").exists()
  assert any(needle in p for p in jr.digest(records).problems)
  with monkeypatch.context() as m:
    m.setattr(_archivecheck._Nodes, "add", lambda *_: None)
    jr.save_records(tmp_path / "old", records)
  for name, call in {
    "load_records": lambda: jr.load_records(tmp_path / "old"),
    "restore": lambda: jr.restore(tmp_path / "old", world_size=3, rank=0),
    "digest": lambda: jr.digest(tmp_path / "old"),
  }.items():
    with pytest.raises(jr.ArchiveError) as got:
      call()
    assert needle in str(got.value), (name, str(got.value))


def test_a_list_beside_a_dict_is_refused_on_every_path(tmp_path, monkeypatch):
  """A params tree that is a list in one group and a dict in the other: a merge made
  the list a dict keyed '0', and a verify of the result found another key path."""
  _, _, ra = _records([jnp.zeros((4,))], 2, 0)
  _, _, rb = _records({"b": jnp.zeros((3,))}, 2, 1)
  _refused_on_every_path(
    ra,
    rb,
    "archive 0 holds a list at state path [0].mu and archive 2 a dict",
    tmp_path,
    monkeypatch,
  )


def test_keys_of_two_kinds_in_one_dict_are_refused_on_every_path(tmp_path, monkeypatch):
  """Group A's dict under 'd' has the integer key 0, group B's the string key 'y':
  one dict cannot sort keys of two kinds, and a merge keyed it by the ids' pieces
  ('0'), which no verify took for the archives' state."""
  _, _, ra = _records({"d": {0: jnp.zeros((4,))}}, 2, 0)
  _, _, rb = _records({"d": {"y": jnp.zeros((3,))}}, 2, 1)
  _refused_on_every_path(
    ra,
    rb,
    "the dict at state path [0].mu['d'] holds key 0 in archive 0 and key 'y' in archive 2",
    tmp_path,
    monkeypatch,
  )


def test_tuple_keys_that_do_not_compare_are_refused_on_every_path(tmp_path, monkeypatch):
  """flax's tuple keys ``("blocks", 0, "w")`` in one group and ``("blocks", "shared",
  "w")`` in the other: tuples, but no order sorts them (0 against "shared")."""
  _, _, ra = _records({("blocks", 0, "w"): jnp.zeros((4,))}, 2, 0)
  _, _, rb = _records({("blocks", "shared", "w"): jnp.zeros((3,))}, 2, 1)
  _refused_on_every_path(
    ra,
    rb,
    "the dict at state path [0].mu holds key ('blocks', 0, 'w') in archive 0 and key"
    " ('blocks', 'shared', 'w') in archive 2",
    tmp_path,
    monkeypatch,
  )


def test_an_empty_node_where_another_group_has_a_param_is_refused_on_every_path(
  tmp_path, monkeypatch
):
  """Param 'x' of group A where group B holds None: a merge that keeps every node of
  both (lists, tuples, empty nodes) holds neither tree, and dropping B's None made
  another state than B's; no one params tree holds both."""
  _, _, ra = _records({"x": jnp.zeros((4,))}, 2, 0)
  _, _, rb = _records({"x": None, "y": jnp.zeros((3,))}, 2, 1)
  _refused_on_every_path(
    ra,
    rb,
    "archive 0 holds a param at state path [0].mu['x'] and archive 2 a None",
    tmp_path,
    monkeypatch,
  )
