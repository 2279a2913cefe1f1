"""Swap a model's norm, GELU and softmax modules onto tiered_ops, in place and reversibly.

    report = tiered_ops.patch(model)       # what was swapped, what was left and why
    tiered_ops.unpatch(model)              # every swapped module back to its own class

A swap makes the module an instance of a subclass of its class whose ``forward`` is the replacement (``swap``: the
parameters, buffers, state_dict keys, hooks, ``isinstance`` and the class's name stay; a deepcopy or a pickled copy
stays swapped; torch.compile guards the forward once per class, not per module); ``unpatch`` gives the module its
class back. Swapped:

- ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` (every affine variant) -> tiered_ops.layer_norm / rms_norm;
- ``torch.nn.GELU`` (none, tanh) -> tiered_ops.gelu; ``torch.nn.Softmax`` with a dim -> tiered_ops.softmax;
- transformers' RMSNorm of Llama, Mistral, Qwen2, Qwen3 (and any class whose forward is LlamaRMSNorm's code):
  normalize in fp32, cast to the input dtype, then multiply by the weight: one tiered_ops.rms_norm call with
  ``cast_before_weight=True`` (the same two roundings as the original, the output promoted as its ``w * y``);
- transformers' GemmaRMSNorm (and any class with its forward's code): normalize and multiply by (1 + weight) in
  fp32, then cast: one tiered_ops.rms_norm call with ``weight_offset=1.0`` ((1 + w) formed in fp32, one rounding);
- transformers' attention modules whose forward calls the rotate-half ``apply_rotary_pos_emb`` (Llama, Mistral,
  Qwen2, Qwen3, Gemma, GPT-NeoX's partial form, ...): that call -> tiered_ops.rotary_embedding (``patch_rope``);
  Qwen3's q_norm/k_norm + that call -> one tiered_ops.qk_norm_rope (``patch_qk_norm``), ahead of the plain route;
- transformers' GELU activations of the erf form (GELUActivation) and the tanh form (GELUTanh / PytorchGELUTanh,
  NewGELUActivation, FastGELUActivation, AccurateGELUActivation);
- transformers' gated MLPs of Llama, Mistral, Qwen2, Qwen3 and Gemma (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
  with a SiLU or GELU act_fn): the activation and the product in one tiered_ops.swiglu call (``patch_mlp``).

A swapped forward runs the original forward for an input tiered_ops does not take (a dtype other than fp32,
bf16 or fp16; a weight or bias of another dtype than the input, as under autocast, except a float32 weight of the
Hugging Face RMSNorms, which their forms take), and, while dynamo traces it, where the op would trace its plain torch
decomposition (``tracing() and op.decomposes(...)``, ``patch_layers.tracing``): Inductor then gets stock's graph.
transformers is imported only when the model holds one of its classes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .lm_head_loss import DESCRIPTION as LM_HEAD_ROUTE
from .lm_head_loss import head_plan
from .patch_layers import (
    LOSS_MARK,
    decoder_plan,
    loss_plan,
    norm_form,
    route_loss,
    unroute_loss,
)
from .patch_mlp import hf_gelu_form as _hf_gelu_form
from .patch_mlp import mlp_plan
from .patch_modules import (
    gelu_erf_forward,
    gelu_tanh_forward,
    gemma_rms_norm_forward,
    layer_norm_forward,
    llama_rms_norm_forward,
    nn_gelu_forward,
    rms_norm_forward,
    softmax_forward,
)
from .patch_qk_norm import qk_norm_plan
from .patch_rope import rope_plan
from .swap import swap, unswap

log = logging.getLogger(__name__)

PATCHABLE_OPS: tuple[str, ...] = ("rms_norm", "layer_norm", "gelu", "softmax", "cross_entropy", "swiglu",
                                  "rotary_embedding", "qk_norm_rope", "linear_cross_entropy")
_MARK = "_tiered_ops_patched"  # instance attribute of a swapped module: the replacement's description
# Class names that say "this may be a norm, GELU or softmax": listed as left when not swapped.
_CANDIDATE = re.compile(r"RMSNorm|LayerNorm|GELU|Gelu|Softmax")
_LLAMA_STYLE = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
_GEMMA_STYLE = ("GemmaRMSNorm",)


@dataclass
class Swapped:
    path: str  # the module's name in model.named_modules() ("" for the model itself)
    cls: str
    replacement: str


@dataclass
class Left:
    path: str
    cls: str
    reason: str


@dataclass
class PatchReport:
    """What ``patch`` swapped (module path, class, replacement) and what it left, with why."""

    swapped: list[Swapped] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"swapped {len(self.swapped)} module(s), left {len(self.left)}"]
        lines += [f"  swapped {s.path or '<model>'} ({s.cls}) -> {s.replacement}" for s in self.swapped]
        lines += [f"  left    {x.path or '<model>'} ({x.cls}): {x.reason}" for x in self.left]
        return "\n".join(lines)


# ---- what to do with one module -------------------------------------------------------------------------------

@dataclass
class _Plan:
    op: str
    forward: Callable[..., torch.Tensor]
    replacement: str


def _plan_torch(m: nn.Module) -> _Plan | str | None:
    fwd = type(m).forward
    if isinstance(m, nn.LayerNorm) and fwd is nn.LayerNorm.forward:
        return _Plan("layer_norm", layer_norm_forward, "tiered_ops.layer_norm")
    if isinstance(m, nn.RMSNorm) and fwd is nn.RMSNorm.forward:
        return _Plan("rms_norm", rms_norm_forward, "tiered_ops.rms_norm")
    if isinstance(m, nn.GELU) and fwd is nn.GELU.forward:
        if m.approximate not in ("none", "tanh"):
            return f"GELU with an unknown approximation {m.approximate!r}"
        return _Plan("gelu", nn_gelu_forward, f"tiered_ops.gelu (approximate={m.approximate!r})")
    if isinstance(m, nn.Softmax) and fwd is nn.Softmax.forward:
        if m.dim is None:
            return "Softmax(dim=None): torch picks the dim from the input's rank; tiered_ops.softmax needs a dim"
        return _Plan("softmax", softmax_forward, f"tiered_ops.softmax (dim={m.dim})")
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.GELU, nn.Softmax)):
        return f"subclass of {type(m).__mro__[1].__name__} with its own forward"
    return None


def _plan_hf(m: nn.Module) -> _Plan | str | None:
    cls = type(m)
    name = cls.__name__
    mlp = mlp_plan(m)
    if mlp is not None:
        return mlp if isinstance(mlp, str) else _Plan("swiglu", *mlp)
    if "GELU" in name or "Gelu" in name:
        form = _hf_gelu_form(m)
        if form is None:
            if name == "QuickGELUActivation":
                return "x * sigmoid(1.702 x) is neither the erf nor the tanh GELU"
            if name == "ClippedGELUActivation":
                return "GELU clipped to [min, max]: no clipped tiered_ops.gelu"
            return "GELU with an unknown approximation"
        fwd = gelu_erf_forward if form == "none" else gelu_tanh_forward
        return _Plan("gelu", fwd, f"tiered_ops.gelu (approximate={form!r})")
    if "RMSNorm" not in name or not hasattr(m, "weight"):
        return None
    form = norm_form(cls)
    if form == "llama" and hasattr(m, "variance_epsilon"):
        return _Plan("rms_norm", llama_rms_norm_forward,
                     "tiered_ops.rms_norm (Llama form: cast_before_weight=True, one launch)")
    if form == "gemma" and hasattr(m, "eps"):
        return _Plan("rms_norm", gemma_rms_norm_forward,
                     "tiered_ops.rms_norm (Gemma form: weight_offset=1.0, one launch)")
    if name in _LLAMA_STYLE or name in _GEMMA_STYLE:
        return "its forward is not the Llama/Gemma RMSNorm code this patch reproduces (another transformers version)"
    return "an RMSNorm whose semantics this patch does not know"


def _plan(m: nn.Module) -> _Plan | str | None:
    """What to do with ``m``: a plan, the reason to leave it (a str), or None when it is no candidate."""
    if _MARK in m.__dict__:  # (a causal LM whose head is fused: _route_loss reports it)
        return None if m.__dict__[_MARK] == LM_HEAD_ROUTE else "already patched"
    plan = _plan_torch(m)
    if plan is None and type(m).__module__.startswith("transformers."):
        plan = _plan_hf(m)
    if plan is None and _CANDIDATE.search(type(m).__name__):
        return "a class this patch does not know"
    if isinstance(plan, _Plan) and "forward" in m.__dict__:
        return "its forward is already replaced on the instance (by other code): left as it is"
    return plan


def _planned(model: nn.Module, plan_of: Callable[[nn.Module], Any]) -> Iterator[tuple[str, nn.Module, str, Any]]:
    """Each module of ``model`` that ``plan_of`` has a plan for (or a str: why none), with its path and class name."""
    for path, m in model.named_modules():
        plan = plan_of(m)
        if plan is not None:
            yield path, m, type(m).__name__, plan


def _fuse_residual(model: nn.Module, report: PatchReport) -> None:
    """Each decoder layer's residual add + post_attention_layernorm onto tiered_ops.fused_add_rms_norm
    (``patch_layers``); the MLP's add + the next layer's input_layernorm are left, with why."""
    first = True
    for path, m, cls, plan in _planned(model, decoder_plan):
        if isinstance(plan, str):
            report.left.append(Left(path, cls, f"residual add + RMSNorm not fused: {plan}"))
            continue
        swap(m, plan[0])
        object.__setattr__(m, _MARK, plan[1])
        report.swapped.append(Swapped(path, cls, plan[1]))
        if not first:
            report.left.append(Left(f"{path}.input_layernorm", type(m.input_layernorm).__name__,
                                    "residual add + RMSNorm not fused: the previous layer's MLP add is across the "
                                    "layer boundary (the model's loop)"))
        first = False


def _route_rope(model: nn.Module, report: PatchReport, wanted: Sequence[str]) -> None:
    """Each Qwen3-style attention's q_norm/k_norm + RoPE onto tiered_ops.qk_norm_rope (``patch_qk_norm``), and each
    other transformers attention's apply_rotary_pos_emb onto tiered_ops.rotary_embedding (``patch_rope``)."""
    routes = (("qk_norm_rope", qk_norm_plan, "q_norm/k_norm + RoPE not fused"),
              ("rotary_embedding", rope_plan, "rotary embedding not routed"))
    for op, plan_of, left in routes:  # the fused route first
        for path, m, cls, plan in _planned(model, plan_of):
            if isinstance(plan, str) or op not in wanted:
                reason = plan if isinstance(plan, str) else f"{op} not in ops={list(wanted)}"
                report.left.append(Left(path, cls, f"{left}: {reason}"))
                continue
            swap(m, plan[0])
            object.__setattr__(m, _MARK, plan[1])
            report.swapped.append(Swapped(path, cls, plan[1]))


