"""An optax wrapper that keeps the state flat-sharded on a mesh (ZeRO stage 1/2).

The wrapped optimizer runs on flat params: each leaf flattened row-major,
zero-padded to ``M * slots`` and sharded over the mesh axis, so every device
holds and updates only its own ``(slots,)`` slice of every history buffer. The
state is therefore always in the layout of :func:`jaxreshard.restore_sharded`
and :func:`jaxreshard.save_sharded`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jaxreshard._src.core import logical_masks as _logical_masks
from jaxreshard._src.core import plain as _plain
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.distributed import update_checks as _checks
from jaxreshard._src.distributed.flat_layout import MeshLayout as _MeshLayout
from jaxreshard._src.distributed.flat_layout import index_dtype as _index_dtype  # noqa: F401
from jaxreshard._src.distributed.flat_layout import is_concrete as _is_concrete
from jaxreshard._src.distributed.flat_layout import update_on_auto_axes as _update_on_auto_axes
from jaxreshard._src.engine import reshard as _reshard
from jaxreshard._src.errors import PlacementError, ShapeError

__all__ = ["flat_sharded"]


class _FlatSharded(_structure.WrappedOptimizer):
  """``flat_sharded``'s transformation; ``inner`` is the optimizer it wraps.

  Functions that ask an optimizer which state leaves are histories (saving,
  ``shard_state``) accept it in place of the optimizer it wraps.
  """


def _history_roles(
  cache: dict[Any, tuple], logical_opt: Any, flat_params: Any, state: Any
) -> tuple:
  """Per leaf of ``state``: the param id of a history or None, kept in ``cache`` by structure.

  Raises:
    PlacementError: ``state`` was not built for ``flat_params``' tree, naming how.
  """
  key = (jax.tree_util.tree_structure(flat_params), jax.tree_util.tree_structure(state))
  if key not in cache:
    try:
      cache[key] = _structure.history_roles(logical_opt, flat_params, state)
    except (ValueError, TypeError) as e:  # the state does not mirror this tree
      try:
        expected = jax.eval_shape(logical_opt.init, flat_params)
      except Exception:  # pylint: disable=broad-exception-caught
        expected = None
      where = (
        _checks.state_difference(expected, state)
        if expected is not None
        else f"{type(e).__name__}: {str(e)[:300]}"
      )
      raise PlacementError(
        f"flat_sharded: the state was not built for grads with param ids"
        f" {_structure.param_ids(flat_params)[0][: _checks.MAX_LISTED]}: {where}"
      ) from None
  return cache[key]


def _check_history_shapes(
  layout: _MeshLayout, state: Any, roles: tuple, shapes: dict[str, tuple[int, ...]]
) -> None:
  """Every history leaf of ``state`` is ``(M * slots,)`` of its param's shape over the axis.

  Raises:
    ShapeError: one is not, naming its param and both shapes.
    PlacementError: one (a value, not a tracer) is laid out on another mesh than
      the wrapper's: other devices, or another shape or axis names of the mesh.
  """
  mesh = layout.sharded.mesh
  for leaf, pid in zip(jax.tree_util.tree_leaves(state), roles):
    if pid is None:
      continue
    want = (layout.world * FlatShard(shapes[pid], 0, layout.world).slots,)
    if tuple(np.shape(leaf)) != want:
      raise ShapeError(
        f"param {pid!r}: history buffer of shape {tuple(np.shape(leaf))} is not the"
        f" ({layout.world} * slots,) = {want} of its shape {shapes[pid]} over mesh axis"
        f" {layout.axis!r}; was the state built for another mesh or other params?"
      )
    sharding = getattr(leaf, "sharding", None) if _is_concrete(leaf) else None
    if isinstance(sharding, NamedSharding) and not _same_mesh(sharding.mesh, mesh):
      raise PlacementError(
        f"param {pid!r}: history buffer laid out on a mesh of shape"
        f" {dict(sharding.mesh.shape)} over devices {_device_ids(sharding.mesh)}, not this"
        f" optimizer's {dict(mesh.shape)} over {_device_ids(mesh)}; restore or reshard the"
        " state onto this mesh (restore_sharded, reshard_to_mesh)"
      )


def _device_ids(mesh: Any) -> list[int]:
  return [d.id for d in mesh.devices.flat]


def _same_mesh(a: Any, b: Any) -> bool:
  """The same devices in the same places under the same axis names (axis types aside)."""
  return a is b or (
    a.axis_names == b.axis_names
    and a.devices.shape == b.devices.shape
    and _device_ids(a) == _device_ids(b)
  )


def _flatten(layout: _MeshLayout, tree: Any, shapes: dict[str, tuple[int, ...]]) -> Any:
  """``tree`` with each leaf flattened and padded to its flat-shard layout."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return jax.tree_util.tree_unflatten(
    treedef, [layout.flat(x, shapes[_structure.path_id(p)]) for p, x in with_path]
  )


