"""One process of a multi-process test job (started by ``_mp_util.ProcessGroup``).

Environment: ``MP_COORDINATOR``, ``MP_NUM_PROCESSES``, ``MP_PROCESS_ID``,
``MP_TASK``, ``MP_OUT`` (results directory), ``MP_ARGS`` (JSON), and
``XLA_FLAGS`` with this process's simulated device count. Writes
``<out>/p<i>.json`` (and ``<out>/p<i>.npz`` with device buffers) on success.

Tasks:
  save:      lay the example state out over every device of the job
             (``shard_to_mesh``) and ``save_sharded`` it to ``args.path``;
             then save it as step 1 of an orbax ``CheckpointManager`` at
             ``args.run`` (``Composite``: params and ``ReshardSave(state=...)``),
             deleting the device state as soon as ``save`` returns.
  restore:   ``restore_sharded(args.path)`` onto a (world,) mesh; report the
             bytes this process read and dump every addressable shard; then
             ``gather_from_mesh`` (all processes) and compare with the original.
             With ``args.replicated`` (a mesh shape), also restore onto a
             (data, fsdp) mesh of that shape and ``save_sharded`` it to
             ``args.resave``. With ``args.run``, also restore step 1 of that
             manager (``ReshardRestore(mesh=...)``, params with
             ``StandardRestore``) and dump it to ``<out>/p<i>_manager.npz``.
  fail:      a manager saves step 1, then step 2 with process ``args.fail``
             unable to write its archives (a file size limit, as a full disk);
             reports what each process saw and how long its step 2 took.
  full_disk: ``save_sharded`` of the example state to ``args.path`` with process
             ``args.fail`` unable to write its archives (files held under
             ``args.bytes``);
             reports what each process raised and how soon.
  stall:     an ``AsyncCheckpointer`` of ``ReshardCheckpointHandler(timeout_secs=
             args.timeout_s)`` saves to ``args.path``, process ``args.stall``'s
             archive writes held back until process 0 has reported; reports
             what each process raised and how soon.
  exists_for_one: process 1 makes ``args.path`` (as another job's save that
             committed it; with ``args.make`` false it makes nothing) once
             process 0 is about to ``save_sharded`` there and has looked,
             ``args.delay_s`` later; then both save with
             ``timeout_s=args.timeout_s``. Reports what each process raised and
             how soon.
  background_resave: a manager with orbax's background deletion saves step 1,
             deletes it and saves it again (process 0's deleter ``args.slow_s``
             slow); reports the second save's outcome and the run's listing.
  scripted:  the saves ``args.saves`` in order, each a dict: ``path``, ``timeout_s``
             (or a dict of one per process), and per process (keys are process numbers as strings) ``sleep``
             (seconds before the call), ``mkdir`` (a directory made before the
             call) and ``bad`` (``progress``, ``shapes``, ``axis``: a bad argument;
             ``padding``, ``clock``: state data only this process refuses; ``deleted``:
             a state whose buffer was deleted; ``probe``: looking for a live save of
             the directory fails with an ``OSError``), and ``skip`` (this process does
             not make this save), ``paths`` (this process's spelling of ``path``).
             Reports what each save raised and how soon (None for a save skipped).
  padding_share: ``restore_sharded(path, target=...)`` of each of ``args.paths``
             (Adam over params of ``args.counts`` elements) onto every device,
             replicated; report which restores this process refused, and why.
  restore_target: ``restore_sharded(args.path, target=...)`` of
             ``_target_util.big_example``'s checkpoint, rows sharded over a
             mesh of 4 devices of which process 0 has one (so it holds one
             device's share) and then over all 8 devices; report each
             restore's bytes read and whether every local piece is exact.
"""

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.distributed.initialize(
  coordinator_address=os.environ["MP_COORDINATOR"],
  num_processes=int(os.environ["MP_NUM_PROCESSES"]),
  process_id=int(os.environ["MP_PROCESS_ID"]),
  initialization_timeout=60,
  heartbeat_timeout_seconds=10,
  shutdown_timeout_seconds=20,
)

import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jaxreshard as jr  # noqa: E402
from jaxreshard._src.distributed.mesh import mesh_ranks  # noqa: E402
from tests import _mp_util as U  # noqa: E402
from tests._core_util import bits, rchar  # noqa: E402

