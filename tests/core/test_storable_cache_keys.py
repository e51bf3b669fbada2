"""A tree structure checked storable does not vouch for a tree jax takes as equal.

jax's tree structures compare dict keys by ``==`` and hash them by ``hash``: a
structure keyed ``True``, ``1.0`` or ``np.int64(1)`` equals one keyed ``1``, and
one keyed ``np.str_("a")`` or a ``str`` subclass's ``"a"`` equals one keyed
``"a"``. A checkpoint stores only keys of exactly ``str``, ``int`` and tuples of
those, so after a storable tree has been taken in memory, a tree of such keys must
still be refused in memory with the words a save refuses it with, on every path
that keeps structures it has seen (the storable check's and the outlines').
"""

from typing import NamedTuple

import jax
import numpy as np
import optax
import pytest

import jaxreshard as jr
from jaxreshard._src.core import storable, structure
from jaxreshard._src.core.ids import path_id

OPT = optax.sgd(0.1, momentum=0.9)
A = np.arange(5, dtype=np.float32)


class Name(str):
  """A str subclass: equal to, and hashed as, the str it holds."""


class Pair(NamedTuple):
  a: int
  b: int


# name -> (a storable key, a key jax takes as equal that no checkpoint stores)
KEYS = {
  "True for 1": (1, True),
  "1.0 for 1": (1, 1.0),
  "np.int64(1) for 1": (1, np.int64(1)),
  "np.str_ for str": ("a", np.str_("a")),
  "a str subclass for str": ("a", Name("a")),
  "(True, 'a') for (1, 'a')": ((1, "a"), (True, "a")),
  "a NamedTuple for a tuple": ((1, 2), Pair(1, 2)),
}


@pytest.fixture(name="fresh")
def _fresh(monkeypatch):
  """No structure checked or outlined yet, whatever ran before in this process."""
  monkeypatch.setattr(storable, "CHECKED", storable._Checked())
  monkeypatch.setattr(structure.OUTLINES, "outlines", {})


def _record(key, pid):
  """One archive of a world of one: an SGD trace of ``{key: A}``, flat."""
  placement = jr.ParamPlacement(pid, A.shape, 0, 1, np.dtype(np.float32), True)
  state = (optax.TraceState(trace={key: A}), optax.EmptyState())
  return jr.ShardRecord(1, (placement,), state, (pid,))


def _refusal(call):
  with pytest.raises(jr.ReshardError) as got:
    call()
  return str(got.value)


@pytest.mark.parametrize("case", sorted(KEYS))
def test_shard_state_refuses_a_key_equal_to_one_it_took(case, fresh, tmp_path):
  good, bad = KEYS[case]

  def shard(key):
    return jr.shard_state(OPT, {key: A}, OPT.init({key: A}), 2)

  want = _refusal(lambda: shard(bad))  # nothing checked yet
  assert "state node at (0, 'trace'): dict keys must be all str" in want, want
  saved = _refusal(lambda: jr.save_records(tmp_path / "ck", [_record(bad, "k")]))
  assert "state node at (0, 'trace'): dict keys must be all str" in saved, saved
  shard(good)
  assert _refusal(lambda: shard(bad)) == want


@pytest.mark.parametrize("case", sorted(KEYS))
@pytest.mark.parametrize("same_ids", [True, False], ids=["same ids", "own ids"])
def test_records_are_refused_for_a_key_equal_to_one_taken(case, same_ids, fresh, tmp_path):
  """Records of a tree no checkpoint holds are refused by every call, also after
  records of the equal storable tree were taken apart: with that tree's roles (the
  outline of its structure is known) or with their own key paths' (only its check
  is)."""
  good, bad = KEYS[case]
  bad_records = [_record(bad, path_id((jax.tree_util.DictKey(good if same_ids else bad),)))]
  want = _refusal(lambda: jr.unshard_state(bad_records))  # nothing taken yet
  assert "state node at (0, 'trace'): dict keys must be all str" in want, want
  if not same_ids:  # roles a save takes: it refuses the tree alone, in the same words
    assert _refusal(lambda: jr.save_records(tmp_path / "ck", bad_records)) == want
  good_records = jr.shard_state(OPT, {good: A}, OPT.init({good: A}), 1)
  assert good_records[0].roles == bad_records[0].roles or not same_ids
  to_two = jr.plan(good_records, world_size=2, rank=0)
  jr.reshard(good_records, to_two)
  jr.unshard_state(good_records)
  assert _refusal(lambda: jr.unshard_state(bad_records)) == want
  assert _refusal(lambda: jr.reshard(bad_records, to_two)) == want


def _plain_record(record, key):
  """``record`` (one key's trace) built with its fields, numpy buffers, keyed ``key``."""
  (trace,) = record.state[0].trace.values()
  state = (optax.TraceState(trace={key: np.asarray(trace)}), record.state[1])
  return jr.ShardRecord(1, record.placements, state, record.roles)


@pytest.mark.parametrize("case", sorted(KEYS))
def test_a_save_refuses_a_rank_keyed_equal_to_the_rank_before(case, fresh, tmp_path):
  """A save registers a plain record of a structure it has written leaf by leaf
  from that one: a rank whose keys are only equal to the first's is refused as it
  is alone, not written with the first's keys."""
  good, bad = KEYS[case]
  ranks = jr.shard_state(OPT, {good: A}, OPT.init({good: A}), 2)
  first, second = _plain_record(ranks[0], good), _plain_record(ranks[1], bad)
  alone = _refusal(lambda: jr.save_records(tmp_path / "alone", [second]))
  assert alone.startswith("archive 0: state node at (0, 'trace'): dict keys"), alone
  got = _refusal(lambda: jr.save_records(tmp_path / "ck", [first, second]))
  assert got == "archive 1: " + alone.removeprefix("archive 0: ")
  assert not (tmp_path / "ck").exists()
  jr.save_records(tmp_path / "ok", [first, _plain_record(ranks[1], good)])


def test_a_structure_of_exact_keys_is_still_checked_once(fresh, monkeypatch):
  """Trees of str, int and tuple keys hit the checked structures as before."""
  walked = []
  check_tree = storable.check_tree
  monkeypatch.setattr(storable, "check_tree", lambda t: walked.append(1) or check_tree(t))
  for params in ({1: A, 2: A}, {"a": A, "b": A}, {(1, "a"): A, (2, "b"): A}):
    records = jr.shard_state(OPT, params, OPT.init(params), 3)
    jr.shard_state(OPT, params, OPT.init(params), 2)
    jr.unshard_state(records)
    jr.reshard(records, jr.plan(records, world_size=2, rank=1))
  assert len(walked) == 3
  assert jax.tree.structure({1: 0}) == jax.tree.structure({True: 0})  # what jax merges
