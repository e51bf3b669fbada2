"""The package's layers: every import inside ``jaxreshard._src`` points down.

Bottom-up: ``errors``, ``progress``; ``core`` (the layout and its rules);
``exec`` (executors of a copy plan); ``engine`` (sources, the pipeline, the
pure public functions); ``checkpoint`` (the on-disk format); ``distributed``
(meshes, ``flat_sharded``, sharded restores); ``orbax`` (the handler and the
sharded save); ``cli``. A module may import its own layer and those below it,
lazily or not; only the CLI, a client of the library, imports the public
package (``import jaxreshard as jr``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

LAYERS = [
  "errors",
  "progress",
  "core",
  "exec",
  "engine",
  "checkpoint",
  "distributed",
  "orbax",
  "cli",
]
SRC = pathlib.Path(__file__).resolve().parents[1] / "jaxreshard" / "_src"


def _layer(module: str) -> str:
  """``jaxreshard._src.core.geometry`` -> ``core``."""
  return module.split(".")[2]


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """Every ``jaxreshard._src`` module a file imports (at any depth), with its line."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.startswith("jaxreshard._src."):
        out.append((node.lineno, node.module))
      elif node.module == "jaxreshard":
        out.extend((node.lineno, "jaxreshard.<public>") for _ in node.names)
    elif isinstance(node, ast.Import):
      out.extend(
        (node.lineno, a.name)
        for a in node.names
        if a.name == "jaxreshard" or a.name.startswith("jaxreshard.")
      )
  return out


def _files():
  return sorted(SRC.rglob("*.py"))


def test_every_layer_exists():
  assert {p.relative_to(SRC).parts[0].removesuffix(".py") for p in _files()} - {"__init__"} == set(
    LAYERS
  )


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path):
  rel = path.relative_to(SRC).parts
  if rel == ("__init__.py",):
    return
  own = LAYERS.index(rel[0].removesuffix(".py"))
  for line, module in _imports(path):
    if rel[0] == "cli" and not module.startswith("jaxreshard._src."):
      continue
    assert module.startswith("jaxreshard._src."), (
      f"{path}:{line} imports {module}: inside _src, import the module itself, not the"
      " public package"
    )
    theirs = LAYERS.index(_layer(module))
    assert theirs <= own, f"{path}:{line} imports {module}, a layer above its own ({rel[0]})"
