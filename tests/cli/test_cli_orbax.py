"""The command line given an orbax CheckpointManager run, step or item directory (real orbax)."""

import json
import os

import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import merge as _merge
from jaxreshard._src.checkpoint import reader as _reader
from jaxreshard._src.cli.commands import EXIT_ERROR, app
from tests._core_util import assert_records_equal

PARAMS = {"w": np.zeros((7,), np.float32), "b": np.zeros((3,), np.float32)}
OPT = optax.adam(1e-3)


def _records(count, world_size=4):
  state = OPT.init(PARAMS)
  mu = {k: np.arange(v.size, dtype=np.float32) + count for k, v in PARAMS.items()}
  state = (state[0]._replace(count=np.int32(count), mu=mu),) + tuple(state[1:])
  return jr.shard_state(OPT, PARAMS, state, world_size)


def _run(*args):
  result = CliRunner().invoke(app, [str(a) for a in args])
  assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
  return result


def _error(result):
  assert result.exit_code == EXIT_ERROR, result.output
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxreshard: error: "), result.stderr
  return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("orbax")
  with ocp.CheckpointManager(root / "run") as manager:
    for step in (10, 20, 30):
      manager.save(step, args=jr.ReshardSave(_records(step)))
    manager.wait_until_finished()
  with ocp.CheckpointManager(root / "two", item_names=("opt", "ema")) as manager:
    manager.save(
      5, args=ocp.args.Composite(opt=jr.ReshardSave(_records(5)), ema=jr.ReshardSave(_records(6)))
    )
    manager.wait_until_finished()
  for step in (20, 30):
    jr.save_records(root / f"plain{step}", _records(step, world_size=3))
  return root


def test_inspect_takes_the_latest_step_or_the_one_named(run):
  result = _run("inspect", run / "run", "--json")
  assert result.exit_code == 0, result.output
  data = json.loads(result.stdout)
  assert data["orbax"]["step"] == 30 and data["orbax"]["steps"] == [10, 20, 30]
  assert data["orbax"]["item"] == "default" and data["archives"] == 4
  assert [c["value"] for c in data["clocks"]] == [30]
  assert "step 30 (of 10, 20, 30), item 'default'" in result.stderr
  older = json.loads(_run("inspect", run / "run", "--step", 10, "--json").stdout)
  assert [c["value"] for c in older["clocks"]] == [10] and older["orbax"]["step"] == 10
  # A step directory, and the item directory itself, name the same checkpoint.
  step = json.loads(_run("inspect", run / "run" / "20", "--json").stdout)
  assert [c["value"] for c in step["clocks"]] == [20] and step["orbax"]["step"] is None
  item = json.loads(_run("inspect", run / "run" / "20" / "default", "--json").stdout)
  assert item["orbax"] is None and item["clocks"] == step["clocks"]
  text = _run("inspect", run / "run").stdout
  assert "step 30 (of 10, 20, 30), item 'default'): 4 archives" in text


def test_verify_and_reshard_read_orbax_steps(run, tmp_path):
  assert _run("verify", run / "run", run / "plain30").exit_code == 0
  assert _run("verify", run / "run", run / "plain20", "--step", 20).exit_code == 0
  assert _run("verify", run / "run" / "20", run / "plain20").exit_code == 0
  different = _run("verify", run / "run", run / "plain20")
  assert different.exit_code == 1 and "scalar [0].count: 30 != 20" in different.stdout
  out = _run("reshard", run / "run", tmp_path / "six", "-w", 6, "--step", 10)
  assert out.exit_code == 0, out.output
  src = _records(10)
  want = [jr.reshard(src, jr.plan(src, world_size=6, rank=r)) for r in range(6)]
  for a, b in zip(jr.load_records(tmp_path / "six"), want, strict=True):
    assert_records_equal(a, b)


