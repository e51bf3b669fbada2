"""The one pipeline every path runs: validate -> plan -> fetch -> execute -> record.

``reshard`` and ``reshard_ranks`` (archives in memory), ``restore`` and
``load_records`` (a checkpoint on disk), the CLI and the multi-host restore all
call :func:`validate` and :func:`build`; they differ only in their *sources*
(which answer validation's questions and say where each history buffer lives)
and their *fetch* step (how the planned runs become target buffers: numpy
copies from memory, jitted gathers on a device, reads from files). Sources in
memory have their padding checked after validation (``padcheck``); a read
from disk checks the padding it reads as it reads it.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import assembly as _assembly
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.core import groups as _groups
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.gcpause import no_gc
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.placement import Migration, ParamPlacement
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord
from jaxreshard._src.engine import devicefetch as _devicefetch
from jaxreshard._src.engine.sources import MemorySources, Sources
from jaxreshard._src.errors import PlacementError
from jaxreshard._src.exec import host as _host_exec

__all__ = [
  "EXECUTORS",
  "build",
  "build_batch",
  "common_sources",
  "memory_fetch",
  "no_gc",
  "validate",
  "validate_ranks",
]

EXECUTORS = ("auto", "host", "device")

# fetch(runs, sources, layout) -> {dtype: flat target buffer}
Fetch = Callable[[dict, list, _copyplan.TargetLayout], dict]


def validate(src: Sources, migrations: Sequence[Migration]) -> list[_validate.SourceGroup]:
  """Every refusal of one target rank's migrations; the groups, sorted by param.

  The source side of each group comes from ``src``'s cache after the first
  call, so a call costs time in the number of migrations only.
  """
  if isinstance(migrations, (str, bytes)) or not isinstance(migrations, Sequence):
    raise PlacementError(f"migrations must be a list of Migration, got {type(migrations).__name__}")
  if not gc.isenabled():  # already paused: by reshard_ranks, once for all its plans
    return _validated(src, migrations)
  with no_gc():
    return _validated(src, migrations)


def validate_ranks(src: Sources, plans: Sequence[Sequence[Migration]]) -> list[_groups.Groups]:
  """:func:`validate` of each list of ``plans``, refusing an empty one; lists that
  ``src``'s own ``plan`` made are recognised together, with a few numpy-free
  steps per rank and one C-level identity comparison per migration."""
  with no_gc():
    cache = getattr(src, "plan_cache", None)
    tables = None
    if cache is not None and isinstance(plans, (list, tuple)):
      tables = cache.validated_each(plans, lambda m: _validate_all(src, m))
    if tables is not None:
      return tables
    tables = []
    for migrations in plans:
      groups = validate(src, migrations)
      if not groups:
        raise PlacementError("no migrations: a target rank needs at least one parameter")
      tables.append(groups)
    return tables


def _validated(src: Sources, migrations: Sequence[Migration]) -> _groups.Groups:
  # A plan that the sources' own ``plan`` made is recognised by its objects.
  plans = getattr(src, "plan_cache", None)
  if plans is not None:
    groups = plans.validated(migrations, lambda: _validate_all(src, migrations))
    if groups is not None:
      return groups
  return _validate_all(src, migrations)


def _validate_all(src: Sources, migrations: Sequence[Migration]) -> _groups.Groups:
  seen: dict[str, Migration] = {}
  for m in migrations:
    if not isinstance(m, Migration):
      raise PlacementError(f"expected a Migration, got {type(m).__name__}")
    if not isinstance(m.param, str):
      raise PlacementError(
        f"a migration's param is a parameter id (a str), not {type(m.param).__name__} {m.param!r}"
      )
    if type(m.sources) is not tuple:
      raise PlacementError(
        f"param {m.param!r}: a migration's sources are the indices of its source"
        f" archives (a list of ints), not {type(m.sources).__name__} {m.sources!r}"
      )
    if m.param in seen:
      raise PlacementError(
        f"param {m.param!r}: two migrations target it (from archives"
        f" {list(seen[m.param].sources)} and {list(m.sources)}); pass one per parameter"
      )
    seen[m.param] = m
  geometry_checked = _groups.targets_checked(migrations)
  facts = []
  for m in migrations:
    f = src.facts(m.param, m.sources)
    facts.append(f)
    if not (m.shape == f.shape and type(m.shape) is tuple):
      target = _validate.check_target(m)
      raise PlacementError(
        f"param {m.param!r}: archive {f.by_rank[0]} has logical shape {f.shape}"
        f" but the target has {target.shape}"
      )
    if m.shape is not f.shape and any(type(d) is not int for d in m.shape):
      _validate.check_target(m)  # a dim 5.0 equals the sources' 5 but is no dim
    if not geometry_checked:
      # The shape is the sources' own, already checked: only the rank and world.
      try:
        FlatShard.of_checked_shape(f.shape, f.source.count, m.rank, m.world_size)
      except PlacementError as e:
        raise PlacementError(f"param {m.param!r}: invalid target placement: {e}") from None
  order = sorted(range(len(facts)), key=lambda i: facts[i].param)
  groups = _groups.Groups([migrations[i] for i in order], [facts[i] for i in order])
  clocks = {f.clock: f for f in groups.facts}
  if len(clocks) > 1:
    a, b = list(clocks.values())[:2]
    raise PlacementError(_clock.clock_mismatch(src, b.by_rank[0], a.by_rank[0], b.param))
  return groups


def memory_fetch(
  src: MemorySources, executor: str = "auto", packs: _devicefetch.Packs | None = None
) -> Fetch:
  """Runs over in-memory source buffers: numpy on the host, jitted gathers on a device.

  ``executor="auto"`` runs on the device when a source already lives on a
  GPU/TPU and on the host otherwise; "host" and "device" force one. ``packs``:
  the call's packed device buffers, shared with its padding check (a fresh one
  when None).
  """
  if executor not in EXECUTORS:
    raise PlacementError(f"executor {executor!r} is not one of {', '.join(EXECUTORS)}")
  packs = _devicefetch.Packs(src) if packs is None else packs

  def fetch(runs: dict, keys: list, layout: _copyplan.TargetLayout) -> dict:
    if executor == "device" or (executor == "auto" and src.on_accelerator(keys)):
      return _devicefetch.device_fetch(src, runs, keys, layout, packs)
    programs = getattr(src, "programs", None)

    def make() -> dict:
      views = src.host_views(keys)
      return {d: _host_exec.Program(views, r) for d, r in runs.items()}

    # A program holds views of the sources, and copies what they hold when it
    # runs; where a host view is a copy, a kept program would hold stale bytes.
    if programs is None or getattr(src, "host_copies", False):
      made = make()
    else:
      made = programs.get(runs, make)
    return {d: _host_exec.run(p, layout.sizes[d], d) for d, p in made.items()}

  return fetch


def build(
  src: Sources, groups: Sequence[_validate.SourceGroup], fetch: Fetch, *, logical: bool = False
) -> ShardRecord:
  """Plans, fetches and assembles one target rank's record from validated groups."""
  with no_gc():
    return _build(src, groups, fetch, logical=logical)


