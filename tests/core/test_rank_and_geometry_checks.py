"""Rank checks of the paths that group a param's archives, and the exact target geometry
of counts whose products pass int64."""

from __future__ import annotations

import numpy as np
import pytest

import jaxreshard as jr
from jaxreshard._src.core import groups as _groups
from tests._core_util import snapshot
from tests.core.test_refusals import _records, _with_placement
from tests.engine.test_tables import _facts


@pytest.mark.parametrize("call", ["plan", "unshard_state"])
def test_plan_and_unshard_refuse_a_rank_outside_its_world(call):
  """A group whose ranks are 0, 1, 2 and 7 of world_size 4 is refused, naming the ranks."""
  records = _records()
  records[3] = _with_placement(records[3], "a", rank=7)
  before = snapshot(records)
  with pytest.raises(jr.PlacementError) as info:
    if call == "plan":
      jr.plan(records, world_size=6, rank=2)
    else:
      jr.unshard_state(records)
  msg = str(info.value)
  assert "param 'a'" in msg, msg
  assert "ranks [0, 1, 2, 7] of world_size 4" in msg, msg
  assert "missing ranks [3]" in msg, msg
  assert snapshot(records) == before


def _oracle(count: int, rank: int, world: int) -> tuple[int, int, int]:
  """Slots, start and stop of a rank in Python ints: ceil division, clipped to the count."""
  slots = (count + world - 1) // world
  return slots, min(rank * slots, count), min((rank + 1) * slots, count)


@pytest.mark.parametrize(
  "count, rank, world", [(2**63 - 1, 2, 3), (2**63 - 2, 4, 5), (2**62 + 1, 1, 2)]
)
def test_target_geometry_is_exact_where_rank_times_slots_passes_int64(count, rank, world):
  """A target rank's slots, start and stop equal Python-int arithmetic past 2**63."""
  table = _groups.Groups(
    [jr.Migration("p0", (count,), rank, world, (0,))], [_facts("p0", (count,))]
  )
  got = (int(table.slots[0]), int(table.start[0]), int(table.stop[0]))
  assert got == _oracle(count, rank, world)
  assert table.start.dtype == table.stop.dtype == np.int64
