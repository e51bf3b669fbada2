"""The formatter and linter settings of pyproject.toml hold for every file CI checks.

CI runs these two checks after the suite; running them here too means the README's test
command fails on the same trees CI does.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["format", "--check"], ["check"]])
def test_ruff_passes_on_the_repository(args):
  done = subprocess.run(
    [sys.executable, "-m", "ruff", *args, "."], cwd=ROOT, capture_output=True, text=True
  )
  assert done.returncode == 0, done.stdout + done.stderr
