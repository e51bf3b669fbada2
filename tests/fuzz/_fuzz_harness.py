"""The checkpoint fuzz harness: the checkpoint, its mutations, bounded calls, signing.

Used by ``tests/fuzz/test_fuzz_checkpoint.py`` (whose docstring says what is fuzzed and
how the judge, ``tests/fuzz/_fuzz_judge.py``, decides) and by the strategies in
``tests/fuzz/_fuzz_strategies.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import HealthCheck, Phase, settings

import jaxreshard as jr
from jaxreshard._src.checkpoint import read_plan as _read_plan
from jaxreshard._src.checkpoint.reader import open_checkpoint
from jaxreshard._src.cli import commands as _cli

# --- profiles -------------------------------------------------------------------

PROFILE = os.environ.get("JAXRESHARD_FUZZ", "short")
STRICT = os.environ.get("JAXRESHARD_FUZZ_STRICT") == "1"
LONG = PROFILE == "long"
# A refusal takes milliseconds; a call that needs this long hangs (two shared cores).
PATIENCE_S = 30.0 if LONG else 15.0
MAX_TRACED_BYTES = 64 << 20
# An error message quotes untrusted metadata truncated (the reader's own [:80]s):
# a line longer than this echoes a whole field (a 64 MiB index could fill a log).
MAX_ERROR_CHARS = 2000


def _settings(short_examples: int) -> settings:
  common = dict(
    deadline=None,  # the watchdog bounds each call; a deadline cannot stop a hang
    suppress_health_check=[
      HealthCheck.too_slow,
      HealthCheck.data_too_large,
      HealthCheck.function_scoped_fixture,
    ],
    print_blob=True,
  )
  if LONG:
    return settings(
      max_examples=int(os.environ.get("JAXRESHARD_FUZZ_EXAMPLES", "2000")),
      derandomize=False,
      **common,
    )
  return settings(
    max_examples=short_examples,
    derandomize=True,
    database=None,
    phases=[Phase.generate, Phase.shrink],
    **common,
  )


# --- the checkpoint -------------------------------------------------------------

WORLD = 3
CHUNK_BYTES = 8
INDEX = "jaxreshard.json"
ARCHIVES = [f"archive_{i:05d}" for i in range(WORLD)]
DTYPES = ["bfloat16", "float32"]


def _params():
  return {
    "": jnp.zeros((5,), jnp.float32),
    "a/b": jnp.zeros((7,), jnp.bfloat16),
    "dense": {"kernel": jnp.zeros((4, 3), jnp.float32)},
    "scale": jnp.zeros((), jnp.float32),
  }


def fuzz_records(world: int = WORLD, seed: int = 0, count: int = 1234) -> list:
  """The records saved: random bits in every history buffer, a non-trivial clock."""
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
  params = _params()
  with jax.numpy_dtype_promotion("standard"):
    state = opt.init(params)
  rng = np.random.default_rng(seed)

  def fill(x):
    a = np.asarray(x)
    if a.ndim == 0:
      return x
    u = np.dtype(f"u{a.dtype.itemsize}")
    return jnp.asarray(
      rng.integers(0, 2 ** (8 * u.itemsize), a.shape, dtype=np.uint64).astype(u).view(a.dtype)
    )

  state = jax.tree.map(fill, state)
  hp = dict(state.hyperparams)
  hp["eps_root"] = np.asarray(1e-300, np.float64)  # float64 bits, whatever x64 says
  hp["learning_rate"] = jnp.asarray(1e-3)  # weak-typed
  inner = (state.inner_state[0]._replace(count=jnp.asarray(count, jnp.int32)),) + tuple(
    state.inner_state[1:]
  )
  state = state._replace(count=jnp.asarray(count, jnp.int32), hyperparams=hp, inner_state=inner)
  return jr.shard_state(opt, params, state, world)


def _entries(root: str) -> list[str]:
  """Every entry below ``root`` (relative, directories included), sorted."""
  out = []
  for d, dirs, files in os.walk(root):
    for name in dirs + files:
      out.append(os.path.relpath(os.path.join(d, name), root))
  return sorted(out)


def _uint(a: Any) -> np.ndarray:
  a = np.asarray(a)
  return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) and a.size else a


def _key(record: Any) -> tuple:
  """Everything of a record, bits included, as a comparable value."""
  leaves, tree = jax.tree_util.tree_flatten(record.state)
  data = []
  for x in leaves:
    weak = bool(getattr(x, "weak_type", False))
    a = np.asarray(x)
    data.append(
      (
        a.dtype.str,
        a.shape,
        weak,
        type(x).__name__ if np.ndim(x) == 0 else "",
        _uint(a).tobytes() if a.dtype != object else repr(a),
      )
    )
  return (
    record.version,
    record.placements,
    record.roles,
    str(tree),
    _shape_of_tree(record.state),
    tuple(data),
  )


def _shape_of_tree(node: Any) -> Any:
  """The tree's nodes with their classes, field names and keys (a treedef shows fewer)."""
  if isinstance(node, tuple) and hasattr(type(node), "_fields"):
    cls = type(node)
    return (
      "n",
      cls.__module__,
      cls.__qualname__,
      tuple(cls._fields),
      tuple(_shape_of_tree(c) for c in node),
    )
  if type(node) in (list, tuple):
    return (type(node).__name__, tuple(_shape_of_tree(c) for c in node))
  if type(node) is dict:
    return ("d", tuple((repr(k), _shape_of_tree(v)) for k, v in node.items()))
  return type(node).__name__


