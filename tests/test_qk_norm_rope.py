import pytest
import torch
from helpers import DTYPES, IMPLS, assert_matches, device_for, gpu, rel

import tiered_ops
from tiered_ops.ops.qk_norm_rope import _problem as P

PROBLEMS = [
    P((1, 1, 1, 16)),  # one row, head_dim 16: fewer pairs than a warp (the CUDA block's idle lanes)
    P((2, 4, 7, 128), kv_heads=2),  # grouped-query k, Qwen3's head_dim
    P((1, 3, 5, 256), kv_heads=1),  # head_dim 256: fewer rows a program
    P((1, 2, 3, 80), kv_heads=2),  # 40 pairs: masked columns
    P((2, 2, 37, 64), kv_heads=1),  # rows over one program's block, a tail of rows (partial weight gradients)
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_float64(impl, dtype, problem):
    assert_matches("qk_norm_rope", impl, problem, dtype, grad=True)


def test_compile_tier():
    assert_matches("qk_norm_rope", "compile", P((2, 4, 7, 128), kv_heads=2), torch.float32, grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_as_qwen3_attention_computes_it(impl, dtype):
    """Qwen3's q_norm/k_norm on the [batch, seq, heads, head_dim] projections, transposed, then its
    apply_rotary_pos_emb: the same values from the transposed views (bf16: within two roundings)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    dev = device_for(impl)
    g = torch.Generator(device=dev).manual_seed(0)
    b, s, h, kv, d = 2, 5, 4, 2, 64
    qn, kn = Qwen3RMSNorm(d).to(dev, dtype), Qwen3RMSNorm(d).to(dev, dtype)
    with torch.no_grad():
        qn.weight.add_(0.5 * torch.randn(d, generator=g, device=dev).to(dtype))
        kn.weight.add_(0.5 * torch.randn(d, generator=g, device=dev).to(dtype))
    q = torch.randn(b, s, h, d, generator=g, device=dev).to(dtype)
    k = torch.randn(b, s, kv, d, generator=g, device=dev).to(dtype)
    ang = torch.randn(b, s, d // 2, generator=g, device=dev).repeat(1, 1, 2)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    with torch.no_grad():
        want = apply_rotary_pos_emb(qn(q).transpose(1, 2), kn(k).transpose(1, 2), cos, sin)
    fn = tiered_ops.get_op("qk_norm_rope").impls[impl].fn
    got = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin, qn.weight.detach(), kn.weight.detach(), 1e-6)
    for o, w in zip(got, want):
        assert rel(o, w) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=gpu)])
def test_weight_gradients_over_many_programs(impl):
    """The weights' gradients summed over more programs than one (rows of both tensors past the first's end)."""
    assert_matches("qk_norm_rope", impl, P((3, 4, 50, 32), kv_heads=1), torch.float32, grad=True)