ME = jax.process_index()
OUT = os.environ["MP_OUT"]
ARGS = json.loads(os.environ["MP_ARGS"])


def mesh() -> Mesh:
  return Mesh(np.array(jax.devices()), ("fsdp",))


def save(opt, params, state, shapes) -> dict:
  m = mesh()
  sharded = jr.shard_to_mesh(opt, params, state, m, trainable=U.trainable())
  spec = {p.param: p for p in next(iter(sharded.placements.values()))}
  jr.save_sharded(
    ARGS["path"],
    opt,
    sharded.state,
    spec,
    m,
    timeout_s=60,
    chunk_bytes=ARGS.get("chunk_bytes", 1 << 20),
  )
  result = {"ranks": sorted(sharded.placements)}
  if ARGS.get("run"):
    result.update(manager_save(opt, sharded.state, spec, m))
  return result


def replicated_params(m: Mesh):
  """The example params with random bits, replicated over ``m``."""
  host = U.example_params(seed=ARGS.get("seed", 0))
  return jax.device_put(host, jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec()))


def manager_save(opt, state, spec, m) -> dict:
  """Step 1 of a manager: params and the sharded state, saved asynchronously.

  The archive writes wait for a gate this thread opens only after ``save``
  returned: a ``save`` that waited for its writes would never return.
  """
  from jaxreshard._src.checkpoint import reader as _checkpoint  # pylint: disable=g-import-not-at-top

  params = replicated_params(m)
  gate, write = threading.Event(), _checkpoint.write_archive

  def gated(*a, **k):
    if not gate.wait(60):
      raise TimeoutError("the gate never opened: save waited for its own writes")
    return write(*a, **k)

  _checkpoint.write_archive = gated
  try:
    with ocp.CheckpointManager(ARGS["run"], item_names=("params", "opt_state")) as manager:
      manager.save(
        1,
        args=ocp.args.Composite(
          params=ocp.args.StandardSave(params),
          opt_state=jr.ReshardSave(
            state=state, optimizer=opt, shapes=spec, mesh=m, axis="fsdp", chunk_bytes=4096
          ),
        ),
      )
      result = {
        "in_progress_after_save": manager.is_saving_in_progress(),
        "committed_after_save": os.path.exists(os.path.join(ARGS["run"], "1")),
      }
      # save returned with host copies taken: the device buffers may go now.
      for leaf in jax.tree.leaves(state):
        leaf.delete()
      gate.set()
      manager.wait_until_finished()
      return {**result, "steps": manager.all_steps()}
  finally:
    _checkpoint.write_archive = write


def restore(opt, params, state, shapes) -> dict:
  m = mesh()
  # Warm-up on a tiny private checkpoint, onto this process's own devices (two
  # processes' saves are never restored onto one mesh): imports and first-call work
  # are then not counted as bytes read for the real restore.
  tiny, tiny_opt = {"w": jax.numpy.arange(3.0)}, optax.adam(1e-3)
  warm = os.path.join(OUT, f"warm_p{ME}")
  jr.save_records(warm, jr.shard_state(tiny_opt, tiny, tiny_opt.init(tiny), 2))
  jr.restore_sharded(warm, Mesh(np.array(jax.local_devices()), ("fsdp",)))

  before = rchar()
  out = jr.restore_sharded(ARGS["path"], m)
  jax.block_until_ready(out.state)
  read = rchar() - before

  dump = {}
  for i, leaf in enumerate(jax.tree.leaves(out.state)):
    for shard in leaf.addressable_shards:
      dump[f"{i}:{shard.device.id}"] = bits(shard.data)
  np.savez(os.path.join(OUT, f"p{ME}.npz"), **dump)
  rank_of = {d.id: r for r, ds in mesh_ranks(m).items() for d in ds}

  spec = {p.param: p for p in out.placements[min(out.placements)]}
  gathered = jr.gather_from_mesh(opt, out.state, spec, m)
  same = all(
    np.array_equal(bits(a), bits(b))
    for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(state))
  )
  same = same and jax.tree.structure(gathered) == jax.tree.structure(state)
  result = {}
  if ARGS.get("replicated"):
    result["replicated"] = restore_replicated(opt)
  if ARGS.get("run"):
    result["manager"] = manager_restore(m)
  return {
    **result,
    "ranks": sorted(out.placements),
    "rank_of": rank_of,
    "bytes_read": read,
    "gather_equals_original": bool(same),
    "placements": {
      str(r): [
        [p.param, list(p.shape), p.rank, p.world_size, np.dtype(p.dtype).name, p.trainable]
        for p in ps
      ]
      for r, ps in out.placements.items()
    },
  }