def _build(src: Sources, groups: _groups.Groups, fetch: Fetch, *, logical: bool) -> ShardRecord:
  family = groups.family

  def plan() -> tuple[dict, list]:
    return _copyplan.plan_runs(
      groups, layout, lambda a, g, m, d: src.locate_runs(groups, a, g, m, d)
    )

  if family is None:
    layout = _copyplan.target_layout(groups, logical=logical)
    runs, keys = plan()
  else:
    # Every rank of a family shares its layout; a rank's runs are kept for its next call.
    layout = family.remember(
      ("layout", logical), lambda: _copyplan.target_layout(groups, logical=logical)
    )
    runs, keys = family.recent(("runs", groups.uniform_rank, logical), plan)
  buffers = fetch(runs, keys, layout)
  if not logical and all(isinstance(b, np.ndarray) for b in buffers.values()):
    return deferred(src, groups, layout, buffers)
  return eager(src, groups, layout, buffers, logical=logical)


def build_batch(
  src: Sources, tables: Sequence[_groups.Groups], fetch: Fetch
) -> list[ShardRecord] | None:
  """Target ranks of one family (one layout), fetched as one; None where that does not
  apply (the caller builds them one by one).

  The runs of every rank are planned as ``build`` plans them, then fetched
  together into one buffer per dtype whose rows are the ranks' buffers: each
  source buffer is opened, read and checked once for them all, not once per
  rank. Each rank's record is deferred over its rows.
  """
  family = tables[0].family if tables else None
  if family is None or any(t.family is not family for t in tables):
    return None
  with no_gc():
    layout = family.remember(("layout", False), lambda: _copyplan.target_layout(tables[0]))
    ids: dict[Any, int] = {}
    parts: dict[np.dtype, list[_copyplan.Runs]] = {d: [] for d in layout.slots}
    for i, groups in enumerate(tables):
      runs, keys = family.recent(
        ("runs", groups.uniform_rank, False),
        lambda g=groups: _copyplan.plan_runs(
          g, layout, lambda a, gi, m, d: src.locate_runs(g, a, gi, m, d)
        ),
      )
      try:
        remap = np.asarray([ids.setdefault(k, len(ids)) for k in keys], np.int64)
      except TypeError:  # keys that cannot be hashed: no merged source list
        return None
      for d, r in runs.items():
        size = layout.sizes[d]
        parts[d].append(_copyplan.Runs(remap[r.source], r.src, r.dst + i * size, r.length))
    merged = {
      d: _copyplan.Runs(*(np.concatenate([getattr(r, f) for r in rs]) for f in _RUN_FIELDS))
      for d, rs in parts.items()
    }
    n = len(tables)
    rows = dataclasses.replace(layout, sizes={d: n * s for d, s in layout.sizes.items()})
    buffers = fetch(merged, list(ids), rows)
    if not all(isinstance(b, np.ndarray) for b in buffers.values()):
      return None
    return [
      deferred(
        src,
        groups,
        layout,
        {d: b[i * layout.sizes[d] : (i + 1) * layout.sizes[d]] for d, b in buffers.items()},
      )
      for i, groups in enumerate(tables)
    ]


