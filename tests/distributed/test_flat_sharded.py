"""flat_sharded: optax on flat shards over a mesh axis equals optax on the params.

Exactness is checked on bits, with both optimizers run op by op
(``jax.disable_jit``), for chains of multiplies, adds, signs and selects. Chains
that divide by a broadcast scalar (adam's bias correction) and jitted runs are
compared to rounding: XLA's CPU backend compiles such a division differently
for a one-element shard than for a longer array, and contracts multiply-adds
into FMAs or not depending on how it fused the program (the unwrapped optimizer
jitted differs from itself op by op; ``test_jitted_optax_differs_from_itself_op_by_op``). Meshes: 8 devices along "fsdp", (2, 4)
with "fsdp" the size-4 axis, and 3 or 5 devices (sizes that divide none of the
params), each with explicit axes (``jax.make_mesh``'s default) and Auto axes.
The params have a size not divisible by any M (35), one smaller than M (7: the
trailing ranks are all padding), a scalar, a size-1 param and bf16 params.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard._src.core import structure as _structure
from tests._core_util import (
  F32,
  LABELS,
  MASK,
  SCHEDULE,
  assert_bits_equal,
  assert_trees_bit_equal,
  bits,
  count_xla_compiles,
  random_grads,
  random_params,
  standard,
)
from tests._shapes import SMALL_MIXED_SHAPES

SHAPES = SMALL_MIXED_SHAPES

# Elementwise chains of multiplies, adds, signs and selects: bit for bit.
EXACT = {
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
  "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
  "lion": lambda: optax.lion(1e-3, weight_decay=0.1),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.sgd)(
    learning_rate=SCHEDULE, momentum=0.9
  ),
  "masked": lambda: optax.masked(optax.lion(1e-3, weight_decay=0.1), MASK),
  "multi_transform": lambda: optax.multi_transform(
    {"train": optax.sgd(1e-2, momentum=0.9), "frozen": optax.set_to_zero()}, LABELS
  ),
  "multi_steps": lambda: optax.MultiSteps(optax.sgd(1e-2, momentum=0.9), every_k_schedule=2),
}
# Elementwise chains that divide by a broadcast scalar (adam's bias correction),
# which XLA's CPU compiler turns into a multiplication by the reciprocal for
# arrays longer than one element: bit for bit too, because a param of at most
# M elements is updated on its own elements, as the unwrapped optimizer does.
DIVIDING = {
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "adamw_mu_bf16": lambda: optax.adamw(1e-2, mu_dtype=jnp.bfloat16),
  "adagrad": lambda: optax.adagrad(1e-2, initial_accumulator_value=0.1),
  "inject_hyperparams_adamw": lambda: optax.inject_hyperparams(optax.adamw)(
    learning_rate=SCHEDULE, weight_decay=0.01
  ),
  "masked_adam": lambda: optax.masked(optax.adam(1e-2), MASK),
  "multi_transform_adamw": lambda: optax.multi_transform(
    {"train": optax.adamw(1e-2), "frozen": optax.set_to_zero()}, LABELS
  ),
  "multi_steps_adam": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}


def _labels_by_walk(p):
  """Labels by a walk over the params' dicts: "matrix" for a leaf of 2 dims or more."""
  if isinstance(p, dict):
    return {k: _labels_by_walk(v) for k, v in p.items()}
  return "matrix" if p.ndim > 1 else "vector"


# Mask and label *functions* that depend on shapes: they see the params' own
# shapes, so "decay only matrices" decays the same params as unwrapped.
MATRICES = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
MASK_FUNCTIONS = {
  "adamw_mask_fn": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=MATRICES),
  "masked_fn_lion": lambda: optax.masked(optax.lion(1e-3, weight_decay=0.1), MATRICES),
  "multi_transform_label_fn": lambda: optax.multi_transform(
    {"matrix": optax.adamw(1e-2, weight_decay=0.1), "vector": optax.sgd(1e-2, momentum=0.9)},
    lambda p: jax.tree.map(lambda x: "matrix" if x.ndim > 1 else "vector", p),
  ),
  "nested_chain_mask_fns": lambda: optax.chain(
    optax.masked(
      optax.chain(optax.trace(0.9), optax.add_decayed_weights(0.1, MATRICES)),
      lambda p: jax.tree.map(lambda x: x.size > 1, p),
    ),
    optax.scale(-1e-2),
  ),
  "inject_static_mask": lambda: optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
    learning_rate=1e-2, weight_decay=0.1, mask=MATRICES
  ),
  "multi_steps_mask_fn": lambda: optax.MultiSteps(
    optax.adamw(1e-2, weight_decay=0.1, mask=MATRICES), every_k_schedule=2
  ),
  # Label functions that walk the params' structure (flax's documented way to
  # freeze part of a model, and a loop over a dict's keys), which optax's
  # placeholder (the params in ``tree_map_params``) is not: labels of it come
  # back without the function being called.
  "multi_transform_path_aware_labels": lambda: optax.multi_transform(
    {"matrix": optax.adamw(1e-2, weight_decay=0.1), "other": optax.sgd(1e-2, momentum=0.9)},
    lambda p: traverse_util.path_aware_map(
      lambda path, x: "matrix" if x.ndim > 1 and path[0] != "emb" else "other", p
    ),
  ),
  "multi_transform_labels_by_walk": lambda: optax.multi_transform(
    {"matrix": optax.adamw(1e-2, weight_decay=0.1), "vector": optax.sgd(1e-2, momentum=0.9)},
    _labels_by_walk,
  ),
}
# Whole-parameter or whole-tree reductions: equal to float rounding.
REDUCING = {
  "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
  "lamb": lambda: optax.lamb(1e-2, weight_decay=0.1),
  # Step sizes from dot products over the whole state: op by op on explicit axes, a
  # dot of two sharded flat buffers has no layout jax picks; it runs on Auto axes.
  "prodigy": lambda: optax.contrib.prodigy(1.0),
  "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1.0),
}


