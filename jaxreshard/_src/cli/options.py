"""How the command line reads its arguments: paths, integers, and the options that
name a step or item of an orbax directory."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

__all__ = ["integer", "item_option", "path", "step_option"]


def path(text: str) -> Path:
  """A path argument; an empty one names nothing (``Path("")`` would be ``.``)."""
  if not text:
    raise typer.BadParameter("an empty path names no checkpoint")
  return Path(text)


def integer(text: str, least: int | None = None) -> int:
  """An integer argument in decimal digits, with an optional leading minus, and
  at least ``least``: ``3.0``, ``+3``, `` 3``, ``3_0`` and ``0x3`` are refused, never
  read as 3 or 30. An option's default arrives as the int it is."""
  if type(text) is int:
    value = text
  elif isinstance(text, str) and re.fullmatch(r"-?[0-9]+", text):
    value = int(text)
  else:
    raise typer.BadParameter(f"{text!r} is not an integer in decimal digits")
  if least is not None and value < least:
    raise typer.BadParameter(f"{value} is less than {least}")
  return value


def step_option() -> Any:
  return typer.Option(
    None,
    "--step",
    parser=integer,
    help="In an orbax run directory, the step to read (default: the latest"
    " holding a jaxreshard item).",
  )


def item_option() -> Any:
  return typer.Option(
    None, "--item", help="In an orbax step, the item to read (needed when several hold one)."
  )
