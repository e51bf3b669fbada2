"""An opened checkpoint in one short line: what ``repr`` of a ``Checkpoint`` shows.

Only the index is used (nothing is read from the archives): the directory, the
number of archives, the source world sizes, the parameters, and the step when
the archives share one clock whose step counter is an integer scalar
(``count``, ``step`` or ``gradient_step``, as optax names them).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["checkpoint_repr"]

# How many param ids the line names before it counts the rest.
_PARAMS_SHOWN = 3
# The last key of a clock scalar that counts steps.
_STEP_KEYS = ("count", "step", "gradient_step")


def checkpoint_repr(ckpt: Any) -> str:
  """``Checkpoint('DIR', archives=N, world_sizes=[...], params=[...], step=S)``.

  Examples:
    >>> import os, tempfile, jax.numpy as jnp, optax, jaxreshard as jr
    >>> params = {"w": jnp.arange(10.0), "b": jnp.zeros(3)}
    >>> opt = optax.adam(1e-3)
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> jr.save_records(path, jr.shard_state(opt, params, opt.init(params), world_size=4))
    >>> repr(jr.open_checkpoint(path)).replace(path, "PATH")
    "Checkpoint('PATH', archives=4, world_sizes=[4], params=['b', 'w'], step=0)"
  """
  ids = sorted({ckpt.params[p].param for g in ckpt.groups for p in g.params})
  shown = [repr(p) for p in ids[:_PARAMS_SHOWN]]
  if len(ids) > _PARAMS_SHOWN:
    shown.append(f"... {len(ids) - _PARAMS_SHOWN} more")
  world_sizes = sorted({g.world_size for g in ckpt.groups if g.ranks})
  step = _step(ckpt)
  return (
    f"Checkpoint({str(ckpt.directory)!r}, archives={len(ckpt)}, world_sizes={world_sizes},"
    f" params=[{', '.join(shown)}]" + ("" if step is None else f", step={step}") + ")"
  )


def _step(ckpt: Any) -> int | None:
  """The step counter of the checkpoint's one clock, or None (several clocks, none found)."""
  if not len(ckpt) or len(set(ckpt.archive_clock)) != 1:
    return None
  record = ckpt.metadata_record(0)
  leaves = jax.tree_util.tree_flatten_with_path(record.state)[0]
  for (path, value), role in zip(leaves, record.roles):
    key = path[-1] if path else None
    name = getattr(key, "name", getattr(key, "key", None))
    if role is None and name in _STEP_KEYS and np.ndim(value) == 0:
      if np.issubdtype(np.asarray(value).dtype, np.integer):
        return int(value)
  return None
