"""The ``jaxreshard`` command line on real checkpoints on disk (no mocks)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.checkpoint import read_plan as _read_plan
from jaxreshard._src.cli.commands import EXIT_DIFFERENT, EXIT_ERROR, app, progress_bar
from tests._archive_util import padding_unchecked, read_json, set_unchecked, write_consistent_index
from tests._core_util import assert_records_equal
from tests._core_util import replace_history as _replace

PARAMS = {
  "enc": {"kernel": np.zeros((7, 11), np.float32), "bias": np.zeros((5,), np.float32)},
  "head": np.zeros((9,), np.float32),
}


def _records(world_size):
  """A trained-looking adam state (random bits of history, clock at 3)."""
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
  rng = np.random.default_rng(1)

  def fill(x):
    a = np.asarray(x)
    if a.ndim == 0:
      return np.asarray(3 if a.dtype.kind == "i" else 0.25, a.dtype)
    return rng.standard_normal(a.shape).astype(a.dtype)

  state = jax.tree.map(fill, opt.init(PARAMS))
  return jr.shard_state(opt, PARAMS, state, world_size)


def _run(*args):
  result = CliRunner().invoke(app, [str(a) for a in args])
  assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
  return result


def _one_line_error(result, code=EXIT_ERROR):
  assert result.exit_code == code, result.output
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxreshard: error: "), result.stderr
  assert "Traceback" not in result.output
  return lines[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  root = tmp_path_factory.mktemp("cli")
  src = _records(8)
  jr.save_records(root / "ckpt8", src)
  return root, src


@pytest.fixture(scope="module")
def resharded(ckpt):
  root, src = ckpt
  result = _run("reshard", root / "ckpt8", root / "ckpt6", "--world-size", 6)
  assert result.exit_code == 0, result.output
  assert "wrote 6 of 6 target ranks" in result.stdout
  return root / "ckpt6"


def test_inspect_table_and_json(ckpt):
  root, src = ckpt
  result = _run("inspect", root / "ckpt8")
  assert result.exit_code == 0, result.output
  for text in (
    "enc/kernel",
    "enc/bias",
    "head",
    "(7, 11)",
    "8 archives",
    "world size 8",
    "learning_rate",
    "count",
  ):
    assert text in result.stdout, text
  data = json.loads(_run("inspect", root / "ckpt8", "--json").stdout)
  assert data["archives"] == 8 and data["world_sizes"] == [8] and data["clocks_agree"]
  kernel = next(p for p in data["params"] if p["param"] == "enc/kernel")
  assert kernel["shape"] == [7, 11] and kernel["ranks"] == list(range(8))
  assert kernel["buffers"] == ["float32", "float32"] and kernel["dtype"] == "float32"
  assert kernel["bytes"] == 77 * 2 * 4 and kernel["stored_bytes"] == 8 * 10 * 2 * 4
  clocks = {c["path"]: c["value"] for c in data["clocks"]}
  assert 3 in clocks.values() and 0.25 in clocks.values()


def test_dry_run_plans_every_rank_and_writes_nothing(ckpt):
  root, src = ckpt
  result = _run("reshard", root / "ckpt8", root / "never", "-w", 6, "--dry-run")
  detail = _run("reshard", root / "ckpt8", root / "never", "-w", 6, "--dry-run", "--reads")
  assert result.exit_code == 0 and detail.exit_code == 0, result.output + detail.output
  assert not (root / "never").exists() and "nothing written" in result.stdout
  summary = result.stdout.splitlines()
  assert summary[0].split() == [
    "target",
    "rank",
    "archives",
    "read",
    "bytes",
    "moved",
    "target",
    "bytes",
    "peak",
    "memory",
  ]
  assert len(summary) == 1 + 6 + 1
  # With --reads, every read is one line under its rank's line.
  read_lines = [
    l.split()
    for l in detail.stdout.splitlines()
    if re.match(r"    \S", l) and not l.split()[0] == "param"
  ]
  index = jr.open_checkpoint(root / "ckpt8")
  for rank in range(6):
    p = _read_plan.read_plan(index, world_size=6, rank=rank)
    for pid, shape in (("enc/kernel", (7, 11)), ("enc/bias", (5,)), ("head", (9,))):
      t = jr.FlatShard(shape, rank, 6)
      reads = [r for r in p.reads if r.param == pid]
      # The reads tile exactly the target's owned range, each inside its source slot.
      covered = [i for r in reads for i in range(r.lo, r.hi)]
      assert covered == list(range(t.start, t.stop))
      for r in reads:
        s = jr.FlatShard(shape, r.source_rank, 8)
        assert s.start <= r.lo < r.hi <= s.stop and r.source_offset == r.lo - s.start
    assert p.bytes_read == sum(jr.FlatShard(s, rank, 6).owned * 8 for s in ((7, 11), (5,), (9,)))
    row = summary[1 + rank].split()
    assert row[:4] == [str(rank), str(len(p.per_archive)), "of", "8"], row
    assert row[4:6] == [str(p.bytes_read), "B"], row
    mine = [
      [
        r.param,
        str(r.archive),
        str(r.source_rank),
        f"[{r.lo},",
        f"{r.hi})",
        str(r.source_offset),
        str(r.bytes),
      ]
      for r in p.reads
    ]
    assert all(m in read_lines for m in mine)
  assert len(read_lines) == sum(
    len(_read_plan.read_plan(index, world_size=6, rank=r).reads) for r in range(6)
  )
  assert summary[-1].startswith("dry run: 6 target ranks, ")


def test_reshard_writes_exactly_the_target_ranks(ckpt, resharded):
  root, src = ckpt
  got = jr.load_records(resharded)
  assert len(got) == 6
  for rank, rec in enumerate(got):
    assert_records_equal(rec, jr.reshard(src, jr.plan(src, world_size=6, rank=rank)))
  one = _run("reshard", root / "ckpt8", root / "rank2", "-w", 6, "--rank", 2)
  assert one.exit_code == 0 and "wrote 1 of 6 target ranks" in one.stdout
  [rec] = jr.load_records(root / "rank2")
  assert_records_equal(rec, got[2])


def test_verify_identical_across_layouts(ckpt, resharded):
  root, _ = ckpt
  result = _run("verify", root / "ckpt8", resharded)
  assert result.exit_code == 0, result.output
  assert "identical: 3 params, 6 buffers" in result.stdout and "padding all zero" in result.stdout


def test_verify_names_the_differing_buffer_and_bad_padding(ckpt):
  root, src = ckpt
  six = [jr.reshard(src, jr.plan(src, world_size=6, rank=r)) for r in range(6)]

  def flip(a):
    a.view(np.uint32)[0] ^= 1 << 22  # a mantissa bit, in rank 4's owned part
    return a

  bad = [_replace(r, "enc/kernel", 1, flip) if i == 4 else r for i, r in enumerate(six)]
  jr.save_records(root / "bitflip", bad)
  result = _run("verify", root / "ckpt8", root / "bitflip")
  assert result.exit_code == EXIT_DIFFERENT, result.output
  assert "param 'enc/kernel' buffer 1: bits differ" in result.stdout
  assert "does not hold" in result.stderr and "Traceback" not in result.output

  def pad(a):
    a.view(np.uint32)[-1] = 0x80000000  # -0.0 in rank 5's padding of head (9 over 6)
    return a

  padded = [_replace(r, "head", 0, pad) if i == 5 else r for i, r in enumerate(six)]
  with padding_unchecked():  # a save refuses it; another writer may not
    jr.save_records(root / "badpad", padded)
  # Nonzero padding makes a checkpoint invalid, not different: exit 2, one
  # line naming it, on either side and compared with itself.
  for args in (
    (root / "ckpt8", root / "badpad"),
    (root / "badpad", root / "ckpt8"),
    (root / "badpad", root / "badpad"),
    (root / "badpad", root / "badpad", "--json"),
  ):
    result = _run("verify", *args)
    line = _one_line_error(result)
    assert "badpad" in line, line
    assert "param 'head'" in line and "buffer 0" in line and "padding is not zero" in line, line
    assert result.stdout == "" and "differs" not in result.output


@pytest.mark.parametrize("text", ["3.0", "+3", " 3", "3_0", "0x3", "\uff13"])
@pytest.mark.parametrize("option", ["-w", "-r", "--step", "--max-diffs", "--steps"])
def test_an_integer_option_takes_decimal_digits_only(ckpt, tmp_path, option, text):
  """Python's int() reads "3_0" as 30 and "+3" or " 3" as 3: the CLI refuses
  anything but decimal digits, so a typo is never taken as another world size."""
  root, _ = ckpt
  args = {
    "-w": ("reshard", root / "ckpt8", tmp_path / "o", "-w", text),
    "-r": ("reshard", root / "ckpt8", tmp_path / "o", "-w", 6, "-r", text),
    "--step": ("inspect", root / "ckpt8", "--step", text),
    "--max-diffs": ("verify", root / "ckpt8", root / "ckpt8", "--max-diffs", text),
    "--steps": ("demo", "--steps", text),
  }[option]
  line = _one_line_error(_run(*args))
  assert f"{text!r} is not an integer in decimal digits" in line, line
  assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
  "args, needle",
  [
    (("demo", "--steps", "0"), "--steps': 0 is less than 1"),
    (
      ("verify", "ROOT/ckpt8", "ROOT/ckpt8", "--max-diffs", "-1"),
      "--max-diffs': -1 is less than 0",
    ),
  ],
)
def test_an_integer_option_below_its_least_is_refused(ckpt, args, needle):
  root, _ = ckpt
  line = _one_line_error(_run(*(a.replace("ROOT", str(root)) for a in args)))
  assert needle in line, line


@pytest.mark.parametrize(
  "name", [".model.tmp-" + "0123456789abcdef" * 2 + "-1-vm", "7.orbax-checkpoint-tmp-3"]
)
def test_no_checkpoint_is_written_under_a_temporary_directory_s_name(ckpt, tmp_path, name):
  """A checkpoint named as a save's temporary directory is taken by ``clean`` (and the
  next save to its base name) for a killed save's leftover, and removed once nobody
  holds its lock: reshard, merge and save_records wrote one, which clean then
  removed, whole and verified. Every save refuses such a name, writing nothing."""
  root, src = ckpt
  line = _one_line_error(_run("reshard", root / "ckpt8", tmp_path / name, "-w", 3))
  assert "never saved under the name of a save's temporary directory" in line, line
  with pytest.raises(jr.ReshardError, match="name of a save's temporary directory"):
    jr.save_records(tmp_path / name, src)
  assert os.listdir(tmp_path) == []


def test_errors_are_one_line(ckpt, resharded, tmp_path):
  root, _ = ckpt
  assert "does not exist" in _one_line_error(_run("inspect", tmp_path / "missing"))
  assert "not a jaxreshard checkpoint" in _one_line_error(_run("verify", tmp_path, resharded))
  assert "already exists" in _one_line_error(_run("reshard", root / "ckpt8", resharded, "-w", 6))
  # OUT that is CHECKPOINT itself: named as existing, before it is found inside itself.
  line = _one_line_error(_run("reshard", root / "ckpt8", root / "ckpt8", "-w", 6))
  assert "ckpt8 already exists; jaxreshard never overwrites a checkpoint" in line, line
  assert "outside world_size 6" in _one_line_error(
    _run("reshard", root / "ckpt8", tmp_path / "o", "-w", 6, "-r", 6)
  )
  assert "world_size 0" in _one_line_error(_run("reshard", root / "ckpt8", tmp_path / "o", "-w", 0))
  mixed = tmp_path / "mixed"
  shutil.copytree(root / "ckpt8", mixed)
  shutil.rmtree(mixed / "archive_00003")
  assert "archive 3" in _one_line_error(_run("inspect", mixed))
  assert not (tmp_path / "o").exists()


def test_a_dry_run_refuses_an_archive_of_another_save_as_the_run_does(ckpt, tmp_path):
  """An archive of another save of the same layout: ``inspect``, the run and its
  dry run (every rank, or a rank that reads it) refuse it alike, naming it."""
  root, _ = ckpt
  other = tmp_path / "other"
  jr.save_records(other, _records(8))
  mixed = tmp_path / "mixed"
  shutil.copytree(root / "ckpt8", mixed)
  shutil.rmtree(mixed / "archive_00003")
  shutil.copytree(other / "archive_00003", mixed / "archive_00003")
  for args in (
    ("inspect", mixed),
    ("reshard", mixed, tmp_path / "o", "-w", 6),
    ("reshard", mixed, tmp_path / "o", "-w", 6, "--dry-run"),
    ("reshard", mixed, tmp_path / "o", "-w", 6, "--dry-run", "--json"),
    ("reshard", mixed, tmp_path / "o", "-w", 6, "-r", 2, "--dry-run"),
  ):
    line = _one_line_error(_run(*args))
    assert "archive 3" in line and "belongs to checkpoint" in line, (args, line)
  assert not (tmp_path / "o").exists()
  # A rank that reads only other archives is planned (its run reads nothing of 3).
  assert _run("reshard", mixed, tmp_path / "o", "-w", 6, "-r", 0, "--dry-run").exit_code == 0


def test_a_dry_run_refuses_a_truncated_file_as_the_run_does(ckpt, tmp_path):
  root, _ = ckpt
  cut = tmp_path / "cut"
  shutil.copytree(root / "ckpt8", cut)
  (f,) = (cut / "archive_00005").rglob("c/0")
  os.truncate(f, os.path.getsize(f) - 3)
  for args in ((), ("--dry-run",), ("--dry-run", "--json"), ("-r", 3, "--dry-run")):
    line = _one_line_error(_run("reshard", cut, tmp_path / "o", "-w", 6, *args))
    assert "archive 5" in line and "the file is truncated" in line, (args, line)
  assert not (tmp_path / "o").exists()


def test_a_dry_run_of_one_rank_checks_the_all_padding_archives_its_run_checks(tmp_path):
  """A 5-element param over 4 ranks: archive 3 holds only padding, which target rank 0
  of 1 reads to check it. Its file cut to nothing: the run and its dry run refuse it."""
  opt = optax.adam(1e-3)
  params = {"w": np.arange(5, dtype=np.float32)}
  jr.save_records(tmp_path / "ck", jr.shard_state(opt, params, opt.init(params), 4))
  (f,) = (tmp_path / "ck" / "archive_00003").rglob("c/0")
  os.truncate(f, 0)
  for args in ((), ("--dry-run",)):
    line = _one_line_error(
      _run("reshard", tmp_path / "ck", tmp_path / "o", "-w", 1, "-r", 0, *args)
    )
    assert "archive 3" in line and "has 0 bytes" in line, (args, line)


@pytest.mark.parametrize("rank", [2, 5])
def test_inspect_counts_the_bytes_a_checkpoint_of_one_rank_holds(ckpt, tmp_path, rank):
  """A checkpoint of one target rank (``reshard --rank``): ``bytes`` are the elements
  it owns, ``stored_bytes`` with its padding; counted here from the loaded records
  and the FSDP rule for what a rank owns. (``bytes`` counted whole params.)"""
  root, _ = ckpt
  path = tmp_path / f"r{rank}"
  assert _run("reshard", root / "ckpt8", path, "-w", 6, "-r", rank).exit_code == 0
  info = _json_out(_run("inspect", path, "--json"))
  owned = stored = 0
  for rec in jr.load_records(path):
    leaves = jax.tree.leaves(rec.state)
    for p in rec.placements:
      n = int(np.prod(p.shape))
      slots = -(-n // p.world_size)
      own = max(0, min(slots, n - p.rank * slots))
      for leaf, role in zip(leaves, rec.roles):
        if role is not None and role == p.param:
          owned += own * np.asarray(leaf).dtype.itemsize
          stored += np.asarray(leaf).nbytes
  assert (info["bytes"], info["stored_bytes"]) == (owned, stored)
  assert 0 < owned <= stored


def test_failed_reshard_leaves_no_output(ckpt, tmp_path):
  root, _ = ckpt
  broken = tmp_path / "broken"
  shutil.copytree(root / "ckpt8", broken)
  # Corrupt the last archive's arrays (their checksums catch it): only target
  # rank 5 reads archive 7, so ranks 0..4 are written before the failure.
  for f in (broken / "archive_00007").rglob("c/0"):
    data = bytearray(f.read_bytes())
    data[0] ^= 0xFF
    f.write_bytes(bytes(data))
  line = _one_line_error(_run("reshard", broken, tmp_path / "out", "-w", 6))
  assert "archive 7" in line and "corrupted" in line, line
  assert sorted(os.listdir(tmp_path)) == ["broken"]  # no OUT, no temporary leftovers
  result = _run("reshard", root / "ckpt8", tmp_path / "out", "-w", 6)
  assert result.exit_code == 0 and len(jr.load_records(tmp_path / "out")) == 6


@pytest.mark.slow
def test_subprocess_python_m(ckpt, resharded):
  root, _ = ckpt
  ok = subprocess.run(
    [sys.executable, "-m", "jaxreshard", "verify", str(root / "ckpt8"), str(resharded)],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert ok.returncode == 0, ok.stderr
  assert ok.stdout.startswith("identical: 3 params")
  bad = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxreshard",
      "reshard",
      str(root / "nope"),
      str(root / "x"),
      "--world-size",
      "3",
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert bad.returncode == EXIT_ERROR and bad.stdout == ""
  assert bad.stderr.strip().splitlines() == [
    f"jaxreshard: error: checkpoint directory {root / 'nope'} does not exist"
  ]
  version = _run("--version")
  assert (version.exit_code, version.stdout, version.stderr) == (
    0,
    f"jaxreshard {jr.__version__}\n",
    "",
  )
  # --version answers and ends: the command after it does not run.
  assert _run("--version", "inspect", root / "nope").exit_code == 0


def test_progress_bar_shows_bytes_and_eta_on_terminals():
  import io

  from rich.console import Console

  text = io.StringIO()
  with progress_bar(Console(file=text, force_terminal=True, width=100)) as bar:
    task = bar.add_task("rank 0/6", total=2_000_000)
    bar.advance(task, 1_000_000)
  assert "rank 0/6" in text.getvalue() and "1.0/2.0 MB" in text.getvalue()
  assert "-:--:--" in text.getvalue() or "0:00:" in text.getvalue()  # the ETA column
  piped = io.StringIO()
  with progress_bar(Console(file=piped)) as bar:
    bar.advance(bar.add_task("x", total=10), 10)
  assert piped.getvalue() == ""  # pipes and logs get no frozen bar


# --- untrusted names, metadata and arguments ------------------------------------


def _first_namedtuple(tree):
  if isinstance(tree, list) and tree and tree[0] == "n":
    return tree
  for child in tree[-1] if isinstance(tree, list) and tree else []:
    found = _first_namedtuple(child)
    if found is not None:
      return found
  return None


def _edit_index(path, fn):
  """An index edit, re-signed, with every archive.json re-signed to agree with it."""
  data = read_json(path / "jaxreshard.json")
  fn(data)
  write_consistent_index(path, data)


def test_names_and_paths_are_printed_literally_and_escaped(tmp_path):
  # Rich markup and terminal escapes in param names and paths are data, never
  # markup or control sequences.
  params = {
    "\x1b[2J": np.ones(4, np.float32),
    "[bold]y": np.ones(2, np.float32),
    "[/x]": np.ones(3, np.float32),
  }
  opt = optax.adam(1e-3)
  (tmp_path / "[").mkdir()
  path = tmp_path / "[/p] \x1b[31m"
  jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=2))
  for args in (
    ("inspect", path),
    ("reshard", path, tmp_path / "[/o]", "-w", 3, "--dry-run", "--reads"),
    ("reshard", path, tmp_path / "[/o]", "-w", 3),
    ("verify", path, tmp_path / "[/o]"),
  ):
    result = _run(*args)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout, result.stdout
  result = _run("inspect", path)
  assert "\\x1b[2J" in result.stdout and "[bold]y" in result.stdout
  assert "[%2Fx]" in result.stdout  # the param id of the key "[/x]"
  assert "[/p] \\x1b[31m" in result.stdout
  missing = _one_line_error(_run("inspect", tmp_path / "gone \x1b[2J"))
  assert "\x1b" not in missing and "gone \\x1b[2J" in missing


@pytest.mark.parametrize(
  "edit, needle",
  [
    # a NamedTuple node whose module is a list (unhashable)
    (
      lambda d: _first_namedtuple(d["layouts"][0]["tree"]).__setitem__(1, ["optax"]),
      "invalid NamedTuple",
    ),
    (lambda d: d["groups"][0].update(world_size=10**12), "between 1 and 1048576"),
    (lambda d: d["groups"][0].update(world_size=0), "world_size 0 must be"),
    (lambda d: d["groups"][0].update(world_size=True), "expected int, got bool"),
    (lambda d: d["params"][0].__setitem__(1, [10**30]), "shape"),
    (
      lambda d: d["groups"][0]["ranks"].__setitem__(1, d["groups"][0]["ranks"][0]),
      "twice|both hold rank 0",
    ),
    (lambda d: d["groups"][0]["ranks"][1].__setitem__(1, -1), "has rank -1"),
    (lambda d: d.update(record_version=2), "record version 2 is not supported"),
    (lambda d: d["clocks"][0].extend(d["clocks"][0][-1:] * 1100), "more than an optimizer has"),
    (lambda d: d["params"][0].__setitem__(0, "x" * 5000), "param id of 5000 characters"),
  ],
)
def test_hostile_index_is_one_line_exit_2_in_every_command(ckpt, tmp_path, edit, needle):
  root, _ = ckpt
  bad = tmp_path / "bad"
  shutil.copytree(root / "ckpt8", bad)
  _edit_index(bad, edit)
  for args in (
    ("inspect", bad),
    ("verify", root / "ckpt8", bad),
    ("verify", bad, root / "ckpt8"),
    ("reshard", bad, tmp_path / "o", "-w", 3, "--dry-run"),
    ("reshard", bad, tmp_path / "o", "-w", 3),
  ):
    assert re.search(needle, _one_line_error(_run(*args))), args
  assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_a_mistyped_world_size_is_refused_at_once(ckpt):
  root, _ = ckpt
  for m in (100_000_000, 2**20 + 1):
    line = _one_line_error(_run("reshard", root / "ckpt8", root / "never", "-w", m, "--dry-run"))
    assert f"world_size {m} is more than the 1048576 ranks" in line
  # The largest allowed world size plans lazily: one rank is one line, at once.
  result = _run(
    "reshard", root / "ckpt8", root / "never", "-w", 2**20, "-r", 2**20 - 1, "--dry-run"
  )
  assert result.exit_code == 0 and result.stdout.splitlines()[1].split()[:4] == [
    str(2**20 - 1),
    "0",
    "of",
    "8",
  ]


def test_verify_exits_2_not_1_on_bad_input(ckpt, tmp_path):
  root, _ = ckpt
  dup = tmp_path / "dup"
  shutil.copytree(root / "ckpt8", dup)
  _edit_index(dup, lambda d: d["groups"][0]["ranks"][1].__setitem__(1, 0))
  assert "rank" in _one_line_error(_run("verify", root / "ckpt8", dup))
  missing = tmp_path / "missing"
  shutil.copytree(root / "ckpt8", missing)
  shutil.rmtree(missing / "archive_00002")
  assert "archive 2" in _one_line_error(_run("verify", root / "ckpt8", missing))
  assert "does not exist" in _one_line_error(_run("verify", root / "ckpt8", tmp_path / "none"))


# --- help -------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["demo"], ["inspect"], ["reshard"], ["verify"], ["clean"]])
def test_help_shows_metavars_and_flags_without_a_value_type(command):
  result = _run(*command, "--help")
  assert result.exit_code == 0, result.output
  text = result.stdout
  assert "<bool>" not in text and "{checkpoint}" not in text and "{out}" not in text, text
  if command:
    assert "--json" in text, text
  usage = next(l for l in text.splitlines() if "Usage:" in l)
  expected = {
    "inspect": "CHECKPOINT",
    "reshard": "CHECKPOINT OUT",
    "verify": "CHECKPOINT OUT",
    "clean": "CHECKPOINT",
  }.get(command[0] if command else "")
  if expected:
    assert usage.split("[OPTIONS]")[1].split() == expected.split(), usage
  assert "{" not in usage, usage


def test_world_size_short_flag_is_w(ckpt, tmp_path):
  root, _ = ckpt
  assert "-w" in _run("reshard", "--help").stdout
  ok = _run("reshard", root / "ckpt8", tmp_path / "o", "-w", 3, "--dry-run")
  assert ok.exit_code == 0, ok.output
  assert _run("reshard", root / "ckpt8", tmp_path / "o", "-m", 3, "--dry-run").exit_code == 2


# --- every value whole ------------------------------------------------------------


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
  """A state with long clock paths and a frozen (stateless) parameter."""
  params = {
    "enc": {"kernel": np.ones((7, 11), np.float32)},
    "frozen_emb": np.ones((9,), np.float32),
  }
  labels = {"enc": {"kernel": "train"}, "frozen_emb": "frozen"}
  opt = optax.multi_transform(
    {
      "train": optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
      "frozen": optax.set_to_zero(),
    },
    labels,
  )
  path = tmp_path_factory.mktemp("multi") / "ckpt"
  jr.save_records(
    path,
    jr.shard_state(
      opt,
      params,
      opt.init(params),
      world_size=4,
      trainable={"enc/kernel": True, "frozen_emb": False},
    ),
  )
  return path


def _whole(text, data):
  assert "…" not in text and "..." not in text, text
  for c in data["clocks"]:
    assert c["path"] in text, c["path"]
  for p in data["params"]:
    assert p["param"] in text and str(tuple(p["shape"])) in text
  for whole in ("616 B", "640 B", "float32", "2xf32"):
    assert whole in text, whole


@pytest.mark.slow
def test_piped_output_never_cuts_a_value(multi):
  data = json.loads(_run("inspect", multi, "--json").stdout)
  assert any(len(c["path"]) > 60 for c in data["clocks"])
  _whole(_run("inspect", multi).stdout, data)
  env = dict(os.environ, COLUMNS="80")
  piped = subprocess.run(
    [sys.executable, "-m", "jaxreshard", "inspect", str(multi)],
    capture_output=True,
    text=True,
    timeout=120,
    env=env,
  )
  assert piped.returncode == 0, piped.stderr
  _whole(piped.stdout, data)


def test_terminal_output_folds_and_never_cuts(multi, monkeypatch):
  from rich.console import Console

  from jaxreshard._src.cli import render as _render

  monkeypatch.setattr(
    _render,
    "console",
    lambda: Console(force_terminal=True, width=50, highlight=False, no_color=True),
  )
  data = json.loads(_run("inspect", multi, "--json").stdout)
  text = _run("inspect", multi).stdout
  assert "…" not in text, text
  # A folded cell continues on the next lines of its column: joined, it is whole.
  rows = [l.split("│") for l in text.splitlines() if l.startswith("│")]
  first = "".join(r[1].strip() for r in rows)
  for c in data["clocks"]:
    assert c["path"] in first, (c["path"], text)


def test_inspect_frozen_params_trainable_flag_and_float32_values(multi):
  data = json.loads(_run("inspect", multi, "--json").stdout)
  params = {p["param"]: p for p in data["params"]}
  assert params["frozen_emb"]["buffers"] == [] and not params["frozen_emb"]["trainable"]
  assert params["enc/kernel"]["trainable"]
  text = _run("inspect", multi).stdout
  row = next(l for l in text.splitlines() if "frozen_emb" in l).split("│")
  assert [c.strip() for c in row[5:7]] == ["no", "none"], row
  assert "buffers none: no optimizer state (frozen, or a stateless optimizer)" in text
  assert "local" not in text
  clocks = {c["path"].rsplit("[", 1)[-1]: c for c in data["clocks"] if "hyperparams" in c["path"]}
  assert clocks["'b1']"]["value"] == 0.9 and clocks["'learning_rate']"]["value"] == 0.001
  assert clocks["'b1']"]["bits"] == np.float32(0.9).tobytes().hex()
  value_col = [l.split("│")[3].strip() for l in text.splitlines() if "['b1']" in l]
  assert value_col == ["0.9"]
  assert "0.8999999761581421" not in text


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_inspect_shows_a_clock_as_the_shortest_decimal_of_its_dtype(tmp_path, dtype):
  """bfloat16 0.9 reads ``0.9`` (ml_dtypes' own text is ``0.898438``); every value
  shown parses back, at its dtype, to the bits stored."""
  opt = optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.dtype(dtype))(
    learning_rate=0.1, b1=0.9, b2=0.999, eps=1e-8
  )
  params = {"w": np.zeros((3,), np.float32)}
  jr.save_records(tmp_path / "c", jr.shard_state(opt, params, opt.init(params), 2))
  data = _json_out(_run("inspect", tmp_path / "c", "--json"))
  hyper = {c["path"].rsplit("'", 2)[-2]: c for c in data["clocks"] if "hyperparams" in c["path"]}
  want = {"learning_rate": 0.1, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 0.0}
  for name, c in hyper.items():
    assert c["dtype"] == dtype
    parsed = np.asarray(c["value"]).astype(jnp.dtype(dtype))
    assert parsed.tobytes().hex() == c["bits"], (name, c)
    assert len(repr(c["value"])) <= len(repr(want[name])), (name, c["value"])
  assert hyper["b1"]["value"] == 0.9
  text = _run("inspect", tmp_path / "c").stdout
  assert [l.split("│")[3].strip() for l in text.splitlines() if "['b1']" in l] == ["0.9"]


# --- --json on every subcommand ---------------------------------------------------


def _json_out(result, code=0):
  assert result.exit_code == code, result.output
  return json.loads(result.stdout)  # the whole of stdout is one JSON document


def test_reshard_json_dry_run_plans_reads_and_written(ckpt, tmp_path):
  root, src = ckpt
  index = jr.open_checkpoint(root / "ckpt8")
  plans = [_read_plan.read_plan(index, world_size=6, rank=r) for r in range(6)]
  data = _json_out(_run("reshard", root / "ckpt8", tmp_path / "o", "-w", 6, "--dry-run", "--json"))
  assert data["dry_run"] and data["world_size"] == 6 and data["archives"] == 8
  assert [r["rank"] for r in data["ranks"]] == list(range(6))
  assert all("reads" not in r for r in data["ranks"])
  for got, p in zip(data["ranks"], plans):
    assert got["archives_read"] == list(p.per_archive) and got["bytes_read"] == p.bytes_read
    assert (got["target_bytes"], got["peak_bytes"]) == (p.target_bytes, p.peak_bytes)
  assert data["bytes_read"] == sum(p.bytes_read for p in plans)
  detail = _json_out(
    _run(
      "reshard", root / "ckpt8", tmp_path / "o", "-w", 6, "-r", 4, "--dry-run", "--reads", "--json"
    )
  )
  assert [r["rank"] for r in detail["ranks"]] == [4]
  assert detail["ranks"][0]["reads"] == [
    dict(
      param=r.param,
      archive=r.archive,
      source_rank=r.source_rank,
      lo=r.lo,
      hi=r.hi,
      source_offset=r.source_offset,
      bytes=r.bytes,
    )
    for r in plans[4].reads
  ]
  assert not (tmp_path / "o").exists()
  wrote = _json_out(_run("reshard", root / "ckpt8", tmp_path / "o", "-w", 6, "--json"))
  assert not wrote["dry_run"] and wrote["ranks"] == list(range(6))
  assert wrote["out"] == str(tmp_path / "o") and wrote["bytes_read"] == data["bytes_read"]
  assert len(jr.load_records(tmp_path / "o")) == 6


def test_verify_json_identical_and_different(ckpt, resharded, tmp_path):
  root, src = ckpt
  same = _json_out(_run("verify", root / "ckpt8", resharded, "--json"))
  assert same["identical"] and same["differences"] == []
  assert same["digest"] == same["out_digest"] and len(same["digest"]) == 64
  assert (same["params"], same["buffers"], same["elements"]) == (3, 6, 2 * (77 + 5 + 9))
  assert same["clock_scalars"] == len(src[0].roles) - 6
  text = _run("verify", root / "ckpt8", resharded).stdout
  assert f"digest {same['digest'][:16]}" in text

  def flip(a):
    a.view(np.uint32)[0] ^= 1
    return a

  bad = [_replace(r, "head", 0, flip) if i == 0 else r for i, r in enumerate(src)]
  jr.save_records(tmp_path / "bad", bad)
  result = _run("verify", root / "ckpt8", tmp_path / "bad", "--json")
  diff = _json_out(result, EXIT_DIFFERENT)
  assert not diff["identical"] and diff["digest"] != diff["out_digest"]
  assert len(diff["differences"]) == 1 and "param 'head' buffer 0" in diff["differences"][0]
  assert "does not hold" in result.stderr
  assert "does not exist" in _one_line_error(
    _run("verify", root / "ckpt8", tmp_path / "x", "--json")
  )


def test_clean_json(tmp_path):
  data = _json_out(_run("clean", tmp_path / "c", "--json"))
  assert data == dict(checkpoint=str(tmp_path / "c"), removed=[], kept=[])


@pytest.mark.parametrize("parent", ["a_file", "missing"])
def test_clean_of_a_directory_it_cannot_list_is_an_error(tmp_path, parent):
  """It reported "0 of 0 temporary directories removed" (exit 0) without looking."""
  (tmp_path / "a_file").write_text("")
  line = _one_line_error(_run("clean", tmp_path / parent / "ck", "--json"))
  assert str(tmp_path / parent) in line and "listing it for saves to" in line, line


# --- merge ------------------------------------------------------------------------


def _with_count(records, count):
  """The same archives at another step: every integer clock scalar set to ``count``."""

  def step(x):
    a = np.asarray(x)
    return np.asarray(count, a.dtype) if a.ndim == 0 and a.dtype.kind == "i" else x

  return [jr.ShardRecord(1, r.placements, jax.tree.map(step, r.state), r.roles) for r in records]


@pytest.fixture(scope="module")
def parts(ckpt):
  """reshard 8 -> 6 run once per target rank, as a cluster job does (one per host)."""
  root, _ = ckpt
  paths = []
  for r in range(6):
    result = _run("reshard", root / "ckpt8", root / f"part{r}", "--world-size", 6, "--rank", r)
    assert result.exit_code == 0, result.output
    paths.append(root / f"part{r}")
  return paths


def _bits(records):
  return [
    np.asarray(x).reshape(-1).view(f"u{np.asarray(x).dtype.itemsize}")
    for r in records
    for x in jax.tree.leaves(r.state)
  ]


def test_merge_per_rank_outputs_equals_one_shot_reshard(ckpt, resharded, parts, tmp_path):
  root, _ = ckpt
  # The parts may come in any order: archives are written in rank order.
  result = _run("merge", tmp_path / "merged", *reversed(parts))
  assert result.exit_code == 0, result.output
  assert "merged 6 parts" in result.stdout
  verify = _run("verify", root / "ckpt8", tmp_path / "merged")
  assert verify.exit_code == 0 and verify.stdout.startswith("identical: 3 params"), verify.output
  merged, one_shot = jr.load_records(tmp_path / "merged"), jr.load_records(resharded)
  assert [r.placements for r in merged] == [r.placements for r in one_shot]
  assert [r.roles for r in merged] == [r.roles for r in one_shot]
  a, b = _bits(merged), _bits(one_shot)
  assert len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))
  # The merged checkpoint has its own identity.
  ids = {
    json.loads((p / "jaxreshard.json").read_text()).get("checkpoint")
    for p in (tmp_path / "merged", parts[0])
  }
  assert len(ids) == 2
  data = _json_out(_run("merge", tmp_path / "again", *parts, "--json"))
  assert data == dict(out=str(tmp_path / "again"), world_size=6, parts=6, archives=6)


def test_merge_refusals_are_one_line_and_leave_no_out(ckpt, parts, tmp_path):
  root, src = ckpt
  jr.save_records(tmp_path / "step4", _with_count(src, 4))
  assert _run("reshard", tmp_path / "step4", tmp_path / "late5", "-w", 6, "-r", 5).exit_code == 0
  assert _run("reshard", root / "ckpt8", tmp_path / "w3", "-w", 3, "-r", 2).exit_code == 0
  out = tmp_path / "out"
  cases = [
    (parts + [parts[2]], r"part2 is one part given twice; parts must hold disjoint ranks"),
    (parts[:2] + parts[4:], r"ranks \[2, 3\] of 6 are in none of the parts"),
    (parts[:5] + [tmp_path / "w3"], r"world size 3 but .*part0 has 6"),
    (
      parts[:5] + [tmp_path / "late5"],
      r"late5 has \.count = 4 but .*part0 has \.count = 3;"
      r" parts of different steps",
    ),
  ]
  for args, needle in cases:
    line = _one_line_error(_run("merge", out, *args))
    assert re.search(needle, line), line
    assert not out.exists()
  out.mkdir()
  assert "already exists" in _one_line_error(_run("merge", out, *parts))


def test_verify_of_a_part_says_partial_and_suggests_merge(ckpt, parts):
  root, _ = ckpt
  line = _one_line_error(_run("verify", root / "ckpt8", parts[2]))
  assert "partial checkpoint: ranks [2] of 6" in line and "jaxreshard merge" in line, line


@pytest.mark.parametrize("args", [(), ("--dry-run",), ("-r", 0)])
def test_reshard_of_a_part_says_partial_and_suggests_merge_as_verify_does(
  ckpt, parts, tmp_path, args
):
  line = _one_line_error(_run("reshard", parts[2], tmp_path / "o", "-w", 2, *args))
  assert "partial checkpoint: ranks [2] of 6" in line and "jaxreshard merge" in line, line
  assert not (tmp_path / "o").exists()


def test_mixed_steps_refusal_names_the_scalar_path_inspect_shows(tmp_path):
  opt = optax.adam(1e-3)
  params = {"w": np.ones((10,), np.float32)}
  at3, at4 = (
    _with_count(jr.shard_state(opt, params, opt.init(params), world_size=4), c) for c in (3, 4)
  )
  with set_unchecked():  # a save refuses it; another writer may not
    jr.save_records(tmp_path / "mixed", at3[:3] + at4[3:])
  paths = [c["path"] for c in _json_out(_run("inspect", tmp_path / "mixed", "--json"))["clocks"]]
  assert paths == ["[0].count"]
  line = _one_line_error(_run("reshard", tmp_path / "mixed", tmp_path / "o", "-w", 3))
  assert "archive 3 has clock scalar [0].count = " in line, line
  assert "not one checkpoint" in line, line
  # verify refuses it with the same words (a checkpoint no restore returns is no state).
  jr.save_records(tmp_path / "at3", at3)
  refused = line.split("error: ", 1)[1]
  line = _one_line_error(_run("verify", tmp_path / "at3", tmp_path / "mixed"))
  assert line == f"jaxreshard: error: {tmp_path / 'mixed'}: {refused}", line
  with pytest.raises(
    jr.PlacementError, match=r"has clock scalar \[0\]\.count = .*4.* but archive 0 has"
  ):
    jr.reshard(at3[:3] + at4[3:], jr.plan(at3[:3] + at4[3:], world_size=3, rank=0))


@pytest.mark.parametrize(
  "count",
  [
    lambda: jax.numpy.asarray(2**40),  # weak-typed int64 (a Python int under x64)
    lambda: np.uint64(2**64 - 1),
    lambda: jax.numpy.asarray(10**18, jax.numpy.int64),
  ],
)
def test_64_bit_clock_scalars_saved_with_x64_read_without_it(tmp_path, count):
  # Read where x64 is off, a 64-bit scalar keeps every bit (a numpy scalar):
  # inspect and verify print it, never an overflow.
  params = {"a": np.arange(4.0, dtype=np.float32)}
  opt = optax.adam(1e-3)
  with jax.enable_x64(True):
    state = opt.init(params)
    state = (state[0]._replace(count=count()),) + tuple(state[1:])
    expected = np.asarray(state[0].count)
    jr.save_records(tmp_path / "c", jr.shard_state(opt, params, state, world_size=2))
  loaded = jr.load_records(tmp_path / "c")[0].state[0].count
  assert np.asarray(loaded).dtype == expected.dtype
  assert np.asarray(loaded).tobytes() == expected.tobytes()
  result = _run("inspect", tmp_path / "c", "--json")
  assert result.exit_code == 0, result.output
  (clock,) = json.loads(result.stdout)["clocks"]
  assert clock["value"] == expected.item() and clock["dtype"] == expected.dtype.name
  assert _run("verify", tmp_path / "c", tmp_path / "c").exit_code == 0


def test_reads_without_dry_run_is_refused_and_writes_nothing(ckpt, tmp_path):
  root, _ = ckpt
  line = _one_line_error(_run("reshard", root / "ckpt8", tmp_path / "o", "-w", 6, "--reads"))
  assert "--dry-run" in line and not (tmp_path / "o").exists()


def _index(path):
  return json.loads((path / "jaxreshard.json").read_text())


def _leftovers(parent, name):
  return [e for e in os.listdir(parent) if e == name or e.startswith(f".{name}.tmp-")]


def test_reshard_outputs_name_their_source_checkpoint(ckpt, resharded, parts, tmp_path):
  root, _ = ckpt
  source_id = _index(root / "ckpt8")["checkpoint"]
  assert _index(root / "ckpt8")["source"] is None  # a save of its own
  layouts = set()
  for path in [resharded] + parts:
    src = _index(path)["source"]
    assert sorted(src) == ["checkpoint", "layout", "world_size"]
    assert src["checkpoint"] == source_id and src["world_size"] == 6
    layouts.add(src["layout"])
  assert len(layouts) == 1  # every rank of one target shares its layout
  assert _json_out(_run("inspect", parts[2], "--json"))["source"] == _index(parts[2])["source"]
  text = _run("inspect", parts[2]).stdout
  assert f"resharded from checkpoint {source_id} to world size 6" in text
  assert _json_out(_run("inspect", root / "ckpt8", "--json"))["source"] is None
  # A merge names the parts' source too, under an identity of its own.
  assert _run("merge", tmp_path / "m", *parts).exit_code == 0
  merged = _index(tmp_path / "m")
  assert merged["source"] == _index(parts[0])["source"]
  assert merged["checkpoint"] not in (source_id, _index(parts[0])["checkpoint"])


def test_merge_refuses_parts_of_two_saves_of_the_same_state(ckpt, parts, tmp_path):
  # Same model, same step, same bits: only the save differs. Mixing its parts
  # would make a checkpoint no save ever held; it is refused, and nothing is left.
  root, src = ckpt
  jr.save_records(tmp_path / "again", src)
  assert _run("reshard", tmp_path / "again", tmp_path / "other5", "-w", 6, "-r", 5).exit_code == 0
  first_id, other_id = (_index(p)["checkpoint"] for p in (root / "ckpt8", tmp_path / "again"))
  assert first_id != other_id
  out = tmp_path / "out"
  for extra in ((), ("--json",)):
    result = _run("merge", out, *parts[:5], tmp_path / "other5", *extra)
    line = _one_line_error(result)
    assert re.search(
      rf"other5 was resharded from checkpoint {other_id} but .*part0 from"
      rf" checkpoint {first_id}; parts of two different saves are never merged",
      line,
    ), line
    assert result.stdout == ""
    assert _leftovers(tmp_path, "out") == []
  # In any order, and whichever part comes first.
  line = _one_line_error(_run("merge", out, tmp_path / "other5", *parts[:5]))
  assert other_id in line and first_id in line, line
  assert _leftovers(tmp_path, "out") == []


@pytest.mark.parametrize(
  "change, needle",
  [
    (
      lambda p: p.update(head=np.zeros((10,), np.float32)),
      r"has param 'head' of shape \(10,\), dtype float32 but .*part0 of shape \(9,\),"
      r" dtype float32",
    ),
    (lambda p: p.update(tail=np.zeros((3,), np.float32)), r"holds other parameters than .*part0"),
  ],
)
def test_merge_refuses_parts_whose_layouts_disagree(
  ckpt, parts, tmp_path, monkeypatch, change, needle
):
  # Another model at the same step, with the same clock: its rank 5 is no part
  # of this target.
  root, _ = ckpt
  params = jax.tree.map(lambda x: x, PARAMS)
  change(params)
  monkeypatch.setitem(globals(), "PARAMS", params)
  jr.save_records(tmp_path / "model2", _records(8))
  assert _run("reshard", tmp_path / "model2", tmp_path / "p5", "-w", 6, "-r", 5).exit_code == 0
  line = _one_line_error(_run("merge", tmp_path / "out", *parts[:5], tmp_path / "p5"))
  assert re.search(needle + "; parts of different target layouts are never merged", line), line
  assert _leftovers(tmp_path, "out") == []


def test_merge_refuses_parts_whose_dtypes_disagree(tmp_path):
  opt = optax.adam(1e-3)
  for name, dtype in (("f32", np.float32), ("bf16", jax.numpy.bfloat16)):
    params = {"w": np.arange(5).astype(dtype), "v": np.ones(3, np.float32)}
    jr.save_records(tmp_path / name, jr.shard_state(opt, params, opt.init(params), world_size=2))
    for r in range(2):
      assert (
        _run("reshard", tmp_path / name, tmp_path / f"{name}.{r}", "-w", 3, "-r", r).exit_code == 0
      )
  assert _run("reshard", tmp_path / "f32", tmp_path / "f32.2", "-w", 3, "-r", 2).exit_code == 0
  line = _one_line_error(
    _run("merge", tmp_path / "out", tmp_path / "f32.0", tmp_path / "bf16.1", tmp_path / "f32.2")
  )
  assert re.search(
    r"bf16\.1 has param 'w' of shape \(5,\), dtype bfloat16 but .*f32\.0 of"
    r" shape \(5,\), dtype float32; parts of different target layouts",
    line,
  ), line
  assert _leftovers(tmp_path, "out") == []
  assert _run("merge", tmp_path / "out", *(tmp_path / f"f32.{r}" for r in range(3))).exit_code == 0


@pytest.mark.parametrize(
  "edit, needle",
  [
    (lambda d: d.update(source=None), "names no checkpoint it was resharded from"),
    (
      lambda d: d["source"].update(layout="0" * 64),
      "archive 0 does not have the target layout its index declares",
    ),
  ],
)
def test_merge_refuses_a_part_that_does_not_say_its_source(parts, tmp_path, edit, needle):
  part = tmp_path / "p5"
  shutil.copytree(parts[5], part)
  _edit_index(part, edit)
  line = _one_line_error(_run("merge", tmp_path / "out", *parts[:5], part))
  assert needle in line, line
  assert _leftovers(tmp_path, "out") == []


def test_merge_refuses_a_part_whose_archive_holds_two_ranks(tmp_path):
  """A reshard's part holds one rank of every group in each archive. A hand-made part
  whose archive holds rank 0 of one param and rank 1 of another is refused: merged by
  one group's rank, it made a checkpoint holding rank 1 of the other twice (and its
  rank 0 nowhere), which every restore refused."""
  from jaxreshard._src.checkpoint import reader as _reader
  from tests._core_util import adam_records

  records = adam_records(2, {"a": ((4,), jnp.float32), "b": ((6,), jnp.float32)})
  jr.save_records(tmp_path / "src", records)
  source = _reader.Source(jr.open_checkpoint(tmp_path / "src").id, 2)
  first, second = records
  leaves, treedef = jax.tree.flatten(first.state)
  theirs = jax.tree.leaves(second.state)
  mixed = jr.ShardRecord(
    first.version,
    tuple(q if p.param == "b" else p for p, q in zip(first.placements, second.placements)),
    jax.tree.unflatten(
      treedef, [y if r == "b" else x for x, y, r in zip(leaves, theirs, first.roles)]
    ),
    first.roles,
  )
  assert {(p.param, p.rank) for p in mixed.placements} == {("a", 0), ("b", 1)}
  jr.save_records(tmp_path / "p0", _reader.SourcedRecords([mixed], source))
  jr.save_records(tmp_path / "p1", _reader.SourcedRecords([second], source))
  line = _one_line_error(_run("merge", tmp_path / "out", tmp_path / "p0", tmp_path / "p1"))
  assert f"{tmp_path / 'p0'}: archive 0 holds rank 0 of one group and rank 1 of another" in line
  assert _leftovers(tmp_path, "out") == []


@pytest.mark.parametrize(
  "edit, needle",
  [
    (lambda d: d["source"].update(checkpoint="../../x"), "source: invalid checkpoint identity"),
    (lambda d: d["source"].update(checkpoint=7), "source: invalid checkpoint identity"),
    (lambda d: d["source"].update(world_size=True), "expected int, got bool"),
    (lambda d: d["source"].update(world_size=2**40), "world_size 1099511627776 must be between"),
    (lambda d: d["source"].update(world_size=5), "world_size 5, but group 0 has world_size 6"),
    (
      lambda d: d["source"].update(layout="x" * 10**6),
      r"invalid layout 'xxx.*\(1000002 characters\)",
    ),
    (lambda d: d["source"].update(extra=1), "expected checkpoint, world_size and layout"),
    (lambda d: d.update(source=[1]), "source: expected dict, got list"),
    (lambda d: d.pop("source"), "unexpected index keys"),
  ],
)
def test_a_hostile_source_is_refused_by_every_command(parts, tmp_path, edit, needle):
  bad = tmp_path / "bad"
  shutil.copytree(parts[5], bad)
  _edit_index(bad, edit)
  for args in (
    ("inspect", bad),
    ("inspect", bad, "--json"),
    ("merge", tmp_path / "o", bad),
    ("reshard", bad, tmp_path / "o", "-w", 1),
  ):
    line = _one_line_error(_run(*args))
    assert re.search(needle, line), (args, line)
    assert len(line) < 600, line
  assert sorted(os.listdir(tmp_path)) == ["bad"]


@pytest.mark.slow
def test_inspect_summarises_huge_clock_arrays_in_bounded_memory(tmp_path):
  # 16 clock leaves of 65,536 elements each (a million in all): inspect shows
  # the first elements of each, in output and memory that do not grow with them.
  import tracemalloc

  params = {"w": np.ones(6, np.float32)}
  opt = optax.chain(*[optax.scale_by_adam() for _ in range(16)])

  def with_counts(base):
    return tuple(
      s._replace(count=((np.arange(65536) * (i + base)) % 251).astype(np.uint8))
      for i, s in enumerate(opt.init(params))
    )

  jr.save_records(tmp_path / "c", jr.shard_state(opt, params, with_counts(1), world_size=2))
  index_bytes = (tmp_path / "c" / "jaxreshard.json").stat().st_size
  for extra in ((), ("--json",)):
    tracemalloc.start()
    try:
      result = _run("inspect", tmp_path / "c", *extra)
      peak = tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()
    assert result.exit_code == 0, result.output
    assert len(result.stdout) < 20_000, len(result.stdout)
    assert peak < 8 * index_bytes, (peak, index_bytes)
  clocks = json.loads(result.stdout)["clocks"]
  assert len(clocks) == 16
  for i, c in enumerate(clocks):
    first = ((np.arange(16) * (i + 1)) % 251).astype(np.uint8)
    assert c["truncated"] and c["shape"] == [65536] and c["dtype"] == "uint8"
    assert c["value"] == first.tolist() and c["bits"] == first.tobytes().hex()
  text = _run("inspect", tmp_path / "c").stdout
  assert (
    "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, ...] (65536 elements of shape"
    " (65536,))" in text
  ), text
  # Small scalars are whole and not marked.
  small = json.loads(_run("inspect", _save_adam(tmp_path / "small"), "--json").stdout)["clocks"]
  assert [c["truncated"] for c in small] == [False]
  # verify names a differing huge clock in a bounded line.
  jr.save_records(tmp_path / "d", jr.shard_state(opt, params, with_counts(2), world_size=3))
  result = _run("verify", tmp_path / "c", tmp_path / "d")
  assert result.exit_code == EXIT_DIFFERENT
  # Its values as numbers, the first 16 of each side, and its size.
  assert "scalar [0].count: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, ...]" in (
    result.stdout
  )
  assert "(65536 elements of shape (65536,))" in result.stdout
  assert max(len(l) for l in result.stdout.splitlines()) < 400


def _save_adam(path, world_size=2):
  params = {"w": np.arange(5, dtype=np.float32)}
  opt = optax.adam(1e-3)
  jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=world_size))
  return path


@pytest.mark.parametrize(
  "args, needle",
  [
    (("reshard", "CK", "O"), r"Missing option '--world-size' / '-w'\. \(jaxreshard reshard --help"),
    (("reshard", "CK", "O", "--json"), r"Missing option '--world-size'"),
    (("reshard", "CK", "O", "-w", "six", "--json"), r"Invalid value for '--world-size' / '-w'"),
    (("inspect", "--json"), r"Missing argument 'CHECKPOINT'"),
    (("inspect", "CK", "--jsn"), r"No such option: --jsn"),
    (("verify", "CK"), r"Missing argument 'OUT'"),
    (("merge", "O", "--json"), r"Missing argument 'PART\.\.\.'|Missing argument 'PART'"),
    (("demo", "--steps", "0", "--json"), r"Invalid value for '--steps'"),
    (("bogus", "--json"), r"No such command 'bogus'\. \(jaxreshard --help shows the usage\)"),
    (("--bogus",), r"No such option: --bogus"),
  ],
)
def test_usage_errors_are_one_line(tmp_path, args, needle):
  _save_adam(tmp_path / "ck")
  args = [
    str(tmp_path / "ck") if a == "CK" else str(tmp_path / "o") if a in ("O",) else a for a in args
  ]
  result = _run(*args)
  line = _one_line_error(result)
  assert re.search(needle, line), line
  assert result.stdout == ""
  assert sorted(os.listdir(tmp_path)) == ["ck"]


@pytest.mark.slow
def test_usage_errors_are_one_line_in_a_subprocess(tmp_path):
  bad = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxreshard",
      "reshard",
      str(tmp_path / "x"),
      str(tmp_path / "y"),
      "--json",
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert bad.returncode == EXIT_ERROR and bad.stdout == ""
  assert bad.stderr.splitlines() == [
    "jaxreshard: error: Missing option '--world-size' / '-w'. (jaxreshard reshard --help"
    " shows the usage)"
  ]


def test_reshard_refuses_an_out_inside_its_checkpoint(tmp_path):
  ck = _save_adam(tmp_path / "ck")
  before = sorted(p.relative_to(ck) for p in ck.rglob("*"))
  os.symlink(ck, tmp_path / "alias")
  for out in (ck / "resharded", ck / "archive_00000" / "x", tmp_path / "alias" / "r"):
    for extra in ((), ("-r", "1"), ("--json",)):
      line = _one_line_error(_run("reshard", ck, out, "-w", 3, *extra))
      assert "is inside" in line and "a checkpoint this command reads" in line, line
  assert sorted(p.relative_to(ck) for p in ck.rglob("*")) == before
  # A part inside a part is refused by merge the same way.
  assert _run("reshard", ck, tmp_path / "p0", "-w", 2, "-r", 0).exit_code == 0
  assert _run("reshard", ck, tmp_path / "p1", "-w", 2, "-r", 1).exit_code == 0
  line = _one_line_error(_run("merge", tmp_path / "p0" / "m", tmp_path / "p0", tmp_path / "p1"))
  assert "is inside" in line, line
  # A sibling whose name starts with the checkpoint's is outside it.
  assert _run("reshard", ck, tmp_path / "ck2", "-w", 3).exit_code == 0


def test_an_empty_path_is_refused(tmp_path, monkeypatch):
  # Path("") is ".": clean "" would clean the working directory's saves.
  monkeypatch.chdir(tmp_path)
  (tmp_path / "w").mkdir()
  monkeypatch.chdir(tmp_path / "w")
  stale = tmp_path / ".w.tmp-0123456789abcdef0123456789abcdef-999999999-nohost"
  stale.mkdir()
  for args in (
    ("clean", ""),
    ("clean", "", "--json"),
    ("clean", "", "--all"),
    ("inspect", ""),
    ("reshard", "", "o", "-w", 2),
    ("merge", "", "x"),
    ("verify", "x", ""),
  ):
    line = _one_line_error(_run(*args))
    assert "an empty path names no checkpoint" in line, line
  assert stale.exists() and os.listdir(tmp_path / "w") == []


class _Bar:
  """Records what a progress bar is told (the rich bar draws only on terminals)."""

  def __init__(self):
    self.told = []

  def update(self, task, description):
    self.told.append(description)

  def advance(self, task, n):
    pass


def test_a_batch_is_named_whole_while_it_is_read_and_each_rank_as_it_is_written(ckpt, tmp_path):
  from jaxreshard._src.checkpoint import restore as _restore
  from jaxreshard._src.cli import streams

  root, src = ckpt
  ranks = list(range(6))
  bar = _Bar()
  got = list(streams.targets(root / "ckpt8", None, ranks, 6, 6 << 20, bar, 0))
  assert len(got) == 6
  assert bar.told == ["ranks 0-5/6"] + [f"rank {r}/6" for r in ranks]

  # A batch refused while it is read: the bar names the batch, not its first rank.
  def pad(a):
    a.view(np.uint32)[-1] = 0x80000000  # -0.0 in rank 7's padding of head (9 over 8)
    return a

  with padding_unchecked():
    jr.save_records(
      tmp_path / "badpad", [_replace(r, "head", 0, pad) if i == 7 else r for i, r in enumerate(src)]
    )
  bar = _Bar()
  with pytest.raises(jr.ReshardError, match="padding is not zero"):
    list(streams.targets(tmp_path / "badpad", None, ranks, 6, 6 << 20, bar, 0))
  assert bar.told == ["ranks 0-5/6"]
  # One rank per batch: each named as it is read.
  bar = _Bar()
  small = max(1, _restore.BATCH_BYTES)  # bytes per rank at the batch limit: one rank each
  got = list(streams.targets(root / "ckpt8", None, ranks, 6, 6 * small, bar, 0))
  assert bar.told == [t for r in ranks for t in (f"rank {r}/6", f"rank {r}/6")]


def test_verify_and_merge_show_their_progress_on_terminals(ckpt, parts, tmp_path, monkeypatch):
  """Both read every byte (minutes on a real checkpoint); they printed nothing until
  done, where reshard draws a bar."""
  import io

  from rich.console import Console

  from jaxreshard._src.cli import render as _render

  root, _ = ckpt
  drawn = io.StringIO()
  monkeypatch.setattr(
    _render, "err_console", lambda: Console(file=drawn, force_terminal=True, width=100)
  )
  assert _run("verify", root / "ckpt8", root / "ckpt8").exit_code == 0
  text = drawn.getvalue()
  assert "OUT" in text and " kB" in text, text  # the last frame: the second checkpoint read
  drawn.seek(0), drawn.truncate()
  assert _run("merge", tmp_path / "merged", *parts).exit_code == 0
  assert "merging" in drawn.getvalue() and " kB" in drawn.getvalue(), drawn.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("as_json", [False, True])
def test_a_reader_that_leaves_early_changes_no_exit_code(ckpt, resharded, tmp_path, as_json):
  """`verify A B | head`: the verdict stands (1 for different checkpoints, 0 for
  identical), in text as in JSON; rich's own broken-pipe exit (1) and a blanket 0 did
  not keep it. So does inspect's 0."""
  root, src = ckpt
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
  full = jr.unshard_state(src)
  other = jax.tree.map(lambda x: x, full)
  other.inner_state[0].mu["head"] = np.asarray(full.inner_state[0].mu["head"]) + 1
  jr.save_records(tmp_path / "other", jr.shard_state(opt, PARAMS, other, world_size=8))
  flag = ["--json"] if as_json else []

  def leaves_early(*args):
    p = subprocess.Popen(
      [sys.executable, "-m", "jaxreshard", *map(str, args), *flag],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
    )
    p.stdout.close()  # the reader is gone before the command prints a line
    _, err = p.communicate(timeout=120)
    return p.returncode, err.decode()

  assert leaves_early("verify", root / "ckpt8", tmp_path / "other") == (1, "")
  assert leaves_early("verify", root / "ckpt8", resharded) == (0, "")
  assert leaves_early("inspect", root / "ckpt8") == (0, "")


