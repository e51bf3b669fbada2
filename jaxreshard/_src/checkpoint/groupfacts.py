"""What validation asks of a checkpoint's uniform groups, answered from the index alone.

A group is uniform when every archive of it has one layout and one clock, with
the group's slots: one archive then speaks for all, and the facts of all its
params are made in one pass over the group (``group_facts``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxreshard._src.checkpoint import regular as _regular
from jaxreshard._src.checkpoint.index import LeafInfo
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.errors import ReshardError

__all__ = ["group_facts", "is_uniform", "uniform_by_tables", "uniform_facts"]


def is_uniform(ckpt: Any, gi: int) -> bool:
  """Every archive of group ``gi`` has one layout and clock, with the group's slots."""
  g = ckpt.groups[gi]
  archives = [a for a, _ in g.ranks]
  u = (
    len({ckpt.archive_layout[a] for a in archives}) == 1
    and len({ckpt.clock_class(a) for a in archives}) == 1
    and all(len(ckpt.member[a]) == 1 for a in archives)
  )
  if u:
    layout = ckpt.layout(archives[0])
    histories = layout.histories
    for p in g.params:
      e = ckpt.params[p]
      hist = histories.get(e.param)
      if hist is None:
        continue
      slots = FlatShard.checked(e.shape, 0, g.world_size).slots
      if any(isinstance(h, LeafInfo) and h.shape != (slots,) for h in hist):
        u = False
        break
    u = u and histories.keys() <= ckpt.index.param_index[gi].keys()
  return u


def uniform_by_tables(ckpt: Any, gi: int) -> bool:
  """``is_uniform`` answered with the index's arrays, one pass per group: True only where
  it holds; False where it does not or where a dtype or history is one these arrays do
  not vouch for (``is_uniform`` then decides, param by param)."""
  t = ckpt.index.tables
  archives, _ = t.group_ranks(gi)
  if not len(archives):
    return False
  layouts, clocks = t.a_layout[archives], t.a_clock[archives]
  if (layouts != layouts[0]).any() or (clocks != clocks[0]).any():
    return False
  member = ckpt.member
  if any(len(member[a]) != 1 for a in archives.tolist()):
    return False
  entry = t.group_params(gi)
  count = t.p_count[entry]
  if (count < 0).any():
    return False
  slots = -(-count // int(t.g_world[gi]))
  name = t.p_name[entry]
  group = np.zeros(len(name), np.int64)
  return _regular.histories(ckpt.index, layouts[:1], name, group, slots) is not None


def uniform_facts(ckpt: Any, gi: int, pid: str, sources: tuple) -> _validate.SourceFacts:
  """The facts of ``pid`` of uniform group ``gi``, from its first archive alone."""
  g = ckpt.groups[gi]
  p = ckpt.index.param_index[gi].get(pid)
  if p is None:
    raise _validate.not_listed(pid, sources[0], ckpt)
  e = ckpt.params[p]
  a0 = sources[0]
  _validate.check_storage_dtype(e.dtype, f"param {pid!r}: archive {a0}")
  hist = ckpt.history(a0, pid)
  dtypes = []
  for m, h in enumerate(hist):
    if isinstance(h, LeafInfo):
      _validate.check_buffer_dtype(h.dtype, f"param {pid!r}: archive {a0}, history buffer {m}")
      dtypes.append(h.dtype)
    else:
      dtypes.append(None)
  return _validate.SourceFacts(
    param=pid,
    shape=e.shape,
    source=FlatShard.checked(e.shape, 0, g.world_size),
    by_rank=sources,
    dtype=e.dtype,
    trainable=e.trainable,
    history=tuple(True if isinstance(h, LeafInfo) else h for h in hist),
    buffer_dtypes=tuple(dtypes),
    clock=ckpt.clock_class(a0),
  )


def group_facts(ckpt: Any, gi: int, sources: tuple) -> dict[str, _validate.SourceFacts]:
  """The facts of every param of uniform group ``gi`` that passes its checks; the
  others are left out, for ``uniform_facts`` to refuse with their own message."""
  g = ckpt.groups[gi]
  a0 = sources[0]
  layout = ckpt.layout(a0)
  clock = ckpt.clock_class(a0)
  ok: dict[Any, bool] = {}

  def passes(check, dtype) -> bool:
    hit = ok.get((check, dtype))
    if hit is None:
      try:
        check(dtype, "")
        hit = True
      except (ReshardError, TypeError):
        hit = False
      ok[(check, dtype)] = hit
    return hit

  out = {}
  for p in g.params:
    e = ckpt.params[p]
    hist = layout.history(e.param)
    if not passes(_validate.check_storage_dtype, e.dtype):
      continue
    leaf = [isinstance(h, LeafInfo) for h in hist]
    if not all(passes(_validate.check_buffer_dtype, h.dtype) for h, b in zip(hist, leaf) if b):
      continue
    try:
      source = FlatShard.checked(e.shape, 0, g.world_size)
    except ReshardError:
      continue
    out[e.param] = _validate.SourceFacts(
      param=e.param,
      shape=e.shape,
      source=source,
      by_rank=sources,
      dtype=e.dtype,
      trainable=e.trainable,
      history=tuple(True if b else h for h, b in zip(hist, leaf)),
      buffer_dtypes=tuple(h.dtype if b else None for h, b in zip(hist, leaf)),
      clock=clock,
    )
  return out
