"""The one home of the test helpers: a plain-numpy oracle, bit comparisons,
random bits, example params and states, and record edits.

Every test module (and the multi-process worker) takes these from here; the
other ``_*_util`` modules hold only what is particular to their tests.

The oracle is deliberately independent of jaxreshard: it flattens a full
buffer, pads it with zeros to ``W * slots`` and slices rank ``r``'s part, which
is the FSDP flat-shard definition in four lines of numpy.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from jax.sharding import Mesh

import jaxreshard as jr
from tests._shapes import SMALL_SHAPES, STORAGE_SHAPES

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "fsdp_flat_shards.npz")

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x: Any) -> np.ndarray:
  """The raw bit patterns of an array (shape kept), as unsigned integers."""
  a = np.asarray(x)
  return a.view(_UINT[a.dtype.itemsize])


def oracle_slots(count: int, world_size: int) -> int:
  return -(-count // world_size)


def oracle_shard(full: Any, world_size: int, rank: int) -> np.ndarray:
  """Rank ``rank``'s zero-padded flat shard of ``full`` (numpy only)."""
  a = np.asarray(full)
  flat = a.reshape(-1)
  slots = oracle_slots(flat.size, world_size)
  padded = np.zeros(world_size * slots, dtype=a.dtype)
  padded[: flat.size] = flat
  return padded[rank * slots : (rank + 1) * slots]


def leaf_at(tree: Any, path: tuple) -> Any:
  """The leaf of ``tree`` at a key path from ``jax.tree_util.tree_flatten_with_path``."""
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      tree = tree[key.key]
    elif isinstance(key, jax.tree_util.SequenceKey):
      tree = tree[key.idx]
    else:
      tree = getattr(tree, key.name)
  return tree


def assert_bits_equal(actual: Any, expected: Any, what: str = "") -> None:
  a, e = np.asarray(actual), np.asarray(expected)
  assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
  assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
  ba, be = bits(a), bits(e)
  if not np.array_equal(ba, be):
    bad = np.flatnonzero(ba.reshape(-1) != be.reshape(-1))
    raise AssertionError(f"{what}: {bad.size} elements differ, first at flat index {bad[0]}")


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def assert_trees_bit_equal(actual: Any, expected: Any) -> None:
  """Same tree structure (MaskedNode positions included) and bit-equal leaves."""
  la, ta = jax.tree_util.tree_flatten_with_path(actual)
  le, te = jax.tree_util.tree_flatten_with_path(expected)
  assert ta == te, f"tree structures differ:\n{ta}\n{te}"
  for (path, a), (_, e) in zip(la, le):
    assert_bits_equal(a, e, jax.tree_util.keystr(path))


def assert_records_equal(a: Any, b: Any) -> None:
  """Two ShardRecords are identical: version, placements, roles, structure, bits."""
  assert a.version == b.version
  assert a.placements == b.placements
  assert a.roles == b.roles
  assert_trees_bit_equal(a.state, b.state)


def snapshot(obj: Any) -> tuple[Any, list[tuple[str, bytes]]]:
  """Structure + every leaf's dtype/shape/bytes, to prove an input unchanged.

  Records are pytrees whose static fields (placements, version, roles) live in
  the treedef, so comparing treedefs compares them too.
  """
  leaves, treedef = jax.tree_util.tree_flatten(obj)
  return treedef, [(np.asarray(x).dtype.str, np.shape(x), np.asarray(x).tobytes()) for x in leaves]


def random_bits_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
  """An array of ``dtype`` whose bits are uniformly random (NaN payloads, ±0,
  inf and subnormals all occur for 16-bit types at moderate sizes)."""
  dt = np.dtype(dtype)
  n = math.prod(shape)
  raw = rng.integers(0, 2 ** (8 * dt.itemsize), size=n, dtype=np.uint64)
  return raw.astype(_UINT[dt.itemsize]).view(dt).reshape(shape)


SPECIAL_F32 = np.array(
  [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, -1e-45, 1.1754942e-38, 3.4e38],
  dtype=np.float32,
)


