"""The compiled block copy against an independent oracle, bit for bit, and its refusals.

The oracle is the rule itself, in plain numpy: a block's rows concatenated are
its flat elements, and target row ``r`` holds flat elements ``[lo + r * ts,
lo + (r + 1) * ts)`` clipped to ``hi``.
"""

from __future__ import annotations

import importlib.machinery
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxreshard._src.exec import native

needs_library = pytest.mark.skipif(not native.available(), reason="built without a C compiler")

UINTS = [np.uint8, np.uint16, np.uint32, np.uint64]


def _cc() -> list[str]:
  """The command line of the C compiler the package is built with."""
  return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def _compiler() -> str | None:
  """The C compiler the package is built with, where one is found."""
  cc = _cc()
  return shutil.which(cc[0]) if cc else None


@pytest.mark.skipif(os.environ.get("JAXRESHARD_NATIVE") == "0", reason="turned off")
@pytest.mark.skipif(_compiler() is None, reason="no C compiler to build it with")
def test_the_library_is_built_where_a_compiler_is():
  """An install on a machine with a C compiler builds and loads the block copy, of
  the version this package calls."""
  assert native.available()


@needs_library
def test_a_library_of_another_version_is_not_loaded(monkeypatch, capsys):
  """A library built from another ``_blockcopy.c`` (an editable install not
  installed again) is left alone, with a line on stderr: numpy copies."""
  monkeypatch.setattr(native, "VERSION", native.VERSION + 1)
  assert native._load() is None
  assert "another version of _blockcopy.c" in capsys.readouterr().err


_OLD_LIBRARY = """
#include <stdint.h>
int jaxreshard_blockcopy_version(void) { return 4; }
int jaxreshard_copy_blocks(void) { return -1; }
int jaxreshard_gather_tile(void) { return -1; }
int64_t jaxreshard_check_chunks(void) { return -1; }
int jaxreshard_any_nonzero_runs(void) { return -1; }
"""


@pytest.mark.skipif(os.environ.get("JAXRESHARD_NATIVE") == "0", reason="turned off")
@pytest.mark.skipif(_compiler() is None, reason="no C compiler")
def test_a_library_built_before_a_function_was_added_is_named_as_another_version(tmp_path, capsys):
  """A library left by an older build lacks the newer functions: it is refused for
  its version, with the line saying to install the package again."""
  source = tmp_path / "old.c"
  source.write_text(_OLD_LIBRARY)
  cc = _cc()
  suffix = next(s for s in importlib.machinery.EXTENSION_SUFFIXES if s.endswith(".so"))
  subprocess.run(
    [*cc, "-shared", "-fPIC", "-o", str(tmp_path / f"_blockcopy{suffix}"), str(source)], check=True
  )
  assert native._load(str(tmp_path)) is None
  err = capsys.readouterr().err
  assert "another version of _blockcopy.c (4," in err and "installed again" in err


@pytest.mark.skipif(_compiler() is None, reason="no C compiler")
def test_the_library_compiles_as_strict_c99():
  """Every function the library calls is declared under ``-std=c99`` too (an
  undeclared one fails newer compilers, and the optional build then leaves the
  library out without a word)."""
  cc = _cc()
  source = os.path.join(os.path.dirname(native.__file__), "_blockcopy.c")
  flags = ["-std=c99", "-Werror=implicit-function-declaration", "-fsyntax-only"]
  subprocess.run([*cc, *flags, source], check=True)


def test_the_environment_turns_it_off():
  """``JAXRESHARD_NATIVE=0`` before the import: numpy alone copies."""
  code = "from jaxreshard._src.exec import native; print(native.available(), native.enabled)"
  env = {**os.environ, "JAXRESHARD_NATIVE": "0"}
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
  )
  assert out.stdout.split() == ["False", "False"]


def _oracle(src, shape, table):
  """The target rows by the rule, block by block, in plain numpy."""
  out = np.zeros(shape, src.dtype)
  for so, ss, to, ts, lo, hi in zip(*(c.tolist() for c in table)):
    flat = src[:, so : so + ss].reshape(-1)
    for r in range(shape[0]):
      piece = flat[lo + r * ts : min(lo + (r + 1) * ts, hi)]
      out[r, to : to + len(piece)] = piece
  return out