# Every test here is slow: `pytest -m "not slow"` skips them, plain `pytest` runs them.
pytestmark = pytest.mark.slow


def _mesh(kind):
  devices = jax.devices()
  if kind == "explicit8":
    return jax.make_mesh((8,), ("fsdp",))
  if kind == "auto8":
    return jax.sharding.Mesh(np.array(devices), ("fsdp",))
  if kind == "explicit2x4":
    return jax.make_mesh((2, 4), ("data", "fsdp"))
  if kind == "auto2x4":
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  if kind == "explicit5":
    return jax.make_mesh((5,), ("fsdp",), devices=devices[:5])
  if kind == "auto5":
    return jax.sharding.Mesh(np.array(devices[:5]), ("fsdp",))
  if kind == "explicit3":
    return jax.make_mesh((3,), ("fsdp",), devices=devices[:3])
  raise ValueError(kind)


def _shapes(params):
  ids, leaves, _ = _structure.param_ids(params)
  return dict(zip(ids, leaves))


def _run(inner, wrapped, params, steps=3, jit=False):
  """Both optimizers for ``steps`` steps on the same grads; per-step updates.

  ``jit``: each update jitted; otherwise every operation runs by itself.
  """
  wrap = jax.jit if jit else (lambda f: f)
  upd_ref, upd_flat = wrap(inner.update), wrap(wrapped.update)
  with contextlib.ExitStack() as stack:
    if not jit:
      stack.enter_context(jax.disable_jit())
    ref_state, flat_state = standard(inner.init, params), standard(wrapped.init, params)
    p_ref = p_flat = params
    out = []
    for step in range(steps):
      u_ref, ref_state = standard(upd_ref, random_grads(params, step), ref_state, p_ref)
      u_flat, flat_state = standard(upd_flat, random_grads(params, step), flat_state, p_flat)
      out.append((u_ref, u_flat))
      p_ref = standard(optax.apply_updates, p_ref, u_ref)
      p_flat = standard(optax.apply_updates, p_flat, u_flat)
  return out, ref_state, flat_state, p_ref


def _assert_close(actual, expected, rtol):
  """Same structure, dtypes and shapes; values to ``rtol`` (bf16: 2**-7)."""
  la, ta = jax.tree_util.tree_flatten(actual)
  le, te = jax.tree_util.tree_flatten(expected)
  assert ta == te
  for a, e in zip(la, le):
    assert a.dtype == e.dtype and a.shape == e.shape
    tol = max(rtol, 2.0**-7) if a.dtype == jnp.bfloat16 else rtol
    a64, e64 = np.asarray(a, np.float64), np.asarray(e, np.float64)
    np.testing.assert_allclose(a64, e64, rtol=tol, atol=tol * np.max(np.abs(e64), initial=0.0))


def _check_layout(inner, state, params, mesh, axis="fsdp"):
  """Histories: (M * slots,) over ``axis``, padding exactly zero; scalars replicated."""
  world = mesh.shape[axis]
  shapes = _shapes(params)
  roles = _structure.history_roles(inner, params, state)
  sharded, replicated = NamedSharding(mesh, P(axis)), NamedSharding(mesh, P())
  n_hist = 0
  for leaf, pid in zip(jax.tree.leaves(state), roles):
    if pid is None:
      assert leaf.sharding.is_equivalent_to(replicated, leaf.ndim), leaf.sharding
      continue
    n_hist += 1
    g = jr.FlatShard(shapes[pid].shape, 0, world)
    assert leaf.shape == (world * g.slots,), (pid, leaf.shape)
    # An empty history has no element to place: under jit on Auto axes XLA
    # returns it replicated, which saves and restores alike.
    assert leaf.sharding.is_equivalent_to(sharded, 1) or not g.count, (pid, leaf.sharding)
    for shard in leaf.addressable_shards:
      assert shard.data.shape == (g.slots,)
    assert not np.any(bits(leaf)[g.count :]), f"param {pid!r}: padding is not zero"
  assert n_hist > 0
  return n_hist


