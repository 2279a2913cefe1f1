"""qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps=1e-6) -> (q_embed, k_embed): Qwen3's QK-norm then RoPE.

Qwen3-style attention normalizes each head of q and k over head_dim with its RMSNorm (transformers' Llama form: in
fp32, rounded to the input's dtype, then times the weight), then applies the rotary embedding (rotate-half, cos and
sin as wide as head_dim): ``rotary_embedding(rms_norm(q) * q_weight, rms_norm(k) * k_weight, cos, sin)``. q, k, cos
and sin as ``rotary_embedding`` takes them (q [batch, heads, seq, head_dim], views of a transpose taken in place);
q_weight and k_weight [head_dim] of q's dtype. The kernel tiers do it in one launch (fp32 math; the normalized rows
rounded to the input's dtype before the weight, as the module does) and their backward in one launch too (plus a sum of
the weights' per-program partial gradients).
Bucket: (batch x seq rounded up to a power of two, heads, kv_heads, head_dim).
Bytes: read q, k, write q_embed, k_embed (+ cos, sin, the weights once). Backward: read dq_embed, dk_embed, q, k,
write dq, dk (+ cos, sin, weights, weight grads once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..registry import BadInput, Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ._common import call, check_eps, floating, gen, randn, same_device, values
from .rotary_embedding import _inputs as _rope_inputs
from .rotary_embedding import check_rope
from .rotary_embedding import reference as rope_reference

OP = "qk_norm_rope"


def validate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
             k_weight: torch.Tensor, eps: float = 1e-6) -> None:
    """rotary_embedding's contract with cos and sin as wide as head_dim, and weights [head_dim] of q's dtype."""
    check_rope(OP, q, k, cos, sin)
    d = q.shape[-1]
    if cos.shape[-1] != d:
        raise ValueError(f"{OP}: cos must be as wide as head_dim {d} (no partial rotary), got {list(cos.shape)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        floating(OP, name, w)
        same_device(OP, name, w, q, "q")
        if tuple(w.shape) != (d,):
            raise ValueError(f"{OP}: {name} must have shape [head_dim] [{d}], got {list(w.shape)}")
        if w.dtype != q.dtype:
            raise TypeError(f"{OP}: {name} must have the dtype of q ({q.dtype}), got {w.dtype}")
    check_eps(OP, eps, optional=False)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm (float64 stays float64 for the gate's reference)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
              k_weight: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager tier and reference: the norms as the module computes them, then transformers' RoPE."""
    return rope_reference(_norm(q, q_weight, eps), _norm(k, k_weight, eps), cos, sin)


def _problem(shape: tuple[int, ...], kv_heads: int | None = None) -> Problem:
    """q's shape [batch, heads, seq, head_dim] (fewer dims: its trailing ones, the rest 1); head_dim even."""
    shape = tuple(shape)
    if not 1 <= len(shape) <= 4:
        raise ValueError(f"{OP}: shape must be q's [batch, heads, seq, head_dim], got {list(shape)}")
    shape = (1,) * (4 - len(shape)) + shape
    shape = shape[:3] + (shape[3] + shape[3] % 2,)  # an odd generic row length: the next even head_dim
    kv = shape[1] if kv_heads is None else int(kv_heads)
    if kv < 0:
        raise ValueError(f"{OP}: kv_heads must be >= 0, got {kv}")
    return make_problem(shape, kv_heads=kv)


def _problem_of(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> Problem:
    return _problem(tuple(q.shape), k.shape[1])


def _bucket(p: Problem) -> tuple:
    b, h, s, d = p.shape
    return pow2_ceil(b * s), h, p.kw["kv_heads"], d


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    d = p.shape[3]
    q, k, cos, sin = _rope_inputs(make_problem(p.shape, kv_heads=p.kw["kv_heads"], rotary_dim=d), dtype, device,
                                  seed).args
    g = gen(device, seed + 1)
    wq, wk = ((1 + 0.5 * randn((d,), torch.float32, device, g)).to(dtype) for _ in range(2))
    return Inputs((q, k, cos, sin, wq, wk, 1e-6))


def _bytes(p: Problem, dt: torch.dtype) -> int:
    b, h, s, d = p.shape
    return (2 * b * s * d * (h + p.kw["kv_heads"]) + 2 * b * s * d + 2 * d) * dt.itemsize


def _bwd_bytes(p: Problem, dt: torch.dtype) -> int:
    b, h, s, d = p.shape
    return (3 * b * s * d * (h + p.kw["kv_heads"]) + 2 * b * s * d + 4 * d) * dt.itemsize


def _kernel_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float = 1e-6) -> tuple:
    return q, k, cos, sin, q_weight, k_weight, float(eps)