def restore_replicated(opt) -> dict:
  """A (data x fsdp) mesh whose fsdp ranks are replicated across processes: restore, save."""
  m = Mesh(np.array(jax.devices()).reshape(ARGS["replicated"]), ("data", "fsdp"))
  out = jr.restore_sharded(ARGS["path"], m, "fsdp")
  dump = {}
  for i, leaf in enumerate(jax.tree.leaves(out.state)):
    for shard in leaf.addressable_shards:
      dump[f"{i}:{shard.device.id}"] = bits(shard.data)
  np.savez(os.path.join(OUT, f"p{ME}_rep.npz"), **dump)
  spec = {p.param: p for p in out.placements[min(out.placements)]}
  jr.save_sharded(ARGS["resave"], opt, out.state, spec, m, "fsdp", timeout_s=60)
  from jaxreshard._src.distributed import mesh as _mesh  # pylint: disable=g-import-not-at-top

  return {
    "ranks": sorted(out.placements),
    "written": _mesh.writer_ranks(m, "fsdp"),
    "rank_of": {d.id: r for r, ds in mesh_ranks(m, "fsdp").items() for d in ds},
  }


def manager_restore(m: Mesh) -> dict:
  """Step 1 of the manager onto this job's mesh: the optax state and the params."""
  want = U.example_params(seed=ARGS.get("seed", 0))
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec())
    ),
    want,
  )
  with ocp.CheckpointManager(ARGS["run"], item_names=("params", "opt_state")) as manager:
    out = manager.restore(
      1,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract), opt_state=jr.ReshardRestore(mesh=m, axis="fsdp")
      ),
    )
  dump = {}
  for i, leaf in enumerate(jax.tree.leaves(out.opt_state)):
    assert leaf.sharding.mesh.shape == m.shape, leaf.sharding
    for shard in leaf.addressable_shards:
      dump[f"{i}:{shard.device.id}"] = bits(shard.data)
  np.savez(os.path.join(OUT, f"p{ME}_manager.npz"), **dump)
  params_equal = all(
    np.array_equal(bits(a.addressable_data(0)), bits(b))
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(want), strict=True)
  )
  return {
    "params_equal": bool(params_equal),
    "structure_equal": jax.tree.structure(out.params) == jax.tree.structure(want),
  }


def fail(opt, params, state, shapes) -> dict:
  """Step 1 saved; step 2 with one process's disk full. Reports what each saw.

  The failing process's files may not grow past 1 KiB (``RLIMIT_FSIZE``): its
  archive writes fail for real, as on a full disk, and nothing else changes.
  """
  import resource  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top

  manager, args = _saved_step_1(opt, params, state)
  if ME == ARGS["fail"]:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
  result = {"steps_before": manager.all_steps()}
  result.update(_save_step_2(manager, args))
  # The job is broken now: report and leave without the shutdown barrier.
  write_result({"task": "fail", "process": ME, **result})
  leave_broken_job()


def full_disk(opt, params, state, shapes) -> dict:
  """``save_sharded`` with one process's files held under ``args.bytes`` (``RLIMIT_FSIZE``):
  its writes fail for real, as on a full disk, and its cleanup removes the
  directory the other processes write in."""
  import resource  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top

  m = mesh()
  sharded = jr.shard_to_mesh(opt, params, state, m, trainable=U.trainable())
  spec = {p.param: p for p in next(iter(sharded.placements.values()))}
  if ME == ARGS["fail"]:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (ARGS["bytes"], resource.RLIM_INFINITY))

  def save():
    try:
      jr.save_sharded(ARGS["path"], opt, sharded.state, spec, m, timeout_s=600)
    finally:  # the report itself is a file
      resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

  report_save("full_disk", save)


