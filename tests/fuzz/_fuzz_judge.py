"""The judge of the checkpoint fuzz harness: what every reader must do with a mutated copy.

Its rules are stated in ``tests/fuzz/test_fuzz_checkpoint.py``'s docstring; ``check_checkpoint``
applies them and raises ``Finding``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from typing import Any

from hypothesis import note as _hypothesis_note
from hypothesis.errors import InvalidArgument

import jaxreshard as jr
from tests.fuzz._fuzz_harness import (
  CHUNK_BYTES,
  INDEX,
  MAX_ERROR_CHARS,
  STRICT,
  Finding,
  Hang,
  Op,
  Outcome,
  _entries,
  _is_regular_or_dir,
  _key,
  _keys,
  _read_canaries,
  _shard_regions,
  _unblock_fifos,
  cli,
  is_signed,
  pristine,
  run_bounded,
  signature,
  through_link,
  unsigned_json,
)


def note(text: str) -> None:
  """A note in hypothesis' report, or on stdout outside a hypothesis test."""
  try:
    _hypothesis_note(text)
  except InvalidArgument:
    print(text)


# --- what differs from the original ------------------------------------------------


@dataclasses.dataclass
class Damage:
  """What differs from the pristine checkpoint, entry by entry.

  ``broken``: entries that are missing, of another kind, a link, (a shard file)
  hold other bytes, or (a JSON file the original signs) hold bytes its checksum
  does not cover: a reader that needs one must refuse.
  ``restore_broken``: the subset a restore must refuse even though it reads only
  some chunks (all but chunk bytes of a shard file of the right size).
  ``edited``: JSON files (regular) whose bytes differ and that are as authentic as
  the original: validly re-signed, or of a file the original does not sign.
  ``extra``: entries the original does not have, and regular files with the
  original bytes but another link count (a hard link, to a copy outside or inside).
  """

  broken: set[str]
  restore_broken: set[str]
  edited: set[str]
  extra: set[str]

  @property
  def lenient(self) -> bool:
    """Whether a reader may refuse although the reference accepts (see the rules)."""
    return bool(self.broken or self.extra or self.edited - {INDEX})


def damage(ckpt: str) -> Damage:
  pr = pristine()
  broken, restore_broken, edited, linked = set(), set(), set(), set()
  for e in pr.entries:  # sorted: a directory comes before what it holds
    p, q = os.path.join(ckpt, e), os.path.join(pr.path, e)
    if os.path.dirname(e) in broken:  # never look through a link (a canary) or a non-dir
      broken.add(e)
      restore_broken.add(e)
      continue
    try:
      mode = os.lstat(p).st_mode
    except OSError:  # gone, or a parent is no directory any more
      broken.add(e)
      restore_broken.add(e)
      continue
    if os.path.isdir(q):
      if not stat.S_ISDIR(mode):
        broken.add(e)
        restore_broken.add(e)
      continue
    if not stat.S_ISREG(mode):
      broken.add(e)
      restore_broken.add(e)
      continue
    if os.lstat(p).st_nlink != 1:
      linked.add(e)
    with open(p, "rb") as f:
      a = f.read()
    b = pr.raw(e)
    if a == b:
      continue
    if e.endswith(".json"):
      if is_signed(pr, e) and signature(a) is not True:
        broken.add(e)  # a plain edit of a signed file: every reader of it must refuse
        restore_broken.add(e)
      else:
        edited.add(e)
      continue
    broken.add(e)
    index_at = max(_shard_regions(pr, e)["chunk crc32c"]) + 1
    if len(a) != len(b) or a[index_at:] != b[index_at:]:
      restore_broken.add(e)
  extra = set(_entries(ckpt)) - set(pr.entries) | linked
  return Damage(broken, restore_broken, edited, extra)


# --- the reference: reshard(load_records(ck), plan(...)) --------------------------------


def _in_memory(records: list, rank: int, world: int) -> Any:
  return jr.reshard(records, jr.plan(records, world_size=world, rank=rank))


