"""Whether runs of an array hold a set bit, compiled and in numpy, against the rule
itself written in plain Python."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxreshard._src.exec import host, native

needs_library = pytest.mark.skipif(not native.available(), reason="built without a C compiler")

UINTS = [np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("compiled", ["one thread", "two threads", "numpy"])
@settings(max_examples=150, deadline=None)
@given(
  dtype=st.sampled_from(UINTS),
  n=st.integers(0, 60),
  runs=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 9)), max_size=8),
  hit=st.one_of(st.none(), st.integers(0, 59)),
  byte=st.integers(0, 7),
)
def test_nonzero_runs_answer_whether_a_run_holds_a_set_bit(compiled, dtype, n, runs, hit, byte):
  """One element with one bit set in any of its bytes (-0.0's sign bit, a NaN
  payload's low bit): the answer is whether a run covers it, by plain Python;
  compiled (the runs split between two threads from two runs on, or not) and
  numpy's gather of the runs' elements."""
  if compiled != "numpy" and not native.available():
    pytest.skip("built without a C compiler")
  flat = np.zeros(n, dtype)
  if hit is not None and hit < n:
    flat.view(np.uint8)[hit * flat.itemsize + byte % flat.itemsize] = 0x80 >> byte % 8
  table = [(s % max(n, 1), k) for s, k in runs]
  table = [(s, min(k, n - s)) for s, k in table if n]
  start = np.array([s for s, _ in table], np.int64)
  length = np.array([k for _, k in table], np.int64)
  want = any(int(flat[i]) != 0 for s, k in table for i in range(s, s + k))
  saved = native.enabled, host._PARALLEL_RUNS
  try:
    native.enabled = compiled != "numpy"
    host._PARALLEL_RUNS = 2 if compiled == "two threads" else 1 << 14
    assert host.any_nonzero_runs(flat, start, length) is want
  finally:
    native.enabled, host._PARALLEL_RUNS = saved


@needs_library
@pytest.mark.parametrize("start, length", [(-1, 1), (0, 11), (10, 1), (3, -1), (2**62, 2**62)])
def test_nonzero_runs_outside_the_array_are_refused(start, length):
  flat = np.zeros(10, np.uint32)
  with pytest.raises(ValueError, match="outside the 10 elements"):
    native.any_nonzero_runs(flat, np.array([0, start], np.int64), np.array([1, length], np.int64))
