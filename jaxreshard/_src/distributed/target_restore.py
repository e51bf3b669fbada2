"""Restore a checkpoint into any target sharding, in logical (param-shaped) form.

The target is an abstract optax state: the tree ``optimizer.init(params)``
builds, each leaf a ``jax.ShapeDtypeStruct`` (or array) whose ``.sharding``
says where its pieces live. For each history leaf and each of this process's
devices, the sharding gives the device's index box of the parameter's logical
shape. The box's row-major flat element ranges are the runs a restore needs;
each run is split where the source flat shards (``ceil(count / W)`` elements
per source rank) begin and end, which names the source archive and the offset
inside its packed buffer. Every (archive, dtype) is then read once, through the
checkpoint reader, only in the chunks those runs touch (each chunk checked
against its crc32c), into one host buffer per dtype; each device's piece is a
view of it. Devices holding the same box (replicas) share one read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
import optax

from jaxreshard._src.checkpoint import pads as _pads
from jaxreshard._src.checkpoint import restore as _restore
from jaxreshard._src.checkpoint.reader import (
  STAGING_BYTES,
  Checkpoint,
  ReadStats,
  allocate,
  open_checkpoint,
)
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import plain as _plain
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core.placement import ParamPlacement
from jaxreshard._src.distributed import restore_agreement as _agreement
from jaxreshard._src.distributed.mesh import MeshState
from jaxreshard._src.errors import DtypeError, PlacementError, ReshardError, ShapeError
from jaxreshard._src.progress import ProgressCallback, Reporter

__all__ = [
  "box_runs",
  "check_leaf",
  "check_structure",
  "checkpoint_state",
  "raise_collected",
  "restore_to_target",
]

# How many leaf paths a structure refusal lists before it stops.
_MAX_LISTED = 8

Box = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class _Hist:
  """Stands for history buffer ``subtree`` of validated group ``group``."""

  group: int
  subtree: int


def restore_to_target(
  directory: Any,
  target: Any,
  *,
  stats: ReadStats | None = None,
  progress: ProgressCallback | None = None,
  checkpoint: Checkpoint | None = None,
) -> MeshState:
  """The checkpoint's full optax state, laid out as ``target``'s shardings say.

  Args:
    directory: a checkpoint written by ``save_records`` or ``save_sharded``.
    target: the abstract state (see ``restore_sharded``).
    stats: a counter of the chunk bytes this process reads, when given.
    progress: told after each source archive read (see ``restore_sharded``).
    checkpoint: ``directory`` already opened, every process of the restore agreed.

  Returns:
    ``MeshState(state, {0: placements})``: see ``restore_sharded``.
  """
  ckpt = checkpoint
  if ckpt is None:
    processes = _agreement.processes_of(_agreement.restore_devices(None, target))
    ckpt = _agreement.opened_everywhere(processes, lambda: open_checkpoint(directory), directory)
  groups, expected = checkpoint_state(ckpt)
  paths, leaves, treedef = check_structure(expected, target, groups)
  specs = [check_leaf(p, e, t, groups) for p, e, t in zip(paths, leaves, jax.tree.leaves(target))]
  raise_collected("the target does not match the checkpoint", specs)

  host = _read(ckpt, groups, leaves, specs, stats, progress)
  out = []
  for leaf, spec, data in zip(leaves, specs, host):
    out.append(_place(leaf, spec, data))
  placements = tuple(
    ParamPlacement(g.param, g.target.shape, 0, 1, g.dtype, g.trainable) for g in groups
  )
  return MeshState(jax.tree_util.tree_unflatten(treedef, out), {0: placements})


# --- checking the target -------------------------------------------------------


def checkpoint_state(ckpt: Checkpoint) -> tuple[list[Any], Any]:
  """The validated groups of every parameter, and the saved state's tree.

  The tree is the full (logical) optax state the checkpoint holds, with a
  ``_Hist`` in place of each history buffer and the saved clock scalars.
  Validating the layout of one rank runs every refusal a restore makes
  (groups, clocks, histories, dtypes).
  """
  groups = _restore.validated_whole(ckpt)
  if not groups:
    raise PlacementError("the checkpoint holds no parameters")
  template = ckpt.template(groups[0].by_rank[0])
  histories = {
    g.param: [_Hist(gi, m) if present is True else present for m, present in enumerate(g.history)]
    for gi, g in enumerate(groups)
  }
  keys = _structure.mirror_trees(ckpt.template(a) for a in sorted({g.by_rank[0] for g in groups}))
  return groups, _structure.build_state(template, histories, keys=keys)


def raise_collected(
  what: str, checked: list[Any], kinds: tuple = (), default: type = ReshardError
) -> None:
  """Raises every error in ``checked`` as one, of the most specific class they share.

  ``kinds`` are the classes to choose from, most specific first (default:
  DtypeError, ShapeError, PlacementError; DtypeError is both of the others);
  ``default`` is raised when they share none of them.
  """
  errors = [s for s in checked if isinstance(s, Exception)]
  if not errors:
    return
  kinds = kinds or (DtypeError, ShapeError, PlacementError)
  kind = next((c for c in kinds if all(isinstance(e, c) for e in errors)), default)
  raise kind(
    f"{what}: "
    + "; ".join(str(e) for e in errors[:_MAX_LISTED])
    + (f"; and {len(errors) - _MAX_LISTED} more" if len(errors) > _MAX_LISTED else "")
  )


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _describe(leaf: Any, groups) -> str:
  if isinstance(leaf, _Hist):
    return f"history buffer {leaf.subtree} of param {groups[leaf.group].param!r}"
  if _is_masked(leaf):
    return "a masked position (optax.MaskedNode)"
  return "a clock scalar"


def check_structure(
  expected: Any, target: Any, groups, whose: str = "the target's"
) -> tuple[list[str], list[Any], Any]:
  """The expected leaves with their key paths, and the target's tree; a target of
  another tree is refused (NamedTuple nodes compared by name and fields: see
  ``plain.same_tree``).

  Masked positions count as leaves here, so a target that leaves out a
  parameter the optimizer masks is refused as well.
  """
  exp = jax.tree_util.tree_flatten_with_path(expected, is_leaf=_is_masked)[0]
  tgt = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_masked)[0]
  exp_paths = [jax.tree_util.keystr(p) for p, _ in exp]
  tgt_paths = [jax.tree_util.keystr(p) for p, _ in tgt]
  if exp_paths != tgt_paths:
    exp_set, tgt_set = set(exp_paths), set(tgt_paths)
    missing = [(p, x) for p, (_, x) in zip(exp_paths, exp) if p not in tgt_set]
    extra = [p for p in tgt_paths if p not in exp_set]
    parts = []
    if missing:
      parts.append(
        "it lacks the checkpoint's "
        + ", ".join(f"leaf {p} ({_describe(x, groups)})" for p, x in missing[:_MAX_LISTED])
      )
    if extra:
      parts.append(
        "extra " + ", ".join(f"leaf {p}" for p in extra[:_MAX_LISTED]) + " (not in the checkpoint)"
      )
    if not parts:
      parts.append(
        f"leaves in another order: first difference at leaf"
        f" {next(a for a, b in zip(tgt_paths, exp_paths) if a != b)}"
      )
    raise PlacementError(f"{whose} tree does not match the checkpoint's state: " + "; ".join(parts))
  leaves, treedef = jax.tree_util.tree_flatten(expected)
  target_def = jax.tree_util.tree_structure(target)
  for p, (_, e), (_, t) in zip(exp_paths, exp, tgt):
    if _is_masked(e) != _is_masked(t):  # a mask changed between the save and now
      how = (
        f"{whose} tree masks it, but the checkpoint holds state there"
        if _is_masked(t)
        else f"the checkpoint masks it, but {whose} tree holds state there"
      )
      raise PlacementError(
        f"leaf {p}: {how} (an optax.masked or multi_transform mask other than the saved"
        " optimizer's)"
      )
  if not _plain.same_tree(target_def, treedef):
    raise PlacementError(
      f"{whose} tree has the checkpoint's leaf paths but other node types:"
      f" {whose} {str(target_def)[:300]} vs the checkpoint's {str(treedef)[:300]}"
    )
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]]
  # The target's own tree: its NamedTuple classes where the checkpoint has plain ones.
  return paths, leaves, target_def


@dataclasses.dataclass(frozen=True)
class _Spec:
  """A checked target leaf: logical shape, dtype, sharding, this process's boxes."""

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  sharding: Any
  boxes: tuple[Box, ...]  # distinct boxes of this process's devices, in first-seen order


