"""Hypothesis fuzzing of untrusted checkpoints: damage a real save, every reader must cope.

The harness lives in ``tests/fuzz/_fuzz_harness.py`` (the checkpoint, the mutations,
bounded calls, the JSON signing scheme), the strategies in
``tests/fuzz/_fuzz_strategies.py``, the judge in ``tests/fuzz/_fuzz_judge.py``; this module
holds the fuzz tests, ``tests/fuzz/test_regressions.py`` the regression tests of what
they found.

One small but representative checkpoint is saved once (3 ranks, uneven sizes,
float32 + bfloat16 buffers, a scalar param, keys ``""`` and ``"a/b"``, an
``inject_hyperparams`` Adam with a float64 and a weak-typed hyper-parameter, a
non-zero step count, 8-byte chunks so that every buffer has several chunks).
Each example copies it and applies one to three mutations:

* JSON edits of ``jaxreshard.json``, ``archive.json`` and ``zarr.json``: any node
  (``json_edits``): a value replaced (every JSON type, huge and negative ints,
  NaN/inf, ``1e400``, deep nesting, long strings, terminal escapes, rich markup,
  path-like names) or nudged (+-1, doubled, negated, a character changed), a key
  or element removed, added or duplicated;
* every field by name (``field_edits``, ``FIELD_NAMES``), with values that mean
  something for it: of the index ``format``, ``format_version``, ``checkpoint``,
  ``record_version``, ``checksum``, each param's id/shape/dtype/trainable, the
  groups' world_size/params/ranks, the layouts' tree and leaves (scalar and
  history references), each clock scalar's dtype, shape, weak flag, bits (a
  flipped bit) and value (2 -> 10), its encoding's form, the archives'
  name/layout/clock and order; of archive.json ``format``, ``format_version``,
  ``checkpoint``, ``archive``, ``checksum`` and each buffer's dtype, elements,
  chunk and crc32c;
* bytes: bit flips (anywhere, or aimed at a shard file's chunk data, chunk
  crc32c, shard index and index crc32c), truncation, extension, overwrites;
* the file system: an entry replaced by a directory, an empty file, a FIFO, a
  socket, a character device, a symbolic link (to a copy outside, to a
  sibling inside, dangling) or a hard link (to a sibling, to a copy outside);
  entries removed; extra files and directories; files copied from another
  archive of the same save or from another save.

JSON edits come in two modes. Plain: the file is written back as edited. A file
the writer signs (the index and each archive.json carry a "checksum" member:
``sha256`` of the compact object without it) then no longer matches its
checksum, and every reader that needs it must refuse. Re-signed
(``JsonEdit.resign``): the edited object is signed again with the harness's own
implementation of the scheme, as a writer would have signed it, so the edit
reaches the reader's deeper rules. A file the original does not sign (zarr.json;
every JSON file of a format without checksums) cannot be told from a re-signed
one: its edits are judged as re-signed ones.

Every mutated checkpoint goes through ``jr.load_records``, ``jr.restore`` (both
ranks of world size 2 and one drawn target), ``jr.restore_ranks`` (both ranks of
world size 2), ``jr.digest`` and the command line, in process: ``inspect MUT``,
``verify ORIG MUT`` and ``reshard MUT OUT --world-size 2``.

The judge's rules (``tests/fuzz/_fuzz_judge.py``), strict: no "misread" is tolerated.

* The reference. Unless the index was edited authentically (re-signed, or not
  signed at all), it is the original: every reader gives the exact original
  result, compared bit for bit (arrays viewed as unsigned ints, scalars by dtype,
  shape and bits, tree structure, NamedTuple classes, placements, roles), or a
  ``jr.ReshardError``. After an authentic index edit the checkpoint may mean
  something else; the reference is then ``reshard(load_records(R), plan(R, ...))``
  of a repaired copy R (the original's files with the edited index), and:

  - if that state differs from the original, saving it again must give back
    every file of R by meaning (JSON compared resolved: identity where it agrees,
    checksums, leaf numbering and NamedTuple modules aside; everything else byte
    for byte). So a misread index (records that are not what it says) and data
    that contradicts the layout (non-zero elements where the layout says padding,
    elements a shape edit leaves out, buffers of other sizes) are findings: they
    must be refused;
  - every reader agrees bit for bit with the reference, or refuses;
  - where ``load_records(R)`` refuses although the index alone opens
    (``open_checkpoint``), the data contradicts the index: ``load_records``,
    ``digest`` and ``verify`` must refuse; ``restore``, ``restore_ranks`` and
    ``reshard``, which read only the byte ranges a target needs, may succeed, but
    then agree with each other bit for bit.
* Refusing. A reader must refuse where the reference refuses, and where it needs
  a broken entry (missing, of another kind, a link, a shard file holding other
  bytes, a signed JSON file its checksum does not cover; ``restore`` reads only
  some chunks, so for it only a shard file's size and index count). It may refuse
  where the reference accepts only if something else differs that could explain
  it: a broken or an extra entry, or an authentic edit of a JSON file other than
  the index. Otherwise a refusal where the reference accepts is a finding too.
* ``digest`` answers a broken or refused checkpoint with a refusal or a digest
  listing problems (never identical to anything); a digest without problems must
  equal ``digest(load_records(ck))``.
* Errors: only a ``jr.ReshardError`` (``ArchiveError``, ``PlacementError``, ...
  included). A bare ``ValueError``, ``KeyError``, ``TypeError``,
  ``OverflowError``, ``MemoryError``, ``RecursionError`` and *any* ``OSError`` are
  failures. A ``FileNotFoundError`` naming the path is right only for a
  checkpoint directory that does not exist; no mutation here removes the root, so
  no ``OSError`` is ever right.
* A link to a copy outside the checkpoint is a canary (its access time is reset):
  reading it at all is a failure.
* The CLI: exit 0 (verify: 0 same, 1 different), or exit 2 with exactly one line
  ``jaxreshard: error: ...`` on stderr, no traceback, no message that starts with
  a bare exception type, no control characters in any output; a failed
  ``reshard`` leaves no output directory. Its answers follow the same rules:
  ``verify``'s 0/1, what ``reshard`` writes (bit for bit the reference's two
  ranks), what ``inspect`` prints (the reference's table; a broken index: exit 2).
* Every call finishes within ``PATIENCE_S`` (a watchdog thread; FIFOs are
  unblocked before the failure is reported), allocates less than
  ``MAX_TRACED_BYTES`` (tracemalloc peak, numpy included) under an address-space
  cap (``RLIMIT_AS`` at the current mapping + 3 GiB while the call runs, so a
  metadata bomb fails fast as a MemoryError instead of paging the machine), and
  leaves the checkpoint's files unchanged.
* Error messages (API and CLI) are at most ``MAX_ERROR_CHARS`` long: untrusted
  fields are quoted truncated.

The judge looks at the resulting files, not at how they were damaged.

Profiles (settings are applied per test, other tests are untouched):

* default, in the normal suite: 86 derandomized examples (CI is deterministic)
  plus one re-signed edit of every field by name, about 30 s of CPU;
* long, on demand, random and as many examples as you like:
  ``JAXRESHARD_FUZZ_EXAMPLES`` examples for each of the 5 fuzz tests (default
  2000). The full run, 10,000 cases in all, which prints the number of cases judged
  (by test and outcome) at the end::

    JAXRESHARD_FUZZ=long JAXRESHARD_FUZZ_EXAMPLES=2000 JAXRESHARD_FUZZ_LOG=/tmp/fuzz.log \\
        nice -n 10 .venv/bin/python -m pytest -q -s -p no:cacheprovider \\
        tests/fuzz/test_fuzz_checkpoint.py --hypothesis-show-statistics -k \\
        "json_metadata or index_fields or fuzz_bytes or file_system or fuzz_combined"

  or one test: ``tests/fuzz/test_fuzz_checkpoint.py::test_fuzz_index_fields``.
  ``JAXRESHARD_FUZZ_LOG=FILE`` appends one line per case (time, test, outcome), so
  that a run cut short by a timeout still says how far it got:
  ``wc -l FILE``, or ``awk '{print $2, $3}' FILE | sort | uniq -c``.

Every reader bug the fuzzer found has a minimized regression test in
``tests/fuzz/test_regressions.py``. A bug found later can be tolerated while it is fixed: an entry in
``_fuzz_judge._KNOWN`` (a regex on the finding's text, the edits it follows, and
its regression test, marked ``xfail(strict=True)``), removed with the mark when
the fix lands; ``JAXRESHARD_FUZZ_STRICT=1`` reports known findings too.
"""

