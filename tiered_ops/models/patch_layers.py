"""The model-level rewrites of ``tiered_ops.patch``: the decoder layer's residual add + RMSNorm, and the causal-LM loss.

Decoder layers (``patch(model, fuse_residual=True)``). transformers' Llama, Mistral, Qwen2, Qwen3 and Gemma decoder
layers share one forward: ``residual + attention`` then ``post_attention_layernorm`` of that sum, the MLP, and
``residual + mlp``. The rewrite (a forward through the layer's swapped class, for any class whose forward is that
code, compared as syntax with ``_LAYER``, the KV-cache argument under either of its names) computes
the first add and the norm in one ``tiered_ops.fused_add_rms_norm`` call, which returns the normalized sum and the sum
(the next residual). The sum is rounded to the input's dtype before the norm, as in the original. The norm keeps its
form through the op's Hugging Face forms, in the same launch: Llama's normalizes in fp32, rounds to the input's dtype,
then multiplies by the weight (``cast_before_weight=True``: the same two roundings, the output promoted as the
original's); Gemma's multiplies by 1 + weight in fp32 before its one rounding (``weight_offset=1.0``). A weight of
another dtype than the input's or float32 runs the add and the norm apart, as the original. The MLP's add and
the next layer's input norm stay apart (the layer boundary is the model's loop). Under gradient checkpointing the
layer runs its class's forward. Every call site of the fused op is in ``add_rms_norm``.

Loss. Models whose ``loss_function`` is transformers' ``ForCausalLMLoss`` get ``causal_lm_loss`` on the instance:
the same shift (labels padded with ignore_index, shifted by one, or ``shift_labels`` as given), ``ignore_index`` and
``num_items_in_batch`` (a sum over it, else the mean over the targets not ignored; NaN when all are ignored), through
``tiered_ops.cross_entropy(..., dtype=torch.float32)``: the float32 loss transformers gets by upcasting the logits,
without the upcast. The win over the stock loss: no float32 copy of the logits, no float32 log-probabilities [N, V]
written or read back, and in training no float32 gradient of the logits cast down after.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.dispatch import public
from .swap import original_class, own_forward

cross_entropy, fused_add_rms_norm = public("cross_entropy"), public("fused_add_rms_norm")

# The dtypes the rewrites take. A forward asks ``dt.is_floating_point and dt.itemsize in (2, 4)`` (the same set: a test
# checks it on every dtype torch has) rather than ``dt in TAKEN``: read off the dtype alone, a trace folds it with no
# guard, where a global tuple puts a guard on each of its elements, evaluated on every call of the compiled model.
TAKEN = (torch.float32, torch.bfloat16, torch.float16)
LOSS_MARK = "_tiered_ops_loss"  # instance attribute of a model whose loss is routed


# The transformers code each rewrite reproduces, compared with a class's as syntax (``same_syntax``): annotations,
# decorators, docstrings and comments aside. A transformers version whose class does anything else is left, with why.

_LLAMA_NORM = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""
_GEMMA_NORM = """
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
"""
_GEMMA_NORM_NORM = """
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
"""
# the decoder layer ({cache}: the KV-cache argument's name, past_key_values or cache)
_LAYER = """
def forward(self, hidden_states, attention_mask=None, position_ids=None, {cache}=None, use_cache=False,
            position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, {cache}={cache}, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
"""


def _syntax(tree: ast.AST) -> str | None:
    """A function definition's syntax without its decorators, annotations and docstring (None: no function)."""
    fn = tree.body[0] if isinstance(tree, ast.Module) and tree.body else None
    if not isinstance(fn, ast.FunctionDef):
        return None
    fn.decorator_list, fn.returns = [], None
    a = fn.args
    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
        if arg is not None:
            arg.annotation = None
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        fn.body = body[1:]
    return ast.dump(fn)


@functools.lru_cache(maxsize=256)
def _syntax_of(fn: Callable) -> str | None:
    try:
        return _syntax(ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))))
    except (OSError, TypeError, SyntaxError):
        return None  # no source to compare


@functools.lru_cache(maxsize=16)
def _syntax_of_source(source: str) -> str | None:
    return _syntax(ast.parse(source))


