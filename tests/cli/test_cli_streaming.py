"""``jaxreshard reshard`` streams target ranks: each one planned and validated once."""

from __future__ import annotations

import jax
import numpy as np
import optax
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import regular as _regular
from jaxreshard._src.cli.commands import app
from jaxreshard._src.engine import pipeline as _pipeline


def test_reshard_validates_each_target_rank_once(tmp_path, monkeypatch):
  params = {"a": np.zeros((7, 3), np.float32), "b": np.zeros((5,), np.float32)}
  opt = optax.adam(1e-3)
  rng = np.random.default_rng(0)
  state = jax.tree.map(
    lambda x: rng.standard_normal(np.shape(x)).astype(np.asarray(x).dtype) if np.ndim(x) else x,
    opt.init(params),
  )
  records = jr.shard_state(opt, params, state, world_size=4)
  jr.save_records(tmp_path / "src", records)
  calls = []
  validate = _pipeline.validate
  monkeypatch.setattr(_pipeline, "validate", lambda *a: calls.append(1) or validate(*a))
  # A regular checkpoint validates a target rank from its index's arrays: its target once.
  check = _regular.check_target
  monkeypatch.setattr(_regular, "check_target", lambda *a: calls.append(1) or check(*a))
  result = CliRunner().invoke(
    app, ["reshard", str(tmp_path / "src"), str(tmp_path / "out"), "-w", "3"]
  )
  assert result.exit_code == 0, result.output
  # One for the early refusal (target rank 0's read plan), then one per target rank.
  assert len(calls) == 1 + 3
  want = jr.reshard_ranks(records, [jr.plan(records, world_size=3, rank=r) for r in range(3)])
  got = jr.load_records(tmp_path / "out")
  for w, g in zip(want, got):
    for x, y in zip(jax.tree.leaves(w.state), jax.tree.leaves(g.state)):
      x, y = np.asarray(x), np.asarray(y)
      assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
