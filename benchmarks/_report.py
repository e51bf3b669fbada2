"""Writes results: RESULTS.md (machine, command, one table per benchmark) and the plot."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["markdown", "plot_throughput"]

_VERDICT = {True: "**met**", False: "**missed**", None: "no verdict (quick run or skipped)"}


def _cell(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def _table(rows: Sequence[dict]) -> list[str]:
  if not rows:
    return ["(no rows)"]
  keys = list(rows[0])
  for r in rows[1:]:
    keys += [k for k in r if k not in keys]
  lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
  lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
  return lines


def markdown(doc: dict, analysis: str = "") -> str:
  """RESULTS.md text for one run's ``doc`` (``machine``, ``command``, ``results``)."""
  m = doc["machine"]
  out = [
    "# jaxreshard benchmark results",
    "",
    f"Measured {doc['started']} in {doc['elapsed_s']:.0f} s"
    + (" (**--quick: figures mean nothing**)" if doc["quick"] else "")
    + ".",
    "",
    "## Machine",
    "",
  ]
  out += [f"- {k}: {v}" for k, v in m.items()]
  out += ["", "## Command", "", "```", doc["command"], "```", ""]
  out += ["## Goals", "", "| benchmark | goal | verdict |", "|---|---|---|"]
  for r in doc["results"]:
    out.append(f"| {r['name']} | {r['goal']} | {_VERDICT[r['met']]} |")
  out.append("")
  if analysis:
    out += [analysis.strip(), ""]
  for r in doc["results"]:
    out += [
      f"## {r['name']}: {r['title']}",
      "",
      f"Goal: {r['goal']} — {_VERDICT[r['met']]}. Took {r.get('elapsed_s', 0):.0f} s.",
      "",
    ]
    if r.get("error"):
      out += ["```", r["error"], "```", ""]
    out += _table(r["rows"]) + ["", r["notes"], ""]
  return "\n".join(out)


def plot_throughput(memory_rows: Sequence[dict], path: str, title: str) -> str:
  """PNG of GB/s vs size for jaxreshard and each baseline; returns ``path``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  mib = [r["mib"] for r in memory_rows]
  fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
  # A time that rounds to 0 in the rows (a quick run's tiny sizes) is left out.
  gbps = lambda key: [
    2 * r["mib"] * 2**20 / r[key] / 1e9 if r[key] > 0 else float("nan") for r in memory_rows
  ]
  series = [
    ("reshard_s", "jaxreshard.reshard, rank after rank", "o-"),
    ("reshard_ranks_s", "jaxreshard.reshard_ranks (one call)", "d-"),
    ("memcpy_s", "numpy copyto (pre-touched)", "s--"),
    ("fresh_copy_s", "numpy copy into a fresh array", "^--"),
  ]
  for key, label, style in series:
    ax.plot(mib, gbps(key), style, label=label)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("optimizer history copied (MiB, float32 mu + nu)")
  ax.set_ylabel("GB/s (bytes read + written)")
  ax.set_title(title, fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path)
  plt.close(fig)
  return path
