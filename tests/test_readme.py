"""The README's Python examples run, in order, in one namespace; its CLI output is real.

Blocks preceded by ``<!-- not run: ... -->`` (a multi-host job) are skipped; the
Quick start block must hold exactly two commands, and .ci/run must run the
second one.
"""

import contextlib
import io
import json
import os
import pathlib
import re

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


# Every test here is slow: `pytest -m "not slow"` skips them, plain `pytest` runs them.
pytestmark = pytest.mark.slow


def _python_blocks():
  blocks = []
  for m in re.finditer(r"(<!--[^>]*-->\s*)?```python\n(.*?)```", README, re.S):
    if m.group(1) and "not run" in m.group(1):
      continue
    blocks.append(m.group(2))
  return blocks


def test_readme_python_examples_run(tmp_path):
  blocks = _python_blocks()
  assert len(blocks) >= 2
  namespace: dict = {}
  out = io.StringIO()
  cwd = os.getcwd()
  os.chdir(tmp_path)
  try:
    # optax's own update math needs standard promotion; jaxreshard runs under strict.
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(out):
      for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  finally:
    os.chdir(cwd)
  # The refusal example prints the message the README shows.
  assert "param 'dense/bias': source archive index 7 is out of range (0..6)" in out.getvalue()
  # The restore checked against another optimizer prints the refusal the README shows.
  assert (
    "optimizer.init(params)'s tree does not match the checkpoint's state: it lacks the"
    " checkpoint's leaf [0].count" in out.getvalue()
  )


def test_the_weak_clock_refusal_is_quoted_as_it_is_raised():
  """The README quotes the refusal of a learning rate weak in one archive and strong in
  another: the quote is the message's own text."""
  import dataclasses

  import jax.numpy as jnp
  import optax

  import jaxreshard as jr

  quoted = re.search(r"is two clocks \(`(archive 1 has clock scalar.*?)`\)", README, re.S)
  assert quoted, "the README's quote of the weak clock refusal"
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  params = {"w": jnp.ones((5,))}
  records = jr.shard_state(opt, params, opt.init(params), world_size=2)
  state = records[1].state
  weak = dict(state.hyperparams, learning_rate=jnp.asarray(0.1))
  records[1] = dataclasses.replace(records[1], state=state._replace(hyperparams=weak))
  with pytest.raises(jr.PlacementError) as e:
    jr.reshard(records, jr.plan(records, world_size=3, rank=0))
  assert " ".join(quoted.group(1).split()) in str(e.value)


def test_quick_start_holds_two_commands_and_ci_runs_the_second():
  section = README.split("## Quick start", 1)[1]
  block = section.split("```", 2)[1]
  commands = [line for line in block.splitlines() if line.strip()]
  assert len(commands) == 2
  assert "jaxreshard demo" in commands[0]
  assert "pytest" in commands[1]
  assert commands[1] in (ROOT / ".ci" / "run").read_text()


# The README's CLI transcript: commands after "$ ", each followed by its output.
# Normalized on both sides: a figure in seconds ("1.2 s") reads "… s", the
# directory the commands ran in reads "…", and the digest reads "digest …"
# (the demo's trained bits, and so its digest, depend on the CPU's float
# arithmetic; the digest is checked against the demo's own below).
_SECONDS = re.compile(r"\b\d+(\.\d+)? s\b")
_DIGEST = re.compile(r"digest [0-9a-f]{16}")


def _normalized(text, cwd):
  text = _DIGEST.sub("digest …", text)
  lines = _SECONDS.sub("… s", text.replace(str(cwd), "…")).splitlines()
  return "\n".join(line.rstrip() for line in lines).strip("\n")


def _transcript():
  section = README.split("## Command line", 1)[1].split("\n## ", 1)[0]
  block = section.split("```console\n", 1)[1].split("```", 1)[0]
  steps = []
  for line in block.splitlines():
    if line.startswith("$ "):
      steps.append((line[2:].split(), []))
    else:
      steps[-1][1].append(line)
  return [(argv, "\n".join(out)) for argv, out in steps]


def test_readme_cli_output_is_what_the_commands_print(tmp_path, monkeypatch):
  from typer.testing import CliRunner

  from jaxreshard._src.cli.commands import app

  steps = _transcript()
  assert [argv[:2] for argv in (a for a, _ in steps)] == [
    ["jaxreshard", "demo"],
    ["jaxreshard", "inspect"],
    ["jaxreshard", "reshard"],
    ["jaxreshard", "reshard"],
    ["jaxreshard", "verify"],
  ]
  assert "--dry-run" in steps[2][0]
  monkeypatch.chdir(tmp_path)
  for argv, shown in steps:
    result = CliRunner().invoke(app, argv[1:])
    assert result.exit_code == 0, (argv, result.output)
    assert _normalized(result.stdout, tmp_path) == _normalized(shown, tmp_path), argv
  # The digest shown is the demo checkpoint's wherever float arithmetic is the
  # one the README was made with (_arithmetic, below).
  data = json.loads(CliRunner().invoke(app, ["verify", "ckpt8", "ckpt6", "--json"]).stdout)
  if _same_arithmetic():
    assert f"digest {data['digest'][:16]}" in steps[-1][1]


# This machine's float arithmetic, as the demo's kind of training sees it (an
# MLP's gradients of the demo's shapes, adam-style arithmetic on them),
# recorded where the README's transcript was made. Independent of the demo's
# code, so a change of the demo still shows as a changed digest.
_ARITHMETIC = "178df63316e3238e"


def _arithmetic() -> str:
  import hashlib

  import jax.numpy as jnp

  k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(k1, (64, 13), jnp.float32)
  w1 = jax.random.normal(k2, (13, 37), jnp.float32)
  w2 = jax.random.normal(k3, (37, 5), jnp.float32)
  loss = lambda a, b: jnp.mean((jax.nn.gelu(x @ a) @ b) ** 2)
  g1, g2 = jax.jit(jax.grad(loss, argnums=(0, 1)))(w1, w2)
  m = jax.jit(lambda g: (0.1 * g) / (1.0 - 0.9**3) / (jnp.sqrt(g * g) + 1e-8))(g1)
  h = hashlib.sha256()
  for a in (g1, g2, m):
    h.update(np.asarray(a).view(np.uint32).tobytes())
  return h.hexdigest()[:16]


def _same_arithmetic() -> bool:
  return _arithmetic() == _ARITHMETIC
