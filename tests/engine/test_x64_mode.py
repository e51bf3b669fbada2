"""Sources validated under one x64 mode are never reused under the other.

A float64 history buffer is copied exactly only while ``jax_enable_x64`` is on; with
it off every path refuses it (``ShapeError``). Records resharded once under x64
and again after it was turned off must be refused as records never seen are, on
every executor, for numpy and device-resident records alike: a validation
remembered from the first call would let the host path return float64 while
refusing a fresh call, and the device executor narrow the values to float32.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxreshard as jr
from tests._core_util import assert_bits_equal

# A signalling NaN, 1 + 1 ulp and a value past float32's largest: none survives float32.
_BITS = np.array([0x7FF0000000000001, 0x3FF0000000000001, 0x47EFFFFFE0000001], np.uint64)


def _float64_records(n):
  with jax.enable_x64(True):
    params = {f"p{i:03d}": jnp.zeros((3,), jnp.float32) for i in range(n)}
    opt = optax.sgd(0.1, momentum=0.9, accumulator_dtype=jnp.float64)
    state = opt.init(params)
    trace = {k: _BITS.view(np.float64).copy() for k in params}
    return jr.shard_state(opt, params, (state[0]._replace(trace=trace), state[1]), 2)


def _refusal(fn):
  with pytest.raises(jr.ShapeError) as e:
    fn()
  return str(e.value)


@pytest.mark.parametrize("n", [5, 300], ids=["programs", "staged"])
@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
def test_records_resharded_under_x64_are_refused_alike_once_it_is_off(n, on_device):
  records, unseen = _float64_records(n), _float64_records(n)
  if on_device:
    with jax.enable_x64(True):
      records = [dataclasses.replace(r, state=jax.device_put(r.state)) for r in records]
  plan = lambda rs: jr.plan(rs, world_size=1, rank=0)
  with jax.enable_x64(True):
    for executor in ("host", "device", "auto"):
      whole = jr.reshard(records, plan(records), executor=executor)
      assert_bits_equal(whole.state[0].trace["p001"], _BITS.view(np.float64))
  assert not jax.config.jax_enable_x64
  expected = _refusal(lambda: jr.reshard(unseen, plan(unseen)))
  assert "float64" in expected and "jax_enable_x64" in expected
  for executor in ("host", "device", "auto"):
    assert _refusal(lambda: jr.reshard(records, plan(records), executor=executor)) == expected
  assert _refusal(lambda: jr.unshard_state(records)) == _refusal(lambda: jr.unshard_state(unseen))
  # And back under x64: the same records give their float64 bits again.
  with jax.enable_x64(True):
    again = jr.reshard(records, plan(records), executor="device")
    assert_bits_equal(again.state[0].trace["p001"], _BITS.view(np.float64))
