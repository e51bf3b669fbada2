"""A save is durable before it is visible, observed in its system calls.

The save runs in a process of its own under ``strace``, which reports every
write, fsync and rename with the path of the descriptor (``-y``): every file
and directory of the committed checkpoint must be fsync'ed after its last write
and before the rename, and the parent directory after it. Skipped where
``strace`` is absent or may not trace.
"""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CALL = re.compile(r"^\d+\s+(?P<call>[a-z0-9_]+)\((?P<args>.*)$")
_FD = re.compile(r"^\d+<(?P<path>[^>]*)>")


def _strace_works() -> bool:
  if shutil.which("strace") is None:
    return False
  return (
    subprocess.run(
      ["strace", "-f", "-qq", "-e", "trace=none", "true"], capture_output=True
    ).returncode
    == 0
  )


pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(not _strace_works(), reason="strace is absent or may not trace"),
]


def _traced_save(tmp_path, durable: bool) -> tuple[str, list[tuple[str, str, str]]]:
  """Saves a 3-rank, 2-dtype checkpoint under strace; returns it and the calls made
  (call, descriptor path or the rename's target, raw arguments). A durable save is
  the default one."""
  out = str(tmp_path / "ckpt")
  log = str(tmp_path / "strace.log")
  code = textwrap.dedent(f"""
      import jax.numpy as jnp
      import jaxreshard as jr
      from tests._core_util import adam_records
      records = adam_records(3, {{"w": ((40, 3), jnp.float32), "b": ((17,), jnp.bfloat16)}})
      jr.save_records({out!r}, records{"" if durable else ", durable=False"})
      assert len(jr.load_records({out!r})) == 3
      """)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [
      "strace",
      "-f",
      "-y",
      "-qq",
      "-o",
      log,
      "-e",
      "trace=write,writev,pwrite64,pwritev,fsync,fdatasync,rename,renameat,renameat2",
      sys.executable,
      "-c",
      code,
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  calls = []
  with open(log) as f:
    for line in f:
      m = _CALL.match(line)
      if not m or "resumed>" in line:
        continue
      call, args = m["call"], m["args"]
      if call.startswith("rename"):
        calls.append((call, "", args))
      else:
        fd = _FD.match(args)
        if fd:
          calls.append((call, fd["path"], args))
  return out, calls


def _tree(root: str) -> list[str]:
  """Every directory and file below ``root``, ``root`` included."""
  out = [root]
  for d, dirs, files in os.walk(root):
    out += [os.path.join(d, n) for n in dirs + files]
  return out


def test_every_file_and_directory_is_fsynced_before_the_rename_and_the_parent_after(tmp_path):
  out, calls = _traced_save(tmp_path, durable=True)
  (rename_at,) = [
    i for i, (call, _, args) in enumerate(calls) if call.startswith("rename") and f'"{out}"' in args
  ]
  tmp = re.search(r'"([^"]*\.ckpt\.tmp-[^"]*)"', calls[rename_at][2])[1]
  before, after = calls[:rename_at], calls[rename_at + 1 :]
  synced = {path: i for i, (call, path, _) in enumerate(before) if call in ("fsync", "fdatasync")}
  last_write = {
    path: i for i, (call, path, _) in enumerate(before) if call.startswith(("write", "pwrite"))
  }
  entries = _tree(out)
  assert len(entries) > 10
  for entry in entries:
    at_tmp = tmp + entry[len(out) :]
    assert at_tmp in synced, f"{entry} was not fsync'ed before the rename"
    if os.path.isfile(entry):
      assert at_tmp in last_write, f"{entry}: no write seen"
      assert last_write[at_tmp] < synced[at_tmp], f"{entry} was written after its fsync"
  parent = os.path.dirname(out)
  assert any(call in ("fsync", "fdatasync") and path == parent for call, path, _ in after), (
    "the parent directory was not fsync'ed after the rename"
  )


def test_durable_false_makes_no_fsync(tmp_path):
  out, calls = _traced_save(tmp_path, durable=False)
  assert os.path.isdir(out)
  assert not [c for c in calls if c[0] in ("fsync", "fdatasync") and c[1].startswith(str(tmp_path))]
