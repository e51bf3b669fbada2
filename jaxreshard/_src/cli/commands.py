"""The ``jaxreshard`` command line: demo, inspect, reshard, verify, clean.

Exit codes follow ``cmp``/``diff``: 0 success (for ``verify``: identical),
1 a negative answer (``verify``: the checkpoints differ; ``demo``: a check
failed), 2 trouble (a refused, missing or unreadable checkpoint). Trouble is
one line on stderr, never a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import typer
from rich import filesize
from rich.console import Console
from rich.table import Table
from rich.text import Text

import jaxreshard as jr
from jaxreshard._src.checkpoint import store as _archive_io
from jaxreshard._src.checkpoint import reader as _checkpoint
from jaxreshard._src.checkpoint import digest as _digest
from jaxreshard._src.checkpoint import merge as _merge
from jaxreshard._src.checkpoint import read_plan as _read_plan
from jaxreshard._src.checkpoint import restore as _restore

__all__ = ["app", "main"]

EXIT_DIFFERENT = 1
EXIT_ERROR = 2



def _plain_flags(params: list) -> list:
  # A flag takes no value: help shows no value type for it (an empty metavar).
  for p in params:
    if isinstance(p, typer.core.TyperOption) and p.is_flag and p.metavar is None:
      p.metavar = ""
  return params


def _usage(command: Any, ctx: Any) -> list[str]:
  # Arguments appear in the usage line by their metavar, CHECKPOINT OUT, and
  # in brackets when optional.
  pieces = [command.options_metavar] if command.options_metavar else []
  for p in command.get_params(ctx):
    if isinstance(p, typer.core.TyperArgument):
      name = p.metavar or p.name.upper()
      name += "..." if p.nargs != 1 else ""
      pieces.append(name if p.required else f"[{name}]")
    else:
      pieces.extend(p.get_usage_pieces(ctx))
  return pieces


class _Command(typer.core.TyperCommand):
  """A subcommand whose help shows CHECKPOINT OUT and flags without a value type."""

  def get_params(self, ctx: Any) -> list:
    return _plain_flags(super().get_params(ctx))

  def collect_usage_pieces(self, ctx: Any) -> list[str]:
    return _usage(self, ctx)


class _Group(typer.core.TyperGroup):
  """The root command, with the same help conventions as its subcommands.

  A usage error (a missing argument, an unknown option, a value of the wrong
  type), of the root or of a subcommand, is one line on stderr and exit code 2,
  like every other error.
  """

  def get_params(self, ctx: Any) -> list:
    return _plain_flags(super().get_params(ctx))

  def collect_usage_pieces(self, ctx: Any) -> list[str]:
    return _usage(self, ctx) + [self.subcommand_metavar]

  def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
    with _one_line_usage_errors():
      return super().parse_args(ctx, args)

  def invoke(self, ctx: Any) -> Any:
    with _one_line_usage_errors():  # resolving the subcommand and parsing its arguments
      return super().invoke(ctx)


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
  try:
    yield
  except typer._click.exceptions.NoArgsIsHelpError:  # pylint: disable=protected-access
    raise  # no arguments at all: the help, as asked for by no_args_is_help
  except typer._click.exceptions.UsageError as e:  # pylint: disable=protected-access
    hint = f" ({e.ctx.command_path} --help shows the usage)" if e.ctx is not None else ""
    text = " ".join(e.format_message().split())
    print(f"jaxreshard: error: {safe(text)}{hint}", file=sys.stderr)
    raise typer.Exit(EXIT_ERROR) from None


app = typer.Typer(
    name="jaxreshard",
    cls=_Group,
    help="Exact resharding of optax flat-shard (ZeRO / FSDP) optimizer state.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _out() -> Console:
  # Made per call so that a test runner's captured stdout is the one used.
  console = Console(highlight=False, soft_wrap=True)
  if not console.is_terminal:
    # Pipes and files get every value whole: tables as wide as they need.
    console.width = _PIPE_WIDTH
  return console


_PIPE_WIDTH = 10_000


def _table(title: Any, columns: list[tuple[str, str]]) -> Table:
  """A table whose every value is shown whole: folded onto more lines, never cut.

  Pipes and files are as wide as the table needs (see ``_out``); on a
  terminal a value too wide for its column wraps inside the cell.
  """
  table = Table(title=title)
  for name, justify in columns:
    table.add_column(name, justify=justify, overflow="fold", min_width=len(name))
  return table


def _err() -> Console:
  return Console(stderr=True, highlight=False)


def safe(text: Any) -> str:
  """``text`` with every non-printable character (terminal escapes, newlines) escaped."""
  text = str(text)
  if text.isprintable():
    return text
  return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _cell(text: Any) -> Text:
  # Names and paths come from checkpoints and users: never rich markup.
  return Text(safe(text))


def _message(e: BaseException) -> str:
  if isinstance(e, OSError) and e.filename is not None and e.strerror:
    return safe(f"{e.strerror}: {e.filename}")
  text = " ".join(str(e).split()) or type(e).__name__
  text = text if isinstance(e, (jr.ReshardError, OSError)) else f"{type(e).__name__}: {text}"
  return safe(text)


def _guard(fn: Callable) -> Callable:
  """Turns bad input into one line on stderr and exit code 2."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except (typer.Exit, typer.Abort):
      raise
    except BrokenPipeError:
      # `jaxreshard inspect ... | head`: the reader left; that is not an error.
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
      raise typer.Exit(0) from None
    except KeyboardInterrupt:
      print("jaxreshard: interrupted", file=sys.stderr)
      raise typer.Exit(130) from None
    # ReshardError is a ValueError; other ValueErrors come from bad input too.
    except (ValueError, OSError) as e:
      print(f"jaxreshard: error: {_message(e)}", file=sys.stderr)
      raise typer.Exit(EXIT_ERROR) from None
    except Exception as e:  # pylint: disable=broad-except
      # A bug, not an answer: exit 2 (verify's 1 means "different"), one line.
      if os.environ.get("JAXRESHARD_TRACEBACK"):
        raise
      print(f"jaxreshard: error: internal error, please report it: {_message(e)}"
            " (JAXRESHARD_TRACEBACK=1 shows where)", file=sys.stderr)
      raise typer.Exit(EXIT_ERROR) from None

  return wrapper


