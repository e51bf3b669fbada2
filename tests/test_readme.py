"""The README's Python examples run, in order, in one namespace.

Blocks preceded by ``<!-- not run: ... -->`` (a multi-host job) are skipped; the
Quick start block must hold exactly two commands, and .ci/run must run the
second one.
"""

import contextlib
import io
import os
import pathlib
import re

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


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


def test_quick_start_holds_two_commands_and_ci_runs_the_second():
  section = README.split("## Quick start", 1)[1]
  block = section.split("```", 2)[1]
  commands = [line for line in block.splitlines() if line.strip()]
  assert len(commands) == 2
  assert "jaxreshard demo" in commands[0]
  assert "pytest" in commands[1]
  assert commands[1] in (ROOT / ".ci" / "run").read_text()