def _scalar_dtypes(x: Any) -> tuple[np.dtype, ...]:
  """The target dtypes a clock scalar may be described by; the first is its own.

  A value handed back as it is (``_clock.stays_on_host``) has no jax array to
  match, so the dtype jax gives it (what ``jax.eval_shape`` of the state says:
  float32 for a float64 while x64 is off) describes it as well as its own.
  """
  if _clock.is_python_number(x):
    return (_clock.python_dtype(x), np.dtype(type(x)))
  if _clock.is_key_dtype(x.dtype):
    return (x.dtype,)  # a typed PRNG key's own dtype: no numpy dtype describes it
  own = np.dtype(x.dtype)
  if _clock.stays_on_host(x):
    return (own, np.dtype(jax.dtypes.canonicalize_dtype(own)))
  return (own,)


def _dtype_name(dtype: Any) -> str:
  return str(dtype) if _clock.is_key_dtype(dtype) else np.dtype(dtype).name


def check_leaf(path: str, leaf: Any, t: Any, groups, whose: str = "the target") -> Any:
  """The leaf's spec, or the error (returned, so every bad leaf is reported at once).

  ``whose`` names what ``t`` belongs to; ``"the target"`` also needs a sharding
  (anything else is checked for shape and dtype only, and gives None).
  """
  if isinstance(leaf, _Hist):
    g = groups[leaf.group]
    what = f"leaf {path} (param {g.param!r})"
    shape, dtype = tuple(g.target.shape), np.dtype(g.facts.buffer_dtypes[leaf.subtree])
  else:
    what = f"leaf {path} (clock scalar)"
    dtypes = _scalar_dtypes(leaf)
    shape, dtype = tuple(np.shape(leaf)), dtypes[0]
  sharding = getattr(t, "sharding", None)
  if not (hasattr(t, "shape") and hasattr(t, "dtype")):
    return PlacementError(
      f"{what}: the target leaf is a {type(t).__name__}, not a jax.ShapeDtypeStruct with a sharding"
    )
  if tuple(t.shape) != shape:
    return ShapeError(
      f"{what}: {whose} has shape {tuple(t.shape)} but the checkpoint holds {shape}"
    )
  t_dtype = t.dtype if _clock.is_key_dtype(t.dtype) else np.dtype(t.dtype)
  if t_dtype != dtype and (isinstance(leaf, _Hist) or t_dtype not in dtypes):
    return DtypeError(
      f"{what}: {whose} has dtype {_dtype_name(t_dtype)} but the"
      f" checkpoint holds {_dtype_name(dtype)}; buffers are restored in their saved"
      " dtype, never converted"
    )
  if whose != "the target":
    return None
  if not isinstance(sharding, jax.sharding.Sharding):
    return PlacementError(
      f"{what}: the target leaf has no sharding (got"
      f" {type(sharding).__name__}); attach one, e.g. a NamedSharding"
    )
  try:
    index_map = sharding.addressable_devices_indices_map(shape)
  except Exception as e:  # jax's own refusal of the sharding for this shape
    return PlacementError(
      f"{what}: its sharding cannot lay out shape {shape}: {type(e).__name__}: {e}"
    )
  boxes: dict[Box, None] = {}
  for index in index_map.values():
    try:
      boxes.setdefault(_box(index, shape))
    except ValueError as e:
      return PlacementError(f"{what}: {e}")
  return _Spec(path, shape, dtype, sharding, tuple(boxes))


