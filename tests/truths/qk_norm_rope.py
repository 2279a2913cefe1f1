"""qk_norm_rope's float64 math: each head row x normalized to x / sqrt(mean(x^2) + eps) times its weight, then
rotary_embedding's rotation of the pairs (x_j, x_{j+d/2})."""

from __future__ import annotations

import torch

from truths.rotary_embedding import truth as rope


def truth(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
          k_weight: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    return rope(norm(q, q_weight), norm(k, k_weight), cos, sin)


def random_problem(draw, shape: tuple[int, ...]) -> dict:
    """Hypothesis: a 4-D q of its own (batch 1-3, heads 1-6, seq 0-40, an even head_dim up to 96), kv_heads 1 to
    heads."""
    import hypothesis.strategies as st

    heads = draw(st.integers(1, 6))
    q = (draw(st.integers(1, 3)), heads, draw(st.integers(0, 40)), 2 * draw(st.integers(1, 48)))
    return dict(shape=q, kv_heads=draw(st.integers(1, heads)))
