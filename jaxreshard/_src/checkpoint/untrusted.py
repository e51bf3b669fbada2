"""Untrusted values quoted in messages: a field read from an archive never makes a
long message, whatever its size."""

from __future__ import annotations

from typing import Any

__all__ = ["short"]


def short(value: Any, limit: int = 80) -> str:
  """``repr(value)``, cut to ``limit`` characters."""
  text = repr(value)
  return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
