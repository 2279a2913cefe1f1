"""What benchmarks/models.py builds: the model tables (random weights from configs,
nothing downloaded), the variants (stock, its unpatched copy, tiered_ops.patch with and without fuse_residual,
Liger's patch; each patch's fused LM head + loss on, for training), one step of a workload and the ways to run it
(CUDA-graph capture, a compile of its own)."""

from __future__ import annotations

import contextlib
import copy
import types
from typing import Any, Callable, Iterator

import torch

import tiered_ops

CONTROL = "stock-copy"  # an unpatched copy of stock: what a verdict reads between two identical models
# the variants whose LM head and loss are one fused op: a training step gives a loss and no logits, so they run only
# for training and are checked by their loss and gradient norm against stock's
FUSED_LOSS = ("tiered-lce", "liger-lce")


class Skip(Exception):
    """A variant that cannot run here, with why."""


def models(quick: bool, seq: int) -> dict[str, tuple[Any, Any, str]]:
    """name -> (model class, config, liger architecture name)."""
    import transformers as T

    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if quick:
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=max(64, seq))
        return {"llama-tiny": (T.LlamaForCausalLM, T.LlamaConfig(**small), "llama"),
                "qwen3-tiny": (T.Qwen3ForCausalLM, T.Qwen3Config(**small, head_dim=16), "qwen3"),
                "gpt2-tiny": (T.GPT2LMHeadModel, T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                                              n_positions=max(64, seq), bos_token_id=0,
                                                              eos_token_id=0, **no_dropout), "gpt2")}
    llama = T.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=max(8192, seq))
    qwen3 = T.Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936,
                          max_position_embeddings=max(8192, seq))
    # Mistral 7B v0.3 (vocabulary 32768, no sliding window)
    mistral = T.MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=128, vocab_size=32768, sliding_window=None,
                              max_position_embeddings=max(8192, seq))
    gpt2 = T.GPT2Config(n_positions=max(1024, seq), **no_dropout)  # the defaults are GPT-2 small
    return {"llama-8b-dims-2l": (T.LlamaForCausalLM, llama, "llama"),
            "qwen3-8b-dims-2l": (T.Qwen3ForCausalLM, qwen3, "qwen3"),
            "mistral-7b-dims-2l": (T.MistralForCausalLM, mistral, "mistral"),
            "gpt2-small": (T.GPT2LMHeadModel, gpt2, "gpt2")}


def base_model(name: str, seq: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
               ) -> tuple[torch.nn.Module, Any, str]:
    """(model, config, liger architecture name) of ``name`` (a model of either table), random weights from seed 0, in
    eval mode; a model naming no loss type gets the causal LM's (GPT-2 names none: transformers then logs, breaking
    fullgraph)."""
    cls, config, arch = (models(True, seq) | models(False, seq))[name]
    torch.manual_seed(0)
    with device:
        base = cls(config).to(dtype).eval()
    if getattr(base, "loss_type", None) is None:
        base.loss_type = "ForCausalLM"
    return base, config, arch


class Variant:
    """A copy of the base model under one patch; ``active()`` is the context its calls must run in."""

    def __init__(self, name: str, base: torch.nn.Module, arch: str) -> None:
        self.name, self.model, self.note, self._swap = name, copy.deepcopy(base), "", {}
        if name.startswith("tiered"):
            # the fused LM head + loss off (as in Liger's variant), so that training has logits; on in tiered-lce
            ops = [o for o in tiered_ops.models.patching.PATCHABLE_OPS
                   if o != "linear_cross_entropy" or name in FUSED_LOSS]
            report = tiered_ops.patch(self.model, ops=ops, fuse_residual=name == "tiered-fused")
            left = sorted({f"{x.cls}: {x.reason}" for x in report.left})
            self.note = f"{len(report.swapped)} swapped" + (f"; left {'; '.join(left)}" if left else "")
        elif name.startswith("liger"):
            self._liger(arch, fused_loss=name in FUSED_LOSS)
        elif name == CONTROL:
            self.note = "the control: an unpatched copy of stock"

    def _liger(self, arch: str, fused_loss: bool) -> None:
        try:
            import liger_kernel.transformers as L
        except ImportError:
            raise Skip("liger-kernel not installed") from None
        apply = getattr(L, f"apply_liger_kernel_to_{arch}", None)
        if apply is None:
            raise Skip(f"liger has no {arch} patch")
        import importlib

        mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        before = dict(vars(mod))
        apply(model=self.model, **({} if fused_loss else {"fused_linear_cross_entropy": False}))
        # module functions Liger replaced (RoPE): back for the other variants, swapped in for Liger's calls
        self._swap = {(mod, k): v for k, v in vars(mod).items() if before.get(k, v) is not v}
        for (m, k) in self._swap:
            setattr(m, k, before[k])
        self.note = ("liger defaults" if fused_loss else "liger defaults, fused linear cross entropy off") + (
            f"; module functions swapped per call: {', '.join(k for _, k in self._swap)}" if self._swap else "")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        old = {key: getattr(*key) for key in self._swap}
        for (m, k), v in self._swap.items():
            setattr(m, k, v)
        try:
            yield
        finally:
            for (m, k), v in old.items():
                setattr(m, k, v)

    def tune(self, kwargs: dict[str, Any], train: bool, context: str, show: bool = True) -> float:
        """tiered_ops.tune of this variant's model for one step of ``kwargs`` in ``context`` (tiered_ops' name of it);
        with ``show`` each decision printed. The seconds it took (0 for a variant not patched by tiered_ops)."""
        if not self.name.startswith("tiered"):
            return 0.0
        report = tiered_ops.tune(self.model, kwargs, train=train, context=context)
        for c in report.calls if show else ():
            print(f"  {self.name} decided {c.call.op} {c.call.problem} {c.call.mode}: {c.chosen} [{c.tier}]")
        return report.seconds


def step_fn(model: Any, workload: str, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One call of ``workload`` on ``model`` (an nn.Module or its compiled form), returning the logits. A training
    step also keeps its loss as the function's ``loss``, and returns that loss where the model makes no logits (a
    fused LM head + loss)."""
    if workload == "train":
        def train() -> torch.Tensor:
            out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            train.loss = out.loss.detach()
            return train.loss if out.logits is None else out.logits.detach()

        return train

    def infer() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits

    return infer


def graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` captured in a CUDA graph after an eager warm-up on a side stream (torch's recipe); calls replay it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def own_compile(model: torch.nn.Module, tag: str, backend: str | Callable[..., Any] | None = None
                ) -> Callable[..., Any]:
    """``torch.compile(fullgraph=True, dynamic=False)`` of a call of ``model`` through a code object of its own (dynamo
    keeps compiled frames per code object: variants sharing ``forward``'s cache check each other's guards on every
    call). Static: one function serves every workload's shapes, and by default stock's graphs turn dynamic at its first
    recompile while tiered_ops' traces, which guard each size, stay static: rows would compare graphs of two kinds."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    name = f"call_{''.join(c if c.isalnum() else '_' for c in tag)}"
    fn = types.FunctionType(call.__code__.replace(co_name=name), call.__globals__, name, None,
                            call.__closure__)
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend or "inductor")