def special_values(dtype) -> np.ndarray:
  """NaN (several payloads, both signs), ±inf, ±0, subnormals, in ``dtype``'s bits."""
  dt = np.dtype(dtype)
  if dt == np.float32:
    nan_payloads = np.array([0x7FC00001, 0xFFC00123, 0x7F800001, 0x7FBFFFFF], np.uint32)
    return np.concatenate([SPECIAL_F32, nan_payloads.view(np.float32)])
  u = np.array(
    [0x7E01, 0xFE55, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x8001, 0x007F]
    if dt == ml_dtypes.bfloat16
    else [0x7E01, 0xFE55, 0x7C01, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001, 0x8001, 0x03FF],
    np.uint16,
  )
  return u.view(dt)


BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def nest(flat: dict) -> dict:
  """A nested-dict pytree from ``{"a/b": x}`` ids (how flax nests params)."""
  root: dict = {}
  for pid, v in flat.items():
    *parents, last = pid.split("/")
    node = root
    for k in parents:
      node = node.setdefault(k, {})
    node[last] = v
  return root


def rchar() -> int:
  """Bytes this process has read through read-like syscalls (pread included) so far."""
  with open("/proc/self/io") as f:
    for line in f:
      if line.startswith("rchar:"):
        return int(line.split()[1])
  raise RuntimeError("no rchar in /proc/self/io")


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_xla_compiles():
  """Counts XLA backend compilations inside the block (jax.monitoring)."""
  counter = {"n": 0}

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == _BACKEND_COMPILE:
      counter["n"] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counter
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...], devices: Any = None) -> Mesh:
  """A mesh of ``shape`` over the first devices (or over ``devices``)."""
  devices = jax.devices()[: math.prod(shape)] if devices is None else devices
  return Mesh(np.array(devices).reshape(shape), names)


def standard(fn, *args):
  """``fn(*args)`` under jax's standard promotion rules.

  optax's own math mixes Python floats and int32 counters, which the suite's
  strict promotion refuses; jaxreshard itself runs under strict.
  """
  with jax.numpy_dtype_promotion("standard"):
    return fn(*args)


def random_params(shapes: dict, seed: int = 0) -> Any:
  """Nested params of ``{id: (shape, dtype)}``: standard normal values, drawn in float32."""
  rng = np.random.default_rng(seed)
  return nest(
    {
      pid: jnp.asarray(rng.standard_normal(s).astype(np.float32), d)
      for pid, (s, d) in shapes.items()
    }
  )


def random_grads(params: Any, step: int) -> Any:
  """Standard normal gradients of ``params``' shapes and dtypes, one stream per step."""
  rng = np.random.default_rng(100 + step)
  return jax.tree.map(
    lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32), p.dtype), params
  )


def random_example(
  opt: Any, specs: dict, seed: int = 0, *, random_float_scalars: bool = True
) -> tuple[Any, Any]:
  """(params, state) for ``{id: (shape, dtype)}``: zero params and ``opt.init``'s state
  with every history buffer filled with random bits.

  Integer clock scalars get a random value in ``[1, 10**6)``; float scalars
  (injected hyper-parameters) get random bits when ``random_float_scalars``,
  else keep their initial value. Leaves are filled in tree order from one
  generator, so the same seed gives the same bits in every process.
  """
  from jaxreshard._src.core import structure as _structure  # pylint: disable=g-import-not-at-top

  params = nest({pid: jnp.zeros(s, d) for pid, (s, d) in specs.items()})
  state = standard(opt.init, params)  # inject_hyperparams' init mixes dtypes
  rng = np.random.default_rng(seed)
  roles = _structure.history_roles(opt, params, state)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  new = []
  for leaf, role in zip(leaves, roles):
    if role is not None:
      new.append(jnp.asarray(random_bits_array(rng, leaf.shape, leaf.dtype)))
    elif not jnp.issubdtype(leaf.dtype, jnp.floating):
      new.append(jnp.asarray(rng.integers(1, 10**6), leaf.dtype))
    elif random_float_scalars:
      new.append(jnp.asarray(random_bits_array(rng, leaf.shape, leaf.dtype)))
    else:
      new.append(leaf)
  return params, jax.tree_util.tree_unflatten(treedef, new)


def replace_history(record: Any, pid: str, m: int, fn) -> Any:
  """A copy of ``record`` whose ``m``-th history buffer of ``pid`` is ``fn(buffer)``
  (``fn`` gets a writable numpy copy)."""
  leaves, treedef = jax.tree_util.tree_flatten(record.state)
  hits = [i for i, role in enumerate(record.roles) if role == pid]
  leaves[hits[m]] = fn(np.asarray(leaves[hits[m]]).copy())
  return jr.ShardRecord(
    record.version, record.placements, jax.tree_util.tree_unflatten(treedef, leaves), record.roles
  )


