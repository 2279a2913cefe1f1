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