def _fake(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
          k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


def _bwd_fake(dq: torch.Tensor, dk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(q_weight), torch.empty_like(k_weight))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, cos, sin, wq, wk, ctx.eps = inputs
    ctx.save_for_backward(q, k, cos, sin, wq, wk)


def _backward_for(bwd: Callable[..., tuple]) -> Callable[..., tuple]:
    def backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None) -> tuple:
        q, k, cos, sin, wq, wk = ctx.saved_tensors
        dq = torch.zeros_like(q) if dq is None else dq
        dk = torch.zeros_like(k) if dk is None else dk
        gq, gk, gwq, gwk = bwd(dq, dk, q, k, cos, sin, wq, wk, ctx.eps)
        return gq, gk, None, None, gwq, gwk, None

    return backward


def _with(**change: Any) -> Callable[[torch.device], Any]:
    args = dict(q=values(2, 3, 4, 8), k=values(2, 1, 4, 8), cos=values(2, 4, 8), sin=values(2, 4, 8),
                q_weight=values(8), k_weight=values(8), eps=1e-6)
    args.update(change)
    return call(*args.values())


BAD_INPUTS = (
    BadInput("q of 3 dims", _with(q=values(3, 4, 8)), ValueError, r"qk_norm_rope: q must be 4-D"),
    BadInput("partial rotary", _with(cos=values(2, 4, 4), sin=values(2, 4, 4)), ValueError,
             r"qk_norm_rope: cos must be as wide as head_dim 8 \(no partial rotary\), got \[2, 4, 4\]"),
    BadInput("q_weight of another length", _with(q_weight=values(6)), ValueError,
             r"qk_norm_rope: q_weight must have shape \[head_dim\] \[8\], got \[6\]"),
    BadInput("k_weight of float16", _with(k_weight=values(8, dtype=torch.float16)), TypeError,
             r"qk_norm_rope: k_weight must have the dtype of q \(torch.float32\), got torch.float16"),
    BadInput("eps of a string", _with(eps="1e-6"), TypeError, r"qk_norm_rope: eps must be a float, got str"),
)

SPEC = register_op(OpSpec(
    name=OP, reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=_bytes, outputs=("q_embed", "k_embed"), bwd_bytes=_bwd_bytes, grad_args=(0, 1, 4, 5),
    autograd=(_setup, _backward_for), bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1, 1, 1, 16)),  # one token of one head, head_dim 16: fewer pairs than a warp
        _problem((2, 4, 7, 128), kv_heads=2),  # grouped-query k (Qwen3's head_dim 128)
        _problem((1, 3, 5, 256), kv_heads=1),  # head_dim 256
        _problem((1, 2, 3, 80), kv_heads=2),  # head_dim of no power of two: masked pairs
        _problem((2, 2, 67, 64), kv_heads=1),  # rows over one program's block, a tail of rows
        _problem((2, 2, 0, 64)),  # empty
    ],
    default_problems=lambda dev: [_problem(s, kv_heads=kv) for s, kv in (
        [((1, 32, 1, 128), 8), ((1, 32, 4096, 128), 8), ((8, 32, 2048, 128), 8)]
        if dev == "cuda" else [((1, 8, 64, 128), 2), ((2, 8, 256, 128), 4)])],
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, validate=validate,
    result_dtype=lambda q, k, cos, *a, **kw: torch.promote_types(q.dtype, cos.dtype), bad_inputs=BAD_INPUTS,
))
