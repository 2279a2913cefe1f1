"""rotary_embedding, Triton tier: transformers' apply_rotary_pos_emb (rotate-half) of q and k in one launch, fp32
math, one rounding. With r = rotary_dim / 2 and a row x of head_dim elements (one (batch, head, position)):
out[j] = x[j] c[j] - x[j+r] s[j], out[j+r] = x[j+r] c[j+r] + x[j] s[j+r] for j < r, out[j] = x[j] past 2r.
Backward (the rotation by -sin): dx[j] = g[j] c[j] + g[j+r] s[j+r], dx[j+r] = g[j+r] c[j+r] - g[j] s[j].

Bytes: 1 read + 1 write of q and of k per element, cos and sin once per (batch, position) (cached across the heads).
Limits: q and k are read through their batch, head and position strides (a transpose's view in place); a last dim
that is not contiguous is copied first. cos and sin of batch 1 broadcast over the batch (stride 0). Outputs are
contiguous. 64-bit row offsets; the grid's second axis is q (0) and k (1).
Versions: v1 — ROWS rows of a tensor per program (up to 16, TILE pairs at most), the rotated halves and the
pass-through as separate tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_float, check_same
from .launch import Step, register_ops

OP = "rotary_embedding_triton"
BWD = "rotary_embedding_bwd_triton"
TILE = 1024  # rotated pairs a program takes (ROWS rows of HALF pairs): 8 a thread at 4 warps


@triton.jit
def _rope_rows(x_ptr, o_ptr, c_ptr, s_ptr, pid, n_rows, heads, seq, sxb, sxh, sxs, scb, scs, half, head_dim,
               BWD: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, ROWS: tl.constexpr):
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    rows = rows.to(tl.int64)
    b = rows // (heads * seq)
    h = (rows // seq) % heads
    s = rows % seq
    x_row = (b * sxb + h * sxh + s * sxs)[:, None]
    o_row = (rows * head_dim)[:, None]
    c_row = (b * scb + s * scs)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    mask = rmask[:, None] & (cols < half)
    x1 = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row + cols + half, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c_ptr + c_row + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + c_row + cols + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + c_row + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + c_row + cols + half, mask=mask, other=0.0).to(tl.float32)
    if BWD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(o_ptr + o_row + cols, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + o_row + cols + half, o2.to(o_ptr.dtype.element_ty), mask=mask)
    if PASS > 0:  # the dims past rotary_dim: copied
        pcols = 2 * half + tl.arange(0, PASS)[None, :]
        pmask = rmask[:, None] & (pcols < head_dim)
        v = tl.load(x_ptr + x_row + pcols, mask=pmask, other=0.0)
        tl.store(o_ptr + o_row + pcols, v.to(o_ptr.dtype.element_ty), mask=pmask)


@triton.jit
def _rotary_embedding(q_ptr, k_ptr, qo_ptr, ko_ptr, c_ptr, s_ptr, q_rows, k_rows, q_heads, k_heads, seq,
                      sqb, sqh, sqs, skb, skh, sks, scb, scs, half, head_dim,
                      BWD: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _rope_rows(q_ptr, qo_ptr, c_ptr, s_ptr, pid, q_rows, q_heads, seq, sqb, sqh, sqs, scb, scs, half, head_dim,
                   BWD, HALF, PASS, ROWS)
    else:
        _rope_rows(k_ptr, ko_ptr, c_ptr, s_ptr, pid, k_rows, k_heads, seq, skb, skh, sks, scb, scs, half, head_dim,
                   BWD, HALF, PASS, ROWS)


def _check(op: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qn: str, kn: str
           ) -> int:
    """The rotary_dim after the checks of q, k (4-D, one dtype and device, the same batch, seq, head_dim) and cos,
    sin ([batch or 1, seq, even rotary_dim <= head_dim], one dtype)."""
    check_float(op, qn, q)
    check_same(op, kn, k, q, qn)
    check_float(op, "cos", cos)
    check_float(op, "sin", sin)
    if q.dim() != 4 or k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        raise ValueError(f"{op}: {qn} and {kn} must be 4-D with one batch, seq and head_dim, got {list(q.shape)} and "
                         f"{list(k.shape)}")
    b, s, d = q.shape[0], q.shape[2], q.shape[3]
    if (cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1] != s or cos.shape[2] % 2
            or not 0 < cos.shape[2] <= d):
        raise ValueError(f"{op}: cos must have shape [batch or 1, seq, rotary_dim] with batch {b}, seq {s} and an even "
                         f"rotary_dim in 2..head_dim {d}, got {list(cos.shape)}")
    if sin.shape != cos.shape or sin.dtype != cos.dtype or cos.device != q.device or sin.device != q.device:
        raise ValueError(f"{op}: cos and sin must have one shape and dtype on {q.device}, got {cos.dtype} "
                         f"{list(cos.shape)} on {cos.device} and {sin.dtype} {list(sin.shape)} on {sin.device}")
    return cos.shape[2]


def _last_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _run(op: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bwd: bool
         ) -> tuple[torch.Tensor, torch.Tensor]:
    rd = _check(op, q, k, cos, sin, "dq" if bwd else "q", "dk" if bwd else "k")
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    b, hq, s, d = q.shape
    hk = k.shape[1]
    q_rows, k_rows = b * hq * s, b * hk * s
    if max(q_rows, k_rows) == 0:
        return qo, ko
    q, k = _last_dense(q), _last_dense(k)
    cos, sin = cos.contiguous(), sin.contiguous()
    half = rd // 2
    scb = 0 if cos.shape[0] == 1 else cos.stride(0)
    block = triton.next_power_of_2(half)
    rows = max(1, min(16, TILE // block))
    step = Step(_rotary_embedding, (triton.cdiv(max(q_rows, k_rows), rows), 2), 4, BWD=bwd, HALF=block,
                PASS=triton.next_power_of_2(d - rd) if d > rd else 0, ROWS=rows)
    step(False, q, k, qo, ko, cos, sin, q_rows, k_rows, hq, hk, s, q.stride(0), q.stride(1), q.stride(2),
         k.stride(0), k.stride(1), k.stride(2), scb, cos.stride(1), half, d)
    return qo, ko


def rotary_embedding_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed). The launcher as a plain function: the op below registers it; called bare it is the
    unregistered contrast."""
    return _run(OP, q, k, cos, sin, False)


def rotary_embedding_bwd_launch(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of q, grad of k) from the gradients of q_embed and k_embed: the rotation by -sin."""
    return _run(BWD, dq, dk, cos, sin, True)


rotary_embedding_triton, rotary_embedding_bwd_triton = register_ops(
    "rotary_embedding", rotary_embedding_launch, rotary_embedding_bwd_launch)