from __future__ import annotations

import collections
import hashlib
import json

import hypothesis.strategies as st
import pytest
from hypothesis import given

from tests.fuzz import _fuzz_judge as judge
from tests.fuzz._fuzz_harness import JsonEdit, _settings, signature, signed_bytes
from tests.fuzz._fuzz_judge import fuzz_case
from tests.fuzz._fuzz_strategies import (
  ANY_EDIT,
  FIELD_NAMES,
  TARGETS,
  byte_edits,
  field_edits,
  first_field_edit,
  fs_edits,
  json_edits,
)

# Every test here is slow: `pytest -m "not slow"` skips them, plain `pytest` runs them.
pytestmark = pytest.mark.slow


# --- the fuzz tests -------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _case_count():
  """Prints how many cases each fuzz test judged, by outcome (seen with ``-s``)."""
  yield
  if judge.CASES:
    by_test = collections.Counter((t, s) for t, s in judge.CASES)
    lines = [f"  {t}: {n} {s}" for (t, s), n in sorted(by_test.items())]
    print(f"\nfuzz: {len(judge.CASES)} cases judged\n" + "\n".join(lines))


@_settings(25)
@given(op=json_edits(), target=TARGETS)
def test_fuzz_json_metadata(op, target):
  fuzz_case([op], [target])