def _check_exact(name, factory, mesh_kind):
  mesh = _mesh(mesh_kind)
  inner = factory()
  wrapped = jr.flat_sharded(inner, mesh, axis="fsdp")
  params = random_params(SHAPES)
  steps, ref_state, flat_state, p_ref = _run(inner, wrapped, params)
  for u_ref, u_flat in steps:
    assert_trees_bit_equal(u_flat, u_ref)
  _check_layout(inner, flat_state, params, mesh)
  # The state is exactly the flat-shard layout of the unwrapped optimizer's state.
  expected = jr.shard_to_mesh(inner, p_ref, ref_state, mesh).state
  assert_trees_bit_equal(flat_state, expected)


def _check_close(factory, mesh_kind, rtol, jit=False):
  """Updates and the final state of ``flat_sharded(factory())`` equal optax's to ``rtol``."""
  mesh = _mesh(mesh_kind)
  inner = factory()
  params = random_params(SHAPES)
  steps, ref_state, flat_state, _ = _run(inner, jr.flat_sharded(inner, mesh), params, jit=jit)
  for u_ref, u_flat in steps:
    _assert_close(u_flat, u_ref, rtol=rtol)
  _check_layout(inner, flat_state, params, mesh)
  _assert_close(jr.gather_from_mesh(inner, flat_state, _shapes(params), mesh), ref_state, rtol)


@pytest.mark.parametrize("mesh_kind", ["explicit2x4", "auto5"])
@pytest.mark.parametrize("name", sorted(EXACT) + sorted(DIVIDING))
def test_elementwise_chains_are_bit_exact(name, mesh_kind):
  _check_exact(name, {**EXACT, **DIVIDING}[name], mesh_kind)


@pytest.mark.parametrize("mesh_kind", ["explicit8", "auto8", "auto2x4", "explicit5", "explicit3"])
@pytest.mark.parametrize("name", ["lion", "multi_transform", "adamw", "inject_hyperparams_adamw"])
def test_bit_exact_on_every_mesh(name, mesh_kind):
  _check_exact(name, {**EXACT, **DIVIDING}[name], mesh_kind)


@pytest.mark.parametrize("mesh_kind", ["explicit2x4", "auto5"])
@pytest.mark.parametrize("name", sorted(REDUCING))
def test_reductions_agree_to_rounding(name, mesh_kind):
  _check_close(REDUCING[name], mesh_kind, rtol=1e-5)


@pytest.mark.parametrize("mesh_kind", ["explicit8", "auto2x4", "explicit5", "auto5"])
@pytest.mark.parametrize("name", ["adamw", "lion", "multi_steps_adam", "clip_by_global_norm"])
def test_jitted_updates_agree_to_rounding(name, mesh_kind):
  _check_close({**EXACT, **DIVIDING, **REDUCING}[name], mesh_kind, rtol=1e-5, jit=True)


def test_jitted_optax_differs_from_itself_op_by_op():
  """Why jitted runs are compared to rounding: fusion alone changes last bits."""
  inner = optax.adamw(1e-2, weight_decay=0.1)
  params = random_params(SHAPES)
  jitted = _run(inner, inner, params, jit=True)[0]
  op_by_op = _run(inner, inner, params)[0]
  differ = sum(
    int(np.sum(bits(a) != bits(b)))
    for (a_tree, _), (b_tree, _) in zip(jitted, op_by_op)
    for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree))
  )
  if differ == 0:
    pytest.skip("this XLA build fuses without changing bits; nothing to show")
  for (a, _), (b, _) in zip(jitted, op_by_op):
    _assert_close(a, b, rtol=1e-5)


@pytest.mark.parametrize("mesh_kind", ["explicit8", "auto2x4", "explicit5"])
@pytest.mark.parametrize(
  "name", ["adam", "adagrad", "multi_transform_adamw", "inject_hyperparams_adamw"]
)
def test_init_equals_shard_to_mesh(name, mesh_kind):
  mesh = _mesh(mesh_kind)
  inner = DIVIDING[name]()
  params = random_params(SHAPES)
  state = standard(jr.flat_sharded(inner, mesh).init, params)
  expected = jr.shard_to_mesh(inner, params, standard(inner.init, params), mesh).state
  assert_trees_bit_equal(state, expected)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


