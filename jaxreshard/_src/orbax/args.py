"""The arguments of a jaxreshard orbax item: ``ReshardSave`` and ``ReshardRestore``.

``ReshardSave`` checks, when it is made, everything a save of it would refuse
(``check``), so the refusal comes before orbax creates any temporary
directory. Both are registered with ``ReshardCheckpointHandler`` where that
handler is defined (``jaxreshard._src.orbax.handler``), so an orbax manager
picks the handler from the arguments alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxreshard._src.checkpoint import index as _index
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import writer as _writer
from jaxreshard._src.core import archivecheck as _archivecheck
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import deleted as _deleted
from jaxreshard._src.core import plain as _plain
from jaxreshard._src.core import record as _record
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.distributed import mesh as _mesh
from jaxreshard._src.distributed import sharded as _sharded
from jaxreshard._src.engine import pipeline as _pipeline
from jaxreshard._src.engine import reshard as _reshard
from jaxreshard._src.engine import sources as _sources
from jaxreshard._src.errors import PlacementError

__all__ = ["ReshardRestore", "ReshardSave", "check", "naming_deleted", "source_of"]


@dataclasses.dataclass(frozen=True)
class Checked:
  """What checking a ``ReshardSave`` found, kept for its save."""

  shapes: Mapping[str, Any] | None  # state: param id -> shape or placement
  views: dict[int, ShardRecord] | None  # state: this process's archives, device buffers
  roles: tuple[str | None, ...] | None = None  # state: each leaf's param id, or None
  # state: the index of every rank under a placeholder identity and clock
  # (``sharded.stamped_index`` gives a save's own from it)
  index: dict | None = None
  # state: its tree structure and leaves as checked (``holds``)
  tree: tuple[Any, tuple[Any, ...]] | None = None

  def holds(self, state: Any) -> bool:
    """Whether ``state`` is still the tree of leaves that was checked: its containers
    are the caller's, who may put another leaf into one (or take one out) after the
    arguments were made; what was found of it then no longer describes it."""
    if self.tree is None:
      return state is None
    leaves, treedef = jax.tree_util.tree_flatten(state)
    checked_def, checked = self.tree
    return (
      treedef == checked_def
      and len(leaves) == len(checked)
      and all(a is b for a, b in zip(leaves, checked))
    )


def _shapes_of(args: ReshardSave) -> Mapping[str, Any]:
  if args.shapes is not None:
    return args.shapes
  _reshard.check_params(args.params)
  ids, leaves, _ = _structure.param_ids(args.params)
  trainable = _validate.trainable_map(args.trainable, ids)
  return {
    pid: ParamPlacement(pid, tuple(np.shape(x)), 0, 1, np.dtype(x.dtype), trainable.get(pid, True))
    for pid, x in zip(ids, leaves)
  }


def source_of(records: Any) -> _reader.Source | None:
  """The checkpoint a reshard's output names as its source (``SourcedRecords``), or None."""
  return records.source if isinstance(records, _reader.SourcedRecords) else None


def naming_deleted(args: ReshardSave) -> contextlib.AbstractContextManager[None]:
  """A block in which jax's error for a deleted array of ``args`` (a record's leaf, or
  the state's or the params') names it, as ``save_records`` and ``save_sharded`` do."""
  records = None if args.records is None else tuple(args.records)
  return _deleted.naming(records=records, state=args.state, params=args.params)


def check(args: ReshardSave) -> Checked:
  """Every refusal of a save of ``args``, in every process, with nothing copied or written.

  Records: each record as an archive of the index. A state: its structure
  against the optimizer and the params, each history buffer against its
  parameter's shape over the mesh axis, this process's shards of its own
  ranks, and the index of every rank (made with a placeholder identity and clock,
  and kept: the save stamps it with its own).
  """
  with naming_deleted(args):
    return _check(args)


