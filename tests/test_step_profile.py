"""benchmarks/step_profile.py: kernels sorted into families (tiered_ops' own found from the kernel sources), and a
step of each variant timed and issued on the CPU; benchmarks/step_trace.py's reading of a trace and
benchmarks/step_memory.py's replay of a recorded step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_patch import needs_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import step_profile  # noqa: E402


@pytest.mark.parametrize("name, fam", [
    ("void rms_norm_v1_kernel<__nv_bfloat16, 8>(__nv_bfloat16 const*, float*, long)", "tiered_ops"),
    ("_rms_norm_rows", "tiered_ops"),
    ("ce_fwd_v2_kernel", "tiered_ops"),
    ("triton_red_fused__to_copy_add_mean_pow_0", "inductor"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "matmul"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reduction"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("Memset (Device)", "other"),
])
def test_kernel_families(name, fam):
    assert step_profile.family(name) == fam


def test_the_own_kernels_are_read_from_both_kernel_folders():
    assert {"_rms_norm_rows", "_ce_fwd", "rms_norm_v1_kernel", "reduce_partials_kernel"} <= step_profile.OWN


@needs_hf
def test_a_step_of_each_variant_on_the_cpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TIERED_OPS_DB", str(tmp_path / "s.sqlite"))
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    monkeypatch.setattr(sys, "argv", ["step_profile.py", "--model", "llama-tiny", "--seq", "16", "--reps", "2",
                                      "--variants", "stock,tiered", "--no-tune"])
    assert step_profile.main() == 0
    out = capsys.readouterr().out
    assert "llama-tiny train eager bf16 16 tokens on cpu" in out
    for v in ("stock", "tiered"):
        assert f"  {v:13s} step " in out and "host to issue it" in out


def _x(name, cat, ts, dur, tid=1, ext=None):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid,
            "args": {} if ext is None else {"External id": ext}}


def test_a_trace_gives_the_gpus_gaps_and_the_op_that_closed_each(tmp_path):
    import gzip
    import json

    from benchmarks import step_trace

    events = [
        _x("step", "user_annotation", 100, 400),
        _x("aten::mm", "cpu_op", 110, 20, ext=1),
        _x("aten::add", "cpu_op", 200, 10, ext=2),
        _x("aten::empty", "cpu_op", 202, 1, ext=3),  # nested in aten::add: not a top-level op
        _x("RmsNormBackward", "cpu_op", 300, 50, tid=2, ext=4),
        _x("old", "kernel", 50, 10, ext=9),  # before the step: not counted
        _x("gemm", "kernel", 130, 60, ext=1),  # idle 30 us from the start
        _x("add_kernel", "kernel", 190, 5, ext=2),  # no gap (1 us < 2)
        _x("norm_bwd", "kernel", 320, 80, ext=4),  # idle 125 us
        _x("inner", "kernel", 330, 10, ext=4),  # overlaps: adds no busy time
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    t = step_trace.analyze(step_trace.load(path))
    assert t.span_us == 300 and t.busy_us == 60 + 5 + 80
    assert [(g.at_us, g.us, g.op, g.before) for g in t.gaps] == [(95, 125, "RmsNormBackward", "add_kernel"),
                                                                  (0, 30, "aten::mm", "")]
    assert t.host_ops[0] == ("RmsNormBackward", 1, 50) and ("aten::empty", 1, 1) not in t.host_ops
    text = step_trace.render(t)
    assert "GPU busy 0.145 of 0.300 ms" in text and "idle    125.0 us at   0.095 ms, until RmsNormBackward" in text


def test_a_trace_without_a_step_range_is_refused():
    from benchmarks import step_trace

    with pytest.raises(ValueError, match="named 'step'"):
        step_trace.analyze([_x("gemm", "kernel", 0, 1)])


def test_a_recorded_step_replays_to_its_peak_and_the_blocks_alive_there():
    from benchmarks import step_memory

    def ev(action, addr, size, line=1):
        return {"action": action, "addr": addr, "size": size,
                "frames": [{"filename": "/x/torch/nn/f.py", "line": 9, "name": "inner"},
                           {"filename": "/m/model.py", "line": line, "name": "forward"}]}

    trace = [ev("alloc", 1, 100), ev("alloc", 2, 50, 7), ev("free_requested", 1, 100), ev("free_completed", 1, 100),
             ev("free_requested", 99, 30),  # held before the step: freed in it
             ev("alloc", 3, 60), ev("segment_alloc", 0, 4096)]
    stock = step_memory.Peak(stats=0, trace=trace, **step_memory.replay(trace))
    assert stock.requested == 150 and stock.live == {1: 100, 2: 50} and stock.held_freed == {}
    assert stock.at == "model.py:7 forward"
    other_trace = trace + [ev("alloc", 4, 500, 42)]
    other = step_memory.Peak(stats=0, trace=other_trace, **step_memory.replay(other_trace))
    assert other.requested == 580 and other.held_freed == {99: 30} and stock.where()[50] == "model.py:7 forward"
    diff = step_memory.differences(stock, other, ("stock", "tiered"))
    assert diff == ["alive at the peak:          500 B: stock 0, tiered 1  (model.py:42 forward)",
                    "alive at the peak:          100 B: stock 1, tiered 0  (model.py:1 forward)",
                    "alive at the peak:           60 B: stock 0, tiered 1  (model.py:1 forward)",
                    "held before, freed before the peak:           30 B: stock 0, tiered 1  (model.py:1 forward)",
                    "allocated in the step:          500 B: stock 0, tiered 1  (model.py:42 forward)",
                    "the peak reached at: stock model.py:7 forward, tiered model.py:42 forward"]


def test_a_saved_step_keeps_each_event_with_its_line(tmp_path):
    import gzip
    import json

    from benchmarks import step_memory

    trace = [{"action": "alloc", "addr": 1, "size": 100, "stream": 0,
              "frames": [{"filename": "/m/model.py", "line": 3, "name": "forward"}]},
             {"action": "free_requested", "addr": 1, "size": 100, "stream": 0, "frames": []}]
    step_memory.Peak(stats=512, trace=trace, **step_memory.replay(trace)).save(tmp_path / "p.json.gz")
    with gzip.open(tmp_path / "p.json.gz", "rt") as f:
        saved = json.load(f)
    assert saved["requested"] == 100 and saved["stats"] == 512 and saved["at"] == "model.py:3 forward"
    assert [e["line"] for e in saved["events"]] == ["model.py:3 forward", "?"]
