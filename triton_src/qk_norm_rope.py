"""qk_norm_rope, Triton tier: Qwen3's per-head RMSNorm of q and k (transformers' Llama form) then the rotate-half
rotary embedding, q and k in one launch, fp32 math. A row is one (batch, head, position) of d = head_dim elements,
h = d / 2: r = rsqrt(mean(x^2) + eps), y = round(x r) w, out[j] = y[j] c[j] - y[j+h] s[j],
out[j+h] = y[j+h] c[j+h] + y[j] s[j+h].
Backward, with g the output gradient: gy = the rotation of g by -sin, gw = sum over rows of gy x r (per program,
summed by torch), dx = r (gy w - x r mean(gy w x r)).

Bytes: forward 1 read + 1 write of q and k, cos and sin once per (batch, position); backward 2 reads + 1 write.
Limits: head_dim up to 2 * 4096 (a row in registers); q and k read through their strides (last dim contiguous, else
copied); outputs contiguous; partial weight gradients (programs, head_dim) fp32.
Versions: v1 — ROWS rows per program (TILE pairs at most), the row's halves as two tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_float
from .launch import Step, register_ops
from .rotary_embedding import TILE, _check, _last_dense

OP = "qk_norm_rope_triton"
BWD = "qk_norm_rope_bwd_triton"


@triton.jit
def _rows_of(pid, n_rows, heads, seq, sxb, sxh, sxs, scb, scs, head_dim, HALF: tl.constexpr, ROWS: tl.constexpr):
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    rows = rows.to(tl.int64)
    b = rows // (heads * seq)
    h = (rows // seq) % heads
    s = rows % seq
    cols = tl.arange(0, HALF)[None, :]
    mask = rmask[:, None] & (cols < head_dim // 2)
    return (b * sxb + h * sxh + s * sxs)[:, None], (rows * head_dim)[:, None], (b * scb + s * scs)[:, None], cols, mask


@triton.jit
def _norm_rope_rows(x_ptr, o_ptr, w_ptr, c_ptr, s_ptr, pid, n_rows, heads, seq, sxb, sxh, sxs, scb, scs, head_dim,
                    eps, HALF: tl.constexpr, ROWS: tl.constexpr):
    x_row, o_row, c_row, cols, mask = _rows_of(pid, n_rows, heads, seq, sxb, sxh, sxs, scb, scs, head_dim, HALF, ROWS)
    half = head_dim // 2
    x1 = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row + cols + half, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim + eps)[:, None]
    cm = cols < half
    w1 = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + cols + half, mask=cm, other=0.0).to(tl.float32)
    y1 = (x1 * r).to(o_ptr.dtype.element_ty).to(tl.float32) * w1  # rounded to the input's dtype, then the weight
    y2 = (x2 * r).to(o_ptr.dtype.element_ty).to(tl.float32) * w2
    c1 = tl.load(c_ptr + c_row + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + c_row + cols + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + c_row + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + c_row + cols + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + o_row + cols, (y1 * c1 - y2 * s1).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + o_row + cols + half, (y2 * c2 + y1 * s2).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope(q_ptr, k_ptr, qo_ptr, ko_ptr, wq_ptr, wk_ptr, c_ptr, s_ptr, q_rows, k_rows, q_heads, k_heads, seq,
                  sqb, sqh, sqs, skb, skh, sks, scb, scs, head_dim, eps, HALF: tl.constexpr, ROWS: tl.constexpr):
    eps = tl.cast(eps, tl.float32)  # Inductor passes float arguments as fp64
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _norm_rope_rows(q_ptr, qo_ptr, wq_ptr, c_ptr, s_ptr, pid, q_rows, q_heads, seq, sqb, sqh, sqs, scb, scs,
                        head_dim, eps, HALF, ROWS)
    else:
        _norm_rope_rows(k_ptr, ko_ptr, wk_ptr, c_ptr, s_ptr, pid, k_rows, k_heads, seq, skb, skh, sks, scb, scs,
                        head_dim, eps, HALF, ROWS)


@triton.jit
def _norm_rope_bwd_rows(g_ptr, x_ptr, dx_ptr, w_ptr, pw_ptr, c_ptr, s_ptr, pid, n_rows, heads, seq, sxb, sxh, sxs,
                        scb, scs, head_dim, eps, HALF: tl.constexpr, ROWS: tl.constexpr):
    x_row, o_row, c_row, cols, mask = _rows_of(pid, n_rows, heads, seq, sxb, sxh, sxs, scb, scs, head_dim, HALF, ROWS)
    half = head_dim // 2
    x1 = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row + cols + half, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim + eps)[:, None]
    g1 = tl.load(g_ptr + o_row + cols, mask=mask, other=0.0).to(tl.float32)  # g is contiguous
    g2 = tl.load(g_ptr + o_row + cols + half, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c_ptr + c_row + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + c_row + cols + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + c_row + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + c_row + cols + half, mask=mask, other=0.0).to(tl.float32)
    gy1 = g1 * c1 + g2 * s2  # the rotation by -sin
    gy2 = g2 * c2 - g1 * s1
    cm = cols < half
    w1 = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + cols + half, mask=cm, other=0.0).to(tl.float32)
    n1, n2 = x1 * r, x2 * r
    a1, a2 = gy1 * w1, gy2 * w2
    m = ((tl.sum(a1 * n1, axis=1) + tl.sum(a2 * n2, axis=1)) / head_dim)[:, None]
    tl.store(dx_ptr + o_row + cols, (r * (a1 - n1 * m)).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + o_row + cols + half, (r * (a2 - n2 * m)).to(dx_ptr.dtype.element_ty), mask=mask)
    base = pid.to(tl.int64) * head_dim + cols
    tl.store(pw_ptr + base, tl.sum(gy1 * n1, axis=0)[None, :], mask=cm)
    tl.store(pw_ptr + base + half, tl.sum(gy2 * n2, axis=0)[None, :], mask=cm)


@triton.jit
def _qk_norm_rope_bwd(gq_ptr, gk_ptr, q_ptr, k_ptr, dq_ptr, dk_ptr, wq_ptr, wk_ptr, pq_ptr, pk_ptr, c_ptr, s_ptr,
                      q_rows, k_rows, q_heads, k_heads, seq, sqb, sqh, sqs, skb, skh, sks, scb, scs, head_dim, eps,
                      HALF: tl.constexpr, ROWS: tl.constexpr):
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _norm_rope_bwd_rows(gq_ptr, q_ptr, dq_ptr, wq_ptr, pq_ptr, c_ptr, s_ptr, pid, q_rows, q_heads, seq, sqb, sqh,
                            sqs, scb, scs, head_dim, eps, HALF, ROWS)
    else:
        _norm_rope_bwd_rows(gk_ptr, k_ptr, dk_ptr, wk_ptr, pk_ptr, c_ptr, s_ptr, pid, k_rows, k_heads, seq, skb, skh,
                            sks, scb, scs, head_dim, eps, HALF, ROWS)


def _check_all(op: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wq: torch.Tensor,
               wk: torch.Tensor) -> int:
    d = q.shape[-1] if q.dim() else 0
    if _check(op, q, k, cos, sin, "q", "k") != d:
        raise ValueError(f"{op}: cos must be as wide as head_dim {d}, got {list(cos.shape)}")
    for name, w in (("q_weight", wq), ("k_weight", wk)):
        check_float(op, name, w)
        if tuple(w.shape) != (d,) or w.dtype != q.dtype or w.device != q.device:
            raise ValueError(f"{op}: {name} must be a [{d}] tensor of {q.dtype} on {q.device}, got {w.dtype} "
                             f"{list(w.shape)} on {w.device}")
    return d


def _grid(q: torch.Tensor, k: torch.Tensor, d: int) -> tuple[int, int, int]:
    """(programs, rows a program, HALF)."""
    block = triton.next_power_of_2(d // 2)
    rows = max(1, min(16, TILE // block))
    return triton.cdiv(max(q.shape[0] * q.shape[1] * q.shape[2], k.shape[0] * k.shape[1] * k.shape[2]), rows), rows, \
        block


def _geometry(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> tuple:
    b, hq, s, d = q.shape
    hk = k.shape[1]
    return (b * hq * s, b * hk * s, hq, hk, s, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            k.stride(2), 0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1), d)


def qk_norm_rope_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed). The launcher as a plain function: the op below registers it."""
    d = _check_all(OP, q, k, cos, sin, q_weight, k_weight)
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if qo.numel() + ko.numel() == 0:
        return qo, ko
    q, k, cos, sin = _last_dense(q), _last_dense(k), cos.contiguous(), sin.contiguous()
    programs, rows, block = _grid(q, k, d)
    Step(_qk_norm_rope, (programs, 2), 4, HALF=block, ROWS=rows)(
        False, q, k, qo, ko, q_weight.contiguous(), k_weight.contiguous(), cos, sin, *_geometry(q, k, cos), eps)
    return qo, ko


