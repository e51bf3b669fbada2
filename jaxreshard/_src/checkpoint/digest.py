"""A sharding-independent digest of a checkpoint's optimizer state.

Two checkpoints hold the same optimizer state, whatever their layouts, when
every logical buffer (flat, unpadded) has the same bits, every clock scalar has
the same bits, and the state has the same structure. The digest hashes exactly
that: each history buffer's owned elements are fed, rank by rank in rank order,
into one ``hashlib`` hash per (param, buffer index), so the padding and the
world size never reach the hash. The padding is checked separately (it must be
exactly zero bits; ``-0.0`` is not zero padding).

Records may arrive one at a time (a generator reading one rank at a time):
slices that arrive before their turn wait in a small reorder buffer, so a
checkpoint streamed in rank order is hashed without holding more than one
record. Deferred records after the first of their layout are hashed from their
packed buffers (``digestpacked``), with the same checks and words.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jaxreshard._src.checkpoint import digestpacked as _packed
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.checkpoint.parampaths import ParamPaths
from jaxreshard._src.core import archivecheck as _archivecheck
from jaxreshard._src.core import clock as _clock
from jaxreshard._src.core import deleted as _deleted
from jaxreshard._src.core import record as _record
from jaxreshard._src.core import structure as _structure
from jaxreshard._src.core import validate as _validate
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.record import ShardRecord
from jaxreshard._src.errors import PlacementError
from jaxreshard._src.exec import bitview as _bitview

__all__ = [
  "BufferDigest",
  "Digest",
  "ParamDigest",
  "checkpoint_records",
  "clock_scalars",
  "digest",
  "digest_records",
  "raw_bits",
]


@dataclasses.dataclass(frozen=True)
class BufferDigest:
  """One logical history buffer: dtype, element count and sha256 of its bits."""

  dtype: str
  count: int
  sha256: str


@dataclasses.dataclass(frozen=True)
class ParamDigest:
  """One parameter: logical metadata, which mirrors hold it, its buffers."""

  shape: tuple[int, ...]
  dtype: str
  trainable: bool
  history: tuple[str, ...]  # per optimizer mirror: "buffer", "masked" or "absent"
  buffers: tuple[BufferDigest, ...]
  # Its key path in the params tree, each key with its kind (``{0: w}``, ``{"0": w}``
  # and ``[w]`` all hold param "0", at three different paths).
  path: str = ""


@dataclasses.dataclass(frozen=True, eq=False)
class Digest:
  """What a checkpoint holds, independent of how it is sharded.

  Attributes:
    structure: the optimizer state's tree structure with every
      param-mirroring subtree replaced by a marker, plus the mirrors' paths.
    scalars: ``(path, dtype and shape (" weak" after a weakly typed one), hex of the
      bits)`` of every clock scalar.
    params: param id -> ``ParamDigest``.
    problems: nonzero padding, incomplete or inconsistent archives; a
      checkpoint with problems is never "identical" to anything.
    trees: ``(path, tree structure)`` of each param-mirroring subtree whose
      tree, as a whole state has it (``unshard_state``'s), is not the nested
      dicts of its param ids: one with a list, a tuple, another container or
      an empty node (``None``, ``{}``), with a leaf at each param. The key paths
      of the params alone leave out containers that hold no param.
  """

  structure: str
  scalars: tuple[tuple[str, str, str], ...]
  params: Mapping[str, ParamDigest]
  problems: tuple[str, ...]
  trees: tuple[tuple[str, str], ...] = ()

  def __eq__(self, other: object) -> bool:
    # Archives with problems hold no one state: never equal, not even to themselves,
    # so that ``digest(a) == digest(b)`` never passes on an invalid checkpoint.
    if not isinstance(other, Digest):
      return NotImplemented
    if self.problems or other.problems:
      return False
    return (self.structure, self.trees, self.scalars, dict(self.params)) == (
      other.structure,
      other.trees,
      other.scalars,
      dict(other.params),
    )

  __hash__ = None  # type: ignore[assignment]  # equal digests hold unhashable mappings

  def hexdigest(self) -> str:
    """One sha256 over everything above, the problems too: archives with problems
    never share a hexdigest with a set that has none."""
    h = hashlib.sha256(self.structure.encode())
    if self.trees:  # none for params trees of nested dicts: the hash they always had
      h.update(repr(("trees", self.trees)).encode())
    h.update(repr(self.scalars).encode())
    for pid in sorted(self.params):
      h.update(repr((pid, self.params[pid])).encode())
    if self.problems:
      h.update(repr(("problems", self.problems)).encode())
    return h.hexdigest()


raw_bits = _bitview.bits


def _history_word(entry: Any) -> str:
  if entry is None:
    return "absent"
  if entry is _structure.MASKED:
    return "masked"
  return "buffer"


class _Stream:
  """One (param, buffer) hash fed in rank order through a reorder buffer."""

  def __init__(self, dtype: np.dtype):
    self.hash = hashlib.sha256()
    self.dtype = dtype
    self.next_rank = 0
    self.count = 0  # elements hashed so far
    self.waiting: dict[int, np.ndarray] = {}

  def feed(self, rank: int, bits: np.ndarray) -> None:
    # Early slices are copied so that waiting never pins a whole record.
    self.waiting[rank] = bits if rank == self.next_rank else bits.copy()
    while self.next_rank in self.waiting:
      chunk = self.waiting.pop(self.next_rank)
      self.hash.update(chunk.tobytes())
      self.count += chunk.size
      self.next_rank += 1


@_deleted.names_deleted
def digest_records(records: Iterable[ShardRecord]) -> Digest:
  """Digests a complete set of archives, streaming them one at a time.

  Args:
    records: every rank's archive of one checkpoint, in any order (rank order
      keeps the reorder buffer empty); a generator is read once.

  Returns:
    A ``Digest``; ``digest.problems`` lists nonzero padding and archives that
    do not form one complete, consistent checkpoint.

  Raises:
    ReshardError: an archive that cannot be taken apart, or that every reshard
      refuses on its own (its record version, listing, storage or buffer dtypes).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.adam(1e-3)
    >>> state = opt.init(params)
    >>> a = digest_records(jr.shard_state(opt, params, state, world_size=2))
    >>> b = digest_records(jr.shard_state(opt, params, state, world_size=3))
    >>> a == b
    True
  """
  acc = _Accumulator()
  paths = ParamPaths()
  packed = _packed.PackedRanks()  # later ranks of a deferred record's layout
  one = _record.CheckpointOf()
  for index, record in enumerate(records):
    _archivecheck.check_version(index, record)
    try:
      one.add(index, record)
    except PlacementError as e:  # parts of two saves hold no one state
      acc.problems.append(str(e))
    if packed.add(acc, index, record):
      continue
    state_parts = _validate.check_record(index, record)[0]
    seen = len(acc.problems)
    acc.add_structure(index, state_parts, record)
    path_of = paths.of(state_parts)
    for p in record.placements:
      acc.add_placement(index, p, state_parts.history(p.param), path_of.get(p.param, ""))
    mirrors = _mirrors(state_parts)
    acc.add_rank_zero([p.param for p in record.placements if p.rank == 0], mirrors)
    if len(acc.problems) == seen:
      packed.learn(acc, record, lambda: structure_of(state_parts, record), mirrors)
  return acc.digest()


def _mirrors(state_parts: _structure.StateParts) -> tuple[tuple[Any, Any, tuple[str, ...]], ...]:
  """``(prefix, treedef, param order)`` of each param-mirroring subtree of an archive."""
  return tuple((m.prefix, m.treedef, m.order) for m in state_parts.subtrees)


class _Accumulator:
  """What ``digest_records`` has seen so far, one archive at a time."""

  def __init__(self):
    self.structure: str | None = None
    self.scalars: tuple | None = None
    self.clock: tuple | None = None  # archive 0's ``_clock.clock_key``
    self.meta: dict[str, tuple] = {}  # pid -> (shape, dtype, trainable, world_size, history)
    self.seen_ranks: dict[str, set[int]] = {}
    self.streams: dict[tuple[str, int], _Stream] = {}
    self.problems: list[str] = []
    # The archive a whole state takes its mirrors' trees from (``build_state``'s
    # template: the one holding rank 0 of the first param id), as (that id, its
    # mirrors); and ``archivecheck.check_one_tree``'s layouts so far.
    self.template: tuple[str, tuple] | None = None
    self.layouts: dict = {}
    # Per mirror, the distinct trees of the archives holding a rank 0: the trees a
    # whole state of several groups merges (``build_state``'s ``keys``).
    self.mirror_trees: list[dict[tuple, None]] = []
    self._keyed: dict[int, tuple] = {}  # the mirrors read into ``mirror_trees``, by identity

  def add_structure(
    self, index: int, state_parts: _structure.StateParts, record: ShardRecord
  ) -> None:
    """The state's structure and clock scalars must be those of archive 0, and
    archives holding the same params must hold them in the same trees."""
    structure, clock, names = structure_of(state_parts, record)
    if self.structure is None:
      self.structure, self.scalars, self.clock = structure, _scalars(record), clock
    else:
      self.check_structure(index, structure, clock, names)
    try:
      _archivecheck.check_one_tree([(index, state_parts)], self.layouts)
    except PlacementError as e:
      self.problems.append(str(e))

  def add_rank_zero(self, pids: Iterable[str], mirrors: tuple) -> None:
    """An archive holds rank 0 of ``pids``, in the trees of ``mirrors`` (``_mirrors``)."""
    first = min(pids, default=None)
    if first is not None and (self.template is None or first < self.template[0]):
      self.template = (first, mirrors)
    if first is not None and self._keyed.get(id(mirrors)) is not mirrors:
      self._keyed[id(mirrors)] = mirrors
      for i, (_, treedef, order) in enumerate(mirrors):
        if i == len(self.mirror_trees):
          self.mirror_trees.append({})
        self.mirror_trees[i].setdefault((treedef, order), None)

  def trees(self) -> tuple[tuple[str, str], ...]:
    """``Digest.trees``. A whole state takes each mirror's tree from the template
    archive when that holds every param the archives put in the mirror, else
    merges the trees of every group's archives (``build_state``); only trees
    other than the nested dicts of the params' ids are listed."""
    if self.template is None:
      return ()
    out = []
    for i, (prefix, treedef, order) in enumerate(self.template[1]):
      held = sorted(
        pid for pid, key in self.meta.items() if i < len(key[4]) and key[4][i] != "absent"
      )
      try:
        nested = jax.tree_util.tree_structure(_structure.nested(held, dict.fromkeys(held, 0)))
        if set(order) != set(held):
          trees = tuple(self.mirror_trees[i]) if i < len(self.mirror_trees) else ()
          treedef = _structure.merged_tree(trees or ((treedef, order),), held, prefix)[0]
      except PlacementError:  # ids no tree holds: listed in the problems already
        continue
      if treedef != nested:
        out.append((jax.tree_util.keystr(prefix), str(treedef)))
    return tuple(out)

  def check_structure(self, index: int, structure: str, clock: Any, names: list[str]) -> None:
    """An archive after the first: its structure and clock (``structure_of``) are archive 0's."""
    where = _clock.clock_difference(self.clock, clock)
    if structure != self.structure or where == _clock.STRUCTURE:
      self.problems.append(f"archive {index}: optimizer state structure differs from archive 0")
    elif where is not None:
      named = f" ({names[where]})" if 0 <= where < len(names) else ""
      self.problems.append(
        f"archive {index}: optimizer clock scalar{named} differs from archive 0's"
      )

  def new_stream(self, dtype: np.dtype) -> _Stream:
    return _Stream(dtype)

  def add_placement(self, index: int, p: Any, hist: tuple[Any, ...], path: str = "") -> None:
    """One parameter's rank: its metadata agrees, the rank is new, its buffers stream in."""
    pid = p.param
    _validate.check_storage_dtype(p.dtype, f"param {pid!r}: archive {index}")
    g = FlatShard(p.shape, p.rank, p.world_size)  # a shape 5 or None: refused, as everywhere
    words = tuple(_history_word(h) for h in hist)
    key = (tuple(p.shape), np.dtype(p.dtype).name, bool(p.trainable), p.world_size, words, path)
    if self.meta.setdefault(pid, key) != key:
      self.problems.append(
        f"param {pid!r}: archive {index} disagrees with another archive on its shape,"
        f" dtype, trainability, world size, history or key path"
      )
      return
    if p.rank in self.seen_ranks.setdefault(pid, set()):
      self.problems.append(f"param {pid!r}: rank {p.rank} appears in more than one archive")
      return
    self.seen_ranks[pid].add(p.rank)
    buffers = [h for h in hist if h is not None and h is not _structure.MASKED]
    for m, buf in enumerate(buffers):
      self.add_buffer(
        f"param {pid!r} buffer {m} (archive {index}, rank {p.rank})", (pid, m), g, buf
      )

  def add_buffer(self, where: str, key: tuple[str, int], g: FlatShard, buf: Any) -> None:
    """A buffer's owned elements join its stream; its padding must be zero bits."""
    if tuple(np.shape(buf)) != (g.slots,):
      self.problems.append(f"{where}: shape {tuple(np.shape(buf))} is not ({g.slots},)")
      return
    _validate.check_buffer_dtype(np.asarray(buf).dtype, where)
    bits = raw_bits(buf)
    pad = np.flatnonzero(bits[g.owned :])
    if pad.size:
      self.problems.append(
        f"{where}: padding is not zero ({pad.size} nonzero, first at local"
        f" index {g.owned + int(pad[0])})"
      )
    dtype = np.asarray(buf).dtype
    stream = self.streams.setdefault(key, _Stream(dtype))
    if stream.dtype != dtype:
      self.problems.append(
        f"{where}: dtype {dtype.name} differs from another rank's {stream.dtype.name}"
      )
      return
    stream.feed(g.rank, bits[: g.owned])

  def digest(self) -> Digest:
    """The digest of everything seen; ranks never seen are problems."""
    params = {}
    for pid, (shape, dtype, trainable, world, words, path) in sorted(self.meta.items()):
      missing = sorted(set(range(world)) - self.seen_ranks.get(pid, set()))
      if missing:
        self.problems.append(f"param {pid!r}: ranks {missing} of world size {world} are missing")
      buffers = []
      for m in range(words.count("buffer")):
        s = self.streams.get((pid, m))
        if s is not None:
          buffers.append(BufferDigest(s.dtype.name, s.count, s.hash.hexdigest()))
      params[pid] = ParamDigest(shape, dtype, trainable, words, tuple(buffers), path)
    if self.structure is None:
      self.problems.append("no archives")
    return Digest(
      self.structure or "", self.scalars or (), params, tuple(self.problems), self.trees()
    )