@st.composite
def _layouts(draw):
  """Blocks side by side in target rows (anywhere in source rows), each with a flat
  range that the rows hold; source rows may be a strided view of wider rows."""
  n = draw(st.integers(1, 6))
  ss = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
  ts = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
  src_rows = draw(st.integers(1, 9))
  out_rows = draw(st.integers(1, 9))
  gap = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
  so = np.cumsum([0] + [s + g for s, g in zip(ss[:-1], gap[:-1])]).astype(np.int64)
  shuffle = draw(st.permutations(range(n)))
  to_order = np.cumsum([0] + [ts[i] for i in shuffle[:-1]])
  to = np.empty(n, np.int64)
  to[list(shuffle)] = to_order
  lo, hi = [], []
  for s, t in zip(ss, ts):
    held = s * src_rows
    a = draw(st.integers(0, held))
    b = draw(st.integers(a, min(held, a + t * out_rows)))
    lo.append(a)
    hi.append(b)
  width_in = int(so[-1] + ss[-1]) + draw(st.integers(0, 5))
  width_out = int(sum(ts)) + draw(st.integers(0, 5))
  table = tuple(np.asarray(c, np.int64) for c in (so, ss, to, ts, lo, hi))
  return table, (src_rows, width_in), (out_rows, width_out), draw(st.integers(1, 3))


@needs_library
@settings(max_examples=300, deadline=None)
@given(layout=_layouts(), dtype=st.sampled_from(UINTS), seed=st.integers(0, 2**16))
def test_the_compiled_copy_is_the_rule(layout, dtype, seed):
  """Every item size, partial first and last rows, rows several times a block's
  slots or shorter, empty ranges, strided source rows: the oracle's bits, and
  zeros wherever no block writes."""
  table, (src_rows, width_in), (out_rows, width_out), every = layout
  rng = np.random.default_rng(seed)
  info = np.iinfo(dtype)
  wide = rng.integers(info.min, info.max, (src_rows, width_in * every), dtype=dtype, endpoint=True)
  src = wide[:, :width_in]  # rows ``every`` times their width apart
  out = np.zeros((out_rows, width_out), dtype)
  native.copy_blocks(src, out, table, slice(None))
  np.testing.assert_array_equal(out, _oracle(src, out.shape, table))


@needs_library
def test_a_range_of_blocks_copies_those_alone():
  """The blocks named are copied, and the others' columns left zero."""
  src = np.arange(1, 1 + 4 * 6, dtype=np.uint32).reshape(4, 6)
  # Three blocks of two slots per source row, three per target row.
  table = tuple(
    np.asarray(c, np.int64) for c in ([0, 2, 4], [2, 2, 2], [0, 3, 6], [3, 3, 3], [0] * 3, [8] * 3)
  )
  out = np.zeros((3, 9), np.uint32)
  native.copy_blocks(src, out, table, np.array([1]))
  want = np.zeros_like(out)
  want[:, 3:6] = _oracle(src, (3, 9), table)[:, 3:6]
  np.testing.assert_array_equal(out, want)


def _good():
  src = np.arange(1, 1 + 4 * 6, dtype=np.uint16).reshape(4, 6)
  out = np.zeros((3, 9), np.uint16)
  table = [np.asarray(c, np.int64) for c in ([0, 2], [2, 2], [0, 3], [3, 3], [0, 1], [8, 8])]
  return src, out, table


def _with(table, column, value):
  table = [c.copy() for c in table]
  table[column][-1] = value
  return tuple(table)


def _unaligned(a: np.ndarray) -> np.ndarray:
  """A copy of ``a`` whose first element lies one byte past an address aligned to its
  item size, its rows whole elements apart."""
  raw = np.zeros(a.nbytes + 1, np.uint8)
  out = raw[1:].view(a.dtype).reshape(a.shape)
  out[...] = a
  return out


