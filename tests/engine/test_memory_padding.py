"""Source padding in memory is refused exactly where a read of it from disk is refused.

Each test gives one padding element of one source record nonzero bits, then
asks every path that reads records in memory (``reshard`` with either
executor, ``reshard_ranks`` in every grouping, ``unshard_state``) and the disk
restore of a checkpoint holding the same bits. The expected answer comes from
the flat-shard rule written out below with plain loops, not from the library.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxreshard as jr
from tests._archive_util import padding_unchecked

COUNTS = (1, 3, 5, 8, 9, 17)  # below, at and around the source world size
W = 8


def _records(counts=COUNTS, w=W, dtype=jnp.float32):
  params = {f"p{n:02d}": jnp.zeros((n,), dtype) for n in counts}
  opt = optax.adam(1e-3)
  state = jax.tree.map(lambda x: x + 1 if x.ndim else x, opt.init(params))
  return jr.shard_state(opt, params, state, world_size=w)


def _padding_positions(counts=COUNTS, w=W):
  """(count, source rank, local index) of every padding slot, by the rule."""
  out = []
  for n in counts:
    s = -(-n // w)
    for r in range(w):
      for i in range(s):
        if r * s + i >= n:
          out.append((n, r, i))
  return out


def _readers(n: int, r: int, w: int, m: int) -> set[int]:
  """The target ranks of world ``m`` that read padding slot (rank ``r``) of a count-``n``
  param over ``w`` sources: those that copy from ``r`` when it owns elements, else
  those whose padded slots meet ``r``'s, or, for a rank past the target world's
  padded buffer, target ``r * m // w``."""
  s, ts = -(-n // w), -(-n // m)
  out = set()
  for t in range(m):
    lo, hi = min(t * ts, n), min((t + 1) * ts, n)
    if r * s < n:  # the last owner: read by the targets that copy from it
      if lo < hi and max(lo, r * s) < min(hi, (r + 1) * s):
        out.add(t)
    elif r * s < m * ts:
      if max(t * ts, r * s) < min((t + 1) * ts, (r + 1) * s):
        out.add(t)
    elif t == r * m // w:
      out.add(t)
  return out


def _poke(records, pid, rank, mirror, local, value):
  """Source ``rank``'s buffer ``mirror`` of ``pid`` with ``value``'s bits at ``local``, in place."""
  a = (records[rank].state[0].mu, records[rank].state[0].nu)[mirror][pid]
  a.view(f"u{a.dtype.itemsize}")[local] = value
  return a


def _refused(fn) -> str | None:
  try:
    fn()
  except (jr.PlacementError, jr.ArchiveError) as e:
    return str(e)
  return None


def _message(pid, archive, mirror, local) -> str:
  return f"param {pid!r}: history buffer {mirror} of archive {archive}: padding is not zero" + (
    f" (nonzero bits at local index {local})"
  )


@pytest.mark.parametrize("m", [1, 3, 5, 8, 11])
def test_every_target_rank_refuses_exactly_the_padding_it_reads_as_disk_does(tmp_path, m):
  """Every padding slot of mirror ``nu``, one at a time: each target rank of world ``m``
  resharded in memory refuses exactly when the rule says it reads the slot, and
  so does its restore from a checkpoint holding the same bits."""
  records = _records()
  for k, (n, r, i) in enumerate(_padding_positions()):
    pid = f"p{n:02d}"
    _poke(records, pid, r, 1, i, 0x80000000)  # -0.0
    want = _readers(n, r, W, m)
    path = tmp_path / f"c{k}"
    with padding_unchecked():  # a save refuses it; another writer may not
      jr.save_records(path, records)
    for t in range(m):
      memory = _refused(lambda: jr.reshard(records, jr.plan(records, world_size=m, rank=t)))
      disk = _refused(lambda: jr.restore(path, world_size=m, rank=t))
      assert (memory is not None) == (t in want) == (disk is not None), (n, r, i, t, memory, disk)
      if memory is not None:
        assert memory.startswith(_message(pid, r, 1, i)), memory
        assert "padding is not zero" in disk and f"'{pid}'" in disk
    every = _refused(
      lambda: jr.reshard_ranks(records, [jr.plan(records, world_size=m, rank=t) for t in range(m)])
    )
    assert every is not None and every.startswith(_message(pid, r, 1, i))
    _poke(records, pid, r, 1, i, 0)
  # Zero again everywhere: every path reads the records.
  out = jr.reshard_ranks(records, [jr.plan(records, world_size=m, rank=t) for t in range(m)])
  assert len(out) == m


@settings(max_examples=30, deadline=None)
@given(
  counts=st.lists(st.integers(0, 12), min_size=1, max_size=4),
  w=st.integers(2, 9),
  m=st.integers(1, 9),
  pick=st.integers(0, 2**20),
  ranks=st.sampled_from(["one", "all", "tail", "reversed"]),
  bf16=st.booleans(),
  separate=st.booleans(),
)
def test_every_grouping_of_target_ranks_refuses_what_its_ranks_read(
  counts, w, m, pick, ranks, bf16, separate
):
  """One padding slot with nonzero bits: a ``reshard_ranks`` of some target ranks
  refuses exactly when one of them reads the slot, by the rule, whichever
  grouping (one rank, every rank, the last ranks, every rank in reverse), from
  packed rows or from one array per buffer."""
  records = _records(counts, w, jnp.bfloat16 if bf16 else jnp.float32)
  if separate:
    records = [
      jr.ShardRecord(r.version, r.placements, jax.tree.map(np.array, r.state), r.roles)
      for r in records
    ]
  positions = _padding_positions(counts, w)
  if not positions:
    return
  n, r, i = positions[pick % len(positions)]
  pid = f"p{n:02d}"
  pids = sorted({f"p{c:02d}" for c in counts})
  mirror = (pick // len(positions)) % 2
  _poke(records, pid, r, mirror, i, 0x7FC1)  # a NaN payload in bf16, a subnormal in f32
  targets = {
    "one": [pick % m],
    "all": list(range(m)),
    "tail": list(range(m // 2, m)),
    "reversed": list(range(m))[::-1],
  }[ranks]
  plans = [jr.plan(records, world_size=m, rank=t) for t in targets]
  got = _refused(lambda: jr.reshard_ranks(records, plans))
  # Any param with this count reads the same way; the poked one is ``pid``.
  assert (got is not None) == bool(_readers(n, r, w, m) & set(targets)), (got, targets)
  if got is not None:
    assert got.startswith(_message(pid, r, mirror, i)), got
  assert pid in pids


@pytest.mark.parametrize(
  "dtype, value", [(jnp.float32, 0x80000000), (jnp.float32, 1), (jnp.bfloat16, 0x7FC1)]
)
def test_the_device_executor_refuses_as_the_host_does(dtype, value):
  """-0.0, a subnormal, a bf16 NaN payload: the padding is gathered on the device and
  only the answer comes back; the refusal names the same element as the host's."""
  records = _records(dtype=dtype)
  _poke(records, "p05", 6, 0, 0, value)  # 5 over 8: ranks 5 to 7 are all padding
  plans = [jr.plan(records, world_size=3, rank=t) for t in range(3)]
  host = _refused(lambda: jr.reshard(records, plans[2], executor="host"))
  device = _refused(lambda: jr.reshard(records, plans[2], executor="device"))
  assert host is not None and host == device
  assert host.startswith(_message("p05", 6, 0, 0))
  assert _refused(lambda: jr.reshard(records, plans[0], executor="device")) is None


def test_unshard_state_refuses_nonzero_padding():
  records = _records()
  _poke(records, "p09", 4, 0, 1, 0x80000000)  # 9 over 8: slots 2, rank 4 owns only 8
  got = _refused(lambda: jr.unshard_state(records))
  assert got is not None and got.startswith(_message("p09", 4, 0, 1))


def _strided(records):
  """The same records over numpy arrays not in C order (a host view of each is a copy)."""
  remake = lambda x: np.repeat(np.asarray(x), 2)[::2] if np.ndim(x) else x  # noqa: E731
  return [
    jr.ShardRecord(r.version, r.placements, jax.tree.map(remake, r.state), r.roles) for r in records
  ]


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("executor", ["host", "device"])
def test_a_write_into_padding_between_calls_is_read(strided, executor):
  """The padding is read at each call, as the history buffers are: a write after a
  first reshard refuses the next one (whichever call came first: one rank, every
  rank), and undoing it lets the one after through."""
  records = _records()
  if strided:
    records = _strided(records)
  plans = [jr.plan(records, world_size=3, rank=t) for t in range(3)]
  jr.reshard(records, plans[2], executor=executor)
  before = jr.reshard_ranks(records, plans, executor=executor)
  a = _poke(records, "p17", 7, 1, 2, 1)
  want = _message("p17", 7, 1, 2)
  for call in (
    lambda: jr.reshard(records, plans[2], executor=executor),
    lambda: jr.reshard_ranks(records, plans, executor=executor),
  ):
    got = _refused(call)
    assert got is not None and got.startswith(want), got
  a.view(np.uint32)[2] = 0
  assert _refused(lambda: jr.reshard(records, plans[2], executor=executor)) is None
  again = jr.reshard_ranks(records, plans, executor=executor)
  for x, y in zip(before, again):
    for p, q in zip(jax.tree.leaves(x.state), jax.tree.leaves(y.state)):
      assert np.asarray(p).tobytes() == np.asarray(q).tobytes()


@pytest.mark.parametrize("layout", ["packed", "separate", "strided", "jax"])
def test_every_kind_of_source_buffer_is_read_for_padding(layout):
  """Packed rows (read as one 2-D array), one array per buffer, numpy arrays not in C
  order (copied at each read) and jax arrays: each refuses the same element."""
  records = _records()
  if layout != "packed":

    def remake(x):
      if np.ndim(x) == 0:
        return x
      if layout == "separate":
        return np.array(x)
      if layout == "strided":
        return np.repeat(np.asarray(x), 2)[::2]  # the same values, not C-contiguous
      return jnp.asarray(x)

    records = [
      jr.ShardRecord(r.version, r.placements, jax.tree.map(remake, r.state), r.roles)
      for r in records
    ]
  if layout == "jax":
    bad = np.array(records[6].state[0].mu["p09"])
    bad.view(np.uint32)[0] = 0x80000000
    state = records[6].state
    mu = dict(state[0].mu, p09=jnp.asarray(bad))
    records[6] = jr.ShardRecord(
      records[6].version,
      records[6].placements,
      (state[0]._replace(mu=mu), *state[1:]),
      records[6].roles,
    )
  else:
    _poke(records, "p09", 6, 0, 0, 0x80000000)
  plans = [jr.plan(records, world_size=3, rank=t) for t in range(3)]
  for got in (
    _refused(lambda: jr.reshard_ranks(records, plans)),
    _refused(lambda: jr.reshard(records, plans[2])),
  ):
    assert got is not None and got.startswith(_message("p09", 6, 0, 0)), got
  assert _refused(lambda: jr.reshard(records, plans[0])) is None


def test_explicit_migrations_to_several_target_ranks_read_each_row_s_own():
  """Hand-written migrations whose params go to different target ranks: each row
  reads the padding its own target rank reads, no other."""
  records = _records()
  sources = tuple(range(W))
  # 17 over 8: slots 3, rank 5 owns [15, 17) and one padding slot. Over 3 ranks
  # (slots 6), only rank 2 ([12, 17)) copies from it.
  _poke(records, "p17", 5, 0, 2, 0x80000000)
  mig = lambda pid, n, t: jr.Migration(pid, (n,), t, 3, sources)  # noqa: E731
  assert _refused(lambda: jr.reshard(records, [mig("p09", 9, 2), mig("p17", 17, 1)])) is None
  got = _refused(lambda: jr.reshard(records, [mig("p09", 9, 0), mig("p17", 17, 2)]))
  assert got is not None and got.startswith(_message("p17", 5, 0, 2))


def test_the_refusal_names_the_first_element_in_param_order_across_dtypes_and_ranks():
  """Nonzero bits in two params whose buffers differ in dtype (``mu`` bf16, ``nu``
  f32), and in two source ranks read by different target ranks: the refusal
  names the first param, then the first source rank, whatever the order of the
  dtypes or of the target ranks handed in."""
  params = {"a": jnp.zeros((5,), jnp.float32), "b": jnp.zeros((5,), jnp.float32)}
  opt = optax.adam(1e-3, mu_dtype=jnp.bfloat16)
  state = jax.tree.map(lambda x: x + 1 if x.ndim else x, opt.init(params))
  records = jr.shard_state(opt, params, state, world_size=8)
  records[6].state[0].nu["a"].view(np.uint32)[0] = 1  # 'a', mirror 1 (f32)
  records[6].state[0].mu["b"].view(np.uint16)[0] = 1  # 'b', mirror 0 (bf16)
  want = _message("a", 6, 1, 0)
  for call in (
    lambda: jr.unshard_state(records),
    lambda: jr.reshard(records, jr.plan(records, world_size=3, rank=2)),
    lambda: jr.reshard(records, jr.plan(records, world_size=3, rank=2), executor="device"),
  ):
    got = _refused(call)
    assert got is not None and got.startswith(want), got
  # Two source ranks, read by two target ranks: the lower one is named.
  q = {"d": jnp.zeros((2,), jnp.float32)}
  opt = optax.adam(1e-3)
  state = jax.tree.map(lambda x: x + 1 if x.ndim else x, opt.init(q))
  records = jr.shard_state(opt, q, state, world_size=8)
  records[2].state[0].mu["d"].view(np.uint32)[0] = 1
  records[6].state[0].mu["d"].view(np.uint32)[0] = 1
  plans = [jr.plan(records, world_size=8, rank=t) for t in range(8)]
  for order in (plans, plans[::-1], [plans[6], plans[2]]):
    got = _refused(lambda o=order: jr.reshard_ranks(records, o))
    assert got is not None and got.startswith(_message("d", 2, 0, 0)), got


def _views_of_one_allocation(records, *, read_only=False, shared_zeros=False):
  """The same records, every history buffer a view of one numpy allocation (not in
  packing order: the archives are laid out last first); with ``shared_zeros``
  the buffers of all-padding ranks are one zero array per size, shared by every
  such rank; returns (records, the allocation)."""
  leaves = [[x for x in jax.tree.leaves(r.state) if np.ndim(x)] for r in records]
  big = np.zeros(sum(x.size for ls in leaves for x in ls), np.uint32)
  view = big.view()
  view.flags.writeable = not read_only
  zeros: dict[int, np.ndarray] = {}
  at = 0
  out = [None] * len(records)
  for k in reversed(range(len(records))):
    r = records[k]
    placements = {p.param: p for p in r.placements}

    def remake(path, x, r=r, placements=placements):
      nonlocal at
      if np.ndim(x) == 0:
        return x
      pid = str(path[-1].key)
      p = placements[pid]
      slots = -(-p.shape[0] // p.world_size)
      if shared_zeros and p.rank * slots >= p.shape[0]:
        return zeros.setdefault(x.size, np.zeros(x.size, x.dtype))
      bits = np.asarray(x).view(np.uint32)
      big[at : at + x.size] = bits
      at += x.size
      return view[at - x.size : at].view(x.dtype)

    out[k] = jr.ShardRecord(
      r.version, r.placements, jax.tree_util.tree_map_with_path(remake, r.state), r.roles
    )
  return out, big, zeros


@pytest.mark.parametrize("kind", ["writable", "read-only"])
def test_views_of_one_allocation_are_read_in_place_at_each_call(kind, monkeypatch):
  """Buffers that are views of one allocation (not records ``reshard`` built): each
  target rank refuses exactly the padding the rule says it reads, naming it,
  reading the allocation as it is at each call; read-only views too; no view
  is made per piece of padding when nothing is refused."""
  from jaxreshard._src.engine import padcheck

  records, big, _ = _views_of_one_allocation(_records(), read_only=kind == "read-only")
  m = 3
  plans = [jr.plan(records, world_size=m, rank=t) for t in range(m)]
  pieces = padcheck._by_pieces
  monkeypatch.setattr(padcheck, "_by_pieces", lambda *a: pytest.fail("a view per piece"))
  for t in range(m):
    jr.reshard(records, plans[t])
  monkeypatch.setattr(padcheck, "_by_pieces", pieces)
  for n, r, i in _padding_positions()[::3]:
    pid = f"p{n:02d}"
    a = (records[r].state[0].mu, records[r].state[0].nu)[1][pid]
    at = (a.__array_interface__["data"][0] - big.__array_interface__["data"][0]) // 4
    big[at + i] = 0x80000000
    want = _readers(n, r, W, m)
    for t in range(m):
      got = _refused(lambda: jr.reshard(records, plans[t]))
      assert (got is not None) == (t in want), (n, r, i, t, got)
      if got is not None:
        assert got.startswith(_message(pid, r, 1, i)), got
    big[at + i] = 0
  for t in range(m):
    assert _refused(lambda: jr.reshard(records, plans[t])) is None


def test_one_zero_array_shared_by_every_all_padding_buffer_is_read():
  """All-padding buffers that are one shared zero array per size (runs of padding
  that overlap in memory): read through, and a write into it refuses the
  first param and rank, in order, that the target rank reads it as."""
  records, _, zeros = _views_of_one_allocation(_records(), shared_zeros=True)
  last = jr.plan(records, world_size=3, rank=2)
  before = jr.reshard(records, last)
  zeros[1][0] = 1  # every all-padding buffer of one slot: counts 1, 3 and 5 over 8
  got = _refused(lambda: jr.reshard(records, last))
  # Target rank 2 of 3 (one slot of p01) reads p01's all-padding ranks from its own
  # slot, 2, to the end; mirror 0 first.
  assert got is not None and got.startswith(_message("p01", 2, 0, 0)), got
  zeros[1][0] = 0
  again = jr.reshard(records, last)
  for p, q in zip(jax.tree.leaves(before.state), jax.tree.leaves(again.state)):
    assert np.asarray(p).tobytes() == np.asarray(q).tobytes()


def test_one_target_rank_of_records_shard_state_built_reads_padding_in_place(monkeypatch):
  """Records that ``shard_state`` built (their buffers views of packed buffers): one
  target rank reads the padding it reads in place, no view per piece, at each call.
  Target rank 2 of 3 reads the padding of many buffers in each source rank's packed
  buffer (ranks 0 and 1 read a few, for which views of the pieces cost less)."""
  from jaxreshard._src.engine import padcheck

  records = _records(counts=tuple(range(1, 40)))
  plans = [jr.plan(records, world_size=3, rank=t) for t in range(3)]
  pieces = padcheck._by_pieces
  monkeypatch.setattr(padcheck, "_by_pieces", lambda *a: pytest.fail("a view per piece"))
  jr.reshard(records, plans[2])
  monkeypatch.setattr(padcheck, "_by_pieces", pieces)
  _poke(records, "p17", 7, 1, 2, 1)
  got = _refused(lambda: jr.reshard(records, plans[2]))
  assert got is not None and got.startswith(_message("p17", 7, 1, 2)), got


def _replace(record, mirror, pid, buffer):
  """Puts ``buffer`` in place of a history buffer in the record's own state."""
  (record.state[0].mu, record.state[0].nu)[mirror][pid] = buffer


def test_a_buffer_put_in_a_record_s_state_is_what_every_path_reads(tmp_path):
  """A record ``shard_state`` built whose state gets another array for one of its
  history buffers (its dicts are the caller's): every target rank, one at a time
  or all at once, and a save then restore, read the array the record holds now,
  its padding included, not the packed buffer the record was made from."""
  records = _records(counts=tuple(range(60, 100)), w=16)
  pid, n = "p80", 80
  new = np.array(records[1].state[0].mu[pid])
  new[:] = 42.0
  _replace(records[1], 0, pid, new)
  want = np.asarray(jr.unshard_state(records)[0].mu[pid])
  assert want[5:10].tolist() == [42.0] * 5 and want[:5].tolist() == [1.0] * 5
  plans = [jr.plan(records, world_size=12, rank=t) for t in range(12)]
  every = jr.reshard_ranks(records, plans)
  for t in range(12):
    alone = jr.reshard(records, plans[t])
    slots = -(-n // 12)
    shard = want[t * slots : (t + 1) * slots]
    for got in (every[t], alone):
      mu = np.asarray(got.state[0].mu[pid])
      assert mu[: len(shard)].tobytes() == shard.tobytes(), t
  jr.save_records(tmp_path / "c", records)
  back = jr.load_records(tmp_path / "c")
  assert np.asarray(back[1].state[0].mu[pid]).tobytes() == new.tobytes()


def test_padding_of_a_buffer_put_in_a_record_s_state_is_read_not_the_old_one():
  """Nonzero padding in the array now held is refused; nonzero padding in the
  packed buffer the record no longer holds is not."""
  records = _records(counts=(5, 3, 9), w=4)
  bad = np.array(records[3].state[0].nu["p03"])
  bad.view(np.uint32)[0] = 1  # 3 over 4: rank 3 is all padding
  _replace(records[3], 1, "p03", bad)
  plan = jr.plan(records, world_size=2, rank=1)
  for call in (lambda: jr.reshard(records, plan), lambda: jr.unshard_state(records)):
    got = _refused(call)
    assert got is not None and got.startswith(_message("p03", 3, 1, 0)), got
  records = _records(counts=(5, 3, 9), w=4)
  old = records[3].state[0].nu["p03"]
  _replace(records[3], 1, "p03", np.array(old))
  old.view(np.uint32)[0] = 1  # the packed buffer, no longer held
  assert _refused(lambda: jr.reshard(records, plan)) is None
  assert (
    _refused(
      lambda: jr.reshard_ranks(records, [jr.plan(records, world_size=2, rank=t) for t in range(2)])
    )
    is None
  )


@pytest.mark.parametrize("m", [3, 11])
def test_padding_gathered_in_chunks_by_two_threads_is_refused_as_by_one(monkeypatch, m):
  """The padding check's gathers split between the copy threads and read two
  elements per numpy call: every padding slot is still refused, with its own
  words, by exactly the target ranks that read it, and by every rank at once."""
  from jaxreshard._src.exec import host as _host

  monkeypatch.setattr(_host, "_PARALLEL_BYTES", 1)
  monkeypatch.setattr(_host, "_GATHER_CHUNK", 2)
  halves = []
  gather = _host._any_nonzero
  monkeypatch.setattr(_host, "_any_nonzero", lambda *a: halves.append(a[2]) or gather(*a))
  records = _records()
  for n, r, i in _padding_positions():
    pid = f"p{n:02d}"
    _poke(records, pid, r, 0, i, 1)  # the smallest subnormal
    want = _readers(n, r, W, m)
    for t in range(m):
      got = _refused(lambda: jr.reshard(records, jr.plan(records, world_size=m, rank=t)))
      assert (got is not None) == (t in want), (n, r, i, t, got)
      if got is not None:
        assert got.startswith(_message(pid, r, 0, i)), got
    every = _refused(
      lambda: jr.reshard_ranks(records, [jr.plan(records, world_size=m, rank=t) for t in range(m)])
    )
    assert every is not None and every.startswith(_message(pid, r, 0, i)), every
    _poke(records, pid, r, 0, i, 0)
  assert any(start > 0 for start in halves)  # the second thread's half was read
  out = jr.reshard_ranks(records, [jr.plan(records, world_size=m, rank=t) for t in range(m)])
  assert len(out) == m
