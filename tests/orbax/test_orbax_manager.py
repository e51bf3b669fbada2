"""A real orbax CheckpointManager saving jaxreshard archives and restoring on a new world size."""

import os
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest

import jaxreshard as jr
from tests._core_util import adam_records, assert_records_equal, bits, device_mesh


def _steps():
  # A different state per step (different random bits), 4 ranks each.
  return {step: adam_records(4, seed=step) for step in (10, 20, 30)}


def test_manager_keeps_steps_and_restores_the_latest_on_a_new_world_size(tmp_path):
  steps = _steps()
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
    for step, records in steps.items():
      manager.save(step, args=jr.ReshardSave(iter(records), chunk_bytes=16))
    manager.wait_until_finished()
    assert manager.all_steps() == [20, 30]

  # A restart on 3 ranks: a new manager, each rank restores its own slice.
  with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
    latest = manager.latest_step()
    assert latest == 30
    records = steps[latest]
    for rank in range(3):
      target = manager.restore(latest, args=jr.ReshardRestore(world_size=3, rank=rank))
      assert_records_equal(target, jr.reshard(records, jr.plan(records, world_size=3, rank=rank)))
    # Without a rank: every archive, exactly as saved.
    for a, b in zip(manager.restore(20, args=jr.ReshardRestore()), steps[20], strict=True):
      assert_records_equal(a, b)
  # Orbax owns the step directories; the item directory holds the jaxreshard layout.
  item = tmp_path / "run" / "30" / "default"
  assert sorted(os.listdir(item))[:2] == ["archive_00000", "archive_00001"]
  assert (item / "jaxreshard.json").is_file()


def test_one_item_of_a_composite_checkpoint(tmp_path):
  records = adam_records(5)
  with ocp.CheckpointManager(tmp_path / "run", item_names=("opt", "meta")) as manager:
    manager.save(
      7, args=ocp.args.Composite(opt=jr.ReshardSave(records), meta=ocp.args.JsonSave({"lr": 0.1}))
    )
    manager.wait_until_finished()
    out = manager.restore(
      7,
      args=ocp.args.Composite(
        opt=jr.ReshardRestore(world_size=2, rank=1), meta=ocp.args.JsonRestore()
      ),
    )
  assert out.meta == {"lr": 0.1}
  assert_records_equal(out.opt, jr.reshard(records, jr.plan(records, world_size=2, rank=1)))


def test_handler_refusals_reach_the_caller(tmp_path):
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(adam_records(2)))
    manager.wait_until_finished()
    with pytest.raises(jr.PlacementError):
      manager.restore(1, args=jr.ReshardRestore(world_size=3, rank=3))


