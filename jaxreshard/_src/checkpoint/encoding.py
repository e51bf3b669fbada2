"""The JSON half of an archive on disk: metadata and the state's tree (the clock's
scalars: ``clockjson``).

A checkpoint is untrusted data. Everything here turns JSON into
Python values without executing anything from it: no pickle, no eval, names
checked against strict patterns before they become paths, NamedTuple classes
re-created only from an allowlist, sizes checked before anything is allocated
(the buffer files themselves are checked in ``_shardfile``).

A state's tree is encoded node by node, as JSON arrays (a large state's tree
has a node per leaf, and arrays parse faster than objects)::

  null (None) | 3 (leaf number 3) | ["l" | "t", [children]] (list, tuple)
  ["d", [["s", "mu"], ["i", 0]], [children]] (dict: str or int keys)
  ["d", [["u", [["s", "layer"], ["i", 0]]]], [children]] (tuple keys: ("layer", 0))
  ["f", [...keys...], [children]]             (flax FrozenDict, keys as for dict)
  ["o", [...keys...], [children]]             (OrderedDict, keys in its own order)
  ["n", "optax._src.transform", "ScaleByAdamState", ["count", "mu", "nu"], [children]]

Every JSON file jaxreshard writes in a checkpoint (the index and each
``archive.json``; not zarr's ``zarr.json``) is *signed*: its compact, ASCII
JSON body with a sha256 of that body as the first member::

  {"checksum":"sha256:<64 lowercase hex digits>",<the body after its opening brace>

The sha256 covers the body's exact bytes (``{`` and everything after the
checksum member's comma), and a reader checks it on the raw bytes before it
parses anything or uses any value (:func:`verified_json`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import re
import sys
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxreshard._src.checkpoint import dictkeys as _dictkeys
from jaxreshard._src.checkpoint.untrusted import short
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import storable as _storable
from jaxreshard._src.errors import ArchiveError, ArchiveExistsError, ReshardError

__all__ = [
  "ArchiveError",
  "ArchiveExistsError",
  "decode_tree",
  "encode_tree",
  "check_name",
  "np_dtype",
  "signed_json",
  "verified_json",
]

# Names that become file names inside a checkpoint; anything else is refused.
ARCHIVE_NAME = re.compile(r"archive_[0-9]{5,9}\Z")
_IDENTIFIER = _storable.IDENTIFIER
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,9}\Z")

# NamedTuple classes are looked up only in these (already imported) packages.
ALLOWED_PACKAGES = ("optax",)

DTYPES = {name: jnp.dtype(name) for name in _clock.CLOCK_DTYPES}
MAX_SCALAR_BYTES = _clock.MAX_CLOCK_BYTES
MAX_TREE_DEPTH = _storable.MAX_TREE_DEPTH


def check_name(name: Any, pattern: re.Pattern, where: str) -> str:
  """Refuses any metadata name that could leave the checkpoint directory."""
  if not isinstance(name, str) or not pattern.match(name):
    raise ArchiveError(f"{where}: name {short(name)} is not a valid name inside a checkpoint")
  return name


# The dtypes a history buffer is stored in (clock scalars may have any of DTYPES).
BUFFER_DTYPES = ("float16", "bfloat16", "float32", "float64")


def buffer_dtype(dtype: np.dtype, where: str) -> np.dtype:
  """``dtype``, refused unless history buffers are stored in it."""
  if np.dtype(dtype).name not in BUFFER_DTYPES:
    raise ArchiveError(
      f"{where}: history buffer dtype {np.dtype(dtype).name} is not a floating"
      " dtype jaxreshard stores"
    )
  return dtype


def np_dtype(name: Any, where: str) -> np.dtype:
  """A dtype from its name, only from a fixed list."""
  if not isinstance(name, str) or name not in DTYPES:
    raise ArchiveError(f"{where}: dtype {short(name)} is not one jaxreshard stores")
  return np.dtype(DTYPES[name])


def loads(text: str, where: str) -> Any:
  """Strict JSON: no NaN/Infinity constants, no duplicate keys."""

  def no_constants(c):
    raise ValueError(f"constant {c} is not allowed")

  def no_duplicates(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
      seen = set()
      for k, _ in pairs:
        if k in seen:
          raise ValueError(f"duplicate key {k!r}")
        seen.add(k)
    return out

  try:
    return json.loads(text, parse_constant=no_constants, object_pairs_hook=no_duplicates)
  except (ValueError, RecursionError) as e:
    raise ArchiveError(f"{where} is not valid JSON: {e}") from None


# A signed file starts with exactly these bytes, 64 lowercase hex digits, ``",``.
SIGNED_PREFIX = b'{"checksum":"sha256:'
_SIGNED_HEAD = len(SIGNED_PREFIX) + 64 + 2
_HEX = re.compile(rb"[0-9a-f]{64}\Z")


def signed_json(obj: dict) -> bytes:
  """The bytes of a signed JSON file holding ``obj`` (a non-empty dict).

  The body is ``obj`` as compact ASCII JSON; the file is that body with
  ``"checksum":"sha256:<sha256 of the body>"`` inserted as its first member.
  """
  if not isinstance(obj, dict) or not obj or "checksum" in obj:
    raise ValueError("a signed JSON file holds a non-empty dict without a 'checksum' key")
  # json.dumps, not json.dump: only the former uses the C encoder.
  body = json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
  return SIGNED_PREFIX + hashlib.sha256(body).hexdigest().encode() + b'",' + body[1:]


def is_signed(raw: bytes) -> bool:
  """Whether ``raw`` starts the way a signed JSON file does (its checksum unchecked)."""
  return raw.startswith(SIGNED_PREFIX)


def verified_json(raw: bytes, where: str) -> Any:
  """The value of a signed JSON file, after its checksum matched its raw bytes.

  Raises:
    ArchiveError: naming ``where``: the file has no checksum where a signed
      file has it, the checksum does not match the bytes (the file was changed
      or damaged after it was written), or the checked body is not strict JSON
      of a dict.
  """
  head = raw[:_SIGNED_HEAD]
  if (
    not raw.startswith(SIGNED_PREFIX)
    or len(raw) < _SIGNED_HEAD + 1
    or not _HEX.match(head[len(SIGNED_PREFIX) : -2])
    or head[-2:] != b'",'
  ):
    raise ArchiveError(
      f"{where} has no checksum: a file jaxreshard writes in a checkpoint starts"
      ' with {"checksum":"sha256:<64 hex digits>",'
    )
  body = b"{" + raw[_SIGNED_HEAD:]
  recorded = head[len(SIGNED_PREFIX) : -2].decode("ascii")
  actual = hashlib.sha256(body).hexdigest()
  if actual != recorded:
    raise ArchiveError(
      f"{where} fails its checksum (sha256 {actual[:16]}... of its bytes, but it"
      f" records {recorded[:16]}...): the file was changed or damaged after it"
      " was written"
    )
  try:
    text = body.decode("ascii")
  except UnicodeDecodeError:
    raise ArchiveError(f"{where} is not ASCII JSON") from None
  value = loads(text, where)
  if not isinstance(value, dict) or "checksum" in value:
    raise ArchiveError(f"{where}: its checked body is not a JSON object without a checksum member")
  return value


def expect(value: Any, kind: type, where: str) -> Any:
  if kind is int:
    ok = isinstance(value, int) and not isinstance(value, bool)
  else:
    ok = isinstance(value, kind)
  if not ok:
    raise ArchiveError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")
  return value


# A shape has at most numpy's 64 dimensions, and the product of its dimensions,
# each zero counted as one, is at most MAX_EXTENT: an array of it, empty or not,
# has a byte count (at up to 16 bytes an element) that numpy and jax can hold.
MAX_NDIM = 64
MAX_EXTENT = 2**58


def valid_shape(dims: tuple[int, ...]) -> bool:
  """Whether ``dims`` (ints) is a shape a checkpoint may hold.

  Examples:
    >>> valid_shape((3, 0)), valid_shape((2**60, 0)), valid_shape((1,) * 65)
    (True, False, False)
  """
  return (
    len(dims) <= MAX_NDIM
    and all(d >= 0 for d in dims)
    and math.prod(d or 1 for d in dims) <= MAX_EXTENT
  )


def shape_of(value: Any, where: str) -> tuple[int, ...]:
  dims = tuple(expect(d, int, where) for d in expect(value, list, where))
  if not valid_shape(dims):
    raise ArchiveError(f"{where}: shape {short(dims)} is not a valid array shape")
  return dims


# --- the state's tree structure -----------------------------------------------


def _frozen_dict_class(where: str) -> type:
  try:
    from flax.core.frozen_dict import FrozenDict  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ArchiveError(
      f"{where}: the state holds a flax FrozenDict; loading it needs flax installed"
    ) from None
  return FrozenDict


def encode_tree(state: Any) -> tuple[dict, list[Any]]:
  """Encodes ``state``'s structure; returns (tree, leaves in jax.tree.leaves order).

  Raises:
    ReshardError: a tree the on-disk format cannot re-create (``core.storable``'s rule).
  """
  leaves: list[Any] = []
  classes: dict[tuple, type] = {}

  def enc(node, path):
    kind, what, children = _storable.node(node, path, classes)
    if kind == "leaf":
      leaves.append(node)
      return len(leaves) - 1
    if kind == "none":
      return None
    out = [enc(c, path + (k,)) for k, c in children]
    if kind == "n":
      return ["n", what.__module__, what.__name__, list(what._fields), out]
    return [kind, out] if kind in ("l", "t") else [kind, what, out]

  try:
    tree = enc(state, ())
  except _storable.UnstorableTree as e:
    raise ReshardError(str(e)) from None
  # The encoding must give back exactly this structure, or saving is pointless
  # (with the original classes: one loaded elsewhere may be a plain namedtuple).
  rebuilt = decode_tree(tree, list(range(len(leaves))), "state", classes)
  if jax.tree_util.tree_structure(rebuilt) != jax.tree_util.tree_structure(
    state
  ) or jax.tree.leaves(rebuilt) != list(range(len(leaves))):
    raise ReshardError("the state's tree structure cannot be stored exactly")
  return tree, leaves


_FALLBACK_LOCK = threading.Lock()
_FALLBACK_CLASSES: dict[tuple[str, tuple[str, ...]], type] = {}


def namedtuple_class(module: Any, name: Any, fields: Any, where: str) -> type:
  """The NamedTuple class to re-create, found without running any checkpoint code.

  An allowlisted class (found by attribute lookup in an already-imported optax
  module, a NamedTuple with exactly these fields) when there is one; otherwise
  a plain ``collections.namedtuple`` of the same name and fields, one class per
  (name, fields) so that archives loaded separately still share a structure.
  """
  check_name(name, _IDENTIFIER, where)
  # The rule a writer applies (``storable.names_ok``): what it refuses is never read.
  if not isinstance(fields, list) or not _storable.names_ok(name, fields):
    raise ArchiveError(f"{where}: NamedTuple {short(name)} has invalid field names {short(fields)}")
  fields = tuple(fields)
  if isinstance(module, str) and _MODULE.match(module) and module.split(".")[0] in ALLOWED_PACKAGES:
    mod = sys.modules.get(module)  # never imports: only modules already loaded
    cls = getattr(mod, name, None) if mod is not None else None
    if (
      isinstance(cls, type)
      and issubclass(cls, tuple)
      and tuple(getattr(cls, "_fields", ())) == fields
      and hasattr(cls, "_make")
    ):
      return cls
  with _FALLBACK_LOCK:
    key = (name, fields)
    cls = _FALLBACK_CLASSES.get(key)
    if cls is None:
      try:
        cls = _FALLBACK_CLASSES[key] = collections.namedtuple(name, fields)
      except ValueError as e:
        raise ArchiveError(f"{where}: cannot re-create NamedTuple {short(name)}: {e}") from None
    return cls


def decode_tree(tree: Any, leaves: Sequence[Any], where: str, classes: dict | None = None) -> Any:
  """Rebuilds a pytree from ``encode_tree``'s JSON and its leaves (each used once).

  ``classes`` (the encoder's own, never a checkpoint's) maps (module, name,
  fields) to the NamedTuple class to use instead of the allowlist lookup.
  """
  used = [False] * len(leaves)

  n_leaves = len(leaves)

  def dec(node, depth):
    if depth > MAX_TREE_DEPTH:
      raise ArchiveError(f"{where}: the state tree is nested deeper than {MAX_TREE_DEPTH}")
    t = type(node)
    if t is int:  # a leaf: the common node, checked first
      if not 0 <= node < n_leaves or used[node]:
        raise ArchiveError(f"{where}: leaf index {short(node)} is out of range or used twice")
      used[node] = True
      return leaves[node]
    if node is None:
      return None
    if t is not list or not node or type(node[-1]) is not list:
      raise ArchiveError(f"{where}: invalid tree node {str(node)[:200]!r}")
    kind, children = node[0], node[-1]
    if kind in ("l", "t") and len(node) == 2:
      out = [dec(c, depth + 1) for c in children]
      return out if kind == "l" else tuple(out)
    if kind in ("d", "f", "o") and len(node) == 3 and type(node[1]) is list:
      keys = node[1]
      if len(keys) != len(children):
        raise ArchiveError(
          f"{where}: a dict node has {len(keys)} keys and {len(children)} children"
        )
      decoded = _dictkeys.decode(keys, where)
      out = {}
      for key, c in zip(decoded, children):
        if key in out:
          raise ArchiveError(f"{where}: dict key {short(key)} appears twice")
        out[key] = dec(c, depth + 1)
      if kind == "o":  # its keys in their stored order, which jax keeps
        return collections.OrderedDict(out)
      if out and type(decoded[0]) is tuple:
        _dictkeys.check_orderable(out, where)
      return out if kind == "d" else _frozen_dict_class(where)(out)
    if kind == "n" and len(node) == 5:
      _, module, name, fields = node[:4]
      if not (
        type(module) is str
        and type(name) is str
        and type(fields) is list
        and all(type(f) is str for f in fields)
      ):
        raise ArchiveError(f"{where}: invalid NamedTuple node {str(node[:4])[:200]!r}")
      cls = (classes or {}).get((module, name, tuple(fields))) or namedtuple_class(
        module, name, fields, where
      )
      out = [dec(c, depth + 1) for c in children]
      if len(out) != len(cls._fields):
        raise ArchiveError(f"{where}: NamedTuple {cls.__name__} has {len(out)} children")
      return cls(*out)
    raise ArchiveError(f"{where}: invalid tree node {str(node)[:200]!r}")

  out = dec(tree, 0)
  if not all(used):
    raise ArchiveError(f"{where}: {used.count(False)} stored leaves are not in the tree")
  return out