@pytest.mark.slow
@pytest.mark.parametrize(
  "signum, code, words",
  [("SIGTERM", 128 + 15, "jaxreshard: terminated"), ("SIGINT", 130, "jaxreshard: interrupted")],
)
def test_a_signal_in_the_middle_of_a_reshard_leaves_nothing(tmp_path, signum, code, words):
  """SIGTERM (timeout, batch schedulers, containers) cleans up as Ctrl-C does: it left
  the hidden temporary directory of the save it interrupted, and said nothing. Each
  exits with the shell's code for its signal."""
  import glob
  import signal

  opt = optax.sgd(0.1, momentum=0.9)
  params = {f"p{i}": np.zeros((1 << 20,), np.float32) for i in range(12)}
  state = jax.tree.map(lambda x: np.ones_like(x), opt.init(params))
  jr.save_records(tmp_path / "src", jr.shard_state(opt, params, state, world_size=8))
  # A shell starts background jobs (`pytest &`, nohup) with SIGINT ignored, and a
  # child inherits that: the command gets the handler a terminal's Ctrl-C meets.
  run = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
    " sys.argv = ['jaxreshard', 'reshard', 'src', 'out', '-w', '7'];"
    " runpy.run_module('jaxreshard', run_name='__main__')"
  )
  p = subprocess.Popen(
    [sys.executable, "-c", run],
    cwd=tmp_path,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  deadline = time.monotonic() + 120
  while not glob.glob(str(tmp_path / ".out.tmp-*" / "archive_00001")):
    assert p.poll() is None and time.monotonic() < deadline, p.communicate()
    time.sleep(0.005)
  p.send_signal(getattr(signal, signum))
  _, err = p.communicate(timeout=120)
  assert p.returncode == code, err
  assert err.strip().splitlines()[-1] == words, err
  assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_missing_checkpoint_names_the_temporary_directory_a_save_to_it_left(tmp_path):
  """Where only a save's temporary sibling is there (the save was killed, or runs),
  "does not exist" says so and names ``clean``, instead of leaving the reader to
  guess; another checkpoint's temporary directory is not named."""
  left = f".ck.tmp-{'0' * 32}-7-host"
  (tmp_path / left).mkdir()
  (tmp_path / f".ck2.tmp-{'1' * 32}-8-host").mkdir()
  assert _one_line_error(_run("inspect", tmp_path / "ck")) == (
    f"jaxreshard: error: checkpoint directory {tmp_path / 'ck'} does not exist ({left}: the"
    " temporary directory of a save to it that has not finished;"
    f" `jaxreshard clean {tmp_path}` removes those of killed saves)"
  )
  assert _one_line_error(_run("inspect", tmp_path / "c")) == (
    f"jaxreshard: error: checkpoint directory {tmp_path / 'c'} does not exist"
  )
  spaced = tmp_path / "with space"
  (spaced / left).mkdir(parents=True)
  line = _one_line_error(_run("inspect", spaced / "ck"))
  assert f"`jaxreshard clean '{spaced}'` removes" in line, line


def test_a_sigterm_before_the_command_runs_exits_143_saying_so(capsys):
  """A SIGTERM while the command line is parsed (before any command runs) ends the
  process with 143 and one line, as a SIGTERM in a command does; raised as an
  interrupt there, the parser exited 130 (Ctrl-C's code), silently."""
  from jaxreshard._src.cli import interrupts

  interrupts.put_back(None)  # no command runs
  with pytest.raises(SystemExit) as info:
    interrupts._raise_terminated(signal.SIGTERM, None)
  assert info.value.code == 143 and capsys.readouterr().err == "jaxreshard: terminated\n"
  interrupts.started()
  try:
    with pytest.raises(interrupts.Terminated):
      interrupts._raise_terminated(signal.SIGTERM, None)
  finally:
    interrupts.put_back(None)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_once_the_command_has_reported_keeps_its_exit_code(tmp_path, signame):
  """A SIGTERM or Ctrl-C that lands after the command finished and reported (while
  the process exits) is ignored: the exit code is the command's own (0: OUT is
  complete), not the 143 or 130 of an interrupted command, after which a job script
  would retry and fail on an OUT that exists. (A Ctrl-C there killed the process,
  or printed a KeyboardInterrupt traceback from the threads' shutdown.)"""
  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": np.zeros((10,), np.float32)}
  jr.save_records(tmp_path / "src", jr.shard_state(opt, params, opt.init(params), world_size=4))
  # The signal comes once the console script's main() has returned: as late as a
  # real one can come before the interpreter's finalization puts back the default
  # handler. Run with argv given (a program running the command line in its own
  # process), main() puts back that program's handler: SIGTERM is its again.
  run = (
    "import os, signal, sys, time; from jaxreshard._src.cli.commands import main\n"
    "mine = lambda *a: print('the program handled it')\n"
    f"signal.signal(signal.{signame}, mine)\n"
    "argv = None if sys.argv[1] == 'script' else sys.argv[2:]\n"
    "sys.argv = ['jaxreshard', *sys.argv[2:]]\n"
    "try:\n  main(argv)\n"
    "except SystemExit as e:\n  code = e.code\n"
    f"os.kill(os.getpid(), signal.{signame}); time.sleep(0.2); sys.exit(code)\n"
  )
  for how, out in (("script", "out"), ("embedded", "out2")):
    p = subprocess.run(
      [sys.executable, "-c", run, how, "reshard", "src", out, "-w", "3"],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=120,
    )
    assert p.returncode == 0 and p.stderr == "", (how, p.stderr)
    assert "wrote 3 of 3 target ranks" in p.stdout, (how, p.stdout)
    assert ("the program handled it" in p.stdout) == (how == "embedded"), (how, p.stdout)
    assert jr.restore(tmp_path / out, world_size=3, rank=2).placements


def test_an_internal_error_is_one_line_and_exit_2(ckpt, monkeypatch):
  """A bug (an exception that is not bad input) is reported in one line, as a bug, with
  exit 2; JAXRESHARD_TRACEBACK=1 lets it through with its traceback."""
  from jaxreshard._src.cli import commands

  def bug(*args, **kwargs):
    raise RuntimeError("a bug in inspect")

  monkeypatch.setattr(commands, "inspect_info", bug)
  root, _ = ckpt
  assert _one_line_error(_run("inspect", root / "ckpt8")) == (
    "jaxreshard: error: internal error, please report it: RuntimeError: a bug in inspect"
    " (JAXRESHARD_TRACEBACK=1 shows where)"
  )
  monkeypatch.setenv("JAXRESHARD_TRACEBACK", "1")
  result = CliRunner().invoke(app, ["inspect", str(root / "ckpt8")])
  assert isinstance(result.exception, RuntimeError) and result.exit_code == 1


def test_a_weak_64_bit_clock_scalar_stays_weak_through_a_conversion_without_x64(tmp_path):
  """A checkpoint saved with x64 holds a weak int64 ``count`` (``jnp.asarray(3)``); a
  process without x64 (the CLI's) keeps it on the host with every bit, and now
  says it is weak, so the conversion writes it back weak as a restore reads it."""
  from jaxreshard._src.core.clock import WeakHostScalar

  opt = optax.sgd(0.1, momentum=0.9)
  params = {"w": np.ones((5,), np.float32)}
  src = jr.shard_state(opt, params, opt.init(params), world_size=2)
  count = np.asarray(2**40 + 3, np.int64).view(WeakHostScalar)  # an x64 save, read without x64
  src = [
    jr.ShardRecord(r.version, r.placements, {"trace": r.state[0].trace, "step": count}) for r in src
  ]
  jr.save_records(tmp_path / "c", src)
  assert _run("reshard", tmp_path / "c", tmp_path / "o", "-w", 3).exit_code == 0
  for path in (tmp_path / "c", tmp_path / "o"):
    step = jr.load_records(path)[0].state["step"]
    assert isinstance(step, WeakHostScalar) and step.weak_type
    assert step.dtype == np.int64 and int(step) == 2**40 + 3
  index = read_json(tmp_path / "o" / "jaxreshard.json")
  assert '"weak":true' in json.dumps(index, separators=(",", ":"))


def test_verify_of_an_incomplete_checkpoint_that_is_no_part_says_what_restore_says(tmp_path):
  """Ranks missing from a checkpoint another writer made (it names no source) are
  no part of a reshard to merge: verify refuses with the restore's words, not with
  a merge hint that merge would refuse."""
  opt = optax.adam(1e-3)
  params = {"w": np.ones((10,), np.float32)}
  with set_unchecked():
    jr.save_records(tmp_path / "three", jr.shard_state(opt, params, opt.init(params), 4)[:3])
  with pytest.raises(jr.PlacementError) as restored:
    jr.restore(tmp_path / "three", world_size=2, rank=0)
  jr.save_records(tmp_path / "full", jr.shard_state(opt, params, opt.init(params), 4))
  line = _one_line_error(_run("verify", tmp_path / "full", tmp_path / "three"))
  assert "merge" not in line and str(restored.value) in line, line
  assert "is not a complete checkpoint, which verify needs" in line, line


@pytest.mark.parametrize("n", [200, 250])
def test_inspect_lists_the_first_and_last_params_of_a_large_table_unless_asked_for_all(tmp_path, n):
  """More than 200 params: the first 100 and the last 20, and a line naming how many are
  left out between which two; ``--all`` and ``--json`` list every one."""
  ids = [f"p{i:03d}" for i in range(n)]
  params = {pid: np.zeros(2 + i % 3, np.float32) for i, pid in enumerate(ids)}
  opt = optax.adam(1e-3)
  jr.save_records(tmp_path / "c", jr.shard_state(opt, params, opt.init(params), world_size=2))
  rows = lambda text: [pid for pid in ids if re.search(rf"│ {pid} ", text)]  # noqa: E731
  default = _run("inspect", tmp_path / "c")
  assert default.exit_code == 0, default.output
  every = _run("inspect", tmp_path / "c", "--all")
  assert every.exit_code == 0, every.output
  assert rows(every.stdout) == ids
  if n <= 200:
    assert rows(default.stdout) == ids and "not listed" not in default.stdout
  else:
    assert rows(default.stdout) == ids[:100] + ids[-20:]
    assert (
      f"{n - 120} params not listed between p099 and p{n - 20:03d} (--all lists every one)"
      in (default.stdout)
    )
    assert "not listed" not in every.stdout
  assert f"{n} params, " in default.stdout
  assert [p["param"] for p in _json_out(_run("inspect", tmp_path / "c", "--json"))["params"]] == ids


def _without_permission_override() -> list[str]:
  """A command prefix under which mode bits bind (root's override dropped), or skip."""
  if os.geteuid() != 0:
    return []
  if shutil.which("setpriv") is None:
    pytest.skip("root reads any file, and there is no setpriv here to drop that")
  caps = "-dac_override,-dac_read_search"
  return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]