def _stream(path: Path) -> Iterator[Any]:
  """The checkpoint's records, read one archive at a time (verify holds one at once)."""
  ckpt = _checkpoint.open_checkpoint(str(path))
  _merge.refuse_partial(path, ckpt)
  try:
    ckpt.complete_groups()
  except jr.PlacementError as e:
    raise jr.PlacementError(f"{path} is not a complete checkpoint, which verify needs: {e}"
                            ) from None
  for i in range(len(ckpt)):
    ckpt.check_archive(i)
  for i in range(len(ckpt)):
    yield ckpt.record(i)


def _path(text: str) -> Path:
  """A path argument; an empty one names nothing (``Path("")`` would be ``.``)."""
  if not text:
    raise typer.BadParameter("an empty path names no checkpoint")
  return Path(text)


_JSON_HELP = "Print machine-readable JSON only (on stdout; errors stay on stderr)."


def _json(data: Any) -> None:
  print(json.dumps(data, indent=2))


def _size(n: int) -> str:
  return filesize.decimal(n).replace(" bytes", " B").replace(" byte", " B")


def _version(value: bool) -> None:
  if value:
    print(f"jaxreshard {jr.__version__}")
    raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
  """Exact resharding of optax flat-shard (ZeRO / FSDP) optimizer state."""
  del version


def progress_bar(console: Any) -> Any:
  """A rich progress bar counting bytes, with speed and ETA, on terminals only."""
  from rich import progress  # only the CLI draws bars

  return progress.Progress(
      progress.TextColumn("[bold]{task.description}"),
      progress.BarColumn(),
      progress.DownloadColumn(),
      progress.TransferSpeedColumn(),
      progress.TimeRemainingColumn(),
      console=console,
      # Pipes and logs get the one summary line, not a frozen bar.
      disable=not console.is_terminal,
  )


# --------------------------------------------------------------------------- demo


