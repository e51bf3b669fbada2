"""The orbax integration, as one namespace (the way ``orbax.checkpoint.args`` groups args).

``ReshardSave`` and ``ReshardRestore`` are ``CheckpointArgs`` registered with
``ReshardCheckpointHandler``, so an ``ocp.CheckpointManager`` picks the handler
from the arguments alone. The same names are also at the top level of
``jaxreshard``.

Examples:
  >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp
  >>> import jaxreshard as jr
  >>> from jaxreshard import orbax as jro
  >>> params = {"w": jnp.arange(8.0)}
  >>> opt = optax.adam(1e-3)
  >>> records = jr.shard_state(opt, params, opt.init(params), world_size=4)
  >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
  ...   _ = manager.save(1, args=jro.ReshardSave(records))
  ...   manager.wait_until_finished()
  ...   target = manager.restore(1, args=jro.ReshardRestore(world_size=3, rank=2))
  >>> target.placements[0].rank, jro.ReshardRestore is jr.ReshardRestore
  (2, True)
"""

from jaxreshard._src.orbax.durable import DurableRenameTemporaryPath
from jaxreshard._src.orbax.handler import ReshardCheckpointHandler, ReshardRestore, ReshardSave

__all__ = [
  "DurableRenameTemporaryPath",
  "ReshardCheckpointHandler",
  "ReshardRestore",
  "ReshardSave",
]
