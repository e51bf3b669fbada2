"""Progress of long calls: the ``progress`` callback and the ``"jaxreshard"`` logger."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from tests._core_util import bits

PARAMS = {
  "dense": {"kernel": jnp.arange(39.0).reshape(3, 13) - 7.0, "bias": jnp.linspace(-1.0, 1.0, 5)},
  "scale": jnp.float32(0.5),
}
COUNT = 39 + 5 + 1
OPT = optax.adamw(1e-2, mu_dtype=jnp.bfloat16)  # histories of two dtypes: 2 + 4 bytes each
PER_ELEMENT = 2 + 4


def _state():
  rng = np.random.default_rng(0)

  def fill(x):
    a = np.asarray(x)
    if a.ndim == 0 and a.dtype.kind == "i":
      return jnp.asarray(3, a.dtype)
    return jnp.asarray(rng.standard_normal(a.shape).astype(a.dtype))

  return jax.tree.map(fill, OPT.init(PARAMS))


@pytest.fixture(scope="module")
def records():
  return jr.shard_state(OPT, PARAMS, _state(), 5)


def _stored_bytes(records):
  """Bytes of every flat history buffer (padding included): what a save stores."""
  return sum(
    x.nbytes for r in records for x in map(np.asarray, jax.tree.leaves(r.state)) if x.ndim == 1
  )


def _same_bits(a, b):
  assert [r.placements for r in a] == [r.placements for r in b]
  for ra, rb in zip(a, b):
    for x, y in zip(jax.tree.leaves(ra.state), jax.tree.leaves(rb.state)):
      np.testing.assert_array_equal(bits(x), bits(y))


def _check_events(events, what, total, total_bytes, key):
  assert [e.what for e in events] == [what] * len(events)
  assert [e.done for e in events] == list(range(1, len(events) + 1))
  assert all(e.total == total and e.total_bytes == total_bytes for e in events)
  done = [e.done_bytes for e in events]
  assert done == sorted(done) and done[0] > 0
  if total is not None:
    assert len(events) == total and done[-1] == total_bytes and events[-1].fraction == 1.0
  return [getattr(e, key) for e in events]


def test_save_and_load_report_each_archive_and_every_byte(records, tmp_path):
  stored = _stored_bytes(records)
  saved = []
  jr.save_records(tmp_path / "ckpt", records, progress=saved.append)
  assert _check_events(saved, "save_records", 5, stored, "archive") == [0, 1, 2, 3, 4]
  assert all(e.rank is None for e in saved)
  loaded = []
  back = jr.load_records(tmp_path / "ckpt", progress=loaded.append)
  assert _check_events(loaded, "load_records", 5, stored, "archive") == [0, 1, 2, 3, 4]
  assert [e.done_bytes for e in loaded] == [e.done_bytes for e in saved]
  assert _stored_bytes(back) == stored
  _same_bits(back, records)


def test_save_of_an_iterator_counts_without_a_total(records, tmp_path):
  events = []
  jr.save_records(tmp_path / "ckpt", (r for r in records), progress=events.append)
  _check_events(events, "save_records", None, None, "archive")
  assert events[-1].done_bytes == _stored_bytes(records) and events[-1].fraction is None
  _same_bits(jr.load_records(tmp_path / "ckpt"), records)


@pytest.mark.parametrize("world_size", [7, 3, 1])
def test_restore_ranks_reports_each_rank_and_the_logical_bytes(records, tmp_path, world_size):
  jr.save_records(tmp_path / "ckpt", records)
  events = []
  ranks = list(range(world_size))
  got = jr.restore_ranks(tmp_path / "ckpt", ranks, world_size=world_size, progress=events.append)
  # Every source element is copied once, padding never: the state's logical bytes.
  assert _check_events(events, "restore_ranks", world_size, COUNT * PER_ELEMENT, "rank") == ranks
  want = [jr.reshard(records, jr.plan(records, world_size=world_size, rank=r)) for r in ranks]
  _same_bits(got, want)


def test_restore_reports_its_one_rank(records, tmp_path):
  jr.save_records(tmp_path / "ckpt", records)
  events = []
  got = jr.restore(tmp_path / "ckpt", world_size=7, rank=6, progress=events.append)
  slots = [-(-n // 7) for n in (39, 5, 1)]
  owned = [max(0, min(n, 7 * s) - 6 * s) for n, s in zip((39, 5, 1), slots)]
  assert _check_events(events, "restore", 1, sum(owned) * PER_ELEMENT, "rank") == [6]
  _same_bits([got], [jr.reshard(records, jr.plan(records, world_size=7, rank=6))])


def test_mesh_save_and_restore_report_progress(records, tmp_path):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:6]), ("fsdp",))
  restored = []
  state, placements = jr.restore_sharded(_saved(records, tmp_path), mesh, progress=restored.append)
  assert _check_events(restored, "restore_sharded", 6, COUNT * PER_ELEMENT, "rank") == list(
    range(6)
  )
  saved = []
  jr.save_sharded(
    tmp_path / "six", OPT, state, {p.param: p for p in placements[0]}, mesh, progress=saved.append
  )
  six = jr.load_records(tmp_path / "six")
  assert _check_events(saved, "save_sharded", 6, _stored_bytes(six), "archive") == list(range(6))
  _same_bits(six, [jr.reshard(records, jr.plan(records, world_size=6, rank=r)) for r in range(6)])


def test_restore_to_a_target_reports_each_archive_read(records, tmp_path):
  path = _saved(records, tmp_path)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
  everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere),
    jax.eval_shape(OPT.init, PARAMS),
  )
  events = []
  state, _ = jr.restore_sharded(path, mesh, target=abstract, progress=events.append)
  assert _check_events(events, "restore_sharded", 5, COUNT * PER_ELEMENT, "archive") == list(
    range(5)
  )
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(_state())):
    np.testing.assert_array_equal(bits(np.asarray(x)), bits(y))


def _saved(records, tmp_path):
  path = tmp_path / "ckpt"
  if not path.exists():
    jr.save_records(path, records)
  return path


def test_logging_is_off_by_default_and_has_no_handlers(records, tmp_path, caplog):
  logger = logging.getLogger("jaxreshard")
  assert logger.handlers == [] and logger.level == logging.NOTSET
  with caplog.at_level(logging.WARNING):
    jr.save_records(tmp_path / "ckpt", records)
    jr.load_records(tmp_path / "ckpt")
  assert [r for r in caplog.records if r.name == "jaxreshard"] == []


def test_logging_per_archive_at_debug_and_per_call_at_info(records, tmp_path, caplog):
  with caplog.at_level(logging.DEBUG, logger="jaxreshard"):
    jr.save_records(tmp_path / "ckpt", records)
    jr.restore(tmp_path / "ckpt", world_size=3, rank=1)
  mine = [r for r in caplog.records if r.name == "jaxreshard"]
  debug = [r.getMessage() for r in mine if r.levelno == logging.DEBUG]
  info = [r.getMessage() for r in mine if r.levelno == logging.INFO]
  assert len(debug) == 5 + 1 and all(m.startswith("save_records ") for m in debug[:5])
  assert "archive 4 done (5 of 5)" in debug[4] and "rank 1 done (1 of 1)" in debug[5]
  assert len(info) == 2
  assert info[0].startswith(
    f"save_records {os.fspath(tmp_path / 'ckpt')}: 5 archives, {_stored_bytes(records)} bytes"
  )
  assert info[1].startswith("restore ") and ": 1 rank," in info[1]


def test_a_progress_that_is_not_callable_is_refused_before_any_work(records, tmp_path):
  with pytest.raises(jr.ReshardError, match="progress must be a callable"):
    jr.save_records(tmp_path / "ckpt", records, progress="bar")
  assert not os.path.lexists(tmp_path / "ckpt") and os.listdir(tmp_path) == []
  jr.save_records(tmp_path / "ckpt", records)
  for call in (
    lambda: jr.load_records(tmp_path / "ckpt", progress=1),
    lambda: jr.restore(tmp_path / "ckpt", world_size=2, rank=0, progress=1),
  ):
    with pytest.raises(jr.ReshardError, match="progress must be a callable"):
      call()


def test_a_callback_that_raises_stops_the_save_and_leaves_nothing(records, tmp_path):
  def stop(event):
    if event.done == 3:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    jr.save_records(tmp_path / "ckpt", records, progress=stop)
  assert os.listdir(tmp_path) == []