@app.command(cls=_Command)
@_guard
def demo(
    steps: int = typer.Option(3, min=1, help="AdamW steps to train before sharding."),
    save: Optional[Path] = typer.Option(
        None, "--save", parser=_path,
        help="Keep the 8-rank checkpoint here, to try the other commands on."),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
):
  """Train a small flax MLP, shard its AdamW state over 8 ranks, reshard to 6, prove it exact.

  Exit code 1 when a check fails. With --json: {"exact", "steps", "seconds",
  "source_world_size", "target_world_size", "checks": {name: bool}, "params": a
  list of {"param", "shape", "slots_source", "slots_target", "buffers",
  "bytes", "exact"}, "saved": the --save path or null}.
  """
  from jaxreshard._src.cli import demo as _demo

  out = _out()
  log = (lambda line: None) if as_json else (lambda line: out.print(f"[green]ok[/] {line}"))
  try:
    summary = _demo.run_demo(steps, archive_dir=None if save is None else str(save), log=log)
  except ModuleNotFoundError as e:
    raise jr.ReshardError(
        f"the demo needs {e.name}: pip install 'jaxreshard[examples]'") from None
  if as_json:
    _json(dict(
        exact=summary.exact, steps=summary.steps, seconds=round(summary.seconds, 3),
        source_world_size=_demo.SOURCE_WORLD, target_world_size=_demo.TARGET_WORLD,
        checks=dict(unshard_exact=summary.unshard_exact,
                    round_trip_exact=summary.round_trip_exact,
                    digest_equal=summary.digest_equal, disk_exact=summary.disk_exact),
        params=[dict(param=r.param, shape=list(r.shape), slots_source=r.slots_source,
                     slots_target=r.slots_target, buffers=r.buffers, bytes=r.bytes,
                     exact=r.exact) for r in summary.rows],
        saved=None if save is None else os.path.abspath(save)))
    if not summary.exact:
      raise typer.Exit(EXIT_DIFFERENT)
    return
  table = _table(f"AdamW state, {_demo.SOURCE_WORLD} -> {_demo.TARGET_WORLD} ranks",
                 [(col, "left" if col in ("param", "shape") else "right")
                  for col in ("param", "shape", f"slots @{_demo.SOURCE_WORLD}",
                              f"slots @{_demo.TARGET_WORLD}", "buffers", "bytes", "exact")])
  for r in summary.rows:
    table.add_row(r.param, str(r.shape), str(r.slots_source), str(r.slots_target),
                  str(r.buffers), str(r.bytes), "yes" if r.exact else "[red]NO[/]")
  out.print(table)
  checks = [
      (summary.unshard_exact,
       f"unshard of the {_demo.TARGET_WORLD} ranks is bit-identical to the trained state"),
      (summary.round_trip_exact,
       f"{_demo.SOURCE_WORLD} -> {_demo.TARGET_WORLD} -> {_demo.SOURCE_WORLD} returns the"
       " original archives bit for bit"),
      (summary.digest_equal, f"sharding-independent digests of {_demo.SOURCE_WORLD} and"
       f" {_demo.TARGET_WORLD} ranks are equal, padding all zero"),
      (summary.disk_exact, f"rank {_demo.DISK_RANK} of {_demo.TARGET_WORLD} restored from"
       f" disk is {'identical' if summary.disk_exact else 'DIFFERENT'}"),
  ]
  for ok, line in checks:
    out.print(f"{'[green]ok[/]' if ok else '[red]FAILED[/]'} {line}")
  if summary.exact:
    out.print(f"[bold green]EXACT[/]: {_demo.SOURCE_WORLD} -> {_demo.TARGET_WORLD} ranks,"
              f" every bit preserved ({summary.seconds:.1f} s)")
  else:
    out.print(f"[bold red]NOT EXACT[/] ({summary.seconds:.1f} s)")
  if not summary.exact:
    raise typer.Exit(EXIT_DIFFERENT)


# ------------------------------------------------------------------------ inspect


