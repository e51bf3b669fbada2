"""User-facing errors.

Every refusal is a :class:`ReshardError` (a :class:`ValueError`), so callers can
catch one class. The subclasses say what kind of disagreement was found.
"""

from __future__ import annotations

__all__ = ["ReshardError", "PlacementError", "ShapeError", "DtypeError", "ArchiveError",
           "ArchiveExistsError"]


class ReshardError(ValueError):
  """Base class of every refusal raised by jaxreshard."""


class PlacementError(ReshardError):
  """Ownership, grouping, metadata or optimizer-clock disagreement."""


class ShapeError(ReshardError):
  """A history buffer whose shape or precision cannot be resharded."""


class DtypeError(PlacementError, ShapeError):
  """A storage dtype that is unsupported or differs across sources.

  A storage dtype is both placement metadata and a question of precision, so
  this error is a :class:`PlacementError` and a :class:`ShapeError` at once.
  """


class ArchiveError(ReshardError):
  """A checkpoint directory or file that is not a valid jaxreshard checkpoint."""


class ArchiveExistsError(ArchiveError):
  """The output directory of a save already exists (nothing is overwritten)."""
