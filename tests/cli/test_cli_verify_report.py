"""What ``verify`` and ``inspect`` say: values as numbers, capped lists, tolerance, names, bytes."""

import json
import os

import numpy as np
import optax
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.cli.commands import EXIT_DIFFERENT, app

OPT = optax.adam(1e-3)
N_PARAMS = 25


def _params():
  return {f"p{i:02d}": np.zeros((6,), np.float32) for i in range(N_PARAMS)}


def _state(count=8, edit=None):
  """Adam state with mu[k] = 1, 2, ..., 6 for every param; ``edit(mu)`` changes mu in place."""
  params = _params()
  state = OPT.init(params)
  mu = {k: np.arange(1, 7, dtype=np.float32) for k in params}
  if edit is not None:
    edit(mu)
  return params, (state[0]._replace(count=np.int32(count), mu=mu),) + tuple(state[1:])


def _save(path, world_size=4, **kw):
  params, state = _state(**kw)
  jr.save_records(path, jr.shard_state(OPT, params, state, world_size))
  return path


def _run(*args):
  result = CliRunner().invoke(app, [str(a) for a in args])
  assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
  return result


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  return _save(tmp_path_factory.mktemp("v") / "base")


def test_clock_scalars_differ_as_numbers(base, tmp_path):
  result = _run("verify", base, _save(tmp_path / "c12", world_size=3, count=12))
  assert result.exit_code == EXIT_DIFFERENT, result.output
  lines = result.stdout.splitlines()
  assert lines[0] == "different: 1 difference: 1 of 1 clock scalars", lines
  assert lines[1] == "differs: scalar [0].count: 8 != 12", lines


def test_an_empty_node_of_the_params_tree_is_a_difference(base, tmp_path):
  """The same params at the same key paths and the same bits, beside an empty ``{}``:
  restored, the two are other trees, and verify says so (exit 1)."""
  params, state = _state()
  params["empty"] = {}
  adam = state[0]._replace(mu={**state[0].mu, "empty": {}}, nu={**state[0].nu, "empty": {}})
  other = tmp_path / "other"
  jr.save_records(other, jr.shard_state(OPT, params, (adam,) + tuple(state[1:]), 3))
  result = _run("verify", base, other)
  assert result.exit_code == EXIT_DIFFERENT, result.output
  lines = result.stdout.splitlines()
  assert lines[0] == "different: 2 differences: 2 other (structure, parameters, problems)", lines
  assert lines[1].startswith(
    "differs: params tree at [0].mu: the nested dicts of its param ids != "
  )
  assert "'empty': {}" in lines[1] and "[0].nu" in lines[2], lines


def _bits(mu, key, i, pattern):
  mu[key].view(np.uint32)[i] = pattern


def test_nan_payloads_and_negative_zero_show_their_bits(base, tmp_path):
  def edit(mu):
    mu["p03"][2] = np.nan  # float32 NaN: 0x7fc00000
    _bits(mu, "p03", 4, 0x7FC00001)  # another NaN
    mu["p07"][0] = -0.0  # was 1.0

  nan_base = _save(tmp_path / "a", edit=lambda mu: (_bits(mu, "p03", 2, 0x7FC00001), None))
  other = _save(tmp_path / "b", world_size=5, edit=edit)
  result = _run("verify", nan_base, other)
  assert result.exit_code == EXIT_DIFFERENT, result.output
  text = result.stdout
  # p03: element 2 goes from one NaN to another, element 4 from 5.0 to a NaN.
  assert (
    "differs: param 'p03' buffer 0: bits differ in 2 of 6 elements, first [2]:"
    " nan(0x7fc00001) != nan(0x7fc00000); max abs diff inf, max rel diff inf" in text
  ), text
  assert "param 'p07' buffer 0: bits differ in 1 of 6 elements, first [0]: 1.0 != -0.0" in text
  assert "max abs diff 1, max rel diff 1" in text


def test_summary_first_and_differences_capped(base, tmp_path):
  def edit(mu):
    for k in mu:
      mu[k][5] = 7.0  # was 6.0, in every param

  other = _save(tmp_path / "o", world_size=3, count=9, edit=edit)
  result = _run("verify", base, other, "--max-diffs", 5)
  assert result.exit_code == EXIT_DIFFERENT
  lines = result.stdout.splitlines()
  assert lines[0] == (
    f"different: {N_PARAMS + 1} differences: 1 of 1 clock scalars,"
    f" {N_PARAMS} of {2 * N_PARAMS} buffers ({N_PARAMS} params)"
  ), lines[0]
  assert lines[1:6] == ["differs: scalar [0].count: 8 != 9"] + [
    f"differs: param 'p{i:02d}' buffer 0: bits differ in 1 of 6 elements, first [5]:"
    " 6.0 != 7.0; max abs diff 1, max rel diff 0.167"
    for i in range(4)
  ]
  assert lines[6] == f"... {N_PARAMS + 1 - 5} more not shown (--max-diffs N shows up to N)"
  assert len(lines) == 7
  default = _run("verify", base, other).stdout.splitlines()
  assert len(default) == 1 + 20 + 1 and default[-1].startswith("... 6 more not shown")
  data = json.loads(_run("verify", base, other, "--json").stdout)
  assert len(data["differences"]) == N_PARAMS + 1  # --json lists them all