def _unflat_updates(layout: _MeshLayout, grads: Any, flat_updates: Any, leaves, shapes) -> Any:
  """The flat updates in the grads' tree, each in its param's shape and layout."""
  return jax.tree_util.tree_unflatten(
    jax.tree_util.tree_structure(grads),
    layout.unflat_all(jax.tree_util.tree_leaves(flat_updates), leaves, shapes),
  )


def _counts(layout: _MeshLayout, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
  """param id -> its element count, as the flat shards over ``layout`` count it."""
  return {pid: FlatShard(s, 0, layout.world).count for pid, s in shapes.items()}


def _mesh_context(layout: _MeshLayout, *trees: Any) -> Any:
  """Outside jit, operations on arrays typed with explicit axes (and arrays created
  next to them) need the mesh in context; inside jit, the types carry it."""
  if layout.explicit and all(_is_concrete(x) for x in jax.tree_util.tree_leaves(trees)):
    return jax.set_mesh(layout.sharded.mesh)
  return contextlib.nullcontext()


def _on_devices_of(tree: Any, mesh: Mesh) -> bool:
  """Whether every leaf of ``tree`` is a jax array (a value, not a tracer) that one
  program on ``mesh`` takes as it is: on one device of the mesh, or laid out on
  the mesh itself. Arrays on another mesh, even of the same devices, are not: a
  program under one mesh refuses another's axis names and types."""
  devices = set(mesh.devices.flat)
  for x in jax.tree_util.tree_leaves(tree):
    if not (isinstance(x, jax.Array) and _is_concrete(x)):
      return False
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
      if sharding.mesh != mesh:
        return False
    elif not (isinstance(sharding, SingleDeviceSharding) and sharding.device_set <= devices):
      return False
  return True


def flat_sharded(
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  axis: str = "fsdp",
  *,
  shard_updates: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optax optimizer so its state stays flat-sharded over a mesh axis (ZeRO-1/2).

  ``init`` returns ``optimizer``'s state with every history buffer (``mu``,
  ``nu``, ``trace``, ``acc_grads``, ...) as a global ``(M * slots,)`` array
  sharded over ``axis`` and replicated over the other mesh axes, ``M =
  mesh.shape[axis]``, holding the parameter's row-major flattening followed by
  zeros; scalars (counts, injected hyper-parameters) are replicated. That is
  exactly the layout :func:`jaxreshard.restore_sharded` returns and
  :func:`jaxreshard.save_sharded` takes (and :func:`jaxreshard.shard_to_mesh`
  builds). Called outside ``jit`` on arrays laid out on the mesh or on one of
  its devices, ``init`` runs as one compiled program (op by op, each parameter shape would compile programs
  of its own). ``update`` takes and returns param-shaped pytrees in any sharding
  and works inside ``jax.jit``: it flattens and pads grads and params, runs
  ``optimizer.update`` on them sharded over ``axis`` (each device computes its
  own slots), and reshapes the updates back. Grads whose rows are split evenly
  over ``axis`` (ZeRO-2; known under explicit axes or outside ``jit``), with no
  padding, are already the flat shards and are used where they lie, not
  all-gathered. Inside ``jit``, flat grads that are not already sharded stay
  replicated for the partitioner to slice (``optimizer.update`` is traced on
  ``Auto`` axes), so a reduction over the whole tree (the norm of
  ``clip_by_global_norm``) is computed on each device without an all-reduce.

  Meshes with explicit axes (``jax.make_mesh``'s default) and with ``Auto``
  axes (``jax.sharding.Mesh``) are both supported. Where the updates lie:

  * By default every update is laid out like its grad (row-sharded ZeRO-2
    grads give row-sharded updates), on explicit axes and, outside ``jit``, on
    ``Auto`` axes; inside ``jit`` on ``Auto`` axes the partitioner lays them out
    (and may shard the new params over ``axis``: constrain them with
    ``out_shardings`` or ``with_sharding_constraint``). A step that applies the
    updates itself (``nnx.Optimizer.update``, ``TrainState.apply_gradients``)
    keeps replicated params replicated, and every mesh adds the updates after
    their all-gather, so a run resumed on another number of devices continues
    bit for bit op by op (optax's own compiled pieces aside) and inside ``jit``
    to the last bit's rounding (below). Outside ``jit`` on explicit axes, an
    update whose ``lax.cond`` branches differ in layout type op by op
    (``apply_if_finite``) runs on Auto axes, as under ``jit``.
  * With ``shard_updates=True``, under explicit mesh axes the update of a param
    of more than ``M`` elements whose leading dimension ``M`` divides is
    returned with its rows sharded over ``axis`` (``PartitionSpec(axis)``,
    replicated over the other mesh axes), outside ``jit`` too: its flat shards
    are exactly those rows, so it is not all-gathered, and
    ``optax.apply_updates`` adds each device's rows, as with optax's own
    updates when its state is sharded (ZeRO-1 with ``NamedSharding``); it is
    the faster step. The new params then come out row-sharded as well:
    constrain them where they are made, with ``jax.jit``'s ``out_shardings``
    or ``jax.sharding.reshard``, to the params' own sharding (replicated params
    are one all-gather each). The update of any other param (a leading
    dimension ``M`` does not divide, a scalar, or at most ``M`` elements, which
    are updated whole on every device) is laid out like its grad. No effect on
    ``Auto`` axes.

  Updates that are all-gathered are packed: those of one dtype whose flat
  shards are small (at most 16 KiB) share one all-gather.

  Exactness: when every transformation of ``optimizer`` is elementwise in the
  params, grads and histories (adam, adamw, adagrad, sgd with momentum, lion,
  ``inject_hyperparams``, ``masked``, ``multi_transform``, ...) each element
  goes through the same operations on the same values as in the unwrapped
  optimizer, and run op by op the updates and states are the same bits, but for
  the pieces optax compiles even op by op: its bias correction (the Adam family)
  is a jitted function, and ``optax.MultiSteps`` runs its inner update inside
  ``lax.cond``; compiled for each device's shard length, they agree to the last
  bit's rounding, as jitted updates do (below). A param of at most M elements (one slot per rank) is updated on its own
  unpadded elements, replicated: XLA's CPU compiler turns a division by a
  broadcast scalar (adam's bias correction) into a multiplication by the
  reciprocal for arrays longer than one element, so a one-element shard of a
  longer param would otherwise round differently. Inside ``jax.jit`` the
  compiler also contracts multiply-adds into FMAs depending on how it fused
  the program (jitted optax differs from itself run op by op in the same way),
  so jitted updates agree to the last bit's rounding. A reduction over a whole
  parameter or tree (``clip_by_global_norm``, lamb's trust ratio) adds the same
  values, padding zeros included, in another order, and agrees to float
  rounding. One that averages over a param or reads its shape
  (``clip_by_block_rms``, ``scale_by_param_block_rms``/``_norm``, ``centralize``,
  ``adaptive_grad_clip``) would see the padding and the flat shape: ``init`` and
  ``update`` refuse it by name. "The last bit" is that of the narrowest dtype
  computed in: XLA's excess precision (on by default) may keep a bfloat16
  intermediate in float32 in one program and round it in another.

  An optimizer whose state holds no array at all (``optax.sgd`` without
  momentum) has nothing to lay out: its ``update`` is the optimizer's own.

  Across meshes each element of the histories and updates goes through the same
  jitted arithmetic on any number of devices. With ``shard_updates=True`` the
  add of an update to its param does only where the update lies alike: one
  returned sharded by rows can be added in the kernel that computes it (XLA
  then contracts its last multiply and the add into an FMA), one laid out like
  its grad only after its all-gather. A run resumed on a mesh whose ``M``
  divides other leading dimensions then agrees to the last bit's rounding; by
  default it continues bit for bit op by op (optax's compiled pieces aside). Inside ``jit`` XLA compiles each
  device's loop for the length of its shard, so an element another mesh puts
  in another place of its shard (a vector lane, or the scalar tail of the loop)
  can be contracted into an FMA on one mesh and not on the other: jitted runs
  on two meshes agree to the last bit's rounding, as jitted optax agrees with
  itself run op by op.

  Padding: after every ``init`` and ``update`` the padding slots of every
  history are exactly zero (they are reset, so a non-zero initial value such as
  adagrad's ``initial_accumulator_value`` does not leak into them); grads and
  params are padded with zeros, so weight decay adds nothing there. Reductions
  also see the padding of the intermediate updates, which is zero whenever each
  transformation maps zero grads, params and history to a zero update (every
  optax scaling, clipping and weight decay; not ``add_noise``).

  Mask and label functions (``optax.masked``, ``multi_transform``'s labels,
  the ``mask`` of ``adamw``/``lamb``/``add_decayed_weights``, ``lars``' masks,
  a ``static_args`` mask of ``inject_hyperparams``, at any depth of chains and
  ``MultiSteps``) are called with ``jax.ShapeDtypeStruct`` stand-ins of the
  params in their own shapes and dtypes, not with the flat arrays, so "decay
  only matrices" decays exactly what it decays unwrapped (optax requires masks
  to be static: functions of the tree, shapes and dtypes). One called on a part
  of the params tree is refused by name. A function hidden where closures
  cannot be followed (an attribute of a custom transformation class) still sees
  flat params: ``init`` refuses it when it changes the state's structure.

  Checks at ``update``: grads must have the tree structure and shapes of the
  params ``init`` built the state for (when this wrapper's ``init`` built it;
  one restored from a checkpoint is checked by its flat sizes), and of
  ``params`` when given; the state's tree must be that of a state for the
  grads' tree. A grad of another shape with the same flat size ((3, 2) for
  (2, 3)) would otherwise train silently on the wrong elements.

  Args:
    optimizer: an optax ``GradientTransformation`` (or anything with ``init``
      and ``update``, e.g. ``optax.MultiSteps``) with coordinate-wise state.
    mesh: the device mesh.
    axis: the mesh axis to shard the optimizer state over.
    shard_updates: under explicit mesh axes, return the updates of params of
      more than ``M`` elements whose leading dimension ``M`` divides with their
      rows sharded over ``axis`` (the faster step; the caller constrains the
      new params). The default, ``False``, lays every update out like its grad.
      No effect on ``Auto`` axes.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra ``update`` arguments
    are passed to ``optimizer`` unchanged.

  Raises:
    PlacementError: ``axis`` is not an axis of ``mesh``.
    ShapeError: (at ``init``) non-coordinate optimizer state, as
      :func:`jaxreshard.shard_state` refuses it, or a state whose structure
      depends on the params' shapes.
    DtypeError: (at ``init``) a param dtype other than float32, float16 or
      bfloat16.
    PlacementError: (at ``update``) grads or params of another tree structure
      than at ``init`` or than each other, or a state of another structure,
      naming the param ids or state paths; a mask or label function called on
      part of the params tree.
    ShapeError: (at ``update``) grads of another shape than the params of
      ``init`` or than ``params``, naming the param and both shapes.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxreshard as jr
    >>> mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    >>> opt = jr.flat_sharded(optax.sgd(0.5, momentum=0.9), mesh, axis="fsdp")
    >>> params = {"w": jnp.ones((2, 3))}
    >>> state = opt.init(params)
    >>> trace = state[0].trace["w"]
    >>> trace.sharding.spec, trace.shape[0] % jax.device_count()
    (P('fsdp',), 0)
    >>> updates, state = jax.jit(opt.update)({"w": jnp.ones((2, 3))}, state, params)
    >>> updates["w"].shape, float(updates["w"][1, 2])
    ((2, 3), -0.5)
  """
  _structure.require_optimizer(optimizer, "; the arguments are (optimizer, mesh, axis)")
  layout = _MeshLayout(mesh, axis, shard_updates)
  roles_cache: dict[Any, tuple] = {}
  # ``optimizer`` with its mask and label functions seeing the params' own shapes.
  logical_opt = _logical_masks.with_logical_callables(optimizer)
  # Raised at init, after the coordinate rule, and at update (a restored state needs no init).
  refusal = _logical_masks.shape_dependent_refusal(optimizer)
  # params tree structure -> the shapes ``init`` saw for it (each distinct one).
  built_for: dict[Any, list[dict[str, tuple[int, ...]]]] = {}
  on_mesh = functools.partial(_mesh_context, layout)

  def roles(flat_params: Any, state: Any) -> tuple:
    return _history_roles(roles_cache, logical_opt, flat_params, state)

  def init(params: Any) -> Any:
    # nnx.Optimizer initialises with Variables and updates with their values.
    params = _plain.unwrapped(params)
    # The coordinate rule is checked on the state of the real params: flat
    # params would hide factored statistics (1-D params are never factored).
    logical = jax.eval_shape(optimizer.init, params)
    _, _, shapes, _ = _reshard.coordinate_roles(optimizer, params, logical)
    _checks.check_update_args(built_for, None, None, refusal)
    records = built_for.setdefault(jax.tree_util.tree_structure(params), [])
    if shapes not in records:
      records.append(dict(shapes))
    if not _on_devices_of(params, mesh):
      return laid_out(params)
    # Outside jit, one compiled program: run op by op, every flatten, fill and
    # padding reset compiles one of its own per shape (~20 ms each).
    with on_mesh(params):
      return init_program(params)

  def laid_out(params: Any) -> Any:
    logical = jax.eval_shape(optimizer.init, params)
    _, _, shapes, _ = _reshard.coordinate_roles(optimizer, params, logical)
    with on_mesh(params), _logical_masks.logical_shapes(_checks.described(params)):
      flat_params = _flatten(layout, params, shapes)
      state = logical_opt.init(flat_params)
      if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(logical):
        raise ShapeError(
          f"params {sorted(shapes)[:3]}: the optimizer's state is structured differently"
          " for flat params than for the params themselves (a mask or label function that"
          " depends on shapes?); pass such masks and labels as pytrees"
        )
      return layout.settle(state, roles(flat_params, state), _counts(layout, shapes))

  init_program = jax.jit(laid_out)

  def update(grads: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
    grads, params = _plain.unwrapped(grads), _plain.unwrapped(params)
    ids, leaves, _ = _structure.param_ids(grads)
    shapes = {pid: tuple(np.shape(g)) for pid, g in zip(ids, leaves)}
    _checks.check_update_args(built_for, grads, params, refusal, state)
    if not jax.tree_util.tree_leaves(state):
      # No history and no clock (sgd without momentum): nothing is laid out on the
      # mesh, so the update is the optimizer's own, as optax lays it out.
      return optimizer.update(grads, state, params, **extra_args)
    described = _checks.described(grads)
    flat_grads = _flatten(layout, grads, shapes)
    flat_params = None if params is None else _flatten(layout, params, shapes)
    with _logical_masks.logical_shapes(described):
      state_roles = roles(flat_grads, state)
    _check_history_shapes(layout, state, state_roles, shapes)
    with on_mesh(grads, state, params), _logical_masks.logical_shapes(described):
      state = layout.for_update(state, state_roles, shapes)
      args = (flat_grads, state, flat_params)
      flat_updates, state = _update_on_auto_axes(
        layout, lambda *a: logical_opt.update(*a, **extra_args), args, ids, state_roles, shapes
      )
      updates = _unflat_updates(layout, grads, flat_updates, leaves, [shapes[p] for p in ids])
      return updates, layout.settle(state, state_roles, _counts(layout, shapes))

  return _FlatSharded(init, update, optimizer)
