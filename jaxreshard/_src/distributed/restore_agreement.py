"""The processes of a restore onto devices of several processes read one checkpoint.

Each process reads the ranks (or the shards) of its own devices and makes its part
of global arrays; no byte passes between processes. Processes that opened two
checkpoints (a step number read at two moments, a stale copy of the run directory
on one host) would make arrays whose parts are of two saves, and a clock that
differs between processes. So before any byte is read, every process whose devices
the restore places on tells the others, through the ``jax.distributed`` key-value
store, the identity of the state it opened (or why it refused the restore: its
arguments, or a checkpoint it could not open), and every process compares: one
identity, or an error in every process.

The processes meet under the set of them and how many such restores each made
before: every process restores onto those devices in the same order (from one
thread), as it calls any collective. Every restore that knows its devices counts,
whatever it then refuses of its arguments or checkpoint, so that such a refusal
never leaves a process a restore behind the others; a process that raises before
(orbax refusing a step) and goes on, while the others did not, is one behind.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.distributed import kvstore as _kv
from jaxreshard._src.errors import ArchiveError, PlacementError

__all__ = [
  "devices_of_target",
  "done_everywhere",
  "mesh_words",
  "opened_everywhere",
  "processes_of",
  "restore_devices",
  "target_words",
]

_KEY = "jaxreshard/restore"
# A process that is not at the restore by then (it failed before it, or hangs) is
# named; the others fail instead of waiting for good. Long: a slow peer (still
# loading its data) is waited for, as a collective waits.
TIMEOUT_S = 1800.0
_GRACE_S = 60.0  # how much longer the others wait for the first process's verdict
_COUNTS: collections.Counter = collections.Counter()
_LOCK = threading.Lock()


def processes_of(devices: Iterable[Any]) -> tuple[int, ...]:
  """The processes whose devices are among ``devices``, sorted."""
  return tuple(sorted({d.process_index for d in devices}))


def restore_devices(mesh: Any, target: Any) -> Iterable[Any]:
  """The devices a restore places on: a target's (when given), else the mesh's; none
  where neither says (the restore refuses such arguments itself)."""
  if target is not None:
    return devices_of_target(target)
  devices = getattr(mesh, "devices", None)
  return devices.flat if isinstance(devices, np.ndarray) else ()


def mesh_words(mesh: Any, axis: Any) -> Any:
  """What every process of a restore onto ``mesh`` along ``axis`` must pass alike:
  a digest of its axes, shape, devices in order and the axis (a few bytes in the
  store whatever the number of devices)."""
  devices = getattr(mesh, "devices", None)
  if not isinstance(devices, np.ndarray):
    return None
  names = [str(n) for n in getattr(mesh, "axis_names", ())]
  words = repr((names, devices.shape, [d.id for d in devices.flat], str(axis)))
  return hashlib.sha256(words.encode()).hexdigest()[:32]


def target_words(target: Any) -> str:
  """What every process of a restore onto ``target`` must pass alike: a digest of
  each leaf's shape, dtype and layout (which device holds which block, in the
  sharding's device order), a few bytes in the store whatever the size of the tree.

  Each process builds its part of every global array from its own target: targets
  whose shardings differ (another device order, another mesh shape or partition)
  make parts of different arrays, which no later collective can put together.
  """
  digest = hashlib.sha256()
  meshes: dict[int, str] = {}
  try:
    for leaf in jax.tree.leaves(target):
      sharding = getattr(leaf, "sharding", None)
      shape = tuple(getattr(leaf, "shape", ()))
      digest.update(repr((shape, str(getattr(leaf, "dtype", None)))).encode())
      digest.update(_layout_words(sharding, shape, meshes).encode())
  except Exception as e:  # a target the restore refuses (in every process) when it checks it
    return f"target not readable ({type(e).__name__})"
  return "target " + digest.hexdigest()[:32]


def _layout_words(sharding: Any, shape: tuple, meshes: dict[int, str]) -> str:
  """A sharding's layout of ``shape``: a named sharding's mesh (its axes, shape and
  devices in order, once per mesh) and partition; any other's block of each device."""
  if sharding is None:
    return "none"
  mesh = getattr(sharding, "mesh", None)
  devices = getattr(mesh, "devices", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(devices, np.ndarray):
    words = meshes.get(id(mesh))
    if words is None:  # once per mesh, however many devices it has
      words = meshes[id(mesh)] = mesh_words(mesh, None)
    kind = getattr(sharding, "memory_kind", None)
    return repr((words, str(sharding.spec), kind))
  try:
    blocks = sharding.devices_indices_map(shape)
  except Exception:  # a sharding that cannot say: its own words
    return repr(sharding)
  return repr(sorted((d.id, repr(i)) for d, i in blocks.items()))


def devices_of_target(target: Any) -> Iterable[Any]:
  """The devices a target's leaves are laid out on (leaves without a sharding, which
  the restore refuses later, add none)."""
  for leaf in jax.tree.leaves(target):
    yield from getattr(getattr(leaf, "sharding", None), "device_set", ())


def _client(processes: tuple[int, ...]) -> Any:
  """The ``jax.distributed`` client, where the restore spans several processes."""
  if len(processes) < 2 or jax.process_index() not in processes:
    return None  # one process, or none of the restore's devices here: nothing to agree
  return _kv.client()


def _text(words: str) -> str:
  """``words`` as the key-value store takes them, cut to 2,000 characters."""
  return _kv.text(words)[:2000]


def opened_everywhere(
  processes: tuple[int, ...], open_it: Callable[[], Any], directory: Any, where: Any = None
) -> Any:
  """``open_it()`` (the checkpoint, or a tuple whose first element it is), once every
  one of ``processes`` opened one of the same state. Everything a process may refuse
  before it reads a byte runs inside ``open_it``, so that its refusal reaches the
  others and every process counts this restore. ``where`` (JSON-able: the mesh's
  axes and devices, say) must be the same in every process too.

  Every process sets its word (the state it opened, or why it refused); the
  first of ``processes`` reads every other's as it comes and sets the verdict,
  which the others wait for: a number of requests to the store linear in the
  processes, each answered when its key is set.

  Raises:
    PlacementError: processes opened checkpoints of two states.
    ArchiveError: another process refused the restore (its error: its arguments,
      or a checkpoint it could not open), or a process was not at this restore
      within ``TIMEOUT_S``.
    whatever ``open_it`` raises, in this process (the others are told).
  """
  client = _client(processes)
  if client is None:
    return open_it()
  with _LOCK:
    n = _COUNTS[processes]
    _COUNTS[processes] += 1
  prefix = f"{_KEY}/{'-'.join(map(str, processes))}/{n}/"
  me, leader = jax.process_index(), processes[0]
  deadline = time.monotonic() + TIMEOUT_S
  try:
    opened = open_it()
  except BaseException as e:
    word = _text(f"failed: {type(e).__name__}: {e}")
    _tell(client, prefix, {str(me): word, "verdict": _verdict({me: word}, directory)}, me, leader)
    raise
  ckpt = opened[0] if isinstance(opened, tuple) else opened
  # JSON's ASCII escapes keep any path whole; a long one is shown cut (words only).
  shown = str(directory) if len(str(directory)) <= 300 else f"{str(directory)[:280]}..."
  mine = {"state": _reader.state_id(ckpt), "path": shown, "where": where}
  word = "ok " + json.dumps(mine)
  client.key_value_set(prefix + str(me), word)
  if me == leader:
    words = {me: word}
    try:
      for p in processes[1:]:
        words[p] = _get(client, prefix + str(p), deadline, directory, [p], TIMEOUT_S)
        if words[p].startswith("failed: "):
          break  # named at once; the others need not be waited for
    except BaseException as e:  # told to the others (an interrupt too), who wait for it
      why = str(e) if isinstance(e, ArchiveError) else f"{directory}: process {me} stopped"
      _tell(client, prefix, {"verdict": f"ArchiveError: {why}"}, me, leader)
      raise
    verdict = _text(_verdict(words, directory))
    client.key_value_set(prefix + "verdict", verdict)
  else:
    # Past the first process's own wait: its verdict names whoever did not come.
    verdict = _get(
      client, prefix + "verdict", deadline + _GRACE_S, directory, [leader], TIMEOUT_S + _GRACE_S
    )
  if verdict != "ok":
    cls, _, words = verdict.partition(": ")
    raise (PlacementError if cls == "PlacementError" else ArchiveError)(words)
  return opened


def done_everywhere(processes: tuple[int, ...], build: Callable[[], Any], directory: Any) -> Any:
  """``build()`` (the reads and checks of this process's part of the restore), once
  every one of ``processes`` built its part. What a process refuses while it reads
  (a chunk that fails its checksum, padding that is not zero, a target its data
  does not match) is then refused in every process: the others raise naming it,
  and no process hands back part of a state another process refused. Called after
  :func:`opened_everywhere` of the same restore, in the same order everywhere.

  Raises:
    ArchiveError: another process refused its part (named, with its error), or
      was not done within ``TIMEOUT_S``.
    whatever ``build`` raises, in this process (the others are told).
  """
  client = _client(processes)
  if client is None:
    return build()
  with _LOCK:
    n = _COUNTS[("done", processes)]
    _COUNTS[("done", processes)] += 1
  prefix = f"{_KEY}/{'-'.join(map(str, processes))}/done/{n}/"
  me, leader = jax.process_index(), processes[0]
  deadline = time.monotonic() + TIMEOUT_S

  def refused(p: int, word: str) -> str:
    return f"{directory}: process {p} refused its part of this restore ({word[8:]})"

  try:
    built = build()
  except BaseException as e:
    word = _text(f"failed: {type(e).__name__}: {e}")
    _tell(client, prefix, {str(me): word, "verdict": refused(me, word)}, me, leader)
    raise
  client.key_value_set(prefix + str(me), "ok")
  if me == leader:
    verdict = "ok"
    try:
      for p in processes[1:]:
        word = _get(client, prefix + str(p), deadline, directory, [p], TIMEOUT_S)
        if word != "ok":
          verdict = refused(p, word)
          break
    except BaseException as e:  # told to the others, who wait for it
      why = str(e) if isinstance(e, ArchiveError) else f"{directory}: process {me} stopped"
      _tell(client, prefix, {"verdict": why}, me, leader)
      raise
    client.key_value_set(prefix + "verdict", _text(verdict))
  else:
    verdict = _get(
      client, prefix + "verdict", deadline + _GRACE_S, directory, [leader], TIMEOUT_S + _GRACE_S
    )
  if verdict != "ok":
    raise ArchiveError(verdict)
  return built


def _tell(client: Any, prefix: str, words: dict[str, str], me: int, leader: int) -> None:
  """Sets ``words`` (this process's word, the verdict) under ``prefix``, so that the
  others stop waiting for this process; only the first process sets the verdict. A
  store that cannot be reached any more leaves them to their timeout."""
  try:
    for key, word in words.items():
      if key != "verdict" or me == leader:
        client.key_value_set(prefix + key, _text(word))
  except Exception:  # pylint: disable=broad-exception-caught
    pass


def _get(
  client: Any, key: str, deadline: float, directory: Any, who: list[int], waited_s: float
) -> str:
  """The value of ``key`` once set; past ``deadline``, an ArchiveError naming ``who``
  (not come after ``waited_s``)."""
  left_ms = max(1, int((deadline - time.monotonic()) * 1000))
  try:
    return client.blocking_key_value_get(key, left_ms)
  except Exception as e:  # pylint: disable=broad-exception-caught
    if "DEADLINE_EXCEEDED" not in str(e) and time.monotonic() < deadline:
      raise
    raise ArchiveError(
      f"{directory}: processes {who} did not come to this restore within {waited_s:g} s"
    ) from None


def _verdict(words: dict[int, str], directory: Any) -> str:
  """The restore's verdict from the processes' words: "ok", or a refusal as
  ``Class: words``."""
  for p, word in sorted(words.items()):
    if word.startswith("failed: "):
      why = word[len("failed: ") :]
      return f"ArchiveError: {directory}: process {p} refused this restore ({why})"
  opened = {p: json.loads(word[len("ok ") :]) for p, word in words.items()}
  first = min(opened)
  for p in sorted(opened):
    if opened[p].get("where") != opened[first].get("where"):
      if any(str(opened[q].get("where")).startswith("target") for q in (p, first)):
        return (
          f"PlacementError: {directory}: process {p} restores onto another target than"
          f" process {first} (a leaf's shape, dtype, devices, their order, the mesh or"
          " the partition differ); every process passes the same target"
        )
      return (
        f"PlacementError: {directory}: process {p} restores onto another mesh (its devices,"
        f" their order, its axes, or the axis) than process {first}; every process"
        " restores onto the same"
      )
    if opened[p]["state"] != opened[first]["state"]:
      a, b = opened[first], opened[p]
      return (
        "PlacementError: the processes of this restore opened checkpoints of two saves:"
        f" process {first} {a['path']} (checkpoint {a['state']}), process {p} {b['path']}"
        f" (checkpoint {b['state']}); every process restores the same checkpoint"
      )
  return "ok"
