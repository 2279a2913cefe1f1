"""The causal LM's head and loss fused (``tiered_ops.patch``, op ``linear_cross_entropy``): a model trained with
labels gets its loss from the last hidden states and the LM head's weight through ``tiered_ops.linear_cross_entropy``,
never materializing the [tokens, vocab] logits.

Which models. A transformers causal LM whose forward is the code of ``_CAUSAL_LM`` (compared as syntax, as the other
rewrites: Llama, Mistral, Qwen2, Qwen3 and Gemma share it), whose ``lm_head`` is an ``nn.Linear`` of
``config.vocab_size`` outputs and whose loss is transformers' ``ForCausalLMLoss`` (or that loss routed through
tiered_ops.cross_entropy). Gemma2/Gemma3 soft-cap the logits (``tanh``) before the loss: that cannot fuse into the
loss of a linear head, so those models stay on the logits route (their loss still goes through
tiered_ops.cross_entropy), and the report says why.

When. In training (``model.training``) with ``labels``: the forward runs the decoder, then the loss as
``ForCausalLMLoss`` computes it (labels padded with ignore_index and shifted by one, or ``shift_labels`` as given;
``ignore_index``; a sum over ``num_items_in_batch`` when given, else the mean over the targets not ignored, NaN when
all are ignored), a float32 loss (the one transformers gets by upcasting the logits). The output's ``logits`` is then
None (Liger's ``skip_logits``): a caller that needs them in training calls the model without labels, or in eval mode.
Without labels, or in eval mode, the model runs its own forward, logits and all. A head whose weight's dtype is not the
hidden states' (an fp32 head under autocast) runs the original tail (head, then the loss) at that call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.dispatch import public
from .patch_layers import LOSS_MARK, causal_lm_loss, same_syntax
from .swap import original_class

linear_cross_entropy = public("linear_cross_entropy")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DESCRIPTION = ("forward with labels in training -> tiered_ops.linear_cross_entropy (lm_head + ForCausalLMLoss fused: "
               "no [tokens, vocab] logits; the output's logits None)")

# transformers' causal-LM forward (Llama, Mistral, Qwen2, Qwen3, Gemma), decorators and docstring aside (annotations are
# part of the syntax only in an annotated assignment)
_CAUSAL_LM = """
def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None, labels=None,
            use_cache=None, logits_to_keep=0, **kwargs):
    outputs: BaseModelOutputWithPast = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                                  position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                                                  use_cache=use_cache, **kwargs)
    hidden_states = outputs.last_hidden_state
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions)
"""


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
    return hidden.dtype in _DTYPES and w.dtype == hidden.dtype and (b is None or b.dtype == hidden.dtype)


def causal_lm_forward(self: nn.Module, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                      cache: Any = None, inputs_embeds: Any = None, labels: torch.Tensor | None = None,
                      use_cache: Any = None, logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> Any:
    """The forward of a swapped causal LM (``_CAUSAL_LM``'s code, its decorators' argument handling included: the
    deprecated ``past_key_values`` name of ``cache``, ``return_dict``); see the module's docstring."""
    if cache is None and "past_key_values" in kwargs:
        cache = kwargs.pop("past_key_values")
    if labels is None or not self.training:
        return original_class(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                            position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                                            labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep,
                                            **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep

    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    head = self.lm_head
    logits = None
    if _fuses(head, hidden_states):
        loss = lm_head_loss(hidden_states, head.weight, head.bias, labels, self.config.vocab_size, **kwargs)
    else:  # the original tail
        logits = head(hidden_states)
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
                                 attentions=outputs.attentions)
    return out if return_dict else out.to_tuple()


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
    if not same_syntax(getattr(type(m), "forward", None), _CAUSAL_LM):
        return "its forward is not the causal-LM code this rewrite reproduces"
    if "forward" in m.__dict__:
        return "its forward is already replaced on the instance (by other code): left as it is"
    if type(head) is not nn.Linear or head.weight.shape[0] != getattr(config, "vocab_size", None):
        return "its lm_head is not an nn.Linear of config.vocab_size outputs"
    if not _hf_causal_lm_loss_of(m):
        return "its loss is not transformers' ForCausalLMLoss"
    return causal_lm_forward, DESCRIPTION