def _keys(records: list) -> list:
  return [_key(r) for r in records]


@dataclasses.dataclass
class Pristine:
  root: str  # a directory holding the checkpoints below
  path: str  # the checkpoint
  other: str  # a second save of the same records (another identity)
  xored: str  # a save of other records of the same layout
  entries: list[str]
  jsons: dict[str, Any]  # every JSON file, parsed (a "checksum" member included)
  records: list  # the records' keys (``_key``)
  loaded: list  # the records as load_records gives them
  memo: dict = dataclasses.field(default_factory=dict)  # the judge's results on the original
  restores: dict = dataclasses.field(default_factory=dict)
  needed: dict = dataclasses.field(default_factory=dict)
  cli: dict = dataclasses.field(default_factory=dict)

  def raw(self, entry: str) -> bytes:
    if ("raw", entry) not in self.memo:
      with open(os.path.join(self.path, entry), "rb") as f:
        self.memo[("raw", entry)] = f.read()
    return self.memo[("raw", entry)]

  def restore_key(self, rank: int, world: int):
    if (rank, world) not in self.restores:
      self.restores[(rank, world)] = _key(jr.restore(self.path, rank=rank, world_size=world))
    return self.restores[(rank, world)]

  def needed_by_restore(self, rank: int, world: int) -> set[str]:
    """The entries ``restore(rank, world)`` must read: the index, involved archives' files."""
    if (rank, world) not in self.needed:
      plan = _read_plan.read_plan(open_checkpoint(self.path), world_size=world, rank=rank)
      dtype = {
        p.param: np.dtype(p.dtype).name for p in self.records[0][1]
      }  # key: (version, placements, ...)
      out = {INDEX}
      for r in plan.reads:
        if r.bytes:
          a, d = ARCHIVES[r.archive], dtype[r.param]
          out |= {
            a,
            f"{a}/archive.json",
            f"{a}/{d}",
            f"{a}/{d}/zarr.json",
            f"{a}/{d}/c",
            f"{a}/{d}/c/0",
          }
      self.needed[(rank, world)] = out
    return self.needed[(rank, world)]


_PRISTINE: Pristine | None = None


def pristine() -> Pristine:
  global _PRISTINE
  if _PRISTINE is None:
    root = tempfile.mkdtemp(prefix="fz")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    records = fuzz_records()
    path = os.path.join(root, "orig")
    jr.save_records(path, records, chunk_bytes=CHUNK_BYTES)
    jr.save_records(os.path.join(root, "other"), records, chunk_bytes=CHUNK_BYTES)
    jr.save_records(os.path.join(root, "xored"), fuzz_records(seed=7), chunk_bytes=CHUNK_BYTES)
    entries = _entries(path)
    jsons = {}
    for e in entries:
      if e.endswith(".json"):
        with open(os.path.join(path, e), "rb") as f:
          jsons[e] = json.loads(f.read())
    loaded = jr.load_records(path)
    assert _keys(loaded) == _keys(records)
    _PRISTINE = Pristine(
      root,
      path,
      os.path.join(root, "other"),
      os.path.join(root, "xored"),
      entries,
      jsons,
      _keys(loaded),
      loaded,
    )
  return _PRISTINE


