"""Every supported optimizer family: real states after a few steps, 8 -> 6 -> 8, bit-exact.

For each optimizer the test runs real update steps (so moments are non-zero),
shards the state over 8 ranks, reshards every rank of 6 and back to 8, and
checks: each target buffer is the numpy oracle's slice of the full buffer, the
round trip returns the original records exactly, ``unshard_state`` of the 6-rank
layout equals the full state bit for bit, and the unsharded state is usable:
``optimizer.update`` on it gives bit-identical results to the original state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from tests._core_util import (
  OPTIMIZERS,
  assert_records_equal,
  assert_trees_bit_equal,
  bits,
  count_xla_compiles,
  oracle_shard,
  random_grads,
  small_params,
  standard,
)


def _train(opt, params, steps=3):
  state = standard(opt.init, params)
  for step in range(steps):
    updates, state = standard(opt.update, random_grads(params, step), state, params)
    params = standard(optax.apply_updates, params, updates)
  return params, state


def _check_targets(targets, state, world):
  """Each history leaf of each target is the oracle's slice of the full leaf."""
  full_leaves = jax.tree.leaves(state)
  n_hist = 0
  for rank, t in enumerate(targets):
    leaves = jax.tree.leaves(t.state)
    assert len(leaves) == len(full_leaves) == len(t.roles)
    for leaf, full, role in zip(leaves, full_leaves, t.roles):
      if role is None:  # a clock scalar: unchanged
        assert bits(leaf).tobytes() == bits(full).tobytes() and np.shape(leaf) == np.shape(full)
      else:
        np.testing.assert_array_equal(bits(leaf), bits(oracle_shard(full, world, rank)))
        n_hist += 1
  return n_hist


def _migrate_and_check(opt, params, state, trainable=None):
  records = jr.shard_state(opt, params, state, 8, trainable=trainable)
  targets = [jr.reshard(records, jr.plan(records, world_size=6, rank=r)) for r in range(6)]
  n_hist = _check_targets(targets, state, 6)
  assert n_hist > 0
  back = [jr.reshard(targets, jr.plan(targets, world_size=8, rank=r)) for r in range(8)]
  for a, b in zip(back, records, strict=True):
    assert_records_equal(a, b)
  unsharded = jr.unshard_state(targets)
  assert_trees_bit_equal(unsharded, state)
  # The migrated state is usable and behaves exactly as the original.
  grads = random_grads(params, 99)
  u_new, s_new = standard(opt.update, grads, unsharded, params)
  u_old, s_old = standard(opt.update, grads, state, params)
  assert_trees_bit_equal(u_new, u_old)
  assert_trees_bit_equal(s_new, s_old)
  return records, targets


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_round_trip_8_6_8(name):
  opt = OPTIMIZERS[name]()
  params, state = _train(opt, small_params())
  # The moments really are non-zero after the steps (else the test proves little).
  hist = [x for x in jax.tree.leaves(state) if np.ndim(x) > 0 and x.size > 1]
  assert hist and any(np.any(np.asarray(x, np.float32) != 0) for x in hist)
  _migrate_and_check(opt, params, state)