def _check(args: ReshardSave) -> Checked:
  """``check``, where a deleted array is jax's error."""
  if args.state is None:
    builder = _reader.IndexBuilder(source=source_of(args.records))
    one = _record.CheckpointOf()  # parts of two saves are never saved as one
    for i, record in enumerate(args.records):
      one.add(i, record)
      builder.add(i, record, pack=False)
    # What a reader would refuse of the index (a param id or a count of clock scalars
    # past its bounds) is refused now, not at the commit after every file is written.
    _writer.readable_index(builder.index(), "the save's checkpoint")
    if builder.source is None:  # one restorable set, as a save of records must be
      src = _sources.record_sources(args.records)
      _pipeline.validate(src, _reshard.plan(args.records, world_size=1, rank=0))
    return Checked(None, None)
  shapes = _shapes_of(args)
  roles = _mesh.optimizer_roles(args.optimizer, args.state, shapes)
  views = _mesh.records_from_mesh(
    args.optimizer,
    args.state,
    shapes,
    args.mesh,
    args.axis,
    ranks=_mesh.writer_ranks(args.mesh, args.axis),
    roles=roles,
  )
  # The clock's device scalars as zeros of their dtype and shape (what storing
  # one depends on): checking never waits for the step that computes them.
  state_leaves, treedef = jax.tree_util.tree_flatten(args.state)
  leaves = [
    np.zeros(x.shape, x.dtype)
    if role is None and isinstance(x, jax.Array) and not _clock.is_key(x)
    else x
    for x, role in zip(state_leaves, roles)
  ]
  index = _sharded.global_index(
    args.optimizer,
    jax.tree_util.tree_unflatten(treedef, leaves),
    shapes,
    args.mesh,
    args.axis,
    "0" * 32,
    roles,
  )
  _writer.readable_index(index, "the save's checkpoint")
  return Checked(shapes, views, roles, index, (treedef, tuple(state_leaves)))


@dataclasses.dataclass
class ReshardSave(ocp.args.CheckpointArgs):
  """Save archives as one orbax checkpoint item: given records, or a state on a mesh.

  Either ``records`` (every rank's archive, the same in every process: the
  primary writes them, and a process whose records differ fails the save) or the training loop's sharded state: ``state``,
  ``optimizer``, ``mesh``, ``axis`` and the params' ids and shapes, as
  ``shapes`` (``param id -> shape or placement``, as :func:`save_sharded`
  takes) or ``params`` (the params pytree, or its ``jax.ShapeDtypeStruct``s;
  ``trainable`` optionally marks frozen ones). Each process then writes the
  archives of its own ranks.

  Making one checks everything a save of it would refuse (see the module
  doc), so a bad save raises here, before orbax creates its temporary
  directory; but a state's padding, which is data, is checked in the host
  copies ``save`` takes (``save_sharded`` takes them before any directory
  is made). A field set afterwards, or a leaf of the state replaced, added
  or taken out in place, is checked again (and its leaves read again) when
  the save prepares: a refusal then comes, like the padding's, once a
  ``CheckpointManager`` has made the step's temporary directory (an NNX state
  is held in plain form, read when the arguments are made or the field set).
  Records given as an iterator are read into a tuple. The check
  copies nothing and never waits for the device, but it walks the whole
  layout (for a state, every local shard of every history leaf): a training
  loop that saves now and then makes one only when ``manager.should_save(step)``.

  Attributes:
    records: the archives, any iterable. A reshard's output that names the
      checkpoint it was resharded from (``SourcedRecords``, what ``jaxreshard
      reshard`` writes) is saved naming it, so parts saved this way merge
      (``jaxreshard merge``).
    chunk_bytes: bytes per stored chunk (the granularity of partial reads);
      None keeps the handler's default.
    state: the optax state, history leaves ``(M * slots,)`` sharded over ``axis``;
      an ``nnx.Optimizer``'s ``opt_state`` is stored in plain form (its
      ``nnx.State`` nodes as dicts, integer keys kept, its Variables as their
      values); ``ReshardRestore(like=...)`` gives that form back.
    optimizer: the optax transformation of ``state``.
    shapes: param id -> logical shape, or anything with ``.shape`` (and then
      its ``.dtype`` / ``.trainable``); a bare shape takes the storage dtype
      the param's history buffers share (refused when they have none or several).
    params: instead of ``shapes``: the params pytree (ids are its key paths,
      storage dtypes its leaves' dtypes), e.g. ``nnx.state(model, nnx.Param)``
      (ids of its plain form: ``layers/10/kernel``).
    trainable: with ``params``: optional ``param id -> bool``.
    mesh: the mesh of ``state``.
    axis: the mesh axis of the flat shards.

  Examples:
    >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp, jaxreshard as jr
    >>> params = {"w": jnp.arange(8.0)}
    >>> opt = optax.adam(1e-3)
    >>> records = jr.shard_state(opt, params, opt.init(params), world_size=4)
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
    ...   _ = manager.save(100, args=ReshardSave(records))
    ...   manager.wait_until_finished()
    ...   target = manager.restore(100, args=ReshardRestore(world_size=3, rank=0))
    >>> target.state[0].mu["w"].shape
    (3,)
  """

  records: Iterable[ShardRecord] | None = None
  chunk_bytes: int | None = None
  _: dataclasses.KW_ONLY
  state: Any = None
  optimizer: Any = None
  shapes: Mapping[str, Any] | None = None
  params: Any = None
  trainable: Mapping[str, bool] | None = None
  mesh: jax.sharding.Mesh | None = None
  axis: str = "fsdp"

  def __post_init__(self):
    if self.chunk_bytes is not None:
      _index.check_chunk_bytes(self.chunk_bytes)
    if (self.records is None) == (self.state is None):
      raise PlacementError(
        "ReshardSave takes records, or a state (with optimizer, mesh and"
        " shapes or params), not both and not neither"
      )
    if self.state is not None:
      missing = [n for n in ("optimizer", "mesh") if getattr(self, n) is None]
      if (self.shapes is None) == (self.params is None):
        missing.append("exactly one of shapes and params")
      if missing:
        raise PlacementError(f"ReshardSave(state=...) also needs {', '.join(missing)}")
      if self.trainable is not None and self.params is None:
        raise PlacementError(
          "ReshardSave: trainable goes with params; with shapes, give each value a .trainable"
        )
    else:
      _archivecheck.check_records_iterable(self.records, "ReshardSave")
      records = tuple(self.records)  # an iterator is read once, here
      source = source_of(self.records)
      self.records = records if source is None else _reader.SourcedRecords(records, source)
    # Every refusal of the save, now: before orbax creates any directory.
    self.__dict__["_checked"] = check(self)

  def __setattr__(self, name: str, value: Any) -> None:
    # The state and params are kept in the plain form the archives store (NNX
    # State nodes as dicts, Variables as their values).
    if name in ("state", "params"):
      value = _plain.plain(value)
    # A changed field is checked again when the save prepares.
    super().__setattr__(name, value)
    self.__dict__.pop("_checked", None)

  def _checks(self) -> Checked:
    """What checking these arguments found: kept from their making, or found again after a
    change (a field set, or a leaf of the state replaced, added or taken out in place).

    Raises:
      ReshardError: a save of these arguments would be refused.
    """
    found = self.__dict__.get("_checked")
    if found is None or not found.holds(self.state):
      found = self.__dict__["_checked"] = check(self)
    return found


