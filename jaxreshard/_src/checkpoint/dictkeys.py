"""A state dict's keys in the JSON of its tree: ``["s", str]``, ``["i", int]`` and
``["u", [keys]]`` for a tuple of such keys (flax's ``traverse_util.flatten_dict``
form), one kind per dict, written in jax's order for dicts (sorted keys).

Reading them is bounded work: codes nest at most ``MAX_KEY_DEPTH`` deep, and int or
tuple keys chosen to share a hash (a dict of n of them takes n**2 steps to build) are
refused before any dict is built.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxreshard._src.checkpoint.untrusted import short
from jaxreshard._src.errors import ArchiveError, ReshardError

__all__ = ["check_orderable", "decode", "sorted_codes"]

# A dict key inside a tuple key nests at most this deep.
MAX_KEY_DEPTH = 16

# At most this many keys of one dict may share a hash (-1 and -2 share one in CPython).
MAX_KEYS_PER_HASH = 8


def code(key: Any, depth: int = 0) -> list | None:
  """A dict key's JSON; None for a key of no code."""
  t = type(key)
  if t is str:
    return ["s", key]
  if t is int:
    return ["i", key]
  if t is tuple and depth < MAX_KEY_DEPTH:
    codes = [code(k, depth + 1) for k in key]
    return None if None in codes else ["u", codes]
  return None


def value(json_code: Any, depth: int = 0) -> str | int | tuple | None:
  """:func:`code`'s inverse; None for JSON that is not a key's code."""
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


def sorted_codes(node: dict, path: tuple) -> tuple[list, list]:
  """A dict's keys in jax's order for dicts (sorted), and their codes.

  Raises:
    ReshardError: keys of two kinds, or a key with no code.
  """
  refused = ReshardError(
    f"state node at {path}: dict keys must be all str, all int or all tuples of"
    " str, int and such tuples to be stored"
  )
  if len({type(k) for k in node}) > 1:
    raise refused
  try:
    keys = sorted(node)
  except TypeError:
    raise refused from None
  codes = [code(k) for k in keys]
  if None in codes:
    raise refused
  return keys, codes


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
  # A str's hash is seeded per process, so no file can choose it; an int's is the int
  # modulo 2**61 - 1, and a tuple's follows from its items'.
  if len(keys) > MAX_KEYS_PER_HASH and type(keys[0]) is not str:
    hashes = np.fromiter(map(hash, keys), np.int64, len(keys))
    most = int(np.unique(hashes, return_counts=True)[1].max())
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
