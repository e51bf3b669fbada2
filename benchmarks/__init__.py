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
  "scale",
  "plan",
  "step",
)
# Run by ``python -m benchmarks --device`` (on the accelerator, or XLA:CPU as a smoke test).
DEVICE_BENCHMARKS = ("device",)
