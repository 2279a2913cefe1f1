"""segment_sum's float64 math: each segment's rows added one at a time, in a loop (an empty segment is 0)."""

from __future__ import annotations

import torch


def truth(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    zero = values[:0].sum(0)  # the empty sum, in values' graph (its gradient is 0)
    bounds = offsets.tolist()
    sums = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        acc = zero
        for row in range(start, end):
            acc = acc + values[row]
        sums.append(acc)
    return torch.stack(sums) if sums else values[:0]


def random_problem(draw, shape: tuple[int, ...]) -> dict:
    """Hypothesis: a 2-D values shape of its own (E up to 700 rows: past the kernels' 256-row chunk, so long segments
    are split over row ranges), 0 to 64 segments, uniform or powerlaw lengths."""
    import hypothesis.strategies as st

    rows = draw(st.integers(0, 700))
    cols = draw(st.sampled_from([1, 2, 3, 8, 16, 33, 64]))
    segments = draw(st.integers(0 if rows == 0 else 1, 64))
    return dict(shape=(rows, cols), segments=segments, lengths=draw(st.sampled_from(["uniform", "powerlaw"])))
