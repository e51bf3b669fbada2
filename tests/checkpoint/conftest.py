"""Fixtures of the checkpoint tests."""

from __future__ import annotations

import types

import pytest

from jaxreshard._src.checkpoint import writer as _writer


@pytest.fixture
def fixed_id(monkeypatch):
  """Every save of the test gets one identity (a checkpoint's files name it)."""
  monkeypatch.setattr(
    _writer, "uuid", types.SimpleNamespace(uuid4=lambda: types.SimpleNamespace(hex="0" * 32))
  )