@_deleted.names_deleted
def digest(records_or_directory: Iterable[ShardRecord] | os.PathLike | str) -> Digest:
  """A fingerprint of an optimizer state that does not depend on how it is sharded.

  Two sets of archives without problems have equal digests (``==``, or the same
  ``hexdigest()``) exactly when they hold the same optimizer state: the same
  structure, every clock scalar with the same bits, every parameter with the same
  shape, dtype, trainability and history buffers, each buffer's elements with the
  same bits in the same order, whatever the world sizes. Padding never enters the
  hash; nonzero padding and incomplete sets of archives are listed in
  ``Digest.problems``: such a digest equals none (``==``, not even itself), and its
  ``hexdigest()``, which covers the problems, never equals that of a set without
  any (the same incomplete set digested twice gives the same one).

  Args:
    records_or_directory: every archive of one state (any iterable of
      ``ShardRecord``; a generator is read once, one record at a time), or a
      checkpoint directory written by ``save_records`` or ``save_sharded``
      (read one archive at a time).

  Returns:
    A ``Digest``: ``hexdigest()`` (one sha256), ``params`` (param id ->
    shape, dtype, trainability and a sha256 per history buffer), ``scalars``
    (path, dtype and bits of every clock scalar) and ``problems``.

  Raises:
    FileNotFoundError: the directory does not exist.
    ReshardError: an archive that cannot be taken apart or that every reshard
      refuses on its own (``digest_records``), or a directory that
      is not a readable jaxreshard checkpoint.

  Examples:
    >>> import os, tempfile, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(5.0)}
    >>> opt = optax.sgd(0.1, momentum=0.9)
    >>> state = opt.update(params, opt.init(params))[1]
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> jr.save_records(path, jr.shard_state(opt, params, state, world_size=2))
    >>> a = jr.digest(path)
    >>> b = jr.digest(jr.shard_state(opt, params, state, world_size=3))
    >>> a.hexdigest() == b.hexdigest(), jr.compare_digests(a, b)
    (True, [])
    >>> later = opt.update(params, state)[1]
    >>> jr.compare_digests(a, jr.digest(jr.shard_state(opt, params, later, world_size=3)))
    ["param 'w' buffer 0: bits differ (float32[5] ... != float32[5] ...)"]
  """
  if isinstance(records_or_directory, (str, os.PathLike)):
    return digest_records(_stream(records_or_directory))
  _archivecheck.check_records_iterable(
    records_or_directory, "digest (of a checkpoint directory, str or os.PathLike, or of records)"
  )
  return digest_records(records_or_directory)