# --- signed JSON ----------------------------------------------------------------
#
# The scheme jaxreshard signs its own JSON files with (the index and each
# archive.json; zarr.json is not signed), implemented here independently of the
# library: body = the object without "checksum", compact, ASCII; the file is
# '{"checksum":"sha256:' + sha256(body) + '",' + body[1:].

_SIGNED = re.compile(rb'\{"checksum":"sha256:([0-9a-f]{64})",')


def signed_bytes(body: bytes) -> bytes:
  """``body`` (a non-empty JSON object's text, without "checksum") signed."""
  assert body.startswith(b"{") and body != b"{}", body[:20]
  return b'{"checksum":"sha256:' + hashlib.sha256(body).hexdigest().encode() + b'",' + body[1:]


def signature(raw: bytes) -> bool | None:
  """None: ``raw`` carries no signature; True: a valid one; False: one that does not match."""
  m = _SIGNED.match(raw)
  if not m:
    return None
  return hashlib.sha256(b"{" + raw[m.end() :]).hexdigest() == m.group(1).decode()


def is_signed(pr: Pristine, entry: str) -> bool:
  """Whether the original checkpoint signs this JSON file."""
  return entry.endswith(".json") and signature(pr.raw(entry)) is True


def unsigned_json(raw: bytes) -> Any:
  """A JSON file's object without its "checksum" member (the file as the writer meant it)."""
  d = json.loads(raw)
  if isinstance(d, dict):
    d.pop("checksum", None)
  return d


def write_json(path: str, obj: Any, sign: bool) -> None:
  """Writes ``obj`` compactly, signed if ``sign`` (regression tests re-sign their edits)."""
  body = _dumps({k: v for k, v in obj.items() if k != "checksum"} if sign else obj).encode()
  with open(path, "wb") as f:
    f.write(signed_bytes(body) if sign else body)


# --- mutations ------------------------------------------------------------------