@pytest.mark.parametrize("mesh_kind", ["explicit2x4", "auto5"])
def test_save_sharded_restore_sharded_round_trip(mesh_kind, tmp_path):
  mesh = _mesh(mesh_kind)
  inner = DIVIDING["inject_hyperparams_adamw"]()
  wrapped = jr.flat_sharded(inner, mesh)
  params = random_params(SHAPES)
  _, _, state, _ = _run(inner, wrapped, params, steps=2)
  shapes = _shapes(params)
  jr.save_sharded(tmp_path / "ckpt", inner, state, shapes, mesh, axis="fsdp")
  restored, placements = jr.restore_sharded(tmp_path / "ckpt", mesh, axis="fsdp")
  assert_trees_bit_equal(restored, state)
  assert {p.param: p.dtype for p in placements[0]} == {
    pid: np.dtype(x.dtype) for pid, x in shapes.items()
  }
  # The restored state trains on exactly as the saved one.
  update = jax.jit(wrapped.update)
  grads = random_grads(params, 7)
  assert_trees_bit_equal(
    standard(update, grads, restored, params), standard(update, grads, state, params)
  )


def test_init_and_update_inside_jit_and_eagerly_agree():
  mesh = _mesh("auto8")
  inner = optax.lion(1e-3, weight_decay=0.1)
  wrapped = jr.flat_sharded(inner, mesh)
  params = random_params(SHAPES)
  jit_state = standard(jax.jit(wrapped.init), params)
  eager_state = standard(wrapped.init, params)
  assert_trees_bit_equal(jit_state, eager_state)
  _check_layout(inner, jit_state, params, mesh)
  # Eagerly, with grads on one device: updates come back on the grads' device.
  grads = jax.device_put(random_grads(params, 0), jax.devices()[0])
  u_eager, s_eager = standard(wrapped.update, grads, eager_state, params)
  with jax.disable_jit():
    u_ref, _ = standard(inner.update, grads, standard(inner.init, params), params)
  assert_trees_bit_equal(u_eager, u_ref)
  for u, g in zip(jax.tree.leaves(u_eager), jax.tree.leaves(grads)):
    assert u.sharding == g.sharding
  _check_layout(inner, s_eager, params, mesh)


@pytest.mark.parametrize("axis_types", [(AxisType.Explicit,) * 2, (AxisType.Auto,) * 2])
def test_grads_sharded_over_another_axis(axis_types):
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=axis_types)
  rng = np.random.default_rng(3)
  # Leading dimensions divisible by the "data" axis, sizes by no M.
  params = {
    "w": jnp.asarray(rng.standard_normal((6, 5)), jnp.float32),
    "v": jnp.asarray(rng.standard_normal((2,)), jnp.float32),
  }
  by_data = NamedSharding(mesh, P("data"))
  inner = optax.adamw(1e-2, weight_decay=0.1)
  wrapped = jr.flat_sharded(inner, mesh)
  p_sharded = jax.device_put(params, by_data)
  state = standard(wrapped.init, p_sharded)
  ref_state = standard(inner.init, params)
  for step in range(2):
    grads = jax.device_put(random_grads(params, step), by_data)
    updates, state = standard(jax.jit(wrapped.update), grads, state, p_sharded)
    u_ref, ref_state = standard(
      jax.jit(inner.update), random_grads(params, step), ref_state, params
    )
    _assert_close(updates, u_ref, rtol=1e-5)
    if axis_types[0] == AxisType.Explicit:  # the updates' type is the grads' type
      for u in jax.tree.leaves(updates):
        assert u.sharding.is_equivalent_to(by_data, u.ndim), u.sharding
  _check_layout(inner, state, params, mesh)


