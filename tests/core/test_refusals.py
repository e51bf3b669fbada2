"""One test per refusal of a reshard, numbered as the tests are (1..14).

1 no archives; 2 a record version other than 1; 3 a param listed twice, or a history
of an unlisted param; 4 two migrations for one param; 5 an invalid target geometry;
6 an empty source list, or a source index out of range; 7 a source that does not list
the param; 8 a shape that differs from the target's or between sources; 9 a group that
is incomplete or over-complete, repeats a source index, disagrees on its world size or
names a rank outside its world; 10 storage dtypes that disagree or are unsupported, or
trainability that disagrees; 11 a history absent in one source or present in other
subtrees; 12 a clock scalar or state structure that differs; 13 a different number of
buffers; 14 a buffer whose shape is not the slots, whose dtype differs across sources
or is not floating, or a factored state.

Each asserts the specific class, that the message names the parameter and the
archive index involved, and that the refused call changed none of its inputs.
"""

import dataclasses
import os
import re
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from tests._core_util import snapshot

W = 4
OPT = optax.adam(1e-2)


def _records(opt=OPT, world=W, seed=0, count=3):
  rng = np.random.default_rng(seed)
  params = {"a": jnp.zeros((5,), jnp.float32), "b": {"c": jnp.zeros((3, 2), jnp.float32)}}
  state = opt.init(params)
  fill = lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype)) if x.ndim else x
  state = jax.tree.map(fill, state)
  if isinstance(state[0], optax.ScaleByAdamState):
    state = (state[0]._replace(count=jnp.asarray(count, jnp.int32)),) + tuple(state[1:])
  return jr.shard_state(opt, params, state, world)


def _refused(records, migrations, cls, *needles):
  """reshard refuses with ``cls``, names every needle, and leaves inputs alone."""
  before = (
    snapshot(records),
    list(migrations),
    [snapshot(r.state) for r in records if isinstance(r, jr.ShardRecord)],
  )
  with pytest.raises(cls) as info:
    jr.reshard(records, migrations)
  after = (
    snapshot(records),
    list(migrations),
    [snapshot(r.state) for r in records if isinstance(r, jr.ShardRecord)],
  )
  assert before[1] == after[1]
  assert before[0][0] == after[0][0] and before[0][1] == after[0][1]
  assert before[2] == after[2]
  msg = str(info.value)
  for needle in needles:
    assert needle in msg, f"{needle!r} not in {msg!r}"
  assert isinstance(info.value, jr.ReshardError) and isinstance(info.value, ValueError)
  return info.value


def _with_placement(rec, pid, **changes):
  placements = tuple(
    dataclasses.replace(p, **changes) if p.param == pid else p for p in rec.placements
  )
  return dataclasses.replace(rec, placements=placements)


def _with_mu(rec, pid, value, which="mu"):
  """``rec`` with the ``which`` buffer of ``pid`` (a nested id) replaced."""
  adam = rec.state[0]
  tree = jax.tree.map(lambda x: x, getattr(adam, which))  # a copy of the dicts
  *parents, last = pid.split("/")
  node = tree
  for k in parents:
    node = node[k]
  node[last] = value
  return dataclasses.replace(rec, state=(adam._replace(**{which: tree}),) + tuple(rec.state[1:]))


def _plan(records=None, world=6, rank=2):
  return jr.plan(records if records is not None else _records(), world_size=world, rank=rank)


def _by_path(call, records, path, migrations=None):
  """``records`` through one public path: ``reshard`` (of ``migrations``, by default a
  plan to 3 ranks), ``plan`` (a reshard of the records' own plan to 6), ``unshard_state``,
  ``digest``, or ``save_records`` to ``path``."""
  if call == "reshard":
    return jr.reshard(records, migrations or jr.plan(records, world_size=3, rank=0))
  if call == "plan":
    return jr.reshard(records, jr.plan(records, world_size=6, rank=2))
  if call == "unshard_state":
    return jr.unshard_state(records)
  if call == "digest":
    return jr.digest(records)
  return jr.save_records(path, records)


def test_sanity_the_base_case_is_accepted():
  records = _records()
  target = jr.reshard(records, _plan(records))
  assert target.params == ("a", "b/c")


def test_01_no_archives():
  with pytest.raises(jr.PlacementError, match="no archives"):
    jr.reshard([], [jr.Migration("a", (5,), 0, 1, (0,))])
  with pytest.raises(jr.PlacementError, match="no archives"):
    jr.plan([], world_size=2, rank=0)


@pytest.mark.parametrize(
  "migrations, needle",
  [
    ("a", "migrations must be a list of Migration, got str"),
    ({"a": 1}, "migrations must be a list of Migration, got dict"),
    (None, "migrations must be a list of Migration, got NoneType"),
    ([("a", (5,), 0, 6, (0, 1, 2, 3))], "expected a Migration, got tuple"),
  ],
)
def test_01b_migrations_of_another_kind(migrations, needle):
  records = _records()
  before = snapshot(records)
  with pytest.raises(jr.PlacementError) as info:
    jr.reshard(records, migrations)
  assert needle in str(info.value)
  assert snapshot(records)[1] == before[1]


@pytest.mark.parametrize("version", [2, True, 1.0, "1"])
def test_02_version_not_1(version):
  """Only the int 1: True and 1.0 compare equal to it but are no record version."""
  records = _records()
  records[1] = dataclasses.replace(records[1], version=version)
  _refused(
    records, _plan(_records()), jr.PlacementError, "archive 1", f"version {version!r}", "'a'"
  )


def test_02b_trainable_not_a_bool():
  records = _records()
  records[1] = _with_placement(records[1], "b/c", trainable="no")
  _refused(records, _plan(_records()), jr.PlacementError, "param 'b/c'", "archive 1", "'no'")


