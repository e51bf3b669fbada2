"""jaxreshard: exact resharding of optax flat-shard optimizer state.

Rebuilds ZeRO / FSDP flat shards of optax state for a new number of ranks,
bit for bit, with jitted gather kernels, and refuses archives that do not
belong together.
"""

from jaxreshard._errors import DtypeError, PlacementError, ReshardError, ShapeError
from jaxreshard._geometry import FlatShard
from jaxreshard._kernels import clear_kernel_cache, kernel_cache_info
from jaxreshard._placement import Migration, ParamPlacement
from jaxreshard._record import FORMAT_VERSION, ShardRecord
from jaxreshard._reshard import plan, reshard, shard_state, unshard_state

__version__ = "0.1.0"

__all__ = [
    "DtypeError",
    "FORMAT_VERSION",
    "FlatShard",
    "Migration",
    "ParamPlacement",
    "PlacementError",
    "ReshardError",
    "ShapeError",
    "ShardRecord",
    "clear_kernel_cache",
    "kernel_cache_info",
    "plan",
    "reshard",
    "shard_state",
    "unshard_state",
]