def test_tolerance_accepts_rounding_but_says_not_bit_identical(base, tmp_path):
  def edit(mu):
    _bits(mu, "p01", 3, 0x40800001)  # 4.0 plus one ulp (2**-21 = 4.76837158203125e-07)
    _bits(mu, "p02", 0, 0x3F7FFFFF)  # 1.0 minus one ulp (2**-24)

  other = _save(tmp_path / "ulp", world_size=6, edit=edit)
  result = _run("verify", base, other, "--rtol", 1e-6)
  assert result.exit_code == 0, result.output
  lines = result.stdout.splitlines()
  assert lines[0] == (
    "within tolerance (rtol=1e-06, atol=0), not bit-identical:"
    f" 2 differences: 2 of {2 * N_PARAMS} buffers (2 params)"
  ), lines
  assert lines[1:] == [
    "param 'p01' buffer 0: max abs diff 4.77e-07, max rel diff 1.19e-07 (1 of 6 elements differ)",
    "param 'p02' buffer 0: max abs diff 5.96e-08, max rel diff 5.96e-08 (1 of 6 elements differ)",
  ]
  data = json.loads(_run("verify", base, other, "--atol", 1e-6, "--json").stdout)
  assert not data["identical"] and data["within_tolerance"]
  p01 = data["differing_buffers"][0]
  assert p01["max_abs_diff"] == 2.0**-21 and p01["max_rel_diff"] == 2.0**-23
  assert p01["first_index"] == 3 and p01["outside_tolerance"] == 0
  tight = _run("verify", base, other, "--rtol", 1e-7)
  assert tight.exit_code == EXIT_DIFFERENT, tight.output
  assert tight.stdout.splitlines()[0].endswith("; 1 buffers outside rtol=1e-07, atol=0")
  # A tolerance never covers the clock.
  clock = _run("verify", base, _save(tmp_path / "c9", count=9), "--atol", 100)
  assert clock.exit_code == EXIT_DIFFERENT and "8 != 9" in clock.stdout
  same = _run("verify", base, base, "--rtol", 1e-3)
  assert same.exit_code == 0 and same.stdout.startswith("identical: ")


@pytest.mark.parametrize("other_value", [1.0, -np.inf, np.nan, 3.0e38])
def test_an_infinity_is_within_no_tolerance_of_anything_but_itself(tmp_path, other_value):
  """CHECKPOINT holds +inf where OUT holds another value: ``rtol * |inf|`` is infinite,
  and so is the difference, which no tolerance covers. (It was accepted.)"""

  def value(v):
    def edit(mu):
      mu["p03"][2] = np.float32(v)

    return edit

  ref = _save(tmp_path / "inf", edit=value(np.inf))
  other = _save(tmp_path / "other", world_size=3, edit=value(other_value))
  for tol in (("--rtol", 1e-6), ("--atol", 1e30), ("--rtol", 10, "--atol", 1e30)):
    result = _run("verify", ref, other, *tol)
    assert result.exit_code == EXIT_DIFFERENT, (tol, result.output)
    assert "; 1 buffers outside rtol=" in result.stdout.splitlines()[0], (tol, result.output)
  assert _run("verify", ref, ref, "--rtol", 1e-6).exit_code == 0


@pytest.mark.parametrize("tol", [("--rtol", 1e-3), ("--atol", 0), ("--rtol", 0, "--atol", 1e-6)])
def test_nans_of_other_payloads_are_within_every_tolerance(tmp_path, tol):
  """NaN matches NaN whatever its payload (as -0.0 matches 0.0): other bits, so not
  identical, but within every tolerance. (``rtol * |NaN|`` is NaN, and the NaN pair
  was counted outside the tolerance beside "max abs diff 0".)"""

  def nan(payload):
    def edit(mu):
      mu["p03"][2] = np.array(payload, np.uint32).view(np.float32)

    return edit

  ref = _save(tmp_path / "a", edit=nan(0x7FC00123))
  other = _save(tmp_path / "b", world_size=3, edit=nan(0x7FC00001))
  result = _run("verify", ref, other, *tol)
  assert result.exit_code == 0, (tol, result.output)
  first = result.stdout.splitlines()[0]
  assert first.startswith("within tolerance") and "outside" not in first, (tol, first)
  assert _run("verify", ref, other).exit_code == EXIT_DIFFERENT  # bit for bit: not identical


@pytest.mark.parametrize("flag", ["--rtol", "--atol"])
@pytest.mark.parametrize("bad", ["inf", "nan", "-1e-9", "-inf"])
def test_a_tolerance_that_is_not_a_finite_number_at_least_zero_is_refused(base, flag, bad):
  """Each by that rule (an infinite one made ``--json`` print ``Infinity``, which is
  not JSON; ``nan`` was refused as "should be greater than or equal to 0")."""
  result = _run("verify", base, base, flag, bad, "--json")
  assert result.exit_code == 2 and not result.stdout, result.output
  line = result.stderr.strip()
  assert line == f"jaxreshard: error: {flag} {float(bad)} must be a finite number >= 0", line


