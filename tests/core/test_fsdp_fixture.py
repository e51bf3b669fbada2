"""Against PyTorch FSDP's own flat shards (tests/data/fsdp_flat_shards.npz).

The fixture was produced by ``FlatParamHandle._get_shard`` (see
/work/shared/fixtures/README.md): code nobody on this project wrote. An
sgd-momentum state whose trace *is* the fixture's full buffer must shard into
exactly FSDP's shard bits, and resharding between any two of the fixture's
world sizes must give exactly FSDP's shard of the target world size.
"""

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxreshard as jr
from tests._core_util import FIXTURE, assert_bits_equal

WORLDS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


@functools.cache
def _fixture():
  with np.load(FIXTURE) as z:
    data = {k: z[k] for k in z.files}
  cases = sorted({k.split("/")[0] for k in data}, key=lambda c: int(c[1:]))
  return data, cases


def _full_params():
  """{"f32": {case: full}, "bf16": {case: full}} as the optimizer's params."""
  data, cases = _fixture()
  f32, bf16 = {}, {}
  for c in cases:
    shape = tuple(int(d) for d in data[f"{c}/shape"])
    f32[c] = jnp.asarray(data[f"{c}/full_f32"].reshape(shape))
    bf16[c] = jnp.asarray(data[f"{c}/full_bf16_bits"].reshape(shape).view(ml_dtypes.bfloat16))
  return {"f32": f32, "bf16": bf16}


OPT = optax.sgd(0.1, momentum=0.9)


@functools.cache
def _records(world):
  params = _full_params()
  state = OPT.init(params)
  # The momentum trace is the fixture's buffer itself (the optimizer math is
  # irrelevant here: only where each element lands is being tested).
  state = (optax.TraceState(trace=params),) + tuple(state[1:])
  return jr.shard_state(OPT, params, state, world)


def _expected(case, kind, world, rank):
  data, _ = _fixture()
  if kind == "f32":
    return data[f"{case}/w{world}/r{rank}/f32"]
  return data[f"{case}/w{world}/r{rank}/bf16_bits"].view(ml_dtypes.bfloat16)


def test_fixture_is_complete():
  data, cases = _fixture()
  assert len(cases) == 10
  for c in cases:
    for w in WORLDS:
      for r in range(w):
        assert f"{c}/w{w}/r{r}/f32" in data and f"{c}/w{w}/r{r}/bf16_bits" in data


@pytest.mark.parametrize("world", WORLDS)
def test_shard_state_equals_fsdp_shards(world):
  _, cases = _fixture()
  records = _records(world)
  assert len(records) == world
  for rank, rec in enumerate(records):
    trace = rec.state[0].trace
    for kind in ("f32", "bf16"):
      for c in cases:
        assert_bits_equal(
          trace[kind][c], _expected(c, kind, world, rank), f"{kind} {c} w{world} r{rank}"
        )
        p = rec.placement(f"{kind}/{c}")
        assert (p.rank, p.world_size) == (rank, world)


# Every ordered pair of fixture world sizes; targets: the first and the last
# rank (all ranks for the pairs in ALL_RANKS), to keep compiles within budget.
ALL_RANKS = {(8, 6), (5, 7), (16, 3), (1, 12)}


@pytest.mark.parametrize("src", WORLDS)
def test_reshard_between_fixture_world_sizes_equals_fsdp(src):
  _, cases = _fixture()
  records = _records(src)
  for dst in WORLDS:
    ranks = range(dst) if (src, dst) in ALL_RANKS else sorted({0, dst - 1})
    for rank in ranks:
      target = jr.reshard(records, jr.plan(records, world_size=dst, rank=rank))
      trace = target.state[0].trace
      for kind in ("f32", "bf16"):
        for c in cases:
          assert_bits_equal(
            trace[kind][c], _expected(c, kind, dst, rank), f"{kind} {c} w{src}->w{dst} r{rank}"
          )
