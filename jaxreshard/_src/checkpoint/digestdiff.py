"""What differs between two digests, one line per difference (``verify``'s lines)."""

from __future__ import annotations

from typing import Any

from jaxreshard._src.checkpoint import values as _values
from jaxreshard._src.checkpoint.digest import Digest
from jaxreshard._src.errors import ReshardError

__all__ = ["compare_digests", "differences"]


def compare_digests(a: Digest, b: Digest, *, names: tuple[str, str] = ("a", "b")) -> list[str]:
  """Every difference between two digests, one line each; empty when identical.

  Each line names the parameter and buffer index (or the scalar path) that
  differs. Problems of either digest (nonzero padding, missing ranks) are
  differences too.

  Args:
    a: a :func:`digest`.
    b: another.
    names: what the lines call ``a`` and ``b``.

  Returns:
    The differences, sorted by kind then by scalar path or param id; ``[]``
    exactly when the two states are identical and neither has problems.

  Examples: see :func:`jaxreshard.digest`.
  """
  for what, d in (("a", a), ("b", b)):
    if not isinstance(d, Digest):
      raise ReshardError(f"compare_digests: {what} must be a Digest, got {type(d).__name__}")
  if not (
    isinstance(names, (tuple, list)) and len(names) == 2 and all(type(n) is str for n in names)
  ):
    raise ReshardError(f"compare_digests: names must be two strings, got {names!r}")
  return [text for _, _, text in differences(a, b, names=names)]


def _same_paths(a: Digest, b: Digest) -> bool:
  """Both hold the same param ids, each at the same key path."""
  return a.params.keys() == b.params.keys() and all(
    a.params[pid].path == b.params[pid].path for pid in a.params
  )


def differences(
  a: Digest, b: Digest, *, names: tuple[str, str] = ("a", "b")
) -> list[tuple[str, Any, str]]:
  """``compare_digests``' lines as ``(kind, key, line)``.

  kind and key: ``problem`` (None), ``structure`` (None), ``scalar`` (its
  path), ``param`` (its id) or ``buffer`` (``(param id, buffer index)``).
  """
  out: list[tuple[str, Any, str]] = [("problem", None, f"{names[0]}: {p}") for p in a.problems] + [
    ("problem", None, f"{names[1]}: {p}") for p in b.problems
  ]
  if a.structure != b.structure:
    out.append(("structure", None, "optimizer state structure differs"))
  elif a.trees != b.trees and _same_paths(a, b):
    # Containers that hold no param (empty nodes): no param's key path names them.
    ta, tb = dict(a.trees), dict(b.trees)
    for path in sorted(set(ta) | set(tb)):
      if ta.get(path) != tb.get(path):
        x, y = (t.get(path, "the nested dicts of its param ids") for t in (ta, tb))
        out.append(("structure", None, f"params tree at {path or '(the root)'}: {x} != {y}"))
  sa, sb = dict((p, v) for p, *v in a.scalars), dict((p, v) for p, *v in b.scalars)
  for path in sorted(set(sa) | set(sb)):
    if sa.get(path) != sb.get(path):
      out.append(("scalar", path, f"scalar {path}: {_scalars_text(sa.get(path), sb.get(path))}"))
  for pid in sorted(set(a.params) | set(b.params)):
    pa, pb = a.params.get(pid), b.params.get(pid)
    if pa is None or pb is None:
      out.append(("param", pid, f"param {pid!r}: only in {names[0] if pb is None else names[1]}"))
      continue
    if pa.path != pb.path:
      out.append(("param", pid, f"param {pid!r}: key path {pa.path} != {pb.path}"))
    for field in ("shape", "dtype", "trainable", "history"):
      if getattr(pa, field) != getattr(pb, field):
        out.append(
          ("param", pid, f"param {pid!r}: {field} {getattr(pa, field)} != {getattr(pb, field)}")
        )
    if len(pa.buffers) != len(pb.buffers):
      out.append(("param", pid, f"param {pid!r}: {len(pa.buffers)} buffers != {len(pb.buffers)}"))
    for m, (ba, bb) in enumerate(zip(pa.buffers, pb.buffers)):
      if ba != bb:
        what = "bits" if (ba.dtype, ba.count) == (bb.dtype, bb.count) else "dtype or size"
        out.append(
          (
            "buffer",
            (pid, m),
            f"param {pid!r} buffer {m}: {what} differ"
            f" ({ba.dtype}[{ba.count}] {ba.sha256[:12]} != {bb.dtype}[{bb.count}]"
            f" {bb.sha256[:12]})",
          )
        )
  return out


def _scalars_text(va: list | None, vb: list | None) -> str:
  """Two clock scalars that differ, as values (``8 != 12``); as bits when they cannot be read.

  A weakly typed scalar (how jax promotes it) reads as its value too, and which of
  the two is weak is said when that differs: ``0.1 (not weak) != 0.1 (weak)``.
  """
  if va is not None and vb is not None:
    (a, weak_a), (b, weak_b) = _decoded(va), _decoded(vb)
    if a is not None and b is not None:
      if weak_a == weak_b:
        return _values.pair_text(a, b) + (" (both weak)" if weak_a else "")
      same_type = (a.dtype, a.shape) == (b.dtype, b.shape)
      ta, tb = (
        f"{'' if same_type else _values.type_text(x) + ' '}{_values.value_text(x)}"
        f" ({'weak' if weak else 'not weak'})"
        for x, weak in ((a, weak_a), (b, weak_b))
      )
      return f"{ta} != {tb}"
  return f"{_scalar_text(va)} != {_scalar_text(vb)}"


_WEAK = " weak"


def _decoded(v: list) -> tuple[Any, bool]:
  """A digest's clock scalar ``(type text, hex of its bits)`` as its value (None when it
  cannot be read) and whether it is weakly typed (``float32() weak``)."""
  type_text, hexbits = v
  weak = type_text.endswith(_WEAK)
  if weak:
    type_text = type_text[: -len(_WEAK)]
  return _values.decode_scalar(type_text, hexbits), weak


def _scalar_text(v: list | None) -> str:
  if v is None:
    return "missing"
  a, weak = _decoded(v)
  if a is not None:
    return f"{a.dtype.name} {_values.value_text(a)}{' (weak)' if weak else ''}"
  hexbits = v[1]
  if len(hexbits) > 4 * _values.CLOCK_ELEMENTS_SHOWN:  # a long array: its first bytes and its size
    hexbits = f"{hexbits[: 4 * _values.CLOCK_ELEMENTS_SHOWN]}... ({len(v[1]) // 2} bytes)"
  return f"{v[0]} 0x{hexbits}"
