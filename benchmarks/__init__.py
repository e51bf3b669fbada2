"""Benchmarks of jaxreshard: speed, memory and scale, side by side with baselines.

Run ``python -m benchmarks`` (full run, writes ``benchmarks/RESULTS.md`` and
``benchmarks/throughput.png``) or ``python -m benchmarks --quick --json`` (a
smoke run). Each ``bench_*`` module measures one thing against its baseline in
the same process and returns rows; ``__main__`` collects and writes them.
"""

BENCHMARKS = (
  "memory",
  "compile",
  "restore",
  "save",
  "durable",
  "cli",
  "rss",
  "plan",
  "step",
  "coldstart",
  "reload",
  # Last: its 4,096-rank row holds ~18 GB of small objects, and the heap they
  # leave behind slows whatever runs after it in the same process.
  "scale",
)
# Run by ``python -m benchmarks --device`` (on the accelerator, or XLA:CPU as a smoke test).
DEVICE_BENCHMARKS = ("device",)
