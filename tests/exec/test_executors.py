"""The two executors: numpy copies on the host (nothing compiled), jitted gathers on a device.

Compile counts come from jax's own backend-compile monitoring event (every XLA
compilation in the process, whoever asked for it) and from the device
executor's program cache.
"""

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxreshard as jr
from jaxreshard._src.core import copyplan as _copyplan
from jaxreshard._src.engine import sources as _sources
from tests._core_util import (
  BF16,
  F16,
  F32,
  assert_bits_equal,
  assert_records_equal,
  assert_trees_bit_equal,
  bits,
  count_xla_compiles,
  oracle_shard,
  special_values,
)


def _adam_records(n_params, world, seed=0):
  """An Adam state of ``n_params`` parameters of distinct sizes, as numpy, sharded."""
  rng = np.random.default_rng(seed)
  params = {f"layer{i:04d}": np.zeros((3 * i + 1,), np.float32) for i in range(n_params)}
  opt = optax.adam(1e-3)
  adam, rest = opt.init(params)
  fill = lambda t: jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), t)
  state = (adam._replace(mu=fill(adam.mu), nu=fill(adam.nu)), rest)
  return jr.shard_state(opt, params, state, world), state


@pytest.mark.slow
def test_host_path_compiles_nothing():
  records, state = _adam_records(60, 8)
  with count_xla_compiles() as compiles:
    targets = jr.reshard_ranks(records, [jr.plan(records, world_size=6, rank=r) for r in range(6)])
    back = jr.reshard_ranks(targets, [jr.plan(targets, world_size=8, rank=r) for r in range(8)])
  assert compiles["n"] == 0, f"{compiles['n']} XLA compilations on the host path"
  for a, b in zip(back, records, strict=True):
    assert_records_equal(a, b)
  # A target's history buffers are views of one buffer per dtype.
  leaves = [x for x, r in zip(jax.tree.leaves(targets[2].state), targets[2].roles) if r]
  assert all(isinstance(x, np.ndarray) for x in leaves)
  assert len({id(x.base) for x in leaves}) == 1
  assert_trees_bit_equal(jr.unshard_state(targets), state)


def test_reshard_ranks_equals_reshard_rank_by_rank():
  records, _ = _adam_records(12, 5)
  plans = [jr.plan(records, world_size=7, rank=r) for r in range(7)]
  for a, rank in zip(jr.reshard_ranks(records, plans), range(7)):
    assert_records_equal(a, jr.reshard(records, plans[rank]))


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_device_executor_equals_host_executor_bit_for_bit(dtype):
  """The device executor, forced on the CPU backend, on special values and padding."""
  opt = optax.sgd(0.1, momentum=0.9)
  sv = special_values(dtype)
  full = np.resize(sv, 37)
  params = {"w": np.zeros((37,), dtype), "s": np.zeros((), dtype), "v": np.zeros((5,), dtype)}
  state = (
    optax.TraceState(trace={"w": full, "s": sv[:1].reshape(()), "v": sv[2:7]}),
    optax.EmptyState(),
  )
  records = jr.shard_state(opt, params, state, 5)
  on_device = [dataclasses.replace(r, state=jax.device_put(r.state)) for r in records]
  for rank in range(7):
    migrations = jr.plan(records, world_size=7, rank=rank)
    host = jr.reshard(records, migrations, executor="host")
    device = jr.reshard(on_device, migrations, executor="device")
    assert_records_equal(device, host)
    assert isinstance(jax.tree.leaves(device.state)[-1], jax.Array)
    assert_bits_equal(host.state[0].trace["w"], oracle_shard(full, 7, rank))