@dataclasses.dataclass(kw_only=True)
class ReshardRestore(ocp.args.CheckpointArgs):
  """What to restore: a state on a mesh, one target rank, or every archive.

  * ``mesh`` (and ``axis``): the optax state laid out on ``mesh``, every
    history leaf a global ``(M * slots,)`` array sharded over ``axis`` (M its
    size), ready for the training step: ``restore_sharded(...).state``. Every
    process restores only its own ranks. ``target`` (an abstract state whose
    shardings say the layout) is passed on to ``restore_sharded``, and so are
    ``optimizer`` and ``params``: the flat layout checked against the state
    that optimizer builds for those params (see ``restore_sharded``).
  * ``world_size`` and ``rank``: that target rank's ``ShardRecord``.
  * nothing: every archive, as saved (``load_records``).

  With ``mesh``, ``like`` puts the restored state's leaves into ``like``'s own
  tree, matched by key path: an ``nnx.Optimizer``'s ``opt_state`` (made for
  the new mesh) gets back its ``nnx.State`` nodes and Variables, ready for
  ``nnx.update(optimizer.opt_state, nnx.state(restored))``. It is passed on
  to ``restore_sharded(..., like=)``, which says the rule and its refusals.

  Every field is keyword-only.

  Attributes:
    world_size: the target world size (with ``rank``).
    rank: the target rank to build.
    mesh: the target mesh.
    axis: the mesh axis of the flat shards.
    target: optional abstract target for ``restore_sharded(..., target=)``.
    optimizer: with ``params`` (and a mesh, no target): the optax
      transformation the restored state will feed; the checkpoint is checked
      against it before anything is read.
    params: with ``optimizer``: the params pytree (arrays or
      ``jax.ShapeDtypeStruct``s).
    like: optional tree whose structure the restored state takes (with ``mesh``).
  """

  world_size: int | None = None
  rank: int | None = None
  mesh: jax.sharding.Mesh | None = None
  axis: str = "fsdp"
  target: Any = None
  optimizer: Any = None
  params: Any = None
  like: Any = None

  def __post_init__(self):
    if self.like is not None and self.mesh is None:
      raise PlacementError("ReshardRestore(like=...) needs the mesh as well")
    if self.mesh is not None and (self.rank is not None or self.world_size is not None):
      raise PlacementError("ReshardRestore takes a mesh, or world_size and rank, not both")
    if self.target is not None and self.mesh is None:
      raise PlacementError("ReshardRestore(target=...) needs the mesh as well")
    if (self.optimizer is None) != (self.params is None):
      raise PlacementError("ReshardRestore: optimizer= and params= go together; pass both")
    if self.optimizer is not None and (self.mesh is None or self.target is not None):
      raise PlacementError(
        "ReshardRestore(optimizer=..., params=...) checks the flat layout on a mesh:"
        " it needs mesh= and takes no target= (a target is checked by itself)"
      )
    if (self.rank is None) != (self.world_size is None):
      raise PlacementError("ReshardRestore(world_size=...) needs rank as well, and the reverse")