@pytest.mark.slow
def test_a_checkpoint_directory_that_cannot_be_read_is_said_so(tmp_path):
  """A checkpoint whose directory the process may not look into: its index and its
  steps both read as missing, and the refusal sent the user after a save that did
  not finish. The OS's own error names it (as for any file it may not read)."""
  ck = tmp_path / "ck"
  jr.save_records(ck, _records(3))
  prefix = _without_permission_override()
  os.chmod(ck, 0)
  try:
    cli = subprocess.run(
      [*prefix, sys.executable, "-m", "jaxreshard", "inspect", str(ck)],
      capture_output=True,
      text=True,
      timeout=120,
    )
    lib = subprocess.run(
      [
        *prefix,
        sys.executable,
        "-c",
        "import sys, jaxreshard as jr\n"
        "try:\n  jr.open_checkpoint(sys.argv[1])\n"
        "except Exception as e:\n  print(type(e).__name__, e)",
        str(ck),
      ],
      capture_output=True,
      text=True,
      timeout=120,
    )
  finally:
    os.chmod(ck, 0o755)
  assert cli.returncode == EXIT_ERROR and cli.stdout == ""
  assert cli.stderr.splitlines() == [
    f"jaxreshard: error: Permission denied (looking in it for jaxreshard.json or orbax steps): {ck}"
  ]
  assert lib.stdout.startswith("PermissionError "), lib.stdout + lib.stderr
  assert "a save that did not finish" not in lib.stdout


