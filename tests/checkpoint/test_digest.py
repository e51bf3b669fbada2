"""The sharding-independent digest (``jr.digest``, ``jr.compare_digests``) behind ``jaxreshard verify``."""

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxreshard as jr
from tests._core_util import BF16, F16, F32, bits, random_bits_array, replace_history

PARAMS = {
  "dense": {
    "kernel": jnp.arange(39.0, dtype=jnp.float32).reshape(3, 13) - 7.0,
    "bias": jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32),
  },
  "emb": jnp.ones((7,), jnp.bfloat16),
  "scale": jnp.float32(0.5),
}
FROZEN = {"dense": {"kernel": True, "bias": True}, "emb": False, "scale": True}


def _state():
  opt = optax.chain(
    optax.masked(optax.adamw(1e-2, mu_dtype=jnp.bfloat16), FROZEN),
    optax.scale_by_schedule(optax.linear_schedule(1.0, 0.1, 10)),
  )
  # Trained-looking histories (strict dtype promotion rules out a real bf16-mu
  # update here): random values with a NaN and a -0.0 among them; clocks at 2.
  rng = np.random.default_rng(0)

  def fill(x):
    a = np.asarray(x)
    if a.ndim == 0:
      return jnp.asarray(2, a.dtype)
    v = rng.standard_normal(a.shape).astype(a.dtype)
    v.reshape(-1)[:2] = [np.nan, -0.0][: v.size]
    return jnp.asarray(v)

  return opt, jax.tree.map(fill, opt.init(PARAMS))


@pytest.fixture(scope="module")
def layouts():
  opt, state = _state()
  return {w: jr.shard_state(opt, PARAMS, state, w) for w in (1, 6, 8)}


def _flip_low_bit(index):
  def fn(a):
    a.view(f"u{a.dtype.itemsize}")[index] ^= 1
    return a

  return fn


def _set_bits(value):
  def fn(a):
    u = a.view(f"u{a.dtype.itemsize}")
    u[0] = value
    return a

  return fn


def test_equal_across_layouts_and_orders(layouts):
  d1, d6, d8 = (jr.digest(layouts[w]) for w in (1, 6, 8))
  assert d8 == d6 == d1
  assert d8.hexdigest() == d6.hexdigest()
  assert not d8.problems
  # Streaming order does not matter (a generator, reversed: the reorder buffer).
  assert jr.digest(r for r in reversed(layouts[6])) == d8
  # The frozen, masked-out parameter keeps its "no history" in the digest.
  assert d8.params["emb"].history == ("masked", "masked") and not d8.params["emb"].buffers
  assert [b.dtype for b in d8.params["dense/kernel"].buffers] == ["bfloat16", "float32"]
  assert d8.params["dense/kernel"].buffers[0].count == 39


def test_equal_after_reshard(layouts):
  src = layouts[8]
  dst = [jr.reshard(src, jr.plan(src, world_size=6, rank=r)) for r in range(6)]
  assert jr.compare_digests(jr.digest(src), jr.digest(dst)) == []


@pytest.mark.parametrize(
  "pid,m,value",
  [
    ("dense/kernel", 1, None),  # one flipped low bit of a float32 buffer
    ("dense/bias", 1, 0x7FC00001),  # a NaN with a different payload bit
    ("scale", 0, 0x8000),  # -0.0 instead of +0.0 (bf16 mu)
  ],
)
def test_one_bit_changes_digest_and_is_named(layouts, pid, m, value):
  src = list(layouts[6])
  rank = 0
  if value is None:
    fn = _flip_low_bit(3)
  elif pid == "dense/bias":
    src = [
      replace_history(r, pid, m, _set_bits(0x7FC00000)) if i == 0 else r for i, r in enumerate(src)
    ]
    fn = _set_bits(value)
  else:
    src = [
      replace_history(r, pid, m, _set_bits(0x0000)) if i == 0 else r for i, r in enumerate(src)
    ]
    fn = _set_bits(value)
  changed = [replace_history(r, pid, m, fn) if i == rank else r for i, r in enumerate(src)]
  before = np.asarray(jax.tree.leaves(src[rank].state)[0])
  d_before, d_after = jr.digest(src), jr.digest(changed)
  assert d_before != d_after and d_before.hexdigest() != d_after.hexdigest()
  diffs = jr.compare_digests(d_before, d_after)
  assert diffs == [diffs[0]] and f"param {pid!r} buffer {m}: bits differ" in diffs[0]
  assert bits(jax.tree.leaves(src[rank].state)[0]).tobytes() == bits(before).tobytes()