def _route_loss(model: nn.Module, report: PatchReport, wanted: tuple[str, ...]) -> None:
    """Each transformers causal LM's loss: its LM head and loss fused (``lm_head_loss``, linear_cross_entropy: the
    forward swapped) and its loss_function through cross_entropy (``patch_layers``: the logits route, for the calls
    the fused one leaves), reported as one entry per model (swapped, and left with why)."""
    for path, m, cls, loss in _planned(model, loss_plan):
        head, done, why = head_plan(m), [], []
        if isinstance(head, tuple) and "linear_cross_entropy" in wanted:
            swap(m, head[0])
            object.__setattr__(m, _MARK, head[1])
            done.append(head[1])
        elif head is not None:
            reason = head if isinstance(head, str) else f"linear_cross_entropy not in ops={list(wanted)}"
            why.append(f"LM head + loss not fused: {reason}")
        if isinstance(loss, str) or "cross_entropy" not in wanted:
            reason = loss if isinstance(loss, str) else f"cross_entropy not in ops={list(wanted)}"
            why.append(f"causal-LM loss not routed: {reason}")
        else:
            done.append(route_loss(m))
        if done:
            report.swapped.append(Swapped(path, cls, "; ".join(done)))
        if why:
            report.left.append(Left(path, cls, "; ".join(why)))