def inspect_info(ckpt: _checkpoint.Checkpoint) -> dict:
  """The machine-readable description ``inspect --json`` prints (index only)."""
  params: dict[str, dict] = {}
  for g in ckpt.groups:
    if not g.ranks:
      continue
    archive0 = g.ranks[0][0]
    for p in g.params:
      e = ckpt.params[p]
      dtypes = [h.dtype for h in ckpt.history(archive0, e.param)
                if isinstance(h, _checkpoint.LeafInfo)]
      itemsize = sum(d.itemsize for d in dtypes)
      entry = params.setdefault(e.param, dict(
          param=e.param, shape=list(e.shape), dtype=np.dtype(e.dtype).name,
          trainable=bool(e.trainable), world_sizes=[], ranks=[],
          buffers=[d.name for d in dtypes],
          bytes=int(np.prod(e.shape, dtype=np.int64)) * itemsize, stored_bytes=0))
      if g.world_size not in entry["world_sizes"]:
        entry["world_sizes"].append(g.world_size)
      entry["ranks"].extend(r for _, r in g.ranks)
      entry["stored_bytes"] += (jr.FlatShard(e.shape, 0, g.world_size).slots * itemsize
                                * len(g.ranks))
  for e in params.values():
    e["ranks"].sort()
  return dict(
      archives=len(ckpt),
      world_sizes=sorted({w for e in params.values() for w in e["world_sizes"]}),
      params=[params[k] for k in sorted(params)],
      bytes=sum(e["bytes"] for e in params.values()),
      stored_bytes=sum(e["stored_bytes"] for e in params.values()),
      clocks=_clock(ckpt.metadata_record(0)),
      clocks_agree=len({ckpt.clock_class(i) for i in range(len(ckpt))}) == 1,
      source=None if ckpt.source is None else ckpt.source.to_json(),
  )


def _clock(record: Any) -> list[dict]:
  """Each clock scalar of an archive; an array of many elements by its first ones."""
  out = []
  for path, a in _digest.clock_scalars(record):
    value, cut = _digest.clock_value(a)
    shown = a.reshape(-1)[:_digest.CLOCK_ELEMENTS_SHOWN] if cut else a
    out.append(dict(path=path, dtype=a.dtype.name, shape=list(a.shape), value=value,
                    bits=_digest.raw_bits(shown).tobytes().hex(), truncated=cut))
  return out


def _buffers_text(dtypes: list[str]) -> str:
  groups: list[list] = []
  for d in dtypes:
    if groups and groups[-1][1] == d:
      groups[-1][0] += 1
    else:
      groups.append([1, d])
  short = lambda d: d.replace("bfloat", "bf").replace("float", "f")
  return " ".join(f"{n}x{short(d)}" if n > 1 else short(d) for n, d in groups) or "none"


@app.command(cls=_Command)
@_guard
def inspect(
    checkpoint: Path = typer.Argument(..., parser=_path, metavar="CHECKPOINT",
                                      help="A checkpoint directory written by save_records."),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
):
  """Show parameters, logical shapes, world sizes, dtypes, bytes and optimizer clocks.

  With --json: {"archives", "world_sizes", "params": a list of {"param",
  "shape", "dtype", "trainable", "world_sizes", "ranks", "buffers": the dtype
  of each history buffer, "bytes", "stored_bytes"}, "bytes", "stored_bytes",
  "clocks": a list of {"path", "dtype", "shape", "value", "bits": hex,
  "truncated": true when the scalar is an array of more than 16 elements, whose
  first 16 (flat) alone are in "value" and "bits"}, "clocks_agree", "source": null,
  or for the output of a reshard {"checkpoint": the identity of the checkpoint it
  was resharded from, "world_size", "layout": the target layout's sha256}}.
  """
  ckpt = _checkpoint.open_checkpoint(str(checkpoint))
  for i in range(len(ckpt)):  # every archive is present and belongs to this checkpoint
    ckpt.archive_meta(i)
  info = inspect_info(ckpt)
  if as_json:
    _json(info)
    return
  out = _out()
  table = _table(_cell(f"{checkpoint}: {info['archives']} archives, world size"
                       f" {', '.join(map(str, info['world_sizes']))}"),
                 [(col, "right" if col in ("world", "bytes", "stored") else "left")
                  for col in ("param", "shape", "world", "dtype", "train", "buffers", "bytes",
                              "stored")])
  for e in info["params"]:
    ranks = e["ranks"]
    world = ", ".join(map(str, e["world_sizes"]))
    if len(ranks) != e["world_sizes"][0] or ranks != list(range(len(ranks))):
      world += f" (ranks {ranks})"
    table.add_row(_cell(e["param"]), str(tuple(e["shape"])), world, e["dtype"],
                  "yes" if e["trainable"] else "no", _buffers_text(e["buffers"]),
                  _size(e["bytes"]), _size(e["stored_bytes"]))
  out.print(table)
  if any(not e["buffers"] for e in info["params"]):
    out.print("buffers none: no optimizer state (frozen, or a stateless optimizer)")
  clocks = _table("optimizer clock" + ("" if info["clocks_agree"] else
                                       " ([red]archives disagree[/])"),
                  [("scalar", "left"), ("dtype", "left"), ("value", "left")])
  for c in info["clocks"]:
    value = c["value"]
    if c["truncated"]:
      n = int(np.prod(c["shape"], dtype=np.int64))
      value = f"{str(value)[:-1]}, ...] ({n} elements of shape {tuple(c['shape'])})"
    clocks.add_row(_cell(c["path"]), c["dtype"], _cell(value))
  out.print(clocks)
  if info["source"] is not None:
    out.print(f"resharded from checkpoint {info['source']['checkpoint']} to world size"
              f" {info['source']['world_size']}")
  out.print(f"{len(info['params'])} params, {_size(info['bytes'])} of optimizer state"
            f" ({_size(info['stored_bytes'])} stored with padding)")