# whether dynamo traces the caller (folded to True there): asked first at each call site, so that an eager call pays
# one call of it (~15 ns) and not the question's argument packing (~100 ns). A rewrite's forward asks ``tracing() and
# op.decomposes(...)`` (``op`` a public ``tiered_ops.<op>``): whether the trace would run the op's plain torch
# decomposition there (its compiled-context decision, or no decision yet); it then traces the code it replaces, so
# Inductor gets stock's graph (its casts, its order; no check of ours) where no kernel of ours runs. Asked in place,
# not through a helper: under torch.compile each function a forward calls is a guard on its code, evaluated on every
# call of the compiled model.
tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


class StandIn:
    """What a public op's ``decomposes`` reads of a tensor argument (shape, dtype, device, requires_grad), for a
    tensor not yet computed where the question is asked: shaped ``shape``, the rest as ``like``'s. Made while dynamo
    traces, it puts no node in the graph (a view standing in would: unused, yet it shifts the names of the compiled
    code's buffers).

    Also for a module's parameter (``StandIn(w.shape, w)``): a trace that reads a Parameter's ``requires_grad`` guards
    its type (one guard per parameter, on every call of the compiled model), and ``decomposes`` reads it. Here it is
    read only with grad mode on: with it off no call records a graph (a key's training bit is ``grad and ...``) and
    no contract of a patched op reads it, so the stand-in says False without reading it."""

    def __init__(self, shape: tuple[int, ...], like: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = torch.Size(shape), like.dtype, like.device
        self.requires_grad, self._dev = torch.is_grad_enabled() and like.requires_grad, like.get_device()

    def get_device(self) -> int:
        return self._dev


def plain_function(obj: Any) -> Any:
    """The function under a hub-kernel wrapper, else ``obj``. Where the ``kernels`` package is installed (a dependency
    of transformers from 5.25), ``@use_kernel_forward_from_hub`` turns a decorated function such as
    ``apply_rotary_pos_emb`` into an ``nn.Module`` instance whose class's forward calls the function (a variable of
    its closure): that function is the code every rewrite compares (``same_syntax``), and the one a rewrite runs
    where its op does not take a call. An instance given a forward of its own (a hub kernel in its place) is not
    unwrapped."""
    if not isinstance(obj, nn.Module) or "forward" in obj.__dict__:
        return obj
    fwd = getattr(type(obj), "forward", None)
    code = getattr(fwd, "__code__", None)
    if code is None or "func" not in code.co_freevars:
        return obj
    inner = fwd.__closure__[code.co_freevars.index("func")]
    try:
        fn = inner.cell_contents
    except ValueError:  # an empty cell
        return obj
    return fn if isinstance(fn, types.FunctionType) else obj


def same_syntax(fn: Any, source: str) -> bool:
    """Whether function ``fn`` (unwrapped, a hub-kernel wrapper's function too: ``plain_function``) is the code of
    ``source`` (see above)."""
    fn = plain_function(fn)
    mine = _syntax_of(fn) if callable(fn) else None
    return mine is not None and mine == _syntax_of_source(source)


def norm_form(cls: type) -> str | None:
    """'llama' or 'gemma' for an RMSNorm class whose forward is transformers' Llama or Gemma RMSNorm code, else None."""
    if same_syntax(getattr(cls, "forward", None), _LLAMA_NORM):
        return "llama"
    if same_syntax(getattr(cls, "forward", None), _GEMMA_NORM) and same_syntax(getattr(cls, "_norm", None),
                                                                               _GEMMA_NORM_NORM):
        return "gemma"
    return None


def layer_form(cls: type) -> str | None:
    """The KV-cache argument's name of a decoder layer class whose forward is the code the rewrite reproduces, else
    None."""
    fwd = getattr(cls, "forward", None)
    return next((c for c in ("past_key_values", "cache") if same_syntax(fwd, _LAYER.format(cache=c))), None)


# ---- the residual add + RMSNorm -------------------------------------------------------------------------------

def add_rms_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor, gemma: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x) of a transformers RMSNorm of the Llama form (``gemma``: the Gemma form),
    through one tiered_ops.fused_add_rms_norm call in the norm's Hugging Face form where the dtypes allow (a weight of
    x's dtype or float32); else the add and the norm module apart."""
    w = norm.weight
    dt = x.dtype
    if (dt.is_floating_point and dt.itemsize in (2, 4) and residual.dtype == dt and residual.shape == x.shape
            and w.dtype in (x.dtype, torch.float32)):
        # the sum's operands in the original's order (residual + x): the same bits either way, but a traced graph is
        # then the original's, and Inductor plans the same kernels and buffers for it
        # Gemma: (1 + w) in fp32, one rounding; Llama: normalized in fp32, rounded to x's dtype, then the weight (the
        # output promote(w, x)). Traced as the original's add and norm where the op would trace its decomposition.
        # (the weight asked about through a stand-in: no guard on its type, StandIn)
        if gemma:
            if not (tracing() and fused_add_rms_norm.decomposes(residual, x, (x.shape[-1],), StandIn(w.shape, w),
                                                                norm.eps, weight_offset=1.0)):
                return fused_add_rms_norm(residual, x, (x.shape[-1],), w, norm.eps, weight_offset=1.0)
        elif not (tracing() and fused_add_rms_norm.decomposes(residual, x, (x.shape[-1],), StandIn(w.shape, w),
                                                              norm.variance_epsilon, cast_before_weight=True)):
            return fused_add_rms_norm(residual, x, (x.shape[-1],), w, norm.variance_epsilon, cast_before_weight=True)
    h = residual + x
    return norm(h), h


