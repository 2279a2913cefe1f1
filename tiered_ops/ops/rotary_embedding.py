"""rotary_embedding(q, k, cos, sin) -> (q_embed, k_embed): transformers' ``apply_rotary_pos_emb`` (rotate-half).

q [batch, heads, seq, head_dim] and k [batch, kv_heads, seq, head_dim] as the attention passes them (views of a
transpose are taken as they are); cos and sin [batch or 1, seq, rotary_dim], broadcast over the heads (transformers'
``unsqueeze_dim=1``). With r = rotary_dim / 2, x1 = x[..., :r], x2 = x[..., r:2r]:
``x_embed[..., :2r] = x[..., :2r] * cos + cat(-x2, x1) * sin`` and the dims past rotary_dim pass through unchanged
(partial rotary, as the models with ``partial_rotary_factor`` < 1 apply it). q and k share a dtype; cos and sin share
theirs (another floating dtype than q's is promoted as torch does). The kernel tiers compute in fp32 and round once.
Backward (the kernel tiers): the rotation by -sin, dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1; cos and sin get no
gradient (transformers computes them without grad: one that requires grad is refused).
Bucket: (batch x seq rounded up to a power of two, heads, kv_heads, head_dim, rotary_dim).
Bytes: read q, k, write q_embed, k_embed (+ cos and sin once). Backward: the same with dq_embed, dk_embed in and dq, dk
out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..registry import BadInput, Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ._common import call, floating, gen, randn, same_device, values

OP = "rotary_embedding"


def validate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The contract of a call (every tier): q, k 4-D floating of one dtype and device with the same batch, seq and
    head_dim; cos, sin of one shape [batch or 1, seq, rotary_dim] (rotary_dim even, <= head_dim) and one dtype, not
    requiring grad."""
    check_rope(OP, q, k, cos, sin)