def test_nonzero_padding_is_a_problem(layouts):
  src = list(layouts[8])
  # dense/bias has 5 elements over 8 ranks: rank 6 is all padding.
  src[6] = replace_history(src[6], "dense/bias", 0, _set_bits(0x8000))  # -0.0 in bf16 padding
  d = jr.digest(src)
  assert d.params == jr.digest(layouts[8]).params  # the logical data is unchanged
  assert len(d.problems) == 1 and "param 'dense/bias' buffer 0" in d.problems[0]
  assert "padding is not zero" in d.problems[0] and "rank 6" in d.problems[0]
  assert jr.compare_digests(jr.digest(layouts[6]), d)


def test_clock_structure_and_missing_ranks(layouts):
  src = layouts[8]
  leaves, treedef = jax.tree_util.tree_flatten(src[0].state)
  roles = src[0].roles
  i = roles.index(None)
  later = []
  for r in src:
    ls = jax.tree.leaves(r.state)
    ls[i] = np.asarray(ls[i]) + np.asarray(1, np.asarray(ls[i]).dtype)
    later.append(jr.ShardRecord(1, r.placements, jax.tree_util.tree_unflatten(treedef, ls), roles))
  diffs = jr.compare_digests(jr.digest(src), jr.digest(later))
  assert len(diffs) == 1 and diffs[0].startswith("scalar ")
  # A mixed checkpoint: archives from two steps disagree among themselves.
  assert any("clock" in p for p in jr.digest(src[:4] + later[4:]).problems)
  missing = jr.digest(src[:3] + src[4:])
  assert any("ranks [3] of world size 8 are missing" in p for p in missing.problems)
  # Archives with problems hold no one state: their digest equals none, not even its own
  # (an `assert digest(a) == digest(b)` never passes on an invalid checkpoint).
  assert missing != missing and missing != jr.digest(src[:3] + src[4:])
  assert jr.digest(src) == jr.digest(src) and jr.digest(src) != missing
  other = jr.shard_state(
    optax.sgd(0.1, momentum=0.9), PARAMS, optax.sgd(0.1, momentum=0.9).init(PARAMS), 8
  )
  assert "optimizer state structure differs" in jr.compare_digests(jr.digest(src), jr.digest(other))


def test_params_at_other_key_paths_are_another_state():
  """``{0: w}``, ``{"0": w}`` and ``[w]`` all hold param "0" with the same bits, in
  three different trees: three states, told apart by each param's key path."""
  opt = optax.sgd(0.1, momentum=0.9)
  w = np.arange(3, dtype=np.float32)
  digests = {}
  for name, params in (
    ("int", {0: w}),
    ("str", {"0": w}),
    ("list", [w]),
    ("tuple", (w,)),
    ("nested", {"a": [w]}),
  ):
    state = jax.tree.map(lambda x: x + 1.5, opt.init(params))
    digests[name] = jr.digest(jr.shard_state(opt, params, state, 2))
  paths = {name: d.params[next(iter(d.params))].path for name, d in digests.items()}
  assert paths == {
    "int": "{0}",
    "str": "{'0'}",
    "list": "[0]",
    "tuple": "(0)",
    "nested": "{'a'}[0]",
  }
  assert jr.compare_digests(digests["int"], digests["str"]) == ["param '0': key path {0} != {'0'}"]
  assert jr.compare_digests(digests["int"], digests["list"]) == ["param '0': key path {0} != [0]"]
  assert jr.compare_digests(digests["list"], digests["tuple"]) == ["param '0': key path [0] != (0)"]
  assert len({d.hexdigest() for d in digests.values()}) == 5
  # Archives of one checkpoint that disagree on it are a problem of that checkpoint.
  for first, second in (({0: w}, {"0": w}), ([w], (w,))):
    mixed = [
      jr.shard_state(opt, params, jax.tree.map(lambda x: x + 1.5, opt.init(params)), 2)[r]
      for r, params in ((0, first), (1, second))
    ]
    assert any("key path" in p for p in jr.digest(mixed).problems)