@pytest.mark.parametrize("signal_kind", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize(
  "where", ["after the rename", "while reporting", "before the rename", "another made OUT"]
)
def test_an_interrupt_says_whether_the_output_was_already_in_place(
  ckpt, tmp_path, monkeypatch, where, signal_kind
):
  """Ctrl-C (or SIGTERM) that lands once the save renamed OUT into place (in its last
  syncs, or while the command prints its report) leaves OUT complete, and the
  command says so instead of "interrupted" alone; one that lands before leaves
  nothing of it, and says nothing of an OUT another made meanwhile. The exit code
  is the signal's either way."""
  from jaxreshard._src.checkpoint import tempdir as _tempdir
  from jaxreshard._src.cli import interrupts as _interrupts
  from jaxreshard._src.cli import render as _render

  root, src = ckpt
  out = tmp_path / "out"
  interrupt = _interrupts.Terminated if signal_kind == "SIGTERM" else KeyboardInterrupt
  rename = _tempdir.commit_dir

  def interrupted_after(path, final):  # the rename done: the syncs follow
    rename(path, final)
    raise interrupt

  def interrupted_before(path, final):
    if where == "another made OUT":
      os.mkdir(out)
    raise interrupt

  def interrupted_report(*args, **kwargs):
    raise interrupt

  if where == "while reporting":
    monkeypatch.setattr(_render, "cell", interrupted_report)
  elif where == "after the rename":
    monkeypatch.setattr(_tempdir, "commit_dir", interrupted_after)
  else:
    monkeypatch.setattr(_tempdir, "commit_dir", interrupted_before)
  result = _run("reshard", root / "ckpt8", out, "-w", 3)
  word = "terminated" if signal_kind == "SIGTERM" else "interrupted"
  assert result.exit_code == (128 + 15 if signal_kind == "SIGTERM" else 130), result.output
  assert "Traceback" not in result.output
  if where in ("before the rename", "another made OUT"):
    assert result.stderr.strip() == f"jaxreshard: {word}"
    assert os.listdir(out) == [] if where == "another made OUT" else not out.exists()
    return
  assert result.stderr.strip() == f"jaxreshard: {word} after {out} was written: it is complete"
  got = jr.load_records(out)
  for r, g in enumerate(got):
    assert_records_equal(g, jr.reshard(src, jr.plan(src, world_size=3, rank=r)))


@pytest.mark.parametrize("when", ["this save's rename never ran", "an earlier command's"])
def test_an_interrupt_claims_no_directory_that_reuses_a_recorded_inode(
  ckpt, tmp_path, monkeypatch, when
):
  """A file system reuses a removed directory's inode number at once (ext4 does): a
  directory another process makes at OUT as the save unwinds may have the number of
  this save's temporary directory, or of an OUT an earlier command of the process
  wrote and the user removed. Neither is this command's output."""
  from jaxreshard._src.checkpoint import rename as _rename
  from jaxreshard._src.checkpoint import tempdir as _tempdir

  root, _ = ckpt
  out = tmp_path / "out"
  if when == "an earlier command's":
    assert _run("reshard", root / "ckpt8", out, "-w", 3).exit_code == 0
    shutil.rmtree(out)

    def interrupted(self, *args, **kwargs):  # while the save checks its files
      raise KeyboardInterrupt

    monkeypatch.setattr(_tempdir.TempDir, "check", interrupted)
  else:

    def interrupted(path, final):  # recorded, then interrupted before the rename
      raise KeyboardInterrupt

    monkeypatch.setattr(_tempdir, "commit_dir", interrupted)
  close = _tempdir.TempDir.close
  made = []

  def close_then_another_makes_out(self):
    close(self)
    mine = os.path.dirname(self.path) == str(tmp_path)  # not another test's, collected here
    if mine and not os.path.lexists(out):
      os.mkdir(out)  # another process, as this save unwinds
      made.append(os.stat(out).st_ino)

  monkeypatch.setattr(_tempdir.TempDir, "close", close_then_another_makes_out)
  # The worst case, whatever the file system gives: OUT has the recorded number.
  real_stat = os.stat

  def same_inode(path, *args, **kwargs):
    st = real_stat(path, *args, **kwargs)
    recorded = _rename._COMMITTED.get(os.path.abspath(path))
    if made and os.path.abspath(path) == str(out) and recorded is not None:
      fields = list(st)
      fields[1] = recorded[1]
      return os.stat_result(fields)
    return st

  monkeypatch.setattr(_rename.os, "stat", same_inode)
  result = _run("reshard", root / "ckpt8", out, "-w", 3)
  monkeypatch.setattr(_rename.os, "stat", real_stat)
  assert made, "the save did not unwind through its directory's close"
  assert result.exit_code == 130, result.output
  assert result.stderr.strip() == "jaxreshard: interrupted"
  assert os.listdir(out) == []


def test_an_interrupt_that_lands_in_a_dropped_save_directory_prints_no_traceback(
  tmp_path, monkeypatch
):
  """A finalizer cannot raise: an interrupt that lands while a dropped temporary
  directory (one whose save ended, or is being unwound) releases its descriptors
  was printed by Python with a traceback. It is not reported, and the descriptors
  are released all the same."""
  import gc
  import sys

  from jaxreshard._src.checkpoint import tempdir as _tempdir

  release = _tempdir.TempDir.close
  calls = []

  def interrupted_close(self):
    if id(self) == mine:  # another test's directory may be collected here too
      calls.append(1)
      if len(calls) == 1:
        raise KeyboardInterrupt
    release(self)

  made = _tempdir.new_temp_dir(str(tmp_path / "ck"))
  mine = id(made)
  monkeypatch.setattr(_tempdir.TempDir, "close", interrupted_close)
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  del made
  gc.collect()
  assert not unraisable, unraisable[0].exc_value
  assert len(calls) == 2
  # Its writer is gone: a later save or clean removes it.
  assert [gone for _, gone in _tempdir.temp_dirs(str(tmp_path / "ck"))] == [True]


@pytest.mark.parametrize("what", ["directory", "link", "empty file"])
def test_an_index_that_is_no_index_file_is_refused_as_the_library_refuses_it(ckpt, tmp_path, what):
  """Something other than a signed index file at the index's name: every command says
  what the library's readers say of it, not that the checkpoint has no index."""
  root, _ = ckpt
  path = tmp_path / "ck"
  shutil.copytree(root / "ckpt8", path)
  index = path / "jaxreshard.json"
  os.remove(index)
  if what == "directory":
    os.mkdir(index)
  elif what == "link":
    os.symlink(root / "ckpt8" / "jaxreshard.json", index)
  else:
    index.write_bytes(b"")
  with pytest.raises(jr.ReshardError) as info:
    jr.load_records(path)
  words = str(info.value)
  assert "no jaxreshard.json" not in words
  for args in (
    ("inspect", path),
    ("verify", path, root / "ckpt8"),
    ("reshard", path, tmp_path / "o", "-w", 2),
  ):
    line = _one_line_error(_run(*args))
    assert line == f"jaxreshard: error: {words}", (args, line)


def test_a_dot_dot_after_a_link_is_taken_as_the_kernel_takes_it(ckpt, tmp_path, monkeypatch):
  """``lnk/..`` is the parent of the link's target, not the directory holding the link:
  a save through that path lands where the kernel resolves it, and an OUT that so
  resolves outside the checkpoint it reads is not written inside it (a textual
  normalisation put ``lnk/../ck/out`` at ``ck/out``, inside ``ck``)."""
  root, src = ckpt
  (tmp_path / "x" / "y").mkdir(parents=True)
  (tmp_path / "x" / "d").mkdir()
  os.symlink(tmp_path / "x" / "y", tmp_path / "lnk")
  shutil.copytree(root / "ckpt8", tmp_path / "ck")
  monkeypatch.chdir(tmp_path)
  result = _run("reshard", "ck", "lnk/../ck/out", "-w", 3)
  assert result.exit_code == EXIT_ERROR, result.output
  assert not (tmp_path / "ck" / "out").exists() and not (tmp_path / "x" / "ck").exists()
  assert _run("reshard", "ck", "lnk/../d/out", "-w", 3).exit_code == 0
  assert not (tmp_path / "d").exists()
  got = jr.load_records(tmp_path / "x" / "d" / "out")
  for r, g in enumerate(got):
    assert_records_equal(g, jr.reshard(src, jr.plan(src, world_size=3, rank=r)))
  jr.save_records("lnk/../d/saved", src)
  assert not (tmp_path / "d").exists()
  assert len(jr.load_records(tmp_path / "x" / "d" / "saved")) == 8
