"""``jaxreshard demo``: a flax model's AdamW state, 8 -> 6 ranks, proven exact."""

import json

import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.cli.commands import app
from jaxreshard._src.cli.demo import run_demo

# Every test here is slow: `pytest -m "not slow"` skips them, plain `pytest` runs them.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def summary():
  return run_demo()


def test_run_demo_is_exact(summary):
  assert summary.exact
  assert summary.unshard_exact and summary.round_trip_exact and summary.digest_equal
  assert summary.disk_exact is True  # rank 2 of 6 restored from disk
  rows = {r.param: r for r in summary.rows}
  assert sorted(rows) == ["hidden/bias", "hidden/kernel", "out/bias", "out/kernel"]
  k = rows["hidden/kernel"]
  assert (k.shape, k.slots_source, k.slots_target, k.buffers, k.bytes) == (
    (13, 37),
    61,
    81,
    2,
    3848,
  )
  # 5 elements over 8 ranks: ranks 5..7 hold only padding.
  assert (rows["out/bias"].slots_source, rows["out/bias"].slots_target) == (1, 1)
  assert all(r.exact and r.buffers == 2 for r in summary.rows)


def test_demo_command(summary, tmp_path):
  result = CliRunner().invoke(app, ["demo", "--steps", "2", "--save", str(tmp_path / "ckpt8")])
  assert result.exit_code == 0, result.output
  out = result.stdout
  assert "trained a flax MLP for 2 AdamW steps" in out
  for text in ("param", "slots @8", "slots @6", "exact", "hidden/kernel", "(13, 37)"):
    assert text in out, text
  assert out.count("│   yes │") == 4
  assert "rank 2 of 6 restored from disk is identical" in out
  assert out.strip().splitlines()[-1].startswith("EXACT: 8 -> 6 ranks, every bit preserved")
  # --save keeps the 8-rank checkpoint for the other commands, and never overwrites.
  assert [r.placements[0].rank for r in jr.load_records(tmp_path / "ckpt8")] == list(range(8))
  again = CliRunner().invoke(app, ["demo", "--save", str(tmp_path / "ckpt8")])
  assert again.exit_code == 2 and "already exists" in again.stderr
  assert "trained" not in again.stdout, again.stdout  # refused before the training
  # A missing parent is refused before the training, not after it.
  lost = CliRunner().invoke(app, ["demo", "--save", str(tmp_path / "nodir" / "x")])
  assert lost.exit_code == 2 and "does not exist" in lost.stderr
  assert "trained" not in lost.stdout, lost.stdout


def test_demo_json_is_the_summary_only(tmp_path, monkeypatch):
  result = CliRunner().invoke(
    app, ["demo", "--steps", "1", "--json", "--save", str(tmp_path / "c")]
  )
  assert result.exit_code == 0, result.output
  data = json.loads(result.stdout)  # nothing but the JSON on stdout
  assert data["exact"] and data["steps"] == 1 and all(data["checks"].values())
  assert (data["source_world_size"], data["target_world_size"]) == (8, 6)
  assert data["saved"] == str(tmp_path / "c")
  kernel = next(p for p in data["params"] if p["param"] == "hidden/kernel")
  assert kernel == dict(
    param="hidden/kernel",
    shape=[13, 37],
    slots_source=61,
    slots_target=81,
    buffers=2,
    bytes=3848,
    exact=True,
  )


def test_demo_table_folds_on_a_narrow_terminal(monkeypatch):
  from rich.console import Console

  from jaxreshard._src.cli import render as _render

  monkeypatch.setattr(
    _render,
    "console",
    lambda: Console(force_terminal=True, width=40, highlight=False, no_color=True),
  )
  result = CliRunner().invoke(app, ["demo", "--steps", "1"])
  assert result.exit_code == 0, result.output
  assert "…" not in result.stdout, result.stdout
  rows = [l.split("│") for l in result.stdout.splitlines() if l.startswith("│")]
  assert "hidden/kernel" in "".join(r[1].strip() for r in rows)


def test_a_demo_that_is_not_exact_says_so_and_exits_1(summary, monkeypatch):
  """The command's verdict follows the summary's checks (here one of them made false)."""
  import dataclasses

  from jaxreshard._src.cli import demo
  from jaxreshard._src.cli.commands import EXIT_DIFFERENT

  failed = dataclasses.replace(summary, round_trip_exact=False)
  assert not failed.exact
  monkeypatch.setattr(demo, "run_demo", lambda *a, **k: failed)
  result = CliRunner().invoke(app, ["demo"])
  assert result.exit_code == EXIT_DIFFERENT == 1, result.output
  assert "NOT EXACT" in result.stdout.strip().splitlines()[-1]
  assert "every bit preserved" not in result.stdout


def test_a_demo_without_its_extra_dependencies_names_them(monkeypatch):
  from jaxreshard._src.cli import demo

  def missing(*a, **k):
    raise ModuleNotFoundError("No module named 'flax'", name="flax")

  monkeypatch.setattr(demo, "run_demo", missing)
  result = CliRunner().invoke(app, ["demo"])
  assert result.exit_code == 2
  assert result.stderr.strip().splitlines() == [
    "jaxreshard: error: the demo needs flax: pip install 'jaxreshard[examples]'"
  ]