def _empty_node_states():
  """One Adam state of ``w`` in params trees that differ only where no param is."""
  opt = optax.adam(1e-3)
  w = np.arange(5, dtype=np.float32) - 2.5
  trees = {
    "plain": {"w": w},
    "empty dict": {"w": w, "e": {}},
    "None": {"w": w, "e": None},
    "empty list": {"w": w, "e": []},
  }
  # The count 1, mu and nu off zero (each in its own dtype: strict promotion).
  bump = lambda x: x + jnp.asarray(1, x.dtype)  # noqa: E731
  return opt, {name: (p, jax.tree.map(bump, opt.init(p))) for name, p in trees.items()}


def test_containers_that_hold_no_param_are_part_of_the_state(tmp_path):
  """``{"w": w, "e": {}}`` and ``{"w": w}`` hold the same param at the same key path,
  and ``unshard_state`` gives them back as two trees: two states. Each is one
  state at any world size, on disk, after a reshard and read in any order."""
  opt, states = _empty_node_states()
  digests = {}
  for name, (params, state) in states.items():
    two, three = (jr.shard_state(opt, params, state, w) for w in (2, 3))
    d = jr.digest(two)
    assert d == jr.digest(three) and not d.problems, name
    five = jr.reshard_ranks(two, [jr.plan(two, world_size=5, rank=r) for r in range(5)])
    assert jr.digest(five) == d, name
    path = str(tmp_path / name.replace(" ", "_"))
    jr.save_records(path, three)
    loaded = jr.load_records(path)
    # Rank 0 last: the later ranks of a layout are digested from their packed buffers.
    assert jr.digest(path) == d and jr.digest(loaded[::-1]) == d, name
    assert jax.tree.structure(jr.unshard_state(loaded)) == jax.tree.structure(state), name
    digests[name] = d
  assert len({d.hexdigest() for d in digests.values()}) == len(digests)
  for name in ("empty dict", "None", "empty list"):
    lines = jr.compare_digests(digests["plain"], digests[name])
    assert len(lines) == 2, lines  # mu and nu
    assert lines[0].startswith("params tree at [0].mu: the nested dicts of its param ids != ")
    assert "'e'" in lines[0], lines
  assert jr.compare_digests(digests["empty dict"], digests["None"]) == [
    "params tree at [0].mu: PyTreeDef({'e': {}, 'w': *}) != PyTreeDef({'e': None, 'w': *})",
    "params tree at [0].nu: PyTreeDef({'e': {}, 'w': *}) != PyTreeDef({'e': None, 'w': *})",
  ]


def test_archives_whose_trees_differ_where_no_param_is_are_not_one_state():
  """Rank 0 of one tree and rank 1 of the other: every reshard refuses them, and
  their digest lists that problem (equal to neither state's)."""
  opt, states = _empty_node_states()
  a, b = (jr.shard_state(opt, *states[name], 2) for name in ("empty dict", "plain"))
  for mixed in ([a[0], b[1]], [b[0], a[1]]):
    with pytest.raises(jr.PlacementError, match="hold the same params in other trees"):
      jr.unshard_state(mixed)
    d = jr.digest(mixed)
    assert [p for p in d.problems if "other trees at state path [0].mu" in p], d.problems
    assert d != jr.digest(a) and d != jr.digest(b)