@dataclasses.dataclass
class Reference:
  """What every reader must give: the in-memory rules applied to ``load_records(path)``.

  ``path`` is the original checkpoint, or (after an authentic edit of the index) a
  repaired copy: the original's files with the edited index, so that damage
  elsewhere cannot hide what the edited index means.
  """

  path: str
  load: Outcome
  # load_records refuses, the index alone (open_checkpoint) does not: the data contradicts
  # it. A reader of part of the data (restore, restore_ranks, reshard) need not see that;
  # where it succeeds it must agree with restore.
  data_refused: bool = False
  targets: dict = dataclasses.field(default_factory=dict)
  memo: dict = dataclasses.field(default_factory=dict)

  @property
  def changed(self) -> bool:
    return self.load.ok and _keys(self.load.value) != pristine().records

  def target(self, rank: int, world: int) -> Outcome:
    """``reshard(load_records(path), plan(..., world_size=world, rank=rank))``, its key."""
    if (rank, world) not in self.targets:
      if not self.load.ok:
        out = Outcome(error=self.load.error)
      else:
        what = f"reshard(load_records(ck), plan(world_size={world}, rank={rank}))"
        out = run_bounded(lambda: _in_memory(self.load.value, rank, world), what, self.path)
        if out.ok:
          out.value = _key(out.value)
        else:
          _check_error(what, out.error, out.tb)
      self.targets[(rank, world)] = out
    return self.targets[(rank, world)]

  def digest(self) -> Outcome:
    if "digest" not in self.memo:
      if not self.load.ok:
        self.memo["digest"] = Outcome(error=self.load.error)
      else:
        d = run_bounded(lambda: jr.digest(self.load.value), "digest(load_records(ck))", self.path)
        if not d.ok:
          _check_error("digest(load_records(ck))", d.error, d.tb)
        self.memo["digest"] = d
    return self.memo["digest"]

  def cli(self, *args: Any) -> tuple[Any, str, str]:
    if args not in self.memo:
      self.memo[args] = cli(*[self.path if a is None else a for a in args])
    return self.memo[args]


def reference(ckpt: str, dmg: Damage, work: str) -> Reference:
  pr = pristine()
  if INDEX not in dmg.edited:
    if "reference" not in pr.memo:
      pr.memo["reference"] = Reference(pr.path, Outcome(value=pr.loaded))
    return pr.memo["reference"]
  path = os.path.join(work, "repaired")
  shutil.copytree(pr.path, path)
  shutil.copyfile(os.path.join(ckpt, INDEX), os.path.join(path, INDEX))
  load = run_bounded(lambda: jr.load_records(path), "load_records", path)
  if not load.ok:
    _check_error("load_records", load.error, load.tb)
  ref = Reference(path, load)
  if not load.ok:
    index = run_bounded(lambda: jr.open_checkpoint(path), "open_checkpoint", path)
    ref.data_refused = index.ok
  if ref.changed:
    _check_writer_agrees(ref, work)
  return ref


def _resolve(node: Any, leaves: list, clock: list) -> Any:
  """A layout's tree with its leaves put in place, dict entries sorted by key."""
  if node is None:
    return None
  if type(node) is int:
    leaf = leaves[node]
    if isinstance(leaf, dict):
      return ["scalar", clock[leaf["s"]]]
    return ["history", leaf]
  kind = node[0]
  if kind == "n":  # the module aside: foreign classes are re-created by design
    return ["n", "", node[2], node[3], [_resolve(c, leaves, clock) for c in node[4]]]
  if kind in ("d", "f"):
    pairs = [[k, _resolve(c, leaves, clock)] for k, c in zip(node[1], node[2], strict=True)]
    return [kind, sorted(pairs, key=lambda kv: json.dumps(kv[0]))]
  if kind in ("l", "t"):
    return [kind, [_resolve(c, leaves, clock) for c in node[1]]]
  raise ValueError(f"tree node {node!r}")


def canonical_index(d: Any) -> str:
  """What an index means: every archive's tree with its clock and leaves resolved.

  The identity and the checksum aside (compared through the archives), and the
  numbering of leaves and scalars (a renamed dict key re-sorts them) and unused
  layouts or clocks aside.
  """
  try:
    out = {
      k: v
      for k, v in d.items()
      if k not in ("checksum", "checkpoint", "layouts", "clocks", "archives")
    }
    out["archives"] = [
      [name, _resolve(d["layouts"][li]["tree"], d["layouts"][li]["leaves"], d["clocks"][ci])]
      for name, li, ci in d["archives"]
    ]
  except (LookupError, TypeError, ValueError, AttributeError):
    return json.dumps(d, sort_keys=True)  # not resolvable: compared as written
  return json.dumps(out, sort_keys=True, separators=(",", ":"))


