import pytest
import torch
import triton
import triton.language as tl
from helpers import DTYPES, IMPLS, assert_like_truth, assert_matches, assert_trains_like_truth, device_for, gpu, truth64

import tiered_ops
from tiered_ops.ops.segment_sum import _problem as P
from tiered_ops.ops.segment_sum import offsets_for
from triton_src.segment_sum import WAYS, _find2, search_steps

EAGERS = ["eager_segment_reduce"]  # the second eager implementation, beside the reference
PROBLEMS = [  # the declaration's edge problems, and more
    *tiered_ops.get_op("segment_sum").edge_problems(),
    P((64, 64), segments=4),  # a few short segments: the segment role only
    P((300, 8), segments=1000),  # more segments than rows: most empty, several per program
    P((5000, 64), segments=100, lengths="powerlaw"),  # long segments sharing ranges, both partial slots used
    P((513, 256), segments=2),  # the widest column block (256)
    P((20, 300), segments=3),  # D above 256: two column blocks
    P((0, 8), segments=5),  # E = 0: every sum is 0
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS + EAGERS)
def test_matches_float64(impl, dtype, problem):
    assert_matches("segment_sum", impl, problem, dtype)


GRAD_PROBLEMS = [P((1000, 16), segments=1), P((5000, 8), segments=100, lengths="powerlaw"), P((40, 3), segments=90)]