def test_02e_an_unknown_executor():
  records = _records()
  before = snapshot(records)
  with pytest.raises(jr.PlacementError, match="executor 'gpu' is not one of auto, host, device"):
    jr.reshard(records, _plan(records), executor="gpu")
  assert snapshot(records)[1] == before[1]


@pytest.mark.parametrize("other", ["a record", {"state": ()}, None])
def test_02c_not_a_record(other):
  records = _records()
  records[1] = other
  _refused(
    records,
    _plan(_records()),
    jr.PlacementError,
    f"archive 1: expected a ShardRecord, got {type(other).__name__}",
  )


def test_02d_a_placement_that_is_not_a_param_placement():
  records = _records()
  p = records[2].placements[0]
  as_tuple = (p.param, p.shape, p.rank, p.world_size, p.dtype, p.trainable)
  records[2] = dataclasses.replace(records[2], placements=(as_tuple, *records[2].placements[1:]))
  _refused(
    records,
    _plan(_records()),
    jr.PlacementError,
    f"archive 2: placement {as_tuple!r} is not a ParamPlacement",
  )


def test_03a_param_listed_twice():
  records = _records()
  records[2] = dataclasses.replace(
    records[2], placements=records[2].placements + (records[2].placements[0],)
  )
  _refused(records, _plan(_records()), jr.PlacementError, "param 'a'", "archive 2", "twice")


def test_03b_history_for_unlisted_param():
  records = _records()
  records[3] = dataclasses.replace(
    records[3], placements=tuple(p for p in records[3].placements if p.param != "b/c")
  )
  migrations = [m for m in _plan(_records()) if m.param == "a"]
  _refused(records, migrations, jr.PlacementError, "param 'b/c'", "archive 3", "does not list")


@pytest.mark.parametrize("sources", [None, 3, 2.0])
def test_04c_a_migration_whose_sources_are_no_collection(sources, tmp_path):
  """Sources that are no collection of indices are refused by name, on every path
  that takes migrations (``Migration`` raised a raw TypeError making the tuple)."""
  records = _records()
  bad = jr.Migration("a", (5,), 0, 6, sources)
  needles = ("param 'a'", "a migration's sources are the indices", type(sources).__name__)
  _refused(records, [bad], jr.PlacementError, *needles)
  with pytest.raises(jr.PlacementError) as info:
    jr.reshard_ranks(records, [[bad]])
  assert all(n in str(info.value) for n in needles)


@pytest.mark.parametrize("ranks", [None, 3])
def test_04d_restore_ranks_of_no_list_of_ranks(ranks, tmp_path):
  """``restore_ranks`` refuses ranks that are no collection by name, as it refuses a
  rank that is no int (a raw TypeError came out of its first loop)."""
  jr.save_records(tmp_path / "ckpt", _records())
  with pytest.raises(jr.PlacementError, match="ranks must be a list of target ranks"):
    jr.restore_ranks(tmp_path / "ckpt", ranks, world_size=2)
  assert len(jr.restore_ranks(tmp_path / "ckpt", (r for r in [1, 0]), world_size=2)) == 2


def test_04_two_migrations_for_one_param():
  records = _records()
  m = _plan(records)
  _refused(records, m + [m[0]], jr.PlacementError, "param 'a'", "two migrations", "archive")


@pytest.mark.parametrize("param", [5, None, ("a",), b"a"])
def test_04b_a_migration_whose_param_is_no_id(param):
  """A param id is a str: anything else is refused by name (a number made the
  refusal's spelling hint raise an AttributeError)."""
  records = _records()
  bad = jr.Migration(param, (5,), 0, 6, (0, 1, 2, 3))
  _refused(records, [bad], jr.PlacementError, "param is a parameter id (a str)", repr(param))


@pytest.mark.parametrize(
  "rank, world, shape", [(6, 6, (5,)), (0, 0, (5,)), (-1, 6, (5,)), (0, 6, (-5,))]
)
def test_05_invalid_target_geometry(rank, world, shape):
  records = _records()
  bad = jr.Migration("a", shape, rank, world, (0, 1, 2, 3))
  _refused(records, [bad], jr.PlacementError, "param 'a'", "target")


def test_06a_empty_source_list():
  records = _records()
  _refused(
    records,
    [jr.Migration("a", (5,), 0, 6, ())],
    jr.PlacementError,
    "param 'a'",
    "no source archives",
  )


@pytest.mark.parametrize("bad", [4, -1, 99])
def test_06b_source_index_out_of_range(bad):
  records = _records()
  _refused(
    records,
    [jr.Migration("a", (5,), 0, 6, (0, 1, 2, bad))],
    jr.PlacementError,
    "param 'a'",
    f"archive index {bad}",
    "out of range",
  )


@pytest.mark.parametrize("bad", [0.0, 1.0, "1", None])
def test_06c_source_index_that_is_no_int(bad):
  """Named as no int (a float index in range was called 'out of range (0..3)')."""
  records = _records()
  _refused(
    records,
    [jr.Migration("a", (5,), 0, 6, (bad, 1, 2, 3))],
    jr.PlacementError,
    "param 'a'",
    f"archive index {bad!r} is not an int",
  )


def test_07_source_does_not_list_param():
  # Two groups: archives 0..3 hold 'a' and 'b/c'; archive 4 holds only 'x'.
  records = _records()
  other = jr.shard_state(
    optax.adam(1e-2), {"x": jnp.zeros((3,))}, optax.adam(1e-2).init({"x": jnp.zeros((3,))}), 1
  )
  records = records + other
  _refused(
    records,
    [jr.Migration("a", (5,), 0, 6, (0, 1, 2, 4))],
    jr.PlacementError,
    "param 'a'",
    "archive 4",
    "does not list",
  )


