"""The save's check of an archive's history buffers: the plain case's quick pass and
the checks one by one refuse the same buffers with the same words, and pass the same."""

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings

import jaxreshard as jr
from jaxreshard._src.checkpoint import historycheck as writer
from jaxreshard._src.core import validate


def _outcome(check, index, parts, placements):
  try:
    check(index, parts, placements)
  except jr.ReshardError as e:
    return type(e).__name__, str(e)
  return None


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
  sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5),
  world=st.integers(1, 6),
  rank=st.data(),
  defect=st.sampled_from(["none", "padding", "length", "dtype", "nan-owned"]),
  which=st.integers(0, 4),
)
def test_the_quick_pass_and_the_checks_one_by_one_agree(sizes, world, rank, defect, which):
  params = {f"p{i}": jnp.ones((n,), jnp.float32) for i, n in enumerate(sizes)}
  opt = optax.adam(1e-3)
  records = jr.shard_state(opt, params, opt.init(params), world_size=world)
  r = rank.draw(st.integers(0, world - 1))
  mu = {k: np.array(v) for k, v in records[r].state[0].mu.items()}
  pid = f"p{which % len(sizes)}"
  n = len(mu[pid])
  if defect == "padding" and n:
    mu[pid][-1] = 1.0  # nonzero where the rank may hold padding
  elif defect == "length":
    mu[pid] = np.zeros(n + 1, np.float32)
  elif defect == "dtype":
    mu[pid] = mu[pid].astype(np.int32)
  elif defect == "nan-owned" and n:
    mu[pid][0] = np.nan
  state = (records[r].state[0]._replace(mu=mu), *records[r].state[1:])
  record = jr.ShardRecord(1, records[r].placements, state, records[r].roles)
  parts, placements = validate.check_record(r, record)
  quick = _outcome(writer.check_histories, r, parts, placements)
  one_by_one = _outcome(writer._check_histories_one_by_one, r, parts, placements)
  assert quick == one_by_one


def test_a_plain_archive_takes_the_quick_pass():
  params = {"w": jnp.ones((5,), jnp.float32), "s": jnp.ones((), jnp.float32)}
  opt = optax.adam(1e-3)
  record = jr.shard_state(opt, params, opt.init(params), world_size=4)[3]
  parts, placements = validate.check_record(3, record)
  padded = writer._plain_histories(parts, placements)
  assert padded is not None and sorted((p.param, m) for p, m, _, _ in padded) == [
    ("s", 0),
    ("s", 1),
    ("w", 0),
    ("w", 1),
  ]


@pytest.mark.parametrize("dtype", [np.int32, np.float64])
def test_other_buffers_take_the_checks_one_by_one(dtype):
  params = {"w": jnp.ones((5,), jnp.float32)}
  opt = optax.adam(1e-3)
  record = jr.shard_state(opt, params, opt.init(params), world_size=2)[0]
  mu = {"w": np.zeros(3, dtype)}
  state = (record.state[0]._replace(mu=mu), *record.state[1:])
  parts, placements = validate.check_record(
    0, jr.ShardRecord(1, record.placements, state, record.roles)
  )
  assert writer._plain_histories(parts, placements) is None


@pytest.mark.parametrize(
  "placement, words",
  [
    (jr.ParamPlacement("w", (4,), 5, 4), "rank 5 is outside world_size 4"),
    (jr.ParamPlacement("w", (4,), 0, 0), "world_size 0 must be at least 1"),
    (jr.ParamPlacement("w", (2**62, 4), 0, 1), "more than a 64-bit index can address"),
  ],
)
def test_a_save_refuses_a_placement_the_format_cannot_describe(tmp_path, placement, words):
  """The history checks vouch for every placement's geometry before the index
  registers it: refused with the geometry's words, nothing written."""
  record = jr.ShardRecord(1, (placement,), {"mu": {"w": np.zeros(1, np.float32)}})
  with pytest.raises(jr.PlacementError, match=words):
    jr.save_records(tmp_path / "c", [record])
  assert list(tmp_path.iterdir()) == []
