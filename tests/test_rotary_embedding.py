import pytest
import torch
from helpers import DTYPES, IMPLS, assert_matches, device_for, gpu, rel, truth64

import tiered_ops
from tiered_ops.ops.rotary_embedding import _problem as P

PROBLEMS = [
    P((1, 1, 1, 64)),  # one token of one head (decode): a single row per tensor
    P((2, 4, 7, 128), kv_heads=2),  # grouped-query k (fewer rows than q: its programs past the end do nothing)
    P((1, 3, 5, 256), kv_heads=1),  # head_dim 256 (Gemma)
    P((2, 4, 9, 64), kv_heads=2, rotary_dim=32),  # partial rotary: the pass-through tile
    P((1, 2, 3, 80), kv_heads=2, rotary_dim=40),  # halves (20) and pass-through (40) of no power of two: masked
    P((2, 2, 37, 64), kv_heads=1),  # rows over one program's 16, a tail of rows
    P((1, 2, 19, 256), kv_heads=2),  # head_dim 256: 8 rows a program (pairs at most TILE), a tail
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_float64(impl, dtype, problem):
    assert_matches("rotary_embedding", impl, problem, dtype, grad=True)


def test_compile_tier():
    assert_matches("rotary_embedding", "compile", P((2, 4, 9, 64), kv_heads=2, rotary_dim=32), torch.float32,
                   grad=True)


def _qkcs(dev, b=2, h=4, kv=2, s=5, d=64, r=None, cos_batch=None, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    r = d if r is None else r
    q = torch.randn(b, s, h, d, generator=g, device=dev).transpose(1, 2)
    k = torch.randn(b, s, kv, d, generator=g, device=dev).transpose(1, 2)
    ang = torch.randn(cos_batch or b, s, r, generator=g, device=dev)
    return q, k, ang.cos(), ang.sin()


@pytest.mark.parametrize("impl", IMPLS)
def test_as_transformers_applies_it(impl):
    """The same values as the installed transformers' apply_rotary_pos_emb (Llama's), from transposed q and k."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    dev = device_for(impl)
    q, k, cos, sin = _qkcs(dev, d=128)
    assert not q.is_contiguous()
    fn = tiered_ops.get_op("rotary_embedding").impls[impl].fn
    for got, want in zip(fn(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert rel(got, want) < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_layouts_and_broadcast_cos(impl):
    """q and k in any layout (a transposed view, a slice whose last dim is strided, contiguous), cos and sin of batch 1
    (shared positions) or a strided view: the float64 math."""
    dev = device_for(impl)
    fn = tiered_ops.get_op("rotary_embedding").impls[impl].fn
    q, k, cos, sin = _qkcs(dev, b=3, cos_batch=1, r=32)
    wide = torch.randn(3, 4, 5, 128, device=dev)[..., ::2]  # last dim of stride 2
    for qq, kk in ((q, k), (q.contiguous(), k.contiguous()), (wide, k)):
        for got, want in zip(fn(qq, kk, cos, sin), truth64("rotary_embedding", qq, kk, cos, sin)):
            assert rel(got, want) < 1e-6
    c2, s2 = torch.randn(3, 5, 64, device=dev)[..., :32], torch.randn(3, 5, 64, device=dev)[..., :32]
    for got, want in zip(fn(q, k, c2, s2), truth64("rotary_embedding", q, k, c2, s2)):
        assert rel(got, want) < 1e-6


@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=gpu)])
def test_gradient_of_one_output_alone(impl):
    """A loss of q_embed alone: k's gradient is zero (the backward gets no gradient for k_embed)."""
    dev = device_for(impl)
    fn = tiered_ops.get_op("rotary_embedding").impls[impl].fn
    q, k, cos, sin = _qkcs(dev)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, _ = fn(q, k, cos, sin)
    dq, dk = torch.autograd.grad(qe.sum(), (q, k), allow_unused=True)
    q64 = q.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(truth64("rotary_embedding", q64, k, cos, sin)[0].sum(), q64)
    assert rel(dq, want) < 1e-6
    assert dk is None or not dk.any()


def test_cos_that_requires_grad_is_refused():
    q, k, cos, sin = _qkcs(torch.device("cpu"))
    with pytest.raises(ValueError, match="cos and sin must not require grad"):
        tiered_ops.get_op("rotary_embedding").impls["eager"].fn(q, k, cos.requires_grad_(), sin)


@gpu
@pytest.mark.parametrize("op", ["rotary_embedding", "qk_norm_rope"])
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_more_rows_than_one_grid(op, impl):
    """1 x 64 heads x 65600 positions x 128: the CUDA rotary kernel's work items (rows x 64 pairs) pass its capped
    grid, so blocks stride over rows; the last head of the last positions as the float64 math."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 65600, 64, 128, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, 65600, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    ang = torch.randn(1, 65600, 64, generator=g, device="cuda").repeat(1, 1, 2)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    w = [torch.randn(128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    extra = (*w, 1e-6) if op == "qk_norm_rope" else ()
    qe, ke = tiered_ops.get_op(op).impls[impl].fn(q, k, cos, sin, *extra)
    tail = slice(65600 - 4096, 65600)
    sub = (q[:, -1:, tail], k[:, -1:, tail], cos[:, tail], sin[:, tail], *extra)
    want_q, want_k = truth64(op, *sub)
    assert rel(qe[:, -1:, tail], want_q) < 1e-2 and rel(ke[:, -1:, tail], want_k) < 1e-2
