"""Param ids: a pytree key path as one string, its keys percent-escaped.

``{'dense': {'kernel': x}}`` has the id ``dense/kernel``; a key holding ``/`` or
``%`` is escaped, so two different key paths never share an id.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax

from jaxreshard._src.errors import PlacementError, ReshardError

__all__ = ["MAX_ID_CHARS", "check_length", "escape", "key_name", "path_id", "split_id", "unescape"]

# A checkpoint holds ids of at most this many characters (no model's key paths run
# to this length); every call in memory refuses a longer one as a save does.
MAX_ID_CHARS = 4096


def check_length(pid: Any, where: str) -> None:
  """Refuses an id longer than a checkpoint holds; ``where`` names what lists it."""
  if isinstance(pid, str) and len(pid) > MAX_ID_CHARS:
    raise PlacementError(
      f"param {pid[:80]!r}... ({len(pid)} characters), in {where}: an id longer than the"
      f" {MAX_ID_CHARS} characters a checkpoint holds"
    )


_tu = jax.tree_util
_DictKey, _GetAttrKey, _SequenceKey = _tu.DictKey, _tu.GetAttrKey, _tu.SequenceKey


def escape(name: str) -> str:
  """A key as one segment of an id: ``%`` and ``/`` percent-encoded."""
  if "%" in name or "/" in name:
    return name.replace("%", "%25").replace("/", "%2F")
  return name


_ESCAPED = re.compile("%(25|2F)")


def unescape(segment: str) -> str:
  """The key a segment of an id stands for (the inverse of the escaping)."""
  if "%" not in segment:
    return segment
  return _ESCAPED.sub(lambda m: "%" if m.group(1) == "25" else "/", segment)


def split_id(pid: str) -> list[str]:
  """The keys of a param id, in order."""
  return [unescape(k) for k in pid.split("/")]


def _text(key: Any) -> str:
  """``str(key)``; a key Python will not print (an int of more digits than
  ``sys.get_int_max_str_digits()``, alone or inside a tuple) is refused by name."""
  try:
    return str(key)
  except ValueError as e:
    raise ReshardError(f"dict key of type {type(key).__name__} cannot be named: {e}") from None


def key_name(key: Any) -> str:
  """One key of a key path as a segment of an id (dict keys, attributes, indices)."""
  t = type(key)
  if t is _DictKey:
    return escape(_text(key.key))
  if t is _GetAttrKey:
    return escape(key.name)
  if t is _SequenceKey:
    return str(key.idx)
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return escape(_text(getattr(key, attr)))
  return escape(_text(key))


def path_id(path: Sequence[Any]) -> str:
  """A pytree key path joined with ``/``: ``{'dense': {'kernel': x}}`` -> ``dense/kernel``.

  Keys that contain ``/`` or ``%`` are percent-encoded (haiku's ``mlp/~/linear_0``
  becomes ``mlp%2F~%2Flinear_0``), so two different key paths never share an id.
  """
  return "/".join(key_name(k) for k in path)