@pytest.mark.parametrize("problem", GRAD_PROBLEMS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", IMPLS + EAGERS)
def test_gradients_match_float64(impl, dtype, problem):
    assert_matches("segment_sum", impl, problem, dtype, seed=5, grad=True)


def test_compile_tier_forward_and_backward():
    assert_matches("segment_sum", "compile", P((777, 5), segments=37, lengths="powerlaw"), torch.float32, grad=True)


def test_a_giant_segment_over_more_ranges_than_one_combine_step_reads(monkeypatch):
    """Chunks of 16 rows: 5000 rows are 313 ranges, more than the combine adds in one tile (256 at D = 16)."""
    import triton_src.segment_sum as kern

    monkeypatch.setattr(kern, "MIN_CHUNK", 16)
    assert kern.chunk_rows(5000) == 16
    assert_matches("segment_sum", "triton", P((5000, 16), segments=3, lengths="powerlaw"), torch.float32, grad=True)


@pytest.mark.parametrize("impl", IMPLS + EAGERS)
def test_boundaries_on_chunk_edges(impl):
    """With 1300 rows the kernels cut at 256: a segment of exactly 256 rows (the longest summed whole), an empty one
    on a range edge, a long one from one range edge to another, and a long one crossing the last edge."""
    dev = device_for(impl)
    fn = tiered_ops.get_op("segment_sum").impls[impl].fn
    values = torch.randn(1300, 8, device=dev, requires_grad=True)
    offsets = torch.tensor([0, 256, 256, 1024, 1300], device=dev)
    assert_trains_like_truth("segment_sum", fn(values, offsets), (values, offsets), 1e-6, 1e-6)


@pytest.mark.parametrize("impl", IMPLS + EAGERS)
def test_non_contiguous_values(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("segment_sum").impls[impl].fn
    values = torch.randn(16, 300, device=dev).t()[:, 3:19]  # [300, 16], rows 16 elements apart, column offset 3
    offsets = offsets_for(300, 7, "uniform", 0).to(dev)
    assert_like_truth(fn(values, offsets), truth64("segment_sum", values, offsets), 1e-6)


@gpu
@pytest.mark.parametrize("impl", ["eager", "eager_segment_reduce", "triton", "cuda"])
def test_malformed_offsets_on_the_gpu_stay_in_bounds(impl):
    """Contract of every tier on the GPU: offsets are not read on the host; malformed ones give some sums
    (unspecified) and no fault: the context is healthy afterwards."""
    fn = tiered_ops.get_op("segment_sum").impls[impl].fn
    values = torch.randn(3000, 16, device="cuda")
    for bad in ([0, 2000, 100, 3000], [-50, 10, 5000], [7, 7, 7], [0, 10**12, 3000]):
        out = fn(values, torch.tensor(bad, device="cuda"))
        assert out.shape == (len(bad) - 1, 16)
    torch.cuda.synchronize()
    good = torch.tensor([0, 1000, 3000], device="cuda")
    assert_like_truth(fn(values, good), truth64("segment_sum", values, good), 1e-5)


@gpu
@pytest.mark.parametrize("problem", [P((1 << 22, 64), segments=1 << 18, lengths="powerlaw"),
                                     P((1 << 20, 128), segments=1), P((1 << 20, 33), segments=1 << 19)], ids=str)
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_large_problems_on_the_gpu(impl, problem):
    assert_matches("segment_sum", impl, problem, torch.bfloat16, grad=True)


def test_inputs_are_drawn_from_the_seed():
    spec = tiered_ops.get_op("segment_sum")
    p = P((4096, 8), segments=256, lengths="powerlaw")
    a, b = (spec.make_inputs(p, torch.float32, torch.device("cpu"), s) for s in (1, 1))
    c = spec.make_inputs(p, torch.float32, torch.device("cpu"), 2)
    assert torch.equal(a.args[1], b.args[1]) and not torch.equal(a.args[1], c.args[1])
    for dist in ("uniform", "powerlaw"):
        off = offsets_for(1 << 16, 1 << 12, dist, 0)
        lengths = off.diff()
        assert off[0] == 0 and off[-1] == 1 << 16 and off.dtype == torch.int64 and bool((lengths >= 0).all())
        top = lengths.sort(descending=True).values
        if dist == "powerlaw":  # a few segments hold most rows, many are empty
            assert top[:10].sum() > 0.5 * (1 << 16) and (lengths == 0).sum() > 1 << 10
        else:  # every length near the mean of 16
            assert top[0] < 16 * 16 and (lengths == 0).sum() < 1 << 9


def test_problem_of_a_call_and_its_bucket():
    spec = tiered_ops.get_op("segment_sum")
    p = P((4096, 8), segments=256, lengths="powerlaw")
    inp = spec.make_inputs(p, torch.float32, torch.device("cpu"), 0)
    assert spec.problem_of(*inp.args) == P((4096, 8), segments=256)  # a call's lengths are not read
    assert spec.bucket(p) == spec.bucket(P((4096, 8), segments=256)) == (4096, 8, 256)
    assert str(p) == "4096x8,lengths=powerlaw,segments=256" and P((32, 4)).kw["segments"] == 2
    for bad, says in [(dict(segments=0), "segments must be >= 1"), (dict(lengths="zipf"), "lengths must be one of")]:
        with pytest.raises(ValueError, match=says):
            P((32, 4), **bad)
    with pytest.raises(ValueError, match="values must be 2-D"):
        P((32, 4, 2))


def test_public_op_trains(private_store):
    values = torch.randn(600, 24, requires_grad=True)
    offsets = offsets_for(600, 9, "powerlaw", 3)
    tiered_ops.set_tuning(False)  # nothing measured: the eager tier
    try:
        out = tiered_ops.segment_sum(values, offsets)
    finally:
        tiered_ops.set_tuning(None)
    assert_trains_like_truth("segment_sum", out, (values, offsets), 1e-5, 1e-6)


@triton.jit
def _probe(off_ptr, rows_ptr, out_ptr, S, n_steps):
    i = tl.program_id(0)
    sa, sb = _find2(off_ptr, tl.load(rows_ptr + 2 * i), tl.load(rows_ptr + 2 * i + 1), S, n_steps)
    tl.store(out_ptr + 2 * i, sa)
    tl.store(out_ptr + 2 * i + 1, sb)


def _search(offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The Triton tier's segment search (``_find2``) of each row in ``rows`` (paired two by two), on its device."""
    S = offsets.shape[0] - 1
    out = torch.full_like(rows, -1)
    _probe[(rows.shape[0] // 2,)](offsets, rows, out, S, search_steps(S, WAYS.value))
    return out


@pytest.mark.parametrize("segments,dist", [(1, "uniform"), (63, "powerlaw"), (64, "uniform"), (65, "powerlaw"),
                                           (5000, "powerlaw"), (4097, "uniform")])
def test_segment_search_finds_the_last_segment_starting_at_or_before_each_row(segments, dist):
    """The k-way search against torch.searchsorted: empty segments (equal offsets) resolve to the last of them that
    starts at or before the row, as the split needs (the segment that holds the row)."""
    rows_total = 20000
    offsets = offsets_for(rows_total, segments, dist, segments)
    dev = device_for("triton")
    rows = torch.cat([torch.tensor([0, rows_total - 1]), torch.randint(0, rows_total, (198,)), offsets[:-1][:100]])
    rows = rows[: rows.shape[0] // 2 * 2]
    want = torch.searchsorted(offsets[:-1], rows, right=True) - 1
    assert torch.equal(_search(offsets.to(dev), rows.to(dev)).cpu(), want)


def test_segment_search_stays_in_range_on_malformed_offsets():
    offsets = torch.tensor([5, 3, 900, -7, 40, 40, 2, 10**12, 0])
    rows = torch.tensor([0, 1, 4, 39, 40, 899, 10**6, 2**40])
    dev = device_for("triton")
    got = _search(offsets.to(dev), rows.to(dev)).cpu()
    assert bool(((got >= 0) & (got < offsets.shape[0] - 1)).all())


def test_search_steps_cover_the_segments():
    assert [search_steps(s, 64) for s in (1, 64, 65, 4096, 4097, 1 << 18)] == [1, 1, 2, 2, 3, 3]
