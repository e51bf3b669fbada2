"""Dicts keyed by tuples (as flax's ``traverse_util.flatten_dict`` makes them) on every
path: saved, loaded, restored per target rank and converted by the CLI, each giving
back the same tree and the same bits as the reshard in memory; restored onto a mesh
as a target's shardings say; a forged tree's tuple keys are refused by name.

Expected values come from the inputs themselves: the records ``shard_state`` made (and
the in-memory reshard, itself checked against a numpy oracle elsewhere), and the full
state given to ``shard_state``, compared bit by bit.
"""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import dictkeys
from jaxreshard._src.checkpoint import encoding as fmt
from jaxreshard._src.cli.commands import app
from tests._archive_util import read_json, write_consistent_index
from tests._core_util import (
  assert_records_equal,
  assert_trees_bit_equal,
  device_mesh,
  random_bits_array,
)

SHAPES = {
  ("layer", 0, "w"): (5,),
  ("layer", 1, "w"): (2, 3),
  ("layer", 10, "w"): (1,),  # 10 sorts after 1 and 2 as an int, not as a string
  ("layer", 2, "w"): (4,),
  ("head",): (),
  ("nested", ("x", 1)): (7,),
}
W = 4


def _params():
  return {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


def _state(opt, seed=0):
  """``opt.init`` of the params, every history filled with random bits (NaN payloads,
  -0.0 and subnormals included)."""
  rng = np.random.default_rng(seed)
  state = opt.init(_params())
  return jax.tree.map(
    lambda x: random_bits_array(rng, np.shape(x), x.dtype) if np.ndim(x) else x, state
  )


@pytest.fixture
def saved(tmp_path):
  opt = optax.adam(1e-3)
  state = _state(opt)
  records = jr.shard_state(opt, _params(), state, W)
  jr.save_records(tmp_path / "ckpt", records)
  return tmp_path / "ckpt", records, state


def test_the_tree_keeps_its_tuple_keys_in_memory():
  opt = optax.adam(1e-3)
  records = jr.shard_state(opt, _params(), _state(opt), W)
  assert set(records[0].state[0].mu) == set(SHAPES)


def test_save_and_load_give_back_every_record(saved):
  directory, records, _ = saved
  loaded = jr.load_records(directory)
  assert len(loaded) == W
  for got, want in zip(loaded, records):
    assert_records_equal(got, want)
  assert set(loaded[2].state[0].nu) == set(SHAPES)


@pytest.mark.parametrize("world", [3, 6])
def test_restore_of_every_target_rank_is_the_reshard_in_memory(saved, world):
  directory, records, state = saved
  restored = jr.restore_ranks(directory, range(world), world_size=world)
  for rank, got in enumerate(restored):
    assert_records_equal(got, jr.reshard(records, jr.plan(records, world_size=world, rank=rank)))
  assert_trees_bit_equal(jr.unshard_state(list(restored)), state)


def test_the_cli_converts_and_verifies_a_checkpoint_keyed_by_tuples(saved, tmp_path):
  directory, _, state = saved
  runner = CliRunner()
  out = tmp_path / "out"
  converted = runner.invoke(app, ["reshard", str(directory), str(out), "--world-size", "3"])
  assert converted.exit_code == 0, converted.output
  verified = runner.invoke(app, ["verify", str(directory), str(out)])
  assert verified.exit_code == 0, verified.output
  assert_trees_bit_equal(jr.unshard_state(jr.load_records(out)), state)


def test_a_key_that_no_code_describes_is_refused_in_memory_as_by_a_save():
  # A save refuses it (tests/core/test_storable_trees.py), so memory refuses it first.
  opt = optax.sgd(1e-3, momentum=0.9)
  params = {("a", 1.5): np.zeros((3,), np.float32)}
  with pytest.raises(jr.ReshardError, match="dict keys must be all str, all int or all tuples"):
    jr.shard_state(opt, params, opt.init(params), 2)


# A forged tree, re-signed consistently: each edit of the first layout's `mu` keys.
_FORGED = {
  "an element that is not a key": (lambda keys: [["u", [["x", 1]]]] + keys[1:], "invalid dict key"),
  "a float inside a tuple key": (
    lambda keys: [["u", [["s", "layer"], 1.5]]] + keys[1:],
    "invalid dict key",
  ),
  "a tuple key nested too deep": (
    lambda keys: [_nested(dictkeys.MAX_KEY_DEPTH + 1)] + keys[1:],
    "invalid dict key",
  ),
  "a str key beside tuple keys": (
    lambda keys: [["s", "head"]] + keys[1:],
    "a dict node mixes tuple and str keys",
  ),
  "one tuple key twice": (lambda keys: [keys[1]] + keys[1:], "appears twice"),
  "tuple keys that cannot be ordered": (
    lambda keys: [["u", [["i", 0]]]] + keys[1:],
    "tuple keys cannot be ordered",
  ),
}


def _nested(depth):
  code = ["s", "deep"]
  for _ in range(depth):
    code = ["u", [code]]
  return code


@pytest.mark.parametrize("case", sorted(_FORGED))
def test_a_forged_tuple_key_is_refused_by_every_reader(saved, case):
  directory, _, _ = saved
  edit, needle = _FORGED[case]
  index = read_json(directory / "jaxreshard.json")
  adam = index["layouts"][0]["tree"][1][0]
  mu = adam[4][1]
  assert mu[0] == "d" and mu[1][0][0] == "u"
  mu[1] = edit(mu[1])
  write_consistent_index(directory, index)
  for call in (
    lambda: jr.load_records(directory),
    lambda: jr.restore(directory, world_size=3, rank=0),
  ):
    with pytest.raises(jr.ArchiveError, match=needle):
      call()


def test_a_key_nested_to_the_limit_is_read_back():
  deepest = "k"
  for _ in range(dictkeys.MAX_KEY_DEPTH):
    deepest = (deepest,)
  tree, leaves = fmt.encode_tree({deepest: 0})
  assert fmt.decode_tree(tree, leaves, "t") == {deepest: 0}
  with pytest.raises(jr.ReshardError, match="dict keys must be"):
    fmt.encode_tree({(deepest,): 0})


def test_a_large_layout_keeps_tuple_keys_in_its_binary_table(tmp_path):
  # 130 params of Adam: 260 history buffers, so the index keeps its layouts in a table.
  opt = optax.adam(1e-3)
  params = {("layer", i, "w"): np.zeros((i % 5 + 1,), np.float32) for i in range(130)}
  rng = np.random.default_rng(1)
  state = jax.tree.map(
    lambda x: random_bits_array(rng, np.shape(x), x.dtype) if np.ndim(x) else x, opt.init(params)
  )
  records = jr.shard_state(opt, params, state, 3)
  jr.save_records(tmp_path / "ckpt", records)
  assert (tmp_path / "ckpt" / "jaxreshard.table").is_file()
  for got, want in zip(jr.load_records(tmp_path / "ckpt"), records):
    assert_records_equal(got, want)
  got = jr.restore(tmp_path / "ckpt", world_size=2, rank=1)
  assert_records_equal(got, jr.reshard(records, jr.plan(records, world_size=2, rank=1)))


def test_restore_sharded_onto_a_target_keyed_by_tuples(saved):
  """The logical state, laid out as the target's shardings say, keys and bits kept."""
  directory, _, state = saved
  mesh = device_mesh((2,), ("fsdp",), jax.devices()[4:6])
  replicated = NamedSharding(mesh, P())
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated), state
  )
  restored, _ = jr.restore_sharded(directory, mesh, axis="fsdp", target=abstract)
  assert set(restored[0].mu) == set(SHAPES)
  assert_trees_bit_equal(jax.device_get(restored), state)


