"""tiered_ops: eager, torch.compile, Triton and CUDA tiers of each op, measured per shape and GPU.

    import tiered_ops
    y = tiered_ops.softmax(x, dim=-1)          # dispatches through the stored decision
    sel = tiered_ops.select_backend("rms_norm", (8, 4096), torch.bfloat16, normalized_shape=(4096,))
    sel.tier, sel.name, sel.record             # what was chosen and why
    y = tiered_ops.layer_norm(x, (4096,), w, b)  # training (x requires grad): the fwd+bwd decision
"""

from __future__ import annotations

import os as _os

if not _os.environ.get("TRITON_INTERPRET"):
    # No GPU: run the Triton tier on the interpreter. Triton reads the variable when a kernel is defined and launched;
    # when something imported triton before this, the Triton tier re-makes the functions defined without it
    # (tiered_ops.ops._tiers.interpreter_ready) or says why it cannot run.
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            _os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

from .ops.gelu import gelu  # noqa: E402
from .ops.layer_norm import layer_norm  # noqa: E402
from .ops.muladd import muladd  # noqa: E402
from .ops.rms_norm import rms_norm  # noqa: E402
from .ops.softmax import softmax  # noqa: E402
from .patch import PatchReport, patch, unpatch  # noqa: E402
from .registry import OPS, Impl, OpSpec, Tier, all_ops, get_op  # noqa: E402
from .select import Selection, clear_cache, select_backend, set_policy, set_tuning, use_store  # noqa: E402
from .tune import TuneReport, tune  # noqa: E402

__all__ = [
    "OPS", "Impl", "OpSpec", "PatchReport", "Selection", "Tier", "TuneReport", "all_ops", "clear_cache", "gelu",
    "get_op", "layer_norm", "muladd", "patch", "rms_norm", "select_backend", "set_policy", "set_tuning", "softmax",
    "tune", "unpatch", "use_store",
]
__version__ = "0.1.0"
