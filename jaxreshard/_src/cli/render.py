"""How the ``jaxreshard`` commands show things: tables, JSON, one-line errors.

Names and paths come from checkpoints and users: every one is shown with its
non-printable characters escaped (``safe``), never read as rich markup
(``cell``). Trouble is one line on stderr and exit code 2, never a traceback
(``guard``, ``Group``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import typer
from rich import filesize
from rich.console import Console
from rich.table import Table
from rich.text import Text

import jaxreshard as jr
from jaxreshard._src.checkpoint import read_plan as _read_plan
from jaxreshard._src.checkpoint import tempdir as _tempdir
from jaxreshard._src.cli import interrupts as _interrupts
from jaxreshard._src.cli.interrupts import Committed, Terminated

EXIT_DIFFERENT = 1
EXIT_ERROR = 2


def plain_flags(params: list) -> list:
  # A flag takes no value: help shows no value type for it (an empty metavar).
  for p in params:
    if isinstance(p, typer.core.TyperOption) and p.is_flag and p.metavar is None:
      p.metavar = ""
  return params


def usage(command: Any, ctx: Any) -> list[str]:
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


class Command(typer.core.TyperCommand):
  """A subcommand whose help shows CHECKPOINT OUT and flags without a value type."""

  def get_params(self, ctx: Any) -> list:
    return plain_flags(super().get_params(ctx))

  def collect_usage_pieces(self, ctx: Any) -> list[str]:
    return usage(self, ctx)


class Group(typer.core.TyperGroup):
  """The root command, with the same help conventions as its subcommands.

  A usage error (a missing argument, an unknown option, a value of the wrong
  type), of the root or of a subcommand, is one line on stderr and exit code 2,
  like every other error.
  """

  def get_params(self, ctx: Any) -> list:
    return plain_flags(super().get_params(ctx))

  def collect_usage_pieces(self, ctx: Any) -> list[str]:
    return usage(self, ctx) + [self.subcommand_metavar]

  def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
    with one_line_usage_errors():
      return super().parse_args(ctx, args)

  def invoke(self, ctx: Any) -> Any:
    with one_line_usage_errors():  # resolving the subcommand and parsing its arguments
      return super().invoke(ctx)


@contextlib.contextmanager
def one_line_usage_errors() -> Iterator[None]:
  try:
    yield
  except typer._click.exceptions.NoArgsIsHelpError:  # pylint: disable=protected-access
    raise  # no arguments at all: the help, as asked for by no_args_is_help
  except typer._click.exceptions.UsageError as e:  # pylint: disable=protected-access
    hint = f" ({e.ctx.command_path} --help shows the usage)" if e.ctx is not None else ""
    text = " ".join(e.format_message().split())
    print(f"jaxreshard: error: {safe(text)}{hint}", file=sys.stderr)
    raise typer.Exit(EXIT_ERROR) from None


class _Console(Console):
  def on_broken_pipe(self) -> None:
    # rich exits 1 here; the command decides its exit code (``guard``, ``outcome``).
    self.quiet = True
    raise BrokenPipeError


def console() -> Console:
  # Made per call so that a test runner's captured stdout is the one used.
  console = _Console(highlight=False, soft_wrap=True)
  if not console.is_terminal:
    # Pipes and files get every value whole: tables as wide as they need.
    console.width = _PIPE_WIDTH
  return console


_PIPE_WIDTH = 10_000


def table(title: Any, columns: list[tuple[str, str]]) -> Table:
  """A table whose every value is shown whole: folded onto more lines, never cut.

  Pipes and files are as wide as the table needs (see ``console``); on a
  terminal a value too wide for its column wraps inside the cell.
  """
  table = Table(title=title)
  for name, justify in columns:
    table.add_column(name, justify=justify, overflow="fold", min_width=len(name))
  return table


def err_console() -> Console:
  return Console(stderr=True, highlight=False)


def safe(text: Any) -> str:
  """``text`` with every non-printable character (terminal escapes, newlines) escaped."""
  text = str(text)
  if text.isprintable():
    return text
  return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def cell(text: Any) -> Text:
  # Names and paths come from checkpoints and users: never rich markup.
  return Text(safe(text))


def message(e: BaseException) -> str:
  if isinstance(e, OSError) and e.filename is not None and e.strerror:
    return safe(f"{e.strerror}: {e.filename}")
  text = " ".join(str(e).split()) or type(e).__name__
  text = text if isinstance(e, (jr.ReshardError, OSError)) else f"{type(e).__name__}: {text}"
  return safe(text)


def _stdout_to_devnull() -> None:
  os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@contextlib.contextmanager
def outcome(code: int) -> Iterator[None]:
  """Printing the report of a command whose exit code is already ``code``: a reader
  that leaves early (``verify ... | head``) does not change it."""
  try:
    yield
  except BrokenPipeError:
    _stdout_to_devnull()
    raise typer.Exit(code) from None


def guard(fn: Callable) -> Callable:
  """Turns bad input into one line on stderr and exit code 2."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    _interrupts.started()
    try:
      return _reported(fn, args, kwargs)
    finally:
      _interrupts.finished()

  return wrapper