def _weak_tree(step):
  """Params or grads where a Python scalar made two leaves weakly typed (as
  ``jnp.asarray(0.7)`` or ``jnp.full(shape, 0.25)`` do), beside a strong one."""
  rng = np.random.default_rng(50 + step)
  return {
    "temperature": jnp.asarray(float(rng.standard_normal())),
    "bias": jnp.full((7,), float(rng.standard_normal())),
    "w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32),
  }


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("mesh_kind", ["explicit5", "auto5"])
def test_weakly_typed_params_step_as_optax_steps_them(mesh_kind, jit):
  mesh = _mesh(mesh_kind)
  inner = optax.adam(1e-2)
  wrapped = jr.flat_sharded(inner, mesh)
  params = _weak_tree(0)
  assert [x.weak_type for x in jax.tree.leaves(params)] == [True, True, False]
  wrap = jax.jit if jit else (lambda f: f)
  state, ref_state = standard(wrapped.init, params), standard(inner.init, params)
  for step in range(3):
    grads = _weak_tree(step + 1)
    updates, state = standard(wrap(wrapped.update), grads, state, params)
    u_ref, ref_state = standard(wrap(inner.update), grads, ref_state, params)
    assert_trees_bit_equal(updates, u_ref)
    assert [u.weak_type for u in jax.tree.leaves(updates)] == [
      u.weak_type for u in jax.tree.leaves(u_ref)
    ]
    # The state's types are optax's (which makes ``nu`` strong at the first step).
    assert [x.weak_type for x in jax.tree.leaves(state)] == [
      x.weak_type for x in jax.tree.leaves(ref_state)
    ]
  _check_layout(inner, state, params, mesh)
  assert_trees_bit_equal(state, jr.shard_to_mesh(inner, params, ref_state, mesh).state)
  gathered = jr.gather_from_mesh(inner, state, _shapes(params), mesh)
  assert_trees_bit_equal(gathered, ref_state)
  assert [x.weak_type for x in jax.tree.leaves(gathered)] == [
    x.weak_type for x in jax.tree.leaves(ref_state)
  ]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("mesh_kind", ["explicit8", "auto8"])
@pytest.mark.parametrize("name", ["multi_steps_adam", "adam"])
def test_params_of_one_slot_per_rank_step_in_their_own_shape(name, mesh_kind, jit):
  # A 0-d param is computed as a 0-d array, as optax computes it (XLA gives a zero
  # update of a (1,) array in MultiSteps' mini-steps another sign), and one of M
  # elements is computed whole even where its grads' rows lie split over the axis.
  # The oracle is optax on the whole arrays: given rows split one element per
  # device, optax's own zero updates take the sign of (1,) pieces.
  mesh = _mesh(mesh_kind)
  rows = NamedSharding(mesh, P("fsdp"))
  inner = DIVIDING[name]()
  wrapped = jr.flat_sharded(inner, mesh)
  params = {
    "scalar": jnp.asarray(0.5, jnp.float32),
    "one": jnp.asarray([-0.25], jnp.float32),
    "rows": jnp.linspace(0.1, 0.8, 8, dtype=jnp.float32),
  }
  placed = lambda tree: {**tree, "rows": jax.device_put(tree["rows"], rows)}  # noqa: E731
  wrap = jax.jit if jit else (lambda f: f)
  state, ref_state = standard(wrapped.init, placed(params)), standard(inner.init, params)
  for step in range(4):
    sign = 1.0 if step % 2 else -1.0
    grads = {
      "scalar": jnp.asarray(0.3 * sign, jnp.float32),
      "one": jnp.asarray([0.7 * sign], jnp.float32),
      "rows": jnp.sin(jnp.arange(8.0, dtype=jnp.float32) * 1.3 * sign),
    }
    with jax.set_mesh(mesh):
      updates, state = standard(wrap(wrapped.update), placed(grads), state, placed(params))
    u_ref, ref_state = standard(wrap(inner.update), grads, ref_state, params)
    assert_trees_bit_equal(updates, u_ref)
  _check_layout(inner, state, params, mesh)
  assert_trees_bit_equal(state, jr.shard_to_mesh(inner, params, ref_state, mesh).state)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("mesh_kind", ["explicit5", "auto5"])
def test_zero_size_params_step_as_optax_steps_them(mesh_kind, jit):
  mesh = _mesh(mesh_kind)
  inner = optax.adamw(1e-2, weight_decay=0.1)
  wrapped = jr.flat_sharded(inner, mesh)
  shapes = {"empty": ((0,), F32), "no_cols": ((3, 0), F32), "w": ((5, 3), F32), "b": ((2,), F32)}
  params = random_params(shapes)
  wrap = jax.jit if jit else (lambda f: f)
  state, ref_state = standard(wrapped.init, params), standard(inner.init, params)
  for step in range(2):
    grads = random_grads(params, step)
    updates, state = standard(wrap(wrapped.update), grads, state, params)
    u_ref, ref_state = standard(wrap(inner.update), grads, ref_state, params)
    assert_trees_bit_equal(updates, u_ref)
    assert [u.shape for u in jax.tree.leaves(updates)] == [u.shape for u in jax.tree.leaves(u_ref)]
  _check_layout(inner, state, params, mesh)
  assert_trees_bit_equal(state, jr.shard_to_mesh(inner, params, ref_state, mesh).state)


def test_padding_slots_stay_zero_with_a_nonzero_initial_accumulator():
  mesh = _mesh("explicit8")
  inner = optax.adagrad(1e-2, initial_accumulator_value=0.1)
  params = {"b": jnp.ones((3,), jnp.float32)}  # 3 < 8: five ranks are all padding
  state = standard(jr.flat_sharded(inner, mesh).init, params)
  acc = np.asarray(state[0].sum_of_squares["b"])
  assert_bits_equal(acc[:3], np.full(3, 0.1, np.float32))
  assert not np.any(bits(acc)[3:])