@pytest.mark.slow
def test_device_program_count_does_not_grow_with_parameters():
  counts = {}
  for n in (10, 100, 400):
    records, _ = _adam_records(n, 8, seed=n)
    on_device = [dataclasses.replace(r, state=jax.device_put(r.state)) for r in records]
    jr.clear_kernel_cache()
    jr.reshard(on_device, jr.plan(on_device, world_size=6, rank=2), executor="device")
    counts[n] = jr.kernel_cache_info().programs
  # A gather per run-count bucket, one zeros program, one split: a handful per
  # dtype, never one per buffer.
  assert max(counts.values()) <= 8, counts
  assert counts[400] - counts[10] <= 3, counts


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_device_executor_past_the_staging_bound_equals_host_and_compiles_a_bounded_few(
  dtype, monkeypatch
):
  """Archives of more leaves than one program takes (``STAGE_ABOVE``) are packed and
  split through host memory: the same bits as the host executor (special values,
  a scalar and size-1 params, 5 -> 7 with an all-padding rank), a handful of
  programs, and none with an argument or result per leaf."""
  from jaxreshard._src.exec import device as dx
  from jaxreshard._src.exec import kernels

  def run(n):
    opt = optax.sgd(0.1, momentum=0.9)
    sv = special_values(dtype)
    sizes = [0 if i == 0 else 1 if i == 1 else 2 + (7 * i) % 41 for i in range(n)]
    params = {f"p{i:04d}": np.zeros((m,) if m else (), dtype) for i, m in enumerate(sizes)}
    trace = {k: np.resize(np.roll(sv, i), v.shape) for i, (k, v) in enumerate(params.items())}
    records = jr.shard_state(opt, params, (optax.TraceState(trace=trace), optax.EmptyState()), 5)
    on_device = [dataclasses.replace(r, state=jax.device_put(r.state)) for r in records]
    jr.clear_kernel_cache()
    with count_xla_compiles() as compiles:
      for rank in (0, 6):  # rank 6 of 7 holds only padding of the smallest params
        migrations = jr.plan(records, world_size=7, rank=rank)
        device = jr.reshard(on_device, migrations, executor="device")
        assert_records_equal(device, jr.reshard(records, migrations, executor="host"))
    return compiles["n"], {key[0] for key in kernels._CACHE.programs}

  for n in (300, 1200):  # as many leaves per archive and per target
    assert n > dx.STAGE_ABOVE
    compiles, kinds = run(n)
    assert compiles <= 8 and not kinds & {"pack", "split"}, (n, compiles, kinds)
  # The same below the bound: programs pack each archive layout and split the target.
  monkeypatch.setattr(dx, "STAGE_ABOVE", 1000)
  assert {"pack", "split"} <= run(300)[1]


@pytest.mark.slow
def test_second_device_reshard_of_the_same_layout_compiles_nothing():
  records, _ = _adam_records(30, 8)
  later, _ = _adam_records(30, 8, seed=1)  # a restart from a later checkpoint
  dev = lambda rs: [dataclasses.replace(r, state=jax.device_put(r.state)) for r in rs]
  records, later = dev(records), dev(later)
  jr.reshard(records, jr.plan(records, world_size=6, rank=3), executor="device")
  info = jr.kernel_cache_info()
  with count_xla_compiles() as compiles:
    jr.reshard(later, jr.plan(later, world_size=6, rank=3), executor="device")
  assert jr.kernel_cache_info() == info and compiles["n"] == 0


def test_the_device_executor_keeps_a_bounded_number_of_programs(monkeypatch):
  """Layout after layout (a new param size each time) compiled programs that the
  process kept for good; past the bound the least recently used go, and a layout
  whose programs went compiles them again and gives the same bits."""
  from jaxreshard._src.exec import kernels

  monkeypatch.setattr(kernels, "MAX_PROGRAMS", 6, raising=False)
  jr.clear_kernel_cache()
  opt = optax.sgd(0.1, momentum=0.9)

  def reshard_one(count):
    full = np.arange(1, count + 1, dtype=np.float32)
    state = (optax.TraceState(trace={"w": full}), optax.EmptyState())
    records = jr.shard_state(opt, {"w": np.zeros((count,), np.float32)}, state, 4)
    records = [dataclasses.replace(r, state=jax.device_put(r.state)) for r in records]
    out = jr.reshard(records, jr.plan(records, world_size=3, rank=1), executor="device")
    assert_bits_equal(out.state[0].trace["w"], oracle_shard(full, 3, 1))
    return jr.kernel_cache_info().programs

  held = [reshard_one(count) for count in range(40, 400, 40)]
  assert max(held) <= 6 and held[-1] == 6, held
  before = jr.kernel_cache_info().traces
  reshard_one(40)  # its programs were dropped: traced again, the same bits
  assert jr.kernel_cache_info().traces > before