def _saved_step_1(opt, params, state, **options) -> tuple:
  """A manager of ``args.run`` (``options`` added to its options) that saved step 1 of
  the state laid out on this job's mesh, and a maker of that save's arguments."""
  m = mesh()
  sharded = jr.shard_to_mesh(opt, params, state, m, trainable=U.trainable())
  spec = {p.param: p for p in next(iter(sharded.placements.values()))}
  options = ocp.CheckpointManagerOptions(
    async_options=ocp.AsyncOptions(timeout_secs=ARGS.get("timeout_s", 30)), **options
  )
  manager = ocp.CheckpointManager(ARGS["run"], options=options)
  args = lambda: jr.ReshardSave(state=sharded.state, optimizer=opt, shapes=spec, mesh=m)
  manager.save(1, args=args())
  manager.wait_until_finished()
  return manager, args


def _save_step_2(manager, args) -> dict:
  """Step 2's save, waited for: its error (None once committed) and its seconds."""
  result = {}
  start = time.monotonic()
  try:
    manager.save(2, args=args())
    manager.wait_until_finished()
    result["error"] = None
  except Exception as e:  # pylint: disable=broad-exception-caught
    result["error"] = f"{type(e).__name__}: {e}"[:500]
    result["error_type"] = type(e).__name__
  result["seconds"] = time.monotonic() - start
  return result


def killed(opt, params, state, shapes) -> dict:
  """Step 1 saved; in step 2's save process ``args.killed`` dies (``os._exit(137)``, as
  a SIGKILL: no cleanup, nothing told) once it has written its first archive
  (``args.at`` "archive"), or once it has told the others that its archives are
  written (``args.at`` "told"). Reports what the others saw and how soon."""
  from jaxreshard._src.checkpoint import reader as _checkpoint  # pylint: disable=g-import-not-at-top
  from jaxreshard._src.orbax import peers as _peers  # pylint: disable=g-import-not-at-top

  manager, args = _saved_step_1(
    opt, params, state, temporary_path_class=jr.DurableRenameTemporaryPath
  )
  result = {"steps_before": manager.all_steps()}
  if ME == ARGS["killed"]:
    name = "write_archive" if ARGS["at"] == "archive" else "tell_peers"
    module = _checkpoint if ARGS["at"] == "archive" else _peers
    real = getattr(module, name)

    def dying(*a, **k):
      real(*a, **k)
      write_result({"task": "killed", "process": ME, "killed": True, **result})
      os._exit(137)

    setattr(module, name, dying)
  result.update(_save_step_2(manager, args))
  write_result({"task": "killed", "process": ME, **result})
  leave_broken_job()


DATA = ("padding", "clock", "deleted")


def _refused_state(opt, params, state, shapes, sharded_state, m, kind):
  """``sharded_state`` with data only this process refuses: nonzero bits in the padding
  of its shards (``kind`` "padding"), its clock one step ahead ("clock"), or a history
  leaf whose buffers (copies) are deleted ("deleted")."""
  import math  # pylint: disable=g-import-not-at-top

  from jaxreshard._src.core import structure  # pylint: disable=g-import-not-at-top

  leaves, treedef = jax.tree_util.tree_flatten(sharded_state)
  roles = structure.history_roles(opt, params, state)
  world = m.devices.size
  for i, (leaf, pid) in enumerate(zip(leaves, roles)):
    if kind == "deleted":
      if pid is None:
        continue
      value = lambda s: s.data * 1  # noqa: E731
    elif kind == "clock":
      if pid is not None or not np.issubdtype(leaf.dtype, np.integer):
        continue
      value = lambda s: s.data + 1  # noqa: E731
    else:
      if pid is None:
        continue
      slots = jr.FlatShard(shapes[pid], 0, world).slots
      padded = [
        s
        for s in leaf.addressable_shards
        if jr.FlatShard(shapes[pid], s.index[0].start // slots, world).owned < slots
      ]
      if not padded or math.prod(shapes[pid]) == 0:
        continue
      value = lambda s: s.data.at[-1].set(1) if s in padded else s.data  # noqa: E731
    pieces = [jax.device_put(value(s), s.device) for s in leaf.addressable_shards]
    leaves[i] = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, pieces)
    if kind == "deleted":
      leaves[i].delete()
    break
  return jax.tree_util.tree_unflatten(treedef, leaves)


