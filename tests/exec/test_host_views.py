"""Host views of source buffers and the outline of a state, checked against their rules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxreshard._src.core import structure as _structure
from jaxreshard._src.exec import host as _host_exec


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16, np.float64, np.bool_])
@pytest.mark.parametrize("make", ["flat", "matrix", "strided", "jax", "scalar"])
def test_host_bits_is_bits_of_host_view(dtype, make):
  base = np.arange(24).astype(dtype)
  x = {
    "flat": base,
    "matrix": base.reshape(4, 6),
    "strided": base[::3],
    "jax": jnp.asarray(base),
    "scalar": base[5],
  }[make]
  got = _host_exec.host_bits(x)
  want = _host_exec.bits(_host_exec.host_view(x))
  assert got.dtype == want.dtype and got.shape == want.shape
  np.testing.assert_array_equal(got, want)


def _mirror_ids(state, parts):
  """Each mirror's (param id, leaf) in flatten order, read with key paths."""
  out = []
  for m in parts.subtrees:
    node = state
    for key in m.prefix:
      node = node[key.idx] if hasattr(key, "idx") else getattr(node, key.name, None)
    leaves = jax.tree_util.tree_flatten_with_path(node, is_leaf=_structure._is_masked_node)[0]
    out.append([(_structure.path_id(p), x) for p, x in leaves])
  return out


@pytest.mark.parametrize("masked", [False, True])
def test_state_parts_mirrors_follow_key_paths(masked):
  params = {"a": {"w": jnp.ones(3), "b": jnp.ones(2)}, "c%/d": jnp.ones(4)}
  opt = optax.adam(1e-3)
  if masked:
    opt = optax.masked(opt, {"a": {"w": True, "b": False}, "c%/d": True})
  state = opt.init(params)
  parts = _structure.state_parts(state, _structure.history_roles(opt, params, state))
  assert len(parts.subtrees) == 2
  entries = [e for m in parts.subtrees for e in m.entries.values()]
  assert masked == any(e is _structure.MASKED for e in entries)
  for m, want in zip(parts.subtrees, _mirror_ids(state, parts)):
    assert list(m.order) == [pid for pid, _ in want]
    for pid, x in want:
      got = m.entries[pid]
      assert (got is _structure.MASKED) if isinstance(x, optax.MaskedNode) else (got is x)