_M61 = 2**61 - 1  # CPython hashes an int n >= 0 as n % (2**61 - 1)


@pytest.mark.parametrize(
  "code",
  [lambda k: ["u", [["i", k * _M61]]], lambda k: ["i", k * _M61]],
  ids=["tuple_keys", "int_keys"],
)
def test_keys_forged_to_share_a_hash_are_refused_at_once(saved, code):
  """A dict of n keys of one hash takes n**2 steps to build (20,000 took ~28 s per
  read): refused before the dict is built, whatever each key's kind."""
  directory, _, _ = saved
  n = 20_000
  index = read_json(directory / "jaxreshard.json")
  adam = index["layouts"][0]["tree"][1][0]
  adam[4][0] = ["t", [0, ["d", [code(k) for k in range(1, n + 1)], [None] * n]]]
  write_consistent_index(directory, index)
  for call in (
    lambda: jr.load_records(directory),
    lambda: jr.restore(directory, world_size=3, rank=0),
    lambda: jr.digest(directory),
  ):
    with pytest.raises(jr.ArchiveError, match=f"{n} keys of a dict node share one hash"):
      call()


def test_keys_that_share_a_hash_by_chance_are_read():
  # -1 and -2 share a hash in CPython; so do tuples that differ only there.
  keys = {(-1,): 0, (-2,): 1, **{(k,): k + 2 for k in range(3, 12)}}
  tree, leaves = fmt.encode_tree(keys)
  assert fmt.decode_tree(tree, leaves, "t") == keys