def test_non_coordinate_optimizer_is_refused_at_init_like_shard_state():
  mesh = _mesh("explicit8")
  inner = optax.adafactor(1e-2, min_dim_size_to_factor=2)
  params = random_params(SHAPES)
  with pytest.raises(jr.ShapeError) as expected:
    jr.shard_state(inner, params, standard(inner.init, params), 8)
  wrapped = jr.flat_sharded(inner, mesh)
  with pytest.raises(jr.ShapeError) as got:
    standard(wrapped.init, params)
  assert str(got.value) == str(expected.value)
  assert "adafactor keeps v_row and v_col, factored or not" in str(got.value)


def test_unfactored_adafactor_is_refused_naming_its_placeholders():
  """With ``factored=False`` adafactor still keeps a (1,) v_row and v_col per param:
  the refusal says so rather than leaving "factored statistics" unexplained."""
  inner = optax.adafactor(1e-2, factored=False)
  with pytest.raises(jr.ShapeError, match=r"v_row.*\(1,\).*adafactor keeps v_row and v_col"):
    jr.flat_sharded(inner, _mesh("explicit8")).init(random_params(SHAPES))


@pytest.mark.parametrize("mesh_kind", ["explicit2x4", "auto5"])
@pytest.mark.parametrize("name", sorted(MASK_FUNCTIONS))
def test_mask_and_label_functions_see_the_params_shapes(name, mesh_kind):
  # Bit for bit with the unwrapped optimizer over several steps: the function
  # decides for each param as it does on the params themselves.
  _check_exact(name, MASK_FUNCTIONS[name], mesh_kind)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_reducing_optimizers_with_mask_functions_agree_to_rounding(name):
  # lamb's and lars' trust ratios reduce over a whole param (rounding); their
  # masks decide per param exactly as unwrapped (a wrong mask is far off).
  factory = {
    "lamb": lambda: optax.lamb(1e-2, weight_decay=0.5, mask=MATRICES),
    "lars": lambda: optax.lars(
      1e-2, weight_decay=0.5, weight_decay_mask=MATRICES, trust_ratio_mask=MATRICES
    ),
  }[name]
  _check_close(factory, "explicit2x4", rtol=1e-5)


def test_mask_functions_under_jit_decay_what_they_decay_unwrapped():
  mesh = _mesh("auto8")
  inner = optax.adamw(1.0, weight_decay=0.5, mask=MATRICES)
  wrapped = jr.flat_sharded(inner, mesh)
  params = {"k": jnp.ones((3, 4), jnp.float32), "b": jnp.ones((4,), jnp.float32)}
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = standard(
    jax.jit(wrapped.update), zeros, standard(jax.jit(wrapped.init), params), params
  )
  # Zero grads: adam's step is 0, so the update is -lr * decay * param where decayed.
  assert bits(updates["k"]).ravel().tolist() == [0xBF000000] * 12  # -0.5
  assert bits(updates["b"]).ravel().tolist() == [0x80000000] * 4  # -0.0: not decayed


class _HiddenMask:
  """A transformation whose mask function is an attribute no closure reaches."""

  def __init__(self, mask):
    self.mask = mask

  def init(self, params):
    return optax.masked(optax.adam(1e-2), self.mask(params)).init(params)

  def update(self, updates, state, params=None):
    return optax.masked(optax.adam(1e-2), self.mask(updates)).update(updates, state, params)


def test_a_hidden_shape_dependent_mask_function_is_refused():
  mesh = _mesh("explicit8")
  with pytest.raises(jr.ShapeError, match="mask or label function"):
    standard(jr.flat_sharded(_HiddenMask(MATRICES), mesh).init, random_params(SHAPES))


def test_a_mask_function_on_part_of_the_params_is_refused_by_name():
  # Called on a tree that is not the params' (a part of it, keyed from its
  # root), a mask function cannot be given the params' shapes: refused, named.
  from jaxreshard._src.core import logical_masks as _logical_masks

  def decay_matrices(p):
    return jax.tree.map(lambda x: x.ndim > 1, p)

  wrapped = _logical_masks.with_logical_callables(optax.masked(optax.adam(1e-2), decay_matrices))
  flat = {"dense": {"kernel": jnp.zeros((40,)), "bias": jnp.zeros((8,))}}
  logical = {"dense/kernel": ((5, 8), jnp.float32), "dense/bias": ((8,), jnp.float32)}
  with _logical_masks.logical_shapes(logical):
    state = wrapped.init(flat)  # the whole tree: the kernel is a matrix, decayed
    assert jax.tree.map(lambda x: x.shape, state.inner_state[0].mu) == {
      "dense": {"kernel": (40,), "bias": optax.MaskedNode()}
    }
    with pytest.raises(jr.PlacementError, match=r"mask function .*decay_matrices.*\['bias'\]"):
      wrapped.init(flat["dense"])


