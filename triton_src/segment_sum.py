"""segment_sum, Triton tier: out[s, :] = sum of values[offsets[s]:offsets[s + 1], :], fp32 sums, one rounding.
Backward: dvalues[e, :] = dout[segment of e, :] (a broadcast per segment, no arithmetic).

Skew: the rows are split at a chunk of CH rows (256 to 4096, growing with E so that there are at most ~1024 row
ranges). A segment of at most CH rows (short, or empty) is summed whole by one program of the segment role; a longer
one is summed by the programs of the row ranges it crosses (ranges of CH rows, a fixed grid over E): each writes an
fp32 partial (and records the long segment that starts in its range, if any), and a second launch adds the partials
of each long segment, in range order, and writes its sum. So no
program sums more than CH rows, one giant segment is spread over E / CH programs, and many empty segments are many
programs that store zeros; no atomics, so the result does not depend on scheduling. Chosen over a row-parallel pass
with atomics: the giant segment would take E / CH atomic adds on the same D addresses, serialized at the L2, in a
buffer that needs zeroing and a rounding pass for 16-bit outputs, and the sum would change from run to run.
A range holds pieces of at most two long segments (the one holding its first row and the one holding its last: a
segment longer than CH that lies in a range must cross one of its ends), so the partials are (2 per range, D) fp32,
followed by one int64 per range: the long segment starting in it, or -1.
The backward needs no combine: each program broadcasts dout rows over the rows it owns.

Bytes: values read once (E * D), out written once (S * D), offsets (S + 1); partials 2 * D fp32 per range at most.
Backward: dout read (S * D), dvalues written (E * D).
Contract: offsets are checked on the host only on the CPU (the interpreter), where reading them costs no sync. On a
GPU they are not read on the host: malformed offsets (unsorted, offsets[0] != 0, offsets[-1] != E) give unspecified
sums, never an access out of bounds: every boundary is clamped to [0, E] and every segment id stays in [0, S).
Limits: any E and D (D in blocks of up to 256 columns over the grid's second dim); 64-bit row offsets.
Versions: v1: segment role + row-range role in one launch, one combine launch when E > CH. v2: the segment holding
a row found by a 64-way search (log64 S dependent loads where a binary search takes log2 S). v3: the range programs
record the long segment starting in their range, so a combine program reads one id instead of searching.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tiered_ops.ops.segment_sum import check_boundaries

from .common import check_float
from .launch import Plans, Step, register_ops

MIN_CHUNK, MAX_CHUNK, RANGES = 256, 4096, 1024
WAYS = tl.constexpr(64)  # the segment search's fan-out: offsets loaded per row per step
TILE = 4096  # fp32 elements of a program's accumulator tile (32 per thread at 4 warps)


@triton.jit
def _bounds(off_ptr, s, E):
    """Rows [start, end) of segment s, clamped to [0, E] (malformed offsets stay in bounds)."""
    start = tl.minimum(tl.maximum(tl.load(off_ptr + s), 0), E)
    end = tl.minimum(tl.maximum(tl.load(off_ptr + s + 1), start), E)
    return start, end


@triton.jit
def _find2(off_ptr, row_a, row_b, S, n_steps):
    """The segments holding rows ``row_a`` and ``row_b``, each the last s in [0, S) with offsets[s] <= row (some s in
    [0, S) for malformed offsets), both at once: a WAYS-way search, one load of WAYS offsets per row a step, so
    n_steps >= log_WAYS S dependent loads where a binary search takes log2 S."""
    q = tl.arange(0, 2)
    row = tl.where(q == 0, row_a, row_b)
    lo = row * 0
    hi = lo + S - 1
    k = tl.arange(0, WAYS)
    for _ in range(n_steps):
        stride = (hi - lo + WAYS) // WAYS  # ceil(width / WAYS): the answer lies in [lo, hi], width hi - lo + 1
        idx = lo[:, None] + stride[:, None] * k[None, :]
        inside = idx <= hi[:, None]
        v = tl.load(off_ptr + idx, mask=inside, other=0)
        below = tl.sum((inside & (v <= row[:, None])).to(tl.int32), axis=1)  # probes at or below the row
        lo = lo + stride * tl.maximum(below - 1, 0)
        hi = tl.minimum(hi, lo + stride - 1)
    return tl.sum(tl.where(q == 0, lo, 0), axis=0), tl.sum(tl.where(q == 1, lo, 0), axis=0)


def search_steps(S: int, k: int) -> int:
    """Steps of a k-way search over S segments: the least n with k ** n >= S (at least 1)."""
    n, reach = 1, k
    while reach < S:
        n, reach = n + 1, reach * k
    return n


@triton.jit
def _sum_rows(x_ptr, r0, r1, D, cols, cmask, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Column sums (fp32) of rows [r0, r1) of x."""
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for r in range(r0, r1, BLOCK_R):
        rows = r + tl.arange(0, BLOCK_R)
        m = (rows < r1)[:, None] & cmask[None, :]
        acc += tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _fill_rows(y_ptr, r0, r1, D, cols, cmask, g, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [r0, r1) of y set to the row vector g."""
    tile = tl.zeros([BLOCK_R, BLOCK_D], g.dtype) + g[None, :]
    for r in range(r0, r1, BLOCK_R):
        rows = r + tl.arange(0, BLOCK_R)
        m = (rows < r1)[:, None] & cmask[None, :]
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], tile, mask=m)


@triton.jit
def _piece(src_ptr, dst_ptr, s, slot, r0, r1, D, cols, cmask, BWD: tl.constexpr, BLOCK_R: tl.constexpr,
           BLOCK_D: tl.constexpr):
    """Rows [r0, r1) of segment s. Forward: their column sums into row ``slot`` of dst (out, or the fp32 partials).
    Backward: dout's row s into those rows of dst (dvalues)."""
    if BWD:
        g = tl.load(src_ptr + s * D + cols, mask=cmask, other=0.0)
        _fill_rows(dst_ptr, r0, r1, D, cols, cmask, g, BLOCK_R, BLOCK_D)
    else:
        tot = _sum_rows(src_ptr, r0, r1, D, cols, cmask, BLOCK_R, BLOCK_D)
        tl.store(dst_ptr + slot * D + cols, tot.to(dst_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _split(src_ptr, off_ptr, seg_ptr, range_ptr, E, D, S, CH, seg_progs, n_steps, SEGS: tl.constexpr,
           BWD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Programs [0, seg_progs): SEGS segments each, those of at most CH rows whole (slot s of seg). Programs after:
    # row range p = [p * CH, p * CH + CH), the pieces of long segments in it: the one holding its first row (slot 2p
    # of range) and the one holding its last row, when another (slot 2p + 1). Forward: the range's int64 after the
    # partials says which long segment starts in the range (the one holding its last row), or -1.
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    if pid < seg_progs:
        for j in range(SEGS):
            s = pid.to(tl.int64) * SEGS + j
            if s < S:
                start, end = _bounds(off_ptr, s, E)
                if end - start <= CH:
                    _piece(src_ptr, seg_ptr, s, s, start, end, D, cols, cmask, BWD, BLOCK_R, BLOCK_D)
    else:
        p = (pid - seg_progs).to(tl.int64)
        lo = p * CH
        hi = tl.minimum(lo + CH, E)
        sa, sb = _find2(off_ptr, lo, hi - 1, S, n_steps)
        b_start, b_end = _bounds(off_ptr, sb, E)
        if not BWD:
            if tl.program_id(1) == 0:
                ranges = (tl.num_programs(0) - seg_progs).to(tl.int64)
                starts_ptr = (range_ptr + 2 * ranges * D).to(tl.pointer_type(tl.int64))
                tl.store(starts_ptr + p, tl.where((b_end - b_start > CH) & (b_start >= lo), sb, -1))
        a_start, a_end = _bounds(off_ptr, sa, E)
        if a_end - a_start > CH:
            _piece(src_ptr, range_ptr, sa, 2 * p, lo, tl.minimum(a_end, hi), D, cols, cmask, BWD, BLOCK_R, BLOCK_D)
        if (sb != sa) & (b_end - b_start > CH):
            _piece(src_ptr, range_ptr, sb, 2 * p + 1, tl.maximum(b_start, lo), hi, D, cols, cmask, BWD, BLOCK_R,
                   BLOCK_D)


@triton.jit
def _segment_sum_fwd(x_ptr, off_ptr, out_ptr, ws_ptr, E, D, S, CH, seg_progs, n_steps, SEGS: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Short segments summed whole into out; long ones as fp32 partials per row range in ws (summed by the combine).
    _split(x_ptr, off_ptr, out_ptr, ws_ptr, E, D, S, CH, seg_progs, n_steps, SEGS, False, BLOCK_R, BLOCK_D)


@triton.jit
def _segment_sum_combine(ws_ptr, off_ptr, out_ptr, E, D, CH, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program q: the long segment that starts in row range q (at most one: it holds the range's last row), as the
    # range's program recorded it after the partials (-1: none), its partials summed in range order: ws[2q] or
    # ws[2q + 1] (slot 0 when it also holds the range's first row), then slot 0 of every later range it crosses.
    q = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    lo = q * CH
    starts_ptr = (ws_ptr + 2 * tl.num_programs(0).to(tl.int64) * D).to(tl.pointer_type(tl.int64))
    s = tl.load(starts_ptr + q)
    if s >= 0:  # then segment s has more than CH rows and starts in [lo, lo + CH)
        start, end = _bounds(off_ptr, s, E)
        slot = tl.where(start == lo, 0, 1)
        first = tl.load(ws_ptr + (2 * q + slot) * D + cols, mask=cmask, other=0.0)
        last = (end - 1) // CH + 1
        acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
        for r in range(q + 1, last, BLOCK_P):
            rr = r + tl.arange(0, BLOCK_P)
            m = (rr < last)[:, None] & cmask[None, :]
            acc += tl.load(ws_ptr + (2 * rr)[:, None] * D + cols[None, :], mask=m, other=0.0)
        tl.store(out_ptr + s * D + cols, (first + tl.sum(acc, axis=0)).to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _segment_sum_bwd(dout_ptr, off_ptr, dx_ptr, E, D, S, CH, seg_progs, n_steps, SEGS: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # The forward's split: a short segment's rows by its segment program, a long one's by the row ranges it crosses.
    _split(dout_ptr, off_ptr, dx_ptr, dx_ptr, E, D, S, CH, seg_progs, n_steps, SEGS, True, BLOCK_R, BLOCK_D)


def chunk_rows(E: int) -> int:
    """CH: a power of two from MIN_CHUNK to MAX_CHUNK that cuts E rows into at most about RANGES ranges."""
    return min(MAX_CHUNK, max(MIN_CHUNK, triton.next_power_of_2(max(1, triton.cdiv(E, RANGES)))))


def _check(op: str, name: str, t: torch.Tensor, offsets: torch.Tensor) -> int:
    """``t`` (values or dout) 2-D float, offsets 1-D int64 on its device (their values where that costs no sync): S."""
    check_float(op, name, t)
    if t.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D [rows, D], got shape {list(t.shape)}")
    if offsets.dtype != torch.int64:
        raise TypeError(f"{op}: offsets must be an int64 tensor of S + 1 boundaries, got dtype {offsets.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        raise ValueError(f"{op}: offsets must be 1-D with S + 1 >= 1 boundaries, got shape {list(offsets.shape)}")
    if offsets.device != t.device:
        raise ValueError(f"{op}: offsets must be on {name}'s device {t.device}, got {offsets.device}")
    return offsets.shape[0] - 1


def _check_cpu_boundaries(op: str, offsets: torch.Tensor, rows: int) -> None:
    """Where reading them costs no sync (the CPU interpreter): offsets[0] == 0, offsets[-1] == rows, sorted."""
    if offsets.is_cpu:
        check_boundaries(offsets, rows, op)


def _settings(E: int, D: int, S: int) -> dict:
    """Chunk, grid and block sizes of both directions (plain ints: constexprs, even where the shapes are symbolic)."""
    E, D, S = int(E), int(D), int(S)
    block_d = min(256, max(16, triton.next_power_of_2(max(D, 1))))
    block_r = max(1, min(256, TILE // block_d))
    ch = chunk_rows(E)
    ranges = triton.cdiv(E, ch) if E > ch else 0  # no segment is longer than CH when E <= CH
    mean = triton.next_power_of_2(max(1, E // max(S, 1)))
    segs = max(1, min(8, block_r // mean))  # short segments: a few per program
    return dict(block_d=block_d, block_r=block_r, ch=ch, ranges=ranges, segs=segs, seg_progs=triton.cdiv(S, segs),
                d_blocks=triton.cdiv(D, block_d), n_steps=search_steps(S, WAYS.value))


# One launch plan per direction (checks, kernels, grids, constexprs, int arguments) and one host function that
# launches from it: the registered ops (triton_op, wrap_triton) make the plan per call, the eager fast path
# (segment_sum_fast, the kept compiled kernels) once per (shapes, dtypes, device). The offsets' values are checked
# (on the CPU) on every call.
class Plan(NamedTuple):
    steps: tuple[Step, ...]  # () when there is nothing to compute; the forward's combine step when E > CH
    ints: tuple  # the main kernel's int arguments after the pointers
    combine_ints: tuple
    ranges: int  # row ranges (rows of the fp32 partials: 2 per range)
    S: int


def _steps(kernel: object, E: int, D: int, S: int, combine: bool) -> Plan:
    c = _settings(E, D, S)
    steps = [Step(kernel, (c["seg_progs"] + c["ranges"], c["d_blocks"]), 4, SEGS=c["segs"], BLOCK_R=c["block_r"],
                  BLOCK_D=c["block_d"])]
    if combine and c["ranges"]:
        steps.append(Step(_segment_sum_combine, (c["ranges"], c["d_blocks"]), 4, BLOCK_P=max(1, TILE // c["block_d"]),
                          BLOCK_D=c["block_d"]))
    return Plan(tuple(steps), (E, D, S, c["ch"], c["seg_progs"], c["n_steps"]), (E, D, c["ch"]), c["ranges"], S)


def plan_fwd(values: torch.Tensor, offsets: torch.Tensor) -> Plan:
    S = _check("segment_sum_triton", "values", values, offsets)
    E, D = values.shape
    if S == 0 or D == 0:
        return Plan((), (), (), 0, S)
    return _steps(_segment_sum_fwd, E, D, S, combine=True)


def plan_bwd(dout: torch.Tensor, offsets: torch.Tensor, rows: int) -> Plan:
    op = "segment_sum_bwd_triton"
    S = _check(op, "dout", dout, offsets)
    if dout.shape[0] != S:
        raise ValueError(f"{op}: dout must have one row per segment ({S}), got shape {list(dout.shape)}")
    D = dout.shape[1]
    if S == 0 or D == 0 or rows == 0:
        return Plan((), (), (), 0, S)
    return _steps(_segment_sum_bwd, rows, D, S, combine=False)


def _fwd(plan: Plan, direct: bool, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    _check_cpu_boundaries("segment_sum_triton", offsets, values.shape[0])
    x, off = values.contiguous(), offsets.contiguous()
    out = x.new_empty((plan.S, x.shape[1]))
    if not plan.steps:
        return out
    # The partials (2 per row range) and the ranges' int64 ids. Without row ranges nothing is written through that
    # pointer, so a direct launch passes out (a traced launch gets its own buffer: no aliased arguments).
    ws = out if direct and not plan.ranges else x.new_empty((max(1, 2 * plan.ranges * (x.shape[1] + 1)),),
                                                             dtype=torch.float32)
    plan.steps[0](direct, x, off, out, ws, *plan.ints)
    if len(plan.steps) > 1:
        plan.steps[1](direct, ws, off, out, *plan.combine_ints)
    return out


def _bwd(plan: Plan, direct: bool, dout: torch.Tensor, offsets: torch.Tensor, rows: int) -> torch.Tensor:
    _check_cpu_boundaries("segment_sum_bwd_triton", offsets, rows)
    g, off = dout.contiguous(), offsets.contiguous()
    dx = g.new_empty((rows, g.shape[1]))
    if plan.steps:
        plan.steps[0](direct, g, off, dx, *plan.ints)
    return dx


def segment_sum_launch(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The launcher as a plain function: the op below registers it; called bare it is the unregistered contrast."""
    return _fwd(plan_fwd(values, offsets), False, values, offsets)


def segment_sum_bwd_launch(dout: torch.Tensor, offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """dvalues [rows, D]: each row the dout row of its segment."""
    return _bwd(plan_bwd(dout, offsets, rows), False, dout, offsets, rows)


segment_sum_triton, segment_sum_bwd_triton = register_ops("segment_sum", segment_sum_launch, segment_sum_bwd_launch)

_fwd_plans, _bwd_plans = Plans(plan_fwd), Plans(plan_bwd)


def segment_sum_fast(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """segment_sum_launch for eager callers: the plan kept per key, the kernels launched directly."""
    key = (values.shape, values.dtype, values.get_device(), offsets.shape, offsets.dtype, offsets.get_device())
    plan = _fwd_plans.get(key) or _fwd_plans.new(key, values, offsets)
    return _fwd(plan, True, values, offsets)


def segment_sum_bwd_fast(dout: torch.Tensor, offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """segment_sum_bwd_launch for eager callers."""
    key = (dout.shape, dout.dtype, dout.get_device(), offsets.shape, offsets.dtype, offsets.get_device(), rows)
    plan = _bwd_plans.get(key) or _bwd_plans.new(key, dout, offsets, rows)
    return _bwd(plan, True, dout, offsets, rows)
