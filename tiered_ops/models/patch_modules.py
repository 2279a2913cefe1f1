"""The forwards of swapped norm, GELU and softmax modules (``patching``), each made once per swapped class
(``swap.per_class``): the class's own forward held in its closure, the op of ours called where it takes the input.

Each forward asks whether it takes the input's dtype (float32, bfloat16 or float16: ``patch_layers.TAKEN``) as
``dt.is_floating_point and dt.itemsize in (2, 4)``, read off the dtype alone: a trace folds it without a guard, where
``dt in TAKEN`` guards each element of the global tuple on every call of the compiled model. tests/test_guards.py
checks that the two agree on every dtype torch has. A parameter is asked about through a ``StandIn`` (its
``requires_grad`` read by a trace guards its type: one guard per parameter). The original forward (``own``: the
class's, held by the forward made for it) is called directly (each helper between costs guards on its code).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..runtime.dispatch import public
from .patch_layers import StandIn, tracing
from .swap import per_class

gelu, layer_norm, rms_norm, softmax = (public(n) for n in ("gelu", "layer_norm", "rms_norm", "softmax"))


def same_dtype(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    dt = x.dtype
    return dt.is_floating_point and dt.itemsize in (2, 4) and all(p is None or p.dtype == dt for p in params)


@per_class
def layer_norm_forward(base: type) -> Callable[..., torch.Tensor]:
    own = base.forward

    def forward(self: nn.LayerNorm, input: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if not same_dtype(input, w, b) or tracing() and layer_norm.decomposes(
                input, self.normalized_shape, w if w is None else StandIn(w.shape, w),
                b if b is None else StandIn(b.shape, b), self.eps):
            return own(self, input)
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    return forward


@per_class
def rms_norm_forward(base: type) -> Callable[..., torch.Tensor]:
    own = base.forward

    def forward(self: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not same_dtype(x, w) or tracing() and rms_norm.decomposes(
                x, self.normalized_shape, w if w is None else StandIn(w.shape, w), self.eps):
            return own(self, x)
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)

    return forward


@per_class
def llama_rms_norm_forward(base: type) -> Callable[..., torch.Tensor]:
    own = base.forward

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        x, w = hidden_states, self.weight
        dt = x.dtype
        if not (dt.is_floating_point and dt.itemsize in (2, 4)) or w.dtype not in (dt, torch.float32) or (
                tracing() and rms_norm.decomposes(x, (x.shape[-1],), StandIn(w.shape, w), self.variance_epsilon,
                                                  cast_before_weight=True)):
            return own(self, x)
        # one launch: normalized in fp32, rounded to x's dtype, then the weight (the output in promote(w, x))
        return rms_norm(x, (x.shape[-1],), w, self.variance_epsilon, cast_before_weight=True)

    return forward


@per_class
def gemma_rms_norm_forward(base: type) -> Callable[..., torch.Tensor]:
    own = base.forward

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        dt, w = x.dtype, self.weight
        if not (dt.is_floating_point and dt.itemsize in (2, 4)) or w.dtype not in (dt, torch.float32) or (
                tracing() and rms_norm.decomposes(x, (x.shape[-1],), StandIn(w.shape, w), self.eps,
                                                  weight_offset=1.0)):
            return own(self, x)
        # one launch: (1 + w) in fp32 times the normalized x, then one rounding to x's dtype
        return rms_norm(x, (x.shape[-1],), self.weight, self.eps, weight_offset=1.0)

    return forward


@per_class
def nn_gelu_forward(base: type) -> Callable[..., torch.Tensor]:
    own = base.forward

    def forward(self: nn.GELU, input: torch.Tensor) -> torch.Tensor:
        dt = input.dtype
        if not (dt.is_floating_point and dt.itemsize in (2, 4)) or tracing() and gelu.decomposes(
                input, None, self.approximate):
            return own(self, input)
        return gelu(input, None, self.approximate)

    return forward


def _gelu_forward(base: type, approximate: str) -> Callable[..., torch.Tensor]:
    own = base.forward

    def forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
        dt = input.dtype
        if not (dt.is_floating_point and dt.itemsize in (2, 4)) or tracing() and gelu.decomposes(
                input, None, approximate):
            return own(self, input)
        return gelu(input, None, approximate)

    return forward


# transformers' GELU activations, by form (each a module-level maker: a pickled swapped module finds it by name)
@per_class
def gelu_erf_forward(base: type) -> Callable[..., torch.Tensor]:
    return _gelu_forward(base, "none")


@per_class
def gelu_tanh_forward(base: type) -> Callable[..., torch.Tensor]:
    return _gelu_forward(base, "tanh")


@per_class
def softmax_forward(base: type) -> Callable[..., torch.Tensor]:
    own = base.forward

    def forward(self: nn.Softmax, input: torch.Tensor) -> torch.Tensor:
        dt = input.dtype
        if not (dt.is_floating_point and dt.itemsize in (2, 4)) or tracing() and softmax.decomposes(input, self.dim):
            return own(self, input)
        return softmax(input, self.dim)

    return forward