def test_08a_shape_differs_from_target():
  records = _records()
  _refused(
    records,
    [jr.Migration("a", (6,), 0, 6, (0, 1, 2, 3))],
    jr.PlacementError,
    "param 'a'",
    "archive 0",
    "(5,)",
    "(6,)",
  )


def test_08b_shape_differs_between_sources():
  records = _records()
  records[2] = _with_placement(records[2], "a", shape=(2, 3))
  _refused(
    records, _plan(_records()), jr.PlacementError, "param 'a'", "archive 2", "(2, 3)", "(5,)"
  )


def test_09a_incomplete_group():
  records = _records()
  _refused(
    records,
    [jr.Migration("a", (5,), 0, 6, (0, 1, 3))],
    jr.PlacementError,
    "param 'a'",
    "world_size 4",
    "[2]",
  )


def test_09b_over_complete_group_from_two_checkpoints():
  # Rank 2 supplied twice (a second copy of the same checkpoint) -> repeated rank.
  records = _records() + _records()
  _refused(
    records,
    [jr.Migration("a", (5,), 0, 6, (0, 1, 2, 3, 6))],
    jr.PlacementError,
    "param 'a'",
    "archives 2 and 6",
    "rank 2",
  )


def test_09c_repeated_source_index():
  records = _records()
  _refused(
    records,
    [jr.Migration("a", (5,), 0, 6, (0, 1, 2, 2, 3))],
    jr.PlacementError,
    "param 'a'",
    "archives 2 and 2",
    "rank 2",
  )


def test_09d_world_size_disagrees():
  records = _records()
  records[1] = _with_placement(records[1], "a", world_size=5)
  _refused(records, _plan(_records()), jr.PlacementError, "param 'a'", "archive 1", "world_size 5")


def test_09e_rank_outside_its_world():
  records = _records()
  records[3] = _with_placement(records[3], "a", rank=7)
  _refused(records, _plan(_records()), jr.PlacementError, "param 'a'", "archive 3", "rank 7")


@pytest.mark.parametrize("call", ["plan", "unshard_state"])
def test_09f_plan_and_unshard_refuse_a_rank_held_twice(call):
  """The paths that group a param's archives themselves (no migration names them)."""
  records = _records()
  records[1] = _with_placement(records[1], "a", rank=0)
  before = snapshot(records)
  with pytest.raises(jr.PlacementError) as info:
    if call == "plan":
      jr.plan(records, world_size=6, rank=2)
    else:
      jr.unshard_state(records)
  assert "param 'a': archives 0 and 1 both hold rank 0" in str(info.value)
  assert snapshot(records)[1] == before[1]


@pytest.mark.parametrize("call", ["plan", "unshard_state"])
@pytest.mark.parametrize(
  "change, needle",
  [
    (
      dict(world_size=5),
      "archive 1 has shape (5,) over world_size 5 but archive 0 has (5,) over 4",
    ),
    (dict(shape=(6,)), "archive 1 has shape (6,) over world_size 4 but archive 0 has (5,) over 4"),
  ],
)
def test_09g_plan_and_unshard_refuse_archives_of_two_groups(call, change, needle):
  """Archives that disagree on a param's shape or world size: no group is guessed."""
  records = _records()
  records[1] = _with_placement(records[1], "a", **change)
  with pytest.raises(jr.PlacementError) as info:
    if call == "plan":
      jr.plan(records, world_size=6, rank=2)
    else:
      jr.unshard_state(records)
  assert f"param 'a': {needle}; pass explicit migrations to pick one group" == str(info.value)


def test_09i_a_target_dim_that_is_no_integer_is_refused():
  """A migration's shape (5.0,) equals the sources' (5,) but is no geometry."""
  records = _records()
  m = dataclasses.replace(_plan(records)[0], shape=(5.0,))
  assert m.param == "a"
  _refused(records, [m], jr.PlacementError, "param 'a'", "shape (5.0,) is not a sequence")


@pytest.mark.parametrize("shape", [None, 5])
def test_09k_a_digest_of_a_placement_shape_that_is_no_sequence_refuses_it(shape):
  """As reshard and a save do, with FlatShard's words (it was a TypeError)."""
  records = _records()
  records[1] = _with_placement(records[1], "a", shape=shape)
  with pytest.raises(jr.PlacementError, match=f"shape {shape} is not a sequence of integers"):
    jr.digest(records)


@pytest.mark.parametrize("archive", [0, 1, 3])
@pytest.mark.parametrize(
  "change, needle",
  [
    (lambda p: dict(rank=bool(p.rank)), "rank must be an integer, not the bool"),
    (lambda p: dict(world_size=float(W)), "world_size must be an integer, not float 4.0"),
    (lambda p: dict(shape=(5.0,)), "shape (5.0,) is not a sequence of integers"),
  ],
)
@pytest.mark.parametrize("call", ["reshard", "plan", "unshard_state", "digest", "save_records"])
def test_09l_a_source_placement_of_a_bool_or_float_is_refused_by_every_path(
  call, archive, change, needle, tmp_path
):
  """Equal to the int it stands for, and of a group whose archives are otherwise
  alike (which reshard checks through their first one): refused by every path,
  whichever archive holds it, as ``FlatShard`` refuses it."""
  records = _records()
  if archive in (0, 1):
    p = records[archive].placement("a")
    records[archive] = _with_placement(records[archive], "a", **change(p))
  else:  # the last archive, and the records in reverse order
    p = records[-1].placement("a")
    records = [_with_placement(records[-1], "a", **change(p))] + records[-2::-1]
    archive = 0
  expected = f"param 'a': archive {archive}: {needle}"
  with pytest.raises(jr.PlacementError) as info:
    _by_path(call, records, tmp_path / "ckpt", _plan())
  assert str(info.value).startswith(expected), str(info.value)
  assert not (tmp_path / "ckpt").exists()