def test_a_digest_with_problems_never_shares_a_hexdigest_with_one_without():
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"a": np.arange(5, dtype=np.float32)}
  records = jr.shard_state(opt, params, jax.tree.map(lambda x: x + 1.0, opt.init(params)), 4)
  full, missing = jr.digest(records), jr.digest(records[:3])  # rank 3 holds only padding
  assert missing.problems == ("param 'a': ranks [3] of world size 4 are missing",)
  assert full != missing and full.hexdigest() != missing.hexdigest()
  assert full.hexdigest() == jr.digest(records).hexdigest()


@pytest.mark.parametrize(
  "call, words",
  [
    (
      lambda d, r: jr.digest(None),
      "digest (of a checkpoint directory, str or os.PathLike, or of records): records must be"
      " an iterable of ShardRecords (a list: one per rank), got NoneType",
    ),
    (lambda d, r: jr.digest(r[0]), "records must be an iterable of ShardRecords"),
    (lambda d, r: jr.compare_digests(d, None), "compare_digests: b must be a Digest, got NoneType"),
    (lambda d, r: jr.compare_digests("x", d), "compare_digests: a must be a Digest, got str"),
    (
      lambda d, r: jr.compare_digests(d, d, names=("x",)),
      "compare_digests: names must be two strings, got ('x',)",
    ),
  ],
)
def test_digest_arguments_of_the_wrong_kind_are_refused_by_name(call, words):
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"a": np.arange(5, dtype=np.float32)}
  records = jr.shard_state(opt, params, opt.init(params), 2)
  with pytest.raises(jr.ReshardError) as info:
    call(jr.digest(records), records)
  assert words in str(info.value), str(info.value)


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(
  shapes=st.lists(
    st.sampled_from([(), (1,), (0,), (7,), (3, 5), (17,), (2, 2, 3)]), min_size=1, max_size=3
  ),
  dtype=st.sampled_from([F32, F16, BF16]),
  w1=st.integers(1, 9),
  w2=st.integers(1, 9),
  seed=st.integers(0, 2**16),
)
def test_digest_property_any_two_layouts(shapes, dtype, w1, w2, seed):
  rng = np.random.default_rng(seed)
  params = {f"p{i}": jnp.asarray(random_bits_array(rng, s, dtype)) for i, s in enumerate(shapes)}
  opt = optax.sgd(0.1, momentum=0.9)
  state = jax.tree.map(
    lambda x: jnp.asarray(random_bits_array(rng, x.shape, x.dtype)) if x.ndim else x,
    opt.init(params),
  )
  a = jr.digest(jr.shard_state(opt, params, state, w1))
  b = jr.digest(jr.shard_state(opt, params, state, w2))
  assert jr.compare_digests(a, b) == [] and a.hexdigest() == b.hexdigest()
  # One random bit of one buffer (when there is any element) is always seen.
  nonempty = [k for k, s in zip(params, shapes) if math.prod(s)]
  if nonempty:
    pid = nonempty[rng.integers(len(nonempty))]
    flat = np.asarray(state[0].trace[pid]).reshape(-1).copy()
    u = flat.view(f"u{flat.dtype.itemsize}")
    u[rng.integers(flat.size)] ^= np.asarray(
      1 << int(rng.integers(8 * flat.dtype.itemsize)), u.dtype
    )
    trace = dict(state[0].trace, **{pid: jnp.asarray(flat.reshape(shapes[int(pid[1:])]))})
    changed = (state[0]._replace(trace=trace),) + tuple(state[1:])
    diffs = jr.compare_digests(a, jr.digest(jr.shard_state(opt, params, changed, w2)))
    assert len(diffs) == 1 and diffs[0].startswith(f"param {pid!r} buffer 0: bits differ")


def test_digest_of_a_directory_equals_the_digest_of_its_records(layouts, tmp_path):
  jr.save_records(tmp_path / "six", layouts[6])
  from_dir = jr.digest(tmp_path / "six")
  assert from_dir == jr.digest(str(tmp_path / "six")) == jr.digest(layouts[8])
  assert from_dir.problems == () and jr.compare_digests(from_dir, jr.digest(layouts[1])) == []
  # The digest hashes the saved bits themselves: every loaded buffer is those bits.
  loaded = jr.load_records(tmp_path / "six")
  for a, b in zip(loaded, layouts[6]):
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)):
      np.testing.assert_array_equal(bits(x), bits(y))


