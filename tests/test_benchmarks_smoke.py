"""Smoke test of the benchmark suite: ``python -m benchmarks --quick --json`` completes.

Benchmarks are not timed tests: this checks only that every benchmark runs
end to end and emits well-formed rows, never how fast anything is.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Every test here is slow: `pytest -m "not slow"` skips them, plain `pytest` runs them.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "RESULTS.md"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # the suite sets simulated devices itself where needed
  env.pop("PYTHONPATH", None)  # as documented: run from the repository root, nothing else
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks", "--quick", "--json", "--out", str(out)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout), out


def test_every_benchmark_emits_rows(quick_run):
  from benchmarks import BENCHMARKS

  doc, _ = quick_run
  assert doc["quick"] is True
  assert [r["name"] for r in doc["results"]] == list(BENCHMARKS)
  for result in doc["results"]:
    assert not result.get("error"), result.get("error")
    assert result["rows"], result["name"]
    assert result["met"] is None  # a quick run gives no verdicts
    keys = set(result["rows"][0])
    assert all(keys <= set(row) for row in result["rows"]), result["name"]


def test_machine_command_report_and_plot(quick_run):
  doc, out = quick_run
  assert doc["machine"]["cpus"] >= 1 and doc["command"].startswith("python -m benchmarks --quick")
  text = out.read_text()
  assert "## Machine" in text and "## memory" in text and "## scale" in text
  (cli,) = [r for r in doc["results"] if r["name"] == "cli"]
  assert {"cli_over_copy_8_6", "copy_ns_per_byte_8", "copy_scale_vs_first"} <= set(cli["rows"][0])
  assert (out.parent / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_leaves_out_a_time_rounded_to_zero(tmp_path):
  # A quick run's copy of a few KiB can take under the rows' rounding: the plot
  # divided by zero and the whole run failed.
  from benchmarks._report import plot_throughput

  row = {"mib": 0.06, "reshard_s": 0.0001, "reshard_ranks_s": 0.0001}
  rows = [
    {**row, "memcpy_s": 0.0, "fresh_copy_s": 0.00002},
    {**row, "mib": 0.25, "memcpy_s": 1e-5, "fresh_copy_s": 0.0},
  ]
  path = plot_throughput(rows, str(tmp_path / "p.png"), "t")
  assert os.path.getsize(path) > 0


def test_workload_matches_shard_state():
  """The benchmark's direct archive builder agrees with jr.shard_state."""
  import jax
  import jax.numpy as jnp
  import optax

  import jaxreshard as jr
  from benchmarks import _workload

  n = 5
  sizes = _workload.param_sizes(1000, n)
  params = _workload.nest(
    {pid: jnp.zeros((s,), jnp.float32) for pid, s in zip(_workload.param_ids(n), sizes)}
  )
  opt = optax.adam(1e-3)
  ref = jr.shard_state(opt, params, opt.init(params), 8)
  got = _workload.adam_records(2000, n, 8)
  for a, b in zip(got, ref):
    assert a.placements == b.placements and a.roles == b.roles
    assert jax.tree.structure(a.state) == jax.tree.structure(b.state)
    assert [x.shape for x in jax.tree.leaves(a.state)] == [
      x.shape for x in jax.tree.leaves(b.state)
    ]


def test_device_mode_runs_on_xla_cpu(tmp_path):
  """``python -m benchmarks --device --quick`` completes on the CPU backend, no accelerator."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  env.pop("PYTHONPATH", None)
  proc = subprocess.run(
    [sys.executable, "-m", "benchmarks", "--device", "--quick", "--json"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  doc = json.loads(proc.stdout)
  (result,) = doc["results"]
  assert result["name"] == "device" and not result.get("error"), result.get("error")
  executor, restore = result["rows"]
  assert executor["programs"] <= 8, executor
  assert restore["bit_exact_vs_orbax"] is True, restore
  assert result["met"] is None


def test_durable_copy_copies_every_file_and_refuses_an_existing_target(tmp_path):
  from benchmarks import _disk

  src = tmp_path / "src"
  (src / "a" / "b").mkdir(parents=True)
  (src / "top").write_bytes(b"\x00\x01")
  (src / "a" / "b" / "leaf").write_bytes(bytes(range(256)) * 3)
  (src / "a" / "empty").write_bytes(b"")
  (src / "c").mkdir()
  _disk.durable_copy(str(src), str(tmp_path / "dst"))
  listing = lambda root: sorted(  # noqa: E731
    (str(p.relative_to(root)), p.read_bytes() if p.is_file() else None) for p in root.rglob("*")
  )
  assert listing(tmp_path / "dst") == listing(src)
  with pytest.raises(FileExistsError):
    _disk.durable_copy(str(src), str(tmp_path / "dst"))
