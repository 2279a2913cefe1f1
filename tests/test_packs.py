"""Decision packs: export, import into a fresh store, the same decisions with tuning off; refusals of rows whose
source or measurement method is not the installed one; no duplicates; packs of two GPUs in one store; the CLI."""

import argparse
import json

import pytest
import torch

import tiered_ops
from tiered_ops.cli.decisions import add_decisions_parser, cmd_decisions
from tiered_ops.decide import packs
from tiered_ops.measure.fingerprint import Fingerprint, fingerprint
from tiered_ops.measure.measure import base_row
from tiered_ops.method import METHOD_VERSION
from tiered_ops.store.rows import from_pack
from tiered_ops.store.store import Store
from tiered_ops.tiers.catalog import get_op

SOFTMAX = get_op("softmax")
CPU = torch.device("cpu")


def _rows(shape, times, fp=None, **extra):
    """Timed rows of softmax at ``shape``: ``times`` maps implementation -> caller us (None: failed)."""
    problem = SOFTMAX.problem(shape)
    out = []
    for name, us in times.items():
        row = base_row(SOFTMAX, SOFTMAX.impls[name], problem, torch.float32, "fwd_nograd", fp or fingerprint(CPU))
        row.update(ok=0, reason="wrong output") if us is None else row.update(ok=1, p50_us=us, caller_us=us)
        out.append(row | extra)
    return out


def _filled(path):
    store = Store(path)
    store.add(_rows((64, 300), {"eager": 9.0, "again": 3.0}) + _rows((1024, 64), {"eager": 2.0, "again": None}))
    return store


def _decide(path, shape):
    tiered_ops.use_store(str(path))
    sel = tiered_ops.select_backend("softmax", shape, "fp32", "cpu", tune=False)
    return sel.name, [(c["impl"], c["caller_us"], c["ok"]) for c in sel.record["candidates"]]


def test_a_pack_round_trips_to_the_same_decisions_with_tuning_off(two_softmaxes, tmp_path):
    here, there = tmp_path / "here.sqlite", tmp_path / "there.sqlite"
    _filled(here).put_meta("softmax", "again", fingerprint(CPU).key, SOFTMAX.impls["again"].source_hash, {"loc": 3})
    before = [_decide(here, s) for s in ((64, 300), (1024, 64))]
    assert [b[0] for b in before] == ["again", "eager"]
    pack = packs.export_pack(Store(here), tmp_path / "pack.json")
    assert {(d["bucket"][0], d["chosen"]) for d in pack["decisions"]} == {(64, "again"), (1024, "eager")}
    assert pack["method"] == METHOD_VERSION and pack["source_hashes"]["softmax"]["again"]
    result = packs.import_pack(tmp_path / "pack.json", Store(there))
    assert (result.added, result.duplicates, result.refused) == (4, 0, [])
    assert [_decide(there, s) for s in ((64, 300), (1024, 64))] == before
    assert Store(there).get_meta("softmax", "again", fingerprint(CPU).key, SOFTMAX.impls["again"].source_hash) == \
        {"loc": 3}
    imported = Store(there).rows()
    assert {r["origin"] for r in imported} == {"pack:pack.json"}
    assert all(from_pack(r) for r in imported)
    assert not any(from_pack(r) for r in Store(here).rows())


def test_a_second_import_adds_nothing_and_a_store_keeps_its_own_rows_once(two_softmaxes, tmp_path):
    packs.export_pack(_filled(tmp_path / "here.sqlite"), tmp_path / "pack.json")
    store = Store(tmp_path / "there.sqlite")
    assert packs.import_pack(tmp_path / "pack.json", store).added == 4
    again = packs.import_pack(tmp_path / "pack.json", store)
    assert (again.added, again.duplicates) == (0, 4) and store.count() == 4
    own = packs.import_pack(tmp_path / "pack.json", Store(tmp_path / "here.sqlite"))
    assert own.added == 0 and Store(tmp_path / "here.sqlite").count() == 4  # its own measurements


