"""Hypothesis strategies of the checkpoint fuzz harness: what to break, and how.

``json_edits``: any node of any JSON file, any JSON value; ``index_field_edits``:
every field of the index and of archive.json by name (``INDEX_FIELDS``,
``ARCHIVE_FIELDS``), with values that mean something for that field (another
param's id, a shape of the same size, a clock value changed 2 -> 10, a swapped
rank...); both plain and re-signed (``JsonEdit.resign``). ``byte_edits``,
``fs_edits``: the bytes of any file, the file system's entries.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import tempfile
from typing import Any

import hypothesis.strategies as st
import numpy as np

from tests.fuzz._fuzz_harness import (
  ARCHIVES,
  INDEX,
  Bytes,
  Extra,
  JsonEdit,
  Raw,
  Replace,
  Transplant,
  _shard_regions,
  pristine,
)

HUGE_INTS = [
  2**31 - 1,
  2**31,
  2**32,
  2**53 + 1,
  2**62,
  2**62 + 1,
  2**63 - 1,
  2**63,
  2**64,
  10**30,
  -(2**63),
  -(2**31),
  -(10**30),
]
STRINGS = [
  "",
  "\x1b[2J",
  "\x1b]0;pwned\x07",
  "[/x]",
  "[bold red]x",
  "[link=file:///etc]x",
  "../../etc/passwd",
  "/etc/passwd",
  "archive_00001",
  "archive_00000/../archive_00001",
  "float64",
  "int32",
  "bool",
  "object",
  "bfloat16",
  "float16",
  "a%2Fb",
  "a/b",
  "%",
  "scale",
  "dense/kernel",
  "\x00",
  "\ud800",
  "\u202e",
  "é",
  "optax",
  "os",
  "optax._src.transform",
  "ScaleByAdamState",
  "count",
  "mu",
  "nan",
  "inf",
  "-0x1p+0",
  "0x1.fffffffffffffp+1023",
  "AAAAAA==",
  "AAAAAAAAAAA=",
  "////",
  "=",
  "s",
  "i",
  "n",
  "d",
  "l",
  "t",
  "py",
  "int",
  "float",
  "e40bf47a6a75481386c3a1bb1b22e490",
]
RAWS = [
  "1e400",
  "-1e400",
  "NaN",
  "Infinity",
  "-0.0",
  "1.0",
  "2.0",
  "3.0",
  "1e2",
  "0.5",
  "1E+30",
  "true",
  "[]",
  "{}",
  '"\\ud800"',
]

SCALARS = st.one_of(
  st.none(),
  st.booleans(),
  st.sampled_from(HUGE_INTS),
  st.integers(-4, 40),
  st.integers(),
  st.floats(),
  st.sampled_from(STRINGS),
  st.text(max_size=12),
  st.sampled_from(RAWS).map(Raw),
  st.integers(1, 200000).map(lambda n: "x" * n),
  (st.integers(1, 100000) | st.sampled_from([190, 200, 210, 500, 900, 950, 980, 990])).map(
    lambda n: Raw("[" * n + "]" * n)
  ),
  st.integers(1, 3000).map(lambda n: Raw('{"a":' * n + "0" + "}" * n)),
)
VALUES = st.recursive(
  SCALARS,
  lambda c: (
    st.lists(c, max_size=4)
    | st.dictionaries(
      st.sampled_from(["s", "dtype", "shape", "weak", "bytes", "py", "v", "", "x"]), c, max_size=4
    )
  ),
  max_leaves=6,
)


def _nudges(v: Any) -> list[Any]:
  """Values near ``v``: the edits a flaky disk or a careless hand makes."""
  if isinstance(v, bool):
    return [not v, int(v), None]
  if isinstance(v, int):
    return [
      v + 1,
      v - 1,
      -v,
      2 * v,
      v + 2**32,
      0,
      v + 2**63,
      float(v),
      Raw(f"{v}.0"),
      Raw(f"{v}e0"),
      str(v),
    ]
  if isinstance(v, float):
    return [v + 1, -v, int(v), Raw("NaN"), str(v)]
  if isinstance(v, str):
    out = [v + "x", v[:-1], v.upper(), v + "/", "../" + v, v + "\x1b[2J", v + "[/x]", [v], ""]
    if v:
      out.append(v[:-1] + chr(ord(v[-1]) ^ 1))
    return out
  if isinstance(v, list):
    out = [v[:-1], v + v[-1:], v[::-1], [], v[1:], [v], {"0": v}]
    if len(v) == 2 and v[0] in ("s", "i"):  # a dict key of the state's tree
      out += [
        ["i", 0],
        ["i", 5],
        ["s", "0"],
        ["i", 2**63],
        ["i", -1],
        ["s", "[/x]"],
        ["s", "\x1b[2J"],
        ["i", True],
        ["s", v[1]],
        ["u", [v]],
        ["u", []],
        ["u", [v, 1.5]],
        ["u", v],
      ]
    return out
  if isinstance(v, dict):
    out = [{}, list(v.values()), {**v, "extra": 1}]
    if "dtype" in v or "py" in v:  # a clock scalar
      out += [
        {"py": "int", "v": 10**30},
        {"py": "int", "v": -(2**63) - 1},
        {"py": "int", "v": 7},
        {"py": "float", "v": "0x1p+9999"},
        {"py": "float", "v": "nan"},
        {"py": "float", "v": "-0x0.0000000000001p-1022"},
        {"py": "bool", "v": True},
        {"py": "bool", "v": 1},
        {"py": "complex", "v": "1j"},
      ]
    return out
  return [0, "", [], {}]


def _json_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
  out = [prefix]
  if isinstance(obj, dict):
    for k, v in obj.items():
      out += _json_paths(v, prefix + (k,))
  elif isinstance(obj, list):
    for i, v in enumerate(obj):
      out += _json_paths(v, prefix + (i,))
  return out


def _get(obj: Any, path: tuple) -> Any:
  for k in path:
    obj = obj[k]
  return obj


@st.composite
def json_edits(draw):
  pr = pristine()
  file = draw(st.sampled_from(sorted(pr.jsons)))
  doc = pr.jsons[file]
  path = draw(st.sampled_from(_json_paths(doc)))
  node = _get(doc, path)
  action = draw(st.sampled_from(["nudge", "set", "delete", "insert", "dup"]))
  resign = draw(st.booleans())
  if action == "nudge":
    return JsonEdit(file, path, "set", draw(st.sampled_from(_nudges(node))), resign)
  if action == "set" or (action in ("delete", "dup") and not path):
    return JsonEdit(file, path, "set", draw(VALUES), resign)
  if action == "delete":
    return JsonEdit(file, path, "delete", resign=resign)
  if action == "dup":
    if not isinstance(_get(doc, path[:-1]), list):
      return JsonEdit(file, path, "delete", resign=resign)
    return JsonEdit(file, path, "dup", resign=resign)
  if isinstance(node, dict):
    key = draw(st.sampled_from(list(node) + ["extra", "", "s"]) | st.text(max_size=4))
    return JsonEdit(file, path, "insert", (key, draw(VALUES)), resign)
  if isinstance(node, list):
    return JsonEdit(file, path, "insert", (draw(st.integers(0, len(node))), draw(VALUES)), resign)
  return JsonEdit(file, path, "set", draw(VALUES), resign)


# --- every field by name ----------------------------------------------------------

# The fields of the index and of archive.json, by name; each name is edited in every
# profile (``test_every_field_edit``), and drawn evenly by ``index_field_edits``.
INDEX_FIELD_NAMES = [
  "format",
  "format_version",
  "checkpoint",
  "record_version",
  "checksum",
  "params.id",
  "params.shape",
  "params.dtype",
  "params.trainable",
  "groups.world_size",
  "groups.params",
  "groups.ranks",
  "layouts.tree",
  "layouts.leaves.scalar",
  "layouts.leaves.history",
  "clocks.dtype",
  "clocks.shape",
  "clocks.weak",
  "clocks.bits",
  "clocks.value",
  "clocks.form",
  "archives.name",
  "archives.layout",
  "archives.clock",
  "archives.order",
]
ARCHIVE_FIELD_NAMES = [
  "archive.format",
  "archive.format_version",
  "archive.checkpoint",
  "archive.archive",
  "archive.checksum",
  "archive.describes.layout",
  "archive.describes.clock",
  "archive.describes.placements",
  "archive.buffers.dtype",
  "archive.buffers.elements",
  "archive.buffers.chunk",
  "archive.buffers.crc32c",
]
FIELD_NAMES = INDEX_FIELD_NAMES + ARCHIVE_FIELD_NAMES


def _dtype(name: str) -> np.dtype:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return np.dtype(jnp.dtype(name))


def _b64(b: bytes) -> str:
  return base64.b64encode(b).decode()


def _shape_variants(shape: list) -> list:
  """Shapes of the same size first (a reshape the data cannot contradict), then others."""
  n = int(np.prod(shape)) if shape else 1
  same = [[n], [n, 1], [1] + shape, list(reversed(shape))] + (
    [[2, n // 2]] if n % 2 == 0 and n > 2 else []
  )
  other = [
    [n - 1],
    [n + 1],
    shape[:-1] + [shape[-1] + 1] if shape else [0],
    [],
    [0],
    [2**40],
    [-n],
    [n, 0],
  ]
  out = [shape[:-1] + [shape[-1] - 1] if shape else [2]]  # drops elements: must be refused
  for s in same + other:
    if s != shape and s not in out:
      out.append(s)
  return out


def _checksum_variants(v: str) -> list:
  h = v.split(":", 1)[-1]
  flip = h[:-1] + ("0" if h[-1] != "0" else "1")
  return [
    f"sha256:{flip}",
    f"sha256:{h.upper()}",
    h,
    f"sha1:{h}",
    f"sha256:{h[:-2]}",
    "",
    f"sha256:{'0' * 64}",
    f"SHA256:{h}",
  ]


def _scalar_variants(field: str, sc: dict) -> list:
  """Edits of one clock scalar's encoding (``{"dtype", "shape", "weak", "bytes"}``)."""
  if "bytes" not in sc:  # a Python-number scalar ({"py", "v"})
    return [{**sc, "v": 10}, {**sc, "py": "float"}, {**sc, "py": "int"}, {**sc, "v": "nan"}]
  raw = base64.b64decode(sc["bytes"])
  dt = _dtype(sc["dtype"])
  if field == "clocks.dtype":
    same = [
      d
      for d in (
        "int32",
        "uint32",
        "float32",
        "int64",
        "uint64",
        "float64",
        "int16",
        "bfloat16",
        "float16",
      )
      if _dtype(d).itemsize == dt.itemsize
    ]
    return [d for d in same if d != sc["dtype"]] + [
      "float64",
      "int8",
      "bool",
      "object",
      "str",
      "V4",
      "<f4",
      "int",
    ]
  if field == "clocks.shape":
    return [[1], [0], [1, 1], [2], None, [-1], "()"]
  if field == "clocks.weak":
    return [not sc["weak"], int(sc["weak"]), None, "true"]
  if field == "clocks.bits":
    bits = [0, 1, 8 * len(raw) - 1, 8 * len(raw) - 2, 4 * len(raw)]
    return [
      _b64(bytes(x ^ (1 << (b % 8)) if i == b // 8 else x for i, x in enumerate(raw))) for b in bits
    ] + [
      _b64(raw[:-1]),
      _b64(raw + b"\0"),
      "",
      sc["bytes"][:-1],
      "!!" + sc["bytes"][2:],
      sc["bytes"] + "=",
    ]
  if field == "clocks.value":
    return [_b64(np.asarray(v).astype(dt).tobytes()) for v in (10, 2, 0, -1, 2**20)] + [
      _b64(np.asarray(10, np.float64 if dt.kind != "f" else np.int64).tobytes()[: dt.itemsize])
    ]
  return [
    {"py": "int", "v": 10},
    {"py": "float", "v": "0x1.4p+3"},
    {"py": "bool", "v": True},
    {"dtype": sc["dtype"], "shape": sc["shape"], "weak": sc["weak"]},
    {"dtype": sc["dtype"], "bytes": sc["bytes"]},
    {**sc, "extra": 1},
    [sc["bytes"]],
  ]


def field_edits_of(name: str) -> list[tuple[str, tuple, str, Any]]:
  """Every (file, path, action, value) edit of the field ``name`` of the original checkpoint."""
  pr = pristine()
  out: list[tuple[str, tuple, str, Any]] = []

  def put(file, path, values, action="set"):
    old = _get(pr.jsons[file], path) if action == "set" else None
    out.extend(
      (file, path, action, v)
      for v in values
      if action != "set" or v != old or type(v) is not type(old)
    )

  idx = pr.jsons[INDEX]
  ident = idx["checkpoint"]
  with open(os.path.join(pr.other, INDEX), "rb") as f:
    other_ident = json.loads(f.read())["checkpoint"]
  if name == "format":
    put(INDEX, ("format",), ["jaxreshard-checkpoint2", "", "zarr", None, ["jaxreshard-checkpoint"]])
  elif name == "format_version":
    v = idx["format_version"]
    put(INDEX, ("format_version",), [v - 1, v + 1, str(v), Raw(f"{v}.0"), True, None, 2**64])
  elif name == "checkpoint":
    put(
      INDEX,
      ("checkpoint",),
      [
        other_ident,
        ident[:-1] + ("0" if ident[-1] != "0" else "1"),
        ident.upper(),
        "",
        None,
        0,
        "../" + ident,
      ],
    )
  elif name == "record_version":
    put(INDEX, ("record_version",), [2, 0, "1", Raw("1.0"), True, None])
  elif name == "checksum" or name == "archive.checksum":
    file = INDEX if name == "checksum" else f"{ARCHIVES[1]}/archive.json"
    if "checksum" in pr.jsons[file]:
      put(file, ("checksum",), _checksum_variants(pr.jsons[file]["checksum"]))
      out.append((file, ("checksum",), "delete", None))
  elif name.startswith("params."):
    ids = [p[0] for p in idx["params"]]
    # dense/kernel first; for shapes "" first: (5,) -> (4,) leaves rank 2's only element
    # in what the layout then calls padding (the slot count stays 2).
    order = sorted(range(len(ids)), key=lambda i: "/" not in ids[i])
    if name == "params.shape":
      order = list(range(len(ids)))
    for i in order:
      pid, shape, dtype, trainable = idx["params"][i]
      if name == "params.id":
        put(
          INDEX,
          ("params", i, 0),
          [x for x in ids if x != pid]
          + [pid.replace("%2F", "/"), pid.replace("/", "%2F"), pid + "x", "", "%", "a%2fb"],
        )
      elif name == "params.shape":
        put(INDEX, ("params", i, 1), _shape_variants(shape))
      elif name == "params.dtype":
        put(
          INDEX,
          ("params", i, 2),
          [d for d in ("bfloat16", "float32") if d != dtype]
          + ["float16", "int32", "uint32", "float64", "int8", "bool", "object", "V4"],
        )
      else:
        put(INDEX, ("params", i, 3), [not trainable, int(trainable), None, "true"])
  elif name.startswith("groups."):
    g = idx["groups"][0]
    if name == "groups.world_size":
      w = g["world_size"]
      put(INDEX, ("groups", 0, "world_size"), [w - 1, w + 1, 2 * w, 1, 0, -w, Raw(f"{w}.0"), True])
    elif name == "groups.params":
      ps = g["params"]
      put(
        INDEX,
        ("groups", 0, "params"),
        [ps[:-1], ps + ps[-1:], ps[1:2] + ps[:1] + ps[2:], ps[:-1] + [len(ps)], [], [-1] + ps[1:]],
      )
    else:
      rs = g["ranks"]
      swapped_ranks = [[a, r] for (a, _), (_, r) in zip(rs, rs[1:2] + rs[:1] + rs[2:])]
      swapped_archives = [[a, r] for (_, r), (a, _) in zip(rs, rs[1:2] + rs[:1] + rs[2:])]
      put(
        INDEX,
        ("groups", 0, "ranks"),
        [
          swapped_ranks,
          swapped_archives,
          rs[:-1],
          rs + rs[-1:],
          rs[:-1] + [[rs[-1][0], rs[-1][1] + 1]],
          rs[:-1] + [[rs[-1][0] + 1, rs[-1][1]]],
        ],
      )
  elif name == "layouts.tree":
    tree = idx["layouts"][0]["tree"]
    for path in _json_paths(tree)[1:]:
      put(INDEX, ("layouts", 0, "tree") + path, _nudges(_get(tree, path)))
  elif name.startswith("layouts.leaves."):
    leaves = idx["layouts"][0]["leaves"]
    pids = [p[0] for p in idx["params"]]
    for j, leaf in enumerate(leaves):
      if isinstance(leaf, dict) and name.endswith("scalar"):
        k = leaf["s"]
        put(
          INDEX,
          ("layouts", 0, "leaves", j),
          [{"s": k + 1}, {"s": k - 1}, {"s": 99}, {"s": str(k)}, {"s": k, "x": 1}],
        )
      elif isinstance(leaf, list) and name.endswith("history"):
        pid, dt, m = leaf
        put(
          INDEX,
          ("layouts", 0, "leaves", j),
          [[m2pid, dt, m] for m2pid in pids if m2pid != pid]
          + [[pid, d, m] for d in ("float32", "bfloat16", "float64") if d != dt]
          + [[pid, dt, m + 1], [pid, dt, m - 1], [pid, dt, 0], [pid, dt], [pid, dt, m, 0]],
        )
    if name.endswith("scalar"):  # two leaves exchanged (scalar with scalar, buffer with buffer)
      out.extend(
        (INDEX, ("layouts", 0, "leaves", j), "swap", j + 1)
        for j, leaf in enumerate(leaves[:-1])
        if type(leaf) is type(leaves[j + 1])
      )
  elif name.startswith("clocks."):
    for c, clock in enumerate(idx["clocks"]):
      for k, sc in enumerate(clock):
        if name == "clocks.form":
          put(INDEX, ("clocks", c, k), _scalar_variants(name, sc))
        elif "bytes" in sc:
          key = {"clocks.dtype": "dtype", "clocks.shape": "shape", "clocks.weak": "weak"}.get(
            name, "bytes"
          )
          put(INDEX, ("clocks", c, k, key), _scalar_variants(name, sc))
  elif name.startswith("archives."):
    arcs = idx["archives"]
    for i, (arc, lay, clk) in enumerate(arcs):
      if name == "archives.name":
        put(
          INDEX,
          ("archives", i, 0),
          [a for a in ARCHIVES if a != arc]
          + ["archive_00003", f"../orig/{arc}", arc + "/", "", arc.upper()],
        )
      elif name == "archives.layout":
        put(INDEX, ("archives", i, 1), [lay + 1, lay - 1, str(lay), None])
      elif name == "archives.clock":
        put(INDEX, ("archives", i, 2), [clk + 1, clk - 1, str(clk), None])
      elif i + 1 < len(arcs):
        out.append((INDEX, ("archives", i), "swap", i + 1))
  elif name.startswith("archive."):
    for arc in ARCHIVES[1:] + ARCHIVES[:1]:
      file = f"{arc}/archive.json"
      doc = pr.jsons[file]
      field = name[len("archive.") :]
      if field == "format":
        put(file, (field,), ["jaxreshard-checkpoint2", "", None])
      elif field == "format_version":
        v = doc[field]
        put(file, (field,), [v + 1, v - 1, str(v), Raw(f"{v}.0")])
      elif field == "checkpoint":
        put(file, (field,), [other_ident, ident.upper(), "", None])
      elif field == "archive":
        put(file, ("archive",), [a for a in ARCHIVES if a != arc] + ["", "../" + arc, None])
      elif field.startswith("describes."):
        key = field.split(".")[1]
        v = doc["describes"][key]
        others = [pr.jsons[f"{a}/archive.json"]["describes"][key] for a in ARCHIVES if a != arc]
        put(
          file,
          ("describes", key),
          [x for x in others if x != v]
          + [v[:-1] + ("0" if v[-1] != "0" else "1"), v.upper(), "", None],
        )
        out.append((file, ("describes", key), "delete", None))
      elif field == "buffers.dtype":
        bufs = doc["buffers"]
        for dt in bufs:
          for new in ("float16", "int32", "float64", "bfloat16", "float32"):
            if new != dt:
              put(file, ("buffers",), [{(new if k == dt else k): v for k, v in bufs.items()}])
          out.append((file, ("buffers", dt), "delete", None))
      else:
        key = field.split(".")[1]
        for dt, b in doc["buffers"].items():
          if key == "crc32c":
            for i, crc in enumerate(b["crc32c"]):
              put(file, ("buffers", dt, "crc32c", i), [crc ^ 1, crc ^ (1 << 31)])
            put(
              file,
              ("buffers", dt, "crc32c"),
              [b["crc32c"][::-1], b["crc32c"][:-1], b["crc32c"] + [0]],
            )
          else:
            v = b[key]
            put(file, ("buffers", dt, key), [v - 1, v + 1, 2 * v, v // 2, 0, -v, 2**40])
  else:
    raise AssertionError(name)
  return out


@st.composite
def field_edits(draw, names: list = FIELD_NAMES):
  """One edit of a field drawn evenly by name, plain or re-signed."""
  name = draw(st.sampled_from(names))
  edits = field_edits_of(name)
  if not edits:  # the original does not have this field (an unsigned format: "checksum")
    edits = field_edits_of("format_version")
  file, path, action, value = draw(st.sampled_from(edits))
  return JsonEdit(file, path, action, value, draw(st.booleans()))


def first_field_edit(name: str, resign: bool) -> JsonEdit | None:
  """The first (most telling) edit of a field; None where the original lacks the field."""
  edits = field_edits_of(name)
  if not edits:
    return None
  file, path, action, value = edits[0]
  return JsonEdit(file, path, action, value, resign)


@st.composite
def byte_edits(draw):
  pr = pristine()
  files = [e for e in pr.entries if os.path.isfile(os.path.join(pr.path, e))]
  shards = [e for e in files if e.endswith("/c/0")]
  file = draw(st.sampled_from(shards) | st.sampled_from(files))
  size = os.path.getsize(os.path.join(pr.path, file))
  action = draw(st.sampled_from(["flip", "flip", "truncate", "extend", "overwrite"]))
  if action == "flip":
    if file in shards and draw(st.booleans()):
      region = draw(st.sampled_from(sorted(_shard_regions(pr, file).items())))
      offset = draw(st.sampled_from(region[1]))
    else:
      offset = draw(st.integers(0, size - 1))
    return Bytes(file, "flip", offset, bytes([draw(st.integers(0, 7))]))
  if action == "truncate":
    return Bytes(file, "truncate", draw(st.integers(0, size - 1)))
  if action == "extend":
    return Bytes(
      file,
      "extend",
      0,
      draw(st.binary(min_size=1, max_size=64) | st.sampled_from([b"\n", b" ", b"\x00" * 4096])),
    )
  offset = draw(st.integers(0, size - 1))
  data = draw(st.binary(min_size=1, max_size=24))
  original = pr.raw(file)
  if original[offset : offset + len(data)] == data:  # overwriting with the same bytes
    data = bytes([data[0] ^ 1]) + data[1:]
  return Bytes(file, "overwrite", offset, data)


def _can_mknod() -> bool:
  d = tempfile.mkdtemp(prefix="fzmk")
  try:
    os.mknod(os.path.join(d, "z"), stat.S_IFCHR | 0o600, os.makedev(1, 5))
    return True
  except OSError:
    return False
  finally:
    shutil.rmtree(d, ignore_errors=True)


_REPLACEMENTS = [
  "dir",
  "empty",
  "fifo",
  "socket",
  "symlink_out",
  "symlink_in",
  "dangling",
  "hardlink_in",
  "hardlink_out",
  "remove",
] + (["chardev"] if _can_mknod() else [])


@st.composite
def fs_edits(draw):
  pr = pristine()
  kind = draw(st.sampled_from(["replace", "replace", "extra", "transplant"]))
  if kind == "replace":
    entry = draw(st.sampled_from(pr.entries))
    is_dir = os.path.isdir(os.path.join(pr.path, entry))
    options = [b for b in _REPLACEMENTS if not (is_dir and b.startswith("hardlink"))]
    by = draw(st.sampled_from(options))
    sibling = ""
    if by in ("symlink_in", "hardlink_in"):
      same_kind = [
        e for e in pr.entries if e != entry and os.path.isdir(os.path.join(pr.path, e)) == is_dir
      ]
      # Most often the same entry of another archive (same name, same size).
      twins = [e for e in same_kind if e.split("/")[1:] == entry.split("/")[1:]]
      sibling = draw(st.sampled_from(twins or same_kind) | st.sampled_from(same_kind))
    return Replace(entry, by, sibling)
  if kind == "extra":
    entry = draw(
      st.sampled_from(
        [
          "archive_00003",
          "archive_00003/archive.json",
          "archive_99999",
          "junk",
          ".hidden",
          "jaxreshard.json.tmp",
          "archive_00000/float64",
          "archive_00000/float16",
          "archive_00000/float32/c/1",
          "archive_00000/float32/zarr.json.bak",
          "archive_00001/bfloat16/c/0.partial",
          "archive_00002/extra.json",
          "archive_00000/float32/c/0/x",
        ]
      )
    )
    what = draw(
      st.sampled_from(
        ["file", "dir", "fifo", "symlink_out", "copy:archive_00000", "copy:archive_00000/float32"]
      )
    )
    return Extra(entry, what)
  entry = draw(st.sampled_from(pr.entries))
  choices = ["other", "xored"]
  if entry.startswith("archive_"):
    choices += [a for a in ARCHIVES if not entry.startswith(a)]
  return Transplant(entry, draw(st.sampled_from(choices)))


ANY_EDIT = st.one_of(json_edits(), field_edits(), byte_edits(), fs_edits())

# Target ranks drawn besides both ranks of world size 2 (which reshard writes).
TARGETS = st.integers(1, 5).flatmap(lambda w: st.tuples(st.integers(0, w - 1), st.just(w)))
