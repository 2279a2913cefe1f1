"""transformers 5.17's causal-LM forwards, copied from its wheel (models/llama/modeling_llama.py:
LlamaForCausalLM.forward, the code Mistral, Qwen2, Qwen3 and Gemma share; models/gemma2/modeling_gemma2.py:
Gemma2ForCausalLM.forward, Gemma3's too), their example docstrings left out, each in a
class of the name it has there (only the forward is copied): set as a class's forward, they make the
installed transformers' model run and look (to ``tiered_ops.patch``'s syntax check) as 5.17's does, so the LM head +
loss rewrite's 5.17 forms are tested without installing 5.17.

The copied code is transformers' (Copyright The HuggingFace Team, Apache License 2.0)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

try:
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils.generic import can_return_tuple
except ImportError:  # the tests that use these skip without transformers
    CausalLMOutputWithPast = None

    def can_return_tuple(f):
        return f

if TYPE_CHECKING:
    from transformers.cache_utils import Cache
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.processing_utils import Unpack
    from transformers.utils import TransformersKwargs


class LlamaForCausalLM:
    """LlamaForCausalLM's forward in 5.17 (Mistral, Qwen2, Qwen3 and Gemma have its code)."""

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

        hidden_states = outputs.last_hidden_state
        # Only compute necessary logits, and do not upcast them to float if we are not computing the loss
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class Gemma2ForCausalLM:
    """Gemma2ForCausalLM's forward in 5.17 (Gemma3ForCausalLM has its code)."""

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        # decoder outputs consists of (dec_features, layer_state, dec_hidden, dec_attn)
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

        hidden_states = outputs.last_hidden_state
        # Only compute necessary logits, and do not upcast them to float if we are not computing the loss
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping

        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