def test_09j_numpy_integer_ranks_and_world_sizes_save_and_load_as_ints(tmp_path):
  """np.int32 / np.int64 ranks and world sizes are integers to every path
  (FlatShard reads them with operator.index): a save writes them as ints, and the
  checkpoint loads as the records with Python ints."""
  records = [
    _with_placement(rec, pid, rank=np.int32(rec.placement(pid).rank), world_size=np.int64(W))
    for rec in _records()
    for pid in ["a"]
  ]
  target = jr.reshard(records, _plan(_records()))
  jr.save_records(tmp_path / "ckpt", records)
  loaded = jr.load_records(tmp_path / "ckpt")
  assert [r.placement("a").rank for r in loaded] == list(range(W))
  assert all(type(r.placement("a").rank) is int for r in loaded)
  assert jr.digest(tmp_path / "ckpt") == jr.digest(_records())
  again = jr.restore(tmp_path / "ckpt", world_size=6, rank=2)
  for a, b in zip(jax.tree.leaves(target.state), jax.tree.leaves(again.state)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_10a_storage_dtypes_disagree():
  records = _records()
  records[2] = _with_placement(records[2], "a", dtype=jnp.float16)
  _refused(records, _plan(_records()), jr.DtypeError, "param 'a'", "archive 2", "float16")


@pytest.mark.parametrize("dtype", [np.float64, np.int32, "bool", "float8_e4m3fn"])
def test_10b_unsupported_storage_dtype(dtype):
  records = [_with_placement(r, "a", dtype=dtype) for r in _records()]
  err = _refused(records, _plan(_records()), jr.DtypeError, "param 'a'", "archive 0")
  assert isinstance(err, jr.PlacementError) and isinstance(err, jr.ShapeError)


def test_10c_trainability_disagrees():
  records = _records()
  records[1] = _with_placement(records[1], "b/c", trainable=False)
  _refused(records, _plan(_records()), jr.PlacementError, "param 'b/c'", "archive 1", "trainable")


def test_11a_history_absent_in_one_source():
  records = _records()
  rec = _with_mu(records[2], "a", optax.MaskedNode())
  rec = _with_mu(rec, "a", optax.MaskedNode(), which="nu")
  records[2] = dataclasses.replace(rec, roles=None)  # a hand-edited record: roles inferred
  _refused(records, _plan(_records()), jr.PlacementError, "param 'a'", "archive 2", "histor")


def test_11b_history_present_in_other_subtrees():
  # Same number of buffers, different subtrees: mu here, nu there.
  records = _records()
  records = [
    dataclasses.replace(
      _with_mu(r, "a", optax.MaskedNode(), which="nu" if i < 2 else "mu"), roles=None
    )
    for i, r in enumerate(records)
  ]
  _refused(records, _plan(_records()), jr.PlacementError, "param 'a'", "archive 2", "absent")


def test_12a_clock_scalar_differs():
  records = _records()
  records[3] = _records(count=4)[3]
  _refused(
    records,
    _plan(_records()),
    jr.PlacementError,
    "param 'a'",
    "archive 3",
    "scalar",
    "not one checkpoint",
  )


def test_12a_clock_scalars_that_print_alike_are_told_apart_by_their_bytes():
  # Two NaNs of different payloads: the message shows what differs.
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=1e-3)
  params = {"a": jnp.zeros((5,))}
  records = []
  for payload in (0x7FC00000, 0x7FC00001):
    state = opt.init(params)
    nan = np.array(payload, np.uint32).view(np.float32)
    state.hyperparams["learning_rate"] = jnp.asarray(nan)
    records.append(jr.shard_state(opt, params, state, 2)[len(records)])
  with pytest.raises(jr.PlacementError) as info:
    jr.reshard(records, jr.plan(records, world_size=1, rank=0))
  message = str(info.value)
  assert "clock scalar .hyperparams['learning_rate'] = array(nan" in message, message
  assert "(bytes 0000c07f)" in message and "(bytes 0100c07f)" in message, message


@pytest.mark.parametrize("impls", [("threefry2x32", "rbg"), ("rbg", "unsafe_rbg")])
def test_12a_prng_keys_of_two_implementations_are_named_by_them(impls, tmp_path):
  """Keys of one seed and two implementations (rbg and unsafe_rbg hold the same key
  data): each side of the refusal names its key's implementation, on every path."""
  params = {"a": jnp.zeros((5,))}
  records = []
  for impl in impls:
    opt = optax.noisy_sgd(1e-2, key=jax.random.key(0, impl=impl))
    with jax.numpy_dtype_promotion("standard"):
      state = opt.init(params)
    records.append(jr.shard_state(opt, params, state, 2)[len(records)])
  data = {"threefry2x32": "array([0, 0], dtype=uint32)", "rbg": "array([0, 0, 0, 0], dtype=uint32)"}
  data["unsafe_rbg"] = data["rbg"]
  needle = (
    f"archive 1 has clock scalar [0].rng_key = a PRNG key of implementation {impls[1]!r}"
    f" with key data {data[impls[1]]} but archive 0 has a PRNG key of implementation"
    f" {impls[0]!r} with key data {data[impls[0]]}; these archives are not one checkpoint"
  )
  for call in (
    lambda: jr.reshard(records, jr.plan(records, world_size=1, rank=0)),
    lambda: jr.save_records(tmp_path / "ckpt", records),
  ):
    with pytest.raises(jr.PlacementError, match=re.escape(needle)):
      call()
  assert not (tmp_path / "ckpt").exists()


