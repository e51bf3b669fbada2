"""Hand-built records (``roles=None``): which leaf is whose history is read from the
state's structure, also where a param is named after a node of the optimizer's state
(a param ``mu`` under Adam), and refused as ambiguous only where the state cannot say."""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from tests._core_util import assert_records_equal, assert_trees_bit_equal, random_state


def _records(opt, params, world=2):
  return jr.shard_state(opt, params, random_state(opt, params), world)


def _hand_built(records):
  return [dataclasses.replace(r, roles=None) for r in records]


def test_a_param_named_after_a_state_node_is_inferred_as_optax_says():
  """Adam's ``[0]`` also holds ``count``: only ``[0].mu`` and ``[0].nu`` mirror the
  params, so ``[0].mu['x']`` is param 'x' (not 'mu/x', the longest id its path ends in)."""
  params = {"x": jnp.arange(5.0), "mu": {"x": jnp.arange(3.0)}}
  records = _records(optax.adam(1e-3), params)
  assert records[0].roles == (None, "mu/x", "x", "mu/x", "x")  # optax's own word
  hand = _hand_built(records)
  for rank in range(3):
    plan = jr.plan(records, world_size=3, rank=rank)
    assert_records_equal(jr.reshard(hand, plan), jr.reshard(records, plan))
  assert_trees_bit_equal(jr.unshard_state(hand), jr.unshard_state(records))
  assert jr.digest(hand) == jr.digest(records)


def test_masked_places_count_as_the_params_they_stand_for():
  """``[0].inner_state.trace['x']`` is param 'trace/x' of a mirror at
  ``[0].inner_state`` or param 'x' of one at ``[0].inner_state.trace``: the
  ``optax.MaskedNode`` of 'trace/x' in the latter makes it the whole params tree,
  and puts a place that is no param's below the former."""
  params = {"x": jnp.arange(5.0), "trace": {"x": jnp.arange(3.0)}}
  opt = optax.masked(optax.trace(0.9), {"x": True, "trace": {"x": False}})
  records = _records(opt, params)
  assert records[0].roles == ("x",)
  hand = _hand_built(records)
  plan = jr.plan(records, world_size=3, rank=1)
  assert_records_equal(jr.reshard(hand, plan), jr.reshard(records, plan))
  assert_trees_bit_equal(jr.unshard_state(hand), jr.unshard_state(records))


def test_a_state_that_does_not_say_which_param_a_buffer_is_refused_as_ambiguous(tmp_path):
  """``[0]['mu']['x']`` is param 'mu/x' of a mirror at ``[0]`` or param 'x' of one at
  ``[0]['mu']``: neither holds both params, so nothing in the state chooses."""
  params = {"x": jnp.arange(5.0), "mu": {"x": jnp.arange(3.0)}}
  records = _records(optax.sgd(1e-3, momentum=0.9), params)
  hand = [
    dataclasses.replace(r, state=({"mu": {"x": r.state[0].trace["mu"]["x"]}},), roles=None)
    for r in records
  ]
  needle = (
    "archive 0: the roles of this hand-built record (roles=None) are ambiguous: the buffer"
    " at [0]['mu']['x'] may be param 'mu/x' of a mirror at [0] or param 'x' of a mirror"
    " at [0]['mu'], and the state's structure does not say which; pass roles= to"
    " ShardRecord explicitly"
  )
  for call in (
    lambda: jr.reshard(hand, jr.plan(records, world_size=3, rank=0)),
    lambda: jr.unshard_state(hand),
    lambda: jr.digest(hand),
    lambda: jr.save_records(tmp_path / "ckpt", hand),
  ):
    with pytest.raises(jr.PlacementError, match=re.escape(needle)):
      call()
  assert not (tmp_path / "ckpt").exists()


def _injected(kind: str, lr):
  if kind == "sgd":
    return optax.inject_hyperparams(optax.sgd)(learning_rate=lr)
  if kind == "adam":
    return optax.inject_hyperparams(optax.adam)(learning_rate=lr)
  # One nested in a chain, inside another's inner state.
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=lr)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(lambda: inner)())


def _lr(state, kind):
  if kind == "chain":
    return state[1].inner_state.hyperparams["learning_rate"]
  return state.hyperparams["learning_rate"]


@pytest.mark.parametrize("kind", ["sgd", "adam", "chain"])
def test_an_injected_vector_hyper_parameter_is_a_clock_scalar_where_it_looks_like_a_history(
  kind, tmp_path
):
  """``inject_hyperparams`` keeps its hyper-parameters beside the inner state: a
  vector learning rate at ``.hyperparams['learning_rate']`` over params
  ``{"learning_rate": (8,)}`` at 4 ranks has that param's id at the end of its path
  and its 2 slots, and is a clock scalar, as optax says. It was taken for the
  param's history: every path gave the rate back 4 times over, with no error (and
  under Adam, whose other hyper-parameters are 0-d, the record was refused)."""
  params = {"learning_rate": jnp.arange(8.0)}
  opt = _injected(kind, jnp.array([0.1, 0.2], jnp.float32))
  state = random_state(opt, params)
  want = np.asarray(_lr(state, kind)).view(np.uint32)
  assert want.shape == (2,)
  records = jr.shard_state(opt, params, state, 4)
  hand = _hand_built(records)
  assert jr.digest(hand) == jr.digest(records)
  assert (np.asarray(_lr(jr.unshard_state(hand), kind)).view(np.uint32) == want).all()
  for rank in range(2):
    plan = jr.plan(records, world_size=2, rank=rank)
    got = jr.reshard(hand, plan)
    assert_records_equal(got, jr.reshard(records, plan))
    assert (np.asarray(_lr(got.state, kind)).view(np.uint32) == want).all()
  jr.save_records(tmp_path / "ckpt", hand)
  restored = jr.restore(tmp_path / "ckpt", world_size=2, rank=1)
  assert (np.asarray(_lr(restored.state, kind)).view(np.uint32) == want).all()