def _stream(directory: os.PathLike | str) -> Iterator[ShardRecord]:
  return checkpoint_records(_reader.open_checkpoint(directory))


def checkpoint_records(ckpt: _reader.Checkpoint) -> Iterator[ShardRecord]:
  """A checkpoint's records, one archive at a time, every archive's metadata checked first
  (its ``archive.json`` too: one whose records hold no param reads no buffer of it)."""
  for i in range(len(ckpt)):
    ckpt.check_archive(i)
  for i in range(len(ckpt)):
    ckpt.archive_meta(i)
  for i in range(len(ckpt)):
    yield ckpt.record(i)


def structure_of(state_parts: _structure.StateParts, record: ShardRecord) -> tuple[str, Any, list]:
  """A record's structure text, clock key and the names of its clock scalars."""
  structure = repr(
    (str(state_parts.skeleton), [jax.tree_util.keystr(m.prefix) for m in state_parts.subtrees])
  )
  leaves = clock_leaves(record)
  # The clock compares the tree itself, as a reshard does: its text names a
  # NamedTuple by its name alone, and another class of that name is another state.
  skeleton = (state_parts.skeleton, tuple(m.prefix for m in state_parts.subtrees))
  return structure, _clock.clock_key(skeleton, [x for _, x in leaves]), [n for n, _ in leaves]