def refused(opt, params, state, shapes) -> dict:
  """A save_sharded that one process's own data refuses: nonzero bits in the padding of
  its shards (``kind`` "padding"), one param's dtype as another in its placements
  ("layout": the index it would make differs), or its clock one step ahead ("clock"; "clock_replica":
  on a 2-D mesh whose "data" axis spans the processes, so that the primary writes every
  archive and the other process none), or that mesh with its rows swapped ("mesh"); or that every process refuses: a clock leaf laid
  out over the devices of both ("split_clock"). Reports what each process raised and
  how soon; a process left waiting would hit the group's time limit, long before the
  save's 600 s timeout.
  """
  from jaxreshard._src.core import structure  # pylint: disable=g-import-not-at-top

  m = mesh()
  if ARGS["kind"] in ("clock_replica", "mesh"):  # a row of the mesh per process
    m = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("data", "fsdp"))
  sharded = jr.shard_to_mesh(opt, params, state, m, "fsdp", trainable=U.trainable())
  spec = {p.param: p for p in next(iter(sharded.placements.values()))}
  leaves, treedef = jax.tree_util.tree_flatten(sharded.state)
  roles = structure.history_roles(opt, params, state)
  if ARGS["kind"] == "split_clock":
    # Every process lays the step count out over the whole mesh, as a step's
    # out_shardings may: a (world,) clock leaf, each process holding its part.
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

    i = next(i for i, pid in enumerate(roles) if pid is None)
    world = m.devices.size
    whole = np.arange(world, dtype=np.int32)
    leaves[i] = jax.make_array_from_callback(
      (world,), NamedSharding(m, PartitionSpec("fsdp")), lambda index: whole[index]
    )
  elif ARGS["kind"] == "layout":
    if ME == ARGS["fail"]:  # one param's dtype as another: an index of another layout
      pid = sorted(spec)[0]
      spec[pid] = dataclasses.replace(spec[pid], dtype=np.dtype("float16"))
  elif ME == ARGS["fail"] and ARGS["kind"] != "mesh":
    kind = "clock" if ARGS["kind"] == "clock_replica" else ARGS["kind"]
    leaves = jax.tree_util.tree_leaves(
      _refused_state(opt, params, state, shapes, sharded.state, m, kind)
    )
  changed = jax.tree_util.tree_unflatten(treedef, leaves)
  given = m
  if ARGS["kind"] == "mesh" and ME == ARGS["fail"]:  # its rows swapped: it writes every rank
    given = Mesh(m.devices[::-1], m.axis_names)
  report_save(
    "refused",
    lambda: jr.save_sharded(ARGS["path"], opt, changed, spec, given, axis="fsdp", timeout_s=600),
  )


def stall(opt, params, state, shapes) -> dict:
  """A save whose process ``args.stall`` never finishes writing within the handler's
  ``timeout_secs`` (orbax's own timeout is longer): its archive writes wait until
  process 0 has reported (a minute at most), then fail. Reports what each process
  raised and how soon.
  """
  from jaxreshard._src.checkpoint import reader as _checkpoint  # pylint: disable=g-import-not-at-top

  m = mesh()
  sharded = jr.shard_to_mesh(opt, params, state, m, trainable=U.trainable())
  spec = {p.param: p for p in next(iter(sharded.placements.values()))}
  if ME == ARGS["stall"]:
    primary_done = os.path.join(OUT, "p0.json")

    def held(*a, **k):
      deadline = time.monotonic() + 60
      while not os.path.exists(primary_done) and time.monotonic() < deadline:
        time.sleep(0.05)
      raise OSError("held back until the primary reported")

    _checkpoint.write_archive = held

  def save():
    handler = jr.ReshardCheckpointHandler(timeout_secs=ARGS["timeout_s"])
    with ocp.AsyncCheckpointer(handler, timeout_secs=60) as checkpointer:
      args = jr.ReshardSave(state=sharded.state, optimizer=opt, shapes=spec, mesh=m)
      checkpointer.save(ARGS["path"], args=args)
      checkpointer.wait_until_finished()

  report_save("stall", save)


def exists_for_one(opt, params, state, shapes) -> dict:
  m = mesh()
  sharded = jr.shard_to_mesh(opt, params, state, m, trainable=U.trainable())
  spec = {p.param: p for p in next(iter(sharded.placements.values()))}
  looking = os.path.join(OUT, "p0_looking")
  if ME == 0:
    open(looking, "w").close()  # its save looks at once, before anything is written
  else:
    deadline = time.monotonic() + 60
    while not os.path.exists(looking) and time.monotonic() < deadline:
      time.sleep(0.01)
    time.sleep(ARGS["delay_s"])
    if ARGS.get("make", True):
      os.mkdir(ARGS["path"])
  report_save(
    "exists_for_one",
    lambda: jr.save_sharded(ARGS["path"], opt, sharded.state, spec, m, timeout_s=ARGS["timeout_s"]),
  )


