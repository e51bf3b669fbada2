"""The digest processes of a multi-process save of records compare: every record's
placements, structure and leaves' dtypes, shapes, weak types and bits, whatever
holds them (numpy or jax arrays), typed PRNG keys included."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxreshard as jr
from jaxreshard._src.orbax.agreement import records_digest


def _records(opt, params):
  return jr.shard_state(opt, params, opt.init(params), world_size=3)


def _with_leaf(records, rank, fn):
  """``records`` with ``fn`` applied to the first leaf of ``rank``'s state it changes."""
  out = list(records)
  leaves, treedef = jax.tree_util.tree_flatten(out[rank].state)
  for i, x in enumerate(leaves):
    y = fn(x)
    if y is not None:
      leaves[i] = y
      break
  out[rank] = dataclasses.replace(out[rank], state=jax.tree_util.tree_unflatten(treedef, leaves))
  return out


def test_the_same_bits_held_as_numpy_or_jax_arrays_digest_alike_and_one_bit_differs():
  params = {"w": jnp.arange(7.0, dtype=jnp.bfloat16), "b": jnp.zeros((2,))}
  records = _records(optax.adam(1e-3, mu_dtype=jnp.bfloat16), params)
  as_numpy = [
    dataclasses.replace(r, state=jax.tree.map(lambda x: np.array(x), r.state)) for r in records
  ]
  assert records_digest(records) == records_digest(as_numpy)

  def flip(x):
    if np.ndim(x) and np.size(x):
      y = np.array(x)
      y.reshape(-1).view(np.uint8)[0] ^= 1
      return y
    return None

  assert records_digest(_with_leaf(records, 1, flip)) != records_digest(records)
  # A NaN payload is bits like any other.
  nan = np.uint16(0x7FC1).view(jnp.bfloat16)

  def payload(bits):
    return lambda x: np.full_like(np.asarray(x), bits) if np.ndim(x) and np.size(x) else None

  a = _with_leaf(records, 0, payload(nan))
  b = _with_leaf(records, 0, payload(np.uint16(0x7FC2).view(jnp.bfloat16)))
  assert records_digest(a) != records_digest(b)


def test_a_typed_prng_key_is_digested_by_its_key_data():
  """``noisy_sgd`` keeps a typed PRNG key: digested (before, ``np.asarray`` of it raised
  in every process of a multi-process save of records), and another key differs."""
  params = {"w": jnp.ones((5,))}
  opt = optax.noisy_sgd(0.1, key=jax.random.key(0))
  records = _records(opt, params)
  assert any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(records))
  again = _records(opt, params)
  assert records_digest(records) == records_digest(again)
  other = _with_leaf(
    records,
    2,
    lambda x: jax.random.key(7) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else None,
  )
  assert records_digest(other) != records_digest(records)


def test_a_weak_clock_differs_from_a_strong_one_of_the_same_bits():
  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  records = _records(opt, {"w": jnp.ones((5,))})

  def lr(v):
    return [
      dataclasses.replace(
        r, state=r.state._replace(hyperparams=dict(r.state.hyperparams, learning_rate=v))
      )
      for r in records
    ]

  assert jnp.asarray(0.1).weak_type and not jnp.asarray(0.1, jnp.float32).weak_type
  assert records_digest(lr(jnp.asarray(0.1))) != records_digest(lr(jnp.asarray(0.1, jnp.float32)))