def test_a_mesh_restore_is_checked_against_the_optimizer_it_feeds(tmp_path):
  """ReshardRestore(mesh=, optimizer=, params=): the same bits as unchecked, or a refusal
  naming the leaf, through a manager; the checked state feeds flat_sharded's update."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from tests._core_util import random_grads, random_params, random_state, standard

  shapes = {"dense/kernel": ((5, 3), np.float32), "dense/bias": ((3,), np.float32)}
  params = random_params({**shapes, "head/w": ((7,), jnp.bfloat16)})
  opt = optax.adam(1e-3)
  records = jr.shard_state(opt, params, random_state(opt, params), world_size=3)
  mesh = device_mesh((4,), ("fsdp",))
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(records))
    manager.wait_until_finished()
    plain = manager.restore(1, args=jr.ReshardRestore(mesh=mesh))
    checked = manager.restore(1, args=jr.ReshardRestore(mesh=mesh, optimizer=opt, params=params))
    assert jax.tree.structure(checked) == jax.tree.structure(plain)
    for a, b in zip(jax.tree.leaves(checked), jax.tree.leaves(plain), strict=True):
      assert a.sharding == b.sharding
      for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True):
        assert sa.device == sb.device and (bits(sa.data) == bits(sb.data)).all()
    standard(jr.flat_sharded(opt, mesh).update, random_grads(params, 0), checked, params)

    sgd = optax.sgd(0.1, momentum=0.9)
    with pytest.raises(
      jr.PlacementError,
      match=r"optimizer\.init\(params\)'s tree does not match the checkpoint's state: it lacks"
      r" the checkpoint's leaf \[0\]\.count \(a clock scalar\), leaf \[0\]\.mu\['dense'\]\['bias'\] \(history"
      r" buffer 0 of param 'dense/bias'\).*; extra leaf \[0\]\.trace\['dense'\]\['bias'\]",
    ):
      manager.restore(1, args=jr.ReshardRestore(mesh=mesh, optimizer=sgd, params=params))
    renamed = {"layer": params["dense"], "head": params["head"]}
    with pytest.raises(
      jr.PlacementError,
      match=r"param 'layer/bias' is in the params but not in the checkpoint; .*param"
      r" 'dense/kernel' is in the checkpoint but not in the params",
    ):
      manager.restore(1, args=jr.ReshardRestore(mesh=mesh, optimizer=opt, params=renamed))
    wider = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    with pytest.raises(
      jr.DtypeError,
      match=r"leaf \[0\]\.mu\['head'\]\['w'\] \(param 'head/w'\): optimizer\.init\(params\) has"
      r" dtype float32 but the checkpoint holds bfloat16",
    ):
      manager.restore(1, args=jr.ReshardRestore(mesh=mesh, optimizer=opt, params=wider))


@pytest.mark.slow
def test_mesh_state_in_a_composite_restored_on_another_mesh(tmp_path, monkeypatch):
  """A (2 x 4) mesh state saved beside params, restored onto 6 ranks; all exact.

  The archive writes wait for a gate opened only after ``save`` returned (a
  ``save`` that waited for its writes would never return), and the device
  state is deleted before they run.
  """
  import threading

  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  from jaxreshard._src.checkpoint import reader as _checkpoint
  from tests import _mp_util as U
  from tests.distributed.test_distributed import _check_against

  opt, params, state, _ = U.example(seed=3)
  mesh = device_mesh((2, 4), ("data", "fsdp"))
  src = jr.shard_to_mesh(opt, params, state, mesh, "fsdp", trainable=U.trainable())
  weights = jax.device_put(U.example_params(3), NamedSharding(mesh, PartitionSpec()))
  # The reference as host copies first: the mesh state shares its scalars' buffers
  # with ``state``, and those are deleted below.
  records = jax.tree.map(np.array, jr.shard_state(opt, params, state, 4, trainable=U.trainable()))
  structure = jax.tree.structure(state)
  gate, write = threading.Event(), _checkpoint.write_archive
  monkeypatch.setattr(_checkpoint, "write_archive", lambda *a: write(*a) if gate.wait(60) else None)
  with ocp.CheckpointManager(tmp_path / "run", item_names=("params", "opt_state")) as manager:
    manager.save(
      5,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(weights),
        opt_state=jr.ReshardSave(
          state=src.state, optimizer=opt, params=params, mesh=mesh, trainable=U.trainable()
        ),
      ),
    )
    assert manager.is_saving_in_progress() and not (tmp_path / "run" / "5").exists()
    # Host copies were taken before save returned: the device state may go.
    for leaf in jax.tree.leaves(src.state):
      leaf.delete()
    gate.set()
    manager.wait_until_finished()
    assert manager.all_steps() == [5]
  for got, want in zip(jr.load_records(tmp_path / "run" / "5" / "opt_state"), records, strict=True):
    assert_records_equal(got, want)  # placements from params: dtypes, trainability

  target = device_mesh((6,), ("fsdp",))
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(target, PartitionSpec())
    ),
    U.example_params(3),
  )
  with ocp.CheckpointManager(tmp_path / "run", item_names=("params", "opt_state")) as manager:
    out = manager.restore(
      5,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract),
        opt_state=jr.ReshardRestore(mesh=target, axis="fsdp"),
      ),
    )
  expected = [jr.reshard(records, jr.plan(records, world_size=6, rank=r)) for r in range(6)]
  assert _check_against(out.opt_state, target, "fsdp", expected)
  assert jax.tree.structure(out.opt_state) == structure
  for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(U.example_params(3))):
    assert (bits(a) == bits(b)).all()


def test_save_and_restore_arguments_are_checked():
  """Each wrong combination is refused by its own rule, in its own words."""
  records = adam_records(2)
  mesh = device_mesh((2,), ("fsdp",))
  opt = object()
  neither = "ReshardSave takes records, or a state (with optimizer, mesh and shapes or params)"
  for bad, words in (
    (dict(), neither),
    (dict(records=records, state={}), neither),
    (dict(state={}, mesh=mesh), "also needs optimizer, exactly one of shapes and params"),
    (dict(state={}, optimizer=opt, shapes={}), "ReshardSave(state=...) also needs mesh"),
    (
      dict(state={}, optimizer=opt, mesh=mesh, shapes={}, params={}),
      "also needs exactly one of shapes and params",
    ),
    (dict(state={}, optimizer=opt, mesh=mesh, shapes={}, trainable={}), "trainable goes with"),
  ):
    with pytest.raises(jr.PlacementError) as info:
      jr.ReshardSave(**bad)
    assert words in str(info.value), (bad, str(info.value))
  with pytest.raises(jr.ReshardError):
    jr.ReshardSave(records, chunk_bytes=0)
  sizes = "ReshardRestore(world_size=...) needs rank as well, and the reverse"
  pair = "ReshardRestore: optimizer= and params= go together; pass both"
  flat = "ReshardRestore(optimizer=..., params=...) checks the flat layout on a mesh"
  for bad, words in (
    (dict(rank=1), sizes),
    (dict(world_size=2), sizes),
    (dict(mesh=mesh, world_size=2, rank=0), "takes a mesh, or world_size and rank, not both"),
    (dict(target={}), "ReshardRestore(target=...) needs the mesh as well"),
    (dict(like={}), "ReshardRestore(like=...) needs the mesh as well"),
    (dict(mesh=mesh, optimizer=opt), pair),
    (dict(mesh=mesh, params={}), pair),
    (dict(optimizer=opt, params={}), flat),
    (dict(mesh=mesh, target={}, optimizer=opt, params={}), flat),
  ):
    with pytest.raises(jr.PlacementError) as info:
      jr.ReshardRestore(**bad)
    assert words in str(info.value), (bad, str(info.value))


def test_a_failed_write_commits_nothing(tmp_path, monkeypatch):
  import jax

  from jaxreshard._src.checkpoint import reader as _checkpoint
  from tests import _mp_util as U

  opt, params, state, _ = U.example(seed=4)
  mesh = device_mesh((4,), ("fsdp",))
  src = jr.shard_to_mesh(opt, params, state, mesh)
  shapes = {p.param: p for p in src.placements[0]}
  write = _checkpoint.write_archive

  def fail_on_rank_2(directory, index, *rest):
    if index == 2:
      raise OSError("injected: no space left on device")
    return write(directory, index, *rest)

  monkeypatch.setattr(_checkpoint, "write_archive", fail_on_rank_2)
  path = tmp_path / "ckpt"
  with pytest.raises(jr.ArchiveError, match="not committed.*no space left"):
    jr.save_sharded(path, opt, src.state, shapes, mesh)
  assert not path.exists()
  monkeypatch.setattr(_checkpoint, "write_archive", write)
  jr.save_sharded(path, opt, src.state, shapes, mesh)  # the same path, now complete
  for got, want in zip(jr.load_records(path), jr.shard_state(opt, params, state, 4), strict=True):
    assert_records_equal(got, want)
  assert jax.tree.structure(jr.restore_sharded(path, mesh).state) == jax.tree.structure(state)


def test_save_sharded_refuses_an_existing_path_and_a_missing_parent(tmp_path):
  """Every process looks before any save starts: an existing path (even an empty
  directory) is never written into, a missing parent is named, and nothing is made."""
  from tests import _mp_util as U

  opt, params, state, _ = U.example(seed=4)
  mesh = device_mesh((2,), ("fsdp",))
  src = jr.shard_to_mesh(opt, params, state, mesh)
  shapes = {p.param: p for p in src.placements[0]}
  (tmp_path / "taken").mkdir()
  with pytest.raises(jr.ArchiveExistsError, match="taken already exists; jaxreshard never"):
    jr.save_sharded(tmp_path / "taken", opt, src.state, shapes, mesh)
  assert list((tmp_path / "taken").iterdir()) == []
  with pytest.raises(FileNotFoundError, match="parent directory .*/absent of .*/absent/ckpt"):
    jr.save_sharded(tmp_path / "absent" / "ckpt", opt, src.state, shapes, mesh)
  assert sorted(os.listdir(tmp_path)) == ["taken"]


def test_an_archive_missing_at_the_commit_commits_nothing(tmp_path, monkeypatch):
  """A write that returned but whose archive is not in the directory at the commit (as
  on hosts that do not share the checkpoint's file system): nothing is committed."""
  import shutil

  from jaxreshard._src.checkpoint import reader as _checkpoint

  records = adam_records(4)
  write = _checkpoint.write_archive

  def lost_on_rank_2(directory, index, *rest, **kwargs):
    nbytes = write(directory, index, *rest, **kwargs)
    if index == 2:
      shutil.rmtree(os.path.join(str(directory), "archive_00002"))
    return nbytes

  monkeypatch.setattr(_checkpoint, "write_archive", lost_on_rank_2)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    with pytest.raises(jr.ArchiveError, match=r"archives \['archive_00002'\] were not written"):
      manager.save(1, args=jr.ReshardSave(records))
      manager.wait_until_finished()
    assert manager.all_steps() == []


def test_a_save_that_will_be_refused_is_refused_before_orbax_makes_a_directory(tmp_path):
  """Every refusal comes from making the ``ReshardSave``: no step, no temporary directory."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from tests import _mp_util as U

  opt, params, state, _ = U.example(seed=5)
  mesh = device_mesh((4,), ("fsdp",))
  src = jr.shard_to_mesh(opt, params, state, mesh)
  other = optax.sgd(0.1, momentum=0.9)  # a state of another optimizer
  grown = dict(params, tiny=jnp.zeros(7, np.float32))  # params that disagree with the state
  two = adam_records(2)
  # Rank 1 with every history buffer one element short of its flat layout.
  short = jr.ShardRecord(
    two[1].version,
    two[1].placements,
    jax.tree.map(lambda x: x[:-1] if np.ndim(x) == 1 and np.size(x) > 1 else x, two[1].state),
    two[1].roles,
  )
  bad = {
    "another optimizer's state": lambda: jr.ReshardSave(
      state=other.init(params), optimizer=opt, params=params, mesh=mesh
    ),
    "params of other shapes": lambda: jr.ReshardSave(
      state=src.state, optimizer=opt, params=grown, mesh=mesh
    ),
    "a state not on the mesh": lambda: jr.ReshardSave(
      state=state, optimizer=opt, params=params, mesh=mesh
    ),
    "a record that does not fit its layout": lambda: jr.ReshardSave([two[0], short]),
    "not a record": lambda: jr.ReshardSave([two[0], {"mu": 1}]),
    "no records": lambda: jr.ReshardSave(iter(())),
  }
  run = tmp_path / "run"
  with ocp.CheckpointManager(run) as manager:
    manager.save(1, args=jr.ReshardSave(two))
    manager.wait_until_finished()
    for step, (name, make) in enumerate(bad.items(), start=2):
      with pytest.raises(jr.ReshardError):
        manager.save(step, args=make())
      manager.wait_until_finished()
      assert sorted(os.listdir(run)) == ["1"], name
    assert manager.all_steps() == [1]


def test_an_item_directory_that_is_a_symlink_is_refused(tmp_path):
  """A step whose jaxreshard item is a link to a valid checkpoint elsewhere: never read."""
  elsewhere = tmp_path / "elsewhere"
  jr.save_records(elsewhere, adam_records(3, seed=1))
  run = tmp_path / "run"
  with ocp.CheckpointManager(run) as manager:
    manager.save(1, args=jr.ReshardSave(adam_records(2)))
    manager.wait_until_finished()
  item = run / "1" / "default"
  os.rename(item, tmp_path / "moved")
  os.symlink(elsewhere, item)
  with ocp.CheckpointManager(run) as manager:
    assert manager.all_steps() == [1]
    for args in (
      jr.ReshardRestore(),
      jr.ReshardRestore(world_size=2, rank=0),
      jr.ReshardRestore(mesh=device_mesh((2,), ("fsdp",))),
    ):
      with pytest.raises(jr.ArchiveError, match=f"{item}.*symbolic link"):
        manager.restore(1, args=args)
    with pytest.raises(jr.ArchiveError, match="symbolic link"):
      manager.item_metadata(1)


@pytest.mark.parametrize("meanwhile", ["made_archive", "removed_directory"])
def test_the_loser_of_two_saves_into_one_directory_gets_a_reshard_error(
  tmp_path, monkeypatch, meanwhile
):
  """Another save of the same step got into orbax's temporary item directory first.

  Orbax names the temporary directory after the final one, so two saves of
  one step share it. Right before this save's first archive, the other save
  has made that archive's directory (or has made the item directory anew,
  removing this save's): the loser's error is an ``ArchiveExistsError`` (an
  ``ArchiveError``), never a bare ``FileExistsError`` or ``FileNotFoundError``.
  """
  import shutil

  from jaxreshard._src.checkpoint import reader as _checkpoint

  write = _checkpoint.write_archive

  def other_save_first(directory, index, *rest):
    if index == 0:
      if meanwhile == "made_archive":
        os.mkdir(os.path.join(directory, "archive_00000"))
      else:
        shutil.rmtree(directory)
    return write(directory, index, *rest)

  monkeypatch.setattr(_checkpoint, "write_archive", other_save_first)
  expected = (jr.ArchiveExistsError, "archive_00000 already exists: another save is writing")
  if meanwhile == "removed_directory":
    expected = (jr.ArchiveError, "was removed while this save wrote it")
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(adam_records(3)))
    with pytest.raises(expected[0], match=expected[1]):
      manager.wait_until_finished()
    assert manager.all_steps() == []


def test_an_async_save_is_a_snapshot_of_numpy_records_taken_when_save_returns(
  tmp_path, monkeypatch
):
  """Records of writable numpy arrays (what ``reshard`` and ``load_records`` give)
  changed in place right after ``save`` returns, before any archive is written:
  the step holds the bits of the moment of ``save``, clock included, and loads.
  (Taken by reference, the histories were the changed ones and a changed clock
  made a step the manager lists but that does not load: its index and its
  archives disagreed on the clock.)"""
  import threading

  import jax
  import numpy as np

  from jaxreshard._src.checkpoint import reader as _checkpoint

  records = [
    jr.ShardRecord(r.version, r.placements, jax.tree.map(np.array, r.state), r.roles)
    for r in adam_records(3)
  ]
  saved = jax.tree.map(np.copy, records)
  gate, write = threading.Event(), _checkpoint.write_archive
  monkeypatch.setattr(_checkpoint, "write_archive", lambda *a: write(*a) if gate.wait(60) else None)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=jr.ReshardSave(records))
    assert manager.is_saving_in_progress()
    for r in records:
      r.state[0].count[...] += 7
      for leaf in jax.tree.leaves(r.state[0].mu):
        leaf[...] = np.float32(12345.0)
    gate.set()
    manager.wait_until_finished()
    assert manager.all_steps() == [1]
    got = manager.restore(1, args=jr.ReshardRestore())
  for a, b in zip(got, saved, strict=True):
    assert_records_equal(a, b)


# A CheckpointManager save of a mesh state with -0.0 in rank 1's padding, refused,
# in a process that then ends. Orbax removes what an earlier save of the step left
# in its temporary directory (here 5,000 files) in its directory-creation thread,
# which is still at it when the refusal comes.
_PADDING_REFUSED_THEN_EXIT = """
import os, sys
import jax, jax.numpy as jnp, numpy as np, optax, orbax.checkpoint as ocp
import jaxreshard as jr

run = os.path.join(sys.argv[1], "run")
left = os.path.join(run, "1.orbax-checkpoint-tmp")
for d in range(50):
  os.makedirs(os.path.join(left, str(d)))
  for f in range(100):
    open(os.path.join(left, str(d), str(f)), "w").close()
params, opt = {"w": jnp.arange(5.0)}, optax.sgd(0.1, momentum=0.9)
mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
state = jr.shard_to_mesh(opt, params, opt.init(params), mesh).state
trace = np.zeros(6, np.float32)
trace[5] = -0.0  # rank 1's padding slot: a sign bit is not zero bits
trace = jax.device_put(trace, state[0].trace["w"].sharding)
state = (state[0]._replace(trace={"w": trace}),) + state[1:]
args = jr.ReshardSave(state=state, optimizer=opt, shapes={"w": (5,)}, mesh=mesh)
if sys.argv[2] == "composite":
  manager = ocp.CheckpointManager(run, item_names=("meta", "opt_state"))
  args = ocp.args.Composite(meta=ocp.args.JsonSave({"lr": 0.1}), opt_state=args)
else:
  manager = ocp.CheckpointManager(run)
try:
  manager.save(1, args=args)
except jr.PlacementError as e:
  print("refused:", e, flush=True)
"""

# How long the process may take to end once its save was refused; orbax's threads
# that hold it wait for its coordination timeout (300 s).
_EXIT_S = 20.0


@pytest.mark.parametrize("mode", ["one_item", "composite"])
def test_a_process_whose_manager_save_was_refused_for_its_padding_exits(tmp_path, mode):
  """The refusal (raised by ``manager.save`` once the host copies show the padding, of
  the save alone or of one item of a ``Composite``) returns after orbax's creation of
  the step's directories is done, so the process ends at once: a creation still
  running at the exit could no longer touch a file and never told its signal, and
  the thread waiting for it would hold the exit."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=2",
    JAX_PLATFORMS="cpu",
    PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
  )
  child = subprocess.Popen(
    [sys.executable, "-c", _PADDING_REFUSED_THEN_EXIT, str(tmp_path), mode],
    env=env,
    cwd=root,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
  )
  try:
    said = child.stdout.readline()
    refused = time.monotonic()
    try:
      child.wait(_EXIT_S)
    except subprocess.TimeoutExpired:
      pass
    took = time.monotonic() - refused
  finally:
    child.kill()
    child.wait()
    child.stdout.close()
  assert said.startswith("refused:") and "padding is not zero" in said, said
  assert child.returncode == 0, f"the process was still running {took:.0f} s after the refusal"
  assert took < _EXIT_S
