"""A forged state tree in the index, re-signed so that its checksum matches, is refused
by name on every read path: each node of the tree's JSON is checked before a leaf is
placed or a class is made.

The tree of a two-param Adam state, as the writer stores it (``["t", [adam, empty]]``,
``adam`` a NamedTuple node ``["n", module, name, fields, children]`` whose children are
the count's leaf and the ``mu`` and ``nu`` dicts), is edited and re-signed with the test
helper, written independently of the library.
"""

import json
import re
import shutil

import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import encoding as fmt
from tests._archive_util import read_json, write_consistent_index

OPT = optax.adam(1e-3)
PARAMS = {"a": np.zeros(5, np.float32), "b": np.zeros((2, 3), np.float32)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = tmp_path_factory.mktemp("tree") / "ckpt"
  jr.save_records(path, jr.shard_state(OPT, PARAMS, OPT.init(PARAMS), 2))
  return path


def _adam(tree):
  return tree[1][0]


def _set(i, value):
  """An edit of the Adam node: its item ``i`` replaced by ``value``."""
  return lambda tree: _adam(tree).__setitem__(i, value)


def _nest(tree, depth):
  for _ in range(depth):
    tree = ["t", [tree]]
  return tree


# Each edit of the tree, and the words every reader refuses it with.
_FORGED = {
  "a leaf index that is a float": (
    lambda t: _adam(t)[4].__setitem__(0, 0.5),
    "invalid tree node '0.5'",
  ),
  "a node of an unknown kind": (lambda t: t[1].__setitem__(1, ["x", []]), "invalid tree node"),
  "a leaf index past the leaves": (
    lambda t: _adam(t)[4][1].__setitem__(2, [1, 99]),
    "leaf index 99 is out of range or used twice",
  ),
  "a leaf index used twice": (
    lambda t: _adam(t)[4][2].__setitem__(2, [1, 4]),
    "leaf index 1 is out of range or used twice",
  ),
  "a leaf no node holds": (
    lambda t: _adam(t)[4][2].__setitem__(2, [3, ["t", []]]),
    "1 stored leaves are not in the tree",
  ),
  "a dict of more children than keys": (
    lambda t: _adam(t)[4][1].__setitem__(1, [["s", "a"]]),
    "a dict node has 1 keys and 2 children",
  ),
  "a NamedTuple of fewer children than fields": (
    lambda t: _adam(t)[4].pop(),
    "NamedTuple ScaleByAdamState has 2 children",
  ),
  "a NamedTuple field that is a keyword": (
    _set(3, ["count", "mu", "for"]),
    "NamedTuple 'ScaleByAdamState' has invalid field names",
  ),
  "a NamedTuple field named twice": (
    _set(3, ["count", "mu", "mu"]),
    "NamedTuple 'ScaleByAdamState' has invalid field names",
  ),
  "a NamedTuple named by a keyword": (
    _set(2, "class"),
    "NamedTuple 'class' has invalid field names",
  ),
  "a NamedTuple field namedtuple refuses": (
    _set(3, ["count", "mu", "_nu"]),
    "cannot re-create NamedTuple 'ScaleByAdamState'",
  ),
  "a NamedTuple module that is not a string": (_set(1, 5), "invalid NamedTuple node"),
}


@pytest.mark.parametrize("case", sorted(_FORGED))
def test_a_forged_tree_is_refused_by_every_reader(saved, tmp_path, case):
  edit, needle = _FORGED[case]
  path = tmp_path / "ckpt"
  shutil.copytree(saved, path)
  index = read_json(path / "jaxreshard.json")
  tree = index["layouts"][0]["tree"]
  assert tree[0] == "t" and _adam(tree)[2] == "ScaleByAdamState", json.dumps(tree)
  edit(tree)
  write_consistent_index(path, index)
  _refused_by_every_reader(path, needle)


def _refused_by_every_reader(path, needle):
  for call in (
    lambda: jr.load_records(path),
    lambda: jr.restore(path, world_size=3, rank=0),
    lambda: jr.digest(path),
  ):
    with pytest.raises(jr.ArchiveError, match=re.escape(needle)):
      call()


def test_a_tree_nested_past_the_limit_is_refused_and_one_at_it_is_read():
  leaves = [np.float32(0)]
  at_limit = _nest(0, fmt.MAX_TREE_DEPTH)
  out = fmt.decode_tree(at_limit, leaves, "t")
  for _ in range(fmt.MAX_TREE_DEPTH):
    assert type(out) is tuple and len(out) == 1
    out = out[0]
  assert out is leaves[0]
  with pytest.raises(jr.ArchiveError, match=f"nested deeper than {fmt.MAX_TREE_DEPTH}"):
    fmt.decode_tree(_nest(0, fmt.MAX_TREE_DEPTH + 1), leaves, "t")


def test_the_unedited_tree_reads_back(saved):
  # The edits above start from a checkpoint every reader takes as it is.
  records = jr.load_records(saved)
  assert len(records) == 2
  assert sorted(records[0].state[0].mu) == ["a", "b"]
  assert jr.restore(saved, world_size=3, rank=0).state[0].nu.keys() == {"a", "b"}


# A typed PRNG key in the clock (add_noise's), re-signed with another description.
_FORGED_KEYS = {
  "an implementation jax does not have": (
    lambda key: key.update(key="threefry9x9"),
    "PRNG key implementation 'threefry9x9' is not one jax has",
  ),
  "key data of another shape than the implementation's": (
    lambda key: key.update(shape=[3], bytes="AAAAAAAAAAAAAAAA"),
    "invalid threefry2x32 key data",
  ),
  "key data that is not uint32 words": (
    lambda key: key.update(dtype="int32"),
    "threefry2x32 key data must be uint32 words",
  ),
}


@pytest.mark.parametrize("case", sorted(_FORGED_KEYS))
def test_a_forged_prng_key_in_the_clock_is_refused_by_every_reader(tmp_path, case):
  import jax  # pylint: disable=g-import-not-at-top

  opt = optax.chain(
    optax.add_noise(0.01, 0.55, key=jax.random.key(0)), optax.sgd(0.1, momentum=0.9)
  )
  path = tmp_path / "ckpt"
  jr.save_records(path, jr.shard_state(opt, PARAMS, opt.init(PARAMS), 2))
  index = read_json(path / "jaxreshard.json")
  keys = [s for clock in index["clocks"] for s in clock if "key" in s]
  assert len(keys) == 1 and keys[0]["key"] == "threefry2x32", index["clocks"]
  edit, needle = _FORGED_KEYS[case]
  edit(keys[0])
  write_consistent_index(path, index)
  _refused_by_every_reader(path, needle)