def background_resave(opt, params, state, shapes) -> dict:
  """A manager with orbax's background deletion saves step 1, deletes it and saves
  it again; process 0 (orbax's primary, whose deleter alone removes steps) takes
  ``args.slow_s`` to remove a step. Reports what the second save raised, how long
  it took, and the run directory's listing."""
  from orbax.checkpoint._src.path import deleter as deleter_lib  # pylint: disable=g-import-not-at-top

  if ME == 0 and ARGS.get("slow_s"):
    remove = deleter_lib.PathDeleter.delete

    def slow(self, path, **kwargs):
      time.sleep(ARGS["slow_s"])
      return remove(self, path, **kwargs)

    deleter_lib.PathDeleter.delete = slow
  m = mesh()
  sharded = jr.shard_to_mesh(opt, params, state, m, trainable=U.trainable())
  spec = {p.param: p for p in next(iter(sharded.placements.values()))}
  options = ocp.CheckpointManagerOptions(
    temporary_path_class=jr.DurableRenameTemporaryPath, enable_background_delete=True
  )
  manager = ocp.CheckpointManager(ARGS["run"], options=options)
  save = lambda: jr.ReshardSave(state=sharded.state, optimizer=opt, shapes=spec, mesh=m)  # noqa: E731
  manager.save(1, args=save())
  manager.wait_until_finished()
  manager.delete(1)

  def again():
    manager.save(1, args=save())
    manager.wait_until_finished()

  result = outcome(again)
  manager.close()
  result["listing"] = sorted(os.listdir(ARGS["run"]))
  from jaxreshard._src.orbax import deletes  # pylint: disable=g-import-not-at-top

  result["left_to_wait_for"] = len(deletes._PENDING) + len(deletes._ELSEWHERE)
  return result


def scripted(opt, params, state, shapes) -> dict:
  m = mesh()
  sharded = jr.shard_to_mesh(opt, params, state, m, trainable=U.trainable())
  spec = {p.param: p for p in next(iter(sharded.placements.values()))}
  saves = []
  for step in ARGS["saves"]:
    me = str(ME)
    if me in step.get("skip", {}):
      saves.append(None)
      continue
    time.sleep(step.get("sleep", {}).get(me, 0))
    if me in step.get("mkdir", {}):
      os.makedirs(step["mkdir"][me])
    bad = step.get("bad", {}).get(me)
    timeout_s = step["timeout_s"]
    kwargs = {"timeout_s": timeout_s[me] if isinstance(timeout_s, dict) else timeout_s}
    if bad == "progress":
      kwargs["progress"] = 42
    if bad == "axis":
      kwargs["axis"] = 3
    got = {k: (3,) for k in spec} if bad == "shapes" else spec
    data = (
      _refused_state(opt, params, state, shapes, sharded.state, m, bad)
      if bad in DATA
      else sharded.state
    )
    path = step.get("paths", {}).get(me, step["path"])
    with _failing_probe(bad == "probe"):
      saves.append(outcome(lambda: jr.save_sharded(path, opt, data, got, m, **kwargs)))  # noqa: B023
  write_result({"task": "scripted", "process": ME, "saves": saves})
  leave_broken_job()


def records_saves(opt, params, state, shapes) -> dict:
  """Saves of records through a manager, one step per entry of ``saves``: each process
  passes every rank's records, process ``process`` (per step; none where absent) with
  the first element of rank 0's first history buffer one bit off ("bits"), or every
  record's integer clock one step ahead ("clock"). Reports each save's outcome
  (``wait_until_finished`` included) and the steps the manager lists."""
  records = jr.shard_state(opt, params, state, 8, trainable=U.trainable())
  saves = []
  with ocp.CheckpointManager(ARGS["run"]) as manager:
    for step, change in enumerate(ARGS["saves"], start=1):
      mine = list(records)
      if change.get("process") == ME:
        for rank, r in enumerate(mine):
          leaves, treedef = jax.tree_util.tree_flatten(r.state)
          for i, x in enumerate(leaves):
            if change["kind"] == "bits" and rank == 0 and np.ndim(x) and np.size(x):
              x = np.array(x)
              x.reshape(-1).view(np.uint8)[0] ^= 1
              leaves[i] = x
              break
            if change["kind"] == "clock" and not np.ndim(x) and np.issubdtype(x.dtype, np.integer):
              leaves[i] = np.asarray(x) + 1
          mine[rank] = dataclasses.replace(r, state=jax.tree_util.tree_unflatten(treedef, leaves))

      def save(step=step, mine=mine):
        manager.save(step, args=ocp.args.Composite(default=jr.ReshardSave(mine)))
        manager.wait_until_finished()

      saves.append(outcome(save))
    steps = list(manager.all_steps())
  write_result({"task": "records_saves", "process": ME, "saves": saves, "steps": steps})
  leave_broken_job()