def canonical_files(root: str) -> dict[str, Any]:
  """Every file of a checkpoint, JSON by meaning, identity replaced where it agrees."""
  with open(os.path.join(root, INDEX), "rb") as f:
    index = unsigned_json(f.read())
  ident = index.get("checkpoint") if isinstance(index, dict) else None
  out: dict[str, Any] = {}
  for e in _entries(root):
    p = os.path.join(root, e)
    if os.path.isdir(p):
      continue
    with open(p, "rb") as f:
      raw = f.read()
    if e == INDEX:
      out[e] = canonical_index(index)
    elif e.endswith("/archive.json"):
      d = unsigned_json(raw)
      if isinstance(d, dict) and d.get("checkpoint") == ident:
        d["checkpoint"] = "<identity>"
      out[e] = json.dumps(d, sort_keys=True)
    else:
      out[e] = raw
  return out


def _check_writer_agrees(ref: Reference, work: str) -> None:
  """An accepted index that changes the state must be one the writer could have written.

  Its records have no non-zero element where the layout says padding (``digest``'s
  problems), and saving the loaded records again must give back every file of the checkpoint by
  meaning (``canonical_files``): this refuses a misread index (the records are not
  what it says) and data that contradicts the layout (non-zero elements where the
  layout says padding, elements a shape edit leaves out, shards of other sizes).
  """
  problems = jr.digest(ref.load.value).problems
  if problems:
    raise Finding(
      "load_records: data contradicting the layout accepted",
      f"load_records accepted an edited index that the data contradicts: {problems}",
    )
  resaved = os.path.join(work, "resaved")
  try:
    jr.save_records(resaved, ref.load.value, chunk_bytes=CHUNK_BYTES)
  except jr.ReshardError as e:
    raise Finding(
      "load_records: accepted records the writer refuses",
      f"load_records accepted an edited index whose records cannot be saved: {e}",
    ) from e
  want, got = canonical_files(ref.path), canonical_files(resaved)
  if want != got:
    diff = sorted(e for e in set(want) | set(got) if want.get(e) != got.get(e))
    first = diff[0]
    raise Finding(
      "load_records: index misread or data contradicting the layout accepted",
      f"load_records accepted an edited index, but saving its records gives other"
      f" files: {diff}\nchecked {str(want.get(first))[:2500]}\nresaved"
      f" {str(got.get(first))[:2500]}",
    )


# --- the checks ----------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x9b]")
_BARE_TYPE = re.compile(
  r"^jaxreshard: error: ([A-Za-z_][A-Za-z0-9_.]*(Error|Exception|Warning)"
  r"|KeyboardInterrupt|StopIteration):"
)


def _check_error(call: str, e: BaseException, tb: str) -> None:
  if isinstance(e, (Hang, Finding)):
    raise e
  if not isinstance(e, jr.ReshardError):
    raise Finding(
      f"{call}: {type(e).__name__}",
      f"{call} raised {type(e).__name__}: {str(e)[:300]}\n{tb[-2000:]}",
    )
  if len(str(e)) > MAX_ERROR_CHARS:
    raise Finding(
      f"{call}: overlong error line",
      f"{call}: a {len(str(e))}-character message: {str(e)[:200]!r}...",
    )


def _check_cli(call: str, code: Any, out: str, err: str, allowed: tuple) -> None:
  if isinstance(code, BaseException):
    raise Finding(
      f"{call}: traceback {type(code).__name__}",
      f"{call} escaped with {type(code).__name__}: {str(code)[:300]}",
    )
  if code not in allowed:
    raise Finding(f"{call}: exit {code}", f"{call} exited {code}; stderr {err[-500:]!r}")
  for name, text in (("stdout", out), ("stderr", err)):
    if _CONTROL.search(text):
      raise Finding(
        f"{call}: control characters", f"{call} wrote control characters to {name}: {text[-300:]!r}"
      )
  if code == 2:
    lines = err.strip("\n").split("\n")
    if len(lines) != 1 or not lines[0].startswith("jaxreshard: error: "):
      raise Finding(f"{call}: not one error line", f"{call}: stderr {err[-500:]!r}")
    if len(lines[0]) > MAX_ERROR_CHARS:
      raise Finding(
        f"{call}: overlong error line",
        f"{call}: a {len(lines[0])}-character error line: {lines[0][:200]!r}...",
      )
    m = _BARE_TYPE.match(lines[0])
    if m:
      raise Finding(f"{call}: bare {m.group(1)}", f"{call}: {lines[0][:300]}")
  if "Traceback" in out + err:
    raise Finding(f"{call}: traceback", f"{call}: {err[-500:]!r}")


