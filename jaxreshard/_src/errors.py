"""User-facing errors.

Every refusal is a :class:`ReshardError` (a :class:`ValueError`), so callers can
catch one class. The subclasses say what kind of disagreement was found.

Which class a public call raises:

* bad arguments or inputs that are not what the call takes (a path that is not
  a path, a ``progress`` that is not callable, a non-positive ``chunk_bytes``):
  ``ReshardError`` itself;
* placements, grouping, mesh axes, clocks, orbax arguments: ``PlacementError``;
  buffer shapes and precision: ``ShapeError``; storage dtypes: ``DtypeError``;
* checkpoint directories and files: ``ArchiveError``, and
  ``ArchiveExistsError`` for a save that would overwrite. A multi-process save
  that was not committed (a process failed or timed out) is an
  ``ArchiveError`` too: its effect is that no checkpoint exists. There is no
  separate class for ``jax.distributed``: jaxreshard never initializes it and
  only sees processes through ``jax.process_index()``, so nothing it refuses
  is about the distributed runtime itself;
* the file system's own failures stay ``OSError`` (``FileNotFoundError``, a full
  disk), and calling with the wrong arguments stays Python's ``TypeError``.

Built-in ``ValueError``s remain only inside private code, never escaping a
public call: argument checks of the private device kernels (``_device_exec``,
reached only with validated runs) and parser errors converted on the spot
(``_archive_format``, ``_target_restore``).
"""

from __future__ import annotations

__all__ = [
  "ReshardError",
  "PlacementError",
  "ShapeError",
  "DtypeError",
  "ArchiveError",
  "ArchiveExistsError",
]


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
