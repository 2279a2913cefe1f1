"""scripts/gpu.sh on a CPU machine: what it does before any stage (the peers' parts), run as a device call runs it."""

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("xz") is None, reason="the script unpacks with tar xJf, which needs xz")
def test_a_peer_tree_in_parts_is_unpacked_once_every_part_has_come(tmp_path):
    # A peer tarball too large to travel beside the tree comes in parts, one a call on the same machine: each call keeps
    # its part; the call that brings the last one unpacks the tree (and puts it on the peers' path); none before it.
    work = tmp_path / "work"
    (work / "scripts").mkdir(parents=True)
    (work / "scripts" / "gpu.sh").write_text((ROOT / "scripts" / "gpu.sh").read_text())
    pkg = tmp_path / "tree" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text("X = 1\n")
    tarball = tmp_path / "lib-1.0.tar.xz"
    with tarfile.open(tarball, "w:xz") as t:
        t.add(pkg, arcname="pkg")
    data = tarball.read_bytes()
    parts = [data[k * len(data) // 3 : (k + 1) * len(data) // 3] for k in range(3)]
    peer_tmp = tmp_path / "machine_tmp"
    unpacked = peer_tmp / "peer_trees" / "lib-1.0" / "pkg" / "mod.py"
    for k in (2, 0, 1):  # in any order
        carried = work / ".whl-cutlass" / "parts"
        if carried.exists():
            for f in carried.iterdir():
                f.unlink()
        carried.mkdir(parents=True, exist_ok=True)
        (carried / f"lib-1.0.tar.xz.{k}-of-3").write_bytes(parts[k])
        env = {**os.environ, "PEER_TMP": str(peer_tmp), "OUT": str(tmp_path / f"out{k}")}
        r = subprocess.run(["bash", "scripts/gpu.sh", "peers"], cwd=work, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"peer part kept for the next call: .whl-cutlass/parts/lib-1.0.tar.xz.{k}-of-3" in r.stdout
        if k != 1:
            came = 1 if k == 2 else 2
            assert f"peer parts of lib-1.0.tar.xz here: {came} of 3" in r.stdout, r.stdout
            assert not unpacked.exists()
    assert "peer tree unpacked from 3 parts: lib-1.0.tar.xz" in r.stdout, r.stdout
    assert unpacked.read_text() == "X = 1\n"
    assert (peer_tmp / "site" / "pkg" / "mod.py").read_text() == "X = 1\n"


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("xz") is None or shutil.which("git") is None, reason="needs git and xz")
def test_a_sweep_resumes_from_a_store_that_only_git_history_holds(tmp_path):
    """A superseded sweep's store is dropped from reports/ once a later sweep replaces it: RESUME_DB=<commit>:<path>
    unpacks it from that commit (decompressing .xz) into .gpu_state/ and resumes from it; a device machine, which gets
    the working tree without its history, finds it there when the call carries .gpu_state."""
    import sqlite3

    work = tmp_path / "work"
    (work / "scripts").mkdir(parents=True)
    for name in ("gpu.sh", "gpu_state.sh"):
        (work / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    (work / ".gitignore").write_text("/.gpu_state/\n")
    store = work / "reports" / "gpu-x" / "sweep-old" / "store.sqlite"
    store.parent.mkdir(parents=True)
    with sqlite3.connect(store) as c:
        c.execute("CREATE TABLE results (x INTEGER)")
        c.execute("INSERT INTO results VALUES (41), (42)")
    c.close()
    subprocess.run(["xz", str(store)], check=True)
    _git(work, "init", "-q")
    _git(work, "add", "-A")
    _git(work, "commit", "-q", "-m", "a sweep")
    sha = _git(work, "rev-parse", "--short", "HEAD")
    _git(work, "rm", "-rq", "reports/gpu-x/sweep-old")
    _git(work, "commit", "-q", "-m", "superseded")

    def gpu(cwd: Path, resume: str, out: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "TIERED_OPS_DB"}  # the store: $OUT/store.sqlite
        env.update(RESUME_DB=resume, OUT=str(tmp_path / out), PEER_TMP=str(tmp_path / "peer"))
        return subprocess.run(["bash", "scripts/gpu.sh", "peers"], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=300)

    def rows(db: Path) -> list[int]:
        with sqlite3.connect(db) as c:
            return [r[0] for r in c.execute("SELECT x FROM results ORDER BY x")]

    spec = f"{sha}:reports/gpu-x/sweep-old/store.sqlite.xz"
    r = gpu(work, spec, "out1")
    assert r.returncode == 0, r.stdout + r.stderr
    unpacked = f".gpu_state/{sha}/reports/gpu-x/sweep-old/store.sqlite"
    assert f"resuming from {unpacked}" in r.stdout
    assert rows(tmp_path / "out1" / "store.sqlite") == [41, 42]
    assert _git(work, "status", "--porcelain") == ""  # .gpu_state is ignored

    device = tmp_path / "device"  # the working tree without .git, .gpu_state carried
    shutil.copytree(work, device, ignore=shutil.ignore_patterns(".git"))
    r = gpu(device, spec, "out2")
    assert r.returncode == 0 and f"resuming from {unpacked}" in r.stdout, r.stdout + r.stderr
    assert rows(tmp_path / "out2" / "store.sqlite") == [41, 42]
    shutil.rmtree(device / ".gpu_state")  # not carried: said, and no sweep starts from an empty store
    r = gpu(device, spec, "out3")
    assert r.returncode == 2 and "no git history here" in r.stderr + r.stdout
    r = gpu(work, f"{sha}:reports/gpu-x/sweep-none/store.sqlite", "out4")
    assert r.returncode == 2 and "no such file at commit" in r.stderr + r.stdout
