"""The gated MLP rewrite of ``tiered_ops.patch``: ``act_fn(gate_proj(x)) * up_proj(x)`` in one tiered_ops.swiglu call.

transformers' Llama, Mistral, Qwen2, Qwen3 and Gemma MLPs (and any class whose forward is their code, compared as
syntax with ``_MLP``) compute ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. The rewrite (the MLP's class swapped,
``swap.py``) computes the activation and the product in one ``tiered_ops.swiglu`` call: the activation in fp32 and
one rounding to the projections' dtype (the original rounds act_fn(gate) to that dtype first). Taken where ``act_fn``
is one of the op's activations: SiLU (``silu``: transformers' SiLUActivation, torch.nn.SiLU), the tanh GELU
(``gelu_tanh``: GELUTanh, NewGELUActivation, ... as ``hf_gelu_form`` says; Gemma's ``gelu_pytorch_tanh``) or the
erf GELU (``gelu``); any other activation leaves the MLP, with why. Projections of a dtype other than fp32, bf16 and
fp16 (or of two dtypes) run the original expression. Under the rewrite act_fn is not called: a hook on it does not
fire.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.dispatch import public
from .patch_layers import same_syntax, tracing
from .swap import original_class, own_forward

swiglu = public("swiglu")

_TANH_GELUS = ("NewGELUActivation", "FastGELUActivation", "AccurateGELUActivation")

# The transformers code the rewrite reproduces (``same_syntax``: annotations, decorators, docstrings aside).
_MLP = """
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
"""
_HF_SILU = """
def forward(self, input):
    return nn.functional.silu(input)
"""


def hf_gelu_form(m: nn.Module) -> str | None:
    """'none' or 'tanh' for transformers' GELU activations whose function is F.gelu's, else None."""
    name = type(m).__name__
    if name in _TANH_GELUS:
        return "tanh"
    act = getattr(m, "act", None)
    python = getattr(act, "__func__", None)
    if name == "GELUActivation":
        return "none" if act is F.gelu or (python is not None and python.__name__ == "_gelu_python") else None
    if name in ("GELUTanh", "PytorchGELUTanh"):
        if python is not None and python.__name__ == "_gelu_tanh_python":
            return "tanh"
        if isinstance(act, functools.partial) and act.func is F.gelu and act.keywords == {"approximate": "tanh"}:
            return "tanh"
    return None


def activation_of(act: nn.Module) -> str | None:
    """swiglu's activation ("silu", "gelu_tanh", "gelu") computed by the module ``act`` (a swapped one by its own
    class's code), else None."""
    cls = original_class(act)
    if cls.forward is nn.SiLU.forward or (cls.__name__ == "SiLUActivation" and same_syntax(cls.forward, _HF_SILU)):
        return "silu"
    if cls.forward is nn.GELU.forward:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    if cls.__module__.startswith("transformers."):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(hf_gelu_form(act) or "")
    return None


def _mlp(self: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
    gate = self.gate_proj(x)
    dt = gate.dtype
    taken = dt.is_floating_point and dt.itemsize in (2, 4)  # in patch_layers.TAKEN (read so: no guard)
    if tracing() and taken and swiglu.decomposes(gate, gate, activation):
        # traced as the original, in its order (up_proj after the activation); gate stands in for up in the question
        # (the op takes only an up of gate's shape and dtype). The activation's own forward, not a patched one's: the
        # swiglu decision covers it (tune records swiglu's call, never the activation's, so a patched GELU would find
        # no decision of its own here)
        return self.down_proj(own_forward(self.act_fn, gate) * self.up_proj(x))
    up = self.up_proj(x)
    if taken and up.dtype == dt and up.shape == gate.shape:
        return self.down_proj(swiglu(gate, up, activation))
    return self.down_proj(self.act_fn(gate) * up)


# One forward per activation: module-level functions, as the swapped class pickles by them.

def _silu_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _mlp(self, x, "silu")


def _gelu_tanh_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _mlp(self, x, "gelu_tanh")


def _gelu_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _mlp(self, x, "gelu")


_FORWARDS = {"silu": _silu_mlp_forward, "gelu_tanh": _gelu_tanh_mlp_forward, "gelu": _gelu_mlp_forward}


def mlp_plan(m: nn.Module) -> tuple[Callable[..., torch.Tensor], str] | str | None:
    """(forward, description) for a gated MLP this rewrite takes, the reason it cannot (a str), or None when ``m`` is
    no transformers module with gate_proj, up_proj, down_proj and act_fn."""
    if not (type(m).__module__.startswith("transformers.")
            and all(isinstance(getattr(m, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and hasattr(m, "act_fn")):
        return None
    if not same_syntax(getattr(original_class(m), "forward", None), _MLP):
        return "its forward is not the gated MLP's code (down_proj(act_fn(gate_proj(x)) * up_proj(x))) this rewrite " \
               "reproduces"
    act = m.act_fn
    activation = activation_of(act) if isinstance(act, nn.Module) else None
    if activation is None:
        return f"its act_fn ({type(act).__name__}) is none of tiered_ops.swiglu's activations (SiLU, GELU tanh, GELU)"
    return _FORWARDS[activation], f"act_fn(gate_proj(x)) * up_proj(x) -> tiered_ops.swiglu (activation={activation!r})"