class Raw:
  """JSON text spliced in verbatim (``1e400``, ``NaN``, deep nesting)."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self):
    t = self.text if len(self.text) < 60 else f"{self.text[:20]}...({len(self.text)} chars)"
    return f"Raw({t!r})"


def _dumps(obj: Any) -> str:
  raws: list[str] = []

  def sub(x):
    if isinstance(x, Raw):
      raws.append(x.text)
      return f"@@RAW{len(raws) - 1}@@"
    if isinstance(x, dict):
      return {k: sub(v) for k, v in x.items()}
    if isinstance(x, list):
      return [sub(v) for v in x]
    return x

  text = json.dumps(sub(obj), separators=(",", ":"))
  for i, r in enumerate(raws):
    text = text.replace(f'"@@RAW{i}@@"', r)
  return text


def _short(v: Any) -> str:
  r = repr(v)
  return r if len(r) <= 80 else f"{r[:40]}...({len(r)} chars)"


@dataclasses.dataclass
class Op:
  """One mutation; ``kind`` classifies what an honest reader must do with it."""

  def apply(self, ckpt: str, work: str) -> None:
    raise NotImplementedError

  # Entries (relative paths) whose content or kind this op changes.
  def touched(self) -> set[str]:
    return set()


@dataclasses.dataclass
class JsonEdit(Op):
  """One edit of a JSON file; ``resign``: sign the result again, as the writer signs.

  Re-signing applies only to a file that carries a valid "checksum" member before
  the edit, and never to an edit of that member itself or one that leaves no
  JSON object: a plain edit of a signed file must be refused, a re-signed one
  reaches the reader's other rules.
  """

  file: str
  path: tuple
  action: str  # set | delete | insert | dup | swap (value: the other list index)
  value: Any = None
  resign: bool = False

  def __repr__(self):
    return f"JsonEdit({self.file!r}, {self.path!r}, {self.action!r}, {_short(self.value)}" + (
      ", resign=True)" if self.resign else ")"
    )

  def apply(self, ckpt, work):
    p = os.path.join(ckpt, self.file)
    with open(p, "rb") as f:
      raw = f.read()
    data = json.loads(raw)
    checksum = data.get("checksum") if signature(raw) else None
    if not self.path and self.action == "set":
      data = self.value
    else:
      parent = data
      for k in self.path[:-1]:
        parent = parent[k]
      last = self.path[-1] if self.path else None
      node = parent[last] if self.path else data
      if self.action == "set":
        parent[last] = self.value
      elif self.action == "delete":
        del parent[last]
      elif self.action == "insert":  # into the node itself
        if isinstance(node, dict):
          node[self.value[0]] = self.value[1]
        elif isinstance(node, list):
          node.insert(min(self.value[0], len(node)), self.value[1])
      elif self.action == "dup":  # an element of a list twice
        parent.insert(last, json.loads(json.dumps(node)))
      elif self.action == "swap":  # two elements of a list
        other = self.value % len(parent)
        parent[last], parent[other] = parent[other], parent[last]
    if (
      self.resign
      and checksum is not None
      and isinstance(data, dict)
      and data.get("checksum") == checksum
      and len(data) > 1
    ):
      del data["checksum"]
      out = signed_bytes(_dumps(data).encode())
    else:
      out = _dumps(data).encode()
    with open(p, "wb") as f:
      f.write(out)

  def touched(self):
    return {self.file}


@dataclasses.dataclass
class Bytes(Op):
  file: str
  action: str  # flip | truncate | extend | overwrite
  offset: int = 0
  data: bytes = b""

  def __repr__(self):
    return f"Bytes({self.file!r}, {self.action!r}, {self.offset}, {_short(self.data)})"

  def apply(self, ckpt, work):
    p = os.path.join(ckpt, self.file)
    size = os.path.getsize(p)
    if self.action == "flip":
      with open(p, "r+b") as f:
        f.seek(self.offset % size)
        b = f.read(1)[0]
        f.seek(self.offset % size)
        f.write(bytes([b ^ (1 << (self.data[0] % 8))]))
    elif self.action == "truncate":
      os.truncate(p, self.offset % size)
    elif self.action == "extend":
      with open(p, "ab") as f:
        f.write(self.data)
    elif self.action == "overwrite":
      with open(p, "r+b") as f:
        f.seek(self.offset % size)
        f.write(self.data)

  def touched(self):
    return {self.file}


@dataclasses.dataclass
class Replace(Op):
  """An entry replaced by another kind of thing (its old content kept aside)."""

  entry: str
  by: str  # dir | empty | fifo | socket | chardev | symlink_out | symlink_in | dangling
  #          | hardlink_in | hardlink_out | remove
  sibling: str = ""

  def __repr__(self):
    return f"Replace({self.entry!r}, {self.by!r}" + (
      f", {self.sibling!r})" if self.sibling else ")"
    )

  def apply(self, ckpt, work):
    p = os.path.join(ckpt, self.entry)
    kept = os.path.join(work, "kept", self.entry.replace("/", "_"))
    os.makedirs(os.path.dirname(kept), exist_ok=True)
    shutil.move(p, kept)
    if self.by == "dir":
      os.mkdir(p)
    elif self.by == "empty":
      open(p, "w").close()
    elif self.by == "fifo":
      os.mkfifo(p)
    elif self.by == "socket":
      s = socket.socket(socket.AF_UNIX)
      try:
        s.bind(p)
      finally:
        s.close()
    elif self.by == "chardev":
      os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero: endless zeros
    elif self.by == "symlink_out":  # a canary: the very content, outside, atime reset
      canary = os.path.join(work, "canary", self.entry.replace("/", "_"))
      os.makedirs(os.path.dirname(canary), exist_ok=True)
      try:
        # Links inside it are copied as links: following one (an earlier op's link to
        # its own canary) would read that canary here, as if a reader had.
        if os.path.isdir(kept):
          shutil.copytree(kept, canary, symlinks=True)
        else:
          shutil.copy2(kept, canary)
      except BaseException:
        # Content that cannot be copied (an earlier op made a FIFO in it): no canary,
        # and none half-made whose fresh atimes would read as "followed a link".
        shutil.rmtree(canary, ignore_errors=True)
        shutil.move(kept, p)
        raise
      _reset_atimes(canary)
      os.symlink(canary, p)
    elif self.by == "symlink_in":
      os.symlink(os.path.relpath(os.path.join(ckpt, self.sibling), os.path.dirname(p)), p)
    elif self.by == "dangling":
      os.symlink(os.path.join(work, "nowhere"), p)
    elif self.by == "hardlink_in":
      os.link(os.path.join(ckpt, self.sibling), p)
    elif self.by == "hardlink_out":
      out = os.path.join(work, "hard", self.entry.replace("/", "_"))
      os.makedirs(os.path.dirname(out), exist_ok=True)
      shutil.copy2(kept, out)
      os.link(out, p)
    elif self.by == "remove":
      pass
    else:
      raise AssertionError(self.by)

  def touched(self):
    return {self.entry}


@dataclasses.dataclass
class Extra(Op):
  """Something added that the format does not have."""

  entry: str
  what: str  # file | dir | fifo | symlink_out | copy:<entry>

  def apply(self, ckpt, work):
    p = os.path.join(ckpt, self.entry)
    if os.path.lexists(p):
      return
    os.makedirs(os.path.dirname(p), exist_ok=True)
    if self.what == "file":
      with open(p, "wb") as f:
        f.write(b"{}")
    elif self.what == "dir":
      os.mkdir(p)
    elif self.what == "fifo":
      os.mkfifo(p)
    elif self.what == "symlink_out":
      canary = os.path.join(work, "canary", "extra_" + self.entry.replace("/", "_"))
      os.makedirs(os.path.dirname(canary), exist_ok=True)
      with open(canary, "wb") as f:
        f.write(b"{}")
      _reset_atimes(canary)
      os.symlink(canary, p)
    elif self.what.startswith("copy:"):
      src = os.path.join(ckpt, self.what[5:])
      if not _plain_tree(src) or (p + "/").startswith(src + "/"):
        return  # links or FIFOs inside, or a copy into itself
      (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, p)

  def touched(self):
    return set()  # the original entries are all still there


@dataclasses.dataclass
class Transplant(Op):
  """An entry replaced by the same entry of another archive or another save."""

  entry: str
  source: str  # other | xored | <archive name of this save>

  def apply(self, ckpt, work):
    p = os.path.join(ckpt, self.entry)
    pr = pristine()
    if self.source in ("other", "xored"):
      src = os.path.join(getattr(pr, self.source), self.entry)
    else:
      src = os.path.join(ckpt, self.source + self.entry[len(ARCHIVES[0]) :])
    if not _plain_tree(src) or not _plain_tree(p):
      return
    kept = os.path.join(work, "transplant")
    (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, kept)
    (shutil.rmtree if os.path.isdir(p) and not os.path.islink(p) else os.unlink)(p)
    shutil.move(kept, p)

  def touched(self):
    return {self.entry}


def through_link(ckpt: str, entry: str) -> bool:
  """Whether a directory above ``entry`` in ``ckpt`` is a symbolic link."""
  parts = entry.split("/")[:-1]
  return any(os.path.islink(os.path.join(ckpt, *parts[: i + 1])) for i in range(len(parts)))


def _is_regular_or_dir(path: str) -> bool:
  try:
    mode = os.lstat(path).st_mode
  except OSError:  # gone, or a parent is no directory any more
    return False
  return stat.S_ISREG(mode) or stat.S_ISDIR(mode)


def _plain_tree(path: str) -> bool:
  """Only regular files and directories at and below ``path`` (safe to copy)."""
  if not _is_regular_or_dir(path):
    return False
  return not os.path.isdir(path) or all(
    _is_regular_or_dir(os.path.join(path, e)) for e in _entries(path)
  )


def _reset_atimes(path: str) -> None:
  for p in [path] + (
    [os.path.join(path, e) for e in _entries(path)] if os.path.isdir(path) else []
  ):
    st_ = os.lstat(p)
    if stat.S_ISREG(st_.st_mode):
      os.utime(p, (0, st_.st_mtime), follow_symlinks=False)


def _read_canaries(work: str) -> list[str]:
  """Canary files (links' targets outside the checkpoint) that someone read."""
  root = os.path.join(work, "canary")
  if not os.path.isdir(root):
    return []
  hit = []
  for e in [""] + _entries(root):
    p = os.path.join(root, e)
    if os.path.isfile(p) and os.stat(p).st_atime > 0:
      hit.append(e)
  return hit


def _shard_regions(pr: Pristine, file: str) -> dict[str, list[int]]:
  """Byte offsets of each part of a shard file."""
  archive, dtype = file.split("/")[:2]
  b = pr.jsons[f"{archive}/archive.json"]["buffers"][dtype]
  n = -(-b["elements"] // b["chunk"])
  stride = b["chunk"] * np.dtype(jnp.dtype(dtype)).itemsize + 4
  data = [i * stride + k for i in range(n) for k in range(stride - 4)]
  crc = [i * stride + k for i in range(n) for k in range(stride - 4, stride)]
  index = list(range(n * stride, n * stride + 16 * n))
  icrc = list(range(n * stride + 16 * n, n * stride + 16 * n + 4))
  return {"chunk data": data, "chunk crc32c": crc, "shard index": index, "index crc32c": icrc}


# --- running one call -----------------------------------------------------------


class Finding(AssertionError):
  """A failure of the reader, with a short signature (for the known-bug list)."""

  def __init__(self, signature: str, detail: str):
    super().__init__(f"[{signature}] {detail}")
    self.signature = signature


class Hang(Finding):
  pass


@dataclasses.dataclass
class Outcome:
  value: Any = None
  error: BaseException | None = None
  peak: int = 0
  seconds: float = 0.0
  tb: str = ""

  @property
  def ok(self) -> bool:
    return self.error is None


def _unblock_fifos(root: str) -> None:
  for d, dirs, files in os.walk(root):
    for name in dirs + files:
      p = os.path.join(d, name)
      try:
        if stat.S_ISFIFO(os.lstat(p).st_mode):
          os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
      except OSError:
        pass


# Every call runs with the address space capped at what the process maps now plus
# this much: an allocation that a metadata bomb asks for fails at once with a
# MemoryError (a finding) instead of paging a shared machine to death.
ADDRESS_SPACE_HEADROOM = 3 << 30


def address_space_cap() -> Callable[[], None]:
  """Caps the address space; returns the function that lifts the cap again."""
  import resource  # pylint: disable=g-import-not-at-top

  soft, hard = resource.getrlimit(resource.RLIMIT_AS)
  with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  cap = mapped + ADDRESS_SPACE_HEADROOM
  if hard != resource.RLIM_INFINITY:
    cap = min(cap, hard)
  if soft != resource.RLIM_INFINITY:
    cap = min(cap, soft)
  resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
  return lambda: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_bounded(fn: Callable[[], Any], what: str, root: str) -> Outcome:
  """``fn()`` in a watchdog thread, its allocations traced; a hang is a failure."""
  import traceback  # pylint: disable=g-import-not-at-top

  out = Outcome()

  def body():
    try:
      out.value = fn()
    except BaseException as e:  # noqa: BLE001 - the caller judges whatever it is
      out.error = e
      out.tb = traceback.format_exc()

  tracemalloc.start()
  start = time.monotonic()
  worker = threading.Thread(target=body, daemon=True)
  lift = address_space_cap()
  try:
    worker.start()
    worker.join(PATIENCE_S)
    if worker.is_alive():
      _unblock_fifos(root)
      worker.join(5)
    if worker.is_alive():  # the cap stays on while it runs
      raise Hang(f"{what}: hang", f"{what}: still running after {PATIENCE_S} s")
    lift()
    _, out.peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  out.seconds = time.monotonic() - start
  if out.peak > MAX_TRACED_BYTES:
    raise Finding(
      f"{what}: memory", f"{what}: allocated {out.peak} bytes (more than {MAX_TRACED_BYTES})"
    )
  return out


def cli(*args: Any) -> tuple[Any, str, str]:
  """The console script in process: (exit code or the escaped exception, stdout, stderr)."""
  o, e = io.StringIO(), io.StringIO()
  code: Any = 0
  with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
    try:
      _cli.main([str(a) for a in args])
    except SystemExit as ex:
      code = ex.code if ex.code is not None else 0
    except BaseException as ex:  # noqa: BLE001 - a real console script would print a traceback
      code = ex
  return code, o.getvalue(), e.getvalue()