def test_12a_a_python_number_is_weak_as_jax_makes_it():
  """jax promotes a Python int as weakly typed (``jnp.asarray(3).weak_type``): a
  ``count`` of 3 in one archive and ``np.int64(3)`` (strong) in another are two
  clocks, which the refusal tells apart; before, they were one (each 'not weak'),
  and the type of every target's count followed whichever archive came first."""
  assert jnp.asarray(3).weak_type and not jnp.asarray(np.int64(3)).weak_type
  records = _records()
  records = [
    dataclasses.replace(r, state=(r.state[0]._replace(count=c),) + tuple(r.state[1:]))
    for r, c in zip(records, [3] + [np.int64(3)] * (len(records) - 1))
  ]
  _refused(
    records,
    _plan(_records()),
    jr.PlacementError,
    "archive 1 has clock scalar [0].count = array(3) (not weak) but archive 0 has array(3)"
    " (weak); these archives are not one checkpoint",
  )


def test_12b_state_structure_differs():
  # adamw's state has one more (empty) transform than adam's: same histories.
  records = _records()
  records[1] = _records(opt=optax.adamw(1e-2))[1]
  _refused(records, _plan(_records()), jr.PlacementError, "param 'a'", "archive 1", "structure")


def test_12c_merged_groups_with_different_clocks():
  # Two groups merged into one target state must share one optimizer clock.
  g1 = _records(count=3)
  opt = optax.adam(1e-2)
  params = {"x": jnp.zeros((3,))}
  state = opt.init(params)
  state = (state[0]._replace(count=jnp.asarray(9, jnp.int32)),) + tuple(state[1:])
  g2 = jr.shard_state(opt, params, state, 2)
  records = g1 + g2
  migrations = _plan(g1) + [jr.Migration("x", (3,), 2, 6, (4, 5))]
  _refused(records, migrations, jr.PlacementError, "param 'x'", "archive 4", "scalar")


def _roles_swapped(rec):
  roles = list(rec.roles)
  i, j = roles.index("a"), roles.index("b/c")
  roles[i], roles[j] = roles[j], roles[i]
  return dataclasses.replace(rec, roles=tuple(roles))


@pytest.mark.parametrize(
  "case, needle",
  [
    ("roles one short", "the state has 5 leaves but its roles describe 4"),
    ("roles swapped", "the leaf at [0].mu['a'] is not under a key path 'b/c'"),
    ("unexplained buffer", "the buffer at [0].mu['z'] is not the history of any listed parameter"),
  ],
)
def test_12d_roles_that_do_not_describe_the_state(case, needle, tmp_path):
  """A record's roles (recorded, or inferred for a hand-built record) must say what
  every leaf of its state is."""
  records = _records()
  rec = records[1]
  if case == "roles one short":
    records[1] = dataclasses.replace(rec, roles=rec.roles[:-1])
  elif case == "roles swapped":
    records[1] = _roles_swapped(rec)
  else:
    records[1] = dataclasses.replace(_with_mu(rec, "z", jnp.zeros((2,), jnp.float32)), roles=None)
  _refused(records, _plan(_records()), jr.PlacementError, "archive 1", needle)
  # The same refusal, in the same words, from the other paths that read records.
  for call in (
    lambda: jr.plan(records, world_size=6, rank=2),
    lambda: jr.unshard_state(records),
    lambda: jr.save_records(tmp_path / "ckpt", records),
  ):
    with pytest.raises(jr.PlacementError, match="archive 1: " + re.escape(needle)):
      call()
  assert not (tmp_path / "ckpt").exists()


def test_12e_a_role_that_is_a_suffix_of_its_path_but_not_its_param():
  """``trace['a']['b']`` called the history of param 'b' (its path ends in 'b'), while
  ``trace['b']`` says the mirror of the params is ``trace`` itself."""
  params = {"a": {"b": jnp.zeros((4,))}, "b": jnp.zeros((3,))}
  opt = optax.sgd(0.1, momentum=0.9)
  records = jr.shard_state(opt, params, opt.init(params), 2)
  assert records[1].roles == ("a/b", "b")
  records[1] = dataclasses.replace(records[1], roles=("b", "b"))
  migrations = jr.plan(jr.shard_state(opt, params, opt.init(params), 2), world_size=3, rank=0)
  _refused(
    records,
    migrations,
    jr.PlacementError,
    "archive 1: roles and state disagree at [0].trace['a']['b']",
  )


def test_12f_roles_that_call_one_leaf_of_a_params_mirror_a_clock_scalar(tmp_path):
  """``mu['a']`` called a clock scalar while ``mu['b/c']`` is a history: the mirror
  is taken whole, so it was resharded as a's history, unchecked as a clock (its
  ranks differ), and a save crashed on it. Every path refuses it by name."""
  records = _records()
  assert records[1].roles == (None, "a", "b/c", "a", "b/c")
  records = [dataclasses.replace(r, roles=(None, None, "b/c", "a", "b/c")) for r in records]
  needle = "archive 0: roles and state disagree at [0].mu['a']: the roles call it a clock scalar"
  _refused(records, _plan(_records()), jr.PlacementError, needle)
  for call in (
    lambda: jr.plan(records, world_size=6, rank=2),
    lambda: jr.unshard_state(records),
    lambda: jr.digest(records),
    lambda: jr.save_records(tmp_path / "ckpt", records),
  ):
    with pytest.raises(jr.PlacementError, match=re.escape(needle)):
      call()
  assert not (tmp_path / "ckpt").exists()


def test_13_different_number_of_buffers():
  # Rank 1 saved by an optimizer with three histories per param (adam + trace).
  records = _records()
  records[1] = _records(opt=optax.chain(optax.adam(1e-2), optax.trace(0.9)))[1]
  _refused(
    records,
    _plan(_records()),
    jr.PlacementError,
    "param 'a'",
    "archive 1",
    "3 history buffers",
    "2",
  )