# ------------------------------------------------------------------------ reshard


@app.command(cls=_Command)
@_guard
def reshard(
    checkpoint: Path = typer.Argument(..., parser=_path, metavar="CHECKPOINT",
                                      help="The source checkpoint directory."),
    out: Path = typer.Argument(..., parser=_path, metavar="OUT",
                               help="The new checkpoint directory (must not exist)."),
    world_size: int = typer.Option(..., "--world-size", "-w", help="The target world size M."),
    rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Write only this target rank."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Print what each target rank reads; write nothing."),
    reads: bool = typer.Option(False, "--reads",
                               help="With --dry-run: list every read, not one line per rank."),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
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
  ckpt = _checkpoint.open_checkpoint(str(checkpoint))
  # Refuses a bad world size or a rank outside it before any work.
  jr.FlatShard((), 0 if rank is None else rank, world_size)
  ranks = [rank] if rank is not None else range(world_size)
  # Plans are made one rank at a time, as they are printed or used: a world
  # size of a million ranks costs a million small plans, never their list.
  plans = (_read_plan.read_plan(ckpt, world_size=world_size, rank=r) for r in ranks)
  first = next(plans)  # refuses archives that do not form complete groups, before any output
  plans = itertools.chain([first], plans)
  if dry_run:
    if as_json:
      _json_plans(plans, world_size, len(ckpt), reads)
    else:
      _print_plans(plans, len(ckpt), len(ranks), reads)
    return
  if os.path.lexists(out):
    raise jr.ArchiveExistsError(
        f"{safe(out)} already exists; jaxreshard never overwrites a checkpoint")
  _refuse_inside(out, [checkpoint])
  total = first.bytes_read if rank is not None else _read_plan.total_bytes(ckpt)
  restore = lambda r: _restore.restore_ranks(str(checkpoint), [r], world_size=world_size,
                                             checkpoint=ckpt)[0]
  err = _err()
  t0 = time.perf_counter()
  with progress_bar(err) as bar:
    task = bar.add_task("resharding", total=total or 1)

    def targets() -> Iterator[Any]:
      for p in plans:
        bar.update(task, description=f"rank {p.rank}/{world_size}")
        yield restore(p.rank)
        bar.advance(task, p.bytes_read)  # after save_records has taken this rank

    # The output names its source, so that parts of two saves never merge.
    jr.save_records(str(out), _checkpoint.SourcedRecords(
        targets(), _checkpoint.Source(ckpt.id, world_size)))
  if as_json:
    _json(dict(dry_run=False, out=os.path.abspath(out), world_size=world_size, ranks=list(ranks),
               bytes_read=total, seconds=round(time.perf_counter() - t0, 3)))
    return
  _out().print(_cell(f"wrote {len(ranks)} of {world_size} target ranks to {out}"
                     f" ({_size(total)} moved, {time.perf_counter() - t0:.1f} s)"))


def _refuse_inside(out: Path, inputs: list[Path]) -> None:
  """Refuses an output path at or below a checkpoint the command reads.

  Paths are compared after resolving links, so another spelling of the same
  directory is caught too.
  """
  target = os.path.realpath(out)
  for path in inputs:
    where = os.path.realpath(path)
    if os.path.commonpath([target, where]) == where:
      raise jr.ArchiveError(f"{safe(out)} is inside {safe(path)}, a checkpoint this command"
                            " reads; write the new checkpoint outside it")