@pytest.mark.parametrize("built,got", [((6,), (5,)), ((2, 3), (3, 2)), ((17,), (23,))])
@pytest.mark.parametrize("jit", [False, True])
def test_grads_of_another_shape_than_the_state_was_built_for_are_refused(built, got, jit):
  # Same flat size over 8 ranks each time: only the record of init can tell.
  wrapped = jr.flat_sharded(optax.adam(1e-2), _mesh("explicit8"))
  state = wrapped.init({"w": jnp.ones(built, jnp.float32), "b": jnp.ones((3,), jnp.float32)})
  update = jax.jit(wrapped.update) if jit else wrapped.update
  grads = {"w": jnp.ones(got, jnp.float32), "b": jnp.ones((3,), jnp.float32)}
  with pytest.raises(
    jr.ShapeError,
    match=rf"param 'w': grads of shape \({got[0]},.*but the"
    rf" state was built .* shape \({built[0]},",
  ):
    update(grads, state)
  with pytest.raises(
    jr.ShapeError,
    match=rf"param 'w': grads of shape \({got[0]},.*but"
    rf" params of shape \({built[0]},",
  ):
    update(grads, state, {"w": jnp.ones(built, jnp.float32), "b": jnp.ones((3,), jnp.float32)})


def test_grads_or_params_of_another_tree_are_refused_naming_the_params():
  wrapped = jr.flat_sharded(optax.adam(1e-2), _mesh("explicit8"))
  params = {"k": jnp.ones((3, 4), jnp.float32), "b": jnp.ones((4,), jnp.float32)}
  state = wrapped.init(params)
  cases = [
    ({"k": params["k"]}, None, r"grads lack params \['b'\]"),
    ({**params, "c": jnp.ones(2)}, None, r"grads have params \['c'\]"),
    ({"k": params["k"], "c": params["b"]}, None, r"\['c'\].*lack params \['b'\]"),
    ([params["b"], params["k"]], None, r"grads have params \['0', '1'\]"),
    (params, {"k": params["k"]}, r"not the params'.*grads have params \['b'\]"),
  ]
  for grads, p, match in cases:
    with pytest.raises(jr.PlacementError, match=match):
      wrapped.update(grads, state, p)
  # A wrapper that did not build the state (as after a restore) reads the
  # state's own tree: the path where it differs is named.
  fresh = jr.flat_sharded(optax.adam(1e-2), _mesh("explicit8"))
  with pytest.raises(jr.PlacementError, match=r"\[0\]\.mu\['b'\]"):
    fresh.update({"k": params["k"], "c": params["b"]}, state)
  assert isinstance(jr.PlacementError("x"), jr.ReshardError)


def test_state_of_another_mesh_is_refused_at_update():
  params = random_params(SHAPES)
  state = standard(jr.flat_sharded(optax.adam(1e-2), _mesh("explicit8")).init, params)
  wrapped5 = jr.flat_sharded(optax.adam(1e-2), _mesh("explicit5"))
  with pytest.raises(jr.ShapeError, match=r"param 'dense/bias'.*another mesh"):
    standard(wrapped5.update, random_grads(params, 0), state, params)


def test_unknown_axis_is_refused():
  with pytest.raises(jr.PlacementError, match="'model'"):
    jr.flat_sharded(optax.adam(1e-2), _mesh("explicit8"), axis="model")