def test_14a_buffer_shape_not_slots():
  records = _records()
  records[2] = _with_mu(records[2], "a", jnp.zeros((3,), jnp.float32))  # slots are 2
  _refused(records, _plan(_records()), jr.ShapeError, "param 'a'", "archive 2", "(3,)", "(2,)")


def test_14b_buffer_dtype_differs_across_sources():
  records = _records()
  records[3] = _with_mu(records[3], "a", jnp.zeros((2,), jnp.float16))
  _refused(
    records, _plan(_records()), jr.ShapeError, "param 'a'", "archive 3", "float16", "float32"
  )


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.uint8])
def test_14c_buffer_not_floating(dtype):
  records = [_with_mu(r, "b/c", jnp.zeros((2,), dtype)) for r in _records()]
  _refused(
    records, _plan(_records()), jr.ShapeError, "param 'b/c'", "archive 0", np.dtype(dtype).name
  )


class _DtypeNumpyCannotRead:
  """A duck-typed buffer of the right shape whose ``dtype`` numpy does not understand."""

  shape = (2,)
  ndim = 1
  dtype = "not-a-dtype"

  def __array__(self, dtype=None, copy=None):
    return np.zeros(2, np.float32)


_OTHER_ORDER = ">f4" if np.little_endian else "<f4"


@pytest.mark.parametrize(
  "buffer, needles",
  [
    # numpy calls ``>f4`` float32 too: the message says which byte order it is.
    (
      np.zeros((2,), _OTHER_ORDER),
      (
        f"history buffer dtype '{_OTHER_ORDER}' (float32,"
        f" {'big' if np.little_endian else 'little'}-endian)",
        "in this host's byte order",
      ),
    ),
    (_DtypeNumpyCannotRead(), ("history buffer dtype 'not-a-dtype' is not a dtype",)),
  ],
  ids=["other_byte_order", "not_a_dtype"],
)
def test_14c_a_buffer_whose_dtype_is_named_as_such(buffer, needles):
  records = _records()
  records[1] = _with_mu(records[1], "a", buffer)
  _refused(records, _plan(_records()), jr.ShapeError, "param 'a'", "archive 1", *needles)


def test_14d_factored_state_is_refused():
  # Adafactor-like factored rows stored where a flat history should be.
  records = [_with_mu(r, "b/c", jnp.zeros((3, 1), jnp.float32)) for r in _records()]
  _refused(records, _plan(_records()), jr.ShapeError, "param 'b/c'", "archive 0", "(3, 1)")


def test_plan_refuses_incomplete_groups():
  records = _records()
  with pytest.raises(jr.PlacementError, match=r"param 'a'.*missing ranks \[1\]"):
    jr.plan(records[:1] + records[2:], world_size=2, rank=0)


def test_unshard_refuses_incomplete_groups():
  records = _records()
  with pytest.raises(jr.PlacementError, match="param 'a'"):
    jr.unshard_state(records[1:])


@pytest.mark.parametrize(
  "case",
  [
    "world_size",
    "unknown_trainable",
    "trainable_not_bool",
    "integer_param",
    "same_id",
    "a_float",
    "huge_int_key",
    "huge_int_in_tuple_key",
  ],
)
def test_shard_state_refusals_leave_inputs_alone(case):
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"a": jnp.arange(5.0), "b": {"c": jnp.ones((3, 2))}}
  kwargs, cls, needle = {"world_size": 2}, jr.PlacementError, None
  if case == "world_size":
    kwargs, needle = {"world_size": 0}, "world_size 0"
  elif case == "unknown_trainable":
    kwargs["trainable"], needle = {"zz": False}, "'zz'"
  elif case == "trainable_not_bool":  # "no" is true: it would have saved as trainable
    kwargs["trainable"], needle = {"a": "no"}, r"\['a'\].*a bool, got str 'no'"
  elif case == "integer_param":
    params = {"i": jnp.arange(3)}
    cls, needle = jr.DtypeError, "param 'i'"
  elif case == "same_id":  # two keys of one dict that print alike: a float32 and a float
    params = {np.float32(0.1): jnp.ones(3), 0.1: jnp.ones(2)}
    needle = r"params \['0.1'\]: two parameters have the same key path id"
  elif case.startswith("huge_int"):  # more digits than Python's str() will print
    key, small = (10**5000, 1) if case == "huge_int_key" else (("l", 10**5000), ("l", 1))
    params = {key: jnp.ones(3), small: jnp.ones(2)}
    cls = jr.ReshardError
    needle = f"dict key of type {type(key).__name__} cannot be named: Exceeds the limit"
  else:  # a Python number among the params: no dtype, no shape
    params = {"w": jnp.ones(3), "n": 1.5}
    needle = r"params\['n'\] is a float, not an array"
  state = opt.init(params)
  before = snapshot(params), snapshot(state)
  with pytest.raises(cls, match=needle):
    jr.shard_state(opt, params, state, **kwargs)
  after = snapshot(params), snapshot(state)
  assert before[0][0] == after[0][0] and before[0][1] == after[0][1]
  assert before[1][0] == after[1][0] and before[1][1] == after[1][1]


# --- arguments of the wrong kind: refused by name, never a bare TypeError -----------


def _params_and_state():
  params = {"w": jnp.arange(6.0), "b": jnp.ones(2)}
  return params, OPT.init(params)