def test_a_link_given_as_the_path_is_followed_and_links_inside_are_not(run, tmp_path):
  """``latest -> run/20`` and a link to the run directory name what their targets
  name (the path is the caller's choice); a step directory inside the run that is
  a link is not a step."""
  import os

  os.symlink(run / "run" / "20", tmp_path / "latest")
  os.symlink(run / "run", tmp_path / "runlink")
  latest = json.loads(_run("inspect", tmp_path / "latest", "--json").stdout)
  assert [c["value"] for c in latest["clocks"]] == [20]
  whole = json.loads(_run("inspect", tmp_path / "runlink", "--json").stdout)
  assert whole["orbax"]["steps"] == [10, 20, 30] and [c["value"] for c in whole["clocks"]] == [30]
  assert _run("verify", tmp_path / "latest", run / "plain20").exit_code == 0
  assert _run("verify", tmp_path / "runlink", run / "plain30").exit_code == 0
  linked = tmp_path / "linked"
  linked.mkdir()
  os.symlink(run / "run" / "20", linked / "40")
  assert "no orbax steps with a jaxreshard item" in _error(_run("inspect", linked))


def test_several_items_need_item(run):
  line = _error(_run("inspect", run / "two"))
  assert "2 jaxreshard items ('ema', 'opt')" in line and "--item NAME" in line, line
  ema = json.loads(_run("inspect", run / "two", "--item", "ema", "--json").stdout)
  assert [c["value"] for c in ema["clocks"]] == [6]
  line = _error(_run("inspect", run / "two", "--item", "meta"))
  assert "no item 'meta'" in line and "'ema', 'opt'" in line, line


def test_refusals_say_what_was_looked_for(run, tmp_path):
  (tmp_path / "empty").mkdir()
  for command in (("inspect",), ("verify", run / "plain30"), ("reshard", "-w", 2)):
    args = [command[0], tmp_path / "empty", *command[1:]]
    if command[0] == "reshard":
      args.insert(2, tmp_path / "o")
    line = _error(_run(*args))
    assert "is not a jaxreshard checkpoint" in line, line
    assert "no orbax steps with a jaxreshard item" in line, line
  line = _error(_run("inspect", run / "run", "--step", 15))
  assert "has no step 15" in line and "10, 20, 30" in line, line
  line = _error(_run("inspect", run / "plain30", "--step", 1))
  assert "--step" in line and "plain30" in line, line
  line = _error(_run("inspect", run / "run" / "20", "--step", 20))
  assert "--step" in line, line
  line = _error(_run("merge", tmp_path / "m", run / "plain30", tmp_path / "empty"))
  assert "is not a jaxreshard checkpoint" in line, line
  assert "no orbax steps with a jaxreshard item" in line, line
  assert not (tmp_path / "m").exists()


def _orbax_part(run_dir, step, source, ranks, world_size=6):
  """Target ranks of ``source`` saved by an orbax manager, naming ``source`` (a reshard's part)."""
  records = _reader.SourcedRecords(
    jr.restore_ranks(source, ranks, world_size=world_size),
    _reader.Source(jr.open_checkpoint(source).id, world_size),
  )
  with ocp.CheckpointManager(run_dir) as manager:
    manager.save(step, args=jr.ReshardSave(records))
    manager.wait_until_finished()