def test_forgetting_axis_on_a_mesh_without_fsdp_says_it_is_the_default(tmp_path):
  """Every helper that defaults to 'fsdp' says so, names the mesh's axes, and asks for axis=."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  opt = optax.adam(1e-2)
  params = {"w": jnp.zeros((5,), jnp.float32)}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  jr.save_records(tmp_path / "ckpt", records)
  message = (
    r"mesh axis 'fsdp' is not one of the mesh's axes \('data', 'model'\); 'fsdp' is the"
    r" default of axis=: pass axis= .*\(one of 'data', 'model'\)"
  )
  calls = {
    "flat_sharded": lambda: jr.flat_sharded(opt, mesh),
    "restore_sharded": lambda: jr.restore_sharded(tmp_path / "ckpt", mesh),
    "shard_to_mesh": lambda: jr.shard_to_mesh(opt, params, opt.init(params), mesh),
    "reshard_to_mesh": lambda: jr.reshard_to_mesh(records, mesh),
  }
  for name, call in calls.items():
    with pytest.raises(jr.PlacementError, match=message):
      call()
      pytest.fail(f"{name} did not refuse")
  # An axis passed by name is not called the default.
  with pytest.raises(jr.PlacementError) as e:
    jr.flat_sharded(opt, mesh, axis="dp")
  assert "default" not in str(e.value) and "('data', 'model')" in str(e.value)


def test_padding_index_of_a_huge_history_needs_64_bit_indices():
  # A flat history of 2**31 elements or more cannot be counted with int32: it
  # is refused by name without x64 (allocating one here would take 8 GiB).
  from jaxreshard._src.distributed import flat_sharded as _flat_sharded

  assert _flat_sharded._index_dtype(2**31 - 1, "w") == jnp.int32
  with pytest.raises(jr.ShapeError, match="'embed'.*64-bit indices"):
    _flat_sharded._index_dtype(2**31, "embed")
  with jax.enable_x64(True):
    assert _flat_sharded._index_dtype(2**31, "embed") == jnp.int64


def test_the_wrapper_stands_for_its_optimizer_when_saving(tmp_path):
  # What a training loop holds is the wrapper: saving takes it in place of the
  # optimizer it wraps, and the checkpoint is the same.
  mesh = _mesh("explicit8")
  inner = optax.adamw(1e-2)
  wrapped = jr.flat_sharded(inner, mesh)
  params = random_params(SHAPES)
  state = standard(wrapped.init, params)
  shapes = _shapes(params)
  jr.save_sharded(tmp_path / "w", wrapped, state, shapes, mesh)
  jr.save_sharded(tmp_path / "i", inner, state, shapes, mesh)
  assert jr.compare_digests(jr.digest(tmp_path / "w"), jr.digest(tmp_path / "i")) == []


@pytest.mark.parametrize("mesh_kind", ["explicit5", "auto2x4"])
def test_init_outside_jit_compiles_one_program_whatever_the_params(mesh_kind):
  """Run op by op, every flatten, fill and padding reset of ``init`` would compile a
  program per shape (~20 ms each: ~3.5 per param, seconds at a few hundred);
  outside ``jit`` it runs as one program."""
  mesh = _mesh(mesh_kind)
  wrapped = jr.flat_sharded(optax.adam(1e-3), mesh)
  # Shapes no other test uses, so that no compiled program is found in a cache.
  params = random_params({f"p{i}": ((311 + i, 1), jnp.float32) for i in range(12)})
  with count_xla_compiles() as compiles:
    state = standard(wrapped.init, params)
  assert compiles["n"] <= 2, compiles
  inner = optax.adam(1e-3)
  _check_layout(inner, state, params, mesh)
  expected = jr.shard_to_mesh(inner, params, standard(inner.init, params), mesh).state
  assert_trees_bit_equal(state, expected)


def test_init_of_params_on_devices_outside_the_mesh_is_the_same_state():
  """Params that one program on the mesh cannot take (on a device the mesh lacks,
  numpy arrays) are laid out op by op: the same bits and shardings."""
  mesh = _mesh("explicit5")
  wrapped = jr.flat_sharded(optax.adam(1e-3), mesh)
  params = random_params(SHAPES)
  on_mesh = standard(wrapped.init, params)
  for moved in (jax.device_put(params, jax.devices()[7]), jax.tree.map(np.asarray, params)):
    state = standard(wrapped.init, moved)
    assert_trees_bit_equal(state, on_mesh)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(on_mesh)):
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


@pytest.mark.parametrize(
  "mesh_kind, params_mesh",
  [
    ("explicit8", lambda: jax.make_mesh((2, 4), ("data", "fsdp"))),
    ("auto8", lambda: jax.make_mesh((8,), ("x",))),
    ("explicit2x4", lambda: jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))),
  ],
)
def test_init_of_params_on_another_mesh_of_the_same_devices(mesh_kind, params_mesh):
  """Params laid out on another mesh than the wrapper's (a 2-D model mesh, other
  axis names or types, over the same devices) are laid out op by op: one program
  under the wrapper's mesh would refuse theirs. The same state as from params on
  one device."""
  mesh = _mesh(mesh_kind)
  wrapped = jr.flat_sharded(optax.adam(1e-3), mesh)
  params = random_params({**SHAPES, "rows": ((16, 3), jnp.float32)})
  other = params_mesh()
  first = other.axis_names[0]

  def placed(x):  # rows split over the other mesh's first axis where it divides them
    rows = x.ndim and x.shape[0] % other.shape[first] == 0
    return jax.device_put(x, NamedSharding(other, P(first) if rows else P()))

  moved = jax.tree.map(placed, params)
  expected = standard(wrapped.init, params)
  state = standard(wrapped.init, moved)
  assert_trees_bit_equal(state, expected)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