def _decoder_layer(self: nn.Module, gemma: bool, cache_name: str, hidden_states: torch.Tensor, attention_mask: Any,
                   position_ids: Any, cache: Any, use_cache: Any, position_embeddings: Any, kwargs: dict[str, Any]
                   ) -> torch.Tensor:
    if cache_name == "cache":  # transformers' deprecated alias of the new name: used where the new one is not given
        old = kwargs.pop("past_key_values", None)
        cache = old if cache is None else cache
    kwargs[cache_name] = cache
    if self.gradient_checkpointing and self.training:
        return own_forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    hidden_states, residual = add_rms_norm(self.post_attention_layernorm, hidden_states, residual, gemma)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


# One forward per norm form and per name of the KV-cache argument (transformers renamed past_key_values to cache and
# keeps the old name as a deprecated alias, which _decoder_layer honours): only their signatures differ; module-level
# functions, as the swapped class pickles by them.

def _llama_decoder_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
                           position_ids: Any = None, past_key_values: Any = None, use_cache: Any = False,
                           position_embeddings: Any = None, **kwargs: Any) -> torch.Tensor:
    return _decoder_layer(self, False, "past_key_values", hidden_states, attention_mask, position_ids,
                          past_key_values, use_cache, position_embeddings, kwargs)


def _gemma_decoder_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
                           position_ids: Any = None, past_key_values: Any = None, use_cache: Any = False,
                           position_embeddings: Any = None, **kwargs: Any) -> torch.Tensor:
    return _decoder_layer(self, True, "past_key_values", hidden_states, attention_mask, position_ids,
                          past_key_values, use_cache, position_embeddings, kwargs)


def _llama_decoder_forward_cache(self: nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
                                 position_ids: Any = None, cache: Any = None, use_cache: Any = False,
                                 position_embeddings: Any = None, **kwargs: Any) -> torch.Tensor:
    return _decoder_layer(self, False, "cache", hidden_states, attention_mask, position_ids, cache, use_cache,
                          position_embeddings, kwargs)


def _gemma_decoder_forward_cache(self: nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
                                 position_ids: Any = None, cache: Any = None, use_cache: Any = False,
                                 position_embeddings: Any = None, **kwargs: Any) -> torch.Tensor:
    return _decoder_layer(self, True, "cache", hidden_states, attention_mask, position_ids, cache, use_cache,
                          position_embeddings, kwargs)


_FORWARDS = {(False, "past_key_values"): _llama_decoder_forward, (True, "past_key_values"): _gemma_decoder_forward,
             (False, "cache"): _llama_decoder_forward_cache, (True, "cache"): _gemma_decoder_forward_cache}

def decoder_plan(m: nn.Module) -> tuple[Callable[..., torch.Tensor], str] | str | None:
    """(forward, description) for a decoder layer this rewrite takes, the reason it cannot (a str), or None when
    ``m`` is no decoder layer with a post-attention RMSNorm."""
    post = getattr(m, "post_attention_layernorm", None)
    if not (isinstance(post, nn.Module) and "RMSNorm" in type(post).__name__
            and isinstance(getattr(m, "input_layernorm", None), nn.Module)):
        return None
    if not type(m).__module__.startswith("transformers."):
        return "not a transformers decoder layer"
    if original_class(m) is not type(m):
        return "already patched"
    cache = layer_form(type(m))
    if cache is None:
        return "its forward is not the Llama decoder layer's code this rewrite reproduces"
    if "forward" in m.__dict__:
        return "its forward is already replaced on the instance (by other code): left as it is"
    form = norm_form(original_class(post))
    if form == "llama" and hasattr(post, "variance_epsilon"):
        return _FORWARDS[False, cache], ("residual add + post_attention_layernorm -> tiered_ops.fused_add_rms_norm "
                                         "(Llama form: cast_before_weight=True)")
    if form == "gemma" and hasattr(post, "eps"):
        return _FORWARDS[True, cache], ("residual add + post_attention_layernorm -> tiered_ops.fused_add_rms_norm "
                                        "(Gemma form: weight_offset=1.0)")
    return "its post_attention_layernorm is not the Llama/Gemma RMSNorm"


