"""tiered_ops: eager, torch.compile, Triton and CUDA tiers of each op, measured per shape and GPU.

    import tiered_ops
    y = tiered_ops.softmax(x, dim=-1)          # dispatches through the stored decision
    sel = tiered_ops.select_backend("rms_norm", (8, 4096), torch.bfloat16, normalized_shape=(4096,))
    sel.tier, sel.name, sel.record             # what was chosen and why
    y = tiered_ops.layer_norm(x, (4096,), w, b)  # training (x requires grad): the fwd+bwd decision

Every op declared in ``tiered_ops/ops`` is a function here, made from its declaration (``dispatch.make_public``);
``patch``/``unpatch`` put them into a model's modules and ``tune`` measures the calls of one real step.
"""

from __future__ import annotations

import os as _os

if not _os.environ.get("TRITON_INTERPRET"):
    # No GPU: run the Triton tier on the interpreter. Triton reads the variable when a kernel is defined and launched;
    # when something imported triton before this, the Triton tier re-makes the functions defined without it
    # (tiered_ops.tiers.interpreter_ready) or says why it cannot run.
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            _os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

from .decide.background import wait_for_tuning, warm_tuning  # noqa: E402
from .decide.decide import Selection, clear_cache, get_store, set_policy, set_tuning, use_store  # noqa: E402
from .decide.packs import load_decisions as _load  # noqa: E402
from .models.patching import PatchReport, patch, unpatch  # noqa: E402
from .models.tuning import TuneReport, tune  # noqa: E402
from .registry import OPS, Impl, OpSpec, Tier  # noqa: E402
from .runtime.bound import select_backend  # noqa: E402
from .runtime.dispatch import public  # noqa: E402
from .tiers.catalog import all_ops, get_op  # noqa: E402

for _spec in all_ops():
    globals()[_spec.name] = public(_spec.name)


def load_decisions(path: str) -> object:
    """Merge the decision pack at ``path`` (``tiered-ops decisions export``) into the store this process decides
    from, so ``tiered_ops.<op>`` uses those decisions without measuring; a row whose kernel source or measurement
    method differs from what is installed here is refused with the reason (in the result and the log). Each
    implementation chosen from a pack is gated on its first use here."""
    result = _load(path, store=get_store())
    clear_cache()
    return result

__all__ = [
    "OPS", "Impl", "OpSpec", "PatchReport", "Selection", "Tier", "TuneReport", "all_ops", "clear_cache", "get_op",
    "load_decisions", "patch", "select_backend", "set_policy", "set_tuning", "tune", "unpatch", "use_store",
    "wait_for_tuning", "warm_tuning",
    *(s.name for s in all_ops()),
]
__version__ = "0.1.0"
