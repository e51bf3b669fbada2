"""Multi-process save and restore with real ``jax.distributed`` jobs on localhost.

One module-scoped job of 2 processes x 4 devices (8 ranks) saves the example
state twice: with ``save_sharded``, and as step 1 of an orbax
``CheckpointManager`` (a ``Composite`` of params and ``ReshardSave(state=...)``,
asynchronous: ``save`` returns while the archive writes are held back, and the
device state is deleted before they run). Then,
concurrently: a 3 processes x 2 devices job and a 1 process x 5 devices job
restore both (the manager's with ``ReshardRestore(mesh=...)``); a 2-process
job whose process 1 raises inside its archive write of step 2 (and whose
primary must hear of it within seconds). Each restoring
process reports the bytes it read and dumps every addressable shard; this
process checks them bit for bit against the single-process core.
"""

import glob
import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import locate as _locate
from jaxreshard._src.cli.commands import app
from jaxreshard._src.core.geometry import FlatShard
from tests import _mp_util as U
from tests._core_util import assert_records_equal, bits

# Every test here is slow: `pytest -m "not slow"` skips them, plain `pytest` runs them.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  """Runs every process group of this module once; yields what they produced."""
  root = str(tmp_path_factory.mktemp("mp"))
  step1, run = os.path.join(root, "step_1"), os.path.join(root, "run")
  with U.ProcessGroup(
    2, 4, "save", os.path.join(root, "save"), {"path": step1, "chunk_bytes": 4096, "run": run}
  ) as g:
    saved = g.check()
  groups = {
    "r6": U.ProcessGroup(
      3,
      2,
      "restore",
      os.path.join(root, "r6"),
      {
        "path": step1,
        "replicated": [2, 3],
        "run": run,
        "resave": os.path.join(root, "step_1_on_3"),
      },
    ),
    "r5": U.ProcessGroup(1, 5, "restore", os.path.join(root, "r5"), {"path": step1, "run": run}),
    # Process 1 raises inside its archive write of step 2; the primary hears
    # of it at once, long before orbax's barrier timeout (longer than the
    # group may run).
    "fail": U.ProcessGroup(
      2,
      4,
      "fail",
      os.path.join(root, "fail"),
      {"run": os.path.join(root, "fail_run"), "fail": 1, "timeout_s": 600},
    ),
    # The primary's disk is full in a save_sharded: its cleanup removes the
    # directory process 1 writes in, and process 1 names the primary's failure.
    "full_disk_primary": U.ProcessGroup(
      2,
      4,
      "full_disk",
      os.path.join(root, "full_disk_primary"),
      {"path": os.path.join(root, "full_disk_primary_ck"), "fail": 0, "bytes": 100},
    ),
    # Process 1's own data refuses the save: it raises, and the primary hears of
    # it at once (neither waits at orbax's barriers for the other).
    **{
      f"refused_{kind}": U.ProcessGroup(
        2,
        4,
        "refused",
        os.path.join(root, f"refused_{kind}"),
        {"path": os.path.join(root, f"refused_{kind}_ck"), "fail": 1, "kind": kind},
      )
      for kind in ("padding", "clock", "split_clock", "clock_replica", "layout", "mesh")
    },
  }
  try:
    for g in groups.values():
      g.__enter__()
    results = {k: g.check() for k, g in groups.items()}
  finally:
    for g in groups.values():
      g.kill()
  yield dict(
    root=root,
    step1=step1,
    run=run,
    saved=saved,
    results=results,
    out={k: g.out for k, g in groups.items()},
  )


@pytest.fixture(scope="module")
def reference():
  opt, params, state, shapes = U.example(seed=0)
  return opt, params, state, jr.shard_state(opt, params, state, 8, trainable=U.trainable())