def clock_scalars(record: ShardRecord) -> list[tuple[str, np.ndarray]]:
  """``(key path, value)`` of every clock scalar of a record, in state order.

  Paths are ``_structure.clock_paths``', the name every message uses; a typed
  PRNG key's value is its key data.
  """
  return [(path, _clock.plain(x)) for path, x in clock_leaves(record)]


def clock_leaves(record: ShardRecord) -> list[tuple[str, Any]]:
  """``(key path, leaf)`` of every clock scalar, the leaves as the state holds them."""
  try:
    state_parts = _structure.state_parts(
      record.state, _structure.roles_of(record), [p.param for p in record.placements]
    )
  except _structure.StatePartsError as e:
    raise PlacementError(f"an archive that cannot be taken apart: {e}") from None
  paths = _structure.clock_paths(
    state_parts.skeleton,
    [not isinstance(x, _structure.ParamsSubtreeSlot) for x in state_parts.skeleton_leaves],
  )
  return [(path, x) for path, (_, x) in zip(paths, state_parts.scalars)]


def _scalars(record: ShardRecord) -> tuple[tuple[str, str, str], ...]:
  # A typed PRNG key is its key data, under its own dtype's name (key<fry>).
  out = []
  for path, x in clock_leaves(record):
    a = _clock.plain(x)
    dtype = x.dtype if hasattr(x, "dtype") else a.dtype
    weak = " weak" if _clock.is_weak(x) else ""  # how jax promotes it
    out.append((path, f"{dtype}{a.shape}{weak}", raw_bits(a).tobytes().hex()))
  return tuple(out)
