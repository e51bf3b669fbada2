"""flat_sharded's jitted step: what XLA compiles for it, not how fast it runs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxreshard as jr
from jaxreshard._src.distributed import flat_layout


def _mesh(kind):
  types = (AxisType.Explicit,) if kind == "explicit" else (AxisType.Auto,)
  return jax.make_mesh((8,), ("fsdp",), axis_types=types)


def _step_and_args(kind, shapes):
  mesh = _mesh(kind)
  rep = NamedSharding(mesh, P())
  params = {k: jax.device_put(jnp.full(s, 0.5, jnp.float32), rep) for k, s in shapes.items()}
  grads = {k: jax.device_put(jnp.full(s, 0.25, jnp.float32), rep) for k, s in shapes.items()}
  opt = jr.flat_sharded(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), mesh)
  with jax.numpy_dtype_promotion("standard"):
    state = opt.init(params)

  def step(p, g, s):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  out = (jax.tree.map(lambda _: rep, params), jax.tree.map(lambda x: x.sharding, state))
  return mesh, jax.jit(step, out_shardings=out, donate_argnums=(0, 2)), (params, grads, state)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_unpadded_histories_are_updated_in_place(kind):
  """Histories without padding are written once, into their donated buffers: no copies."""
  mesh, step, args = _step_and_args(kind, {"w": (16, 24), "b": (24,)})
  with jax.set_mesh(mesh), jax.numpy_dtype_promotion("standard"):  # optax's, not ours
    text = step.lower(*args).compile().as_text()
  entry = text[text.index("\nENTRY") :]
  assert " copy(" not in entry, [line for line in entry.splitlines() if " copy(" in line]


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_padded_and_unpadded_step_keeps_padding_zero(kind):
  """A jitted donated step over padded (5 x 3) and unpadded params keeps padding at zero."""
  mesh, step, (params, grads, state) = _step_and_args(kind, {"w": (16, 24), "odd": (5, 3)})
  with jax.set_mesh(mesh), jax.numpy_dtype_promotion("standard"):  # optax's, not ours
    for _ in range(3):
      params, state = step(params, grads, state)
  mu = np.asarray(state[1][0].mu["odd"])
  assert mu.shape == (16,) and np.all(mu[15:].view(np.uint32) == 0) and np.all(mu[:15] != 0)
  assert np.all(np.asarray(state[1][0].mu["w"]) != 0)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_the_global_norm_of_replicated_grads_is_not_all_reduced(kind):
  """Each device computes clip_by_global_norm's norm of replicated grads itself.

  No all-reduce, which every device would wait at.
  """
  mesh, step, args = _step_and_args(kind, {"w": (16, 24), "odd": (5, 3), "b": (24,)})
  with jax.set_mesh(mesh), jax.numpy_dtype_promotion("standard"):  # optax's, not ours
    text = step.lower(*args).compile().as_text()
  assert not _collectives(text, "all-reduce")


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_histories_of_params_of_at_most_m_elements_are_gathered_together(kind):
  """The histories of params computed whole (at most M elements) share one all-gather."""
  mesh, step, args = _step_and_args(kind, {"s": (3,), "t": (5,), "u": (2, 2), "w": (16, 24)})
  with jax.set_mesh(mesh), jax.numpy_dtype_promotion("standard"):  # optax's, not ours
    text = step.lower(*args).compile().as_text()
    # The mu and nu of s, t and u: six (8,) histories as one (8, 6) array.
    gathered = _collectives(text, "all-gather")
    assert [line for line in gathered if "[8,6]" in line.split("=")[1]], gathered
    assert not [line for line in gathered if "[8]" in line.split("=")[1]], gathered
    _, new_state = step(*args)
  for k in ("s", "t", "u"):
    mu = np.asarray(new_state[1][0].mu[k])
    assert mu.shape == (8,) and np.all(mu[: int(np.prod(np.shape(args[0][k])))] != 0)


def test_row_sharded_grads_are_not_gathered():
  """Grads whose rows are split over the axis (ZeRO-2) and their updates stay where they lie.

  Same bits as from replicated grads, and no all-gather: not of the grads, and not
  of the updates, which come back with the grads' row sharding. (The optimizer is
  elementwise: a norm over the tree adds sharded grads as partial sums and an
  all-reduce, replicated ones on each device, and the two agree to rounding.)
  """
  mesh = _mesh("explicit")
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("fsdp"))
  params = {
    "w": jax.device_put(jnp.full((64, 24), 0.5), rep),
    "b": jax.device_put(jnp.ones(24), rep),
  }
  grads = {"w": jnp.arange(64 * 24.0).reshape(64, 24) / 1000, "b": jnp.arange(24.0) / 100}
  opt = jr.flat_sharded(optax.adamw(1e-2), mesh)
  with jax.numpy_dtype_promotion("standard"):
    state = opt.init(params)
  update = jax.jit(opt.update)
  with jax.set_mesh(mesh), jax.numpy_dtype_promotion("standard"):
    want = update(jax.device_put(grads, rep), state, params)
    sharded = jax.device_put(grads, rows)
    got = update(sharded, state, params)
    text = update.lower(sharded, state, params).compile().as_text()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
  for u in jax.tree.leaves(got[0]):
    assert tuple(u.sharding.spec)[0] == "fsdp" and set(tuple(u.sharding.spec)[1:]) <= {None}
  gathered = [line for line in text.splitlines() if " all-gather(" in line]
  assert not gathered, gathered


def _bits(x):
  return x.view({2: np.uint16, 4: np.uint32}[x.itemsize])


def _collectives(text, op):
  return [line for line in text.splitlines() if f" {op}(" in line]


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_small_updates_are_gathered_together_one_all_gather_per_dtype(kind, monkeypatch):
  """Updates with small flat shards share one all-gather per dtype; a large one has its own.

  The updates are the same bits as with one all-gather per param. (With
  ``shard_updates=True`` explicit axes return those whose leading dimension 8
  divides row-sharded, not gathered: ``test_updates_whose_rows_divide_are_not_gathered``.)
  """
  mesh = _mesh(kind)
  rep = NamedSharding(mesh, P())
  shapes = {
    "big": ((256, 256), jnp.float32),  # an 8192-element (32 KiB) shard: gathered alone
    "w": ((16, 24), jnp.float32),
    "odd": ((5, 3), jnp.float32),  # padded
    "b": ((40,), jnp.float32),
    "hw": ((16, 8), jnp.bfloat16),
    "hb": ((32,), jnp.bfloat16),
  }
  params = {
    k: jax.device_put(jnp.linspace(-1, 1, int(np.prod(s))).reshape(s).astype(d), rep)
    for k, (s, d) in shapes.items()
  }
  grads = jax.tree.map(lambda x: (x * 0.25 + 0.125).astype(x.dtype), params)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))

  def compiled_step():
    opt = jr.flat_sharded(tx, mesh)
    with jax.numpy_dtype_promotion("standard"):
      state = opt.init(params)

    def step(p, g, s):
      u, s = opt.update(g, s, p)
      return u, optax.apply_updates(p, u), s

    out = (None, jax.tree.map(lambda _: rep, params), jax.tree.map(lambda x: x.sharding, state))
    jitted = jax.jit(step, out_shardings=out)
    with jax.set_mesh(mesh), jax.numpy_dtype_promotion("standard"):
      text = jitted.lower(params, grads, state).compile().as_text()
      return jitted(params, grads, state)[0], text

  updates, text = compiled_step()
  monkeypatch.setattr(flat_layout, "PACKED_SHARD_BYTES", 0)
  each, each_text = compiled_step()
  gathered = _collectives(text, "all-gather")
  # "big" alone; w, odd and b as (8, 48 + 2 + 5 slots); hw and hb as (8, 16 + 4).
  dims = sorted(re.search(r"\[([0-9,]+)\]", line.split("=")[1]).group(1) for line in gathered)
  assert dims[0] in ("256,256", "65536") and dims[1:] == ["8,20", "8,55"], gathered
  assert len(_collectives(each_text, "all-gather")) == 6
  for k in shapes:
    a, b = np.asarray(updates[k]), np.asarray(each[k])
    assert a.shape == shapes[k][0] and a.dtype == shapes[k][1], k
    np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=k)


def test_updates_whose_rows_divide_are_not_gathered():
  """With ``shard_updates=True`` under explicit axes, updates whose leading dimension 8 divides stay where they lie.

  Their flat shards are their rows: the update all-gathers nothing of theirs (only
  the packed updates of the other params, and the histories of a param updated
  whole), and a step with replicated ``out_shardings`` gathers each such new param
  once, after the add. The updates are the same bits as laid out like the grads.
  """
  mesh = _mesh("explicit")
  rep = NamedSharding(mesh, P())
  shapes = {
    "big": (256, 256),
    "w": (16, 24),
    "b": (40,),
    "odd": (5, 3),  # padded: gathered with c, 2 + 3 slots
    "c": (3, 8),  # 8 divides only the trailing dimension
    "e": (8,),  # 8 elements, updated whole: its mu and nu gathered, 1 + 1 slots
  }
  params = {
    k: jax.device_put(jnp.linspace(-1, 1, int(np.prod(s))).reshape(s), rep)
    for k, s in shapes.items()
  }
  grads = jax.tree.map(lambda x: x * 0.25 + 0.125, params)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))

  def compiled(shard_updates):
    opt = jr.flat_sharded(tx, mesh, shard_updates=shard_updates)
    with jax.numpy_dtype_promotion("standard"):
      state = opt.init(params)

    def step(p, g, s):
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s

    out = (jax.tree.map(lambda _: rep, params), jax.tree.map(lambda x: x.sharding, state))
    update = jax.jit(opt.update)
    with jax.set_mesh(mesh), jax.numpy_dtype_promotion("standard"):
      update_text = update.lower(grads, state, params).compile().as_text()
      step_text = jax.jit(step, out_shardings=out).lower(params, grads, state).compile().as_text()
      return update(grads, state, params)[0], update_text, step_text

  def dims(text):
    gathered = _collectives(text, "all-gather")
    return sorted(re.search(r"\[([0-9,]+)\]", line.split("=")[1]).group(1) for line in gathered)

  updates, update_text, step_text = compiled(True)
  assert dims(update_text) == ["8,2", "8,5"], _collectives(update_text, "all-gather")
  assert dims(step_text) == ["16,24", "256,256", "40", "8,2", "8,5"], dims(step_text)
  like_grads, _, _ = compiled(False)
  for k in shapes:
    np.testing.assert_array_equal(_bits(np.asarray(updates[k])), _bits(np.asarray(like_grads[k])))