def patch(model: nn.Module, ops: Sequence[str] | None = None, fuse_residual: bool = False) -> PatchReport:
    """Swap ``model``'s norm, GELU and softmax modules onto tiered_ops in place (``unpatch`` reverts it).

    ``ops``: the tiered_ops ops to swap into (default all of ``PATCHABLE_OPS``). ``fuse_residual``: also fuse the
    residual add + RMSNorm pairs of decoder layers (needs an op ``fused_add_rms_norm``; without it the pairs are
    left and the report says so); off by default. ``cross_entropy`` in ``ops`` routes a transformers causal-LM
    loss (``ForCausalLMLoss``) through tiered_ops.cross_entropy; ``linear_cross_entropy`` fuses such a model's LM head
    and loss when it trains with labels (``lm_head_loss``: no logits then, the output's ``logits`` is None).
    Returns what was swapped and what was left, with
    why."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch: model must be a torch.nn.Module, got {type(model).__name__}")
    wanted = PATCHABLE_OPS if ops is None else tuple(ops)
    if isinstance(ops, str) or any(o not in PATCHABLE_OPS for o in wanted):
        raise ValueError(f"patch: ops must be a list of {', '.join(PATCHABLE_OPS)}, got {ops!r}")
    report = PatchReport()
    for path, m, cls, plan in _planned(model, _plan):
        if isinstance(plan, str):
            report.left.append(Left(path, cls, plan))
        elif plan.op not in wanted:
            report.left.append(Left(path, cls, f"{plan.op} not in ops={list(wanted)}"))
        else:
            swap(m, plan.forward)
            object.__setattr__(m, _MARK, plan.replacement)
            report.swapped.append(Swapped(path, cls, plan.replacement))
    _route_rope(model, report, wanted)
    if fuse_residual:
        _fuse_residual(model, report)
    _route_loss(model, report, wanted)
    log.info("tiered_ops.patch: swapped %d module(s), left %d", len(report.swapped), len(report.left))
    return report


def unpatch(model: nn.Module) -> int:
    """Give every module ``patch`` swapped its own class back; returns how many were restored."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"unpatch: model must be a torch.nn.Module, got {type(model).__name__}")
    n = 0
    for m in model.modules():
        restored = unroute_loss(m)
        if _MARK in m.__dict__:
            del m.__dict__[_MARK]
            unswap(m)
            restored = True
        n += restored
    return n


def patched(module: nn.Module) -> str | None:
    """The replacement ``patch`` put on ``module`` (a description), or None when it is not swapped."""
    marks = [d for d in (module.__dict__.get(_MARK), module.__dict__.get(LOSS_MARK)) if d]
    return "; ".join(marks) or None