@pytest.mark.slow
def test_adamw_mu_dtype_bfloat16_keeps_buffer_dtypes():
  opt = OPTIMIZERS["adamw_mu_bf16"]()
  params, state = _train(opt, small_params())
  _, targets = _migrate_and_check(opt, params, state)
  adam = targets[0].state[0]
  assert adam.mu["dense"]["kernel"].dtype == jnp.bfloat16
  assert adam.nu["dense"]["kernel"].dtype == jnp.float32
  assert adam.mu["dense"]["kernel"].shape == (-(-35 // 6),)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_params(dtype):
  opt = optax.adam(1e-2)
  params, state = _train(opt, small_params(dtype))
  records, targets = _migrate_and_check(opt, params, state)
  assert {p.dtype for p in targets[0].placements} == {np.dtype(dtype)}
  assert targets[0].state[0].mu["emb"].dtype == dtype


@pytest.mark.parametrize("name", ["masked", "multi_transform"])
def test_frozen_params_have_no_history_and_stay_frozen(name):
  opt = OPTIMIZERS[name]()
  params, state = _train(opt, small_params())
  trainable = {"emb": False, "tiny": False}
  records, targets = _migrate_and_check(opt, params, state, trainable=trainable)
  for t in targets:
    assert {p.param: p.trainable for p in t.placements} == {
      "dense/bias": True,
      "dense/kernel": True,
      "emb": False,
      "scale": True,
      "tiny": False,
    }
    assert "emb" not in t.roles and "tiny" not in t.roles
    masked = [
      x
      for x in jax.tree.leaves(t.state, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
      if isinstance(x, optax.MaskedNode)
    ]
    assert masked, "frozen params must keep their MaskedNode (no history)"


def _labels_by_walk(p):
  if isinstance(p, dict):
    return {k: _labels_by_walk(v) for k, v in p.items()}
  return "frozen" if p.ndim == 0 else "train"


def test_label_functions_that_walk_the_params_tree():
  """A ``multi_transform`` label function that walks the params' dicts (flax's
  ``traverse_util.path_aware_map``, a loop over keys) runs in optax; optax's
  ``tree_map_params``, which finds the state's mirrors, calls it on a placeholder
  instead of the params, and shard_state raised a raw AssertionError (flax) or a
  ShapeError about factored statistics. The labels of the placeholder come back
  without a call: every path is as with the same labels given as a pytree."""
  from flax import traverse_util

  transforms = {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}
  params = small_params()
  by_tree = optax.multi_transform(transforms, _labels_by_walk(params))
  for labels in (
    _labels_by_walk,
    lambda p: traverse_util.path_aware_map(lambda path, x: "frozen" if x.ndim == 0 else "train", p),
  ):
    opt = optax.multi_transform(transforms, labels)
    trained, state = _train(opt, params)
    records, _ = _migrate_and_check(opt, trained, state)
    assert [r.roles for r in records] == [
      r.roles for r in jr.shard_state(by_tree, trained, state, 8)
    ]


def test_a_skip_function_of_the_params_keys_is_refused_saying_why():
  """MultiSteps calls its should_skip_update_fn at init; optax.tree_map_params (which
  finds the state's mirrors) calls it with a placeholder for the params, where a
  function reading ``updates["dense"]`` fails. The refusal says so and how to write
  the function (it blamed factored or matrix statistics)."""
  params = small_params()
  skip = lambda updates, step, params: (~jnp.all(jnp.isfinite(updates["dense"]["bias"])), {})  # noqa: E731
  opt = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2, should_skip_update_fn=skip)
  _, state = _train(opt, params, steps=1)
  with pytest.raises(jr.ShapeError, match="MultiSteps should_skip_update_fn") as info:
    jr.shard_state(opt, params, state, 4)
  assert "jax.tree.map" in str(info.value) and "factored" not in str(info.value)


@pytest.mark.slow
def test_multi_steps_accumulator_and_clock_carried():
  opt = OPTIMIZERS["multi_steps"]()
  params, state = _train(opt, small_params(), steps=3)  # odd: a half-accumulated gradient
  assert int(state.mini_step) == 1
  records, targets = _migrate_and_check(opt, params, state)
  assert int(targets[3].state.mini_step) == 1
  assert "emb" in targets[3].roles  # acc_grads is a history


@pytest.mark.slow
def test_adafactor_is_refused_with_a_shape_error():
  opt = optax.adafactor(1e-2, min_dim_size_to_factor=2)
  params, state = _train(opt, small_params(), steps=1)
  with pytest.raises(jr.ShapeError, match=r"param 'd(ense/kernel|ense/bias)|param 'emb'"):
    jr.shard_state(opt, params, state, 8)


@pytest.mark.slow
def test_explicit_groups_merge_two_archive_groups_with_different_world_sizes():
  """Explicit migrations of another layout: tensor-parallel 'attn' over 4 ranks and 'experts' over 3,
  merged by one reshard call, each into its own target world size (2 and 5)."""
  opt = optax.adam(1e-2)
  rng = np.random.default_rng(7)
  pa = {
    "attn": {
      "q": jnp.asarray(rng.standard_normal((6, 5)), jnp.float32),
      "o": jnp.asarray(rng.standard_normal((7,)), jnp.float32),
    }
  }
  pb = {
    "experts": {
      "e0": jnp.asarray(rng.standard_normal((9,)), jnp.float32),
      "e1": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
    }
  }
  pa, sa = _train(opt, pa)  # same optimizer, same number of steps: one clock
  pb, sb = _train(opt, pb)
  group_a = jr.shard_state(opt, pa, sa, 4)
  group_b = jr.shard_state(opt, pb, sb, 3)
  archives = group_a[::-1] + group_b  # A's ranks in reverse order: sources are unordered
  a_src, b_src = (0, 1, 2, 3), (4, 5, 6)
  shapes = {"attn/q": (6, 5), "attn/o": (7,), "experts/e0": (9,), "experts/e1": (4, 3)}
  full = {
    "attn/q": (sa, "attn", "q"),
    "attn/o": (sa, "attn", "o"),
    "experts/e0": (sb, "experts", "e0"),
    "experts/e1": (sb, "experts", "e1"),
  }

  def migrations(rank):
    out = [jr.Migration(p, shapes[p], rank, 5, b_src) for p in ("experts/e0", "experts/e1")]
    if rank < 2:
      out += [jr.Migration(p, shapes[p], rank, 2, a_src) for p in ("attn/q", "attn/o")]
    return out

  merged = [jr.reshard(archives, migrations(r)) for r in range(5)]
  for rank, rec in enumerate(merged):
    expect = {"experts/e0": 5, "experts/e1": 5} | ({"attn/o": 2, "attn/q": 2} if rank < 2 else {})
    assert [(p.param, p.world_size, p.rank) for p in rec.placements] == [
      (pid, w, rank) for pid, w in sorted(expect.items())
    ]
    adam = rec.state[0]
    for pid in expect:
      state, outer, inner = full[pid]
      for name in ("mu", "nu"):
        np.testing.assert_array_equal(
          bits(getattr(adam, name)[outer][inner]),
          bits(oracle_shard(getattr(state[0], name)[outer][inner], expect[pid], rank)),
        )
    # Nested dicts from the ids, the clock carried.
    assert set(adam.mu) == ({"attn", "experts"} if rank < 2 else {"experts"})
    assert set(adam.mu["experts"]) == {"e0", "e1"}
    assert bits(adam.count).tobytes() == bits(sa[0].count).tobytes()

  # The merged layout unshards to the union of both full states, which is usable.
  merged_full = jr.unshard_state(merged)
  union = (sa[0]._replace(mu={**sa[0].mu, **sb[0].mu}, nu={**sa[0].nu, **sb[0].nu}), sa[1])
  assert_trees_bit_equal(merged_full, union)
  params = {**pa, **pb}
  standard(opt.update, random_grads(params, 5), merged_full, params)

  # And back: each group from the merged records to its original layout.
  back_a = [
    jr.reshard(merged, [jr.Migration(p, shapes[p], r, 4, (0, 1)) for p in ("attn/o", "attn/q")])
    for r in range(4)
  ]
  back_b = [
    jr.reshard(
      merged,
      [jr.Migration(p, shapes[p], r, 3, (4, 2, 0, 3, 1)) for p in ("experts/e0", "experts/e1")],
    )
    for r in range(3)
  ]
  for a, b in zip(back_a + back_b, group_a + group_b, strict=True):
    assert_records_equal(a, b)


def test_explicit_groups_refuse_a_migration_mixing_the_groups():
  opt = optax.sgd(0.1, momentum=0.9)
  pa = {"w": jnp.ones((5,))}
  group_a = jr.shard_state(opt, pa, opt.init(pa), 2)
  group_b = jr.shard_state(opt, pa, opt.init(pa), 3)  # the same id, another checkpoint
  with pytest.raises(jr.PlacementError, match=r"param 'w': archive 2 has world_size 3"):
    jr.reshard(group_a + group_b, [jr.Migration("w", (5,), 0, 4, (0, 2, 3, 4))])
  with pytest.raises(jr.PlacementError, match="param 'w'"):
    jr.plan(group_a + group_b, world_size=4, rank=0)  # plan never guesses a group


@pytest.mark.slow
def test_prng_key_in_the_optimizer_clock_is_carried_and_compared():
  # noisy_sgd keeps a typed PRNG key in its state: a clock leaf numpy cannot
  # read directly (this crashed with a TypeError before keys were compared by
  # their key data).
  opt = optax.noisy_sgd(1e-2, key=jax.random.key(0))
  params, state = _train(opt, small_params(), steps=2)
  records = jr.shard_state(opt, params, state, 8)
  targets = [jr.reshard(records, jr.plan(records, world_size=6, rank=r)) for r in range(6)]
  full = jr.unshard_state(targets)
  key_data = lambda s: np.asarray(jax.random.key_data(s[0].rng_key))
  np.testing.assert_array_equal(key_data(full), key_data(state))
  assert jax.tree.structure(full) == jax.tree.structure(state)
  # Archives whose keys differ (same step count) are not one checkpoint.
  other = optax.noisy_sgd(1e-2, key=jax.random.key(1))
  _, other_state = _train(other, small_params(), steps=2)
  assert int(other_state[0].count) == int(state[0].count)
  mixed = records[:7] + jr.shard_state(other, params, other_state, 8)[7:]
  with pytest.raises(jr.PlacementError, match=r"archive 7 has clock scalar \[0\]\.rng_key = "):
    jr.reshard(mixed, jr.plan(mixed, world_size=6, rank=0))


def test_sm3_per_axis_statistics_are_refused_with_a_shape_error():
  # SM3 keeps a list of per-axis accumulators per parameter; optax.tree_map_params
  # cannot pair them with the params (this leaked a raw pytree ValueError).
  opt = optax.sm3(1e-2)
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((5,))}
  state = opt.init(params)
  with pytest.raises(jr.ShapeError, match=r"params \['b', 'w'\].*not one per parameter"):
    jr.shard_state(opt, params, state, 2)


def test_lookahead_is_refused_for_its_params_of_another_tree():
  # Elementwise, but its state and params are trees of fast and slow params: the
  # refusal says so rather than calling it factored or matrix state.
  opt = optax.lookahead(optax.adam(1e-2), 5, 0.5)
  params = optax.LookaheadParams.init_synced({"w": jnp.ones((3,))})
  with pytest.raises(jr.ShapeError, match=r"as optax\.lookahead's\) cannot be sharded flat"):
    jr.shard_state(opt, params, opt.init(params), 2)


def test_unshard_state_transfers_buffers_without_compiling():
  """``unshard_state`` hands back jax arrays made by a transfer: ``jnp.asarray`` of a
  numpy array compiles a program per shape (~20 ms each), which at a few hundred
  parameters of distinct shapes cost seconds."""
  opt = optax.adam(1e-3)
  # Shapes no other test uses, so that no compiled program is found in a cache.
  params = {f"p{i}": jnp.full((1009 + i, 1), i, jnp.float32) for i in range(6)}
  state = jax.tree.map(lambda x: x + 1, opt.init(params))
  records = jr.shard_state(opt, params, state, 3)
  with count_xla_compiles() as compiles:
    full = jr.unshard_state(records)
  assert compiles["n"] == 0
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(full))
  assert_trees_bit_equal(full, state)


def test_unshard_state_keeps_a_64_bit_numpy_clock_scalar_whole():
  """A float64 clock scalar held as numpy while x64 is off (how a restore hands it
  back) stays numpy with every bit: jax would cut it to float32."""
  assert not jax.config.jax_enable_x64
  third = np.asarray(1 / 3, np.float64)
  records = [
    jr.ShardRecord(
      1,
      (jr.ParamPlacement("w", (6,), r, 2, jnp.float32, True),),
      {"lr": third.copy(), "mu": {"w": np.arange(3, dtype=np.float32) + 3 * r}},
    )
    for r in range(2)
  ]
  full = jr.unshard_state(records)
  assert type(full["lr"]) is np.ndarray and full["lr"].dtype == np.float64
  assert full["lr"].tobytes() == third.tobytes()
  assert isinstance(full["mu"]["w"], jax.Array)
  np.testing.assert_array_equal(bits(full["mu"]["w"]), bits(np.arange(6, dtype=np.float32)))
