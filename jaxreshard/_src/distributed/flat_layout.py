"""Where ``flat_sharded`` puts arrays on a mesh: flat shards over one axis, the rest replicated."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.distributed import mesh as _mesh
from jaxreshard._src.errors import ShapeError

__all__ = [
  "MeshLayout",
  "PACKED_SHARD_BYTES",
  "gathered",
  "index_dtype",
  "is_concrete",
  "update_on_auto_axes",
  "whole",
]

# Updates whose flat shard is at most this many bytes are all-gathered together,
# one all-gather per dtype and weak type: a gather that small costs its rendezvous
# (every device waits for all the others) far more than its copy. A larger one is
# gathered by itself, so that its consumers read it contiguous, and its buffer
# lives briefly.
PACKED_SHARD_BYTES = 16 * 1024


def is_concrete(x: Any) -> bool:
  """Whether ``x`` is a value rather than a tracer (outside ``jit``)."""
  return not isinstance(x, jax.core.Tracer)


class MeshLayout:
  """Where arrays go on ``mesh``: flat shards over ``axis``, everything else replicated."""

  def __init__(self, mesh: Mesh, axis: str, shard_updates: bool = False):
    self.world = _mesh.axis_size(mesh, axis)
    self.axis = axis
    # Explicit axes change shardings only through ``reshard`` (the sharding is part
    # of the type); Auto axes take ``with_sharding_constraint`` as a constraint.
    self.explicit = dict(zip(mesh.axis_names, mesh.axis_types))[axis] == AxisType.Explicit
    self.shard_updates = shard_updates
    self.sharded = NamedSharding(mesh, PartitionSpec(axis))
    self.replicated = NamedSharding(mesh, PartitionSpec())
    # Rank r's ``(slots,)`` slice of a flat array as row r of its ``(M, slots)`` view.
    self.rows = NamedSharding(mesh, PartitionSpec(axis, None))

  def put(self, x: Any, sharding: Any) -> jax.Array:
    if is_concrete(x):  # outside jit: a transfer, from any devices or the host
      return jax.device_put(x, sharding)
    if self.explicit:
      return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)

  def flat(self, x: Any, shape: tuple[int, ...]) -> jax.Array:
    """``x`` (any sharding) flattened, zero-padded to ``M * slots``, sharded over the axis;
    a param of one slot per rank (``whole``) in its own shape, replicated."""
    g = FlatShard(shape, 0, self.world)
    if self._row_sharded(x, g):
      # Each device's rows are already its flat shard (ZeRO-2 grads): no all-gather.
      return jnp.reshape(x, (g.count,), out_sharding=self.sharded)
    # Pinned replicated as a whole flat array, each device's shard is a 1-D slice of
    # it: left free, the partitioner slices the param's own rows instead, and XLA
    # fuses (and contracts multiply-adds in) the update differently from optax's.
    if whole(g):
      return self.put(x, self.replicated)  # computed whole, in its own shape (``whole``)
    x = jnp.reshape(self.put(x, self.replicated), (g.count,))
    x = self.put(jnp.pad(x, (0, self.world * g.slots - g.count)), self.replicated)
    if not is_concrete(x):
      # Inside jit it stays replicated: the partitioner slices it where it meets the
      # sharded histories (each device its own slots), and a reduction over the
      # whole tree (clip_by_global_norm's norm) is computed on each device, with no
      # all-reduce that every device would wait at (see ``update_on_auto_axes``).
      return x
    return self.put(x, self.sharded)

  def update_on_rows(self, shape: tuple[int, ...]) -> bool:
    """Whether a param's update is returned with its rows sharded over the axis.

    It is with ``shard_updates`` under explicit axes, when the axis
    divides the leading dimension and the update is computed on flat shards (the
    param has more than M elements): rank r's flat shard is then exactly its
    block of rows (no padding), and the update stays where it lies. One computed
    whole is already on every device. On Auto axes the partitioner lays updates
    out for their consumer; constraining them to rows there made the benchmarked
    step slower, not faster.
    """
    if not (self.explicit and self.shard_updates and shape) or shape[0] % self.world:
      return False
    return not whole(FlatShard(shape, 0, self.world))

  def _row_sharded(self, x: Any, g: FlatShard) -> bool:
    """Whether ``x``'s known sharding splits its rows over the axis exactly as the flat shards.

    Rows split evenly (``shape[0] % M == 0``, no padding) put rank r's rows at flat
    elements ``[r * slots, (r + 1) * slots)``. Only explicit axes say so inside ``jit``.
    A param of one slot per rank is not taken as shards, however it lies: its update
    is computed whole (``whole``), on every device.
    """
    shape = np.shape(x)
    if (
      not self.explicit
      or not shape
      or shape[0] % self.world
      or g.count != g.slots * self.world
      or whole(g)
    ):
      return False
    if is_concrete(x):
      sharding, mesh = getattr(x, "sharding", None), self.sharded.mesh
    else:
      sharding, mesh = jax.typeof(x).sharding, self.sharded.mesh.abstract_mesh
    if getattr(sharding, "mesh", None) != mesh:
      return False
    spec = tuple(sharding.spec)
    spec += (None,) * (len(shape) - len(spec))
    return spec[0] in (self.axis, (self.axis,)) and all(s is None for s in spec[1:])

  def for_update(self, state: Any, roles: tuple, shapes: dict[str, tuple[int, ...]]) -> Any:
    """``state`` as the update computes it: the histories of small params whole, each
    in its param's shape.

    Those of one dtype (and weak type) are all-gathered together, by one all-gather.
    """
    leaves, treedef = jax.tree_util.tree_flatten(state)
    out = list(leaves)
    packs: dict[Any, list[int]] = {}
    for i, (leaf, pid) in enumerate(zip(leaves, roles)):
      if pid is not None and whole(FlatShard(shapes[pid], 0, self.world)):
        # One concatenation per dtype and weak type: a strong member would make
        # every weakly typed one strong.
        packs.setdefault((jnp.dtype(leaf.dtype), _weakly_typed(leaf)), []).append(i)
    for members in packs.values():
      for i, x in zip(members, gathered(self, [leaves[i] for i in members])):
        shape = shapes[roles[i]]
        out[i] = jnp.reshape(x[: FlatShard(shape, 0, self.world).count], shape)
    return jax.tree_util.tree_unflatten(treedef, out)

  def unflat(self, u: jax.Array, like: Any, shape: tuple[int, ...]) -> jax.Array:
    """A flat update (or one computed whole, in its parameter's shape) back in its
    parameter's shape, laid out like ``like`` where known."""
    count = FlatShard(shape, 0, self.world).count
    if self.explicit:
      u = self.put(u, self.replicated)  # the ZeRO all-gather of the updates
    if np.shape(u) != tuple(shape):
      u = jnp.reshape(u[:count], shape)
    return self._placed(u, like)

  def unflat_all(
    self, updates: list[Any], likes: list[Any], shapes: list[tuple[int, ...]]
  ) -> list[jax.Array]:
    """Flat updates back in their params' shapes.

    With ``shard_updates`` under explicit axes, an update computed on flat shards
    whose leading dimension the axis divides is returned with its rows sharded over the axis
    (``update_on_rows``): its flat shards are those rows, so it is reshaped where
    it lies, with no all-gather, and adding it to the params adds each device's
    rows (as optax's updates come out sharded like a sharded state). Every other
    update is laid out like ``likes`` where known: one whose ``like`` has its rows
    split over the axis as the flat shards (ZeRO-2 grads) is reshaped where it
    lies; those with flat shards of at most ``PACKED_SHARD_BYTES`` are all-gathered
    together, one all-gather per dtype and weak type; each larger one is gathered
    by itself, and one computed whole is not.
    """
    out = list(updates)
    packs: dict[Any, list[int]] = {}
    for i, (u, like, shape) in enumerate(zip(updates, likes, shapes)):
      g = FlatShard(shape, 0, self.world)
      if not g.count:  # no element to gather: the empty update, of the param's shape
        out[i] = self._placed(jax.lax.full_like(u, 0, shape=shape), like)
      elif self.update_on_rows(shape):
        out[i] = jnp.reshape(u, shape, out_sharding=self.sharded)
      elif whole(g):
        out[i] = self.unflat(u, like, shape)
      elif self._row_sharded(like, g):  # rows split as the flat shards (ZeRO-2 grads)
        out[i] = self._placed(jnp.reshape(u, shape, out_sharding=self.sharded), like)
      elif g.slots * jnp.dtype(u.dtype).itemsize <= PACKED_SHARD_BYTES:
        packs.setdefault((jnp.dtype(u.dtype), _weakly_typed(u)), []).append(i)
      else:
        out[i] = self.unflat(u, like, shape)
    for members in packs.values():
      for i, u in zip(members, gathered(self, [updates[i] for i in members])):
        count = FlatShard(shapes[i], 0, self.world).count
        out[i] = self._placed(jnp.reshape(u[:count], shapes[i]), likes[i])
    return out

  def _placed(self, u: jax.Array, like: Any) -> jax.Array:
    """``u`` laid out like ``like`` where that is known (outside jit, explicit axes)."""
    if is_concrete(like) and isinstance(like, jax.Array):
      return jax.device_put(u, like.sharding)
    if not is_concrete(like) and self.explicit:
      target = jax.typeof(like).sharding
      if not target.mesh.empty:
        return jax.sharding.reshard(u, target)
    return u  # under Auto axes, the partitioner lays it out for its consumer

  def settle(self, state: Any, roles: tuple, counts: dict[str, int]) -> Any:
    """``state`` laid out on the mesh, with the padding of every history set to zero."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    out = []
    for leaf, pid in zip(leaves, roles):
      if pid is None:
        out.append(self.put(leaf, self.replicated))
        continue
      g = FlatShard((counts[pid],), 0, self.world)
      if whole(g):
        # Computed whole: pinned replicated first, even unpadded (left free, on Auto
        # axes the partitioner shards it one element per device: see ``whole``).
        leaf = jnp.reshape(self.put(leaf, self.replicated), (g.count,))
        leaf = jnp.pad(leaf, (0, self.world * g.slots - g.count))
      leaf = self.put(leaf, self.sharded)
      if counts[pid] == np.shape(leaf)[0]:
        # No padding: a select here would be a second consumer of the new history,
        # and XLA would recompute it in that fusion from a copy of the donated input.
        out.append(leaf)
        continue
      index = jax.lax.broadcasted_iota(
        index_dtype(np.shape(leaf)[0], pid),
        np.shape(leaf),
        0,
        out_sharding=self.sharded if self.explicit else None,
      )
      # Padding is zero by definition of the layout; a select keeps every owned
      # element's bits, and in an elementwise chain no owned element reads padding.
      if _weakly_typed(leaf):
        # Outside jit ``full_like`` drops a weakly typed array's sharding, and a strong
        # zero would make it strong: a Python 0 keeps both (``where`` is a select).
        out.append(jnp.where(index < counts[pid], leaf, 0))
      else:
        out.append(jax.lax.select(index < counts[pid], leaf, jax.lax.full_like(leaf, 0)))
    return jax.tree_util.tree_unflatten(treedef, out)


def gathered(layout: MeshLayout, updates: list[jax.Array]) -> list[jax.Array]:
  """Flat sharded arrays of one dtype replicated by one all-gather of them all.

  Each flat shard is row r of its array's ``(M, slots)`` view (no data moves);
  their rows side by side are one ``(M, sum of slots)`` array, whose all-gather
  brings every array whole to every device, as a block of its columns.
  """
  rows = [_as_rows(layout, u) for u in updates]
  packed = layout.put(jnp.concatenate(rows, axis=1), layout.replicated)
  starts = np.cumsum([0] + [r.shape[1] for r in rows])
  return [jnp.reshape(packed[:, a:b], (-1,)) for a, b in zip(starts[:-1], starts[1:])]


def _as_rows(layout: MeshLayout, u: jax.Array) -> jax.Array:
  """A flat array sharded over the axis as ``(M, slots)``, rank r's shard as row r."""
  shape = (layout.world, np.shape(u)[0] // layout.world)
  if layout.explicit and not is_concrete(u):
    return jnp.reshape(u, shape, out_sharding=layout.rows)
  return layout.put(jnp.reshape(u, shape), layout.rows)


def update_on_auto_axes(
  layout: MeshLayout, update: Any, args: tuple, ids: list[str], roles: tuple, shapes: dict
) -> tuple[Any, Any]:
  """``update(flat_grads, state, flat_params)``; inside jit, traced on Auto axes.

  Under explicit axes every intermediate's layout is its type: flat grads typed
  replicated would make each elementwise op before the sharded histories compute
  all M shards on every device, and typed sharded, a reduction over the whole tree
  (clip_by_global_norm's norm) becomes an all-reduce. On Auto axes, as on an Auto
  mesh, the partitioner slices the replicated flat grads where they meet the
  histories and reduces them on each device. The flat updates (``ids``) and the
  state (``roles``) come out sharded over the axis, or replicated where whole.
  """
  concrete = all(is_concrete(x) for x in jax.tree_util.tree_leaves(args))
  if not layout.explicit:
    return update(*args)
  if concrete:
    try:
      return update(*args)  # op by op, as the unwrapped optimizer runs outside jit
    except Exception as e:  # pylint: disable=broad-exception-caught
      # Op by op under explicit axes, branches of a ``lax.cond`` (``apply_if_finite``'s
      # kept and zeroed updates) may differ in layout type (a TypeError), and a dot
      # product over the flat histories (prodigy's, mechanize's) has a sharded
      # contracting dimension whose result's layout jax will not choose (its
      # ShardingTypeError). The update has changed nothing (arrays are values), so it
      # runs again on Auto axes, as under jit.
      if not isinstance(e, TypeError) and type(e).__name__ != "ShardingTypeError":
        raise

  def laid_out(tree: Any, pids: Any) -> Any:
    leaves = [
      layout.replicated
      if pid is None or whole(FlatShard(shapes[pid], 0, layout.world))
      else layout.sharded
      for pid in pids
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)

  out = (laid_out(args[0], ids), laid_out(args[1], roles))
  return jax.sharding.auto_axes(update, out_sharding=out)(*args)


def _weakly_typed(x: Any) -> bool:
  """Whether ``x`` (an array or a tracer) is weakly typed, as a Python scalar makes it."""
  return bool(jax.typeof(x).weak_type)


def whole(g: FlatShard) -> bool:
  """Whether a param's update is computed on its whole unpadded flat array.

  A param of at most M elements (one slot per rank) is: as one-element shards
  XLA would compile its update differently from the unwrapped optimizer's (a
  division by a broadcast scalar stays a division for one element and becomes
  a multiplication by the reciprocal for more), so it is computed, like there,
  on exactly its own elements in its own shape, on every device; it is tiny, so
  that is free. (XLA also compiles some chains differently for a 0-d array, or
  an array of one element per device, than for a (1,) one: the sign of a zero
  update in ``optax.MultiSteps``' mini-steps.)
  """
  return g.slots == 1


def index_dtype(size: int, pid: str) -> Any:
  """The integer type that counts to ``size``: int32, or int64 where jax has it."""
  if size < 2**31:
    return jnp.int32
  if not jax.config.jax_enable_x64:
    raise ShapeError(
      f"param {pid!r}: a flat history of {size} elements needs 64-bit indices for its"
      " padding; enable jax_enable_x64"
    )
  return jnp.int64