def _print_plans(plans: Iterator[_read_plan.ReadPlan], n_archives: int, n_ranks: int,
                 reads: bool) -> None:
  """One line per target rank (every read under it with ``reads``), then the total.

  Plain aligned text, printed as each plan is made: no value is ever cut.
  """
  head = ("target rank", "archives read", "bytes moved", "target bytes", "peak memory")
  print("  ".join(f"{h:>13}" for h in head))
  total = peak = 0
  for p in plans:
    total += p.bytes_read
    peak = max(peak, p.peak_bytes)
    row = (p.rank, f"{len(p.per_archive)} of {n_archives}", _size(p.bytes_read),
           _size(p.target_bytes), _size(p.peak_bytes))
    print("  ".join(f"{v:>13}" for v in row))
    if reads:
      _print_reads(p)
  print(f"dry run: {n_ranks} target rank{'s' if n_ranks != 1 else ''}, {_size(total)} moved"
        f" in all, peak memory ~{_size(peak)} (the target rank's buffers plus one bounded"
        " read buffer); nothing written")


def _json_plans(plans: Iterator[_read_plan.ReadPlan], world_size: int, n_archives: int,
                reads: bool) -> None:
  """``--dry-run --json``: the same plans as one JSON object, written as each rank is planned."""
  print(f'{{\n  "dry_run": true,\n  "world_size": {world_size},\n  "archives": {n_archives},'
        '\n  "ranks": [')
  total = peak = 0
  pending = None  # each entry waits for the next to know whether a comma follows it
  for p in plans:
    if pending is not None:
      print(f"    {pending},")
    total += p.bytes_read
    peak = max(peak, p.peak_bytes)
    entry = dict(rank=p.rank, archives_read=list(p.per_archive), bytes_read=p.bytes_read,
                 target_bytes=p.target_bytes, peak_bytes=p.peak_bytes)
    if reads:
      entry["reads"] = [dict(param=r.param, archive=r.archive, source_rank=r.source_rank,
                             lo=r.lo, hi=r.hi, source_offset=r.source_offset, bytes=r.bytes)
                        for r in p.reads]
    pending = json.dumps(entry)
  if pending is not None:
    print(f"    {pending}")
  print(f'  ],\n  "bytes_read": {total},\n  "peak_bytes": {peak}\n}}')


def _print_reads(p: _read_plan.ReadPlan) -> None:
  """Each read of one target rank: whose elements, from which archive and where in it."""
  head = ("param", "archive", "source rank", "elements [lo, hi)", "source offset", "bytes")
  rows = [(safe(r.param), r.archive, r.source_rank, f"[{r.lo}, {r.hi})", r.source_offset,
           r.bytes)
          for r in p.reads]
  widths = [max([len(h)] + [len(str(row[i])) for row in rows]) for i, h in enumerate(head)]
  line = lambda vals: "    " + "  ".join(
      f"{v!s:<{w}}" if i in (0, 3) else f"{v!s:>{w}}" for i, (v, w) in enumerate(zip(vals, widths)))
  print(line(head).rstrip())
  for row in rows:
    print(line(row).rstrip())


# ------------------------------------------------------------------------- verify


@app.command(cls=_Command)
@_guard
def verify(
    checkpoint: Path = typer.Argument(..., parser=_path, metavar="CHECKPOINT",
                                      help="The original checkpoint."),
    out: Path = typer.Argument(..., parser=_path, metavar="OUT",
                               help="The checkpoint that should hold the same state."),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
):
  """Prove OUT holds exactly CHECKPOINT's optimizer state, whatever the two layouts.

  Exit code 0 identical, 1 different, 2 error (also for a checkpoint that is
  not one valid state: nonzero padding, archives of different steps). With --json: {"identical",
  "differences": a list of lines, "digest": CHECKPOINT's, "out_digest": OUT's,
  "params", "buffers", "elements", "clock_scalars"} (counts of CHECKPOINT).
  """
  a = _digest.digest_records(_stream(checkpoint))
  b = _digest.digest_records(_stream(out))
  for path, d in ((checkpoint, a), (out, b)):
    # A checkpoint with nonzero padding or archives that disagree is not one
    # state: an error, never an answer (even compared with itself).
    if d.problems:
      more = len(d.problems) - 1
      raise jr.ArchiveError(f"{path} is not a valid checkpoint: {d.problems[0]}"
                            + (f" (and {more} more problem{'s' if more > 1 else ''})"
                               if more else ""))
  diffs = _digest.compare_digests(a, b, names=(str(checkpoint), str(out)))
  console = _out()
  buffers = sum(len(p.buffers) for p in a.params.values())
  elements = sum(x.count for p in a.params.values() for x in p.buffers)
  if as_json:
    _json(dict(identical=not diffs, differences=diffs, digest=a.hexdigest(),
               out_digest=b.hexdigest(), params=len(a.params), buffers=buffers,
               elements=elements, clock_scalars=len(a.scalars)))
  if diffs:
    for line in diffs if not as_json else ():
      console.print(_cell(f"differs: {line}"))
    print(f"jaxreshard: {safe(out)} does not hold {safe(checkpoint)}'s optimizer state"
          f" ({len(diffs)} difference{'s' if len(diffs) != 1 else ''})", file=sys.stderr)
    raise typer.Exit(EXIT_DIFFERENT)
  if as_json:
    return
  console.print(
      f"identical: {len(a.params)} params, {buffers} buffers ({elements} elements),"
      f" {len(a.scalars)} clock scalar{'s' if len(a.scalars) != 1 else ''}, padding all zero;"
      f" digest {a.hexdigest()[:16]}")