@pytest.mark.parametrize(
  "call, needles",
  [
    (lambda r, p, s: jr.plan(r, world_size=True, rank=0), ("world_size", "bool")),
    (lambda r, p, s: jr.plan(r, world_size=3, rank=False), ("rank", "bool")),
    (lambda r, p, s: jr.plan(r, world_size=None, rank=0), ("world_size", "NoneType")),
    (lambda r, p, s: jr.plan(r, world_size="3", rank=0), ("world_size", "str")),
    (
      lambda r, p, s: jr.reshard(
        r, [dataclasses.replace(m, rank=True) for m in jr.plan(r, world_size=3, rank=1)]
      ),
      ("rank", "bool"),
    ),
    (
      lambda r, p, s: jr.reshard(
        r,
        [dataclasses.replace(m, sources=(0, True, 2, 3)) for m in jr.plan(r, world_size=3, rank=1)],
      ),
      ("index True", "bool"),
    ),
    (lambda r, p, s: jr.reshard(r, []), ("no migrations",)),
    (lambda r, p, s: jr.reshard(r, None), ("migrations", "NoneType")),
    (lambda r, p, s: jr.reshard(None, jr.plan(r, world_size=2, rank=0)), ("records", "NoneType")),
    (
      lambda r, p, s: jr.reshard(r[0], jr.plan(r, world_size=2, rank=0)),
      ("records", "ShardRecord"),
    ),
    (lambda r, p, s: jr.reshard_ranks(r, 3), ("plans", "int")),
    (lambda r, p, s: jr.unshard_state(None), ("records", "NoneType")),
    (lambda r, p, s: jr.shard_state(OPT, p, s, world_size=True), ("world_size", "bool")),
    (lambda r, p, s: jr.shard_state(p, OPT, s, world_size=2), ("optimizer", "dict")),
    (lambda r, p, s: jr.shard_state(None, p, s, world_size=2), ("optimizer", "NoneType")),
    (lambda r, p, s: jr.shard_state(OPT, s, p, world_size=2), ("swapped",)),
    (lambda r, p, s: jr.shard_state(OPT, None, s, world_size=2), ("params", "no arrays")),
    (
      lambda r, p, s: jr.shard_state(OPT, p, s, world_size=2, trainable=5),
      ("trainable must map param ids to bools, got int",),
    ),
    (
      lambda r, p, s: jr.shard_state(OPT, {"w": jax.random.key(0)}, s, world_size=2),
      ("param 'w' has dtype key<fry>: params must be the model's float",),
    ),
    (
      lambda r, p, s: jr.save_records("/nonexistent/never", 5),
      ("save_records: records must be an iterable of ShardRecords", "got int"),
    ),
    (
      lambda r, p, s: jr.save_records("/nonexistent/never", r[0]),
      ("save_records: records must be an iterable of ShardRecords", "got ShardRecord"),
    ),
  ],
)
def test_arguments_of_the_wrong_kind_are_refused_by_name(call, needles):
  params, state = _params_and_state()
  records = jr.shard_state(OPT, params, state, world_size=W)
  with pytest.raises(jr.ReshardError) as info:
    call(records, params, state)
  assert all(n in str(info.value) for n in needles), str(info.value)


def test_a_migration_naming_a_key_path_unescaped_hears_the_id(tmp_path):
  # Ids escape "/" inside a key as %2F: the key "dense/b" is the id dense%2Fb.
  from jaxreshard._src.checkpoint import reader as _checkpoint
  from jaxreshard._src.engine import pipeline as _pipeline

  params = {"dense/b": jnp.ones(6), "x": {"y": jnp.ones(4), "50%": jnp.ones(3)}}
  opt = optax.adam(1e-3)
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  assert sorted(p.param for p in records[0].placements) == ["dense%2Fb", "x/50%25", "x/y"]
  jr.save_records(tmp_path / "c", records)
  ckpt = _checkpoint.open_checkpoint(tmp_path / "c")
  cases = [("dense/b", (6,), "'dense%2Fb'"), ("x%2Fy", (4,), "'x/y'"), ("x/50%", (3,), "'x/50%25'")]
  for pid, shape, meant in cases:
    migration = jr.Migration(pid, shape, 0, 3, (0, 1))
    # In memory (one uniform group), sources in another order (checked one by
    # one), and from disk: the same words.
    for call in (
      lambda: jr.reshard(records, [migration]),
      lambda: jr.reshard(records, [dataclasses.replace(migration, sources=(1, 0))]),
      lambda: _pipeline.validate(ckpt, [migration]),
    ):
      with pytest.raises(jr.PlacementError) as info:
        call()
      text = str(info.value)
      assert text.startswith(f"param {pid!r}: source archive ") and "does not list it" in text
      assert f"did you mean {meant}?" in text, text
  with pytest.raises(jr.PlacementError) as info:
    jr.reshard(records, [jr.Migration("nothing/here", (6,), 0, 3, (0, 1))])
  assert str(info.value) == "param 'nothing/here': source archive 0 does not list it"


# --- archives of one state hold their params in one tree -------------------------


_TWO_TREES = {
  "a_list_and_a_tuple": ([np.arange(3.0, dtype=np.float32)], (np.arange(3.0, dtype=np.float32),)),
  "an_empty_node_in_one": (
    {"a": np.arange(3.0, dtype=np.float32), "b": None},
    {"a": np.arange(3.0, dtype=np.float32)},
  ),
  "an_empty_dict_in_one": (
    {"a": np.arange(3.0, dtype=np.float32), "e": {}},
    {"a": np.arange(3.0, dtype=np.float32)},
  ),
}