_RUN_FIELDS = ("source", "src", "dst", "length")


def eager(
  src: Sources,
  groups: _groups.Groups,
  layout: _copyplan.TargetLayout,
  buffers: dict,
  *,
  logical: bool,
) -> ShardRecord:
  """The target record with its state built now: its leaves sliced from ``buffers``
  (numpy views or device slices), reshaped to the params' shapes when ``logical``."""
  built: list[list[Any]] = [list(f.history) for f in groups.facts]
  for dtype, slots in layout.slots.items():
    for slot, leaf in zip(slots, _leaves(buffers[dtype], layout.columns[dtype])):
      built[slot.group][slot.subtree] = (
        leaf.reshape(groups.facts[slot.group].shape) if logical else leaf
      )
  return record(src, groups, built)


def deferred(
  src: Sources, groups: _groups.Groups, layout: _copyplan.TargetLayout, buffers: dict
) -> ShardRecord:
  """The target record over its packed host buffers, its placements and state made
  when first read (``ShardRecord.deferred``)."""
  facts = groups.facts
  template = facts[0].by_rank[0] if facts else 0

  def make() -> _assembly.Assembly:
    return _assembly.Assembly(src.template(template), facts, layout, group_keys(src, facts))

  family = groups.family
  if family is None:
    return _assembly.deferred_record(make(), buffers, groups.rank.tolist(), groups.world.tolist())
  assembly = family.remember(("assembly", id(layout)), make)
  rank, world = groups.uniform_rank, family.world

  def placements() -> tuple:
    # A rank's placements are frozen: every record of the rank may share them.
    return family.recent(("placements", rank), lambda: assembly.placements(rank, world))

  return _assembly.deferred_record(assembly, buffers, rank, world, placements)


