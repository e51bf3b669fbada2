"""A target holding params of several groups keeps every container of their trees.

Each history mirror of such a target is the union of its groups' trees: a list,
a tuple, a NamedTuple, flax's FrozenDict and an empty node (None) come back as
they were, at every key. A list came back as a dict keyed '0', '1' and a
FrozenDict as a dict, so ``verify CK OUT`` called jaxreshard's own reshard of a
checkpoint of several groups another state, and its digest differed. A list, a
tuple or a NamedTuple comes back whole or not at all: a target holding some of
its elements' params is refused (it held them in a dict keyed by the ids' pieces).

Every expectation is the whole state written by hand, or that state sharded as
one group by ``shard_state`` (which merges nothing), compared bit for bit.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import FrozenDict
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import encoding as _encoding
from jaxreshard._src.cli.commands import app
from tests._core_util import assert_trees_bit_equal, device_mesh, random_bits_array

OPT = optax.adam(1e-2)


# The class a reader re-creates for a NamedTuple it does not know (a plain namedtuple
# of its name and fields): states read back hold this very class.
Pair = _encoding.namedtuple_class("tests", "Pair", ["a", "b"], "Pair")


def _leaf(field):
  """A history buffer of random bits, the same for one (field, name) in every tree."""

  def leaf(name, shape, dtype=jnp.float32):
    rng = np.random.default_rng(zlib.crc32(f"{field}/{name}".encode()))
    return jnp.asarray(random_bits_array(rng, shape, dtype))

  return leaf


def _params(leaf, part):
  """Group A's params, group B's, or (``"all"``) the one tree holding both, by hand."""
  a, b = part in ("A", "all"), part in ("B", "all")
  out = {}
  if a:
    out["layers"] = [
      leaf("l0", (5,)),
      {"b": leaf("l1b", (2, 3), jnp.bfloat16), "k": (leaf("l1k", (3,), jnp.float16),)},
    ]
    out["e"] = None
  blocks = [{}, {}]  # a list whose elements hold params of both groups
  if a:
    blocks[0]["a"] = leaf("b0a", (4,))
  if b:
    blocks[0]["b"] = leaf("b0b", (3,))
    blocks[1]["b"] = leaf("b1b", (2,))
    out["head"] = FrozenDict({"w": leaf("hw", (6,)), "v": leaf("hv", (1,))})
    out["pair"] = Pair(leaf("pa", (2,)), None)
  out["blocks"] = blocks if b else blocks[:1]
  return out


def _state(part):
  zeros = lambda name, shape, dtype=jnp.float32: jnp.zeros(shape, dtype)
  state = (
    optax.ScaleByAdamState(
      jnp.asarray(7, jnp.int32), _params(_leaf("mu"), part), _params(_leaf("nu"), part)
    ),
    optax.EmptyState(),
  )
  assert jax.tree.structure(state) == jax.tree.structure(OPT.init(_params(zeros, part)))
  return _params(zeros, part), state


def _groups():
  """(group A's 4 archives + group B's 3, the whole state, the whole params)."""
  (pa, sa), (pb, sb), (p, whole) = _state("A"), _state("B"), _state("all")
  records = jr.shard_state(OPT, pa, sa, world_size=4) + jr.shard_state(OPT, pb, sb, world_size=3)
  return records, whole, p


def _same_records(got, want):
  """Records of one rank each: placements, tree and bits (as unsigned integers)."""
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert sorted(g.placements, key=lambda p: p.param) == sorted(
      w.placements, key=lambda p: p.param
    )
    assert_trees_bit_equal(g.state, w.state)


@pytest.mark.parametrize("world", [1, 2, 5])
def test_a_merge_keeps_every_container_in_memory(world):
  records, whole, params = _groups()
  want = jr.shard_state(OPT, params, whole, world_size=world)
  plans = [jr.plan(records, world_size=world, rank=r) for r in range(world)]
  _same_records(jr.reshard_ranks(records, plans), want)
  _same_records([jr.reshard(records, plans[-1])], want[-1:])
  assert_trees_bit_equal(jr.unshard_state(records), whole)
  assert_trees_bit_equal(jr.unshard_state(jr.reshard_ranks(records, plans)), whole)
  mu = jr.unshard_state(records)[0].mu
  assert type(mu["layers"]) is list and type(mu["layers"][1]["k"]) is tuple
  assert type(mu["head"]) is FrozenDict and type(mu["pair"]) is Pair and mu["e"] is None


def test_the_digest_of_a_merge_is_the_digest_of_its_sources():
  """``jr.digest`` of the archives, of their reshard and of the whole state sharded as
  one group: one state, one digest (a reshard's lists and tuples were dicts)."""
  records, whole, params = _groups()
  plans = [jr.plan(records, world_size=5, rank=r) for r in range(5)]
  targets = jr.reshard_ranks(records, plans)
  one = jr.digest(jr.shard_state(OPT, params, whole, world_size=1))
  assert jr.compare_digests(one, jr.digest(records)) == []
  assert jr.compare_digests(one, jr.digest(targets)) == []
  assert jr.digest(records) == jr.digest(targets) == one


def test_a_merge_keeps_every_container_on_disk(tmp_path):
  records, whole, params = _groups()
  want = jr.shard_state(OPT, params, whole, world_size=5)
  jr.save_records(tmp_path / "ck", records)
  _same_records(jr.load_records(tmp_path / "ck"), records)
  _same_records([jr.restore(tmp_path / "ck", world_size=5, rank=r) for r in range(5)], want)
  _same_records(jr.restore_ranks(tmp_path / "ck", range(5), world_size=5), want)
  loaded = jr.load_records(tmp_path / "ck")
  plans = [jr.plan(loaded, world_size=5, rank=r) for r in range(5)]
  targets = jr.reshard_ranks(loaded, plans)
  _same_records(targets, want)
  jr.save_records(tmp_path / "out", targets)
  _same_records(jr.load_records(tmp_path / "out"), want)
  state, _ = jr.restore_sharded(tmp_path / "ck", device_mesh((3,), ("fsdp",)))
  assert jax.tree.structure(state) == jax.tree.structure(whole)
  one = jr.shard_state(OPT, params, whole, world_size=1)
  digests = [jr.digest(x) for x in (records, targets, tmp_path / "ck", tmp_path / "out")]
  assert all(d == jr.digest(one) for d in digests), [
    jr.compare_digests(d, digests[0]) for d in digests
  ]


def test_verify_takes_a_reshard_of_several_groups_for_its_source(tmp_path):
  """``verify CK OUT`` on the CLI's own reshard of CK, and on the whole state saved
  as one group: the same state, exit 0 (it said 'key path [0] != {'0'}', exit 1)."""
  records, whole, params = _groups()
  jr.save_records(tmp_path / "ck", records)
  jr.save_records(tmp_path / "one", jr.shard_state(OPT, params, whole, world_size=1))
  runner = CliRunner()
  made = runner.invoke(app, ["reshard", str(tmp_path / "ck"), str(tmp_path / "out"), "-w", "5"])
  assert made.exit_code == 0, made.output
  for a, b in (("ck", "out"), ("out", "ck"), ("one", "out"), ("ck", "one")):
    result = runner.invoke(app, ["verify", str(tmp_path / a), str(tmp_path / b)])
    assert result.exit_code == 0, (a, b, result.output)
  want = jr.shard_state(OPT, params, whole, world_size=5)
  _same_records(jr.load_records(tmp_path / "out"), want)


def test_frozendict_roots_of_two_groups_merge_into_one_frozendict():
  """flax's params of two groups, each a FrozenDict at the root: one FrozenDict."""
  leaf = _leaf("mu")
  pa = FrozenDict({"enc": [leaf("x", (3,)), leaf("y", (4,))]})
  pb = FrozenDict({"dec": FrozenDict({"w": leaf("z", (5,))})})
  whole_params = FrozenDict({"dec": pb["dec"], "enc": pa["enc"]})
  fill = lambda p: jax.tree.map(lambda x: x + 1 if x.ndim else jnp.asarray(3, x.dtype), OPT.init(p))
  sa, sb, whole = fill(pa), fill(pb), fill(whole_params)
  records = jr.shard_state(OPT, pa, sa, world_size=2) + jr.shard_state(OPT, pb, sb, world_size=3)
  got = jr.unshard_state(records)
  assert type(got[0].mu) is FrozenDict and type(got[0].mu["enc"]) is list
  assert_trees_bit_equal(got, whole)
  plans = [jr.plan(records, world_size=4, rank=r) for r in range(4)]
  _same_records(
    jr.reshard_ranks(records, plans), jr.shard_state(OPT, whole_params, whole, world_size=4)
  )


def _two_groups(a_params):
  leaf = _leaf("mu")
  fill = lambda p: jax.tree.map(lambda x: x + 2 if x.ndim else x, OPT.init(p))
  b_params = {"b": leaf("b", (3,))}
  records = jr.shard_state(OPT, a_params, fill(a_params), world_size=2)
  return records + jr.shard_state(OPT, b_params, fill(b_params), world_size=3), fill(a_params)


@pytest.mark.parametrize(
  "kind, node",
  [
    ("list", lambda x, y: [x, y]),
    ("tuple", lambda x, y: (x, y)),
    ("NamedTuple Pair", lambda x, y: Pair(x, y)),
  ],
  ids=["list", "tuple", "NamedTuple"],
)
@pytest.mark.parametrize("other_group", [True, False], ids=["with group B", "alone"])
def test_a_target_holding_some_of_a_sequence_is_refused(tmp_path, kind, node, other_group):
  """A target holding 's/1' (and group B's 'b', or nothing else) but not 's/0' of one
  list, tuple or NamedTuple: no container of that kind holds it at its own index, so
  every call refuses it, naming the node and the param left out."""
  leaf = _leaf("mu")
  records, _ = _two_groups({"s": node(leaf("x", (4,)), leaf("y", (5,)))})
  jr.save_records(tmp_path / "ck", records)
  held, left = ("s/b", "s/a") if kind.startswith("NamedTuple") else ("s/1", "s/0")
  shapes = {p.param: p.shape for r in records for p in r.placements}
  migrations = [jr.Migration(held, shapes[held], 0, 1, (0, 1))]
  if other_group:
    migrations.append(jr.Migration("b", (3,), 0, 1, (2, 3, 4)))
  needle = (
    f"this target holds param {held!r} but not {left!r}, all in the {kind} at state path"
    f" [0].mu['s']"
  )
  calls = {
    "reshard": lambda: jr.reshard(records, migrations),
    "reshard_ranks": lambda: jr.reshard_ranks(records, [migrations]),
    "loaded": lambda: jr.reshard(jr.load_records(tmp_path / "ck"), migrations),
  }
  for name, call in calls.items():
    with pytest.raises(jr.PlacementError) as got:
      call()
    assert needle in str(got.value), (name, str(got.value))


def test_a_target_holding_some_params_of_each_element_keeps_the_list():
  """Each element of a list keeps only the params the target holds, the list whole."""
  leaf = _leaf("mu")
  params = {"layers": [{"w": leaf("w0", (4,)), "b": leaf("b0", (2,))}, {"w": leaf("w1", (3,))}]}
  records, state = _two_groups(params)
  shapes = {p.param: p.shape for r in records for p in r.placements}
  migrations = [jr.Migration(p, shapes[p], 0, 1, (0, 1)) for p in ("layers/0/w", "layers/1/w")]
  migrations.append(jr.Migration("b", (3,), 0, 1, (2, 3, 4)))
  got = jr.reshard(records, migrations).state[0].mu
  assert jax.tree.structure(got) == jax.tree.structure({"b": 0, "layers": [{"w": 0}, {"w": 0}]})
  mu = state[0].mu
  assert_trees_bit_equal(got["layers"][0]["w"], mu["layers"][0]["w"])
  assert_trees_bit_equal(got["layers"][1]["w"], mu["layers"][1]["w"])