@contextlib.contextmanager
def _failing_probe(fails: bool):
  """While it lasts (when ``fails``), looking for a live save of a directory raises
  the ``OSError`` a storage that fails to answer would."""
  if not fails:
    yield
    return
  from jaxreshard._src.orbax import durable as _durable  # pylint: disable=g-import-not-at-top

  def probe(tmp: str, final: str) -> None:
    raise OSError(5, "Input/output error", tmp)

  saved = _durable.refuse_if_held
  _durable.refuse_if_held = probe
  try:
    yield
  finally:
    _durable.refuse_if_held = saved


def restore_target(opt, params, state, shapes) -> dict:
  del opt, params, state, shapes  # this task restores its own example
  from jax.sharding import PartitionSpec  # pylint: disable=g-import-not-at-top

  from jaxreshard._src.checkpoint import reader as _checkpoint  # pylint: disable=g-import-not-at-top
  from jaxreshard._src.distributed import target_restore as _target_restore
  from tests import _target_util as T  # pylint: disable=g-import-not-at-top

  opt, params, state = T.big_example()
  devices = jax.devices()  # process 0's first
  mine = [d for d in devices if d.process_index == ME]
  theirs = [d for d in devices if d.process_index != ME]
  meshes = {
    # Process 0 holds one device of four; process 1 the other three.
    "one_of_4": Mesh(np.array(devices[:1] + devices[4:7]), ("x",)),
    "half": Mesh(np.array(devices).reshape(2, 4), ("a", "b")),
  }
  specs = {"one_of_4": PartitionSpec("x"), "half": PartitionSpec(("a", "b"))}
  out = {"local_devices": [d.id for d in mine], "other_devices": [d.id for d in theirs]}
  for name, m in meshes.items():
    target = T.abstract(opt, params, T.spec_or_replicated(m, specs[name]))
    stats = _checkpoint.ReadStats()
    before = rchar()
    restored = _target_restore.restore_to_target(ARGS["path"], target, stats=stats)
    jax.block_until_ready(restored.state)
    out[name] = {
      "bytes_read": stats.bytes,
      "chunks": stats.chunks,
      "rchar": rchar() - before,
      "mismatches": T.shard_mismatches(restored.state, state, target),
      "devices_in_mesh": sum(d.process_index == ME for d in m.devices.flat),
    }
  return out


