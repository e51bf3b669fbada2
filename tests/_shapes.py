"""The one home of the shapes the tests use: each set of params, and the shapes drawn from.

``{param id: shape}`` or ``{param id: (shape, storage dtype)}``; the other helpers and the
tests import them from here. Each set is sized for what its tests check (uneven splits,
all-padding ranks, scalars, empty buffers, each storage dtype).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# A small model of the optimizer tests: 35 elements (divisible by neither 8
# nor 6), 7 (fewer elements than 8 ranks: the last rank is all padding), a scalar and
# a size-1 param; ``_core_util.LABELS`` freezes two of them.
SMALL_SHAPES = {
  "dense/kernel": (5, 7),
  "dense/bias": (7,),
  "emb": (13, 3),
  "scale": (),
  "tiny": (1,),
}

# ``SMALL_SHAPES`` with a bf16 param among them (the flat_sharded optimizer tests).
SMALL_MIXED_SHAPES = {
  pid: (shape, jnp.bfloat16 if pid == "emb" else jnp.float32) for pid, shape in SMALL_SHAPES.items()
}

# Small, odd sizes: nothing divides evenly, one parameter is a scalar, one is
# empty, one is bf16 and one f16 (storage dtypes), so padding and every dtype occur.
STORAGE_SHAPES = {
  "dense/kernel": ((5, 7), jnp.float32),
  "dense/bias": ((7,), jnp.float32),
  "emb": ((13, 3), jnp.bfloat16),
  "half": ((9,), jnp.float16),
  "scale": ((), jnp.float32),
  "empty": ((0,), jnp.float32),
}

# The target-sharding restore example (``_target_util``). Dimensions divide by 2, 4
# and 8 where a test shards them; the flat shards of an uneven source world size
# (3, 5) cut rows in the middle.
TARGET_SPECS = {
  "dense/kernel": ((16, 24), np.float32),
  "dense/bias": ((24,), np.float32),
  "embed/table": ((8, 12), jnp.bfloat16),
  "head/w": ((4, 8), np.float16),
  "scalar": ((), np.float32),
  "one": ((1,), np.float32),
  "empty": ((0, 4), np.float32),
  "frozen/w": ((4, 6), np.float32),
}

# The multi-process example (``_mp_util``). Uneven sizes on purpose: 8 -> 6 and 8 -> 5
# split them unevenly, "tiny" leaves trailing ranks all padding, "empty" has
# no elements, "scalar" is 0-d. Big enough that array bytes dominate metadata.
MP_SPECS = {
  "dense/kernel": ((256, 301), np.float32),
  "dense/bias": ((130,), np.float32),
  "embed/table": ((61, 67), jnp.bfloat16),
  "head/w": ((33, 17), np.float16),
  "tiny": ((3,), np.float32),
  "scalar": ((), np.float32),
  "empty": ((0, 4), np.float32),
}

# Shapes a hypothesis test draws param shapes from: the read-path checkpoints of
# ``core/test_one_rule.py`` (0-d, size 1, odd, 2-d, empty) ...
DRAWN_SHAPES = [(), (1,), (5,), (7,), (2, 3), (3, 4), (0,)]

# ... and the oracle properties of ``core/test_properties.py`` (with zero-size and 3-d
# shapes, and sizes prime to every world size up to 17).
ORACLE_SHAPES = [
  (),
  (1,),
  (1, 1),
  (0,),
  (3, 0),
  (2,),
  (3,),
  (5,),
  (7,),
  (13,),
  (17,),
  (31,),
  (2, 3),
  (3, 5),
  (4, 1, 3),
  (2, 3, 4),
]
