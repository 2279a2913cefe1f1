"""The decision of a bucket met while dynamo traces is made outside the graph: one graph break, or under
``fullgraph=True`` an error that says what to do. A module of its own, imported only while dynamo traces, so that
importing tiered_ops does not import dynamo (``torch.compiler.disable`` does: seconds in every process, the
measurement workers' included)."""

from __future__ import annotations

from typing import Any, Callable

import torch


@torch.compiler.disable(reason="tiered_ops has no decision for this op/shape bucket yet: call "
                        "tiered_ops.select_backend(...) or the op once outside the compiled region first")
def outside_graph(decide: Callable[..., Any], *args: Any) -> Any:
    """``decide(*args)``, run eagerly."""
    return decide(*args)
