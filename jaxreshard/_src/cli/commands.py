"""The ``jaxreshard`` command line: demo, inspect, reshard, verify, clean, merge.

Exit codes follow ``cmp``/``diff``: 0 success (for ``verify``: identical),
1 a negative answer (``verify``: the checkpoints differ; ``demo``: a check
failed), 2 trouble (a refused, missing or unreadable checkpoint). Trouble is
one line on stderr, never a traceback. What each command shows, and how, is
``render``'s; what a checkpoint holds is the library's.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import typer

import jaxreshard as jr
from jaxreshard._src.checkpoint import compare as _compare
from jaxreshard._src.checkpoint import digest as _digest
from jaxreshard._src.checkpoint import locate as _locate_mod
from jaxreshard._src.checkpoint import merge as _merge
from jaxreshard._src.checkpoint import read_plan as _read_plan
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint import restore as _restore
from jaxreshard._src.checkpoint import store as _store
from jaxreshard._src.checkpoint import summary as _summary
from jaxreshard._src.checkpoint.summary import inspect_info
from jaxreshard._src.cli import interrupts as _interrupts
from jaxreshard._src.cli import render as _render
from jaxreshard._src.cli import report as _report
from jaxreshard._src.cli import streams as _streams
from jaxreshard._src.cli.options import integer as _integer
from jaxreshard._src.cli.options import item_option as _item_option
from jaxreshard._src.cli.options import path as _path
from jaxreshard._src.cli.options import step_option as _step_option
from jaxreshard._src.cli.render import EXIT_DIFFERENT, EXIT_ERROR, progress_bar, safe

__all__ = ["EXIT_DIFFERENT", "EXIT_ERROR", "app", "inspect_info", "main", "progress_bar", "safe"]


app = typer.Typer(
  name="jaxreshard",
  cls=_render.Group,
  help="Exact resharding of optax flat-shard (ZeRO / FSDP) optimizer state.",
  no_args_is_help=True,
  add_completion=False,
  pretty_exceptions_enable=False,
)


_WHERE = (
  "a jaxreshard checkpoint directory, or an orbax step or run directory"
  " (a CheckpointManager's) holding a jaxreshard item"
)


def _locate(path: Path, step: int | None = None, item: str | None = None) -> _locate_mod.Located:
  """The checkpoint a path names; an orbax step or item taken is said on stderr."""
  found = _locate_mod.locate(path, step=step, item=item)
  if found.describe():
    print(f"jaxreshard: {safe(path)}: {safe(found.describe())}", file=sys.stderr)
  return found


def _version(value: bool) -> None:
  if value:
    print(f"jaxreshard {jr.__version__}")
    raise typer.Exit()


@app.callback()
def _root(
  version: bool = typer.Option(
    False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
  ),
) -> None:
  """Exact resharding of optax flat-shard (ZeRO / FSDP) optimizer state."""
  del version


# --------------------------------------------------------------------------- demo


@app.command(cls=_render.Command)
@_render.guard
def demo(
  steps: int = typer.Option(
    3, parser=lambda t: _integer(t, 1), help="AdamW steps to train before sharding."
  ),
  save: Path | None = typer.Option(
    None,
    "--save",
    parser=_path,
    help="Keep the 8-rank checkpoint here, to try the other commands on.",
  ),
  as_json: bool = typer.Option(False, "--json", help=_render.JSON_HELP),
):
  """Train a small flax MLP, shard its AdamW state over 8 ranks, reshard to 6, prove it exact.

  Exit code 1 when a check fails. With --json: {"exact", "steps", "seconds",
  "source_world_size", "target_world_size", "checks": {name: bool}, "params": a
  list of {"param", "shape", "slots_source", "slots_target", "buffers",
  "bytes", "exact"}, "saved": the --save path or null}.
  """
  from jaxreshard._src.cli import demo as _demo

  out = _render.console()
  log = (lambda line: None) if as_json else (lambda line: out.print(f"[green]ok[/] {line}"))
  try:
    summary = _demo.run_demo(steps, archive_dir=None if save is None else str(save), log=log)
  except ModuleNotFoundError as e:
    raise jr.ReshardError(f"the demo needs {e.name}: pip install 'jaxreshard[examples]'") from None
  worlds = (_demo.SOURCE_WORLD, _demo.TARGET_WORLD)
  if as_json:
    _render.print_json(_render.demo_info(summary, worlds, save))
  else:
    _render.print_demo(out, summary, worlds, _demo.DISK_RANK)
  if not summary.exact:
    raise typer.Exit(EXIT_DIFFERENT)


# ------------------------------------------------------------------------ inspect


@app.command(cls=_render.Command)
@_render.guard
def inspect(
  checkpoint: Path = typer.Argument(..., parser=_path, metavar="CHECKPOINT", help=_WHERE),
  step: int | None = _step_option(),
  item: str | None = _item_option(),
  every: bool = typer.Option(
    False,
    "--all",
    help="List every param (a table of more than 200 lists its first 100 and last 20).",
  ),
  as_json: bool = typer.Option(False, "--json", help=_render.JSON_HELP),
):
  """Show parameters, logical shapes, world sizes, dtypes, bytes and optimizer clocks.

  Bytes are the logical state, the state with its padding, and the files on
  disk (index, archive metadata, buffer files with their checksums and chunk
  rounding, as the file system sizes them). Each clock scalar is named by the
  optax state classes on its key path (chain[0] ScaleByAdamState.count) beside
  the key path itself ([0].count), which refusals use.

  With --json: {"archives", "world_sizes", "params": a list of {"param",
  "shape", "dtype", "trainable", "world_sizes", "ranks", "buffers": the dtype
  of each history buffer, "bytes", "stored_bytes": with padding}, "bytes",
  "stored_bytes", "disk_bytes", "files": how many regular files lie under the
  checkpoint ("disk_bytes" is their bytes), "orbax": null, or {"path", "step", "steps", "item"} for an
  orbax step or run directory, "clocks": a list of {"path", "name": with the
  state classes, "dtype" (a typed PRNG key's as jax names it, "key<fry>", with
  its key data for "shape", "value" and "bits"), "shape", "value", "bits": hex,
  "truncated": true when the scalar is an array of more than 16 elements, whose
  first 16 (flat) alone are in "value" and "bits", "weak": whether it is weakly
  typed (how jax promotes it; the table's dtype says "(weak)")}, "clocks_agree",
  "source": null,
  or for the output of a reshard {"checkpoint": the identity of the checkpoint it
  was resharded from, "world_size", "layout": the target layout's sha256}}.
  """
  found = _locate(checkpoint, step, item)
  ckpt = _reader.open_checkpoint(found.path)
  for i in range(len(ckpt)):  # every archive is present and belongs to this checkpoint
    ckpt.archive_meta(i)
  info = inspect_info(ckpt)
  if as_json:
    _render.print_json(dict(info, orbax=_report.located_info(found)))
    return
  _report.print_inspect(checkpoint, found, info, every)


# ------------------------------------------------------------------------ reshard


@app.command(cls=_render.Command)
@_render.guard
def reshard(
  checkpoint: Path = typer.Argument(
    ..., parser=_path, metavar="CHECKPOINT", help=f"The source: {_WHERE}."
  ),
  out: Path = typer.Argument(
    ..., parser=_path, metavar="OUT", help="The new checkpoint directory (must not exist)."
  ),
  world_size: int = typer.Option(
    ..., "--world-size", "-w", parser=_integer, help="The target world size M."
  ),
  rank: int | None = typer.Option(
    None, "--rank", "-r", parser=_integer, help="Write only this target rank."
  ),
  dry_run: bool = typer.Option(
    False, "--dry-run", help="Print what each target rank reads; write nothing."
  ),
  reads: bool = typer.Option(
    False, "--reads", help="With --dry-run: list every read, not one line per rank."
  ),
  step: int | None = _step_option(),
  item: str | None = _item_option(),
  as_json: bool = typer.Option(False, "--json", help=_render.JSON_HELP),
):
  """Rebuild every target rank (or one) for a new world size, streaming rank by rank.

  With --json and --dry-run: {"dry_run": true, "world_size", "archives",
  "ranks": a list of {"rank", "archives_read": archive indices, "bytes_read",
  "target_bytes", "peak_bytes", with --reads also "reads": a list of {"param",
  "archive", "source_rank", "lo", "hi", "source_offset", "bytes"}},
  "bytes_read", "peak_bytes"}. Without --dry-run: {"dry_run": false, "out",
  "world_size", "ranks": the ranks written, "bytes_read", "seconds"}.
  """
  if reads and not dry_run:
    raise jr.ReshardError("--reads lists the reads of a dry run: give it with --dry-run")
  located = _locate(checkpoint, step, item)
  source = located.path
  ckpt = _reader.open_checkpoint(source)
  _merge.refuse_partial(source, ckpt)  # in the words verify uses: merge the parts first
  # Refuses a bad world size or a rank outside it before any work.
  jr.FlatShard((), 0 if rank is None else rank, world_size)
  ranks = [rank] if rank is not None else range(world_size)
  # Plans are made one rank at a time, as they are printed or used: a world
  # size of a million ranks costs a million small plans, never their list.
  plans = (_read_plan.read_plan(ckpt, world_size=world_size, rank=r) for r in ranks)
  first = next(plans)  # refuses archives that do not form complete groups, before any output
  plans = itertools.chain([first], plans)
  if dry_run:
    archives = None
    if rank is not None:  # what its run reads: its runs' archives, and those it checks
      archives = sorted(set(first.per_archive) | _restore.checked_archives(ckpt, world_size, rank))
    _dry_run(ckpt, plans, archives, world_size, reads, as_json)
    return
  if os.path.lexists(out):
    raise jr.ArchiveExistsError(
      f"{safe(out)} already exists; jaxreshard never overwrites a checkpoint"
    )
  _refuse_inside(out, [checkpoint], [located])
  total = first.bytes_read if rank is not None else _read_plan.total_bytes(ckpt)
  with _interrupts.writing(out):  # an interrupt once OUT is in place says it is complete
    err = _render.err_console()
    t0 = time.perf_counter()
    with progress_bar(err) as bar:
      task = bar.add_task("resharding", total=total or 1)

      # The output names its source (the checkpoint whose state it holds: CK's own,
      # or the one CK was resharded from), so that parts of two saves never merge.
      jr.save_records(
        str(out),
        _reader.SourcedRecords(
          _streams.targets(source, ckpt, ranks, world_size, total, bar, task),
          _reader.Source(_reader.state_id(ckpt), world_size),
        ),
      )
    _written(out, ranks, world_size, total, time.perf_counter() - t0, as_json)


def _written(out: Path, ranks: Any, world_size: int, total: int, seconds: float, as_json: bool):
  """The report of a reshard that wrote ``out``."""
  if as_json:
    _render.print_json(
      dict(
        dry_run=False,
        out=os.path.abspath(out),
        world_size=world_size,
        ranks=list(ranks),
        bytes_read=total,
        seconds=round(seconds, 3),
      )
    )
    return
  _render.console().print(
    _render.cell(
      f"wrote {len(ranks)} of {world_size} target ranks to {out}"
      f" ({_render.size(total)} moved, {seconds:.1f} s)"
    )
  )


def _dry_run(ckpt, plans, archives, world_size: int, reads: bool, as_json: bool) -> None:
  """Prints the plans of a dry run, once what its run would read is checked.

  That is present, belongs to this checkpoint, holds histories of the params it
  lists only, and is as large as its metadata says, as the run itself checks
  before reading (a chunk's checksum is checked only when read): a dry run
  never shows a plan its run refuses that way.
  ``archives``: those one rank reads; None: every archive (some rank of a whole
  run reads each).
  """
  for i in archives if archives is not None else range(len(ckpt)):
    ckpt.archive_meta(i)
    ckpt.check_archive(i)  # its layout against its placements, as the run refuses it
    ckpt.check_files(i)
  if as_json:
    _render.json_plans(plans, world_size, len(ckpt), reads)
  else:
    n_ranks = 1 if archives is not None else world_size
    _render.print_plans(plans, len(ckpt), n_ranks, reads)


def _refuse_inside(out: Path, inputs: list[Path], located: list[Any]) -> None:
  """Refuses an output path at or below a checkpoint the command reads, or below
  the orbax step or run directory around one it reads (``locate.enclosing``).

  Paths are compared after resolving links, so another spelling of the same
  directory is caught too.
  """
  target = os.path.realpath(out)
  for path, found in zip(inputs, located, strict=True):
    roots = [(path, "a checkpoint this command reads"), *_locate_mod.enclosing(found)]
    for root, what in roots:
      where = os.path.realpath(root)
      if os.path.commonpath([target, where]) == where:
        raise jr.ArchiveError(
          f"{safe(out)} is inside {safe(root)}, {what}; write the new checkpoint outside it"
        )


# ------------------------------------------------------------------------- verify


@app.command(cls=_render.Command)
@_render.guard
def verify(
  checkpoint: Path = typer.Argument(
    ..., parser=_path, metavar="CHECKPOINT", help=f"The original: {_WHERE}."
  ),
  out: Path = typer.Argument(
    ...,
    parser=_path,
    metavar="OUT",
    help="The checkpoint that should hold the same state (any form CHECKPOINT may take).",
  ),
  step: int | None = _step_option(),
  item: str | None = _item_option(),
  max_diffs: int = typer.Option(
    20, "--max-diffs", parser=lambda t: _integer(t, 0), help="Show at most this many differences."
  ),
  rtol: float | None = typer.Option(
    None, "--rtol", help="Accept history buffers within this relative tolerance."
  ),
  atol: float | None = typer.Option(
    None, "--atol", help="Accept history buffers within this absolute tolerance."
  ),
  as_json: bool = typer.Option(False, "--json", help=_render.JSON_HELP),
):
  """Prove OUT holds exactly CHECKPOINT's optimizer state, whatever the two layouts.

  A summary comes first, then at most --max-diffs differences; values read as
  numbers (8 != 12), with their bits where the numbers would hide them
  (nan(0x7fc00001)). A buffer that differs gives how many elements differ, the
  first one, and the largest absolute and relative difference.

  --rtol/--atol accept history buffers that differ by no more than
  atol + rtol * |CHECKPOINT's value| in every element: jitted updates on other
  devices or world sizes agree only to rounding. Within it, verify exits 0 and
  still says the states are not bit-identical; clock scalars, structure,
  shapes and dtypes are always compared exactly. --step and --item choose in
  CHECKPOINT; OUT is taken at its latest step (or name its step directory).

  Exit code 0 identical (or within the tolerance given), 1 different, 2 error
  (also for a checkpoint that is not one valid state: nonzero padding, archives
  of different steps). With --json: {"identical", "within_tolerance": null
  without a tolerance, "tolerance": null or {"rtol", "atol"}, "differences": a
  list of lines, "differing_buffers": a list of {"param", "buffer", "dtype",
  "elements", "differing", "first_index", "first", "max_abs_diff",
  "max_rel_diff", "outside_tolerance"}, "digest": CHECKPOINT's, "out_digest":
  OUT's, "params", "buffers", "elements", "clock_scalars"} (counts of CHECKPOINT).
  """
  for flag, value in (("--rtol", rtol), ("--atol", atol)):
    if value is not None and not (math.isfinite(value) and value >= 0):
      raise jr.ReshardError(f"{flag} {value} must be a finite number >= 0")
  paths = (_locate(checkpoint, step, item).path, _locate(out).path)
  with progress_bar(_render.err_console()) as bar:
    task = bar.add_task("reading", total=None)
    a = _digest.digest_records(_streams.counted(paths[0], "CHECKPOINT", bar, task))
    b = _digest.digest_records(_streams.counted(paths[1], "OUT", bar, task))
  for path, d in ((checkpoint, a), (out, b)):
    _summary.refuse_problems(path, d)
  c = _compare.compare_checkpoints(
    a, b, paths, names=(str(checkpoint), str(out)), rtol=rtol, atol=atol
  )
  buffers, elements = _summary.digest_counts(a)
  counts = dict(
    params=len(a.params), buffers=buffers, elements=elements, clock_scalars=len(a.scalars)
  )
  code = 0 if (c.identical or c.within_tolerance) else EXIT_DIFFERENT
  with _render.outcome(code):
    if as_json:
      _render.print_json(_report.verify_info(c, counts))
    _report.print_verify((checkpoint, out), c, counts, max_diffs, as_json)
  if code:
    raise typer.Exit(code)


# -------------------------------------------------------------------------- clean


@app.command(cls=_render.Command)
@_render.guard
def clean(
  checkpoint: Path = typer.Argument(
    ..., parser=_path, metavar="CHECKPOINT", help="The checkpoint path saves were writing to."
  ),
  everything: bool = typer.Option(
    False,
    "--all",
    help="Also remove other hosts' temporary directories whose lock is"
    " free here (a network file system may keep a lock to the host that took it). A"
    " directory whose writer holds its lock is never removed.",
  ),
  as_json: bool = typer.Option(False, "--json", help=_render.JSON_HELP),
):
  """Remove the temporary directories that killed saves to CHECKPOINT left behind.

  A save holds a lock (flock) on its temporary directory until it commits; only
  directories whose lock is free are removed, whatever process id or host their
  name carries. An orbax temporary directory with no lock in it (a save killed
  before it locked it) is listed as kept: the next save of CHECKPOINT replaces it. A directory that can be removed only in part is an error (exit 2)
  naming what is left.

  With --json: {"checkpoint", "removed": paths, "kept": paths}.
  """
  final = os.path.abspath(str(checkpoint))
  found = _store.temp_dirs(final, strict=True, unlocked=True)
  removed = set(_store.remove_temp_dirs(final, everything=everything))
  if as_json:
    _render.print_json(
      dict(
        checkpoint=final,
        removed=[p for p, _ in found if p in removed],
        kept=[p for p, _ in found if p not in removed],
      )
    )
    return
  _render.print_clean(final, found, removed, everything)


# -------------------------------------------------------------------------- merge


@app.command(cls=_render.Command)
@_render.guard
def merge(
  out: Path = typer.Argument(
    ..., parser=_path, metavar="OUT", help="The merged checkpoint (must not exist)."
  ),
  parts: list[Path] = typer.Argument(
    ...,
    parser=_path,
    metavar="PART",
    help=f"Partial checkpoints (reshard --rank outputs), each {_WHERE}.",
  ),
  step: int | None = _step_option(),
  item: str | None = _item_option(),
  as_json: bool = typer.Option(False, "--json", help=_render.JSON_HELP),
):
  """Combine partial checkpoints of one world size (one per rank or host) into one.

  Every part is checked first: resharded from one checkpoint (the same save,
  not only the same step), one world size and target layout (every param's
  shape and dtype), disjoint ranks that together are all of them, the same
  clocks. Archives are then copied in rank order, one at a time, into a new
  checkpoint with its own identity. A PART may be an orbax step or run
  directory, as for inspect; --step and --item choose in every PART. With
  --json: {"out", "world_size", "parts", "archives"}.
  """
  located = [_locate(p, step, item) for p in parts]
  _refuse_inside(out, parts, located)
  found = [x.path for x in located]
  with _interrupts.writing(out):  # an interrupt once OUT is in place says it is complete
    with progress_bar(_render.err_console()) as bar:
      task = bar.add_task("merging", total=None)
      merged = _merge.merge_parts(
        str(out), found, progress=lambda p: bar.update(task, completed=p.done_bytes)
      )
    n = merged.world_size
    if as_json:
      _render.print_json(dict(out=os.path.abspath(out), world_size=n, parts=len(parts), archives=n))
      return
    _render.console().print(
      _render.cell(
        f"merged {len(parts)} part{'s' if len(parts) != 1 else ''} into {out}:"
        f" ranks 0..{n - 1} of {n}, resharded from checkpoint {merged.source.checkpoint}"
      )
    )


def main(argv: list[str] | None = None) -> None:
  """The ``jaxreshard`` console script; with ``argv``, the command line run inside
  another program, whose SIGTERM handler is put back when the command ends (the
  console script's process ignores SIGTERM from then on, while it exits)."""
  previous = _interrupts.on_sigterm_interrupt()
  try:
    app(args=argv, prog_name="jaxreshard")
  finally:
    if argv is not None:
      _interrupts.put_back(previous)