def test_merge_takes_parts_saved_by_orbax(tmp_path):
  jr.save_records(tmp_path / "src", _records(7))
  jr.save_records(tmp_path / "again", _records(7))  # the same state, another save
  _orbax_part(tmp_path / "a", 5, tmp_path / "src", [0, 1])
  _orbax_part(tmp_path / "a", 9, tmp_path / "again", [0, 1])  # the latest step: another save's
  _orbax_part(tmp_path / "b", 5, tmp_path / "src", [2, 3])
  _orbax_part(tmp_path / "c", 5, tmp_path / "src", [4, 5])
  # Each part saved by orbax names the checkpoint it was resharded from.
  source = jr.open_checkpoint(tmp_path / "b" / "5" / "default").source
  assert (source.checkpoint, source.world_size) == (jr.open_checkpoint(tmp_path / "src").id, 6)
  src = jr.load_records(tmp_path / "src")
  want = [jr.reshard(src, jr.plan(src, world_size=6, rank=r)) for r in range(6)]
  # Run directories, each at --step 5.
  result = _run(
    "merge", tmp_path / "m1", tmp_path / "a", tmp_path / "b", tmp_path / "c", "--step", 5
  )
  assert result.exit_code == 0, result.output
  assert "merged 3 parts" in result.stdout and "ranks 0..5 of 6" in result.stdout
  assert "step 5 (of 5, 9), item 'default'" in result.stderr
  # A step directory, an item directory, and a run directory at its latest step.
  ok = _run(
    "merge",
    tmp_path / "m2",
    tmp_path / "b" / "5",
    tmp_path / "c" / "5" / "default",
    tmp_path / "a" / "5",
  )
  assert ok.exit_code == 0, ok.output
  for out in ("m1", "m2"):
    for a, b in zip(jr.load_records(tmp_path / out), want, strict=True):
      assert_records_equal(a, b)
  # The latest step of run a holds another save's part: refused, nothing written.
  refused = _run("merge", tmp_path / "m3", tmp_path / "a", tmp_path / "b", tmp_path / "c")
  assert refused.exit_code == EXIT_ERROR, refused.output
  assert "a: step 9 (of 5, 9), item 'default'" in refused.stderr
  line = refused.stderr.strip().splitlines()[-1]
  assert line.startswith("jaxreshard: error: ") and "a/9/default from checkpoint" in line, line
  assert "parts of two different saves are never merged" in line, line
  assert not (tmp_path / "m3").exists()
  # The library's merge finds parts by the same rule.
  merged = _merge.merge_parts(
    tmp_path / "m4", [tmp_path / "c", tmp_path / "b", tmp_path / "a"], step=5
  )
  assert merged.world_size == 6
  for a, b in zip(jr.load_records(tmp_path / "m4"), want, strict=True):
    assert_records_equal(a, b)


def test_temporary_directories_are_never_read_as_items_or_steps(run, tmp_path):
  """What a killed save leaves (jaxreshard's ``.NAME.tmp-...`` or orbax's
  ``NAME.orbax-checkpoint-tmp``) may already hold an index; it is not committed,
  so no path through a parent directory takes it."""
  import shutil

  parent = tmp_path / "parent"
  parent.mkdir()
  shutil.copytree(run / "plain20", parent / f".opt.tmp-{'0' * 32}-7-host")
  shutil.copytree(run / "plain20", parent / "opt.orbax-checkpoint-tmp")
  assert "no orbax steps with a jaxreshard item" in _error(_run("inspect", parent))
  steps = tmp_path / "steps"
  shutil.copytree(run / "run", steps)
  shutil.copytree(steps / "30", steps / "40.orbax-checkpoint-tmp-1733000000")
  shutil.copytree(steps / "30" / "default", steps / "30" / "default.orbax-checkpoint-tmp")
  data = json.loads(_run("inspect", steps, "--json").stdout)
  assert data["orbax"]["steps"] == [10, 20, 30] and data["orbax"]["item"] == "default"
  assert _run("reshard", steps, tmp_path / "out", "-w", 3, "--step", 40).exit_code == EXIT_ERROR


