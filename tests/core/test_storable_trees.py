"""A state whose tree no checkpoint can hold is refused in memory as by a save.

A save refuses a tree it cannot store exactly: dict keys that are not all str,
all int or all tuples of those (a float, None, a numpy integer, a bool, a tuple
nested too deep, two kinds in one dict), a registered pytree node of another type
(a dataclass, a ``defaultdict``), a node more than 200 keys deep, int keys that
share one hash, a NamedTuple whose names a reader cannot re-create, and a param id
past 4,096 characters. ``shard_state``, ``reshard``, ``reshard_ranks`` and
``unshard_state`` took such states, so a run learnt of them at its first
checkpoint. Each record here is built by hand (an SGD momentum trace of the params,
every buffer flat, one rank of one), and every call must refuse it with the
save's own message.
"""

import collections
import dataclasses
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr

OPT = optax.sgd(0.1, momentum=0.9)
A = np.arange(5, dtype=np.float32)
B = np.arange(3, dtype=np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Node:
  w: jax.Array


class Zustand(NamedTuple):
  größe: jax.Array


_P1 = collections.namedtuple("Pair", ["x"])
_P2 = collections.namedtuple("Pair", ["x"])  # the same module, name and fields


def _nested(depth):
  p = A
  for _ in range(depth):
    p = {"n": p}
  return p


def _tuple_key(depth):
  k = "k"
  for _ in range(depth):
    k = (k,)
  return k


_COLLIDING = [i * (2**61 - 1) for i in range(9)]  # one hash in CPython

# name -> (params, their ids in flatten order, the node the refusal names, its words)
CASES = {
  "a float key": ({1.5: A}, ["1.5"], "(0, 'trace')", "stored (key 1.5, of type float)"),
  "a None key": ({None: A}, ["None"], "(0, 'trace')", "stored (key None, of type NoneType)"),
  "a numpy integer key": (
    {np.int64(3): A},
    ["3"],
    "(0, 'trace')",
    "(key np.int64(3), of type int64)",
  ),
  "a bool key": (
    {True: A},
    ["True"],
    "(0, 'trace')",
    "dict keys must be all str, all int or all tuples of str, int and such tuples to be stored (key True, of type bool)",
  ),
  "a tuple key 17 deep": (
    {"t": {_tuple_key(17): A}},
    ["t/" + str(_tuple_key(17))],
    "(0, 'trace', 't')",
    "dict keys must be all str",
  ),
  "an int and a numpy int in one dict": (
    {1: A, np.int64(2): B},
    ["1", "2"],
    "(0, 'trace')",
    "dict keys must be all str",
  ),
  "a registered dataclass": (
    {"m": Node(A)},
    ["m/w"],
    "(0, 'trace', 'm')",
    f"is a {__name__}.Node, a pytree node type jaxreshard cannot store",
  ),
  "a defaultdict": (
    collections.defaultdict(list, w=A),
    ["w"],
    "(0, 'trace')",
    "is a collections.defaultdict, a pytree node type",
  ),
  "a tree 201 deep": (
    _nested(199),
    ["/".join(["n"] * 199)],
    "(0, 'trace', 'n', 'n', ...195 keys..., 'n', 'n')",
    "the state tree is nested deeper than 200",
  ),
  "int keys of one hash": (
    dict.fromkeys(_COLLIDING, A),
    [str(k) for k in _COLLIDING],
    "(0, 'trace')",
    "9 keys of the dict share one hash (at most 8)",
  ),
  "a NamedTuple field no reader re-creates": (
    {"w": Zustand(A)},
    ["w/größe"],
    "(0, 'trace', 'w')",
    "NamedTuple Zustand with fields ['größe']",
  ),
  "two NamedTuple classes alike": (
    {"a": _P1(A), "b": _P2(B)},
    ["a/x", "b/x"],
    "(0, 'trace', 'b')",
    f"two NamedTuple classes {__name__}.Pair",
  ),
}


def _record(params, pids):
  """One archive of a world of one: the trace of ``params``, every buffer flat."""
  leaves = jax.tree.leaves(params)
  assert len(leaves) == len(pids)
  trace = jax.tree.map(lambda x: np.asarray(x).reshape(-1), params)
  placements = tuple(
    sorted(
      (
        jr.ParamPlacement(p, x.shape, 0, 1, np.dtype(np.float32), True)
        for p, x in zip(pids, leaves)
      ),
      key=lambda p: p.param,
    )
  )
  return jr.ShardRecord(
    1, placements, (optax.TraceState(trace=trace), optax.EmptyState()), tuple(pids)
  )


def _calls(records):
  migrations = [
    [jr.Migration(p.param, p.shape, r, 2, (0,)) for p in records[0].placements] for r in range(2)
  ]
  return {
    "reshard": lambda: jr.reshard(records, migrations[0]),
    "reshard_ranks": lambda: jr.reshard_ranks(records, migrations),
    "unshard_state": lambda: jr.unshard_state(records),
    "plan": lambda: jr.plan(records, world_size=2, rank=0),
  }


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tree_a_save_refuses_is_refused_in_memory_with_its_words(case, tmp_path):
  params, pids, node, words = CASES[case]
  records = [_record(params, pids)]
  with pytest.raises(jr.ReshardError) as saved:
    jr.save_records(tmp_path / "ckpt", records)
  assert not (tmp_path / "ckpt").exists()
  want = str(saved.value)
  assert f"state node at {node}" in want and words in want, want
  for name, call in _calls(records).items():
    with pytest.raises(jr.ReshardError) as got:
      call()
    assert str(got.value) == want, name
  # shard_state refuses the state before sharding it, naming the same node.
  with pytest.raises(jr.ReshardError, match=re.escape(f"state node at {node}")) as got:
    jr.shard_state(OPT, params, OPT.init(params), 2)
  assert words in str(got.value)


def test_a_tree_at_the_limits_is_taken_and_saved(tmp_path):
  """Nodes 200 keys deep, tuple keys 16 deep, 8 keys of one hash: every call takes
  them, and the checkpoint loads back to the same digest. One key more is refused."""
  params = {"deep": _nested(197), "t": {_tuple_key(16): A}, "h": dict.fromkeys(_COLLIDING[:8], B)}
  records = jr.shard_state(OPT, params, OPT.init(params), 2)
  jr.save_records(tmp_path / "ckpt", records)
  assert jr.digest(tmp_path / "ckpt") == jr.digest(records)
  assert jr.digest(jr.load_records(tmp_path / "ckpt")) == jr.digest(records)
  jr.unshard_state(
    jr.reshard_ranks(records, [jr.plan(records, world_size=3, rank=r) for r in range(3)])
  )
  params["deep"] = _nested(198)
  with pytest.raises(jr.ReshardError, match="nested deeper than 200"):
    jr.shard_state(OPT, params, OPT.init(params), 2)


def test_an_id_longer_than_a_checkpoint_holds_is_refused_in_memory(tmp_path):
  pid = "x" * 4097
  records = [_record({pid: A}, [pid])]
  with pytest.raises(jr.PlacementError) as saved:
    jr.save_records(tmp_path / "ckpt", records)
  assert list(tmp_path.iterdir()) == []
  want = str(saved.value)
  assert "4097 characters" in want and "4096" in want, want
  for name, call in _calls(records).items():
    with pytest.raises(jr.PlacementError) as got:
      call()
    assert str(got.value) == want, name
  with pytest.raises(jr.PlacementError, match="4097 characters"):
    jr.shard_state(OPT, {pid: A}, OPT.init({pid: A}), 2)
  ok = "x" * 4096
  jr.save_records(tmp_path / "ok", jr.shard_state(OPT, {ok: A}, OPT.init({ok: A}), 2))


def test_a_structure_is_checked_once(monkeypatch):
  """The check walks a tree structure once: later calls of one structure, and every
  reshard of records already taken apart, walk nothing."""
  from jaxreshard._src.core import storable  # pylint: disable=g-import-not-at-top

  walked = []
  check_tree = storable.check_tree
  monkeypatch.setattr(storable, "check_tree", lambda t: walked.append(1) or check_tree(t))
  monkeypatch.setattr(storable, "CHECKED", storable._Checked())  # none checked yet
  params = {"a": jnp.zeros((5,)), "b": [jnp.zeros((3,)), jnp.zeros((2,))]}
  records = jr.shard_state(OPT, params, OPT.init(params), 3)
  assert len(walked) == 1
  jr.shard_state(OPT, params, OPT.init(params), 2)
  for rank in range(4):
    jr.reshard(records, jr.plan(records, world_size=4, rank=rank))
  jr.unshard_state(records)
  assert len(walked) == 1


def _bits(tree):
  return [np.asarray(x).reshape(-1).view(np.uint8).tobytes() for x in jax.tree.leaves(tree)]


def test_named_chain_keeps_its_ordered_dict_on_every_path(tmp_path):
  """optax's named_chain holds its state in an OrderedDict, whose keys jax keeps in
  their own order: every call and the checkpoint take it, and give it back in that
  order (not sorted), bit for bit. (A save refused it, and then memory did too.)"""
  opt = optax.named_chain(("zeta", optax.scale_by_adam()), ("alpha", optax.trace(0.9)))
  params = {"w": jnp.arange(5.0), "b": jnp.ones((2, 3))}
  state = jax.tree.map(lambda x: x + 0.5 if x.dtype == jnp.float32 else x, opt.init(params))
  assert type(state) is collections.OrderedDict and list(state) == ["zeta", "alpha"]
  records = jr.shard_state(opt, params, state, world_size=3)
  jr.save_records(tmp_path / "ck", records)
  loaded = jr.load_records(tmp_path / "ck")
  for whole in (
    jr.unshard_state(records),
    jr.unshard_state(loaded),
    jr.unshard_state([jr.restore(tmp_path / "ck", world_size=2, rank=r) for r in range(2)]),
    jr.unshard_state(
      jr.reshard_ranks(records, [jr.plan(records, world_size=4, rank=r) for r in range(4)])
    ),
  ):
    assert type(whole) is collections.OrderedDict and list(whole) == ["zeta", "alpha"]
    assert jax.tree.structure(whole) == jax.tree.structure(state)
    assert _bits(whole) == _bits(state)
  assert jr.digest(loaded) == jr.digest(records)


def test_a_frozen_dict_group_beside_a_dict_group_is_one_state(tmp_path):
  """Groups whose params are a FrozenDict in one and a dict in the other (one str key
  kind) merge into one tree of dicts, as before archives of groups were compared node
  by node: every path takes them (the node check refused 'a FrozenDict ... and a dict')."""
  from flax.core import freeze  # pylint: disable=g-import-not-at-top

  def group(params, world):  # the trace holds the params' values
    state = OPT.init(params)
    state = (state[0]._replace(trace=jax.tree.map(lambda x: x, params)), *state[1:])
    return jr.shard_state(OPT, params, state, world_size=world)

  records = group(freeze({"params": {"enc": jnp.arange(5.0)}}), 2) + group(
    {"params": {"dec": jnp.arange(7.0)}}, 3
  )
  target = jr.reshard(records, jr.plan(records, world_size=1, rank=0))
  want = {
    "params": {"dec": np.arange(7.0, dtype=np.float32), "enc": np.arange(5.0, dtype=np.float32)}
  }
  assert _bits(jr.unshard_state([target])[0].trace) == _bits(want)
  jr.save_records(tmp_path / "ck", records)
  assert _bits(jr.unshard_state(jr.load_records(tmp_path / "ck"))[0].trace) == _bits(want)
  assert _bits(jr.restore(tmp_path / "ck", world_size=1, rank=0).state[0].trace) == _bits(want)
  assert not jr.compare_digests(jr.digest(records), jr.digest([target]))


def test_flat_sharded_init_refuses_a_tree_a_save_refuses():
  """flat_sharded's init took params no checkpoint can hold and trained on them; the
  run learnt of it at its first save_sharded. It refuses them as shard_state does."""
  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
  params = {np.int64(3): jnp.arange(5.0), np.int64(4): jnp.arange(3.0)}
  opt = jr.flat_sharded(optax.adam(1e-3), mesh, axis="fsdp")
  with pytest.raises(jr.ReshardError) as got:
    opt.init(params)
  assert "state node at (0, 'mu'): dict keys must be all str" in str(got.value), got.value
  with pytest.raises(jr.PlacementError, match="4097 characters.*in the params"):
    opt.init({"x" * 4097: jnp.arange(3.0)})