@needs_library
@pytest.mark.parametrize(
  "change",
  [
    pytest.param(lambda s, o, t: (s, o, _with(t, 0, 5)), id="source columns past the row"),
    pytest.param(lambda s, o, t: (s, o, _with(t, 0, -1)), id="negative source column"),
    pytest.param(lambda s, o, t: (s, o, _with(t, 1, 0)), id="no source slots"),
    pytest.param(
      lambda s, o, t: (s, o, _with(_with(t, 0, 2**62), 1, 2**62)), id="columns that wrap int64"
    ),
    pytest.param(
      lambda s, o, t: (s, o, _with(_with(t, 2, 2**62), 3, 2**62)), id="target columns that wrap"
    ),
    pytest.param(lambda s, o, t: (s, o, _with(t, 2, 7)), id="target columns past the row"),
    pytest.param(lambda s, o, t: (s, o, _with(t, 3, 0)), id="no target slots"),
    pytest.param(lambda s, o, t: (s, o, _with(t, 4, -1)), id="negative first element"),
    pytest.param(lambda s, o, t: (s, o, _with(t, 5, 9)), id="past the source rows"),
    pytest.param(lambda s, o, t: (s, o[:2], t), id="past the target rows"),
    pytest.param(lambda s, o, t: (s.astype(np.int16), o.astype(np.int16), t), id="signed"),
    pytest.param(lambda s, o, t: (s, o.astype(np.uint32), t), id="two widths"),
    pytest.param(lambda s, o, t: (s[:, ::2], o, t), id="strided columns"),
    pytest.param(lambda s, o, t: (s[::-1], o, t), id="rows backwards"),
    pytest.param(lambda s, o, t: (s.reshape(-1), o, t), id="one dimension"),
    pytest.param(lambda s, o, t: (s, np.broadcast_to(o[:1], o.shape), t), id="read-only target"),
    pytest.param(lambda s, o, t: (_unaligned(s), o, t), id="unaligned source"),
    pytest.param(lambda s, o, t: (s, _unaligned(o), t), id="unaligned target"),
  ],
)
def test_tables_that_do_not_fit_are_refused_and_nothing_is_written(change):
  """Every bound the C code trusts is checked first: a block or an array that does
  not fit raises ``ValueError`` before a byte is written."""
  src, out, table = change(*_good())
  before = np.array(out, copy=True)
  with pytest.raises(ValueError, match="block copy"):
    native.copy_blocks(src, out, table, slice(0, 2))
  np.testing.assert_array_equal(np.asarray(out), before)


@needs_library
def test_blocks_with_nothing_to_copy_are_not_checked_against_the_rows():
  """A block whose range is empty is skipped, wherever its columns say it lies (a
  target range past a buffer's end, as the last target ranks have)."""
  src, out, table = _good()
  table = _with(_with(table, 4, 8), 0, 99)  # lo == hi; columns outside the rows
  native.copy_blocks(src, out, table, slice(0, 2))
  want = np.zeros_like(out)
  want[:, :3] = _oracle(src, out.shape, tuple(c[:1] for c in table))[:, :3]
  np.testing.assert_array_equal(out, want)


# Rows of ``2**62 + 1`` bytes over a small buffer (numpy allows the shape; nothing may
# read past the buffer), and a block whose columns and slots are each within a row
# while their sum is ``2**63``.
_WRAPPING = """
import numpy as np
from jaxreshard._src.exec import native

buffer = np.zeros(64, np.uint8)
wide = np.lib.stride_tricks.as_strided(buffer, (1, 2**62 + 1), (2**62 + 1, 1))
small = np.zeros((1, 1), np.uint8)
table = tuple(np.asarray([c], np.int64) for c in {table})
src, out = (wide, small) if {source} else (small, wide)
try:
  native.copy_blocks(src, out, table, slice(None))
except ValueError as e:
  print("refused:", e)
"""