def test_compare_digests_names_its_sides(layouts):
  src = layouts[6]
  diffs = jr.compare_digests(jr.digest(src), jr.digest(src[:5]), names=("old", "new"))
  assert any(d.startswith("new: ") and "missing" in d for d in diffs)
  assert not any(d.startswith("old: ") for d in diffs)


def test_a_clock_scalar_s_weak_type_is_part_of_the_digest(tmp_path):
  """Two checkpoints whose counts differ only in their weak type load as different
  states (a weak scalar promotes as a Python number does): not identical."""
  import jax.numpy as jnp
  import optax

  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": jnp.ones((5,), jnp.float32)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)

  def with_step(step):
    state = lambda r: {"trace": r.state[0].trace, "step": step}  # noqa: E731
    return [jr.ShardRecord(r.version, r.placements, state(r)) for r in records]

  weak, strong = with_step(jnp.asarray(3)), with_step(jnp.asarray(3, jnp.int32))
  assert weak[0].state["step"].weak_type and not strong[0].state["step"].weak_type
  jr.save_records(tmp_path / "weak", weak)
  assert jr.compare_digests(jr.digest(weak), jr.digest(tmp_path / "weak")) == []
  lines = jr.compare_digests(jr.digest(tmp_path / "weak"), jr.digest(strong))
  assert len(lines) == 1 and "weak" in lines[0] and "step" in lines[0], lines


def test_a_python_number_in_the_clock_is_weak_as_jax_makes_it_and_saves_as_before(tmp_path):
  """jax promotes a Python float as weakly typed (``jnp.asarray(0.1).weak_type``): the
  digest says so, and tells it from a strong float64 of the same bits (they restore
  as different values: a Python float and a numpy scalar). The checkpoint stores the
  Python number as it always did, with no weak type of its own."""
  from tests._archive_util import read_json

  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": jnp.ones((5,), jnp.float32)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)

  def with_lr(lr):
    state = lambda r: {"trace": r.state[0].trace, "lr": lr}  # noqa: E731
    return [jr.ShardRecord(r.version, r.placements, state(r)) for r in records]

  python, strong = with_lr(0.1), with_lr(np.float64(0.1))
  assert jnp.asarray(0.1).weak_type
  assert [s[1] for s in jr.digest(python).scalars] == ["float64() weak"]
  assert [s[1] for s in jr.digest(strong).scalars] == ["float64()"]
  jr.save_records(tmp_path / "py", python)
  assert jr.compare_digests(jr.digest(python), jr.digest(tmp_path / "py")) == []
  lines = jr.compare_digests(jr.digest(tmp_path / "py"), jr.digest(strong))
  assert lines == ["scalar ['lr']: 0.1 (weak) != 0.1 (not weak)"], lines
  assert read_json(tmp_path / "py" / "jaxreshard.json")["clocks"] == [
    [{"py": "float", "v": (0.1).hex()}]
  ]
  loaded = jr.load_records(tmp_path / "py")[0].state["lr"]
  assert type(loaded) is float and loaded == 0.1