def _reported(fn: Callable, args: Any, kwargs: Any) -> Any:
  """``fn(*args, **kwargs)``, its errors and interrupts reported as ``guard`` says."""
  try:
    return fn(*args, **kwargs)
  except (typer.Exit, typer.Abort):
    raise
  except BrokenPipeError:
    # `jaxreshard inspect ... | head`: the reader left; that is not an error.
    _stdout_to_devnull()
    raise typer.Exit(0) from None
  except Committed as e:
    print(
      f"jaxreshard: {'terminated' if e.terminated else 'interrupted'} after {safe(e.out)}"
      " was written: it is complete",
      file=sys.stderr,
    )
    raise typer.Exit(128 + signal.SIGTERM if e.terminated else 130) from None
  except Terminated:
    print("jaxreshard: terminated", file=sys.stderr)
    raise typer.Exit(128 + signal.SIGTERM) from None
  except KeyboardInterrupt:
    print("jaxreshard: interrupted", file=sys.stderr)
    raise typer.Exit(130) from None
  # ReshardError is a ValueError; other ValueErrors come from bad input too.
  except (ValueError, OSError) as e:
    print(f"jaxreshard: error: {message(e)}", file=sys.stderr)
    raise typer.Exit(EXIT_ERROR) from None
  except Exception as e:  # pylint: disable=broad-except
    # A bug, not an answer: exit 2 (verify's 1 means "different"), one line.
    if os.environ.get("JAXRESHARD_TRACEBACK"):
      raise
    print(
      f"jaxreshard: error: internal error, please report it: {message(e)}"
      " (JAXRESHARD_TRACEBACK=1 shows where)",
      file=sys.stderr,
    )
    raise typer.Exit(EXIT_ERROR) from None


JSON_HELP = "Print machine-readable JSON only (on stdout; errors stay on stderr)."


def print_json(data: Any) -> None:
  print(json.dumps(data, indent=2))


def size(n: int) -> str:
  return filesize.decimal(n).replace(" bytes", " B").replace(" byte", " B")


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


def buffers_text(dtypes: list[str]) -> str:
  groups: list[list] = []
  for d in dtypes:
    if groups and groups[-1][1] == d:
      groups[-1][0] += 1
    else:
      groups.append([1, d])
  short = lambda d: d.replace("bfloat", "bf").replace("float", "f")
  return " ".join(f"{n}x{short(d)}" if n > 1 else short(d) for n, d in groups) or "none"


def print_plans(
  plans: Iterator[_read_plan.ReadPlan], n_archives: int, n_ranks: int, reads: bool
) -> None:
  """One line per target rank (every read under it with ``reads``), then the total.

  Plain aligned text, printed as each plan is made: no value is ever cut.
  """
  head = ("target rank", "archives read", "bytes moved", "target bytes", "peak memory")
  print("  ".join(f"{h:>13}" for h in head))
  total = peak = 0
  for p in plans:
    total += p.bytes_read
    peak = max(peak, p.peak_bytes)
    row = (
      p.rank,
      f"{len(p.per_archive)} of {n_archives}",
      size(p.bytes_read),
      size(p.target_bytes),
      size(p.peak_bytes),
    )
    print("  ".join(f"{v:>13}" for v in row))
    if reads:
      print_reads(p)
  print(
    f"dry run: {n_ranks} target rank{'s' if n_ranks != 1 else ''}, {size(total)} moved"
    f" in all, peak memory ~{size(peak)} (the target rank's buffers plus one bounded"
    " read buffer); nothing written"
  )


def json_plans(
  plans: Iterator[_read_plan.ReadPlan], world_size: int, n_archives: int, reads: bool
) -> None:
  """``--dry-run --json``: the same plans as one JSON object, written as each rank is planned."""
  print(
    f'{{\n  "dry_run": true,\n  "world_size": {world_size},\n  "archives": {n_archives},'
    '\n  "ranks": ['
  )
  total = peak = 0
  pending = None  # each entry waits for the next to know whether a comma follows it
  for p in plans:
    if pending is not None:
      print(f"    {pending},")
    total += p.bytes_read
    peak = max(peak, p.peak_bytes)
    entry = dict(
      rank=p.rank,
      archives_read=list(p.per_archive),
      bytes_read=p.bytes_read,
      target_bytes=p.target_bytes,
      peak_bytes=p.peak_bytes,
    )
    if reads:
      entry["reads"] = [
        dict(
          param=r.param,
          archive=r.archive,
          source_rank=r.source_rank,
          lo=r.lo,
          hi=r.hi,
          source_offset=r.source_offset,
          bytes=r.bytes,
        )
        for r in p.reads
      ]
    pending = json.dumps(entry)
  if pending is not None:
    print(f"    {pending}")
  print(f'  ],\n  "bytes_read": {total},\n  "peak_bytes": {peak}\n}}')