# -------------------------------------------------------------------------- clean


@app.command(cls=_Command)
@_guard
def clean(
    checkpoint: Path = typer.Argument(..., parser=_path, metavar="CHECKPOINT",
                                      help="The checkpoint path saves were writing to."),
    everything: bool = typer.Option(
        False, "--all", help="Also remove other hosts' temporary directories whose lock is"
        " free here (a network file system may keep a lock to the host that took it). A"
        " directory whose writer holds its lock is never removed."),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
):
  """Remove the temporary directories that killed saves to CHECKPOINT left behind.

  A save holds a lock (flock) on its temporary directory until it commits; only
  directories whose lock is free are removed, whatever process id or host their
  name carries. A directory that can be removed only in part is an error (exit 2)
  naming what is left.

  With --json: {"checkpoint", "removed": paths, "kept": paths}.
  """
  final = os.path.abspath(str(checkpoint))
  found = _archive_io.temp_dirs(final)
  removed = set(_archive_io.remove_temp_dirs(final, everything=everything))
  if as_json:
    _json(dict(checkpoint=final, removed=[p for p, _ in found if p in removed],
               kept=[p for p, _ in found if p not in removed]))
    return
  for path, gone in found:
    if path in removed:
      verb = "removed"
    elif gone and not everything:
      verb = "kept (another host's; its lock is free here, --all removes it)"
    else:
      verb = "kept (its writer holds its lock)"
    print(f"{verb}: {safe(path)}")
  print(f"{len(removed)} of {len(found)} temporary director{'y' if len(found) == 1 else 'ies'}"
        f" of {safe(final)} removed")


# -------------------------------------------------------------------------- merge


@app.command(cls=_Command)
@_guard
def merge(
    out: Path = typer.Argument(..., parser=_path, metavar="OUT",
                               help="The merged checkpoint (must not exist)."),
    parts: list[Path] = typer.Argument(..., parser=_path, metavar="PART",
                                       help="Partial checkpoints (reshard --rank outputs)."),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
):
  """Combine partial checkpoints of one world size (one per rank or host) into one.

  Every part is checked first: resharded from one checkpoint (the same save,
  not only the same step), one world size and target layout (every param's
  shape and dtype), disjoint ranks that together are all of them, the same
  clocks. Archives are then copied in rank order, one at a time, into a new
  checkpoint with its own identity. With --json: {"out", "world_size",
  "parts", "archives"}.
  """
  _refuse_inside(out, parts)
  plan = _merge.merge_parts(str(out), [str(p) for p in parts])
  n = plan.world_size
  if as_json:
    _json(dict(out=os.path.abspath(out), world_size=n, parts=len(parts), archives=n))
    return
  _out().print(_cell(f"merged {len(parts)} part{'s' if len(parts) != 1 else ''} into {out}:"
                     f" ranks 0..{n - 1} of {n}, resharded from checkpoint"
                     f" {plan.source.checkpoint}"))


def main(argv: Optional[list[str]] = None) -> None:
  """The ``jaxreshard`` console script."""
  app(args=argv, prog_name="jaxreshard")
