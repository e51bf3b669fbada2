"""A run resumes on another number of devices and continues bit for bit.

``examples/restart.py`` trains a flax MLP with ``flat_sharded(optax.adamw)``,
saving params and optimizer state with an orbax ``CheckpointManager``. A run
stopped after step 3 and resumed on another mesh must see exactly the losses
and end with exactly the params of the run that never stopped (AdamW is an
elementwise chain: each slot's update does not depend on where it lives).

The quick tests use this process's 8 simulated devices; the multi-process test
runs the example itself as real ``jax.distributed`` jobs: 2 processes x 4
devices, killed after step 3, resumed on 3 x 2 and on 1 x 5.

Not compared bitwise: a resume on one device, where the flat arrays are
unsharded and XLA compiles the jitted step as a different program, whose
fusion (multiply-adds contracted into FMAs) can move a last bit.
"""

import importlib.util
import json
import os
import shutil

import jax
import pytest

from tests import _mp_util as U

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "restart.py")
STEPS, KILL = 5, 3


# Every test here is slow: `pytest -m "not slow"` skips them, plain `pytest` runs them.
pytestmark = pytest.mark.slow


def _example():
  spec = importlib.util.spec_from_file_location("restart_example", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _mesh(n):
  return jax.make_mesh((n,), ("fsdp",), devices=jax.devices()[:n])


@pytest.fixture(scope="module")
def example():
  return _example()


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
  # The suite runs jaxreshard under strict promotion; flax and optax math
  # (the training step) is written for the standard rules.
  with jax.numpy_dtype_promotion("standard"):
    yield


@pytest.fixture(scope="module")
def uninterrupted(example, tmp_path_factory):
  """The reference: 8 devices, never stopped."""
  seen = example.run(_mesh(8), str(tmp_path_factory.mktemp("ref") / "run"), STEPS)
  return example.loss_bits(seen["losses"]), seen["params"]


@pytest.mark.parametrize("resume_on", [8, 5, 3, 2])
def test_a_run_resumed_on_another_mesh_continues_bit_for_bit(
  example, uninterrupted, tmp_path, resume_on
):
  ref_losses, ref_params = uninterrupted
  ckpt = str(tmp_path / "run")
  first = example.run(_mesh(8), ckpt, STEPS, kill_after=KILL)
  assert first["killed"] and sorted(first["losses"]) == [0, 1, 2]
  second = example.run(_mesh(resume_on), ckpt, STEPS)
  assert second["start"] == KILL
  losses = {**example.loss_bits(first["losses"]), **example.loss_bits(second["losses"])}
  assert losses == ref_losses
  assert second["params"] == ref_params


def test_resumed_state_is_what_was_saved(example, tmp_path):
  # The optimizer state restored onto 5 devices is the saved one, resharded:
  # its history leaves are global (5 * slots,) arrays sharded over fsdp.
  import orbax.checkpoint as ocp

  import jaxreshard as jr

  ckpt = str(tmp_path / "run")
  example.run(_mesh(8), ckpt, STEPS, kill_after=KILL)
  mesh5 = _mesh(5)
  with ocp.CheckpointManager(ckpt, item_names=("params", "opt_state")) as manager:
    state = manager.restore(
      KILL, args=ocp.args.Composite(opt_state=jr.ReshardRestore(mesh=mesh5, axis="fsdp"))
    ).opt_state
  mu = state[0].mu["Dense_0"]["kernel"]
  assert mu.shape == (5 * jr.FlatShard((example.FEATURES, example.HIDDEN), 0, 5).slots,)
  assert mu.sharding.spec == jax.sharding.PartitionSpec("fsdp")
  assert int(state[0].count) == KILL


def test_a_run_directory_holding_the_last_step_says_so(example, tmp_path, capsys):
  ckpt = str(tmp_path / "run")
  example.main(["--ckpt", ckpt, "--steps", "2", "--devices", "4"])
  out = capsys.readouterr().out
  assert [line.split(":")[0] for line in out.splitlines()] == ["step 1", "step 2"]
  example.main(["--ckpt", ckpt, "--steps", "2", "--devices", "4"])
  assert capsys.readouterr().out == (
    f"{ckpt} already holds step 2 (--steps 2): nothing to train; pass a larger --steps"
    " to continue\n"
  )


def _printed(job, text):
  """How many lines of the job's processes' output start with ``text``."""
  count = 0
  for log in job.logs:
    with open(log, errors="replace") as f:
      count += sum(line.startswith(text) for line in f)
  return count


def _script_job(n, devices, ckpt, out, extra=()):
  def argv(i, coordinator):
    cmd = [SCRIPT, "--ckpt", ckpt, "--steps", str(STEPS), *extra]
    if n > 1:
      cmd += [
        "--coordinator",
        coordinator,
        "--num-processes",
        str(n),
        "--process-id",
        str(i),
        "--out",
        os.path.join(out, "result.json"),
      ]
    else:
      cmd += ["--out", os.path.join(out, "result.json")]
    return cmd

  return U.ProcessGroup(n, devices, "restart", out, {}, timeout=240, argv=argv)


def test_multi_process_restart_2x4_then_3x2_and_1x5(uninterrupted, tmp_path):
  ref_losses, ref_params = uninterrupted
  ckpt = str(tmp_path / "run")
  with _script_job(2, 4, ckpt, str(tmp_path / "first"), ["--kill-after", str(KILL)]) as job:
    codes = job.wait()
  assert codes == [-9, -9], job.tail()  # killed, not shut down
  # Only process 0 prints: each step once, not once per process.
  assert [_printed(job, f"step {k}: loss") for k in (1, 2, 3)] == [1, 1, 1], job.tail()
  assert _printed(job, f"killed after step {KILL}") == 1, job.tail()
  with open(tmp_path / "first" / "result.json") as f:
    first = json.load(f)
  assert first["processes"] == 2 and first["devices"] == 8
  shutil.copytree(ckpt, tmp_path / "run_1x5")
  for n, devices, where in ((3, 2, ckpt), (1, 5, str(tmp_path / "run_1x5"))):
    out = str(tmp_path / f"resume_{n}x{devices}")
    with _script_job(n, devices, where, out) as job:
      codes = job.wait()
    assert codes == [0] * n, job.tail()
    assert [_printed(job, f"step {k}: loss") for k in range(1, STEPS + 1)] == [0, 0, 0, 1, 1]
    with open(os.path.join(out, "result.json")) as f:
      second = json.load(f)
    assert (second["processes"], second["devices"], second["start"]) == (n, n * devices, KILL)
    assert {**first["losses"], **second["losses"]} == ref_losses, (n, devices)
    assert second["params"] == ref_params, (n, devices)