# ---- the causal-LM loss ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _hf_causal_lm_loss() -> Callable[..., torch.Tensor]:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def _hf_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
    """transformers' ForCausalLMLoss itself (kept in a global: dynamo warns of a call through an lru_cache)."""
    global _HF_LOSS
    if _HF_LOSS is None:
        from transformers.loss.loss_utils import ForCausalLMLoss

        _HF_LOSS = ForCausalLMLoss
    return _HF_LOSS(*args, **kwargs)


_HF_LOSS: Callable[..., torch.Tensor] | None = None


def own_loss(m: nn.Module) -> Callable[..., torch.Tensor]:
    """``m``'s loss as transformers computes it: ForCausalLMLoss itself where ``route_loss`` routed it through
    tiered_ops.cross_entropy, else ``m.loss_function``."""
    return _hf_loss if m.__dict__.get("_loss_function") is causal_lm_loss else m.loss_function


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' ForCausalLMLoss through tiered_ops.cross_entropy (a float32 loss)."""
    if not (logits.dtype.is_floating_point and logits.dtype.itemsize in (2, 4)):  # not in TAKEN
        return _hf_loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    # transformers upcasts the logits to float32 first; dtype=float32 gives that loss (a bf16 loss would round it by up
    # to 2^-9) without writing the float32 copy of [N, V] logits, nor, in training, its float32 gradient
    flat, reduction = logits.reshape(-1, vocab_size), "mean" if num_items_in_batch is None else "sum"
    # asked with the labels in the targets' place (their shape once shifted, their dtype; another device: no)
    if tracing() and cross_entropy.decomposes(flat, (labels if shift_labels is None else shift_labels).reshape(-1),
                                              ignore_index, reduction, dtype=torch.float32):
        # stock's loss traced (the two reshapes above are unused: dropped from the compiled graph)
        return _hf_loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    loss = cross_entropy(flat, target, ignore_index, reduction, dtype=torch.float32)
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def loss_plan(m: nn.Module) -> bool | str | None:
    """True where ``m``'s loss can be routed, the reason it is left (a str), or None when it has no causal-LM
    loss (not a transformers model, another loss)."""
    if not type(m).__module__.startswith("transformers.") or not hasattr(type(m), "loss_function"):
        return None
    if LOSS_MARK in m.__dict__:
        return "already patched"
    if "_loss_function" in m.__dict__:
        return "its loss_function is set on the instance (by other code): left as it is"
    head = getattr(m, "get_output_embeddings", None)
    if not callable(head) or head() is None:
        return None  # a base model (no LM head) computes no loss
    from transformers.loss.loss_utils import LOSS_MAPPING

    # the property's own lookup, without its warning for a loss_type of None (GPT-2): ForCausalLM then
    fn = LOSS_MAPPING.get(getattr(m, "loss_type", None) or "ForCausalLM", _hf_causal_lm_loss())
    return True if fn is _hf_causal_lm_loss() else None


def route_loss(m: nn.Module) -> str:
    """Route ``m``'s loss through causal_lm_loss; returns the description ``patched`` gives."""
    global _HF_LOSS
    _HF_LOSS = _hf_causal_lm_loss()  # what a trace of causal_lm_loss may call (``_hf_loss``)
    m._loss_function = causal_lm_loss
    m.__dict__[LOSS_MARK] = ("loss_function -> tiered_ops.cross_entropy (ForCausalLMLoss: shift, ignore_index, "
                             "num_items)")
    return m.__dict__[LOSS_MARK]


def unroute_loss(m: nn.Module) -> bool:
    if LOSS_MARK not in m.__dict__:
        return False
    del m.__dict__[LOSS_MARK]
    m.__dict__.pop("_loss_function", None)
    return True