def _file_state(root: str) -> dict:
  """Kind and bytes of every entry (links and special files unread)."""
  out = {}
  for e in _entries(root):
    p = os.path.join(root, e)
    s = os.lstat(p)
    if stat.S_ISREG(s.st_mode):
      with open(p, "rb") as f:
        out[e] = f.read()
    elif stat.S_ISLNK(s.st_mode):
      out[e] = "link:" + os.readlink(p)
    else:
      out[e] = stat.S_IFMT(s.st_mode)
  return out


_ON_DISK = re.compile(r";\s+[0-9.]+\s+[kMGT]?B\s+on\s+disk\s+in\s+\d+\s+files?")


def _table(text: str) -> str:
  """inspect's output after its title (which names, and wraps, the checkpoint's path),
  without the bytes and files it finds on disk: inspect reads the index alone, so an
  edited archive file changes that count and nothing else it prints."""
  return _ON_DISK.sub("", text[text.find("\u250f") :])


def check_checkpoint(ckpt: str, work: str, ops: list[Op], targets: list[tuple[int, int]]) -> None:
  """Runs every reader on ``ckpt`` and judges each outcome (raises ``Finding``)."""
  pr = pristine()
  del ops  # the judge looks at the files, not at how they were damaged
  dmg = damage(ckpt)
  before = _file_state(ckpt)
  ref = reference(ckpt, dmg, work)
  lenient = dmg.lenient

  def needs(entries: set[str], broken: set[str]) -> bool:
    """Damage that a reader of ``entries`` must refuse."""
    return bool(broken & entries)

  def refusal(call: str, out: Outcome, want_ok: bool, why: str) -> None:
    """A refusal: always a ReshardError; wrong where the reference accepts and nothing else
    (a broken or extra entry, an edited file other than the index) could explain it."""
    _check_error(call, out.error, out.tb)
    if want_ok and not lenient:
      raise Finding(
        f"{call}: refuses what the reference accepts",
        f"{call} refused ({out.error}) though {why} accepts the checkpoint",
      )

  # load_records -----------------------------------------------------------------
  load = run_bounded(lambda: jr.load_records(ckpt), "load_records", ckpt)
  if load.ok:
    if needs(set(pr.entries), dmg.broken):
      raise Finding(
        "load_records: accepted a broken needed entry",
        f"load_records succeeded although {sorted(dmg.broken)} changed",
      )
    if not ref.load.ok:
      raise Finding(
        "load_records: accepts what the reference refuses",
        f"load_records succeeded, the index alone is refused: {ref.load.error}",
      )
    if _keys(load.value) != _keys(ref.load.value):
      raise Finding(
        "load_records: silently different result",
        "load_records returned other records than the "
        + ("original" if ref.path == pr.path else "edited index says"),
      )
  else:
    refusal("load_records", load, ref.load.ok, "load_records of the index alone")

  # restore, restore_ranks ------------------------------------------------------------
  restored = {}
  for rank, world in targets:
    what = f"restore(rank={rank}, world_size={world})"
    r = run_bounded(lambda: jr.restore(ckpt, rank=rank, world_size=world), what, ckpt)
    restored[(rank, world)] = r
    want = ref.target(rank, world)
    if not r.ok:
      refusal("restore", r, want.ok, f"reshard(load_records(ck), plan(...)) [{what}]")
      continue
    if needs(pr.needed_by_restore(rank, world), dmg.restore_broken):
      raise Finding(
        "restore: accepted a broken needed entry",
        f"{what} succeeded although {sorted(dmg.restore_broken)} changed",
      )
    if not want.ok:
      if ref.data_refused:  # it may not read the data load_records refuses
        continue
      raise Finding(
        "restore: accepts what reshard(load_records) refuses",
        f"{what} succeeded but the in-memory rules refuse: {want.error}",
      )
    if _key(r.value) != want.value:
      raise Finding(
        "restore: silently different result",
        f"{what} differs from reshard(load_records(ck), plan(...))",
      )

  both = [ref.target(r, 2) for r in range(2)]
  if ref.data_refused:  # partial readers that succeed must at least agree with restore
    both = [
      Outcome(value=_key(restored[(r, 2)].value)) if restored[(r, 2)].ok else x
      for r, x in zip(range(2), both)
    ]
  needed2 = pr.needed_by_restore(0, 2) | pr.needed_by_restore(1, 2)
  rr = run_bounded(lambda: jr.restore_ranks(ckpt, [0, 1], world_size=2), "restore_ranks", ckpt)
  if not rr.ok:
    refusal("restore_ranks", rr, all(x.ok for x in both), "reshard(load_records(ck), plan(...))")
  else:
    if needs(needed2, dmg.restore_broken):
      raise Finding(
        "restore_ranks: accepted a broken needed entry",
        f"restore_ranks succeeded although {sorted(dmg.restore_broken)} changed",
      )
    if not all(x.ok for x in both):
      raise Finding(
        "restore_ranks: accepts what reshard(load_records) refuses",
        f"restore_ranks succeeded but the in-memory rules refuse: {[str(x.error) for x in both]}",
      )
    if _keys(rr.value) != [x.value for x in both]:
      raise Finding(
        "restore_ranks: silently different result",
        "restore_ranks differs from reshard(load_records(ck), plan(...))",
      )

  # digest --------------------------------------------------------------------------
  dg = run_bounded(lambda: jr.digest(ckpt), "digest", ckpt)
  want_dg = ref.digest()
  if not dg.ok:
    refusal("digest", dg, want_dg.ok, "digest(load_records(ck))")
  elif not dg.value.problems:  # a digest with problems is never identical to anything
    if needs(set(pr.entries), dmg.broken):
      raise Finding(
        "digest: accepted a broken needed entry",
        f"digest found no problem although {sorted(dmg.broken)} changed",
      )
    if not want_dg.ok:
      raise Finding(
        "digest: accepts what load_records refuses",
        f"digest found no problem, load_records refuses: {want_dg.error}",
      )
    if dg.value != want_dg.value:
      raise Finding(
        "digest: silently different result", "digest(ck) differs from digest(load_records(ck))"
      )
  elif want_dg.ok and not want_dg.value.problems and not lenient:
    raise Finding(
      "digest: problems the reference does not have",
      f"digest(ck) reports {dg.value.problems} but digest(load_records(ck)) none",
    )

  # CLI: inspect ---------------------------------------------------------------------
  code, out, err = run_bounded(lambda: cli("inspect", ckpt), "inspect", ckpt).value
  _check_cli("inspect", code, out, err, (0, 2))
  want_code, want_out, _ = ref.cli("inspect", None)
  if code == 0:
    if INDEX in dmg.broken:
      raise Finding("inspect: accepted a broken index", f"inspect printed:\n{out[-1500:]}")
    if want_code != 0 or _table(out) != _table(want_out):
      raise Finding(
        "inspect: different output",
        f"inspect printed something else than for the reference:\n{out[-1500:]}",
      )
  elif want_code == 0 and not lenient:
    raise Finding("inspect: refuses what the reference accepts", err.strip()[:300])

  # CLI: verify ORIG MUT -------------------------------------------------------------
  code, out, err = run_bounded(lambda: cli("verify", pr.path, ckpt), "verify", ckpt).value
  _check_cli("verify", code, out, err, (0, 1, 2))
  loads = ref.load.ok and not needs(set(pr.entries), dmg.broken)
  if code != 2:
    if not loads:
      raise Finding(
        "verify: accepts what load_records refuses",
        f"verify exited {code} though load_records must refuse",
      )
    want = 0 if not ref.changed else ref.cli("verify", pr.path, None)[0]
    if code != want:
      raise Finding(
        "verify: disagrees with load_records",
        f"verify exited {code} (wanted {want}); {err.strip()[:300]}",
      )
  elif loads and not lenient:
    raise Finding("verify: refuses what the reference accepts", err.strip()[:300])

  # CLI: reshard MUT OUT --world-size 2 ---------------------------------------------
  dest = os.path.join(work, "resharded")
  code, out, err = run_bounded(
    lambda: cli("reshard", ckpt, dest, "--world-size", 2), "reshard", ckpt
  ).value
  _check_cli("reshard", code, out, err, (0, 2))
  if code == 2:
    if os.path.lexists(dest):
      raise Finding("reshard: output left behind", "a refused reshard left its output")
    if all(x.ok for x in both) and not lenient:
      raise Finding("reshard: refuses what the reference accepts", err.strip()[:300])
  else:
    if needs(needed2, dmg.restore_broken):
      raise Finding(
        "reshard: accepted a broken needed entry",
        f"reshard succeeded although {sorted(dmg.restore_broken)} changed",
      )
    if not all(x.ok for x in both):
      raise Finding(
        "reshard: accepts what reshard(load_records) refuses",
        f"reshard succeeded though the in-memory rules refuse: {[str(x.error) for x in both]}",
      )
    written = run_bounded(lambda: jr.load_records(dest), "load_records(resharded)", dest)
    if not written.ok:
      raise Finding("reshard: wrote an unreadable checkpoint", str(written.error))
    if _keys(written.value) != [x.value for x in both]:
      raise Finding(
        "reshard: silently different result",
        "reshard wrote other records than reshard(load_records(ck), plan(...))",
      )

  # No reader reads outside the checkpoint or changes it.
  read = _read_canaries(work)
  if read:
    raise Finding("followed a link outside the checkpoint", f"canaries read: {read}")
  if _file_state(ckpt) != before:
    raise Finding("checkpoint changed by a reader", "the readers changed the checkpoint")


