"""The ``jaxreshard`` command line on real checkpoints on disk (no mocks)."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard import _progress
from jaxreshard._cli import EXIT_DIFFERENT, EXIT_ERROR, app

from tests._core_util import assert_records_equal, replace_history as _replace

PARAMS = {"enc": {"kernel": np.zeros((7, 11), np.float32), "bias": np.zeros((5,), np.float32)},
          "head": np.zeros((9,), np.float32)}


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
  for text in ("enc/kernel", "enc/bias", "head", "(7, 11)", "8 archives", "world size 8",
               "learning_rate", "count"):
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
  result = _run("reshard", root / "ckpt8", root / "never", "-m", 6, "--dry-run")
  detail = _run("reshard", root / "ckpt8", root / "never", "-m", 6, "--dry-run", "--reads")
  assert result.exit_code == 0 and detail.exit_code == 0, result.output + detail.output
  assert not (root / "never").exists() and "nothing written" in result.stdout
  summary = result.stdout.splitlines()
  assert summary[0].split() == ["target", "rank", "archives", "read", "bytes", "moved",
                                "target", "bytes", "peak", "memory"]
  assert len(summary) == 1 + 6 + 1
  # With --reads, every read is one line under its rank's line.
  read_lines = [l.split() for l in detail.stdout.splitlines() if re.match(r"    \S", l)
                and not l.split()[0] == "param"]
  index = jr.open_checkpoint(root / "ckpt8")
  for rank in range(6):
    p = _progress.target_plan(index, world_size=6, rank=rank)
    for pid, shape in (("enc/kernel", (7, 11)), ("enc/bias", (5,)), ("head", (9,))):
      t = jr.FlatShard(shape, rank, 6)
      reads = [r for r in p.reads if r.param == pid]
      # The reads tile exactly the target's owned range, each inside its source slot.
      covered = [i for r in reads for i in range(r.lo, r.hi)]
      assert covered == list(range(t.start, t.stop))
      for r in reads:
        s = jr.FlatShard(shape, r.source_rank, 8)
        assert s.start <= r.lo < r.hi <= s.stop and r.local == r.lo - s.start
    assert p.bytes_read == sum(jr.FlatShard(s, rank, 6).owned * 8 for s in ((7, 11), (5,), (9,)))
    row = summary[1 + rank].split()
    assert row[:4] == [str(rank), str(len(p.per_archive)), "of", "8"], row
    assert row[4:6] == [str(p.bytes_read), "B"], row
    mine = [[r.param, str(r.archive), str(r.source_rank), f"[{r.lo},", f"{r.hi})", str(r.local),
             str(r.bytes)] for r in p.reads]
    assert all(m in read_lines for m in mine)
  assert len(read_lines) == sum(
      len(_progress.target_plan(index, world_size=6, rank=r).reads) for r in range(6))
  assert summary[-1].startswith("dry run: 6 target ranks, ")


def test_reshard_writes_exactly_the_target_ranks(ckpt, resharded):
  root, src = ckpt
  got = jr.load_records(resharded)
  assert len(got) == 6
  for rank, rec in enumerate(got):
    assert_records_equal(rec, jr.reshard(src, jr.plan(src, world_size=6, rank=rank)))
  one = _run("reshard", root / "ckpt8", root / "rank2", "-m", 6, "--rank", 2)
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
  jr.save_records(root / "badpad", padded)
  result = _run("verify", root / "ckpt8", root / "badpad")
  assert result.exit_code == EXIT_DIFFERENT
  assert "param 'head' buffer 0" in result.stdout and "padding is not zero" in result.stdout


def test_errors_are_one_line(ckpt, resharded, tmp_path):
  root, _ = ckpt
  assert "does not exist" in _one_line_error(_run("inspect", tmp_path / "missing"))
  assert "not a jaxreshard checkpoint" in _one_line_error(_run("verify", tmp_path, resharded))
  assert "already exists" in _one_line_error(_run("reshard", root / "ckpt8", resharded, "-m", 6))
  assert "outside world_size 6" in _one_line_error(
      _run("reshard", root / "ckpt8", tmp_path / "o", "-m", 6, "-r", 6))
  assert "world_size 0" in _one_line_error(_run("reshard", root / "ckpt8", tmp_path / "o", "-m", 0))
  mixed = tmp_path / "mixed"
  shutil.copytree(root / "ckpt8", mixed)
  shutil.rmtree(mixed / "archive_00003")
  assert "archive 3" in _one_line_error(_run("inspect", mixed))
  assert not (tmp_path / "o").exists()


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
  line = _one_line_error(_run("reshard", broken, tmp_path / "out", "-m", 6))
  assert "archive 7" in line and "corrupted" in line, line
  assert sorted(os.listdir(tmp_path)) == ["broken"]  # no OUT, no temporary leftovers
  result = _run("reshard", root / "ckpt8", tmp_path / "out", "-m", 6)
  assert result.exit_code == 0 and len(jr.load_records(tmp_path / "out")) == 6


def test_subprocess_python_m(ckpt, resharded):
  root, _ = ckpt
  ok = subprocess.run([sys.executable, "-m", "jaxreshard", "verify", str(root / "ckpt8"),
                       str(resharded)], capture_output=True, text=True, timeout=120)
  assert ok.returncode == 0, ok.stderr
  assert ok.stdout.startswith("identical: 3 params")
  bad = subprocess.run([sys.executable, "-m", "jaxreshard", "reshard", str(root / "nope"),
                        str(root / "x"), "--world-size", "3"],
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == EXIT_ERROR and bad.stdout == ""
  assert bad.stderr.strip().splitlines() == [
      f"jaxreshard: error: checkpoint directory {root / 'nope'} does not exist"]
  assert _run("--version").stdout == f"jaxreshard {jr.__version__}\n"


def test_progress_bar_shows_bytes_and_eta_on_terminals():
  import io

  from rich.console import Console

  text = io.StringIO()
  with _progress.progress_bar(Console(file=text, force_terminal=True, width=100)) as bar:
    task = bar.add_task("rank 0/6", total=2_000_000)
    bar.advance(task, 1_000_000)
  assert "rank 0/6" in text.getvalue() and "1.0/2.0 MB" in text.getvalue()
  assert "-:--:--" in text.getvalue() or "0:00:" in text.getvalue()  # the ETA column
  piped = io.StringIO()
  with _progress.progress_bar(Console(file=piped)) as bar:
    bar.advance(bar.add_task("x", total=10), 10)
  assert piped.getvalue() == ""  # pipes and logs get no frozen bar


# --- untrusted names, metadata and arguments ------------------------------------


def _first_namedtuple(tree):
  if isinstance(tree, list) and tree and tree[0] == "n":
    return tree
  for child in (tree[-1] if isinstance(tree, list) and tree else []):
    found = _first_namedtuple(child)
    if found is not None:
      return found
  return None


def _edit_index(path, fn):
  index = path / "jaxreshard.json"
  data = json.loads(index.read_text())
  fn(data)
  index.write_text(json.dumps(data))


def test_names_and_paths_are_printed_literally_and_escaped(tmp_path):
  # Rich markup and terminal escapes in param names and paths are data, never
  # markup or control sequences.
  params = {"\x1b[2J": np.ones(4, np.float32), "[bold]y": np.ones(2, np.float32),
            "[/x]": np.ones(3, np.float32)}
  opt = optax.adam(1e-3)
  (tmp_path / "[").mkdir()
  path = tmp_path / "[/p] \x1b[31m"
  jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=2))
  for args in (("inspect", path), ("reshard", path, tmp_path / "[/o]", "-m", 3, "--dry-run",
                                   "--reads"), ("reshard", path, tmp_path / "[/o]", "-m", 3),
               ("verify", path, tmp_path / "[/o]")):
    result = _run(*args)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout, result.stdout
  result = _run("inspect", path)
  assert "\\x1b[2J" in result.stdout and "[bold]y" in result.stdout
  assert "[%2Fx]" in result.stdout  # the param id of the key "[/x]"
  assert "[/p] \\x1b[31m" in result.stdout
  missing = _one_line_error(_run("inspect", tmp_path / "gone \x1b[2J"))
  assert "\x1b" not in missing and "gone \\x1b[2J" in missing


@pytest.mark.parametrize("edit, needle", [
    # a NamedTuple node whose module is a list (unhashable)
    (lambda d: _first_namedtuple(d["layouts"][0]["tree"]).__setitem__(1, ["optax"]),
     "invalid NamedTuple"),
    (lambda d: d["groups"][0].update(world_size=10**12), "between 1 and 1048576"),
    (lambda d: d["groups"][0].update(world_size=0), "world_size 0 must be"),
    (lambda d: d["groups"][0].update(world_size=True), "expected int, got bool"),
    (lambda d: d["params"][0].__setitem__(1, [10**30]), "shape"),
    (lambda d: d["groups"][0]["ranks"].__setitem__(1, d["groups"][0]["ranks"][0]), "twice|both hold rank 0"),
    (lambda d: d["groups"][0]["ranks"][1].__setitem__(1, -1), "has rank -1"),
    (lambda d: d.update(record_version=2), "record version 2 is not supported"),
    (lambda d: d["clocks"][0].extend(d["clocks"][0][-1:] * 1100), "more than an optimizer has"),
    (lambda d: d["params"][0].__setitem__(0, "x" * 5000), "param id of 5000 characters"),
])
def test_hostile_index_is_one_line_exit_2_in_every_command(ckpt, tmp_path, edit, needle):
  root, _ = ckpt
  bad = tmp_path / "bad"
  shutil.copytree(root / "ckpt8", bad)
  _edit_index(bad, edit)
  for args in (("inspect", bad), ("verify", root / "ckpt8", bad), ("verify", bad, root / "ckpt8"),
               ("reshard", bad, tmp_path / "o", "-m", 3, "--dry-run"),
               ("reshard", bad, tmp_path / "o", "-m", 3)):
    assert re.search(needle, _one_line_error(_run(*args))), args
  assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_verify_of_a_partial_checkpoint_says_so(ckpt, tmp_path):
  root, _ = ckpt
  result = _run("reshard", root / "ckpt8", tmp_path / "r2", "-m", 6, "-r", 2)
  assert result.exit_code == 0, result.output
  line = _one_line_error(_run("verify", root / "ckpt8", tmp_path / "r2"))
  assert "is not a complete checkpoint" in line and "hold ranks [2] of world_size 6" in line


def test_a_mistyped_world_size_is_refused_at_once(ckpt):
  root, _ = ckpt
  for m in (100_000_000, 2**20 + 1):
    line = _one_line_error(_run("reshard", root / "ckpt8", root / "never", "-m", m, "--dry-run"))
    assert f"world_size {m} is more than the 1048576 ranks" in line
  # The largest allowed world size plans lazily: one rank is one line, at once.
  result = _run("reshard", root / "ckpt8", root / "never", "-m", 2**20, "-r", 2**20 - 1,
                "--dry-run")
  assert result.exit_code == 0 and result.stdout.splitlines()[1].split()[:4] == [
      str(2**20 - 1), "0", "of", "8"]


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