# ``LABELS`` freezes two of ``SMALL_SHAPES``.
LABELS = nest(
  {
    "dense/kernel": "train",
    "dense/bias": "train",
    "emb": "frozen",
    "scale": "train",
    "tiny": "frozen",
  }
)
MASK = jax.tree.map(lambda label: label == "train", LABELS)
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=10)

# Real optax optimizers (and combinators) whose histories are per-param flat
# buffers, written for ``SMALL_SHAPES`` (the masks and labels name its params).
OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "adamw_mu_bf16": lambda: optax.adamw(1e-2, mu_dtype=jnp.bfloat16),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
  "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
  "lion": lambda: optax.lion(1e-3),
  "amsgrad": lambda: optax.amsgrad(1e-2),
  "rmsprop": lambda: optax.rmsprop(1e-2, momentum=0.9, centered=True),
  "adagrad": lambda: optax.adagrad(1e-2),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
    learning_rate=SCHEDULE, weight_decay=0.01
  ),
  "chain_clip_schedule": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.clip(0.5), optax.adamw(SCHEDULE)
  ),
  "masked": lambda: optax.masked(optax.adam(1e-2), MASK),
  "multi_transform": lambda: optax.multi_transform(
    {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, LABELS
  ),
  "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
  "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3),
}


def small_params(dtype: Any = jnp.float32, seed: int = 0) -> Any:
  """Params of ``SMALL_SHAPES`` in ``dtype`` (``random_params``)."""
  return random_params({pid: (s, dtype) for pid, s in SMALL_SHAPES.items()}, seed)


def random_state(opt: Any, prm: Any, seed: int = 1) -> Any:
  """``opt.init(prm)`` with every non-scalar leaf replaced by random bits
  (NaN payloads, -0.0, subnormals) and the special values up front."""
  rng = np.random.default_rng(seed)

  def fill(x):
    if np.ndim(x) == 0 or np.size(x) == 0:
      return x
    a = random_bits_array(rng, np.shape(x), np.dtype(x.dtype)).reshape(-1)
    sv = special_values(x.dtype) if np.dtype(x.dtype).name != "float64" else a[:0]
    a[: min(a.size, sv.size)] = sv[: a.size]
    return jnp.asarray(a.reshape(np.shape(x)))

  # optax's schedules mix int32 counts with Python floats, which the strict
  # promotion of the test settings refuses; init is not what is under test.
  with jax.numpy_dtype_promotion("standard"):
    state = jax.tree.map(fill, opt.init(prm))
  # A clock that is not the initial one: the count is part of what must survive.
  return jax.tree.map(
    lambda x: jnp.asarray(1234, x.dtype) if np.ndim(x) == 0 and x.dtype == jnp.int32 else x, state
  )


def adam_records(world: int, shapes=None, seed: int = 0) -> list:
  """Adam records over ``world`` ranks of ``random_state`` (``STORAGE_SHAPES`` by default)."""
  opt = optax.adam(1e-3)
  prm = random_params(shapes or STORAGE_SHAPES, seed)
  return jr.shard_state(opt, prm, random_state(opt, prm, seed + 1), world)


def retyped_adam_records(mu_dtype: Any = None, storage_dtype: Any = None) -> list:
  """Adam records of one 10-element param over 2 ranks whose first moment is cast to
  ``mu_dtype`` and whose placements claim ``storage_dtype`` (each when given): states
  no reader takes, for the tests of who refuses them."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  params = {"a": jnp.arange(10, dtype=jnp.float32)}
  opt = optax.adam(1e-3)
  out = []
  for r in jr.shard_state(opt, params, opt.init(params), world_size=2):
    state, placements = r.state, r.placements
    if mu_dtype is not None:
      mu = {"a": np.asarray(state[0].mu["a"]).astype(mu_dtype)}
      state = (state[0]._replace(mu=mu),) + tuple(state[1:])
    if storage_dtype is not None:
      placements = tuple(dataclasses.replace(p, dtype=np.dtype(storage_dtype)) for p in placements)
    out.append(jr.ShardRecord(r.version, placements, state, r.roles))
  return out
