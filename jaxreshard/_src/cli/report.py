"""How ``inspect`` and ``verify`` show what the library found: tables, summaries, capped lists.

Every name and path is shown escaped (``render.cell``, ``render.safe``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from rich.table import Table

from jaxreshard._src.checkpoint.compare import Comparison
from jaxreshard._src.checkpoint.locate import Located
from jaxreshard._src.cli.render import buffers_text, cell, console, safe, size, table


def located_info(found: Located) -> dict | None:
  """``--json``'s ``orbax``: the step and item taken, or None for a plain checkpoint."""
  if found.step is None and found.item is None:
    return None
  return dict(path=found.path, step=found.step, steps=list(found.steps), item=found.item)


def _title(checkpoint: Any, found: Located) -> str:
  where = found.describe()
  return f"{checkpoint} ({where})" if where else str(checkpoint)


# A parameter table of more rows than this lists its first ``_HEAD`` and last ``_TAIL``
# params unless ``--all`` asks for every one: rendering a table costs ~0.5 ms a row
# (5 s at 10,000 params), and ``--json`` lists every param.
_MAX_ROWS = 200
_HEAD, _TAIL = 100, 20


def print_inspect(checkpoint: Any, found: Located, info: dict, every: bool = False) -> None:
  """``inspect``: the parameter table, the clock table, the source, the totals.

  ``every``: list every param; otherwise a table of more than ``_MAX_ROWS`` params
  lists its first ``_HEAD`` and last ``_TAIL``, and says how many it left out."""
  out = console()
  t = table(
    cell(
      f"{_title(checkpoint, found)}: {info['archives']} archives, world size"
      f" {', '.join(map(str, info['world_sizes']))}"
    ),
    [
      (col, "right" if col in ("world", "bytes", "padded") else "left")
      for col in ("param", "shape", "world", "dtype", "train", "buffers", "bytes", "padded")
    ],
  )
  params = info["params"]
  left_out = 0 if every or len(params) <= _MAX_ROWS else len(params) - _HEAD - _TAIL
  for i, e in enumerate(params):
    if left_out and i == _HEAD:
      t.add_row("...")
    if left_out and _HEAD <= i < len(params) - _TAIL:
      continue
    ranks = e["ranks"]
    world = ", ".join(map(str, e["world_sizes"]))
    if len(ranks) != e["world_sizes"][0] or ranks != list(range(len(ranks))):
      world += f" (ranks {ranks})"
    t.add_row(
      cell(e["param"]),
      str(tuple(e["shape"])),
      world,
      e["dtype"],
      "yes" if e["trainable"] else "no",
      buffers_text(e["buffers"]),
      size(e["bytes"]),
      size(e["stored_bytes"]),
    )
  out.print(t)
  if left_out:
    out.print(
      cell(
        f"{left_out} params not listed between {params[_HEAD - 1]['param']} and"
        f" {params[-_TAIL]['param']} (--all lists every one)"
      )
    )
  if any(not e["buffers"] for e in info["params"]):
    out.print("buffers none: no optimizer state (frozen, or a stateless optimizer)")
  out.print(_clock_table(info))
  if info["source"] is not None:
    out.print(
      f"resharded from checkpoint {info['source']['checkpoint']} to world size"
      f" {info['source']['world_size']}"
    )
  files = info["files"]
  out.print(
    f"{len(info['params'])} params, {size(info['bytes'])} of optimizer state"
    f" ({size(info['stored_bytes'])} with padding; {size(info['disk_bytes'])} on disk"
    f" in {files} file{'s' if files != 1 else ''})"
  )


def _clock_table(info: dict) -> Table:
  clocks = table(
    "optimizer clock" + ("" if info["clocks_agree"] else " ([red]archives disagree[/])"),
    [("scalar", "left"), ("dtype", "left"), ("value", "left"), ("in optax state", "left")],
  )
  for c in info["clocks"]:
    value = c["value"]
    if c["truncated"]:
      n = int(np.prod(c["shape"], dtype=np.int64))
      value = f"{str(value)[:-1]}, ...] ({n} elements of shape {tuple(c['shape'])})"
    dtype = f"{c['dtype']} (weak)" if c["weak"] else c["dtype"]
    clocks.add_row(cell(c["path"]), dtype, cell(value), cell(c["name"]))
  return clocks


