"""Hypothesis fuzzing of untrusted checkpoints: damage a real save, every reader must cope.

The harness lives in ``tests/_fuzz_harness.py`` (the checkpoint, the mutations,
bounded calls, the JSON signing scheme), the strategies in
``tests/_fuzz_strategies.py``, the judge in ``tests/_fuzz_judge.py``; this module
holds the fuzz tests and the regression tests of what they found.

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

The judge's rules (``tests/_fuzz_judge.py``), strict: no "misread" is tolerated.

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
  failures. The SPEC allows a ``FileNotFoundError`` naming the path only for a
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
        tests/test_fuzz_checkpoint.py --hypothesis-show-statistics -k \\
        "json_metadata or index_fields or fuzz_bytes or file_system or fuzz_combined"

  or one test: ``tests/test_fuzz_checkpoint.py::test_fuzz_index_fields``.
  ``JAXRESHARD_FUZZ_LOG=FILE`` appends one line per case (time, test, outcome), so
  that a run cut short by a timeout still says how far it got:
  ``wc -l FILE``, or ``awk '{print $2, $3}' FILE | sort | uniq -c``.

Every reader bug the fuzzer found has a minimized regression test at the end of
this module. A bug found later can be tolerated while it is fixed: an entry in
``_fuzz_judge._KNOWN`` (a regex on the finding's text, the edits it follows, and
its regression test, marked ``xfail(strict=True)``), removed with the mark when
the fix lands; ``JAXRESHARD_FUZZ_STRICT=1`` reports known findings too.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import socket

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given

import jaxreshard as jr
from tests import _fuzz_judge as judge
from tests._archive_util import read_json, write_consistent_index
from tests._fuzz_harness import (
  INDEX,
  MAX_ERROR_CHARS,
  JsonEdit,
  _settings,
  _uint,
  cli,
  is_signed,
  pristine,
  run_bounded,
  signature,
  signed_bytes,
  write_json,
)
from tests._fuzz_judge import _BARE_TYPE, fuzz_case
from tests._fuzz_strategies import (
  ANY_EDIT,
  FIELD_NAMES,
  TARGETS,
  byte_edits,
  field_edits,
  first_field_edit,
  fs_edits,
  json_edits,
)

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


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=judge.KNOWN_REASONS[n]))
    if n in judge.KNOWN_REASONS else n for n in FIELD_NAMES])
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
  assert signed == (b'{"checksum":"sha256:' + hashlib.sha256(body).hexdigest().encode()
                    + b'","format":"x","n":[1,2]}')
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


# --- regression tests of what the fuzzer found ----------------------------------
#
# Each is the minimized form of a fuzz failure, fixed in the reader.


@pytest.fixture
def fuzz_ckpt(tmp_path):
  """A private copy of the fuzzed checkpoint."""
  path = tmp_path / "ckpt"
  shutil.copytree(pristine().path, path)
  return path


def _edit_json(ckpt, file, fn):
  """Edits a JSON file of the checkpoint, re-signed where the original is signed (so that the
  edit reaches the rule under test, not the checksum)."""
  p = os.path.join(ckpt, file)
  with open(p) as f:
    d = json.load(f)
  fn(d)
  write_json(p, d, sign=is_signed(pristine(), file))


def _edit_index(ckpt, fn):
  """An index edit, re-signed, with every archive.json re-signed to agree with it."""
  _edit_json(ckpt, INDEX, fn)
  write_consistent_index(ckpt, read_json(os.path.join(ckpt, INDEX)))


def _refusals(ckpt, one_rank=True):
  """What load_records, restore_ranks (every target rank) and, with ``one_rank``,
  restore of rank 0 raise (None: they returned)."""
  calls = [lambda: jr.load_records(ckpt), lambda: jr.restore_ranks(ckpt, range(2), world_size=2)]
  if one_rank:
    calls.append(lambda: jr.restore(ckpt, rank=0, world_size=2))
  out = []
  for call in calls:
    e = run_bounded(call, "reader", str(ckpt)).error
    out.append(e)
  return out


def _one_error_line(code, err):
  assert code == 2, (code, err)
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxreshard: error: "), err
  assert not _BARE_TYPE.match(lines[0]), lines[0]


_SOCKET_ENTRIES = [INDEX, "archive_00000/archive.json", "archive_00000/float32/zarr.json",
                   "archive_00000/float32/c/0"]


@pytest.mark.parametrize("entry", _SOCKET_ENTRIES)
def test_socket_in_place_of_a_file_is_an_archive_error(fuzz_ckpt, entry):
  # Found by test_fuzz_file_system: Replace(entry, 'socket').
  path = os.path.join(fuzz_ckpt, entry)
  os.unlink(path)
  s = socket.socket(socket.AF_UNIX)
  s.bind(path)
  s.close()
  for e in _refusals(fuzz_ckpt):
    assert isinstance(e, jr.ArchiveError), repr(e)
    assert f"{path} is not a regular file" in str(e)


def test_tree_dict_with_str_and_int_keys_is_refused(fuzz_ckpt):
  # Found by test_fuzz_json_metadata: one key of the hyperparams dict made an int key,
  # JsonEdit('jaxreshard.json', ('layouts', 0, 'tree', 4, 1, 1, 0), 'set', ['i', 5]).
  def mixed(d):
    node = d["layouts"][0]["tree"][4][1]  # ["d", [["s", "b1"], ...], [...]]: hyperparams
    assert node[0] == "d" and node[1][0] == ["s", "b1"]
    node[1][0] = ["i", 5]

  _edit_index(fuzz_ckpt, mixed)
  for e in _refusals(fuzz_ckpt):
    assert isinstance(e, jr.ArchiveError), repr(e)
  code, _, err = cli("inspect", fuzz_ckpt)
  _one_error_line(code, err)


def test_clock_scalar_bytes_shorter_than_its_dtype_is_an_archive_error(fuzz_ckpt):
  # Found by test_fuzz_index_fields (long profile): JsonEdit('jaxreshard.json',
  # ('clocks', 0, 1, 'bytes'), 'set', 'ZmZmPwA=', resign=True). Eight base64 characters
  # with one '=' are 5 bytes, where the length check allowed 4 to 6: a raw ValueError.
  def edit(d):
    scalar = next(x for x in d["clocks"][0] if isinstance(x, dict) and "bytes" in x
                  and np.dtype(x["dtype"]).itemsize == 4 and x["shape"] == [])
    scalar["shape"], scalar["bytes"] = [1], "ZmZmPwA="  # 5 bytes for 4

  _edit_index(fuzz_ckpt, edit)
  for e in _refusals(fuzz_ckpt):
    assert isinstance(e, jr.ArchiveError), repr(e)


def test_python_int_clock_scalar_beyond_int64(fuzz_ckpt):
  # Found by test_fuzz_json_metadata: JsonEdit('jaxreshard.json', ('clocks', 0, 0, 'v'),
  # 'set', 10**30) on a {"py": "int"} scalar (the first, made a Python int here).
  _edit_index(fuzz_ckpt, lambda d: d["clocks"][0].__setitem__(0, {"py": "int", "v": 10**30}))
  for args in (("inspect", fuzz_ckpt), ("verify", pristine().path, fuzz_ckpt)):
    code, _, err = cli(*args)
    assert not isinstance(code, BaseException), f"{args[0]}: {code!r}"
    assert code in (0, 1, 2), (args[0], code)
    if code == 2:
      _one_error_line(code, err)


def test_inspect_survives_rich_markup_in_a_clock_key(fuzz_ckpt):
  # Found by test_fuzz_json_metadata: JsonEdit('jaxreshard.json', ('layouts', 0, 'tree', 4,
  # 1, 1, 0, 1), 'set', '[/x]'), a key of the hyperparams dict (loads: a valid other tree).
  def markup(d):
    node = d["layouts"][0]["tree"][4][1]
    assert node[1][0] == ["s", "b1"]
    node[1][0] = ["s", "[/x]"]

  _edit_index(fuzz_ckpt, markup)
  assert jr.load_records(fuzz_ckpt)
  code, out, err = cli("inspect", fuzz_ckpt)
  assert not isinstance(code, BaseException), repr(code)
  assert code == 0 and "['[/x]']" in out, (code, err)


def test_inspect_prints_param_ids_with_rich_markup_literally(tmp_path):
  # A regular save: '[bold]b' and '[red]' are legal pytree keys.
  opt = optax.adam(1e-3)
  params = {"[bold]b": jnp.zeros((3,), jnp.float32), "[red]": jnp.zeros((2,), jnp.float32)}
  jr.save_records(tmp_path / "c", jr.shard_state(opt, params, opt.init(params), 2))
  code, out, err = cli("inspect", tmp_path / "c")
  assert code == 0, (code, err)
  assert "[bold]b" in out and "[red]" in out, out


def test_python_float_clock_scalar_that_overflows(fuzz_ckpt):
  # Found by probing the {"py": "float"} scalar form (now a nudge of every clock scalar):
  # JsonEdit('jaxreshard.json', ('clocks', 0, 1), 'set', {'py': 'float', 'v': '0x1p+9999'}).
  _edit_index(fuzz_ckpt, lambda d: d["clocks"][0].__setitem__(
      1, {"py": "float", "v": "0x1p+9999"}))
  for e in _refusals(fuzz_ckpt):
    assert isinstance(e, jr.ArchiveError), repr(e)
  code, _, err = cli("inspect", fuzz_ckpt)
  assert not isinstance(code, BaseException), repr(code)
  _one_error_line(code, err)


@pytest.mark.parametrize("file", [INDEX, "archive_00001/archive.json"])
def test_error_messages_quote_metadata_truncated(fuzz_ckpt, file):
  # Found by test_fuzz_json_metadata: JsonEdit(file, ('format_version',), 'set', 'x' * 100000).
  _edit_json(fuzz_ckpt, file, lambda d: d.__setitem__("format_version", "x" * 100000))
  for e in _refusals(fuzz_ckpt):
    assert isinstance(e, jr.ArchiveError), repr(e)
    assert "is not supported" in str(e) and len(str(e)) < MAX_ERROR_CHARS, len(str(e))


@pytest.mark.parametrize("slot, value", [(1, []), (2, ["x"]), (3, [["count"], "hyperparams",
                                                                   "hyperparams_states",
                                                                   "inner_state"])],
                         ids=["module", "name", "fields"])
def test_unhashable_namedtuple_module_name_or_fields(fuzz_ckpt, slot, value):
  # Found by test_fuzz_json_metadata (long profile):
  # JsonEdit('jaxreshard.json', ('layouts', 0, 'tree', 1), 'set', []).
  def edit(d):
    node = d["layouts"][0]["tree"]  # ["n", module, name, fields, children]
    assert node[0] == "n" and node[2] == "InjectStatefulHyperparamsState"
    node[slot] = value

  _edit_index(fuzz_ckpt, edit)
  for e in _refusals(fuzz_ckpt):
    assert isinstance(e, jr.ArchiveError), repr(e)
  code, _, err = cli("inspect", fuzz_ckpt)
  assert not isinstance(code, BaseException), repr(code)
  _one_error_line(code, err)


def test_inspect_lists_ranks_of_a_huge_world_size(fuzz_ckpt, world=10**12):
  # Found while sizing the fuzzer's values: JsonEdit('jaxreshard.json',
  # ('groups', 0, 'world_size'), 'set', 10**7) made inspect run for minutes.
  # load_records and restore refuse this index at once (slots disagree).
  _edit_index(fuzz_ckpt, lambda d: d["groups"][0].__setitem__("world_size", world))
  for e in _refusals(fuzz_ckpt):
    assert isinstance(e, jr.ReshardError), repr(e)
  # (Under tracemalloc, 2**22 already takes more than 15 s; 10**12 fails at once.)
  code, _, err = cli("inspect", fuzz_ckpt)
  assert not isinstance(code, BaseException), repr(code)
  assert code in (0, 2), (code, err)


def test_renamed_clock_key_keeps_its_value(fuzz_ckpt):
  # From test_fuzz_json_metadata (long profile): JsonEdit('jaxreshard.json', ('layouts', 0,
  # 'tree', 4, 1, 1, 3, 1), 'set', 'EPS_ROOT'). The index is no longer canonical (its
  # scalars are not numbered in flatten order: 'EPS_ROOT' sorts before 'b1'), but each
  # value stays under its own name; history buffers cannot move this way (their key
  # paths must name their param). The strict judge accepts it as what the index says.
  def rename(d):
    node = d["layouts"][0]["tree"][4][1]
    assert node[1][3] == ["s", "eps_root"]
    node[1][3] = ["s", "EPS_ROOT"]

  _edit_index(fuzz_ckpt, rename)
  for record in jr.load_records(fuzz_ckpt):
    hp = record.state.hyperparams
    assert list(hp) == ["b1", "b2", "eps", "EPS_ROOT", "learning_rate"]
    assert hp["EPS_ROOT"].dtype == np.float64 and float(hp["EPS_ROOT"]) == 1e-300
    assert _uint(hp["b1"]).tobytes() == _uint(np.float32(0.9)).tobytes()


def test_archive_list_order_is_checked_against_the_archives(fuzz_ckpt):
  # Found by test_every_field_edit[archives.order]: JsonEdit('jaxreshard.json', ('archives', 0),
  # 'swap', 1, resign=True). archive_00001/archive.json names itself archive_00001, the
  # index (re-signed) lists it first; load_records returned rank 1's history as rank 0's.
  def swap(d):
    d["archives"][0], d["archives"][1] = d["archives"][1], d["archives"][0]

  _edit_index(fuzz_ckpt, swap)
  for e in _refusals(fuzz_ckpt):
    assert isinstance(e, jr.ReshardError), repr(e)


def test_group_ranks_order_is_checked(fuzz_ckpt):
  # Found by test_fuzz_index_fields (long profile): JsonEdit('jaxreshard.json', ('groups', 0,
  # 'ranks'), 'set', [[1, 0], [0, 1], [2, 2]]). load_records returned archive_00000's shards
  # (rank 0's slots) as rank 1 and archive_00001's as rank 0: a permuted state.
  _edit_index(fuzz_ckpt, lambda d: d["groups"][0].__setitem__("ranks", [[1, 0], [0, 1], [2, 2]]))
  for e in _refusals(fuzz_ckpt):
    assert isinstance(e, jr.ReshardError), repr(e)


def test_shape_edit_that_leaves_data_in_padding_is_refused(fuzz_ckpt):
  # Found by the strict judge (test_every_field_edit[params.shape]): JsonEdit('jaxreshard.json',
  # ('params', 0, 1), 'set', [4], resign=True). Param "" of shape (5,) over 3 ranks has 2
  # slots either way; with (4,) rank 2 owns nothing, and its real element 4 became padding.
  # load_records and restore returned the state without it; digest reports the padding.
  # Restoring one target rank alone does not read padding far from its own
  # elements (the README says so); every target rank together reads all of it.
  _edit_index(fuzz_ckpt, lambda d: d["params"][0].__setitem__(1, [4]))
  for e in _refusals(fuzz_ckpt, one_rank=False):
    assert isinstance(e, jr.ReshardError), repr(e)
  code, _, err = cli("reshard", fuzz_ckpt, fuzz_ckpt.parent / "out", "--world-size", 2)
  assert code == 2, (code, err)
