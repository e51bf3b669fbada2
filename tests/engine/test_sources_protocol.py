"""Both kinds of sources answer every question the pipeline asks of a source."""

from __future__ import annotations

import typing

import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.checkpoint import reader as _checkpoint
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.engine import pipeline as _pipeline
from jaxreshard._src.engine import sources as _sources


def _members(protocol: type) -> set[str]:
  """Every method and attribute a protocol (and the protocols it extends) declares."""
  out = set()
  for cls in protocol.__mro__:
    if cls in (object, typing.Protocol, typing.Generic) or not getattr(cls, "_is_protocol", False):
      continue
    out |= set(getattr(cls, "__annotations__", {}))
    out |= {
      k for k, v in vars(cls).items() if callable(v) and (not k.startswith("_") or k == "__len__")
    }
  return out


def _records(world: int = 3):
  params = {"a": np.arange(7, dtype=np.float32), "b": np.ones((2, 3), np.float32)}
  opt = optax.adam(1e-3)
  return jr.shard_state(opt, params, opt.init(params), world)


def test_the_protocol_lists_what_the_pipeline_calls():
  members = _members(_sources.Sources)
  assert {
    "__len__",
    "placement",
    "history",
    "clock_class",
    "skeleton",
    "scalars",
    "template",
    "facts",
    "complete_groups",
    "locate_runs",
  } <= members
  assert {"packing", "buffer", "host_view", "host_views", "on_accelerator"} <= _members(
    _sources.MemorySources
  )


def test_records_in_memory_are_memory_sources():
  src = _sources.record_sources(_records())
  assert isinstance(src, _sources.Sources)
  assert isinstance(src, _sources.MemorySources)
  for name in _members(_sources.MemorySources):
    assert hasattr(src, name), name


def test_an_opened_checkpoint_is_a_source(tmp_path):
  jr.save_records(tmp_path / "ckpt", _records())
  with _checkpoint.open_checkpoint(tmp_path / "ckpt") as ckpt:
    assert isinstance(ckpt, _sources.Sources)
    for name in _members(_sources.Sources):
      assert hasattr(ckpt, name), name
    groups = _pipeline.validate(
      ckpt, jr.plan(jr.load_records(tmp_path / "ckpt"), world_size=2, rank=1)
    )
    assert [g.param for g in groups] == ["a", "b"]


def test_equal_source_tuples_share_their_facts():
  src = _sources.record_sources(_records())
  sources = src.complete_groups()[0][2]
  again = tuple(list(sources))
  assert again is not sources
  assert src.facts("a", again) is src.facts("a", sources)


def test_a_bool_source_is_refused_after_its_equal_int_tuple_was_validated():
  records = _records(2)
  src = _sources.record_sources(records)
  src.facts("a", (0, 1))
  with pytest.raises(jr.PlacementError, match="is a bool"):
    src.facts("a", (False, True))


@pytest.mark.parametrize("block", [1, 3, 4, 16])
def test_cut_runs_cuts_at_every_block_boundary(block):
  rng = np.random.default_rng(block)
  start = rng.integers(0, 40, 50)
  length = rng.integers(0, 12, 50)
  run, k, offset, skip, n = _copyplan.cut_runs(start, length, block)
  expected = []
  for i, (s, m) in enumerate(zip(start.tolist(), length.tolist())):
    for e in range(s, s + m):
      expected.append((i, e // block, e % block, e - s))
  got = [
    (int(r), int(b), int(o) + j, int(sk) + j)
    for r, b, o, sk, m in zip(run, k, offset, skip, n)
    for j in range(int(m))
  ]
  assert got == expected
  assert (n > 0).all() and (offset + n <= block).all()