def _overlapping_source_ranks(count, src, dst, rank):
  s, t = -(-count // src), -(-count // dst)
  lo, hi = rank * t, min((rank + 1) * t, count)
  return [r for r in range(src) if max(lo, r * s) < min(hi, (r + 1) * s, count)]


@pytest.mark.parametrize(
  "count, src, dst", [(48, 8, 6), (1000, 8, 6), (37, 5, 7), (1000, 16, 3), (5, 4, 2), (5, 2, 4)]
)
def test_a_target_rank_reads_only_overlapping_source_buffers(count, src, dst):
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": np.zeros((count,), np.float32)}
  full = np.arange(1, count + 1, dtype=np.float32)
  state = (optax.TraceState(trace={"w": full}), optax.EmptyState())
  records = jr.shard_state(opt, params, state, src)
  sources = _sources.record_sources(records)
  for rank in range(dst):
    target = jr.reshard(records, jr.plan(records, world_size=dst, rank=rank))
    assert_bits_equal(target.state[0].trace["w"], oracle_shard(full, dst, rank))
    groups = jr_validate(sources, records, dst, rank)
    runs, keys = _copyplan.plan_runs(
      groups,
      _copyplan.target_layout(groups),
      lambda a, g, m, d: sources.locate_runs(groups, a, g, m, d),
    )
    # One run per overlapping source rank, reading only inside that rank's slots.
    assert sorted(a for a, _, _ in keys) == _overlapping_source_ranks(count, src, dst, rank)
    (r,) = runs.values()
    assert r.elements == jr.FlatShard((count,), rank, dst).owned
    assert (r.src + r.length <= -(-count // src)).all()


def jr_validate(sources, records, dst, rank):
  from jaxreshard._src.engine import pipeline as _pipeline

  return _pipeline.validate(sources, jr.plan(records, world_size=dst, rank=rank))


def test_sources_committed_to_different_devices():
  # Each rank's archive on its own device (8 simulated CPU devices): the device
  # executor gathers them on one device, the host executor reads them all.
  assert jax.device_count() >= 4
  records, state = _adam_records(6, 4)
  placed = [
    dataclasses.replace(r, state=jax.device_put(r.state, jax.devices()[i]))
    for i, r in enumerate(records)
  ]
  for executor in ("host", "device"):
    for rank in range(3):
      target = jr.reshard(placed, jr.plan(placed, world_size=3, rank=rank), executor=executor)
      assert_bits_equal(
        target.state[0].mu["layer0003"], oracle_shard(state[0].mu["layer0003"], 3, rank)
      )
  assert_trees_bit_equal(jr.unshard_state(placed), state)


def test_validation_is_cached_per_record_list_and_never_keeps_records_alive():
  records, _ = _adam_records(5, 4)
  first = _sources.record_sources(records)
  assert _sources.record_sources(list(records)) is first  # rank after rank: validated once
  n = len(_sources.CACHE)
  del records, first
  gc.collect()
  assert len(_sources.CACHE) < n  # the entry went with its records


def test_records_taken_apart_again_after_a_clock_change_register_nothing_more():
  """Records that live on while their clock changes between calls (a learning rate
  replaced in ``hyperparams``, as the README describes) are taken apart again at
  each call; each call also registered one finalizer per record, none released
  while the records lived (8 more per call here). Now the ones of the first call
  stay the only ones, and the entry still goes with its records."""
  import weakref

  opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
  params = {"w": jnp.zeros((100,))}
  records = jr.shard_state(opt, params, opt.init(params), world_size=8)
  live = lambda: sum(isinstance(o, weakref.finalize) for o in gc.get_objects())
  jr.reshard(records, jr.plan(records, world_size=6, rank=1))
  before = live()
  for i in range(50):
    for r in records:
      r.state.hyperparams["learning_rate"] = jnp.asarray(i / 4, jnp.float32)
    out = jr.reshard(records, jr.plan(records, world_size=6, rank=1))
    assert float(out.state.hyperparams["learning_rate"]) == i / 4  # seen afresh
  assert live() <= before
  n = len(_sources.CACHE)
  del records, out
  gc.collect()
  assert len(_sources.CACHE) < n


def test_unknown_executor_is_refused():
  records, _ = _adam_records(2, 2)
  with pytest.raises(jr.PlacementError, match="executor"):
    jr.reshard(records, jr.plan(records, world_size=1, rank=0), executor="gpu")


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_the_device_executor_builds_a_target_rank_that_is_all_padding(dtype):
  """A target rank owning nothing of a dtype reads nothing: zeros, on every executor."""
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": jnp.arange(3, dtype=dtype)}
  state = jax.tree.map(lambda x: x + 1, opt.init(params))
  records = jr.shard_state(opt, params, state, world_size=1)
  plan = jr.plan(records, world_size=4, rank=3)  # slots 1: rank 3 is all padding
  host = jr.reshard(records, plan, executor="host")
  device = jr.reshard(records, plan, executor="device")
  assert_records_equal(device, host)
  assert bits(device.state[0].trace["w"]).tolist() == [0]


def test_the_device_executor_packs_each_archive_once_per_call(monkeypatch):
  """The padding check and the gathers of one call share each archive's pack, and
  a call's packs are only those of its latest reads (no second copy of every
  source kept on the device)."""
  from jaxreshard._src.engine import devicefetch as _devicefetch
  from jaxreshard._src.exec import device as _device_exec

  records, _ = _adam_records(12, 5)
  records = [dataclasses.replace(r, state=jax.tree.map(jnp.asarray, r.state)) for r in records]
  packed = []
  real_pack = _device_exec.pack
  monkeypatch.setattr(
    _device_exec,
    "pack",
    lambda leaves: packed.append(tuple(id(x) for x in leaves)) or real_pack(leaves),
  )
  # The last target rank of 3 reads source rank 4 (the last), padding included.
  migrations = jr.plan(records, world_size=3, rank=2)
  target = jr.reshard(records, migrations, executor="device")
  assert len(packed) >= 2 and len(set(packed)) == len(packed), packed  # none packed twice
  assert_records_equal(target, jr.reshard(records, migrations, executor="host"))

  # Packs kept: those of the latest request of each dtype; a kept one is reused.
  src = _sources.record_sources(records)
  packs = _devicefetch.Packs(src)
  packed.clear()
  packs.take([0, 1], np.float32)
  packs.take([1, 2], np.float32)
  assert len(packed) == 3  # archive 1 packed once
  assert sorted(packs._kept[np.dtype(np.float32)]) == [1, 2]
  # Each pack is the archive's float32 buffers, flattened, in packing order.
  ((buf, offsets),) = packs.take([2], np.float32)
  for pid, mirror, leaf in src.packing(2):
    at = offsets[(pid, mirror)]
    assert_bits_equal(np.asarray(buf)[at : at + np.size(leaf)], np.ravel(np.asarray(leaf)))


@settings(max_examples=60, deadline=None)
@given(
  n=st.integers(0, 300),
  size=st.integers(1, 64),
  hits=st.lists(st.integers(0, 299), max_size=3),
  chunk=st.integers(1, 7),
  threads=st.sampled_from([1, 2]),
  seed=st.integers(0, 2**16),
)
def test_any_nonzero_answers_as_one_gather_would(n, size, hits, chunk, threads, seed):
  """``any_nonzero`` against the plain rule (any element at an index is nonzero),
  whatever the chunk, with and without the second thread, -0.0 counted as set."""
  from jaxreshard._src.exec import host as _host

  rng = np.random.default_rng(seed)
  flat = np.zeros(size, np.uint32)
  index = rng.integers(0, size, n)
  for h in hits:
    if h < size:
      flat[h] = np.float32(-0.0).view(np.uint32)
  want = any(flat[i] != 0 for i in index.tolist())
  saved = (_host._GATHER_CHUNK, _host._PARALLEL_BYTES, _host.THREADS)
  try:
    _host._GATHER_CHUNK, _host._PARALLEL_BYTES, _host.THREADS = chunk, 1, threads
    assert _host.any_nonzero(flat, index) is want
  finally:
    _host._GATHER_CHUNK, _host._PARALLEL_BYTES, _host.THREADS = saved


def test_any_nonzero_refuses_an_index_out_of_range():
  from jaxreshard._src.exec import host as _host

  with pytest.raises(IndexError):
    _host.any_nonzero(np.zeros(4, np.uint8), np.array([0, 4]))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_any_nonzero_sees_a_set_element_at_every_position_of_the_index(chunk, threads):
  """One nonzero element read at position ``p`` of the index, for every ``p``: first
  chunk, last chunk, either thread's half."""
  from jaxreshard._src.exec import host as _host

  flat = np.zeros(40, np.uint16)
  index = np.random.default_rng(0).permutation(40)[:23]
  saved = (_host._GATHER_CHUNK, _host._PARALLEL_BYTES, _host.THREADS)
  try:
    _host._GATHER_CHUNK, _host._PARALLEL_BYTES, _host.THREADS = chunk, 1, threads
    assert _host.any_nonzero(flat, index) is False
    for p in index.tolist():
      flat[p] = 0x8000  # -0.0 in f16 and bf16
      assert _host.any_nonzero(flat, index) is True, p
      flat[p] = 0
  finally:
    _host._GATHER_CHUNK, _host._PARALLEL_BYTES, _host.THREADS = saved


@pytest.mark.parametrize("n", [10, 300], ids=["programs", "staged"])
def test_device_executor_takes_an_archive_whose_leaves_lie_on_several_devices(n):
  # Leaves of one archive alternating over two devices, or each replicated over two:
  # the host executor copies them; the device executor moves them onto one device
  # first, as it does the archives of one gather, and gives the same bits.
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  devices = jax.devices()
  params = {f"p{i:03d}": np.zeros((3,), np.float32) for i in range(n)}
  trace = {k: np.arange(3, dtype=np.float32) - i for i, k in enumerate(params)}
  opt = optax.sgd(0.1, momentum=0.9)
  records = jr.shard_state(opt, params, (optax.TraceState(trace=trace), optax.EmptyState()), 2)

  def alternating(r):
    leaves, treedef = jax.tree.flatten(r.state)
    moved = [jax.device_put(x, devices[i % 2]) for i, x in enumerate(leaves)]
    return dataclasses.replace(r, state=jax.tree.unflatten(treedef, moved))

  both = NamedSharding(Mesh(np.array(devices[:2]), ("x",)), P())
  for spread in (
    [alternating(r) for r in records],
    [dataclasses.replace(r, state=jax.device_put(r.state, both)) for r in records],
  ):
    for rank in range(3):
      migrations = jr.plan(records, world_size=3, rank=rank)
      device = jr.reshard(spread, migrations, executor="device")
      assert_records_equal(device, jr.reshard(records, migrations, executor="host"))


def test_staged_device_executor_lands_where_its_programs_would(monkeypatch):
  # Uncommitted sources resharded under jax.default_device: past the staging bound
  # the output is on the device, and as committed, as the programs put it.
  from jaxreshard._src.exec import device as dx

  devices = jax.devices()
  params = {f"p{i:03d}": np.zeros((3,), np.float32) for i in range(dx.STAGE_ABOVE + 1)}
  trace = {k: np.arange(3, dtype=np.float32) + i for i, k in enumerate(params)}
  opt = optax.sgd(0.1, momentum=0.9)
  records = jr.shard_state(opt, params, (optax.TraceState(trace=trace), optax.EmptyState()), 2)
  uncommitted = [dataclasses.replace(r, state=jax.tree.map(jnp.asarray, r.state)) for r in records]
  assert not jax.tree.leaves(uncommitted[0].state)[0].committed
  migrations = jr.plan(records, world_size=3, rank=0)

  def placed():
    with jax.default_device(devices[3]):
      out = jr.reshard(uncommitted, migrations, executor="device")
    leaf = out.state[0].trace["p001"]
    return leaf.devices(), leaf.committed, out

  staged = placed()
  monkeypatch.setattr(dx, "STAGE_ABOVE", 10_000)
  programs = placed()
  assert staged[:2] == programs[:2] and staged[0] == {devices[3]}
  assert_records_equal(staged[2], programs[2])
