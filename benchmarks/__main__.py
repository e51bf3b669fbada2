"""``python -m benchmarks [--quick] [--device] [--json] [--only NAME ...] [--out PATH]``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import shlex
import sys
import time
import traceback

from benchmarks import BENCHMARKS, DEVICE_BENCHMARKS
from benchmarks._measure import machine
from benchmarks._options import Options
from benchmarks._report import markdown, plot_throughput

_HERE = os.path.dirname(os.path.abspath(__file__))


def _readme_section(header: str) -> str:
  """The README section starting at ``header`` (to the next ``## ``), or ''."""
  try:
    with open(os.path.join(_HERE, "README.md")) as f:
      text = f.read()
  except OSError:
    return ""
  start = text.find(header)
  if start < 0:
    return ""
  end = text.find("\n## ", start + len(header))
  return text[start : end if end >= 0 else None]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
  parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, one repeat")
  parser.add_argument(
    "--device",
    action="store_true",
    help="device mode: the device executor and mesh restores on the default backend's"
    " devices (an accelerator, or XLA:CPU); writes benchmarks/RESULTS-device.md",
  )
  parser.add_argument("--json", action="store_true", help="print every result as JSON on stdout")
  parser.add_argument(
    "--only",
    action="append",
    choices=BENCHMARKS + DEVICE_BENCHMARKS,
    metavar="NAME",
    help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}",
  )
  parser.add_argument(
    "--out",
    default=None,
    help="RESULTS.md to write (a throughput.png goes next to it); default"
    " benchmarks/RESULTS.md for a full run, nothing for --quick",
  )
  parser.add_argument(
    "--param-counts",
    default=None,
    metavar="N,N,...",
    help="override the compile benchmark's parameter counts, e.g. 10,10000",
  )
  parser.add_argument(
    "--durable-dir",
    default=None,
    metavar="DIR",
    help="directory (disk) the durable benchmark saves and runs dd in;"
    " default: the system's temporary directory",
  )
  parser.add_argument(
    "--rewrite",
    action="store_true",
    help="rewrite --out's markdown and plot from its .json (no measuring),"
    " e.g. after editing the README's analysis",
  )
  args = parser.parse_args(argv)
  opts = Options.smoke() if args.quick else Options.full()
  if args.param_counts:
    opts = dataclasses.replace(
      opts, param_counts=tuple(int(n) for n in args.param_counts.split(","))
    )
  if args.durable_dir:
    opts = dataclasses.replace(opts, durable_dir=os.path.abspath(args.durable_dir))
  out = (
    args.out
    if args.out is not None
    else (
      None
      if args.quick
      else os.path.join(_HERE, "RESULTS-device.md" if args.device else "RESULTS.md")
    )
  )
  log = sys.stderr if args.json else sys.stdout
  if args.rewrite:
    with open(os.path.splitext(out)[0] + ".json") as f:
      doc = json.load(f)
    _write(doc, out, opts.quick, log)
    return 0
  started = datetime.datetime.now(datetime.timezone.utc)
  argv_used = sys.argv[1:] if argv is None else list(argv)
  doc = {
    "started": started.strftime("%Y-%m-%d %H:%M UTC"),
    "quick": opts.quick,
    "command": "python -m benchmarks " + " ".join(shlex.quote(a) for a in argv_used),
    "machine": machine(),
    "results": [],
  }
  t_all = time.perf_counter()
  for name in args.only or (DEVICE_BENCHMARKS if args.device else BENCHMARKS):
    module = importlib.import_module(f"benchmarks.bench_{name}")
    print(f"[benchmarks] {name} ...", file=log, flush=True)
    t0 = time.perf_counter()
    try:
      result = module.run(opts).to_json()
    except Exception:  # noqa: BLE001 - one failing benchmark must not hide the others
      result = {
        "name": name,
        "title": "failed",
        "goal": module.GOAL,
        "met": None,
        "rows": [],
        "notes": "",
        "error": traceback.format_exc(),
      }
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(
      f"[benchmarks] {name}: {result['elapsed_s']} s, met={result['met']}", file=log, flush=True
    )
    doc["results"].append(result)
    if out:  # partial results survive a run that is stopped later
      os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
      with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(doc, f, indent=1)
  doc["elapsed_s"] = round(time.perf_counter() - t_all, 1)
  if out:
    _write(doc, out, opts.quick, log)
  if args.json:
    json.dump(doc, sys.stdout, indent=1)
    print()
  return 1 if any(r.get("error") for r in doc["results"]) else 0


def _write(doc: dict, out: str, quick: bool, log) -> None:
  """RESULTS.md and throughput.png for ``doc``."""
  memory = next((r for r in doc["results"] if r["name"] == "memory" and r["rows"]), None)
  if memory:
    png = os.path.join(os.path.dirname(os.path.abspath(out)), "throughput.png")
    plot_throughput(memory["rows"], png, f"8 -> 6 reshard vs copies, {doc['machine']['cpu']}")
    doc["plot"] = os.path.basename(png)
  analysis = "" if quick else _readme_section("## What dominates")
  text = markdown(doc, analysis)
  if doc.get("plot"):
    text = text.replace("## Machine", f"![throughput vs size]({doc['plot']})\n\n## Machine", 1)
  with open(out, "w") as f:
    f.write(text)
  with open(os.path.splitext(out)[0] + ".json", "w") as f:
    json.dump(doc, f, indent=1)
  print(f"[benchmarks] wrote {out}", file=log)


if __name__ == "__main__":
  sys.exit(main())