def _box(index: Any, shape: tuple[int, ...]) -> Box:
  """A device's index (a tuple of slices) as ``(start, stop)`` per dimension."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
  out = []
  for s, n in zip(index, shape):
    if not isinstance(s, slice):
      raise ValueError(f"device index {index} is not a tuple of slices")
    lo, hi, step = s.indices(n)
    if step != 1:
      raise ValueError(f"device index {index} has a stride; only contiguous boxes exist")
    out.append((lo, max(lo, hi)))
  return tuple(out)


# --- planning and reading --------------------------------------------------------


def box_runs(shape: tuple[int, ...], box: Box) -> tuple[np.ndarray, np.ndarray]:
  """The row-major flat element ranges of ``box`` inside an array of ``shape``.

  Returns:
    ``(starts, length)``: the start of each run, in row-major order of the
    box, and the length every run shares. A box with no elements has no runs.

  Examples:
    >>> starts, length = box_runs((4, 6), ((1, 3), (2, 4)))
    >>> starts.tolist(), length
    ([8, 14], 2)
  """
  if any(hi <= lo for lo, hi in box):
    return np.zeros(0, np.int64), 0
  n = len(shape)
  if n == 0:
    return np.zeros(1, np.int64), 1
  # Trailing dimensions the box covers whole join the run of the last partial one.
  k = n - 1
  while k > 0 and box[k] == (0, shape[k]):
    k -= 1
  strides = [math.prod(shape[i + 1 :]) for i in range(n)]
  length = (box[k][1] - box[k][0]) * strides[k]
  starts = np.array([box[k][0] * strides[k]], np.int64)
  for i in range(k - 1, -1, -1):
    lo, hi = box[i]
    starts = (np.arange(lo, hi, dtype=np.int64)[:, None] * strides[i] + starts[None, :]).ravel()
  return starts, length


def _split(starts: np.ndarray, length: int, dst: np.ndarray, ss: int):
  """Runs of the logical flat buffer cut at source-rank boundaries (``ss`` slots each).

  Returns parallel arrays: source rank, offset inside that rank's buffer,
  destination, length.
  """
  run, rank, src, skip, n = _copyplan.cut_runs(starts, np.full(len(starts), length), max(ss, 1))
  return rank, src, dst[run] + skip, n


def _padding_share(
  ckpt: Checkpoint, g: Any, subtree: int, sharding: Any, trailing: Any, memo: dict
) -> None:
  """Adds this process's share of the source ranks holding only padding of ``g``'s
  history buffer ``subtree`` to ``trailing``.

  No run copies from the source ranks after the one holding the param's last
  element, and their padding is checked all the same. Every process that the
  leaf's sharding spans restores the leaf; each checks an equal share of those
  ranks, in rank order by its place among the processes, so that together they
  check every one and no process opens archives in proportion to the source
  world (as one holding a replicated param whole would, checking them all).
  """
  source = g.source
  ss, world = source.slots, source.world_size
  first = -(-source.count // ss) if ss else world  # the first all-padding rank
  if first >= world:
    return
  # The processes of each sharding and each group's archives by rank, found once
  # per object in one restore (the specs and groups hold them meanwhile).
  processes = memo.get(("processes", id(sharding)))
  if processes is None:
    processes = memo[("processes", id(sharding))] = sorted(
      {d.process_index for d in sharding.device_set}
    )
  me = jax.process_index()
  if me not in processes:
    return
  j, n, left = processes.index(me), len(processes), world - first
  lo, hi = first + -(-left * j // n), first + -(-left * (j + 1) // n)
  if lo >= hi:
    return
  archives = memo.get(("archives", id(g.by_rank)))
  if archives is None:
    archives = memo[("archives", id(g.by_rank))] = np.asarray(g.by_rank, np.int64)
  trailing.add(g.buffer_dtypes[subtree], archives[lo:hi], ckpt.index.name_of[g.param], subtree)


def _read(ckpt: Checkpoint, groups, leaves, specs, stats, progress) -> list[Any]:
  """Host data of every leaf: ``{box: array}`` for histories, the value for scalars."""
  sizes: dict[np.dtype, int] = {}
  where: list[dict[Box, int]] = []
  runs: dict[tuple[int, np.dtype], list[tuple[np.ndarray, ...]]] = {}
  trailing = _pads.Trailing()  # this process's share of the all-padding source ranks
  memo: dict[tuple, Any] = {}  # for _padding_share
  for leaf, spec in zip(leaves, specs):
    if not isinstance(leaf, _Hist):
      where.append({})
      continue
    g = groups[leaf.group]
    _padding_share(ckpt, g, leaf.subtree, spec.sharding, trailing, memo)
    at = {}
    for box in spec.boxes:
      n = math.prod(hi - lo for lo, hi in box)
      at[box] = offset = sizes.get(spec.dtype, 0)
      sizes[spec.dtype] = offset + n
      starts, length = box_runs(spec.shape, box)
      if not len(starts):
        continue
      dst = offset + np.arange(len(starts), dtype=np.int64) * length
      rank, src, dst, lens = _split(starts, length, dst, g.source.slots)
      for r in _copyplan.unique_ints(rank).tolist():
        sel = rank == r
        archive = g.by_rank[r]
        # A history buffer lives in its archive's packed buffer of its dtype.
        d, base, _ = ckpt.layout(archive).offsets[(g.param, leaf.subtree)]
        runs.setdefault((archive, np.dtype(d)), []).append((src[sel] + base, dst[sel], lens[sel]))
    where.append(at)

  # Each group's first archive and this process's share of its archives, read or not.
  for archive in _restore.described_sources(ckpt, groups, jax.process_index(), jax.process_count()):
    ckpt.check_described(archive)
  keys = sorted(runs, key=lambda k: (k[0], k[1].name))
  wanted = {key: [(src, lens) for src, _, lens in runs[key]] for key in keys}
  with _restore.opened_archives(ckpt, keys, wanted) as files:
    out = {d: allocate(n, d, f"restore_sharded of {ckpt.directory}") for d, n in sizes.items()}
    scratch = np.empty(STAGING_BYTES, np.uint8)
    per_archive: dict[int, int] = {}  # bytes copied out of each archive, in reading order
    tables = []
    for archive, d in keys:
      src, dst, lens = (np.concatenate(x) for x in zip(*runs[(archive, d)]))
      tables.append((archive, d, src, dst, lens))
      per_archive[archive] = per_archive.get(archive, 0) + int(lens.sum()) * d.itemsize
    reporter = Reporter(
      "restore_sharded",
      progress,
      where=ckpt.directory,
      total=len(per_archive),
      total_bytes=sum(per_archive.values()),
    )
    for i, (archive, d, src, dst, lens) in enumerate(tables):
      f = files.get((archive, d))
      ckpt.archives.read_runs(archive, d, src, dst, lens, out[d], scratch, stats, f=f)
      if i + 1 == len(tables) or tables[i + 1][0] != archive:
        reporter.step(per_archive[archive], archive=archive)
    ckpt.check_padding(trailing, scratch, stats, files=files)
    reporter.finish()

  host = []
  for leaf, spec, at in zip(leaves, specs, where):
    if not isinstance(leaf, _Hist):
      host.append(leaf)
      continue
    pieces = {}
    for box, offset in at.items():
      extent = tuple(hi - lo for lo, hi in box)
      pieces[box] = out[spec.dtype][offset : offset + math.prod(extent)].reshape(extent)
    host.append(pieces)
  return host


def _place(leaf: Any, spec: _Spec, data: Any) -> Any:
  """One leaf as a global array laid out by its target sharding."""
  if not isinstance(leaf, _Hist):
    if _clock.stays_on_host(data):
      # A Python number (it has no placement), or a 64-bit value jax would cut
      # to 32 bits while x64 is off: handed back as it is, as ``restore`` does.
      return data
    if _clock.is_key_dtype(spec.dtype):
      return jax.device_put(data, spec.sharding)  # a typed PRNG key moves as it is
    value = np.asarray(data)
    made = jax.make_array_from_callback(
      spec.shape, spec.sharding, lambda index: np.asarray(value[index]), dtype=spec.dtype
    )
    return _clock.keep_weak(made, data)

  def piece(index: Any) -> np.ndarray:
    return data[_box(index, spec.shape)]

  return jax.make_array_from_callback(spec.shape, spec.sharding, piece, dtype=spec.dtype)
