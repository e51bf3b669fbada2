"""``device.nonzero_runs`` against numpy: whether the runs hold a set bit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxreshard._src.exec import device


@settings(max_examples=40, deadline=None)
@given(
  sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3),
  runs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 39), st.integers(0, 8)), max_size=6),
  hit=st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(0, 39))),
  bits=st.sampled_from([0x8000, 0x0001, 0x7FC1, 0x0100]),
  dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
)
def test_nonzero_runs_answers_whether_any_run_holds_a_set_bit(sizes, runs, hit, bits, dtype):
  """One element given bits (-0.0's sign, a subnormal, a NaN payload, a high byte):
  the answer is whether a run covers it, by plain numpy."""
  width = np.dtype(jnp.dtype(dtype)).itemsize
  uint = {2: np.uint16, 4: np.uint32}[width]
  host = [np.zeros(n, uint) for n in sizes]
  if hit is not None:
    a, i = hit[0] % len(sizes), hit[1] % sizes[hit[0] % len(sizes)]
    host[a][i] = bits
  table = []
  for a, start, n in runs:
    a %= len(sizes)
    start %= sizes[a]
    table.append((a, start, min(n, sizes[a] - start)))
  want = any(host[a][s : s + n].any() for a, s, n in table)
  sources = [jnp.asarray(h.view(jnp.dtype(dtype))) for h in host]
  t = lambda i: np.array([r[i] for r in table], np.int64)  # noqa: E731
  assert device.nonzero_runs(sources, t(0), t(1), t(2)) is want


def test_runs_longer_than_one_call_are_read_to_their_end(monkeypatch):
  monkeypatch.setattr(device, "_MAX_ELEMENTS_PER_CALL", 256)
  x = np.zeros(1000, np.float32)
  x[999] = -0.0
  src = [jnp.asarray(x)]
  t = lambda v: np.array([v], np.int64)  # noqa: E731
  assert device.nonzero_runs(src, t(0), t(0), t(1000))
  assert not device.nonzero_runs(src, t(0), t(0), t(999))
  assert device.nonzero_runs(src, t(0), t(500), t(500))