# --- known bugs, tolerated by the fuzz tests (see the regression tests) ---------------

# None today; a finding pinned by a regression test while its fix is pending goes
# here, with its test marked xfail(strict=True).
# (regex on the finding's text, which edits it follows, regression test) of each known,
# pinned reader bug.
_KNOWN: list[tuple[str, Callable[[list[Op]], bool], str]] = []
# The field sweep's cases that meet a known bug (field name -> why), marked xfail.
KNOWN_REASONS: dict[str, str] = {}


def _known(f: Finding, ops: list[Op]) -> str | None:
  if STRICT:
    return None
  for pattern, pred, test in _KNOWN:
    if re.search(pattern, str(f)) and pred(ops):
      return test
  return None


# (test, outcome) of every case judged in this process (the module prints the count).
CASES: list[tuple[str, str]] = []


def _log_case(status: str) -> None:
  """One line per case to $JAXRESHARD_FUZZ_LOG (long runs: counts survive a timeout)."""
  path = os.environ.get("JAXRESHARD_FUZZ_LOG")
  test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]
  CASES.append((test, status.split(" ")[0]))
  if path:
    with open(path, "a") as f:
      f.write(f"{time.time():.1f} {test} {status}\n")


def fuzz_case(ops: list[Op], targets: list[tuple[int, int]], tolerate_known: bool = True) -> None:
  """Copies the pristine checkpoint, applies ``ops`` and judges every reader."""
  pr = pristine()
  work = tempfile.mkdtemp(prefix="fz", dir=pr.root)
  ckpt = os.path.join(work, "c")
  try:
    shutil.copytree(pr.path, ckpt)
    for op in ops:
      note(repr(op))
      if any(
        not _is_regular_or_dir(os.path.join(ckpt, e)) or through_link(ckpt, e) for e in op.touched()
      ):
        # An earlier op replaced what this one edits (reading a FIFO would block),
        # or a directory above it with a link (the edit would read or write the
        # canary outside, which only a reader may be caught reading).
        continue
      try:
        op.apply(ckpt, work)
      except (OSError, ValueError, LookupError, TypeError, ArithmeticError, RecursionError) as e:
        note(f"  (not applicable after the earlier ops: {type(e).__name__})")
    targets = [(0, 2), (1, 2)] + [t for t in targets if t not in ((0, 2), (1, 2))]
    status = "ok"
    try:
      check_checkpoint(ckpt, work, ops, targets)
    except Finding as f:
      test = _known(f, ops) if tolerate_known else None
      status = f"known {test}" if test else f"FAIL {f.signature}"
      if test is None:
        raise
      note(f"known bug (see {test}): {f}")
    finally:
      _log_case(status)
  finally:
    _unblock_fifos(work)
    shutil.rmtree(work, ignore_errors=True)
