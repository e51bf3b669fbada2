"""The suite's options: one frozen dataclass, a full and a quick preset."""

from __future__ import annotations

import dataclasses

_M = 2**20


@dataclasses.dataclass(frozen=True)
class Options:
  """What every benchmark runs at.

  Sizes count elements of optimizer *history* (Adam ``mu`` + ``nu``, float32),
  i.e. the bytes a reshard copies are ``4 * size``.

  Attributes:
    quick: smoke run (tiny sizes, one repeat); figures mean nothing.
    sizes: history sizes for the in-memory sweep (benchmark 1).
    n_params: parameters of the Adam workload (lognormal sizes).
    src_world: source world size (8 in every benchmark but ``scale``).
    dst_world: target world size.
    repeats: warm repeats per measurement; the best is reported.
    param_counts: parameter counts of the cold/warm benchmark (host executor).
    device_param_counts: parameter counts run on the device executor (forced on the CPU
      backend) to count its compiled programs.
    compile_size: fixed history size of the compile benchmark.
    compile_ranks: target ranks resharded per cold/warm pass in (2).
    disk_size: history size of the restore, CLI and RSS benchmarks (3, 4, 5).
    scale_worlds: ``(source, target)`` world sizes of the scale benchmark (6).
    scale_size: history size of the scale benchmark.
    scale_params: parameters of the scale benchmark.
    cli_scale_worlds: ``(source, target)`` world sizes of the CLI's time per byte, in
      one process (benchmark 4), the first the base of the others.
    cli_scale_size: history size of those conversions (the same at every world size).
    plan_params: parameters of the planning-from-disk measurement.
    plan_worlds: (source, target) world sizes of the planning measurement.
    plan_size: history elements of the planning checkpoint (the model's, over every rank).
    save_states: (parameters, history elements) of each save measurement.
    reload_params, reload_world, reload_size, reload_parts: the whole-checkpoint
      bookkeeping benchmark: params, ranks and history elements of its checkpoint, and
      the one-rank parts it merges.
    durable_states: (parameters, history elements) of each durable-save measurement.
    durable_rounds: interleaved rounds per side of the durable-save benchmark (median).
    durable_dir: directory (disk) the durable-save benchmark writes in; '' for the
      system's temporary directory.
    step_layers: layers (6 params each) of the optimizer-step benchmark.
    step_width: width of those layers (a layer holds ``8 * width**2 + 7 * width`` elements).
    step_rounds: interleaved timed steps per side of the optimizer-step benchmark.
    device_size: history size of the device benchmark (``--device``).
    coldstart_params: parameters (of distinct shapes) of the first-call benchmark.
    seed: workload seed.
  """

  quick: bool = False
  sizes: tuple[int, ...] = (32 * _M, 128 * _M)
  n_params: int = 200
  src_world: int = 8
  dst_world: int = 6
  repeats: int = 3
  param_counts: tuple[int, ...] = (10, 100, 1000, 10_000, 100_000)
  device_param_counts: tuple[int, ...] = (10, 100, 1000, 10_000)
  compile_size: int = 32 * _M
  compile_ranks: int = 1
  disk_size: int = 64 * _M
  scale_worlds: tuple[tuple[int, int], ...] = ((8, 6), (256, 192), (4096, 3072))
  scale_size: int = 32 * _M
  scale_params: int = 1000
  cli_scale_worlds: tuple[tuple[int, int], ...] = ((8, 6), (256, 192))
  cli_scale_size: int = 8 * _M
  plan_params: int = 10_000
  plan_worlds: tuple[int, int] = (4096, 3072)
  plan_size: int = 4096 * 2 * _M  # 8 MiB of history per source rank; only those read are written
  save_states: tuple[tuple[int, int], ...] = ((200, 2 * _M), (148, 2_200_000))
  durable_states: tuple[tuple[int, int], ...] = ((200, 2 * _M), (200, 32 * _M))
  durable_rounds: int = 5
  durable_dir: str = ""
  step_layers: int = 10
  step_width: int = 224
  step_rounds: int = 30
  device_size: int = 32 * _M
  coldstart_params: int = 200
  reload_params: int = 10_000
  reload_world: int = 64
  reload_size: int = 4 * _M
  reload_parts: int = 16
  seed: int = 0

  @classmethod
  def full(cls) -> Options:
    """The real run (< 15 minutes on a 2-core CPU machine)."""
    return cls()

  @classmethod
  def smoke(cls) -> Options:
    """The ``--quick`` run: every code path, tiny sizes."""
    return cls(
      quick=True,
      sizes=(_M // 16, _M // 4),
      n_params=8,
      repeats=1,
      param_counts=(4, 16),
      compile_size=_M // 4,
      disk_size=_M // 4,
      scale_worlds=((8, 6), (32, 24)),
      scale_size=_M // 4,
      scale_params=8,
      cli_scale_worlds=((8, 6), (32, 24)),
      cli_scale_size=_M // 16,
      plan_params=50,
      plan_worlds=(64, 48),
      plan_size=_M // 16,
      save_states=((8, _M // 16),),
      durable_states=((8, _M // 16),),
      durable_rounds=1,
      device_param_counts=(4, 16),
      step_layers=2,
      step_width=16,
      step_rounds=2,
      coldstart_params=8,
      device_size=_M // 16,
      reload_params=20,
      reload_world=4,
      reload_size=_M // 16,
      reload_parts=2,
    )
