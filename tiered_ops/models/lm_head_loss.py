"""The causal LM's head and loss fused (``tiered_ops.patch``, op ``linear_cross_entropy``): a model trained with
labels gets its loss from the last hidden states and the LM head's weight through ``tiered_ops.linear_cross_entropy``,
never materializing the [tokens, vocab] logits.

Which models. A transformers causal LM whose forward is the code of one of ``FORMS`` (compared as syntax, as the
other rewrites; each form is that code and the forward that reproduces it: a transformers version that writes the
forward another way is one more entry), whose ``lm_head`` is an ``nn.Linear`` of ``config.vocab_size`` outputs and
whose loss is transformers' ``ForCausalLMLoss`` (or that loss routed through tiered_ops.cross_entropy). The forms:
Llama, Mistral, Qwen2, Qwen3 and Gemma share one forward, Gemma2 and Gemma3 another (the logits soft-capped when
``config.final_logit_softcapping`` is set); each as transformers 5.17 writes it (``past_key_values``, the logits slice
inline) and as 5.24 does (``cache``, ``slice_logits_to_keep``). Soft-capped logits (``tanh``) cannot fuse into the
loss of a linear head: a model whose config sets ``final_logit_softcapping`` stays on the logits route (its loss still
goes through tiered_ops.cross_entropy), and the report says why.

When. In training (``model.training``) with ``labels``: the forward runs the decoder, then the loss as
``ForCausalLMLoss`` computes it (labels padded with ignore_index and shifted by one, or ``shift_labels`` as given;
``ignore_index``; a sum over ``num_items_in_batch`` when given, else the mean over the targets not ignored, NaN when
all are ignored), a float32 loss (the one transformers gets by upcasting the logits). The output's ``logits`` is then
None (Liger's ``skip_logits``): a caller that needs them in training calls the model without labels, or in eval mode.
Without labels, or in eval mode, the model runs its own forward, logits and all. A head whose weight's dtype is not the
hidden states' (an fp32 head under autocast), or soft-capping switched on after the patch, runs the original tail (the
head, the cap, then the loss) at that call. While dynamo traces, where ``linear_cross_entropy`` would trace its plain
torch decomposition (its compiled-context decision, or none yet), the forward traces stock's head and loss instead
(transformers' ForCausalLMLoss itself, also where the loss is routed through ``cross_entropy``: the op's decision covers
the loss, and ``tune`` never asks one of cross_entropy for it; the output's logits None as in an eager call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.dispatch import public
from .patch_layers import LOSS_MARK, StandIn, causal_lm_loss, own_loss, same_syntax, tracing
from .swap import original_class, own_forward

linear_cross_entropy = public("linear_cross_entropy")

DESCRIPTION = ("forward with labels in training -> tiered_ops.linear_cross_entropy (lm_head + ForCausalLMLoss fused: "
               "no [tokens, vocab] logits; the output's logits None)")


# ---- the forms: what the known causal-LM forwards differ in, and their code ------------------------------------

@dataclass(frozen=True)
class _Code:
    """What the known forwards differ in: the KV cache's keyword (``past_key_values`` or ``cache``), how the hidden
    states are cut to ``logits_to_keep`` (``keep``: 'inline' or 'slice_logits_to_keep'), and the Gemma2/3 tail
    (``softcap``: the logits soft-capped when the config says so, the loss given ``self.vocab_size``)."""
    cache: str
    keep: str
    softcap: bool


_KEEP = {  # the lines that cut the hidden states and run the head, per way of cutting
    "inline": """
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = self.lm_head(hidden_states[:, slice_indices, :])""",
    "slice_logits_to_keep": """
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    logits = self.lm_head(hidden_states)"""}
_CAP = """
    if self.config.final_logit_softcapping is not None:
        logits = logits / self.config.final_logit_softcapping
        logits = torch.tanh(logits)
        logits = logits * self.config.final_logit_softcapping"""


def _source(code: _Code) -> str:
    """transformers' causal-LM forward of that form, decorators and docstring aside (annotations are part of the
    syntax only in an annotated assignment)."""
    loss = ("logits, labels, self.vocab_size" if code.softcap
            else "logits=logits, labels=labels, vocab_size=self.config.vocab_size")
    c = code.cache
    return f"""
def forward(self, input_ids=None, attention_mask=None, position_ids=None, {c}=None, inputs_embeds=None, labels=None,
            use_cache=None, logits_to_keep=0, **kwargs):
    outputs: BaseModelOutputWithPast = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                                  position_ids=position_ids, {c}={c}, inputs_embeds=inputs_embeds,
                                                  use_cache=use_cache, **kwargs)
    hidden_states = outputs.last_hidden_state{_KEEP[code.keep]}{_CAP if code.softcap else ""}
    loss = None
    if labels is not None:
        loss = self.loss_function({loss}, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits, {c}=outputs.{c}, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions)
