"""How a clock scalar (step count, injected hyper-parameter) is handed back.

One rule for every read path (the host restore, the mesh paths, a target
sharding): a Python number stays a Python number (it has no dtype to keep and
no placement), a value whose dtype jax cannot hold (``float64``, ``int64`` and
``uint64`` while ``jax_enable_x64`` is off) stays a numpy value with every bit,
and anything else becomes a jax array. jax would silently cut a 64-bit value
to 32 bits (``2**40 + 3`` to ``3``, a float64 NaN payload to another one).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxreshard._src.core import structure as _structure
from jaxreshard._src.errors import PlacementError

__all__ = [
  "CLOCK_DTYPES",
  "KEY_IMPLS",
  "MAX_CLOCK_BYTES",
  "WeakHostScalar",
  "check_storable",
  "clock_names",
  "is_key",
  "is_key_dtype",
  "unstorable",
  "is_python_number",
  "is_weak",
  "keep_weak",
  "python_dtype",
  "stays_on_host",
]

try:  # jax's own conversion that can set an array's weak type (not exported by jax.lax)
  from jax._src.lax.lax import _convert_element_type as _convert_weak
except ImportError:  # pragma: no cover - another jax layout: scalars come back strong
  _convert_weak = None


def is_python_number(x: Any) -> bool:
  """A plain Python ``bool``/``int``/``float``/``complex`` (not a numpy scalar)."""
  return isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic)


def is_weak(x: Any) -> bool:
  """Whether jax promotes ``x`` as weakly typed: a Python ``int``, ``float`` or
  ``complex`` (``jnp.asarray(3).weak_type`` is True; a ``bool`` is not weak), or an
  array that says it is (``weak_type``, as jax's and ``WeakHostScalar`` do).

  Examples:
    >>> import numpy as np, jax.numpy as jnp
    >>> is_weak(3), is_weak(0.1), is_weak(True), is_weak(np.int64(3))
    (True, True, False, False)
    >>> is_weak(jnp.asarray(3)) == jnp.asarray(3).weak_type == True
    True
  """
  if is_python_number(x):
    return not isinstance(x, bool)
  return bool(getattr(x, "weak_type", False))


def python_dtype(x: Any) -> np.dtype:
  """The dtype jax gives a Python number (``int`` is int32 while x64 is off), any value."""
  return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(type(x))))


def stays_on_host(x: Any) -> bool:
  """Whether a clock scalar is handed back as it is rather than as a jax array.

  Examples:
    >>> import numpy as np
    >>> stays_on_host(3), stays_on_host(np.float32(1.0))
    (True, False)
    >>> import jax
    >>> stays_on_host(np.int64(2**40 + 3)) == (not jax.config.jax_enable_x64)
    True
  """
  if is_python_number(x):
    return True
  dtype = getattr(x, "dtype", None)
  if dtype is None or is_key_dtype(dtype):
    return False
  return np.dtype(jax.dtypes.canonicalize_dtype(dtype)) != np.dtype(dtype)


# --- what a checkpoint's clock can hold ---------------------------------------------
#
# The dtypes, size bound and PRNG key implementations of a clock scalar the
# checkpoint format stores exactly. Every path applies this one rule: a save
# refuses any other clock leaf, and so does taking records apart in memory, so
# that no state a reshard accepts is refused at its first checkpoint.
CLOCK_DTYPES = (
  "bool",
  "int8",
  "int16",
  "int32",
  "int64",
  "uint8",
  "uint16",
  "uint32",
  "uint64",
  "float16",
  "bfloat16",
  "float32",
  "float64",
)
MAX_CLOCK_BYTES = 1 << 16  # clock scalars are tiny; anything larger is not a clock
KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
_INT64 = (-(2**63), 2**63)


def unstorable(x: Any) -> str | None:
  """Why a checkpoint's clock cannot hold ``x`` ("a complex64 leaf of shape () as a
  scalar"), or None when it can.

  A Python bool, float, or int within int64; a typed PRNG key of one of
  :data:`KEY_IMPLS`; an array or scalar of one of :data:`CLOCK_DTYPES` of at
  most :data:`MAX_CLOCK_BYTES`. Nothing is copied to look (a jax array stays
  where it is).

  Examples:
    >>> import numpy as np
    >>> unstorable(3) is None, unstorable(np.float32(1.0)) is None
    (True, True)
    >>> unstorable(np.complex64(1j))
    'a complex64 leaf of shape () as a scalar'
    >>> unstorable(2**64)
    'the Python int 18446744073709551616 (outside int64)'
  """
  if is_python_number(x) and not isinstance(x, complex):
    if type(x) not in (bool, int, float):  # an IntEnum: read back, it would be an int
      return f"a Python {type(x).__name__} (a subclass of {type(x).__mro__[1].__name__})"
    if type(x) is int and not _INT64[0] <= x < _INT64[1]:
      return f"the Python int {x} (outside int64)"
    return None
  dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
  if dtype is None or shape is None:
    a = np.asarray(x)
    dtype, shape = a.dtype, a.shape
  try:
    key, itemsize = _dtype_rule(dtype)
  except TypeError:  # a ``dtype`` attribute that is no dtype: what numpy makes of it
    a = np.asarray(x)
    (key, itemsize), dtype, shape = _dtype_rule(a.dtype), a.dtype, a.shape
  if key:
    impl = str(jax.random.key_impl(x))
    return None if impl in KEY_IMPLS else f"a PRNG key of implementation {impl!r}"
  if itemsize is None or itemsize * math.prod(map(int, shape)) > MAX_CLOCK_BYTES:
    return f"a {np.dtype(dtype)} leaf of shape {tuple(shape)} as a scalar"
  return None


@functools.lru_cache(maxsize=256)
def _dtype_rule(dtype: Any) -> tuple[bool, int | None]:
  """(whether ``dtype`` is a typed PRNG key's, its item size when a clock may hold it):
  asked once per dtype, as jax's and numpy's dtype look-ups cost microseconds."""
  if is_key_dtype(dtype):
    return True, None
  dtype = np.dtype(dtype)
  return False, dtype.itemsize if dtype.name in CLOCK_DTYPES else None


def check_storable(index: int, state_parts: _structure.StateParts) -> None:
  """Refuses an archive with a clock scalar a checkpoint cannot hold (:func:`unstorable`),
  naming it by its key path: memory takes no state that a save would refuse.

  Raises:
    PlacementError: the first such scalar, in the state's order.
  """
  for k, (_, x) in enumerate(state_parts.scalars):
    why = unstorable(x)
    if why is not None:
      is_scalar = [
        not isinstance(y, _structure.ParamsSubtreeSlot) for y in state_parts.skeleton_leaves
      ]
      path = _structure.clock_paths(state_parts.skeleton, is_scalar)[k]
      raise PlacementError(
        f"archive {index}, clock scalar {path}: cannot store {why}; no checkpoint can"
        " hold this state, so it is refused in memory too"
      )


class WeakHostScalar(np.ndarray):
  """A weakly typed 64-bit clock scalar kept on the host while x64 is off (jax would
  cut it to 32 bits): a numpy array that says it is weak, as the jax scalar it
  stands for did, so that a save (the CLI's conversions, run without x64) writes
  it back weak, as it was read.

  Examples:
    >>> x = np.asarray(2**40 + 3, np.int64).view(WeakHostScalar)
    >>> x.weak_type, int(x)
    (True, 1099511627779)
  """

  weak_type = True


def keep_weak(x: Any, like: Any) -> Any:
  """``x`` (a global array made from ``like``'s value) weakly typed when ``like`` is.

  A global array assembled from per-device pieces is strongly typed, while the
  scalar it holds may have been weak (``jnp.asarray(1e-3)``): kept weak, a
  restored learning rate times a bfloat16 gradient stays bfloat16, as it was
  before the restart.
  """
  if _convert_weak is None or not getattr(like, "weak_type", False) or x.weak_type:
    return x
  return _convert_weak(x, x.dtype, weak_type=True)


# --- the one rule for whether two archives are of one step -----------------------


def _origin(cls: type) -> str:
  if cls.__module__.startswith("jaxreshard."):
    return "the one a checkpoint's reader made"
  return f"{cls.__module__}.{cls.__qualname__}"


def _classes_differ(ta: Any, tb: Any) -> str:
  """For two tree structures that print alike: the first two node classes of one name
  that are not one class (a NamedTuple outside optax, which a checkpoint re-creates as
  a new class of its name and fields), in words; '' when they print otherwise."""
  if str(ta) != str(tb):
    return ""
  pending = [(ta, tb)]
  while pending:
    x, y = pending.pop()
    (cx, _), (cy, _) = x.node_data() or (None, None), y.node_data() or (None, None)
    if cx is not cy and cx is not None and cy is not None:
      return (
        f" (alike in print, but two classes named {cx.__name__}: {_origin(cx)} and"
        f" {_origin(cy)}; a checkpoint re-creates a NamedTuple class from outside optax"
        " as a new class of its name and fields, so its states combine only with states"
        " loaded from a checkpoint)"
      )
    pending.extend(zip(x.children(), y.children()))
  return ""


def clock_mismatch(src: Any, a: int, b: int, pid: str | None = None) -> str:
  """Words the refusal of archives ``a`` and ``b``, whose optimizer clocks differ."""
  name = f"param {pid!r}: " if pid is not None else ""
  sa, sb = src.skeleton(a), src.skeleton(b)
  xa, xb = src.scalars(a), src.scalars(b)
  where = clock_difference(clock_key(sa, xa), clock_key(sb, xb))
  if where == STRUCTURE:
    return (
      f"{name}archive {a} has optimizer state structure {sa[0]} but archive"
      f" {b} has {sb[0]}{_classes_differ(sa[0], sb[0])}; these archives are not one checkpoint"
    )
  if where is not None and where < min(len(xa), len(xb)):
    path = _structure.clock_paths(sa[0], [slot is None for slot in sa[1]])[where]
    va, vb = plain(xa[where]), plain(xb[where])
    shown_a, shown_b = _shown(xa[where], va), _shown(xb[where], vb)
    if shown_a == shown_b and va.tobytes() != vb.tobytes():
      # printed alike, other bits (a NaN's payload): show the bytes
      shown_a += f" (bytes {va.tobytes().hex()})"
      shown_b += f" (bytes {vb.tobytes().hex()})"
    if shown_a == shown_b:  # the same bits, one of them weakly typed
      shown_a += " (weak)" if is_weak(xa[where]) else " (not weak)"
      shown_b += " (weak)" if is_weak(xb[where]) else " (not weak)"
    return (
      f"{name}archive {a} has clock scalar {path} = {shown_a} but archive"
      f" {b} has {shown_b}; these archives are not one checkpoint"
    )
  return f"{name}archives {a} and {b} have different optimizer clocks; not one checkpoint"


def _shown(x: Any, value: np.ndarray) -> str:
  """A clock scalar in a refusal: its value (``value``, its ``plain`` form); a PRNG
  key's with its implementation, as keys of two implementations can hold the same
  key data."""
  if is_key(x):
    impl = str(jax.random.key_impl(x))
    return f"a PRNG key of implementation {impl!r} with key data {value!r}"
  return repr(value)


STRUCTURE = -1  # what ``clock_difference`` answers when the state structures differ


def clock_key(skeleton: Any, scalars: Sequence[Any]) -> tuple[Any, ...]:
  """What must agree for two archives to be of one step: structure, every clock leaf's bits."""
  return (skeleton, tuple(scalar_bits(x) for x in scalars))


def clock_difference(a: tuple[Any, ...], b: tuple[Any, ...]) -> int | None:
  """The one comparison of two :func:`clock_key`: ``None``, ``STRUCTURE`` or a scalar's index."""
  if a[0] != b[0]:
    return STRUCTURE
  for i, (x, y) in enumerate(zip(a[1], b[1])):
    if x != y:
      return i
  return None if len(a[1]) == len(b[1]) else min(len(a[1]), len(b[1]))


def is_key_dtype(dtype: Any) -> bool:
  """Whether ``dtype`` is a typed PRNG key's (``key<fry>``)."""
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_key(x: Any) -> bool:
  """Whether ``x`` is a typed PRNG key array (``noisy_sgd``'s, ``jax.random.key``)."""
  return is_key_dtype(getattr(x, "dtype", None))


def plain(x: Any) -> Any:
  """A clock leaf as numpy; typed PRNG keys (``noisy_sgd``) as their key data."""
  if is_key(x):
    return np.asarray(jax.random.key_data(x))
  return np.asarray(x)


def scalar_bits(x: Any) -> tuple[Any, ...]:
  """What must agree for two clock scalars to be the same: dtype, shape, bytes and
  weak type (how jax promotes it: the digest and ``verify`` tell weak from strong)."""
  a = plain(x)
  weak = is_weak(x)
  return (str(getattr(x, "dtype", a.dtype)), a.dtype.str, a.shape, a.tobytes(), weak)


class ClockClasses:
  """Numbers the optimizer clocks of one source set, archive by archive.

  This is the one rule for whether two archives are of one step of one
  optimizer, whatever holds them (records in memory, a checkpoint's index):
  their states have one structure, with every params subtree in the same place
  (:func:`skeleton_key`), and bit-identical clock scalars (:func:`scalar_bits`).
  Archives share a class exactly when they agree on both.
  """

  def __init__(self):
    self._classes: dict[tuple[Any, ...], int] = {}
    self._memo: dict[Any, int] = {}

  def of(self, src: Any, archive: int, memo: Any = None) -> int:
    """The class of ``src``'s archive ``archive`` (read with ``src.skeleton``/``src.scalars``).

    ``memo`` (default: the archive) names what the class depends on, when
    archives share it (a checkpoint's archives of one layout and one clock).
    """
    m = archive if memo is None else memo
    c = self._memo.get(m)
    if c is None:
      key = clock_key(src.skeleton(archive), src.scalars(archive))
      c = self._memo[m] = self._classes.setdefault(key, len(self._classes))
    return c


def clock_names(state: Any, paths: Sequence[str]) -> list[str]:
  """Each clock scalar's name with the optax state classes on its way, for people.

  ``paths`` are key paths (``[0].count``, the name every message uses) into
  ``state``. Along each path a NamedTuple's field reads ``ScaleByAdamState.count``,
  an element of a plain tuple (``optax.chain``'s state) ``chain[0]``, and a
  dict key or list index as in the key path; so ``[0].count`` of an AdamW
  state reads ``chain[0] ScaleByAdamState.count``. A path not found in the
  state is returned unchanged.
  """
  by_text = {jax.tree_util.keystr(p): p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
  return [_name(state, by_text[p]) if p in by_text else p for p in paths]


def _name(state: Any, path: Sequence[Any]) -> str:
  out, node = "", state
  for k in path:
    if isinstance(k, jax.tree_util.GetAttrKey) and hasattr(type(node), "_fields"):
      piece, node = f" {type(node).__name__}.{k.name}", getattr(node, k.name)
    elif isinstance(k, jax.tree_util.SequenceKey) and type(node) is tuple:
      piece, node = f" chain[{k.idx}]", node[k.idx]
    else:
      piece = jax.tree_util.keystr((k,))
      try:
        node = node[k.idx] if isinstance(k, jax.tree_util.SequenceKey) else node[k.key]
      except (AttributeError, KeyError, IndexError, TypeError):
        node = None
    out += piece
  return out.strip()