def _tree(root):
  return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_an_out_inside_the_run_or_step_around_a_checkpoint_read_is_refused(run, tmp_path):
  # A checkpoint written there would be taken for an item of a step, and change
  # what the run directory names (its latest step, or one step's only item).
  before = _tree(run)
  run_dir, step10 = run / "run", run / "run" / "10"
  item = step10 / "default"
  assert (item / "jaxreshard.json").is_file()
  read, around = "a checkpoint this command reads", "the orbax run directory of a checkpoint"
  cases = [
    (("reshard", run_dir, run_dir / "x", "-w", 2), f"{run_dir}, {read}"),
    (("reshard", step10, run_dir / "old10", "-w", 2), f"{os.path.realpath(run_dir)}, {around}"),
    (("reshard", step10, step10 / "x", "-w", 2), f"{step10}, {read}"),
    (("reshard", item, step10 / "x", "-w", 2), f"{os.path.realpath(run_dir)}, {around}"),
    (("reshard", item, run_dir / "y", "-w", 2, "-r", 0), f"{os.path.realpath(run_dir)}, {around}"),
    (("merge", run_dir / "m", step10), f"{os.path.realpath(run_dir)}, {around}"),
  ]
  for args, words in cases:
    result = _run(*args)
    assert result.exit_code == EXIT_ERROR, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("jaxreshard: error: ") and f"is inside {words}" in line, (args, line)
  assert _tree(run) == before
  # Outside the run: written, and the run still names its latest step.
  assert _run("reshard", step10, tmp_path / "on2", "-w", 2).exit_code == 0
  result = _run("inspect", run_dir, "--json")
  assert result.exit_code == 0 and json.loads(result.stdout)["orbax"]["steps"] == [10, 20, 30]


def test_a_directory_named_like_a_step_that_orbax_did_not_commit_makes_no_run(run, tmp_path):
  """A checkpoint at ``.../run_3/src`` (a name orbax's step pattern matches, with no step
  of orbax's around it): its grandparent is no run directory, and an OUT beside it or
  anywhere under that grandparent is written (all of it was refused)."""
  import shutil

  src = tmp_path / "run_3" / "src"
  shutil.copytree(run / "plain20", src)
  for out in (tmp_path / "run_3" / "on2", tmp_path / "elsewhere"):
    result = _run("reshard", src, out, "-w", 2)
    assert result.exit_code == 0, result.output
    assert _run("verify", src, out).exit_code == 0
  # An orbax step around it (orbax's own metadata in its directory) still refuses.
  step = tmp_path / "orbax_run" / "7"
  shutil.copytree(run / "run" / "10", step)
  result = _run("reshard", step / "default", tmp_path / "orbax_run" / "x", "-w", 2)
  assert result.exit_code == EXIT_ERROR and "the orbax run directory" in result.stderr


def test_a_step_in_two_directories_is_refused_not_picked(tmp_path):
  # ``30`` and ``step_30`` (orbax's step_prefix) are both step 30: which one a
  # command reads would depend on the order the directory lists them in.
  for name in ("30", "step_30"):
    (tmp_path / "run" / name).mkdir(parents=True)
    jr.save_records(tmp_path / "run" / name / "default", _records(30, world_size=2))
  for args in (("inspect", tmp_path / "run"), ("verify", tmp_path / "run", tmp_path / "run")):
    line = _error(_run(*args))
    assert "step 30 is in two directories" in line, line
    assert "'30'" in line and "'step_30'" in line and "name the one to read" in line, line
  # Each directory, named as the path, is read.
  for name in ("30", "step_30"):
    data = json.loads(_run("inspect", tmp_path / "run" / name, "--json").stdout)
    assert [c["value"] for c in data["clocks"]] == [30]


def test_a_folder_of_checkpoints_is_not_taken_for_an_orbax_step(run, tmp_path):
  """A directory that holds checkpoints but is neither named as a step nor holds
  orbax's step metadata (a user's folder of them; ``/tmp`` with one left in it) was
  read as a step: its one checkpoint taken silently, or ``--item`` choosing among
  them. It is refused, naming the checkpoints; a step directory of a manager (named
  as a step, holding orbax's metadata) is still read, and so is a copy of one
  renamed (its metadata kept)."""
  import shutil

  folder = tmp_path / "ckpts"
  folder.mkdir()
  shutil.copytree(run / "plain30", folder / "only")
  for args in ((folder,), (folder, "--item", "only")):
    line = _error(_run("inspect", *args))
    assert "is not a jaxreshard checkpoint" in line, line
    assert "the checkpoints in it: 'only' (name one as the path)" in line, line
  shutil.copytree(run / "run" / "20", tmp_path / "renamed_step")
  assert _run("inspect", tmp_path / "renamed_step").exit_code == 0
  assert _run("inspect", run / "run" / "20").exit_code == 0