def test_two_processes_save_eight_ranks(job, reference):
  assert [r["ranks"] for r in job["saved"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  for step in (job["step1"], os.path.join(job["run"], "1", "opt_state")):
    got = jr.load_records(step)
    assert len(got) == 8
    for a, b in zip(got, reference[3]):
      assert_records_equal(a, b)


def test_manager_save_returns_before_the_write_commits(job):
  """``save`` returned while every archive write was held back, then committed."""
  assert isinstance(jr.ReshardCheckpointHandler(), ocp.AsyncCheckpointHandler)
  for res in job["saved"]:
    assert res["in_progress_after_save"] and not res["committed_after_save"], res
    assert res["steps"] == [1]


@pytest.mark.parametrize("name,procs,world", [("r6", 3, 6), ("r5", 1, 5)])
def test_restart_on_other_layout_is_bit_identical(job, reference, name, procs, world):
  records = reference[3]
  expected = [jr.reshard(records, jr.plan(records, world_size=world, rank=r)) for r in range(world)]
  results = job["results"][name]
  assert len(results) == procs
  covered = set()
  for res in results:
    dump = np.load(os.path.join(job["out"][name], f"p{res['process']}.npz"))
    assert len(dump.files) > 0
    for key in dump.files:
      i, device = map(int, key.split(":"))
      rank = res["rank_of"][str(device)]
      want = jax.tree.leaves(expected[rank].state)[i]
      assert np.array_equal(dump[key], bits(want)), (name, key, rank)
      covered.add(rank)
    manager = np.load(os.path.join(job["out"][name], f"p{res['process']}_manager.npz"))
    assert sorted(manager.files) == sorted(dump.files)
    for key in manager.files:  # the manager's restore: the same shards, the same bits
      assert np.array_equal(manager[key], dump[key]), (name, key)
    assert res["manager"] == {"params_equal": True, "structure_equal": True}
    for r, ps in res["placements"].items():
      want = [
        [p.param, list(p.shape), p.rank, p.world_size, np.dtype(p.dtype).name, p.trainable]
        for p in expected[int(r)].placements
      ]
      assert ps == want
    assert res["gather_equals_original"]
  assert covered == set(range(world))


def test_ranks_replicated_across_processes(job, reference):
  """(data 2 x fsdp 3) over 3 processes x 2 devices: every fsdp rank lives on 2 hosts."""
  records = reference[3]
  expected = [jr.reshard(records, jr.plan(records, world_size=3, rank=r)) for r in range(3)]
  results = [res["replicated"] for res in job["results"]["r6"]]
  # Devices 0..5 fill the mesh row by row: process 0 holds ranks 0, 1; process 1
  # ranks 2, 0; process 2 ranks 1, 2. Each rank is written by its first device's process.
  assert [res["ranks"] for res in results] == [[0, 1], [0, 2], [1, 2]]
  assert [res["written"] for res in results] == [[0, 1], [2], []]
  for p, res in enumerate(results):
    dump = np.load(os.path.join(job["out"]["r6"], f"p{p}_rep.npz"))
    for key in dump.files:
      i, device = map(int, key.split(":"))
      want = jax.tree.leaves(expected[res["rank_of"][str(device)]].state)[i]
      assert np.array_equal(dump[key], bits(want)), key
  for got, want in zip(jr.load_records(os.path.join(job["root"], "step_1_on_3")), expected):
    assert_records_equal(got, want)


def _read_plan(step, ranks, world):
  """What restoring ``ranks`` of ``world`` must read, from the checkpoint's own metadata.

  Returns (exact: bytes the ranks' buffers hold, bound: the bytes of every
  stored chunk they overlap + each opened buffer's index, zarr.json and its
  archive's metadata + the checkpoint's index). An archive packs its buffers
  of one dtype by param id, then in the order the state's leaves hold them.
  """
  index_path = os.path.join(step, "jaxreshard.json")
  index = json.load(open(index_path))
  (group,) = index["groups"]
  params = {index["params"][i][0]: index["params"][i] for i in group["params"]}
  source_world = group["world_size"]
  (layout,) = index["layouts"]
  buffers = {}  # pid -> [dtype of each buffer, in leaf order]
  for leaf in layout["leaves"]:
    if isinstance(leaf, list):
      buffers.setdefault(leaf[0], []).append(leaf[1])
  exact, bound, opened = 0, os.path.getsize(index_path), set()
  for s, (name, _, _) in enumerate(index["archives"]):
    meta_path = os.path.join(step, name, "archive.json")
    meta = json.load(open(meta_path))
    offset = {}
    for pid in sorted(buffers):
      src = FlatShard(tuple(params[pid][1]), s, source_world)
      for dtype in buffers[pid]:
        start = offset.get(dtype, 0)
        offset[dtype] = start + src.slots
        item = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
        chunk = meta["buffers"][dtype]["chunk"]
        for r in ranks:
          t = FlatShard(tuple(params[pid][1]), r, world)
          lo, hi = max(t.start, src.start), min(t.stop, src.stop)
          if lo >= hi:
            continue
          exact += (hi - lo) * item
          first = (start + lo - src.rank * src.slots) // chunk
          last = (start + hi - 1 - src.rank * src.slots) // chunk
          bound += (last - first + 1) * (chunk * item + 4)
          if (name, dtype) not in opened:
            opened.add((name, dtype))
            n_chunks = -(-meta["buffers"][dtype]["elements"] // chunk)
            bound += (
              n_chunks * 16 + 4 + os.path.getsize(os.path.join(step, name, dtype, "zarr.json"))
            )
            if name not in {n for n, _ in opened if n == name and _ != dtype}:
              bound += os.path.getsize(meta_path)
  return exact, bound


def _du(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_each_process_reads_only_what_its_ranks_need(job):
  """8 -> 6 on 3 hosts: each host reads its ranks' chunks, not the checkpoint."""
  step1 = job["step1"]
  total = _du(step1)
  report = []
  for res in job["results"]["r6"]:
    exact, bound = _read_plan(step1, res["ranks"], 6)
    report.append(
      dict(
        process=res["process"],
        ranks=res["ranks"],
        read=res["bytes_read"],
        exact=exact,
        chunk_bound=bound,
        checkpoint=total,
      )
    )
    # rchar also counts a few small reads of the runtime; 16 KiB is their slack.
    assert exact <= res["bytes_read"] <= bound + 16 * 1024, report[-1]
    assert res["bytes_read"] < 0.5 * total, report[-1]
  print("\n8 -> 6, bytes read per process:", *report, sep="\n  ")


def test_failed_write_commits_nothing_and_previous_step_restores(job, reference):
  results = job["results"]["fail"]
  assert [r["steps_before"] for r in results] == [[1], [1]]
  # Every process learned that step 2 failed: process 1 from its own write, the
  # primary from process 1 within seconds, naming it and its error (a file too
  # large for the size limit), not from orbax's 600 s barrier timeout.
  assert all(r["error"] for r in results), results
  assert results[0]["error_type"] == "ArchiveError", results
  assert "process 1 did not write its archives" in results[0]["error"], results
  assert "File too large" in results[0]["error"], results
  assert results[0]["seconds"] < 30, results
  run = os.path.join(job["root"], "fail_run")
  assert not os.path.exists(os.path.join(run, "2")), "step 2 was committed"
  for d in glob.glob(os.path.join(run, "2.orbax-checkpoint-tmp*", "default")):
    with pytest.raises(jr.ArchiveError):  # never loadable: the index comes last
      jr.load_records(d)
  records = reference[3]
  with ocp.CheckpointManager(run) as manager:
    assert manager.all_steps() == [1]
    for rank in (0, 5):
      got = manager.restore(1, args=jr.ReshardRestore(world_size=6, rank=rank))
      assert_records_equal(got, jr.reshard(records, jr.plan(records, world_size=6, rank=rank)))


def test_a_clock_leaf_held_in_parts_by_several_processes_is_refused_by_every_one(job):
  """Each archive holds the whole clock; no process holds the whole of this one, and none
  may write a part of it as if it were the clock (one device's part is what a save
  committed before, with no error)."""
  results = sorted(job["results"]["refused_split_clock"], key=lambda r: r["process"])
  for r in results:
    assert r["error_type"] == "PlacementError", r
    assert "clock leaf of shape (8,) is laid out over devices of several processes" in r["error"]
    assert "replicate it (PartitionSpec())" in r["error"], r
    assert r["seconds"] < 30, r
  assert not os.path.exists(os.path.join(job["root"], "refused_split_clock_ck"))


@pytest.mark.parametrize(
  "kind,words",
  [
    ("padding", "padding is not zero"),
    ("clock", "process 1's optimizer clock (its scalars' bits) differs from the primary"),
    ("layout", "process 1's state layout (its tree structure, params' shapes and dtypes"),
    ("mesh", "or mesh (its devices, their order, its axes) differs from the primary"),
  ],
)
def test_a_save_one_process_refuses_fails_at_once_everywhere(job, kind, words):
  """(Refused before orbax's collectives on that process alone, the primary waited in
  them until the process exited; a clock of another step was found by the primary
  only, the other process waiting out the timeout.)"""
  first, second = sorted(job["results"][f"refused_{kind}"], key=lambda r: r["process"])
  assert second["error_type"] == "PlacementError" and words in second["error"], second
  assert first["error_type"] == "ArchiveError", first
  assert "process 1 did not write its archives" in first["error"] and words in first["error"]
  assert first["seconds"] < 30 and second["seconds"] < 30, (first, second)
  assert not os.path.exists(os.path.join(job["root"], f"refused_{kind}_ck"))


def test_a_primary_that_cannot_write_is_named_by_the_other_process(job):
  """The primary's writes fail (its disk full) and its cleanup removes the save's
  directory while process 1 writes there: process 1 named 'another save of the
  same checkpoint'; it now names the primary and its error, at once."""
  first, second = sorted(job["results"]["full_disk_primary"], key=lambda r: r["process"])
  assert first["error_type"] == "ArchiveError" and "File too large" in first["error"], first
  assert second["error_type"] == "ArchiveError", second
  assert "process 0 did not write its archives" in second["error"], second
  assert "File too large" in second["error"] and "another save" not in second["error"], second
  assert first["seconds"] < 30 and second["seconds"] < 30, (first, second)
  assert not os.path.exists(os.path.join(job["root"], "full_disk_primary_ck"))


def test_a_clock_of_another_step_is_refused_where_its_process_writes_no_archive(job):
  """On a 2-D mesh whose "data" axis spans the processes the primary writes every
  archive and process 1 none; process 1's clock one step ahead is refused all the
  same (it was compared only where both processes wrote archives, so this save
  committed the primary's step)."""
  first, second = sorted(job["results"]["refused_clock_replica"], key=lambda r: r["process"])
  words = "process 1's optimizer clock (its scalars' bits) differs from the primary"
  assert second["error_type"] == "PlacementError" and words in second["error"], second
  assert first["error_type"] == "ArchiveError" and words in first["error"], first
  assert first["seconds"] < 30 and second["seconds"] < 30, (first, second)
  assert not os.path.exists(os.path.join(job["root"], "refused_clock_replica_ck"))


def test_a_process_that_never_finishes_writing_fails_the_save_after_its_timeout(tmp_path):
  """Process 1's archive writes hang (they end only once process 0 has reported): the
  primary, told nothing by it, gives up after the save's ``timeout_s`` and names it."""
  path = str(tmp_path / "ck")
  with U.ProcessGroup(
    2, 4, "stall", str(tmp_path / "out"), {"path": path, "stall": 1, "timeout_s": 3}
  ) as g:
    first, second = sorted(g.check(), key=lambda r: r["process"])
  assert first["error_type"] == "ArchiveError", first
  want = "processes [1] did not finish writing their archives within 3 s; nothing is committed"
  assert want in first["error"], first
  assert first["seconds"] < 30, first
  assert second["error"] and "held back until the primary reported" in second["error"], second
  assert not os.path.exists(path)


def test_a_directory_one_process_finds_made_refuses_the_save_in_every_process(tmp_path):
  """Another job's save commits the directory after process 0 looked and before
  process 1 does: every process raises process 1's ArchiveExistsError at once, and
  nothing is written. (Before: process 1 refused alone, and process 0 went on and
  waited for it in the save's collectives.)"""
  path = str(tmp_path / "ck")
  with U.ProcessGroup(
    2,
    4,
    "exists_for_one",
    str(tmp_path / "out"),
    {"path": path, "delay_s": 2, "timeout_s": 20},
    timeout=90,
  ) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  want = f"process 1 refused the save: {path} already exists; jaxreshard never overwrites"
  for r in results:
    assert r.get("error_type") == "ArchiveExistsError" and want in r["error"], results
  assert results[0]["error"] == results[1]["error"]
  assert results[0]["seconds"] < 15 and results[1]["seconds"] < 5, results
  assert sorted(os.listdir(tmp_path)) == ["ck", "out"] and os.listdir(path) == []


def test_a_process_that_comes_to_the_save_after_its_timeout_fails_it_in_every_process(tmp_path):
  """Process 1 comes to save_sharded past the save's ``timeout_s``: process 0 gives up
  on it then, and process 1, coming late, raises the same error at once instead of
  waiting for process 0 in the save's collectives (where the save went on)."""
  path = str(tmp_path / "ck")
  with U.ProcessGroup(
    2,
    4,
    "exists_for_one",
    str(tmp_path / "out"),
    {"path": path, "delay_s": 6, "timeout_s": 2, "make": False},
    timeout=90,
  ) as g:
    first, second = sorted(g.check(), key=lambda r: r["process"])
  why = "processes [1] did not start the save within 2 s"
  assert first.get("error_type") == "ArchiveError", first
  assert f"{why}; nothing was written" in first["error"], first
  assert second.get("error_type") == "ArchiveError", second
  assert second["error"] == first["error"], (first, second)
  assert first["seconds"] < 5 and second["seconds"] < 5, (first, second)
  assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize(
  "kind, error, why",
  [
    ("progress", "ReshardError", "progress must be a callable taking a jaxreshard.Progress"),
    ("shapes", "DtypeError", "param 'dense/bias': shapes gives it only a shape ((3,))"),
  ],
)
def test_a_save_one_process_refused_alone_fails_in_every_process_and_later_saves_commit(
  tmp_path, kind, error, why
):
  """Process 1 refuses its first save_sharded on its own arguments (a progress that
  cannot be called, before it looks at the directory; shapes that do not match the
  state): every process raises that refusal at once, and the saves every process then
  makes with good arguments commit. (Before: process 0 waited for process 1 until the
  timeout and from then on paired each save with process 1's next one, so every later
  save failed; or, for shapes, it waited in the save's collectives for good.)"""
  paths = [str(tmp_path / f"ck{n}") for n in range(3)]
  saves = [{"path": p, "timeout_s": 4} for p in paths]
  saves[0]["bad"] = {"1": kind}
  with U.ProcessGroup(2, 4, "scripted", str(tmp_path / "out"), {"saves": saves}, timeout=90) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  first = [r["saves"][0] for r in results]
  for s in first:
    assert s.get("error_type") == error, results
    assert f"process 1 refused the save: {why}" in s["error"], results
  assert first[0]["error"] == first[1]["error"] and first[0]["seconds"] < 3, results
  for r in results:
    assert [s["error"] for s in r["saves"][1:]] == [None, None], results
  assert not os.path.exists(paths[0])
  for path in paths[1:]:
    assert len(jr.load_records(path)) == 8


def test_a_process_killed_mid_save_commits_nothing_and_the_previous_step_restores(
  tmp_path, reference
):
  """Process 1 of a two-process manager save dies (as a SIGKILL) once it has written one
  archive of step 2, or once it has told the other that its archives are written.
  Whatever becomes of process 0 (here the runtime aborts it once the dead one stops
  sending heartbeats), step 2 is never committed: every reader gives step 1, what was
  left is refused or removed by ``clean``, and step 2 saves again."""
  groups = {
    at: U.ProcessGroup(
      2,
      4,
      "killed",
      str(tmp_path / f"out_{at}"),
      {"run": str(tmp_path / f"run_{at}"), "killed": 1, "at": at, "timeout_s": 30},
    )
    for at in ("archive", "told")
  }
  try:
    for g in groups.values():
      g.__enter__()
    codes = {at: g.wait() for at, g in groups.items()}
  finally:
    for g in groups.values():
      g.kill()
  records = reference[3]
  for at, g in groups.items():
    assert codes[at][1] == 137, g.tail()
    killed = json.load(open(os.path.join(g.out, "p1.json")))
    assert killed["killed"] and killed["steps_before"] == [1], killed
    run = str(tmp_path / f"run_{at}")
    assert not os.path.exists(os.path.join(run, "2")), f"step 2 was committed ({at})"
    leftovers = glob.glob(os.path.join(run, "2.orbax-checkpoint-tmp*"))
    for d in glob.glob(os.path.join(run, "2.orbax-checkpoint-tmp*", "default*")):
      with pytest.raises(jr.ArchiveError, match="a save's temporary directory"):
        jr.load_records(d)
    with ocp.CheckpointManager(run) as manager:
      assert manager.all_steps() == [1]
      got = manager.restore(1, args=jr.ReshardRestore())
    for a, b in zip(got, records, strict=True):
      assert_records_equal(a, b)
    assert _locate.locate(run).step == 1
    result = CliRunner().invoke(app, ["clean", os.path.join(run, "2"), "--all", "--json"])
    assert result.exit_code == 0, result.output
    assert sorted(json.loads(result.stdout)["removed"]) == sorted(leftovers), result.output
    assert glob.glob(os.path.join(run, "*tmp*")) == []
    with ocp.CheckpointManager(run) as manager:
      manager.save(2, args=jr.ReshardSave(records))
      manager.wait_until_finished()
      got = manager.restore(2, args=jr.ReshardRestore())
    for a, b in zip(got, records, strict=True):
      assert_records_equal(a, b)


def test_three_processes_raise_one_error_for_any_mix_of_refusals_and_later_saves_commit(tmp_path):
  """Three processes, four saves: two processes refuse at once for different reasons
  (a progress that cannot be called, shapes that do not match); the parent directory
  is missing for processes 0 and 2 while process 1, two seconds later, refuses its
  progress; process 1 refuses while process 2 comes after the timeout; then a good
  save. Each refused save raises one error, the same in every process, at once; the
  good save commits the exact bits. (Before: process 1 raised its own ReshardError
  where the others raised process 0's FileNotFoundError.)"""
  root = str(tmp_path)
  saves = [
    {"path": f"{root}/a", "timeout_s": 3, "bad": {"1": "progress", "2": "shapes"}},
    {"path": f"{root}/gone/b", "timeout_s": 3, "bad": {"1": "progress"}, "sleep": {"1": 2}},
    {"path": f"{root}/c", "timeout_s": 3, "bad": {"1": "progress"}, "sleep": {"2": 4}},
    {"path": f"{root}/d", "timeout_s": 30},
  ]
  with U.ProcessGroup(3, 2, "scripted", str(tmp_path / "out"), {"saves": saves}, timeout=120) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  got = list(zip(*[r["saves"] for r in results], strict=True))
  for n, (kind, words) in enumerate(
    [
      (("ReshardError", "DtypeError"), "refused the save: "),
      (("FileNotFoundError",), f"refused the save: parent directory {root}/gone of"),
      (("ReshardError",), "process 1 refused the save: progress must be a callable"),
    ]
  ):
    assert len({s["error"] for s in got[n]}) == 1, (n, got[n])  # the same in every process
    assert got[n][0]["error_type"] in kind and words in got[n][0]["error"], (n, got[n])
  assert max(s["seconds"] for s in got[0] + got[1]) < 3, got
  assert got[2][0]["seconds"] < 3 and got[2][1]["seconds"] < 3, got
  assert [s["error"] for s in got[3]] == [None] * 3, got
  assert sorted(os.listdir(tmp_path)) == ["d", "out"]
  opt, params, state, _ = U.example(seed=0)
  want = jr.shard_state(opt, params, state, 6, trainable=U.trainable())
  for a, b in zip(jr.load_records(f"{root}/d"), want, strict=True):
    assert_records_equal(a, b)


def test_every_process_raises_a_refusal_in_its_own_words_and_a_later_save_commits(tmp_path):
  """The directory's name holds a byte that is not UTF-8 (a surrogate in Python's
  str), or newlines and non-ASCII letters: every process refuses the existing
  directory with one ArchiveExistsError naming it. Process 1's state has a deleted
  buffer: every process raises one ArchiveError naming the runtime's error class too.
  A later save commits. (Before: each process raised an ArchiveError of the key-value
  store's TypeError for the first; the class of the last was not named.)"""
  odd = [str(tmp_path / "bad\udcffname"), str(tmp_path / ("é\n☃" * 40))]
  for path in odd:
    os.mkdir(path)
  saves = [{"path": p, "timeout_s": 3} for p in odd] + [
    {"path": str(tmp_path / "gone"), "timeout_s": 3, "bad": {"1": "deleted"}},
    {"path": str(tmp_path / "ok"), "timeout_s": 30},
  ]
  with U.ProcessGroup(2, 4, "scripted", str(tmp_path / "out"), {"saves": saves}, timeout=90) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  got = list(zip(*[r["saves"] for r in results], strict=True))
  named = [odd[0].replace("\udcff", "\\udcff"), odd[1]]
  for n, path in enumerate(named):
    assert got[n][0]["error"] == got[n][1]["error"], got[n]
    assert got[n][0]["error_type"] == "ArchiveExistsError", got[n]
    assert f"refused the save: {path} already exists" in got[n][0]["error"], got[n]
    assert got[n][0]["seconds"] < 3 and got[n][1]["seconds"] < 3, got[n]
  deleted = "process 1 refused the save: RuntimeError: Array has been deleted with shape="
  assert got[2][0]["error"] == got[2][1]["error"], got[2]
  assert got[2][0]["error_type"] == "ArchiveError" and deleted in got[2][0]["error"], got[2]
  assert [s["error"] for s in got[3]] == [None, None], got
  assert len(jr.load_records(tmp_path / "ok")) == 8


def test_saves_after_one_process_refused_its_data_commit(tmp_path, reference):
  """A save that process 1 refuses past the agreement to start it (nonzero padding in
  its shards), then one whose clocks differ (process 0's a step ahead): each fails at
  once in every process, and the next save of the same job commits the exact bits
  (the processes' agreements and orbax's barriers stay paired)."""
  saves = [
    {"path": str(tmp_path / "a"), "timeout_s": 30, "bad": {"1": "padding"}},
    {"path": str(tmp_path / "b"), "timeout_s": 30, "bad": {"0": "clock"}},
    {"path": str(tmp_path / "c"), "timeout_s": 30},
  ]
  with U.ProcessGroup(2, 4, "scripted", str(tmp_path / "out"), {"saves": saves}, timeout=90) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  got = list(zip(*[r["saves"] for r in results], strict=True))
  for n, words in enumerate(["padding is not zero", "optimizer clock (its scalars' bits) differs"]):
    assert got[n][0]["error_type"] == "ArchiveError", got[n]
    assert "process 1 did not write its archives" in got[n][0]["error"], got[n]
    assert got[n][1]["error_type"] == "PlacementError" and words in got[n][1]["error"], got[n]
    assert got[n][0]["seconds"] < 5 and got[n][1]["seconds"] < 5, got[n]
  assert [s["error"] for s in got[2]] == [None, None], got
  assert sorted(os.listdir(tmp_path)) == ["c", "out"]
  for a, b in zip(jr.load_records(tmp_path / "c"), reference[3], strict=True):
    assert_records_equal(a, b)


def test_a_save_one_process_misses_fails_alone_and_the_saves_after_it_commit(tmp_path, reference):
  """Process 1 never makes the first save (its caller skipped it), then fails to look
  for a live save of the second's directory (an ``OSError`` from the storage); both
  processes then make two good saves. Each save is the ``opt`` directory of a step. The first save fails in process 0 once its
  timeout passes, naming process 1; the second fails in both at once, naming the
  storage's error; the last two commit the exact bits. (Before: process 1's second
  save met process 0's first, and the ``OSError`` left process 0 waiting: every later
  save of the job failed.)"""
  root = str(tmp_path)
  for step in range(1, 5):  # each save is a step's "opt": their names differ by the step
    os.mkdir(f"{root}/{step}")
  saves = [
    {"path": f"{root}/1/opt", "timeout_s": 4, "skip": {"1": True}},
    {"path": f"{root}/2/opt", "timeout_s": 30, "bad": {"1": "probe"}},
    {"path": f"{root}/3/opt", "timeout_s": 30},
    {"path": f"{root}/4/opt", "timeout_s": 30},
  ]
  with U.ProcessGroup(2, 4, "scripted", str(tmp_path / "out"), {"saves": saves}, timeout=120) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  got = list(zip(*[r["saves"] for r in results], strict=True))
  assert got[0][1] is None, got
  assert got[0][0]["error_type"] == "ArchiveError", got
  assert "processes [1] did not start the save within 4 s" in got[0][0]["error"], got
  assert got[1][0]["error"] == got[1][1]["error"], got
  assert got[1][0]["error_type"] == "ArchiveError", got
  assert "process 1 refused the save: OSError: [Errno 5] Input/output error" in got[1][0]["error"]
  assert got[1][0]["seconds"] < 3, got  # process 0 came last: the refusal was waiting
  for n in (2, 3):
    assert [s["error"] for s in got[n]] == [None, None], got
  assert [os.listdir(f"{root}/{step}") for step in range(1, 5)] == [[], [], ["opt"], ["opt"]]
  for step in (3, 4):
    for x, y in zip(jr.load_records(f"{root}/{step}/opt"), reference[3], strict=True):
      assert_records_equal(x, y)


def test_a_retry_of_a_save_one_process_missed_commits(tmp_path, reference):
  """Process 1 never makes the first save of ``1/opt`` (its caller skipped it); process
  0's fails once its timeout passes. Both then retry the same directory (process 1 comes
  once process 0 gave up on the first), then save it once more, then save another
  directory of the same name. The retry commits the exact bits in both, the save after
  it is refused in both (the directory exists), and the other directory commits.
  (Before: process 1 met process 0's first save, the one it missed, and raised that
  save's old verdict at once, naming itself; process 0 waited out its timeout: every
  later save of that name failed, each process raising its own error.)"""
  root = str(tmp_path)
  os.makedirs(f"{root}/a/1")
  os.makedirs(f"{root}/b/1")
  first = f"{root}/a/1/opt"
  saves = [
    {"path": first, "timeout_s": 2, "skip": {"1": True}},
    {"path": first, "timeout_s": 20, "sleep": {"1": 5}},
    {"path": first, "timeout_s": 20},
    {"path": f"{root}/b/1/opt", "timeout_s": 20},
  ]
  with U.ProcessGroup(2, 4, "scripted", str(tmp_path / "out"), {"saves": saves}, timeout=90) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  got = list(zip(*[r["saves"] for r in results], strict=True))
  assert got[0][1] is None, got
  assert "processes [1] did not start the save within 2 s" in got[0][0]["error"], got
  assert [s["error"] for s in got[1]] == [None, None], got
  assert [s["error_type"] for s in got[2]] == ["ArchiveExistsError"] * 2, got
  assert got[2][0]["error"] == got[2][1]["error"], got
  assert f"{first} already exists" in got[2][0]["error"], got
  assert [s["error"] for s in got[3]] == [None, None], got
  for path in (first, f"{root}/b/1/opt"):
    for x, y in zip(jr.load_records(path), reference[3], strict=True):
      assert_records_equal(x, y)


def test_processes_that_spell_the_parent_differently_meet(tmp_path, reference):
  """Process 1 reaches the checkpoint's parent through a symbolic link of another name
  (as a host that mounts the storage elsewhere): the two processes' saves are one save,
  and commit the exact bits (the name they meet by has its links resolved)."""
  root = str(tmp_path)
  os.makedirs(f"{root}/real")
  os.symlink(f"{root}/real", f"{root}/link")
  saves = [{"path": f"{root}/real/opt", "paths": {"1": f"{root}/link/opt"}, "timeout_s": 5}]
  with U.ProcessGroup(2, 4, "scripted", str(tmp_path / "out"), {"saves": saves}, timeout=60) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  assert [r["saves"][0]["error"] for r in results] == [None, None], results
  for x, y in zip(jr.load_records(f"{root}/real/opt"), reference[3], strict=True):
    assert_records_equal(x, y)


def test_a_process_given_no_path_raises_at_once_and_the_others_at_their_timeout(tmp_path):
  """Process 1 is given a directory that is not a path (an int: its caller read a
  setting that it lacks): it raises that refusal at once; process 0, which cannot learn
  it under the save's name, raises once its timeout passes; the next save commits."""
  root = str(tmp_path)
  saves = [
    {"path": f"{root}/ck0", "paths": {"1": 5}, "timeout_s": 3},
    {"path": f"{root}/ck1", "timeout_s": 20},
  ]
  with U.ProcessGroup(2, 4, "scripted", str(tmp_path / "out"), {"saves": saves}, timeout=60) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  first = [r["saves"][0] for r in results]
  assert first[1]["error_type"] == "ReshardError", results
  assert "directory must be a path (str or os.PathLike), got int" in first[1]["error"], results
  assert first[1]["seconds"] < 2, results
  assert first[0]["error_type"] == "ArchiveError", results
  assert "processes [1] did not start the save within 3 s" in first[0]["error"], results
  assert 3 <= first[0]["seconds"] < 10, results
  assert [r["saves"][1]["error"] for r in results] == [None, None], results
  assert len(jr.load_records(f"{root}/ck1")) == 8
  assert sorted(os.listdir(root)) == ["ck1", "out"]


def test_processes_with_different_timeouts_raise_one_error_at_the_shortest(tmp_path):
  """Each process gives its own ``timeout_s``, one of them past ``MAX_TIMEOUT_S``. The
  process that waits with the shorter one decides once it passes that the other did not
  come; the other, coming later, raises that same error at once (it does not wait out
  its own 24.8 days). A save with both timeouts commits."""
  root = str(tmp_path)
  saves = [
    {"path": f"{root}/ck0", "timeout_s": {"0": 2, "1": 1e300}, "sleep": {"1": 4}},
    {"path": f"{root}/ck1", "timeout_s": {"0": 1e300, "1": 2}, "sleep": {"0": 7}},
    {"path": f"{root}/ck2", "timeout_s": {"0": 1e300, "1": 30}},
  ]
  with U.ProcessGroup(2, 4, "scripted", str(tmp_path / "out"), {"saves": saves}, timeout=90) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  got = list(zip(*[r["saves"] for r in results], strict=True))
  for n, late in ((0, 1), (1, 0)):
    assert got[n][0]["error"] == got[n][1]["error"], got
    assert f"processes [{late}] did not start the save within 2 s" in got[n][0]["error"], got
    assert got[n][late]["seconds"] < 1, got
  assert [s["error"] for s in got[2]] == [None, None], got
  assert len(jr.load_records(f"{root}/ck2")) == 8
  assert sorted(os.listdir(root)) == ["ck2", "out"]


def test_a_save_of_records_where_one_process_passes_other_records_fails_everywhere(
  tmp_path, reference
):
  """A save of records: the primary writes every archive from its own records. A
  process whose records differ (one bit of one history element; a clock one step
  ahead) refused nothing and the checkpoint held the primary's state, which that
  process restored as its own. Now every process's records are digested and compared
  with the primary's: the save fails in every process at once, nothing is committed,
  and the saves after it commit the same records exactly."""
  saves = [{"process": 1, "kind": "bits"}, {"process": 1, "kind": "clock"}, {}]
  run = str(tmp_path / "run")
  with U.ProcessGroup(
    2, 4, "records_saves", str(tmp_path / "out"), {"run": run, "saves": saves}, timeout=120
  ) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  words = "process 1's records (their placements, structure, dtypes or bits) differ"
  for r in results:
    for s in r["saves"][:2]:
      assert s["error"] is not None and words in s["error"], results
    assert r["saves"][2]["error"] is None and r["steps"] == [3], results
  # Orbax leaves a failed step's temporary directory (a later manager removes it).
  assert [n for n in os.listdir(run) if "orbax-checkpoint-tmp" not in n] == ["3"]
  _, _, _, records = reference
  assert jr.digest(os.path.join(run, "3", "default")) == jr.digest(records)


def test_processes_of_one_restore_that_open_two_saves_fail_in_every_process(tmp_path):
  """Each process reads the ranks of its own devices: processes that opened two saves
  (a step number read at two moments, a stale copy of the run on one host) made
  global arrays whose halves were of two saves, and a clock that differed between
  processes, with no error. Every process now tells the others the identity of the
  state it opened before any byte is read: flat or onto a target, two saves fail in
  every process; a process that cannot open its checkpoint is named by the other,
  and one that never comes after the timeout; one save restores. Processes whose
  targets are laid out differently fail in every process too."""
  opt = U.optimizer()
  paths = {}
  for step in (1, 2):
    _, params, state, _ = U.example(seed=step)
    state = jax.tree.map(lambda x: x + (step - 1) if np.ndim(x) == 0 else x, state)
    paths[step] = str(tmp_path / f"step{step}")
    jr.save_records(paths[step], jr.shard_state(opt, params, state, 8, trainable=U.trainable()))
  # A long path of characters JSON escapes (their words once cut the message).
  far = tmp_path / ("检查点" * 25) / ("長い道" * 25) / ("ü" * 120) / "ck"
  shutil.copytree(paths[1], far)
  two = {"0": paths[2], "1": paths[1]}
  cases = [
    {"paths": two, "target": False},
    {"paths": two, "target": True},
    {"paths": {"0": paths[1], "1": str(tmp_path / "gone")}, "target": False},
    {"paths": {"0": paths[1], "1": paths[1]}, "target": False},
    {"paths": {"0": paths[2], "1": paths[2]}, "target": True},
    # Process 1 refuses its own arguments: every process counts the restore, so that
    # two saves after it are still found, and one save restores.
    {"paths": {"0": paths[1], "1": paths[1]}, "axis": {"1": "nope"}},
    {"paths": two, "target": False},
    {"paths": {"0": paths[1], "1": paths[1]}, "target": False},
    {"paths": {"0": str(far), "1": str(far)}, "target": True},
    # Process 1 restores onto the same devices in two rows: another mesh.
    {"paths": {"0": paths[1], "1": paths[1]}, "rows": {"1": True}},
    # Process 1's target is laid out on that other mesh: each process would make its
    # part of another global array (targets were not compared), then one restores.
    {"paths": {"0": paths[1], "1": paths[1]}, "rows": {"1": True}, "target": True},
    {"paths": {"0": paths[1], "1": paths[1]}, "target": True},
    # Last: process 1 never comes (its count of restores stays one behind).
    {"paths": {"0": paths[2]}, "target": False, "timeout_s": 3},
  ]
  with U.ProcessGroup(
    2, 4, "restore_two_saves", str(tmp_path / "out"), {"cases": cases}, timeout=120
  ) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  two_saves = "the processes of this restore opened checkpoints of two saves"
  late = results[0]["cases"][12]
  assert late["error_type"] == "ArchiveError" and late["seconds"] < 30, late
  assert "processes [1] did not come to this restore within 3 s" in late["error"], late
  bad_axis = [r["cases"][5] for r in results]
  assert "process 1 refused this restore (" in bad_axis[0]["error"], bad_axis
  assert "nope" in bad_axis[1]["error"] and bad_axis[0]["seconds"] < 30, bad_axis
  for r in results:
    assert two_saves in r["cases"][6]["error"] and r["cases"][7]["error"] is None, r
    assert r["cases"][8]["error"] is None and r["cases"][8]["count"] == r["cases"][7]["count"], r
    assert "process 1 restores onto another mesh" in r["cases"][9]["error"], r
    other_target = r["cases"][10]
    assert other_target["error_type"] == "PlacementError", r
    assert "process 1 restores onto another target than process 0" in other_target["error"], r
    assert r["cases"][11]["error"] is None and r["cases"][11]["count"] == r["cases"][7]["count"], r
    flat, target, gone, one, one_target = r["cases"][:5]
    for case in (flat, target):
      assert case["error_type"] == "PlacementError" and two_saves in case["error"], r
    if r["process"] == 1:
      assert gone["error_type"] == "FileNotFoundError", r
    else:
      assert gone["error_type"] == "ArchiveError", r
      assert "process 1 refused this restore (FileNotFoundError: " in gone["error"], r
      assert "FileNotFoundError" in gone["error"] and gone["seconds"] < 30, r
    assert one["error"] is None and one_target["error"] is None, r

  def count(seed):
    leaves = jax.tree.leaves(U.example(seed=seed)[2])
    return int(next(x for x in leaves if not np.ndim(x) and np.issubdtype(x.dtype, np.integer)))

  assert [r["cases"][3]["count"] for r in results] == [count(1)] * 2
  assert [r["cases"][4]["count"] for r in results] == [count(2) + 1] * 2


def test_a_refusal_while_one_process_reads_its_part_fails_every_process(tmp_path):
  """The processes agree on the state they opened before any byte is read; what one
  refused while it read its part (a chunk that fails its crc32c in an archive only
  its ranks read, a target whose dtype its data does not match) came back from
  that process alone, and the other handed back its half of the global arrays of
  a state refused. Every process now raises, the others naming the refusing one,
  and a restore after it restores in both. (A target whose dtype differs in one
  process is now refused in both before any byte is read: the targets differ.)"""
  opt = U.optimizer()
  _, params, state, _ = U.example(seed=1)
  good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
  jr.save_records(good, jr.shard_state(opt, params, state, 8, trainable=U.trainable()))
  shutil.copytree(good, bad)
  # A bit of archive 7's data, which only process 1's ranks (4-7) read.
  data = os.path.join(bad, sorted(d for d in os.listdir(bad) if d.startswith("archive_"))[7])
  data = os.path.join(data, "float32", "c", "0")
  with open(data, "r+b") as f:
    f.seek(os.path.getsize(data) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 1]))
  both = lambda p: {"0": p, "1": p}  # noqa: E731
  cases = [
    {"paths": both(bad), "target": False},
    {"paths": both(good), "target": True, "wrong_dtype": {"1": True}},
    {"paths": both(good), "target": False},
  ]
  with U.ProcessGroup(
    2, 4, "restore_two_saves", str(tmp_path / "out"), {"cases": cases}, timeout=120
  ) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  first, second = results
  assert "fails its crc32c check" in second["cases"][0]["error"], second
  assert "process 1 refused its part of this restore" in first["cases"][0]["error"], first
  assert "fails its crc32c check" in first["cases"][0]["error"], first
  for r in results:
    assert r["cases"][1]["error_type"] == "PlacementError", r
    assert "process 1 restores onto another target than process 0" in r["cases"][1]["error"], r
  assert [r["cases"][2]["error"] for r in results] == [None, None], results


def test_the_process_that_never_comes_to_a_restore_is_the_one_named(tmp_path):
  """Of three processes, the third never comes: the first names it after its wait,
  and the second, waiting for the first's verdict a little longer, names it too
  (before: the second's wait ended with the first's, and it named the first). A
  restore onto a mesh of the first two, which the third calls too, restores in
  those two and is refused in words in the third (before: a TypeError there)."""
  opt = U.optimizer()
  _, params, state, _ = U.example(seed=1)
  path = str(tmp_path / "ck")
  jr.save_records(path, jr.shard_state(opt, params, state, 6, trainable=U.trainable()))
  cases = [
    # A mesh of processes 0 and 1: process 2, which calls it too (as every process
    # calls a manager's restore), is refused in words and takes no part.
    {"paths": {"0": path, "1": path, "2": path}, "mesh_of": [0, 1]},
    {"paths": {"0": path, "1": path, "2": path}, "mesh_of": [0, 1], "target": True},
    {"paths": {"0": path, "1": path}, "timeout_s": 3, "grace_s": 5},
  ]
  with U.ProcessGroup(
    3, 2, "restore_two_saves", str(tmp_path / "out"), {"cases": cases}, timeout=120
  ) as g:
    results = sorted(g.check(), key=lambda r: r["process"])
  for r in results[:2]:
    subset, subset_target, case = r["cases"]
    assert subset["error"] is None and subset_target["error"] is None, r
    assert case["error_type"] == "ArchiveError", r
    assert "processes [2] did not come to this restore within 3 s" in case["error"], r
  subset, subset_target, skipped = results[2]["cases"]
  assert subset["error_type"] == "PlacementError", subset
  assert "process 2 holds none of the mesh's devices" in subset["error"], subset
  assert "process 2 holds none of the target's devices" in subset_target["error"], subset_target
  assert skipped == {"error": None, "skipped": True}
