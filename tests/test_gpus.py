"""Current and archived GPUs as data (reports/gpus.toml): the current GPUs' evidence gates `tiered-ops check` and CI,
an archived GPU's is reported for information and never fails; compare and report mark it archived."""

from pathlib import Path

import pandas as pd
import pytest
from test_check import SMALL, SPEC, SUMMARY, _frame

from tiered_ops.analysis import gpus as gpu_list
from tiered_ops.analysis import territories as terr
from tiered_ops.cli.cli import main

ROOT = Path(__file__).resolve().parent.parent
TOML = """# current and archived
current = ["nvidia-h200"]  # gates

[archived.nvidia-h100]
tree = "abc1234"   # its last sweep
date = "2026-11-28"
"""


@pytest.fixture
def small(monkeypatch):
    """The check over one crafted territory of softmax's CUDA kernel, nothing retired."""
    import tiered_ops.analysis.check as chk

    for mod in (terr, chk):
        monkeypatch.setattr(mod, "TERRITORIES", (SMALL,))
        monkeypatch.setattr(mod, "RETIRED", {})


def _gpu_rows(gpu_name: str, cuda_us: float = 100.0, **kw) -> pd.DataFrame:
    return _frame(cuda_us=cuda_us, device=f"{gpu_name}|cc9.0", **kw).assign(gpu_name=gpu_name)


def _reports(tmp_path, h200=None, h100=None, toml=TOML) -> Path:
    """A reports folder: gpus.toml and each GPU's results.csv."""
    reports = tmp_path / "reports"
    for name, df in (("nvidia-h200", h200), ("nvidia-h100", h100)):
        if df is not None:
            (reports / name).mkdir(parents=True)
            df.to_csv(reports / name / "results.csv", index=False)
    reports.mkdir(exist_ok=True)
    (reports / "gpus.toml").write_text(toml)
    return reports


def _change_the_kernel_source(monkeypatch):
    """What a commit editing cuda_src/softmax.cu does to the tree: the CUDA kernel's source hash moves on."""
    monkeypatch.setattr(SPEC.impls["cuda"], "_hash", "feedfacefeedface")