# ``build_ranks`` copies by blocks from this many target ranks on; fewer go run by run.
MIN_BLOCK_RANKS = 2


def build_ranks(
  src: Sources, tables: Sequence[_groups.Groups], executor: str, rows: dict | None = None
) -> list | None:
  """Every target rank of ``tables`` at once, by blocks (``copyplan.Blocks``); None
  where that does not apply and the ranks are built one by one.

  It applies to consecutive target ranks of one family (the plans ``plan``
  made of one world size, in rank order) whose sources are uniform archives in
  host memory: each dtype's target rows are one fresh 2-D buffer, filled
  buffer by buffer for every rank at once, and each rank's record is deferred
  over its rows. ``rows``: source stacks' arrays already made by this call (by
  ``id`` of the stack), read instead of made again.
  """
  if len(tables) < MIN_BLOCK_RANKS or executor == "device":
    return None
  family = tables[0].family
  if family is None or not hasattr(src, "stacked"):
    return None
  first = tables[0].uniform_rank
  if any(t.family is not family or t.uniform_rank != first + i for i, t in enumerate(tables)):
    return None
  archives = family.remember(("sources",), lambda: common_sources(family.facts))
  if not archives or not src.uniform(archives) or src.on_accelerator_archives(archives):
    return None
  with no_gc():
    return _build_ranks(src, tables, family, archives, first, rows or {})


def common_sources(facts: Sequence[Any]) -> tuple[int, ...] | bool:
  """The one ``by_rank`` every row shares, or False."""
  if not facts:
    return False
  first = facts[0].by_rank
  return first if all(f.by_rank == first for f in facts) else False


def _build_ranks(src, tables, family, archives, first, made: dict) -> list | None:
  groups = tables[0]
  layout = family.remember(("layout", False), lambda: _copyplan.target_layout(groups))
  work = []
  for dtype in layout.slots:
    stack = src.stacked(archives, dtype)
    if stack is None:
      return None
    blocks = family.remember(
      ("blocks", dtype, id(stack)),
      lambda: _copyplan.plan_blocks(groups, layout, dtype, stack.order, stack.offsets) or False,
    )
    if blocks is False:
      return None
    work.append((dtype, stack, blocks))
  n = len(tables)
  if not family.remember(("by blocks", first, n), lambda: _blocks_pay(work, first, n)):
    return None
  rows = {}
  for dtype, stack, blocks in work:
    # One flat buffer whose rank rows are flat views of it (a writer sees each
    # rank's buffers tile one 1-D buffer, as a rank built alone).
    size = layout.sizes[dtype]
    flat = np.zeros(n * size, dtype)
    out = flat.view(_host_exec.UINT[flat.itemsize]).reshape(n, size)
    # The narrow tiles' gather tables, made by the first call of these rows.
    tables = family.recent(("tiles", dtype, id(stack), first, n), dict)
    source = made.get(id(stack))
    _host_exec.copy_blocks(stack.array() if source is None else source, out, blocks, first, tables)
    rows[dtype] = [flat[i * size : (i + 1) * size] for i in range(n)]
  assembly = family.remember(
    ("assembly", id(layout)),
    lambda: _assembly.Assembly(
      src.template(archives[0]), family.facts, layout, group_keys(src, family.facts)
    ),
  )
  return [
    _assembly.deferred_record(assembly, {d: r[i] for d, r in rows.items()}, first + i, family.world)
    for i in range(n)
  ]


# What copying by blocks costs beside copying run by run, in runs (a run costs
# about 0.5 us of Python: a view and its part of a concatenate, or about 8 KiB
# of copying): a buffer's few reshapes, and a source stack that is a copy.
_BLOCK_RUNS = 16
_RUN_BYTES = 8 << 10


