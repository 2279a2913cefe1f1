"""rotary_embedding's float64 math: each rotated pair (x_j, x_{j+r}) of the first 2r dims taken to
(x_j c_j - x_{j+r} s_j, x_{j+r} c_{j+r} + x_j s_{j+r}) with cos/sin broadcast over the heads; the rest passes."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1] // 2
    c, s = cos[:, None], sin[:, None]
    x1, x2 = x[..., :r], x[..., r:2 * r]
    out1 = x1 * c[..., :r] - x2 * s[..., :r]
    out2 = x2 * c[..., r:] + x1 * s[..., r:]
    return torch.cat((out1, out2, x[..., 2 * r:]), dim=-1)


def truth(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def random_problem(draw, shape: tuple[int, ...]) -> dict:
    """Hypothesis: a 4-D q of its own (batch 1-3, heads 1-6, seq 0-40, an even head_dim up to 96), kv_heads 1 to heads,
    an even rotary_dim up to head_dim (partial rotary below it)."""
    import hypothesis.strategies as st

    heads, half = draw(st.integers(1, 6)), draw(st.integers(1, 48))
    q = (draw(st.integers(1, 3)), heads, draw(st.integers(0, 40)), 2 * half)
    return dict(shape=q, kv_heads=draw(st.integers(1, heads)), rotary_dim=2 * draw(st.integers(1, half)))
