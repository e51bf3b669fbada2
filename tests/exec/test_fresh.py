"""Fresh output buffers: zeros, every page mapped in before the first write.

Whether the pages are mapped is read from the process's minor page faults
while the buffer is written, in a child process that the kernel gives no huge
pages (``PR_SET_THP_DISABLE``), so that each 4 KiB page faults on its own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxreshard._src.exec import fresh

_CHILD = textwrap.dedent(
  """
  import ctypes, resource, sys
  import numpy as np
  from jaxreshard._src.exec import fresh
  if ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) != 0:  # PR_SET_THP_DISABLE
    print("no-prctl"); sys.exit()
  if fresh._MADVISE is None:
    print("no-madvise"); sys.exit()
  n = 64 << 20
  def faults_while_written(a):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a.fill(7)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
  plain = faults_while_written(np.zeros(n, np.uint8))
  a = fresh.zeros(n, np.uint8)
  if fresh._MADVISE is None:  # the kernel refused MADV_POPULATE_WRITE
    print("no-populate"); sys.exit()
  assert not a.any()
  print(plain, faults_while_written(a))
  """
)


def test_zeros_are_zeros_of_the_size_and_dtype_asked():
  for n, dtype in [(0, np.float32), (3, np.uint16), ((1 << 20) + 5, np.float64), (1 << 22, "V2")]:
    a = fresh.zeros(n, dtype)
    assert a.shape == (n,) and a.dtype == np.dtype(dtype)
    assert not a.view(np.uint8).any()


def test_populate_keeps_the_bytes_of_a_buffer_in_use():
  rng = np.random.default_rng(0)
  a = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
  want = a.copy()
  assert fresh.populate(a) is a
  np.testing.assert_array_equal(a, want)
  # Views, read-only arrays and small buffers are left as they are.
  assert fresh.populate(a[1::2]) is not None
  ro = a.copy()
  ro.flags.writeable = False
  assert fresh.populate(ro) is ro
  np.testing.assert_array_equal(a, want)


def test_large_fresh_buffers_take_no_page_fault_per_page_when_written():
  out = subprocess.run(
    [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=120
  ).stdout.split()
  if out[0].startswith("no-"):
    pytest.skip(f"this machine cannot tell: {out[0]}")
  plain, populated = map(int, out)
  pages = (64 << 20) // 4096
  assert plain > pages // 2, f"{plain} faults writing a fresh buffer of {pages} pages"
  assert populated < pages // 100, f"{populated} faults writing a populated one"
