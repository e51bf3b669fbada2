"""jaxreshard: exact resharding of optax flat-shard optimizer state.

Rebuilds ZeRO / FSDP flat shards of optax state for a new number of ranks,
bit for bit, with numpy copies where the bytes are in host memory and jitted gather
kernels where they are on a device, and refuses archives that do not belong
together.

The orbax integration is also grouped as ``jaxreshard.orbax`` (``ReshardSave``,
``ReshardRestore``, ``ReshardCheckpointHandler``). That module is not in
``__all__``: ``from jaxreshard import *`` must not shadow the ``orbax`` package.

Long calls (saves, loads, restores) take ``progress=`` (a callable receiving a
:class:`Progress`) and log to ``logging.getLogger("jaxreshard")``: DEBUG per
archive or rank, INFO per call; the library installs no handler.
"""

from jaxreshard import orbax as orbax  # the submodule, as a public name
from jaxreshard._src.checkpoint.digest import Digest, digest
from jaxreshard._src.checkpoint.digestdiff import compare_digests
from jaxreshard._src.checkpoint.reader import FORMAT_VERSION as CHECKPOINT_FORMAT_VERSION
from jaxreshard._src.checkpoint.restore import restore, restore_ranks
from jaxreshard._src.checkpoint.store import load_records, open_checkpoint, save_records
from jaxreshard._src.core.geometry import FlatShard
from jaxreshard._src.core.placement import Migration, ParamPlacement
from jaxreshard._src.core.record import RECORD_VERSION, ShardRecord
from jaxreshard._src.distributed.flat_sharded import flat_sharded
from jaxreshard._src.distributed.mesh import MeshState, gather_from_mesh, shard_to_mesh
from jaxreshard._src.distributed.sharded import reshard_to_mesh, restore_sharded
from jaxreshard._src.engine.reshard import plan, reshard, reshard_ranks, shard_state, unshard_state
from jaxreshard._src.errors import (
  ArchiveError,
  ArchiveExistsError,
  DtypeError,
  PlacementError,
  ReshardError,
  ShapeError,
)
from jaxreshard._src.exec.device import clear_kernel_cache, kernel_cache_info
from jaxreshard._src.orbax.durable import DurableRenameTemporaryPath
from jaxreshard._src.orbax.handler import ReshardCheckpointHandler, ReshardRestore, ReshardSave
from jaxreshard._src.orbax.save import save_sharded
from jaxreshard._src.progress import Progress

__version__ = "0.1.0"

__all__ = [
  "ArchiveError",
  "ArchiveExistsError",
  "CHECKPOINT_FORMAT_VERSION",
  "Digest",
  "DtypeError",
  "DurableRenameTemporaryPath",
  "FlatShard",
  "MeshState",
  "Migration",
  "ParamPlacement",
  "PlacementError",
  "Progress",
  "RECORD_VERSION",
  "ReshardCheckpointHandler",
  "ReshardError",
  "ReshardRestore",
  "ReshardSave",
  "ShapeError",
  "ShardRecord",
  "clear_kernel_cache",
  "compare_digests",
  "digest",
  "flat_sharded",
  "gather_from_mesh",
  "kernel_cache_info",
  "load_records",
  "open_checkpoint",
  "plan",
  "reshard",
  "reshard_ranks",
  "reshard_to_mesh",
  "restore",
  "restore_ranks",
  "restore_sharded",
  "save_sharded",
  "save_records",
  "shard_state",
  "shard_to_mesh",
  "unshard_state",
]
