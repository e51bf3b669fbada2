"""Which all-padding source buffers a target rank checks, against the flat geometry."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import reader, restore
from jaxreshard._src.engine import reshard as _reshard


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  # Counts below and around the world size, so trailing ranks hold only padding.
  params = {f"p{n}": np.zeros((n,), np.float32) for n in (1, 3, 5, 8, 9, 17)}
  opt = optax.adam(1e-3)
  state = jax.tree.map(np.asarray, opt.init(params))
  path = tmp_path_factory.mktemp("pad") / "ck"
  jr.save_records(path, jr.shard_state(opt, params, state, world_size=8))
  return reader.open_checkpoint(path)


def _buffers(trailing, pids) -> set:
  """Every buffer of a ``pads.Trailing`` as ``(archive, dtype, (param id, mirror))``."""
  return {
    (archive, d, (pids[n], m))
    for archive, d, names, mirrors in trailing.by_file()
    for n, m in zip(names.tolist(), mirrors.tolist())
  }


@pytest.mark.parametrize("world", [1, 3, 5, 7, 8, 11])
def test_every_all_padding_rank_is_checked_by_the_target_ranks_over_it_or_its_share(ckpt, world):
  seen = {}
  for t in range(world):
    migrations = _reshard.plan_groups(ckpt.complete_groups(), world_size=world, rank=t)
    trailing = restore.all_padding_sources(restore._validated(ckpt, migrations), ckpt.index.name_of)
    for a, d, (pid, m) in _buffers(trailing, ckpt.index.tables.pids):
      assert d == np.dtype(np.float32) and m in (0, 1)  # adam's mu and nu
      seen.setdefault((pid, m, a), []).append(t)
  want = {}
  for n in (1, 3, 5, 8, 9, 17):
    s = -(-n // 8)  # source slots
    ts = -(-n // world)
    for r in range(8):
      if r * s < n:
        continue  # owns data
      if r * s < world * ts:
        # Inside the target world's padded buffer: every target rank whose slots
        # meet source rank r's slots.
        over = [t for t in range(world) if t * ts < (r + 1) * s and r * s < (t + 1) * ts]
      else:
        # Past it: one target rank, in proportion (never all on the last one).
        over = [r * world // 8]
      for m in (0, 1):
        want[(f"p{n}", m, r)] = over
  # Archive a holds source rank a (save_records writes rank r as archive r).
  assert seen == want


def test_pads_find_looks_buffers_up_as_a_dict_of_their_keys_would():
  from jaxreshard._src.checkpoint import pads

  rng = np.random.default_rng(0)
  for trial in range(50):
    n = int(rng.integers(0, 40))
    keys = list({(int(a), int(b)) for a, b in rng.integers([-1, 0], [30, 4], (n, 2))})
    rng.shuffle(keys)
    finder = pads._Finder(
      np.asarray([k[0] for k in keys], np.int64).reshape(-1),
      np.asarray([k[1] for k in keys], np.int64).reshape(-1),
    )
    where = {k: i for i, k in enumerate(keys) if k[0] >= 0}
    # More distinct questions than the finder keeps answers to, each asked again.
    questions = [rng.integers([-2, -1], [32, 6], (int(rng.integers(0, 60)), 2)) for _ in range(12)]
    for q in questions + questions[::-1]:
      want = sorted({where[k] for k in map(tuple, q.tolist()) if k in where})
      got = finder.find(q[:, 0], q[:, 1])
      assert got.tolist() == want and not got.flags.writeable, trial


def test_trailing_gives_each_buffer_once_file_by_file_in_archive_then_dtype_order():
  from jaxreshard._src.checkpoint import pads

  rng = np.random.default_rng(1)
  dtypes = [np.dtype(np.float32), np.dtype(np.float16)]
  t, want = pads.Trailing(), set()
  for _ in range(30):
    d = dtypes[int(rng.integers(0, 2))]
    a = rng.integers(0, 7, int(rng.integers(0, 9)))
    name, mirror = int(rng.integers(0, 5)), int(rng.integers(0, 3))
    t.add(d, a, name, mirror)
    want |= {(int(x), d, (name, mirror)) for x in a.tolist()}
  rows = t.by_file()
  files = [(a, d.name) for a, d, _, _ in rows]
  assert files == sorted(set(files))  # each file once, in order
  got = [(a, d, (n, m)) for a, d, ns, ms in rows for n, m in zip(ns.tolist(), ms.tolist())]
  assert len(got) == len(set(got)) and set(got) == want
  assert _buffers(t, list(range(5))) == want
  assert not pads.Trailing() and pads.Trailing().by_file() == []