@pytest.mark.parametrize("case", sorted(_TWO_TREES))
def test_archives_holding_the_same_params_in_two_trees_are_refused_on_every_path(tmp_path, case):
  # Rank 0 of one state and rank 1 of another, the same params and bits in another
  # tree: a target would take its tree from whichever archive it read first.
  from tests._archive_util import set_unchecked

  opt = optax.sgd(0.1, momentum=0.9)
  first, second = _TWO_TREES[case]
  mixed = [
    jr.shard_state(opt, first, opt.init(first), 2)[0],
    jr.shard_state(opt, second, opt.init(second), 2)[1],
  ]
  words = "archives 0 and 1 hold the same params in other trees at state path [0].trace"
  for call in (
    lambda: jr.reshard(mixed, jr.plan(mixed, world_size=3, rank=0)),
    lambda: jr.plan(mixed, world_size=3, rank=0),
    lambda: jr.unshard_state(mixed),
    lambda: jr.save_records(tmp_path / "refused", mixed),
  ):
    with pytest.raises(jr.PlacementError) as info:
      call()
    assert words in str(info.value), str(info.value)
  assert not os.path.lexists(tmp_path / "refused")
  # Written by a save that skips its checks (another writer), every reader refuses it.
  from jaxreshard._src.checkpoint import writer

  no_check = types.SimpleNamespace(check_one_tree=lambda *args: None)
  with set_unchecked(), mock.patch.object(writer, "_archivecheck", no_check):
    jr.save_records(tmp_path / "ckpt", mixed)
  for call in (
    lambda: jr.open_checkpoint(tmp_path / "ckpt"),
    lambda: jr.load_records(tmp_path / "ckpt"),
    lambda: jr.restore(tmp_path / "ckpt", world_size=3, rank=0),
  ):
    with pytest.raises(jr.ArchiveError) as info:
      call()
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("call", ["reshard", "unshard_state", "digest", "save_records"])
def test_09m_a_placement_without_a_dtype_is_refused_as_none_by_every_path(call, tmp_path):
  """``dtype=None`` is a placement without a dtype: refused as None, not as the
  float64 numpy reads None as."""
  records = _records()
  records[1] = _with_placement(records[1], "a", dtype=None)
  with pytest.raises(jr.DtypeError) as info:
    _by_path(call, records, tmp_path / "ckpt", _plan())
  assert "param 'a': archive 1: storage dtype None is not one of" in str(info.value)
  assert "float64" not in str(info.value)
  assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("call", ["reshard", "unshard_state", "digest", "save_records"])
def test_09n_a_param_of_one_group_that_is_a_leaf_above_another_group_s_is_refused(call, tmp_path):
  """Group A holds 'experts' (a leaf), group B 'experts/w': no params tree holds
  both. Every path raised a raw TypeError or IndexError while building the tree,
  and save_records committed the set; each now refuses it by name (``digest``
  lists it among its problems, as it lists every set that is not one state)."""
  opt = optax.sgd(0.1, momentum=0.9)
  a, b = {"experts": jnp.ones((5,))}, {"experts": {"w": jnp.ones((4,))}}
  records = jr.shard_state(opt, a, opt.init(a), 2) + jr.shard_state(opt, b, opt.init(b), 2)
  words = (
    "param 'experts' is a leaf of archive 0's params tree, where archive 2 holds param"
    " 'experts/w' under it: they are not archives of one state"
  )
  if call == "digest":
    assert any(words in p for p in jr.digest(records).problems)
    return
  with pytest.raises(jr.PlacementError) as info:
    _by_path(call, records, tmp_path / "ckpt")
  assert words in str(info.value)
  assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("call", ["reshard", "unshard_state", "save_records"])
def test_09o_a_group_whose_params_tree_is_one_array_joins_no_other(call, tmp_path):
  """Group A's params are one bare array (its id is ""), group B's ``{"w": y}``: no
  tree holds both, and every path built ``{"": x, "w": y}``. Refused now; the
  key "" itself (``{"": x}``) beside ``{"w": y}`` is one tree, and is taken."""
  opt = optax.sgd(0.1, momentum=0.9)
  bare, key, other = jnp.ones((5,)), {"": jnp.ones((5,))}, {"w": jnp.ones((4,))}
  shard = lambda p: jr.shard_state(opt, p, opt.init(p), 2)

  def run(records):
    return _by_path(call, records, tmp_path / f"ckpt{len(os.listdir(tmp_path))}")

  for records in (shard(bare) + shard(other), shard(other) + shard(bare)):
    with pytest.raises(jr.PlacementError, match="params tree is one array, and archive"):
      run(records)
  run(shard(key) + shard(other))


def test_a_user_namedtuple_loaded_and_in_memory_is_refused_saying_why(tmp_path):
  """A NamedTuple state class from outside optax comes back from a checkpoint as a new
  class of its name and fields. Records of such a state loaded beside records made in
  memory are two structures that print alike: the refusal says why, naming both."""
  from typing import NamedTuple  # pylint: disable=g-import-not-at-top

  class Held(NamedTuple):
    step: object
    mu: object

  opt = optax.GradientTransformation(
    lambda p: Held(np.int32(3), jax.tree.map(jnp.zeros_like, p)), lambda g, s, p=None: (g, s)
  )
  pa, pb = {"a": jnp.arange(5.0)}, {"b": jnp.arange(7.0)}
  jr.save_records(tmp_path / "a", jr.shard_state(opt, pa, opt.init(pa), world_size=2))
  loaded = list(jr.load_records(tmp_path / "a"))
  records = loaded + jr.shard_state(opt, pb, opt.init(pb), world_size=3)
  with pytest.raises(jr.PlacementError) as info:
    jr.reshard(records, jr.plan(records, world_size=2, rank=0))
  assert (
    f"(alike in print, but two classes named Held: {__name__}."
    "test_a_user_namedtuple_loaded_and_in_memory_is_refused_saying_why.<locals>.Held and"
    " the one a checkpoint's reader made;"
  ) in str(info.value) or (
    "(alike in print, but two classes named Held: the one a checkpoint's reader made and"
    f" {__name__}.test_a_user_namedtuple_loaded_and_in_memory_is_refused_saying_why"
  ) in str(info.value), info.value