def test_rows_of_another_source_or_method_are_refused_with_the_reason(two_softmaxes, tmp_path):
    packs.export_pack(_filled(tmp_path / "here.sqlite"), tmp_path / "pack.json")
    pack = json.loads((tmp_path / "pack.json").read_text())
    pack["rows"][0]["source_hash"] = "0123456789abcdef"
    pack["rows"][1]["method"] = METHOD_VERSION + 1
    pack["rows"][2]["impl"] = "retired_long_ago"
    (tmp_path / "pack.json").write_text(json.dumps(pack))
    result = packs.import_pack(tmp_path / "pack.json", Store(tmp_path / "there.sqlite"))
    reasons = [why for _, why in result.refused]
    assert result.added == 1 and len(reasons) == 3
    assert any("measured with source 0123456789abcdef, the installed source is" in why for why in reasons), reasons
    assert any(f"measured with measurement method {METHOD_VERSION + 1}" in why for why in reasons), reasons
    assert any("no implementation 'retired_long_ago'" in why for why in reasons), reasons


def test_packs_of_two_gpus_coexist_in_one_store(two_softmaxes, tmp_path):
    gpus = {name: Fingerprint("cuda", name, cc, 132, torch.__version__, "3.6.0", "13.0", "a host")
            for name, cc in (("NVIDIA H100 80GB HBM3", "9.0"), ("NVIDIA H200", "9.0"))}
    fleet = Store(tmp_path / "fleet.sqlite")
    fleet.add(_rows((64, 300), {"eager": 9.0, "again": 3.0}, gpus["NVIDIA H100 80GB HBM3"])
              + _rows((64, 300), {"eager": 2.0, "again": 5.0}, gpus["NVIDIA H200"]))
    for slug in ("nvidia-h100-80gb-hbm3", "nvidia-h200"):
        pack = packs.export_pack(fleet, tmp_path / f"{slug}.json", gpu=slug)
        assert len(pack["devices"]) == 1 and len(pack["rows"]) == 2
    with pytest.raises(ValueError, match="no row of 'A100'.*NVIDIA H100 80GB HBM3, NVIDIA H200"):
        packs.export_pack(fleet, tmp_path / "none.json", gpu="A100")
    store = Store(tmp_path / "mine.sqlite")
    for slug in ("nvidia-h100-80gb-hbm3", "nvidia-h200"):
        assert packs.import_pack(tmp_path / f"{slug}.json", store).added == 2
    bucket = base_row(SOFTMAX, SOFTMAX.impls["eager"], SOFTMAX.problem((64, 300)), torch.float32, "fwd_nograd",
                      fingerprint(CPU))["bucket"]
    fastest = {fp.name: min(store.latest("softmax", bucket, "fp32", fp.key, "fwd_nograd"), key=lambda r: r["caller_us"])
               ["impl"] for fp in gpus.values()}
    assert fastest == {"NVIDIA H100 80GB HBM3": "again", "NVIDIA H200": "eager"}


def test_load_decisions_fills_the_store_model_code_uses(two_softmaxes, tmp_path, private_store):
    packs.export_pack(_filled(tmp_path / "here.sqlite"), tmp_path / "pack.json")
    assert packs.load_decisions(tmp_path / "pack.json").added == 4  # TIERED_OPS_DB: the test's private store
    assert _decide(private_store, (64, 300))[0] == "again"


def test_a_file_that_is_not_a_pack_is_an_error_naming_it(tmp_path):
    (tmp_path / "x.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="x.json: not a decision pack"):
        packs.import_pack(tmp_path / "x.json", Store(tmp_path / "s.sqlite"))


def _cli(*argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--db")
    add_decisions_parser(parser.add_subparsers(dest="cmd"))
    return cmd_decisions(parser.parse_args(list(argv)))


def test_the_cli_exports_imports_and_prints_refusals(two_softmaxes, tmp_path, capsys):
    _filled(tmp_path / "here.sqlite").close()
    pack = tmp_path / "pack.json"
    assert _cli("--db", str(tmp_path / "here.sqlite"), "decisions", "export", "--out", str(pack)) == 0
    assert "wrote 2 decisions (4 measurements, 1 device(s))" in capsys.readouterr().out
    assert _cli("--db", str(tmp_path / "there.sqlite"), "decisions", "import", str(pack)) == 0
    assert "4 measurement(s) added, 0 already stored, 0 refused" in capsys.readouterr().out
    data = json.loads(pack.read_text())
    data["rows"][0]["source_hash"] = "0123456789abcdef"
    pack.write_text(json.dumps(data))
    assert _cli("--db", str(tmp_path / "other.sqlite"), "decisions", "import", str(pack)) == 1
    err = capsys.readouterr().err
    assert "refused 1: softmax" in err and "measured with source 0123456789abcdef" in err