def test_archives_whose_clock_scalar_differs_only_in_weak_type_are_refused_on_every_path(tmp_path):
  """The digest tells a weak clock scalar from a strong one of the same bits, so
  archives of the two are two steps: every path refuses the mix (it took the
  template's weak type), and a checkpoint holding both does not load."""
  from tests._archive_util import set_unchecked

  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
  params = {"w": jnp.arange(5.0, dtype=jnp.float32)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)

  def with_lr(r, lr):
    hyper = dict(r.state.hyperparams, learning_rate=lr)
    return dataclasses.replace(r, state=r.state._replace(hyperparams=hyper))

  weak = [with_lr(r, jnp.asarray(0.1)) for r in records]
  strong = [with_lr(r, jnp.float32(0.1)) for r in records]
  assert jr.digest(weak) != jr.digest(strong)
  mixed = [weak[0], strong[1]]
  for call in (
    lambda: jr.reshard(mixed, jr.plan(mixed, world_size=1, rank=0)),
    lambda: jr.unshard_state(mixed),
    lambda: jr.save_records(tmp_path / "refused", mixed),
  ):
    with pytest.raises(jr.PlacementError, match=r"learning_rate.*\(not weak\).*\(weak\)"):
      call()
  assert not (tmp_path / "refused").exists()
  assert any("learning_rate" in p for p in jr.digest(mixed).problems)
  with set_unchecked():
    jr.save_records(tmp_path / "mixed", mixed)
  with pytest.raises(jr.ReshardError, match="learning_rate"):
    jr.restore_ranks(tmp_path / "mixed", range(2), world_size=2)
  assert jr.digest(tmp_path / "mixed").problems
  # One weak type throughout is one state, bit for bit.
  out = jr.reshard(weak, jr.plan(weak, world_size=3, rank=1))
  lr = out.state.hyperparams["learning_rate"]
  assert lr.weak_type and bits(lr) == bits(weak[0].state.hyperparams["learning_rate"])


def test_archives_whose_state_classes_differ_only_by_class_are_a_problem(tmp_path):
  """A NamedTuple of optax's name and fields that is another class is another state
  structure to every reshard and a save; the digest, which prints a tree by its
  classes' names, must not call such archives one state."""
  import collections

  opt = optax.adam(1e-3)
  params = {"w": jnp.arange(5.0, dtype=jnp.float32)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  twin = collections.namedtuple("ScaleByAdamState", ["count", "mu", "nu"])
  other = dataclasses.replace(
    records[1], state=(twin(*records[1].state[0]),) + tuple(records[1].state[1:])
  )
  mixed = [records[0], other]
  for call in (
    lambda: jr.reshard(mixed, jr.plan(mixed, world_size=1, rank=0)),
    lambda: jr.save_records(tmp_path / "refused", mixed),
  ):
    with pytest.raises(jr.PlacementError, match="optimizer state structure"):
      call()
  d = jr.digest(mixed)
  assert d.problems == ("archive 1: optimizer state structure differs from archive 0",)
  assert d != jr.digest(records)
  assert jr.digest(records).problems == ()


class _Sgd(NamedTuple):
  count: Any
  trace: Any


def _invalid_records(case):
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": np.arange(6, dtype=np.float32)}
  base = jr.shard_state(opt, params, opt.init(params), world_size=2)
  if case == "int32_history":
    return [
      jr.ShardRecord(1, r.placements, _Sgd(np.int32(0), {"w": np.arange(3, dtype=np.int32)}))
      for r in base
    ]
  if case == "record_version_2":
    return [jr.ShardRecord(2, r.placements, r.state) for r in base]
  return [  # storage_dtype_float64
    jr.ShardRecord(
      1, tuple(dataclasses.replace(q, dtype=np.dtype("float64")) for q in r.placements), r.state
    )
    for r in base
  ]


@pytest.mark.parametrize("case", ["int32_history", "record_version_2", "storage_dtype_float64"])
def test_digest_refuses_what_every_reshard_refuses_of_an_archive_alone(case):
  # A digest equal to a valid set's, of archives nothing can read, would say they
  # hold that state.
  records = _invalid_records(case)
  with pytest.raises(jr.ReshardError) as by_reshard:
    jr.reshard(records, jr.plan(records, world_size=3, rank=0))
  with pytest.raises(type(by_reshard.value)) as by_digest:
    jr.digest(records)
  words = {
    "int32_history": "history buffer dtype int32 is not a floating dtype",
    "record_version_2": "param 'w': archive 0 has record version 2, which is not supported",
    "storage_dtype_float64": "param 'w': archive 0: storage dtype float64 is not one of",
  }[case]
  assert words in str(by_reshard.value) and words in str(by_digest.value), (by_digest.value,)