def qk_norm_rope_bwd_launch(dq: torch.Tensor, dk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad of q, grad of k, grad of q_weight, grad of k_weight) from the gradients of q_embed and k_embed."""
    d = _check_all(BWD, q, k, cos, sin, q_weight, k_weight)
    for name, g, x in (("dq", dq, q), ("dk", dk, k)):
        check_float(BWD, name, g)
        if g.shape != x.shape or g.dtype != x.dtype or g.device != x.device:
            raise ValueError(f"{BWD}: {name} must be like its input {x.dtype} {list(x.shape)}, got {g.dtype} "
                             f"{list(g.shape)}")
    gq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    gk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if gq.numel() + gk.numel() == 0:
        return gq, gk, torch.zeros_like(q_weight), torch.zeros_like(k_weight)
    q, k, cos, sin = _last_dense(q), _last_dense(k), cos.contiguous(), sin.contiguous()
    programs, rows, block = _grid(q, k, d)
    pq = torch.empty((programs, d), dtype=torch.float32, device=q.device)
    pk = torch.empty((programs, d), dtype=torch.float32, device=q.device)
    Step(_qk_norm_rope_bwd, (programs, 2), 4, HALF=block, ROWS=rows)(
        False, dq.contiguous(), dk.contiguous(), q, k, gq, gk, q_weight.contiguous(), k_weight.contiguous(), pq, pk,
        cos, sin, *_geometry(q, k, cos), eps)
    return gq, gk, pq.sum(0).to(q_weight.dtype), pk.sum(0).to(k_weight.dtype)


qk_norm_rope_triton, qk_norm_rope_bwd_triton = register_ops("qk_norm_rope", qk_norm_rope_launch,
                                                            qk_norm_rope_bwd_launch)
