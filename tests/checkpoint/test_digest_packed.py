"""Digests of deferred records: later ranks of a layout hashed from their packed buffers.

``digest_records`` digests the first deferred record of a layout param by param and
every later rank of it from its packed buffers (``digestpacked``). The oracle is the
same call with that shortcut off: every record param by param. Digests, and every
problem with its words, must be equal, for sets that are whole, partial, doubled,
mixed with records built eagerly, edited in place, or padded with nonzero bits.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxreshard as jr
from jaxreshard._src.checkpoint import digest as _digest
from jaxreshard._src.checkpoint import digestpacked as _packed
from jaxreshard._src.core.record import deferred_parts
from tests._core_util import random_params, random_state
from tests._shapes import STORAGE_SHAPES

SETTINGS = dict(
  deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
SHAPES = dict(STORAGE_SHAPES, tiny=((1,), jnp.float32), wide=((29,), jnp.float32))


def _records(world: int) -> list:
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=jnp.float32(1e-3))
  params = random_params(SHAPES)
  return jr.shard_state(opt, params, random_state(opt, params), world_size=world)


def _eager(record: jr.ShardRecord) -> jr.ShardRecord:
  leaves, treedef = jax.tree_util.tree_flatten(record.state)
  leaves = [x if role is None else np.array(x) for x, role in zip(leaves, record.roles)]
  return jr.ShardRecord(
    record.version, record.placements, jax.tree_util.tree_unflatten(treedef, leaves), record.roles
  )


def _both(records: list, monkeypatch) -> tuple:
  """The digest with packed ranks, how many ranks they took, and the digest with every
  record param by param."""
  took = []
  add = _packed.PackedRanks.add
  with monkeypatch.context() as m:
    m.setattr(_packed.PackedRanks, "add", lambda self, *a: took.append(add(self, *a)) or took[-1])
    got = _digest.digest_records(records)
  with monkeypatch.context() as m:
    m.setattr(_packed.PackedRanks, "add", lambda self, *a: False)
    want = _digest.digest_records(records)
  return got, sum(took), want


def _assert_same(got, want) -> None:
  assert got.problems == want.problems
  assert (got.structure, got.scalars, dict(got.params)) == (
    want.structure,
    want.scalars,
    dict(want.params),
  )


@pytest.mark.parametrize("world", [1, 2, 5, 8, 12, 40])
def test_a_whole_set_is_digested_from_packed_ranks(world, monkeypatch):
  records = _records(world)
  got, took, want = _both(records, monkeypatch)
  assert took == world - 1  # every rank after the first
  assert not got.problems
  _assert_same(got, want)
  eager, _, _ = _both([_eager(r) for r in records], monkeypatch)
  assert eager == got


@pytest.mark.parametrize("world", [3, 8])
def test_reshard_and_load_outputs_are_digested_from_packed_ranks(world, tmp_path, monkeypatch):
  records = _records(5)
  targets = jr.reshard_ranks(
    records, [jr.plan(records, world_size=world, rank=r) for r in range(world)]
  )
  assert all(deferred_parts(t) is not None for t in targets)
  got, took, want = _both(targets, monkeypatch)
  assert took == world - 1
  _assert_same(got, want)
  jr.save_records(tmp_path / "c", targets)
  loaded, took, want = _both(jr.load_records(tmp_path / "c"), monkeypatch)
  assert took == world - 1
  _assert_same(loaded, want)
  assert loaded == got


def _cases(world: int) -> dict:
  def clock_replaced(r):
    r[2].state.hyperparams["learning_rate"] = jnp.float32(0.5)  # a replaced clock scalar
    return r

  def clock_in_place(r):
    r = [_with_numpy_clock(x) for x in r]
    r = jr.reshard_ranks(r, [jr.plan(r, world_size=world, rank=k) for k in range(world)])
    r[3].state[1][...] = 2.5  # a numpy clock scalar written in place
    return r

  def padded(r):
    for b in deferred_parts(r[-1]).buffers.values():
      b.view(f"u{b.itemsize}")[-1] = 1  # the last rank's last element: padding
    return r

  return {
    "missing rank": lambda r: r[:2] + r[3:],
    "rank twice": lambda r: r + r[1:2],
    "rank 0 twice": lambda r: r + r[:1],
    "reversed": lambda r: r[::-1],
    "eager rank 0": lambda r: [_eager(r[0])] + r[1:],
    "eager rank 1": lambda r: r[:1] + [_eager(r[1])] + r[2:],
    "clock replaced": clock_replaced,
    "clock in place": clock_in_place,
    "padding": padded,
    "other world": lambda r: r[:3] + _records(world + 1)[3:],
  }


def _with_numpy_clock(r: jr.ShardRecord) -> jr.ShardRecord:
  return jr.ShardRecord(
    r.version, r.placements, (r.state, np.asarray(np.pi, np.float64)), r.roles + (None,)
  )


@pytest.mark.parametrize("case", list(_cases(6)))
def test_sets_with_problems_have_the_param_by_param_digest(case, monkeypatch):
  got, took, want = _both(_cases(6)[case](_records(6)), monkeypatch)
  _assert_same(got, want)
  assert bool(got.problems) == (case not in ("reversed", "eager rank 0", "eager rank 1"))
  if case in ("missing rank", "rank twice", "rank 0 twice", "clock replaced", "clock in place"):
    assert took >= 3  # problems found with ranks the shortcut took


@settings(max_examples=25, **SETTINGS)
@given(
  world=st.integers(1, 9),
  picks=st.lists(st.integers(0, 8), min_size=1, max_size=12),
  eager=st.sets(st.integers(0, 11), max_size=4),
)
def test_any_selection_of_ranks_has_the_param_by_param_digest(world, picks, eager, monkeypatch):
  records = _records(world)
  chosen = [records[i % world] for i in picks]
  chosen = [_eager(r) if i in eager else r for i, r in enumerate(chosen)]
  got, _, want = _both(chosen, monkeypatch)
  _assert_same(got, want)


def test_a_record_whose_fields_were_set_by_other_means_is_digested_param_by_param(monkeypatch):
  """A view's strides set in place, or placements put in a (frozen) record's fields
  directly: the record no longer says what its packed buffers hold."""
  records = _records(4)
  view = jax.tree_util.tree_leaves(records[1].state.inner_state[0].mu)[0]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2.4 deprecates it
    view.strides = (0,)
  got, took, want = _both(records, monkeypatch)
  _assert_same(got, want)
  assert took == 2  # ranks 2 and 3
  records = _records(4)
  flipped = tuple(dataclasses.replace(p, trainable=not p.trainable) for p in records[2].placements)
  object.__setattr__(records[2], "placements", flipped)
  got, took, want = _both(records, monkeypatch)
  _assert_same(got, want)
  assert got.problems and took == 2  # ranks 1 and 3
  # Placements that leave out a param whose history the record holds: refused on
  # both paths, as every reshard refuses the archive.
  records = _records(4)
  object.__setattr__(records[2], "placements", records[2].placements[:1])
  for packed in (True, False):
    with monkeypatch.context() as m:
      if not packed:
        m.setattr(_packed.PackedRanks, "add", lambda self, *a: False)
      with pytest.raises(jr.PlacementError, match="archive 2 holds a history for it but does not"):
        _digest.digest_records(records)
