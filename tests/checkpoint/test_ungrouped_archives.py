"""An archive that lists no param is in no group: no target rank's share of a group
names it, yet every read checks it.

A record listing no param (its histories' mirrors empty, its clock alone) saves
as such an archive, and loads. An index re-signed to list one more archive in no
group (sharing another archive's layout, its directory absent) was refused by
``load_records``, ``digest`` and ``verify``, which check every archive, and
accepted by every restore, which checked only the archives of their groups.
Every target rank now checks each archive no group lists.
"""

import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typer.testing import CliRunner

import jaxreshard as jr
from jaxreshard._src.cli.commands import EXIT_ERROR, app
from tests._archive_util import describes, read_json, write_signed_json
from tests._core_util import device_mesh

OPT = optax.adam(1e-2)
W = np.arange(1, 7, dtype=np.float32)


def _records():
  params = {"w": jnp.asarray(W)}
  state = OPT.init(params)
  mu = {"w": jnp.asarray(W * 0.5)}
  state = (state[0]._replace(mu=mu, count=jnp.array(3, jnp.int32)), *state[1:])
  return jr.shard_state(OPT, params, state, world_size=4)


def _clock_alone(record):
  """A record of the same clock that lists no param: its mirrors empty."""
  s = record.state[0]
  return jr.ShardRecord(1, (), (s._replace(mu={}, nu={}), *record.state[1:]))


def _reads(path, tmp_path, verify=True):
  """Every way into a checkpoint on disk: name -> the error's message, or None."""
  mesh = device_mesh((4,), ("fsdp",))
  reads = {
    "load_records": lambda: jr.load_records(path),
    "digest": lambda: jr.digest(path),
    **{
      f"restore rank {r} of 3": (lambda r=r: jr.restore(path, world_size=3, rank=r))
      for r in range(3)
    },
    "restore_ranks": lambda: jr.restore_ranks(path, range(4), world_size=4),
    "restore_sharded": lambda: jr.restore_sharded(path, mesh, "fsdp"),
  }
  out = {}
  for name, read in reads.items():
    try:
      read()
    except jr.ReshardError as e:
      out[name] = str(e)
    else:
      out[name] = None
  clis = [["reshard", str(path), str(tmp_path / "o"), "-w", "3"]]
  if verify:
    clis.append(["verify", str(path), str(path)])
  for cli in clis:
    result = CliRunner().invoke(app, cli)
    out[f"CLI {cli[0]}"] = result.stderr if result.exit_code == EXIT_ERROR else None
  return out


def test_a_record_listing_no_param_saves_and_loads_on_every_path(tmp_path):
  path = tmp_path / "c"
  jr.save_records(path, [*_records(), _clock_alone(_records()[0])])
  assert jr.open_checkpoint(path).index.ungrouped == (4,)
  # (``verify`` is left out: its digest finds the archive's empty mirrors another
  # structure than archive 0's.)
  outcomes = _reads(path, tmp_path, verify=False)
  assert all(msg is None for msg in outcomes.values()), outcomes
  whole = jr.restore(path, world_size=1, rank=0).state[0]
  assert np.array_equal(np.asarray(whole.mu["w"]).view(np.uint32), (W * 0.5).view(np.uint32))
  assert int(whole.count) == 3


@pytest.mark.parametrize("damage", ["archive.json removed", "archive.json edited"])
def test_an_archive_listing_no_param_is_checked_by_every_target_rank(tmp_path, damage):
  path = tmp_path / "c"
  jr.save_records(path, [*_records(), _clock_alone(_records()[0])])
  meta = os.path.join(path, "archive_00004", "archive.json")
  if damage == "archive.json removed":
    os.remove(meta)
  else:
    with open(meta, "rb") as f:
      data = f.read()
    with open(meta, "wb") as f:
      f.write(data.replace(b'checkpoint"', b'checkpoinT"', 1))
  outcomes = _reads(path, tmp_path)
  accepted = [name for name, msg in outcomes.items() if msg is None]
  assert not accepted, accepted
  for name, msg in outcomes.items():
    assert "archive_00004" in msg or "archive 4" in msg, (name, msg)


def test_an_index_re_signed_to_list_an_archive_in_no_group_is_refused_on_every_path(tmp_path):
  path = tmp_path / "c"
  jr.save_records(path, _records())
  index = read_json(os.path.join(path, "jaxreshard.json"))
  index["archives"].append(["archive_00004", 0, 0])  # layout 0 holds histories of w
  write_signed_json(os.path.join(path, "jaxreshard.json"), index)
  for a, d in enumerate(describes(index)[:4]):  # the four archives there, re-signed
    meta_path = os.path.join(path, f"archive_{a:05d}", "archive.json")
    meta = read_json(meta_path)
    meta["describes"] = d
    write_signed_json(meta_path, meta)
  outcomes = _reads(path, tmp_path)
  accepted = [name for name, msg in outcomes.items() if msg is None]
  assert not accepted, accepted
  for name, msg in outcomes.items():
    assert "archive 4" in msg or "archive_00004" in msg, (name, msg)
  assert not os.path.exists(tmp_path / "o")