def verify_info(c: Comparison, counts: dict) -> dict:
  """``verify --json``: the verdict, every difference, each differing buffer's figures."""
  return dict(
    identical=c.identical,
    within_tolerance=None if c.tolerance is None else c.identical or c.within_tolerance,
    tolerance=None if c.tolerance is None else dict(rtol=c.tolerance[0], atol=c.tolerance[1]),
    differences=[text for _, text in c.differences],
    differing_buffers=[
      dict(
        param=b.param,
        buffer=b.buffer,
        dtype=b.dtype,
        elements=b.count,
        differing=b.differing,
        first_index=None if b.first is None else b.first[0],
        first=None if b.first is None else b.first[1],
        max_abs_diff=_json_float(b.max_abs),
        max_rel_diff=_json_float(b.max_rel),
        outside_tolerance=b.outside,
      )
      for b in c.buffers
    ],
    digest=c.digest.hexdigest(),
    out_digest=c.out_digest.hexdigest(),
    **counts,
  )


def _json_float(x: float) -> float | str:
  return x if np.isfinite(x) else str(x)  # JSON has no infinity


def _plural(n: int, word: str) -> str:
  return f"{n} {word}{'' if n == 1 else 's'}"


def _summary(c: Comparison, counts: dict) -> str:
  kinds = [kind for kind, _ in c.differences]
  parts = []
  if kinds.count("scalar"):
    # Of the clock scalars either side holds: a path one side lacks differs too.
    paths = {s[0] for s in c.digest.scalars} | {s[0] for s in c.out_digest.scalars}
    parts.append(f"{kinds.count('scalar')} of {len(paths)} clock scalars")
  if kinds.count("buffer"):
    params = len({b.param for b in c.buffers})
    parts.append(
      f"{kinds.count('buffer')} of {counts['buffers']} buffers"
      + (f" ({_plural(params, 'param')})" if params else "")
    )
  other = len(kinds) - kinds.count("scalar") - kinds.count("buffer")
  if other:
    parts.append(f"{other} other (structure, parameters, problems)")
  return f"{_plural(len(kinds), 'difference')}: {', '.join(parts)}"


def print_verify(
  names: tuple[Any, Any], c: Comparison, counts: dict, max_diffs: int, as_json: bool
) -> None:
  """``verify``'s answer: a summary line, then at most ``max_diffs`` differences.

  Within a tolerance the summary says so, and that the states are still not
  bit-identical; each buffer that differs gives its largest differences. A
  difference is also one line on stderr (the only output with ``as_json``).
  """
  if as_json:
    if not (c.identical or c.within_tolerance):
      _print_not_held(names, c)
    return
  out = console()
  if c.identical:
    scalars = counts["clock_scalars"]
    out.print(
      f"identical: {counts['params']} params, {counts['buffers']} buffers"
      f" ({counts['elements']} elements), {scalars} clock scalar{'s' if scalars != 1 else ''},"
      f" padding all zero; digest {c.digest.hexdigest()[:16]}"
    )
    return
  within = c.within_tolerance
  if within:
    rtol, atol = c.tolerance
    out.print(
      f"within tolerance (rtol={rtol:g}, atol={atol:g}), not bit-identical: {_summary(c, counts)}"
    )
    lines = [
      f"param {b.param!r} buffer {b.buffer}: max abs diff {b.max_abs:.3g}, max rel diff"
      f" {b.max_rel:.3g} ({b.differing} of {b.count} elements differ)"
      for b in c.buffers
    ]
  else:
    tol = ""
    if c.tolerance is not None:
      outside = sum(b.outside > 0 for b in c.buffers)
      tol = f"; {outside} buffers outside rtol={c.tolerance[0]:g}, atol={c.tolerance[1]:g}"
    out.print(cell(f"different: {_summary(c, counts)}{tol}"))
    lines = [f"differs: {text}" for _, text in c.differences]
  for line in lines[:max_diffs]:
    out.print(cell(line))
  if len(lines) > max_diffs:
    out.print(f"... {len(lines) - max_diffs} more not shown (--max-diffs N shows up to N)")
  if not within:
    _print_not_held(names, c)


def _print_not_held(names: tuple[Any, Any], c: Comparison) -> None:
  n = len(c.differences)
  print(
    f"jaxreshard: {safe(names[1])} does not hold {safe(names[0])}'s optimizer state"
    f" ({n} difference{'s' if n != 1 else ''})",
    file=sys.stderr,
  )
