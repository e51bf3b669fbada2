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


@pytest.mark.parametrize("world", [1, 3, 5, 7, 8, 11])
def test_every_all_padding_rank_is_checked_by_the_target_ranks_over_it(ckpt, world):
  seen = {}
  for t in range(world):
    migrations = _reshard.plan_groups(ckpt.complete_groups(), world_size=world, rank=t)
    for a, d, (pid, m) in restore.all_padding_sources(restore._validated(ckpt, migrations)):
      assert d == np.dtype(np.float32) and m in (0, 1)  # adam's mu and nu
      seen.setdefault((pid, m, a), []).append(t)
  want = {}
  for n in (1, 3, 5, 8, 9, 17):
    s = -(-n // 8)  # source slots
    ts = -(-n // world)
    for r in range(8):
      if r * s < n:
        continue  # owns data
      # Every target rank whose slots meet source rank r's slots (the last target
      # rank also takes everything past its own slots).
      over = [
        t for t in range(world) if t * ts < (r + 1) * s and (t == world - 1 or r * s < (t + 1) * ts)
      ]
      for m in (0, 1):
        want[(f"p{n}", m, r)] = over
  # Archive a holds source rank a (save_records writes rank r as archive r).
  assert seen == want
