"""A state dict's keys in the JSON of its tree: ``["s", str]``, ``["i", int]`` and
``["u", [keys]]`` for a tuple of such keys (flax's ``traverse_util.flatten_dict``
form), one kind per dict, written in jax's order for dicts (sorted keys).

Which keys a state may hold is ``core.storable``'s rule, which writes their codes
(``key_code``). Reading them is bounded work: codes nest at most ``MAX_KEY_DEPTH`` deep, and int or
tuple keys chosen to share a hash (a dict of n of them takes n**2 steps to build) are
refused before any dict is built.
"""

from __future__ import annotations

from typing import Any

from jaxreshard._src.checkpoint.untrusted import short
from jaxreshard._src.core.storable import MAX_KEY_DEPTH, MAX_KEYS_PER_HASH, most_sharing_a_hash
from jaxreshard._src.errors import ArchiveError

__all__ = ["MAX_KEY_DEPTH", "MAX_KEYS_PER_HASH", "check_orderable", "decode", "value"]


def value(json_code: Any, depth: int = 0) -> str | int | tuple | None:
  """``core.storable.key_code``'s inverse; None for JSON that is not a key's code."""
  if type(json_code) is not list or len(json_code) != 2:
    return None
  tag, v = json_code
  if tag == "s" and type(v) is str:
    return v
  if tag == "i" and type(v) is int:
    return v
  if tag == "u" and type(v) is list and depth < MAX_KEY_DEPTH:
    out = tuple(value(c, depth + 1) for c in v)
    return None if None in out else out
  return None


def decode(codes: list, where: str) -> list:
  """The keys of one dict node, all of one kind, none of them chosen to collide.

  Raises:
    ArchiveError: a code of no key, keys of two kinds, or int or tuple keys of which
      more than ``MAX_KEYS_PER_HASH`` share a hash.
  """
  keys: list = []
  for k in codes:
    if (
      type(k) is list
      and len(k) == 2
      and ((k[0] == "s" and type(k[1]) is str) or (k[0] == "i" and type(k[1]) is int))
    ):
      key = k[1]  # the common keys, read without a call
    else:
      key = value(k)
      if key is None:
        raise ArchiveError(f"{where}: invalid dict key {short(k)}")
    if keys and type(key) is not type(keys[0]):
      kinds = " and ".join(sorted({type(key).__name__, type(keys[0]).__name__})[::-1])
      raise ArchiveError(f"{where}: a dict node mixes {kinds} keys")
    keys.append(key)
  most = most_sharing_a_hash(keys)
  if most > MAX_KEYS_PER_HASH:
    raise ArchiveError(
      f"{where}: {most} keys of a dict node share one hash (at most"
      f" {MAX_KEYS_PER_HASH}): keys chosen to collide"
    )
  return keys


def check_orderable(out: dict, where: str) -> None:
  """Tuple keys jax can sort (it orders a dict's children by sorting its keys)."""
  try:
    sorted(out)
  except TypeError:
    raise ArchiveError(f"{where}: a dict node's tuple keys cannot be ordered") from None