"""


# ---- the loss without the logits, and the forward that reproduces a form -------------------------------------

def lm_head_loss(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                 vocab_size: int, num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                 shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' ForCausalLMLoss of the logits ``hidden_states @ weight.T + bias``, through
    tiered_ops.linear_cross_entropy (a float32 loss), without the logits."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden_states.device)
    loss = linear_cross_entropy(hidden_states.reshape(-1, hidden_states.shape[-1]), weight, target, bias,
                                ignore_index, "mean" if num_items_in_batch is None else "sum", dtype=torch.float32)
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _fuses(head: nn.Module, hidden: torch.Tensor) -> bool:
    w, b = head.weight, head.bias
    dt = hidden.dtype  # in patch_layers.TAKEN, asked so that a trace reads no global (no guard)
    return dt.is_floating_point and dt.itemsize in (2, 4) and w.dtype == dt and (b is None or b.dtype == dt)


def _traced_as_stock(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """While dynamo traces: whether ``lm_head_loss``'s linear_cross_entropy would trace its decomposition, asked with
    stand-ins of its flattened hidden states and targets (the labels' shape once shifted, their dtype): the forward
    then traces stock's head and loss instead."""
    shift = kwargs.get("shift_labels")
    target = labels if shift is None else shift
    x = StandIn((hidden.numel() // hidden.shape[-1], hidden.shape[-1]), hidden)
    return linear_cross_entropy.decomposes(x, head.weight, StandIn((target.numel(),), target), head.bias,
                                           kwargs.get("ignore_index", -100),
                                           "mean" if kwargs.get("num_items_in_batch") is None else "sum",
                                           dtype=torch.float32)


def _keep(code: _Code, hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    if code.keep == "inline":
        return hidden_states[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep, :]
    from transformers.modeling_utils import slice_logits_to_keep

    return slice_logits_to_keep(hidden_states, logits_to_keep)


def _causal_lm(self: nn.Module, code: _Code, cache: Any, labels: torch.Tensor | None, logits_to_keep: Any,
               args: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """The forward of a swapped causal LM of form ``code`` (its decorators' argument handling included: the
    deprecated ``past_key_values`` name of ``cache``, ``return_dict``); see the module's docstring."""
    if code.cache == "cache" and cache is None and "past_key_values" in kwargs:
        cache = kwargs.pop("past_key_values")
    args[code.cache] = cache
    if labels is None or not self.training:
        return own_forward(self, labels=labels, logits_to_keep=logits_to_keep, **args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    outputs = self.model(**args, **kwargs)
    hidden_states = _keep(code, outputs.last_hidden_state, logits_to_keep)
    head, vocab_size = self.lm_head, self.vocab_size if code.softcap else self.config.vocab_size
    cap = self.config.final_logit_softcapping if code.softcap else None
    logits = None
    if cap is None and _fuses(head, hidden_states):
        if tracing() and _traced_as_stock(head, hidden_states, labels, kwargs):
            # stock's head and loss traced (the loss not routed through cross_entropy: the op's decision covers it,
            # and tune, which records the op's eager call, never asks one of cross_entropy); the output's logits None
            # as in an eager call
            loss = own_loss(self)(logits=head(hidden_states), labels=labels, vocab_size=vocab_size, **kwargs)
        else:
            loss = lm_head_loss(hidden_states, head.weight, head.bias, labels, vocab_size, **kwargs)
    else:  # the original tail
        logits = head(hidden_states)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=vocab_size, **kwargs)
    out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                 attentions=outputs.attentions, **{code.cache: getattr(outputs, code.cache)})
    return out if return_dict else out.to_tuple()


# One forward per form: only their signatures (the cache's keyword) and codes differ; module-level functions, as the
# swapped class pickles by them.
_LLAMA_524, _LLAMA_517 = _Code("cache", "slice_logits_to_keep", False), _Code("past_key_values", "inline", False)
_GEMMA2_524, _GEMMA2_517 = _Code("cache", "slice_logits_to_keep", True), _Code("past_key_values", "inline", True)


def causal_lm_forward(self: nn.Module, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                      cache: Any = None, inputs_embeds: Any = None, labels: torch.Tensor | None = None,
                      use_cache: Any = None, logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> Any:
    return _causal_lm(self, _LLAMA_524, cache, labels, logits_to_keep, dict(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
        use_cache=use_cache), kwargs)


def causal_lm_forward_past_key_values(self: nn.Module, input_ids: Any = None, attention_mask: Any = None,
                                      position_ids: Any = None, past_key_values: Any = None, inputs_embeds: Any = None,
                                      labels: torch.Tensor | None = None, use_cache: Any = None,
                                      logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> Any:
    return _causal_lm(self, _LLAMA_517, past_key_values, labels, logits_to_keep, dict(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
        use_cache=use_cache), kwargs)


def softcap_lm_forward(self: nn.Module, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                       cache: Any = None, inputs_embeds: Any = None, labels: torch.Tensor | None = None,
                       use_cache: Any = None, logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> Any:
    return _causal_lm(self, _GEMMA2_524, cache, labels, logits_to_keep, dict(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
        use_cache=use_cache), kwargs)


def softcap_lm_forward_past_key_values(self: nn.Module, input_ids: Any = None, attention_mask: Any = None,
                                       position_ids: Any = None, past_key_values: Any = None,
                                       inputs_embeds: Any = None, labels: torch.Tensor | None = None,
                                       use_cache: Any = None, logits_to_keep: int | torch.Tensor = 0,
                                       **kwargs: Any) -> Any:
    return _causal_lm(self, _GEMMA2_517, past_key_values, labels, logits_to_keep, dict(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
        use_cache=use_cache), kwargs)


@dataclass(frozen=True)
class HeadForm:
    """A causal-LM forward this rewrite takes: where it is seen (``name``), its code (``source``, compared as
    syntax) and the forward that reproduces it with the head and loss fused."""
    name: str
    source: str
    forward: Callable[..., Any]


FORMS: tuple[HeadForm, ...] = (
    HeadForm("Llama, Mistral, Qwen2, Qwen3, Gemma (transformers 5.24)", _source(_LLAMA_524), causal_lm_forward),
    HeadForm("Llama, Mistral, Qwen2, Qwen3, Gemma (transformers 5.17)", _source(_LLAMA_517),
             causal_lm_forward_past_key_values),
    HeadForm("Gemma2, Gemma3 (transformers 5.24)", _source(_GEMMA2_524), softcap_lm_forward),
    HeadForm("Gemma2, Gemma3 (transformers 5.17)", _source(_GEMMA2_517), softcap_lm_forward_past_key_values),
)


def head_form(cls: type) -> HeadForm | None:
    """The form of ``cls``'s forward, or None when it is none of ``FORMS``."""
    fwd = getattr(cls, "forward", None)
    return next((f for f in FORMS if same_syntax(fwd, f.source)), None)


def _hf_causal_lm_loss_of(m: nn.Module) -> bool:
    """Whether ``m``'s loss is transformers' ForCausalLMLoss, or that loss routed by ``patch_layers.route_loss``."""
    if LOSS_MARK in m.__dict__:
        return m.__dict__.get("_loss_function") is causal_lm_loss
    if "_loss_function" in m.__dict__:
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    return LOSS_MAPPING.get(getattr(m, "loss_type", None) or "ForCausalLM", ForCausalLMLoss) is ForCausalLMLoss


def head_plan(m: nn.Module) -> tuple[Callable[..., Any], str] | str | None:
    """(forward, description) for a causal LM whose head and loss this rewrite fuses, the reason it cannot (a str), or
    None when ``m`` is no transformers causal LM with a head and a loss."""
    if not type(m).__module__.startswith("transformers.") or not hasattr(type(m), "loss_function"):
        return None
    head, config = getattr(m, "lm_head", None), getattr(m, "config", None)
    if not isinstance(head, nn.Module) or config is None or not isinstance(getattr(m, "model", None), nn.Module):
        return None
    if original_class(m) is not type(m):
        return "already patched"
    if getattr(config, "final_logit_softcapping", None):
        return ("the logits are soft-capped (tanh) before the loss (final_logit_softcapping): that cannot fuse into "
                "the loss of a linear head; left on the logits route")
    form = head_form(type(m))
    if form is None:
        return "its forward is not the causal-LM code this rewrite reproduces"
    if "forward" in m.__dict__:
        return "its forward is already replaced on the instance (by other code): left as it is"
    if type(head) is not nn.Linear or head.weight.shape[0] != getattr(config, "vocab_size", None):
        return "its lm_head is not an nn.Linear of config.vocab_size outputs"
    if not _hf_causal_lm_loss_of(m):
        return "its loss is not transformers' ForCausalLMLoss"
    return form.forward, DESCRIPTION