def print_reads(p: _read_plan.ReadPlan) -> None:
  """Each read of one target rank: whose elements, from which archive and where in it."""
  head = ("param", "archive", "source rank", "elements [lo, hi)", "source offset", "bytes")
  rows = [
    (safe(r.param), r.archive, r.source_rank, f"[{r.lo}, {r.hi})", r.source_offset, r.bytes)
    for r in p.reads
  ]
  widths = [max([len(h)] + [len(str(row[i])) for row in rows]) for i, h in enumerate(head)]
  line = lambda vals: (
    "    "
    + "  ".join(
      f"{v!s:<{w}}" if i in (0, 3) else f"{v!s:>{w}}" for i, (v, w) in enumerate(zip(vals, widths))
    )
  )
  print(line(head).rstrip())
  for row in rows:
    print(line(row).rstrip())


def demo_info(summary: Any, worlds: tuple[int, int], saved: Any) -> dict:
  """``demo --json``: the demo's checks and its table, one object."""
  return dict(
    exact=summary.exact,
    steps=summary.steps,
    seconds=round(summary.seconds, 3),
    source_world_size=worlds[0],
    target_world_size=worlds[1],
    checks=dict(
      unshard_exact=summary.unshard_exact,
      round_trip_exact=summary.round_trip_exact,
      digest_equal=summary.digest_equal,
      disk_exact=summary.disk_exact,
    ),
    params=[
      dict(
        param=r.param,
        shape=list(r.shape),
        slots_source=r.slots_source,
        slots_target=r.slots_target,
        buffers=r.buffers,
        bytes=r.bytes,
        exact=r.exact,
      )
      for r in summary.rows
    ],
    saved=None if saved is None else os.path.abspath(saved),
  )


def print_demo(out: Console, summary: Any, worlds: tuple[int, int], disk_rank: int) -> None:
  """The demo's table of parameters, one line per check, then the verdict."""
  src, dst = worlds
  t = table(
    f"AdamW state, {src} -> {dst} ranks",
    [
      (col, "left" if col in ("param", "shape") else "right")
      for col in ("param", "shape", f"slots @{src}", f"slots @{dst}", "buffers", "bytes", "exact")
    ],
  )
  for r in summary.rows:
    t.add_row(
      r.param,
      str(r.shape),
      str(r.slots_source),
      str(r.slots_target),
      str(r.buffers),
      str(r.bytes),
      "yes" if r.exact else "[red]NO[/]",
    )
  out.print(t)
  checks = [
    (summary.unshard_exact, f"unshard of the {dst} ranks is bit-identical to the trained state"),
    (
      summary.round_trip_exact,
      f"{src} -> {dst} -> {src} returns the original archives bit for bit",
    ),
    (
      summary.digest_equal,
      f"sharding-independent digests of {src} and {dst} ranks are equal, padding all zero",
    ),
    (
      summary.disk_exact,
      f"rank {disk_rank} of {dst} restored from"
      f" disk is {'identical' if summary.disk_exact else 'DIFFERENT'}",
    ),
  ]
  for ok, line in checks:
    out.print(f"{'[green]ok[/]' if ok else '[red]FAILED[/]'} {line}")
  if summary.exact:
    out.print(
      f"[bold green]EXACT[/]: {src} -> {dst} ranks, every bit preserved ({summary.seconds:.1f} s)"
    )
  else:
    out.print(f"[bold red]NOT EXACT[/] ({summary.seconds:.1f} s)")


def _is_orbax_temp(path: str) -> bool:
  return _tempdir.ORBAX_TEMP_SUFFIX in os.path.basename(path)


def print_clean(final: str, found: list, removed: set, everything: bool) -> None:
  """``clean``: each temporary directory, removed or kept and why, then the count."""
  for path, gone in found:
    if path in removed:
      verb = "removed"
    elif gone is None:
      verb = (
        "kept (orbax's, with no lock in it: nothing tells whether its save still runs;"
        " the next save of this checkpoint replaces it)"
      )
    elif gone and not everything:
      whose = "orbax's, of a host it does not name" if _is_orbax_temp(path) else "another host's"
      verb = f"kept ({whose}; its lock is free here, --all removes it)"
    elif not os.access(path, os.W_OK | os.X_OK):
      verb = "kept (this user cannot lock or remove it)"
    else:
      verb = "kept (its writer holds its lock)"
    print(f"{verb}: {safe(path)}")
  print(
    f"{len(removed)} of {len(found)} temporary director{'y' if len(found) == 1 else 'ies'}"
    f" of {safe(final)} removed"
  )