def test_verify_refuses_what_every_restore_refuses(tmp_path):
  """float64 history buffers saved with x64 on, read with it off: every restore
  refuses them, and verify does too, with the restore's message (it called the
  checkpoint identical to itself)."""
  import jax

  from tests._core_util import retyped_adam_records

  with jax.enable_x64(True):
    jr.save_records(tmp_path / "ck", retyped_adam_records(mu_dtype=np.float64))
  with pytest.raises(jr.ShapeError) as refused:
    jr.restore(tmp_path / "ck", world_size=3, rank=0)
  result = _run("verify", tmp_path / "ck", tmp_path / "ck")
  assert result.exit_code == 2, result.output
  assert result.stderr.strip() == f"jaxreshard: error: {tmp_path / 'ck'}: {refused.value}"


def test_inspect_names_state_classes_and_counts_files_on_disk(tmp_path):
  params = {"w": np.zeros((5,), np.float32)}
  opt = optax.chain(optax.clip(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
  jr.save_records(tmp_path / "c", jr.shard_state(opt, params, opt.init(params), 2))
  data = json.loads(_run("inspect", tmp_path / "c", "--json").stdout)
  names = {c["path"]: c["name"] for c in data["clocks"]}
  assert names["[1].count"] == "chain[1] InjectStatefulHyperparamsState.count"
  assert (
    names["[1].hyperparams['learning_rate']"]
    == "chain[1] InjectStatefulHyperparamsState.hyperparams['learning_rate']"
  )
  assert (
    names["[1].inner_state[0].count"]
    == "chain[1] InjectStatefulHyperparamsState.inner_state chain[0] ScaleByAdamState.count"
  )
  sizes = [
    os.stat(os.path.join(root, f)).st_size
    for root, _, files in os.walk(tmp_path / "c")
    for f in files
  ]
  assert data["disk_bytes"] == sum(sizes) and data["files"] == len(sizes)
  assert data["disk_bytes"] > data["stored_bytes"]
  text = _run("inspect", tmp_path / "c").stdout
  assert (
    "chain[1] InjectStatefulHyperparamsState.inner_state chain[0] ScaleByAdamState.count" in text
  )
  assert f"in {len(sizes)} files)" in text


def test_verify_reads_a_checkpoint_whose_clock_holds_a_typed_prng_key(tmp_path):
  # add_noise keeps a typed key (no numpy form) in its state: verify compares it
  # like any clock scalar, against itself and against the checkpoint resharded.
  import jax

  opt = optax.chain(
    optax.add_noise(0.01, 0.55, key=jax.random.key(3)), optax.sgd(0.1, momentum=0.9)
  )
  params = {"w": np.arange(5, dtype=np.float32)}
  jr.save_records(tmp_path / "a", jr.shard_state(opt, params, opt.init(params), world_size=2))
  assert _run("reshard", tmp_path / "a", tmp_path / "b", "-w", "3").exit_code == 0
  for other in ("a", "b"):
    result = _run("verify", tmp_path / "a", tmp_path / other)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("identical: 1 params, 1 buffers (5 elements), 2 clock scalars")
  other_key = optax.chain(
    optax.add_noise(0.01, 0.55, key=jax.random.key(4)), optax.sgd(0.1, momentum=0.9)
  )
  jr.save_records(
    tmp_path / "c", jr.shard_state(other_key, params, other_key.init(params), world_size=2)
  )
  result = _run("verify", tmp_path / "a", tmp_path / "c")
  assert result.exit_code == EXIT_DIFFERENT, result.output
  assert "1 of 2 clock scalars" in result.stdout.splitlines()[0], result.stdout
  # inspect names the key's dtype as jax and the digest do, its value the key data.
  key = next(
    c
    for c in json.loads(_run("inspect", tmp_path / "a", "--json").stdout)["clocks"]
    if c["path"] == "[0].rng_key"
  )
  want = np.asarray(jax.random.key_data(jax.random.key(3)))
  assert key["dtype"] == "key<fry>" and key["shape"] == [2], key
  assert key["value"] == want.tolist() and key["bits"] == want.tobytes().hex(), key
  row = next(
    line for line in _run("inspect", tmp_path / "a").stdout.splitlines() if "rng_key" in line
  )
  assert "key<fry>" in row and "uint32" not in row, row


def test_verify_counts_the_clock_scalars_either_side_holds(tmp_path):
  # adam's clock holds one scalar; inject_hyperparams(adam)'s seven, none at adam's path.
  params = {"w": np.arange(5, dtype=np.float32)}
  for name, opt in (("a", OPT), ("b", optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))):
    jr.save_records(tmp_path / name, jr.shard_state(opt, params, opt.init(params), world_size=2))
  for x, y in (("a", "b"), ("b", "a")):
    result = _run("verify", tmp_path / x, tmp_path / y)
    assert result.exit_code == EXIT_DIFFERENT, result.output
    assert result.stdout.splitlines()[0] == (
      "different: 9 differences: 8 of 8 clock scalars, 1 other (structure, parameters, problems)"
    ), result.stdout