def check_rope(op: str, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``validate``'s checks, their errors naming ``op`` (an op that takes these arguments too)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        floating(op, name, t)
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        same_device(op, name, t, q, "q")
    if q.dim() != 4:
        raise ValueError(f"{op}: q must be 4-D [batch, heads, seq, head_dim], got shape {list(q.shape)}")
    if k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        raise ValueError(f"{op}: k must be 4-D [batch, kv_heads, seq, head_dim] with q's batch, seq and head_dim "
                         f"{[q.shape[0], q.shape[2], q.shape[3]]}, got shape {list(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{op}: k must have the dtype of q ({q.dtype}), got {k.dtype}")
    if sin.dtype != cos.dtype:
        raise TypeError(f"{op}: sin must have the dtype of cos ({cos.dtype}), got {sin.dtype}")
    b, s, d = q.shape[0], q.shape[2], q.shape[3]
    if (cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1] != s or cos.shape[2] % 2
            or not 0 < cos.shape[2] <= d):
        raise ValueError(f"{op}: cos must have shape [batch or 1, seq, rotary_dim] with batch {b}, seq {s} and an even "
                         f"rotary_dim in 2..head_dim {d}, got {list(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"{op}: sin must have the shape of cos {list(cos.shape)}, got {list(sin.shape)}")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(f"{op}: cos and sin must not require grad (the op differentiates q and k only)")


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager tier and reference: transformers' apply_rotary_pos_emb, the dims past cos's width passed through."""
    c, s, r = cos.unsqueeze(1), sin.unsqueeze(1), cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot = x[..., :r]
        x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
        out = x_rot * c + torch.cat((-x2, x1), dim=-1) * s
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)

    return rotate(q), rotate(k)


def _problem(shape: tuple[int, ...], kv_heads: int | None = None, rotary_dim: int | None = None) -> Problem:
    """q's shape [batch, heads, seq, head_dim] (fewer dims: its trailing ones, the rest 1, as a generic (rows, n)
    problem is taken); kv_heads defaults to heads, rotary_dim to the even part of head_dim (all of it when even)."""
    shape = tuple(shape)
    if not 1 <= len(shape) <= 4:
        raise ValueError(f"{OP}: shape must be q's [batch, heads, seq, head_dim], got {list(shape)}")
    shape = (1,) * (4 - len(shape)) + shape
    kv = shape[1] if kv_heads is None else int(kv_heads)
    rd = shape[3] - shape[3] % 2 if rotary_dim is None else int(rotary_dim)
    if kv < 0 or rd % 2 or not 0 < rd <= shape[3]:
        raise ValueError(f"{OP}: kv_heads must be >= 0 and rotary_dim even in 2..head_dim {shape[3]}, got "
                         f"kv_heads={kv}, rotary_dim={rd}")
    return make_problem(shape, kv_heads=kv, rotary_dim=rd)


def _problem_of(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Problem:
    return _problem(tuple(q.shape), k.shape[1], cos.shape[-1])


def _bucket(p: Problem) -> tuple:
    b, h, s, d = p.shape
    return pow2_ceil(b * s), h, p.kw["kv_heads"], d, p.kw["rotary_dim"]


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    b, h, s, d = p.shape
    kv, rd = p.kw["kv_heads"], p.kw["rotary_dim"]
    # q and k as the attention makes them: [batch, seq, heads, head_dim] projections viewed through a transpose
    q = randn((b, s, h, d), dtype, device, g).transpose(1, 2)
    k = randn((b, s, kv, d), dtype, device, g).transpose(1, 2)
    # cos and sin as transformers' rotary embedding makes them: angles pos * inv_freq, each half repeated
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, device=device, dtype=torch.float32) / rd))
    pos = torch.arange(s, device=device, dtype=torch.float32)[None, :] + torch.randint(
        0, 4096, (b, 1), generator=g, device=device).float()
    emb = torch.cat(((pos[..., None] * inv_freq),) * 2, dim=-1)
    return Inputs((q, k, emb.cos().to(dtype), emb.sin().to(dtype)))


def _elems(p: Problem) -> tuple[int, int]:
    b, h, s, d = p.shape
    return b * s * d * (h + p.kw["kv_heads"]), 2 * b * s * p.kw["rotary_dim"]


def _bytes(p: Problem, dt: torch.dtype) -> int:
    qk, cs = _elems(p)
    return (2 * qk + cs) * dt.itemsize


def _kernel_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    return q, k, cos, sin


def _fake(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


def _bwd_fake(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake(dq, dk, cos, sin)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, cos, sin = inputs
    ctx.shapes = (q.shape, k.shape, q.dtype)
    ctx.save_for_backward(cos, sin)


def _backward_for(bwd: Callable[..., tuple]) -> Callable[..., tuple]:
    def backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None) -> tuple:
        cos, sin = ctx.saved_tensors
        q_shape, k_shape, dtype = ctx.shapes
        dq = cos.new_zeros(q_shape, dtype=dtype) if dq is None else dq
        dk = cos.new_zeros(k_shape, dtype=dtype) if dk is None else dk
        gq, gk = bwd(dq, dk, cos, sin)
        return gq, gk, None, None

    return backward


def _cos(*shape: int) -> Callable[[torch.device], Any]:
    return call(values(2, 3, 4, 8), values(2, 1, 4, 8), values(*shape), values(*shape))


BAD_INPUTS = (
    BadInput("q of 3 dims", call(values(3, 4, 8), values(3, 4, 8), values(3, 4, 8), values(3, 4, 8)), ValueError,
             r"rotary_embedding: q must be 4-D \[batch, heads, seq, head_dim\], got shape \[3, 4, 8\]"),
    BadInput("k of another head_dim", call(values(2, 3, 4, 8), values(2, 1, 4, 6), values(2, 4, 8), values(2, 4, 8)),
             ValueError, r"rotary_embedding: k must be 4-D \[batch, kv_heads, seq, head_dim\] with q's"),
    BadInput("k of float16", call(values(2, 3, 4, 8), values(2, 1, 4, 8, dtype=torch.float16), values(2, 4, 8),
                                  values(2, 4, 8)), TypeError,
             r"rotary_embedding: k must have the dtype of q \(torch.float32\), got torch.float16"),
    BadInput("cos of another seq", _cos(2, 5, 8), ValueError, r"rotary_embedding: cos must have shape \[batch or 1"),
    BadInput("cos with heads", _cos(2, 3, 4, 8), ValueError, r"rotary_embedding: cos must have shape"),
    BadInput("odd rotary_dim", _cos(2, 4, 7), ValueError, r"an even rotary_dim in 2..head_dim 8, got \[2, 4, 7\]"),
    BadInput("rotary_dim over head_dim", _cos(2, 4, 10), ValueError, r"rotary_embedding: cos must have shape"),
    BadInput("sin of another shape", call(values(2, 3, 4, 8), values(2, 1, 4, 8), values(2, 4, 8), values(1, 4, 8)),
             ValueError, r"rotary_embedding: sin must have the shape of cos \[2, 4, 8\], got \[1, 4, 8\]"),
    BadInput("sin of float16", call(values(2, 3, 4, 8), values(2, 1, 4, 8), values(2, 4, 8),
                                    values(2, 4, 8, dtype=torch.float16)), TypeError,
             r"rotary_embedding: sin must have the dtype of cos"),
)

SPEC = register_op(OpSpec(
    name=OP, reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=_bytes, outputs=("q_embed", "k_embed"), bwd_bytes=_bytes, grad_args=(0, 1),
    autograd=(_setup, _backward_for), bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1, 1, 1, 64)),  # one token of one head (decode)
        _problem((2, 4, 7, 128), kv_heads=2),  # grouped-query k, a seq of no block multiple
        _problem((1, 3, 5, 256), kv_heads=1),  # head_dim 256 (Gemma), one kv head
        _problem((2, 4, 9, 64), kv_heads=2, rotary_dim=32),  # partial rotary: half the dims pass through
        _problem((1, 2, 3, 80), kv_heads=2, rotary_dim=40),  # partial rotary, halves of no power of two
        _problem((2, 2, 67, 64), kv_heads=1),  # rows over one program's block, a tail of rows
        _problem((2, 2, 0, 64)),  # empty
    ],
    default_problems=lambda dev: [_problem(s, kv_heads=kv) for s, kv in (
        [((1, 32, 1, 128), 8), ((1, 32, 4096, 128), 8), ((8, 32, 2048, 128), 8), ((4, 16, 2048, 256), 8)]
        if dev == "cuda" else [((1, 8, 64, 64), 2), ((2, 8, 256, 128), 4)])],
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, validate=validate,
    result_dtype=lambda q, k, cos, sin: torch.promote_types(q.dtype, cos.dtype), bad_inputs=BAD_INPUTS,
))