def restore_two_saves(opt, params, state, shapes) -> dict:
  """Restores onto the whole mesh (both processes' devices), case after case: each
  process the checkpoint its entry of ``paths`` names, flat (``restore_sharded``) or
  onto a replicated ``target``, along ``axis`` (per process; "fsdp" where absent), onto
  the devices of the processes ``mesh_of`` lists (where given, else all; in two rows
  in the processes ``rows`` lists); a
  process without an entry skips the case (the others wait ``timeout_s`` for it,
  and ``grace_s`` more for the first process's verdict). Reports each case's error (or None) and, where none,
  the integer clock restored."""
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  m = mesh()
  from jaxreshard._src.distributed import restore_agreement  # pylint: disable=g-import-not-at-top

  cases = []
  for case in ARGS["cases"]:
    if str(ME) not in case["paths"]:  # this process never comes to this restore
      cases.append({"error": None, "skipped": True})
      continue
    path = case["paths"][str(ME)]
    restore_agreement.TIMEOUT_S = case.get("timeout_s", restore_agreement.TIMEOUT_S)
    restore_agreement._GRACE_S = case.get("grace_s", restore_agreement._GRACE_S)
    axis = case.get("axis", {}).get(str(ME), "fsdp")  # another: refused in this process
    got = {}

    where = m
    if "mesh_of" in case:  # a mesh of these processes' devices
      where = Mesh(
        np.array([d for d in jax.devices() if d.process_index in case["mesh_of"]]), ("fsdp",)
      )
    if str(ME) in case.get("rows", {}):  # the same devices in rows: another mesh
      where = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "fsdp"))
    on = NamedSharding(where, PartitionSpec())
    target = jax.tree.map(
      lambda x, on=on: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=on), state
    )

    if str(ME) in case.get("wrong_dtype", {}):  # its first bfloat16 leaf declared float32
      seen = []

      def wrong(x, seen=seen):
        if x.dtype != jax.numpy.bfloat16 or seen:
          return x
        seen.append(x)
        return jax.ShapeDtypeStruct(x.shape, np.float32, sharding=x.sharding)

      target = jax.tree.map(wrong, target)

    def restore(case=case, path=path, got=got, axis=axis, where=where, target=target):
      target = target if case.get("target") else None
      out = jr.restore_sharded(path, where, axis, target=target)
      leaves = jax.tree.leaves(out.state)
      count = next(x for x in leaves if not np.ndim(x) and np.issubdtype(x.dtype, np.integer))
      got["count"] = int(np.asarray(count.addressable_data(0)))

    cases.append({**outcome(restore), **got})
  return {"cases": cases}


def padding_share(opt, params, state, shapes) -> dict:
  del opt, params, state, shapes  # this task restores the checkpoints it is given
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  from jaxreshard._src.distributed import target_restore as _target_restore
  from tests import _target_util as T  # pylint: disable=g-import-not-at-top

  opt = optax.adam(1e-3)
  params = {k: np.zeros(n, np.float32) for k, n in ARGS["counts"].items()}
  replicated = NamedSharding(mesh(), PartitionSpec())
  target = T.abstract(opt, params, lambda path, x: replicated)
  refused = []
  for path in ARGS["paths"]:
    try:
      restored = _target_restore.restore_to_target(path, target)
      jax.block_until_ready(restored.state)
      refused.append(None)
    except jr.ReshardError as e:
      refused.append(str(e))
  return {"refused": refused}


def main() -> None:
  task = os.environ["MP_TASK"]
  opt, params, state, shapes = U.example(seed=ARGS.get("seed", 0))
  result = {"task": task, "process": ME, "devices": jax.local_device_count()}
  result.update(globals()[task](opt, params, state, shapes))
  write_result(result)
  jax.distributed.shutdown()


def leave_broken_job(timeout_s: float = 120.0) -> None:
  """Exits without the shutdown barrier; the primary last, after every result.

  The primary hosts the coordination service: were it to exit first, the runtime
  would abort a peer still handling its own error before it could report.
  """
  if ME == 0:
    paths = [os.path.join(OUT, f"p{i}.json") for i in range(1, jax.process_count())]
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
      time.sleep(0.01)
    # Then until the peers are gone (every process of these jobs runs on this host).
    pids = [json.load(open(p))["pid"] for p in paths if os.path.exists(p)]
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
      time.sleep(0.01)
  os._exit(0)


def _gone(pid: int) -> bool:
  """Whether the process ``pid`` has exited (a zombie not yet reaped counts)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
  except FileNotFoundError:
    return True


def outcome(save) -> dict:
  """Runs ``save()``: what it raised (or None), and how long it took."""
  start = time.monotonic()
  try:
    save()
    result = {"error": None}
  except Exception as e:  # pylint: disable=broad-exception-caught
    result = {"error": f"{type(e).__name__}: {e}"[:800], "error_type": type(e).__name__}
  result["seconds"] = time.monotonic() - start
  return result


def report_save(task: str, save) -> None:
  """Runs ``save()``; reports what it raised (or None) and how long it took; leaves."""
  write_result({"task": task, "process": ME, **outcome(save)})
  leave_broken_job()


def write_result(result: dict) -> None:
  result = {**result, "pid": os.getpid()}
  tmp = os.path.join(OUT, f"p{ME}.json.tmp")
  with open(tmp, "w") as f:
    json.dump(result, f)
  os.rename(tmp, os.path.join(OUT, f"p{ME}.json"))


if __name__ == "__main__":
  main()
  sys.exit(0)