@_settings(15)
@given(op=field_edits(), target=TARGETS)
def test_fuzz_index_fields(op, target):
  fuzz_case([op], [target])


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=judge.KNOWN_REASONS[n]))
    if n in judge.KNOWN_REASONS
    else n
    for n in FIELD_NAMES
  ],
)
def test_every_field_edit(name):
  """One re-signed edit of every field by name (plain edits: test_fuzz_*)."""
  op = first_field_edit(name, resign=True)
  if op is None:
    pytest.skip(f"the original checkpoint has no {name!r}")
  fuzz_case([op], [(2, 3)], tolerate_known=False)


@_settings(18)
@given(op=byte_edits(), target=TARGETS)
def test_fuzz_bytes(op, target):
  fuzz_case([op], [target])


@_settings(18)
@given(op=fs_edits(), target=TARGETS)
def test_fuzz_file_system(op, target):
  fuzz_case([op], [target])


@_settings(10)
@given(ops=st.lists(ANY_EDIT, min_size=2, max_size=3), target=TARGETS)
def test_fuzz_combined(ops, target):
  fuzz_case(ops, [target])


def test_pristine_checkpoint_passes_the_harness():
  """The judge itself: an untouched copy is the original everywhere."""
  fuzz_case([], [(0, 1), (2, 3), (4, 5)])


def test_harness_signs_like_the_scheme(tmp_path):
  """The harness's signing: a re-signed edit carries a valid checksum, a plain one does not,
  and a file without a checksum member is never signed (its edits are judged as authentic)."""
  body = b'{"format":"x","n":[1,2]}'
  signed = signed_bytes(body)
  assert signed == (
    b'{"checksum":"sha256:'
    + hashlib.sha256(body).hexdigest().encode()
    + b'","format":"x","n":[1,2]}'
  )
  assert signature(signed) is True and signature(body) is None
  assert signature(signed.replace(b"[1,2]", b"[1,3]")) is False
  for resign, want in ((True, True), (False, False)):
    p = tmp_path / f"signed{resign}.json"
    p.write_bytes(signed)
    JsonEdit(p.name, ("n", 1), "set", 3, resign).apply(str(tmp_path), str(tmp_path))
    assert signature(p.read_bytes()) is want and json.loads(p.read_bytes())["n"] == [1, 3]
  JsonEdit(p.name, ("checksum",), "set", "sha256:" + "0" * 64, True).apply(str(tmp_path), "")
  assert signature(p.read_bytes()) is False  # an edit of the checksum itself stays plain
  p = tmp_path / "plain.json"
  p.write_bytes(body)
  JsonEdit(p.name, ("n", 1), "set", 3, True).apply(str(tmp_path), str(tmp_path))
  assert p.read_bytes() == b'{"format":"x","n":[1,3]}'