@needs_library
@pytest.mark.parametrize("source", [True, False], ids=["source row", "target row"])
def test_columns_and_slots_whose_sum_wraps_in_wide_rows_are_refused(source):
  """A block's first column and its slots may each fit a row whose width is over
  ``2**62`` while their sum wraps int64: refused, in a child (a copy would read or
  write past the buffer)."""
  big = (2**62, 2**62)
  table = (*big, 0, 1, 0, 1) if source else (0, 1, *big, 0, 1)
  code = _WRAPPING.format(table=table, source=source)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.startswith("refused: block copy"), out


@needs_library
@settings(max_examples=200, deadline=None)
@given(
  dtype=st.sampled_from(UINTS),
  n_tile=st.integers(1, 50),
  rows=st.integers(0, 6),
  width=st.integers(0, 9),
  extra=st.integers(0, 4),
  seed=st.integers(0, 2**16),
)
def test_the_tile_gather_is_take_of_the_clipped_index(dtype, n_tile, rows, width, extra, seed):
  """Each target element is the tile's element at its index, an index past the
  tile's end or negative reading the tile's last element (the zero the caller
  places there); target rows that are a strided view of wider rows keep their
  other columns."""
  rng = np.random.default_rng(seed)
  info = np.iinfo(dtype)
  tile = rng.integers(info.min, info.max, n_tile, dtype=dtype, endpoint=True)
  index = rng.integers(-3, n_tile + 3, rows * width, dtype=np.int32)
  index[: min(2, len(index))] = [np.iinfo(np.int32).min, np.iinfo(np.int32).max][
    : min(2, len(index))
  ]
  wide = rng.integers(info.min, info.max, (rows, width + extra), dtype=dtype, endpoint=True)
  before = wide.copy()
  native.gather_tile(tile, index, wide[:, extra:])
  # The oracle: numpy's own take, every index outside the tile sent to its last element.
  inside = (index >= 0) & (index < n_tile)
  want = tile[np.where(inside, index, n_tile - 1)].reshape(rows, width)
  np.testing.assert_array_equal(wide[:, extra:], want)
  np.testing.assert_array_equal(wide[:, :extra], before[:, :extra])


def _good_gather():
  tile = np.arange(1, 7, dtype=np.uint16)
  index = np.asarray([0, 5, 9, 2, 3, 1], np.int32)
  return tile, index, np.zeros((2, 3), np.uint16)


@needs_library
@pytest.mark.parametrize(
  "change",
  [
    pytest.param(lambda t, i, o: (t[:0], i, o), id="empty tile"),
    pytest.param(lambda t, i, o: (t[::2], i[:3], o[:1]), id="strided tile"),
    pytest.param(lambda t, i, o: (t.reshape(2, 3), i, o), id="tile of two dimensions"),
    pytest.param(lambda t, i, o: (t.astype(np.int16), i, o.astype(np.int16)), id="signed"),
    pytest.param(lambda t, i, o: (t, i, o.astype(np.uint32)), id="two widths"),
    pytest.param(lambda t, i, o: (t, i.astype(np.int64), o), id="int64 index"),
    pytest.param(lambda t, i, o: (t, i[:5], o), id="index shorter than the target"),
    pytest.param(lambda t, i, o: (t, i[::2], o[:1]), id="strided index"),
    pytest.param(lambda t, i, o: (t, i, o.reshape(-1)), id="target of one dimension"),
    pytest.param(lambda t, i, o: (t, i, np.zeros((2, 6), o.dtype)[:, ::2]), id="strided target"),
    pytest.param(lambda t, i, o: (t, i, np.broadcast_to(o[:1], o.shape)), id="read-only target"),
    pytest.param(lambda t, i, o: (_unaligned(t[None])[0], i, o), id="unaligned tile"),
    pytest.param(lambda t, i, o: (t, i, _unaligned(o)), id="unaligned target"),
  ],
)
def test_tile_gathers_that_do_not_fit_are_refused_and_nothing_is_written(change):
  """Every shape the C gather trusts is checked first: ``ValueError`` before a byte
  is written."""
  tile, index, out = change(*_good_gather())
  before = np.array(out, copy=True)
  with pytest.raises(ValueError, match="tile gather"):
    native.gather_tile(tile, index, out)
  np.testing.assert_array_equal(np.asarray(out), before)
