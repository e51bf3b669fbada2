"""A forked child copies with threads of its own: the parent's worker threads do not
exist in the child, and work handed to them would wait forever."""

import dataclasses
import os
import signal
import threading
import time
import warnings

import jax
import numpy as np
import optax

import jaxreshard as jr
from tests._core_util import oracle_shard

_COUNT = 3_000_001  # a target buffer of 8 MB: copied by two threads
_CHILD_DEADLINE_S = 120


def _records():
  rng = np.random.default_rng(0)
  params = {"w": np.zeros((_COUNT,), np.float32)}
  opt = optax.adam(1e-3)
  adam, rest = opt.init(params)
  bits = lambda: rng.integers(0, 2**32, _COUNT, dtype=np.uint32).view(np.float32)
  state = (adam._replace(mu={"w": bits()}, nu={"w": bits()}), rest)
  records = jr.shard_state(opt, params, state, 4)
  # numpy buffers: the child never needs jax's runtime to read them.
  records = [dataclasses.replace(r, state=jax.tree.map(np.asarray, r.state)) for r in records]
  return records, adam._replace(mu={"w": state[0].mu["w"]}, nu={"w": state[0].nu["w"]})


def _exact(target, full, rank):
  got = target.state[0]
  return all(
    np.asarray(getattr(got, m)["w"]).view(np.uint32).tobytes()
    == oracle_shard(getattr(full, m)["w"], 3, rank).view(np.uint32).tobytes()
    for m in ("mu", "nu")
  )


def _in_child(fn) -> int | None:
  """``fn()`` in a forked child: its exit code (0: fn returned True), or None
  when it had not finished by the deadline (killed)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # jax warns that a fork of a threaded process may hang
    pid = os.fork()
  if pid == 0:
    code = 1
    try:
      code = 0 if fn() else 3
    finally:
      os._exit(code)
  deadline = time.monotonic() + _CHILD_DEADLINE_S
  while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return os.waitstatus_to_exitcode(status)
    time.sleep(0.05)
  os.kill(pid, signal.SIGKILL)
  os.waitpid(pid, 0)
  return None


def test_a_forked_child_reshards_after_its_parent_used_the_copy_threads():
  records, full = _records()
  assert _exact(jr.reshard(records, jr.plan(records, world_size=3, rank=1)), full, 1)
  # The parent's copy used a worker thread: the child will not have it.
  assert any(t.name.startswith("jaxreshard-copy") for t in threading.enumerate())
  code = _in_child(
    lambda: _exact(jr.reshard(records, jr.plan(records, world_size=3, rank=2)), full, 2)
  )
  assert code is not None, "the child's reshard waited for a thread it does not have"
  assert code == 0
  # The parent's own threads still work.
  assert _exact(jr.reshard(records, jr.plan(records, world_size=3, rank=0)), full, 0)