# ------------------------------------------------------------------------------------------------ the acceptance
def test_a_kernel_source_change_with_fresh_current_gpu_evidence_passes(tmp_path, small, monkeypatch, capsys):
    old_h200, old_h100 = _gpu_rows("NVIDIA H200"), _gpu_rows("NVIDIA H100 80GB HBM3")
    _change_the_kernel_source(monkeypatch)
    fresh_h200 = _gpu_rows("NVIDIA H200")  # measured again at the new tree: the new hash
    reports = _reports(tmp_path, fresh_h200, old_h100)
    assert main(["check", "--all", str(reports)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "nvidia-h100: archived (last swept at tree abc1234 on 2026-11-28" in out
    assert any(line.startswith("info softmax cuda [stale]: 2 rows of NVIDIA H100 80GB HBM3") for line in lines)
    assert "gated on the current GPUs' evidence: nvidia-h200" in out and "FAIL" not in out
    assert SUMMARY.match(lines[-1]).groups() == ("1", "2", "1", "0")
    assert (old_h200.source_hash != fresh_h200.source_hash).any()


def test_the_same_change_without_fresh_current_gpu_evidence_fails_naming_its_rows(tmp_path, small, monkeypatch,
                                                                                  capsys):
    h200, h100 = _gpu_rows("NVIDIA H200"), _gpu_rows("NVIDIA H100 80GB HBM3")
    _change_the_kernel_source(monkeypatch)
    reports = _reports(tmp_path, h200, h100)
    assert main(["check", "--all", str(reports)]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert any(line.startswith("FAIL softmax cuda [stale]: 2 rows of NVIDIA H200 measured source") for line in fails)
    assert any("[no-evidence]: does not hold softmax.small" in line for line in fails)
    assert not any("H100" in line for line in fails)
    # one file at a time, as CI did before: the H200's fails, the H100's does not
    assert main(["check", "--results", str(reports / "nvidia-h200" / "results.csv")]) == 1
    assert main(["check", "--results", str(reports / "nvidia-h100" / "results.csv")]) == 0


def test_an_archived_gpus_staleness_and_losses_never_fail(tmp_path, small, monkeypatch, capsys):
    lost = _gpu_rows("NVIDIA H100 80GB HBM3", 149.0, problems=("16x4096,dim=-1",))  # a loss inside the territory
    h100 = pd.concat([_gpu_rows("NVIDIA H100 80GB HBM3"), lost])
    _change_the_kernel_source(monkeypatch)
    reports = _reports(tmp_path, None, h100)
    assert main(["check", "--all", str(reports)]) == 0
    out = capsys.readouterr().out
    assert "nvidia-h200: current, but no" in out and "nothing gated" in out and "FAIL" not in out
    info = [line for line in out.splitlines() if line.startswith("info ")]
    assert len(info) == 2 and "[stale]: 3 rows of NVIDIA H100" in info[0] and "softmax.small" in info[1]
    assert main(["check", "--results", str(reports / "nvidia-h100" / "results.csv")]) == 0
    capsys.readouterr()
    # brought back: moving it to `current` is the whole change, and then its staleness gates
    (reports / "gpus.toml").write_text('current = ["nvidia-h200", "nvidia-h100"]\n')
    assert main(["check", "--all", str(reports)]) == 1
    assert "FAIL softmax cuda [stale]: 3 rows of NVIDIA H100 80GB HBM3" in capsys.readouterr().out


def test_rows_are_judged_by_their_own_gpu_whatever_file_holds_them(tmp_path, small, monkeypatch, capsys):
    """A file with rows of both GPUs: the H100's stale rows inform, the H200's fresh rows gate; files without a
    gpu_name column take their folder's GPU; no gpus.toml anywhere: every GPU is current, as before."""
    h100 = _gpu_rows("NVIDIA H100 80GB HBM3")
    _change_the_kernel_source(monkeypatch)
    both = pd.concat([h100, _gpu_rows("NVIDIA H200")])
    reports = _reports(tmp_path)
    (reports / "nvidia-h200").mkdir()
    both.to_csv(reports / "nvidia-h200" / "results.csv", index=False)
    assert main(["check", "--results", str(reports / "nvidia-h200" / "results.csv")]) == 0
    assert "info softmax cuda [stale]: 2 rows of NVIDIA H100" in capsys.readouterr().out
    bare = tmp_path / "elsewhere" / "nvidia-h100"
    bare.mkdir(parents=True)
    h100.drop(columns="gpu_name").to_csv(bare / "results.csv", index=False)
    assert main(["check", "--results", str(bare / "results.csv")]) == 1  # no gpus.toml: current
    capsys.readouterr()
    assert main(["check", "--results", str(bare / "results.csv"), "--gpus", str(reports / "gpus.toml")]) == 0
    assert "nvidia-h100: archived" in capsys.readouterr().out


def test_ci_gates_through_check_all_reports():
    text = (ROOT / ".ci" / "run").read_text()
    assert '-m tiered_ops check --all reports' in text and "results.csv\"" not in text


# ----------------------------------------------------------------------------------------------------- the file
def test_the_committed_file_names_the_h200_current_and_the_h100_archived():
    g = gpu_list.load(ROOT / "reports" / "gpus.toml")
    assert g.current == ("nvidia-h200",) and set(g.archived) == {"nvidia-h100"}
    a = g.archived["nvidia-h100"]
    assert len(a.tree) >= 7 and pd.Timestamp(a.date) <= pd.Timestamp.now()
    for gpu in g.current + tuple(g.archived):  # each names a folder of evidence
        assert (ROOT / "reports" / gpu / "results.csv").is_file()
    assert g.name(pd.read_csv(ROOT / "reports/nvidia-h100/results.csv").gpu_name.iloc[0]) == "nvidia-h100"
    assert g.name(pd.read_csv(ROOT / "reports/nvidia-h200/results.csv").gpu_name.iloc[0]) == "nvidia-h200"
    assert g.of_file(ROOT / "reports/nvidia-h100/training/results.csv") == "nvidia-h100"
    assert gpu_list.find(ROOT / "reports/nvidia-h100/training/results.csv") == ROOT / "reports" / "gpus.toml"


def test_the_subset_parser_reads_what_tomllib_reads_and_names_what_it_cannot():
    tomllib = pytest.importorskip("tomllib")
    for text in (TOML, (ROOT / "reports" / "gpus.toml").read_text()):
        assert gpu_list.parse_subset(text) == tomllib.loads(text)
    with pytest.raises(ValueError, match="line 2"):
        gpu_list.parse_subset('current = ["a"]\ncurrent = 3\n')


def test_without_tomllib_the_file_loads_the_same(monkeypatch):
    """Python 3.10 has no tomllib: the subset parser reads the committed file to the same GPUs."""
    import sys

    want = gpu_list.load(ROOT / "reports" / "gpus.toml")
    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` now raises ModuleNotFoundError
    assert gpu_list.load(ROOT / "reports" / "gpus.toml") == want


def test_names_and_an_unlisted_gpu():
    g = gpu_list.load(None)
    assert g.current == () and g.is_current("nvidia-h100") and g.path is None
    g = gpu_list.Gpus(("nvidia-h200",), {"nvidia-h100": gpu_list.Archived("nvidia-h100", "t", "d")})
    assert g.name("NVIDIA H100 80GB HBM3") == "nvidia-h100" and g.name("NVIDIA H1000") == "nvidia-h1000"
    assert g.is_current("NVIDIA A100-SXM4-80GB") and not g.is_current("nvidia-h100") and g.name(float("nan")) is None


@pytest.mark.parametrize("text, error", [
    ('current = ["nvidia-h200"]\n[archived.nvidia-h100]\ndate = "2026-11-28"\n', "needs tree and date"),
    ('current = ["nvidia-h100"]\n[archived.nvidia-h100]\ntree = "a"\ndate = "b"\n', "both current and archived"),
    ('current = "nvidia-h200"\n', "expected `current = "),
    ('currant = ["nvidia-h200"]\n', "unknown keys: currant"),
    ('current = [nvidia-h200\n', "gpus: .*gpus.toml: "),
])
def test_a_malformed_file_is_named(tmp_path, text, error, capsys):
    f = tmp_path / "reports" / "gpus.toml"
    f.parent.mkdir()
    f.write_text(text)
    with pytest.raises(ValueError, match=error):
        gpu_list.load(f)
    assert main(["check", "--all", str(f.parent)]) == 2
    assert "error: gpus: " in capsys.readouterr().err


def test_ci_on_the_committed_reports_gates_the_h200_and_reports_the_h100(capsys):
    assert main(["check", "--all", str(ROOT / "reports")]) == 0
    out = capsys.readouterr().out
    assert "nvidia-h100: archived (last swept at tree" in out and "FAIL" not in out
    assert "gated on the current GPUs' evidence: nvidia-h200\n" in out and SUMMARY.match(out.splitlines()[-1])


def test_compare_and_report_read_archived_evidence_and_mark_it(tmp_path):
    h200 = _gpu_rows("NVIDIA H200").assign(torch_version="t", triton_version="tr", copy_gbps=1000.0)
    h100 = _gpu_rows("NVIDIA H100 80GB HBM3").assign(torch_version="t", triton_version="tr", copy_gbps=1000.0)
    reports = _reports(tmp_path, h200, h100)
    out = tmp_path / "compare.md"
    assert main(["compare", "--results", str(reports / "nvidia-h100" / "results.csv"),
                 str(reports / "nvidia-h200" / "results.csv"), "--out", str(out)]) == 0
    text = out.read_text()
    assert "**Archived GPU** `nvidia-h100` (last swept at tree abc1234 on 2026-11-28)" in text
    assert "| nvidia-h100 (archived) winner us | nvidia-h200 winner us |" in text and "| softmax | 1x4096 |" in text
    assert "`nvidia-h200`" in text and "**Archived GPU** `nvidia-h200`" not in text
    real = pd.read_csv(ROOT / "tests/data/h100-dab8732-results.csv")  # real GPU rows: every column
    real = real[(real.op == "muladd") & (real.dtype == "fp32")]
    for gpu, marked in (("nvidia-h100", True), ("nvidia-h200", False)):
        folder = reports / gpu
        real.to_csv(folder / "results.csv", index=False)
        assert main(["report", "--results", str(folder / "results.csv"), "--out", str(folder), "--command", "x"]) == 0
        title, note = (folder / "README.md").read_text().splitlines()[:3:2]
        assert title.startswith("# NVIDIA H") and note.startswith("**Archived GPU** (last swept at tree") == marked


def test_check_all_of_a_folder_without_evidence_and_bad_arguments(tmp_path, capsys):
    reports = _reports(tmp_path)
    assert main(["check", "--all", str(reports)]) == 0
    out = capsys.readouterr().out
    assert "nvidia-h200: current, but no" in out and "no GPU evidence to check" in out
    assert main(["check", "--all", str(tmp_path / "missing")]) == 2
    assert main(["check", "--all", str(reports), "--results", str(reports / "gpus.toml")]) == 2
    assert "error: check needs --results" in capsys.readouterr().err