def _blocks_pay(work: list, first: int, n: int) -> bool:
  """Whether blocks beat runs for target ranks ``first .. first + n - 1``: the runs
  are every (source rank, target rank) overlap of every buffer."""
  runs = blocks = extra = 0
  for dtype, stack, b in work:
    ts, ss = b.dst_slots, np.maximum(b.src_slots, 1)
    lo = np.minimum(first * ts, b.count)
    hi = np.minimum((first + n) * ts, b.count)
    some = hi > lo
    k = (hi - 1) // ss + 1 - lo // ss
    r = -(-(hi - lo) // np.maximum(ts, 1))
    runs += int(np.where(some, k + r - 1, 0).sum())
    blocks += int(some.sum())
    extra += stack.copied * np.dtype(dtype).itemsize // _RUN_BYTES
  return runs > _BLOCK_RUNS * blocks + extra


def _roles(template: _structure.StateParts, histories: dict[str, list[Any]]) -> tuple | None:
  """The roles of ``build_state(template, histories)``'s leaves, read off the template.

  When every subtree holds exactly the template's params, ``build_state``
  puts each back in the template's structure, so the leaves are the
  skeleton's, each subtree's in its flatten order with masked and absent
  entries left out (a masked entry has no leaf). None otherwise.
  """
  subtrees = []
  for i, subtree in enumerate(template.subtrees):
    order = subtree.order
    if sum(h[i] is not None for h in histories.values()) != len(order):
      return None
    held = [histories.get(p) for p in order]
    if any(h is None or h[i] is None for h in held):
      return None
    subtrees.append([p for p, h in zip(order, held) if h[i] is not _structure.MASKED])
  roles: list[str | None] = []
  for leaf in template.skeleton_leaves:
    if isinstance(leaf, _structure.ParamsSubtreeSlot):
      roles.extend(subtrees[leaf.index])
    else:
      roles.append(None)
  return tuple(roles)


def _leaves(buffer: Any, columns: tuple[np.ndarray, ...]) -> list[Any]:
  """The history buffers inside one packed buffer: numpy views, or device slices."""
  _, _, offset, size = columns
  if isinstance(buffer, np.ndarray):
    return [buffer[a:b] for a, b in zip(offset.tolist(), (offset + size).tolist())]
  from jaxreshard._src.exec import device as _device_exec  # pylint: disable=g-import-not-at-top

  return _device_exec.split(buffer, size.tolist())


def group_keys(src: Sources, facts: Sequence[Any]) -> Any:
  """``structure.mirror_trees`` of the template of every group ``facts`` come from,
  the groups found when a key is first asked for (most states never ask)."""
  made: list = []

  def keys(i: int) -> Any:
    if not made:
      firsts = {f.by_rank[0] for f in facts}
      made.append(_structure.mirror_trees(src.template(a) for a in sorted(firsts)))
    return made[0](i)

  return keys


def record(src: Sources, groups: _groups.Groups, built: list[list[Any]]) -> ShardRecord:
  """The target record: the template archive's clock, the built history buffers.

  ``built`` holds per group its per-subtree entries: the built buffer where
  the group's facts say True, else the facts' own MASKED or None.
  """
  facts = groups.facts
  template = src.template(facts[0].by_rank[0] if facts else 0)
  histories = {f.param: entries for f, entries in zip(facts, built)}
  state = _structure.build_state(template, histories, keys=group_keys(src, facts))
  roles = _roles(template, histories)
  if roles is None:
    # A leaf is a history buffer exactly when it is one of the buffers just built.
    role_of = {
      id(leaf): f.param
      for f, entries in zip(facts, built)
      for present, leaf in zip(f.history, entries)
      if present is True
    }
    roles = tuple([role_of.get(id(x)) for x in jax.tree.leaves(state)])
  placements = tuple(
    map(
      ParamPlacement.checked,
      groups.params,
      [f.shape for f in facts],
      groups.rank.tolist(),
      groups.world.tolist(),
      [f.dtype for f in facts],
      [f.trainable for f in facts],
    )
  )
  return ShardRecord(version=RECORD_VERSION, placements=placements, state=state, roles=roles)
