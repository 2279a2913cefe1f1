"""Peer implementations: other libraries' kernels for the same ops, measured beside ours and never selected.

A peer is an ``Impl`` of tier ``PEER`` with the op's signature. The sweep gates and times it like any tier (so
the report shows it next to ours, in the same run, against the same copy bandwidth); selection, the
policies' decisions and ``tiered-ops check`` skip it. Its source hash covers the library files it runs, so a
new version of the library is a new candidate.

Liger-Kernel (``liger_kernel``, Triton): softmax (last dim), rms_norm and layer_norm, each on a single
trailing normalized dim. rms_norm uses ``casting_mode="gemma"`` (the whole computation in fp32, rounded
once: the semantics of our ops) and ``in_place=False`` (the default ``True`` writes dx over dy, which the
timing loop re-uses). cross_entropy (``liger_cross_entropy``, which calls ``LigerCrossEntropyFunction``) writes the
logits' gradient over its input during a forward that requires grad: the peer gives it a copy of the logits then
(the copy is timed with it), and its mean is made NaN where torch's is (every target ignored).
fused_add_rms_norm (``LigerFusedAddRMSNormFunction``, 0.8.5) likewise in "gemma" mode: the
sum rounded once to the dtype, then the fp32 rms_norm of it; it needs a weight. linear_cross_entropy
(``liger_fused_linear_cross_entropy``: chunks of tokens, the gradients computed in the forward), its mean NaN where
torch's is.
swiglu: ``liger_swiglu`` (``LigerSiLUMulFunction``) for "silu" and ``liger_geglu`` (``LigerGELUMulFunction``, GELU's
tanh form) for "gelu_tanh", each act(gate) in fp32 rounded to the dtype, then times up (eager's rounding); no erf
GeGLU ("gelu"), a last dim of 1..65536 (one row per program). rotary_embedding: ``liger_rotary_pos_emb`` (what
Liger's model patches swap in: its Triton kernel, or its CuTe DSL one where that is installed and claims the case), q
and k [batch, heads, seq, head_dim] in any layout, cos and sin [batch or 1, seq, rotary_dim] (partial rotary
included); in the dtype of cos, so cos and sin of q's dtype only, and an even head_dim (its CuTe DSL path raises on
an odd one). It reads the first half of cos and sin only: the checked call refuses cos or sin whose halves differ
(transformers' cat(freqs, freqs) repeats them; the inputs factory makes them so).
Both write over their inputs, as in a model, where those are activations nobody reads again: SwiGLU's backward writes
the gradients over the saved gate and up, RoPE rotates q and k in place where they are the attention's transposed
views (and the output gradients where those are). The checked call (``Impl.fn``: the gate, any other caller) gives
Liger copies, so the caller's tensors stay as they were; the timed call (``Impl.unchecked``, on the harness's own
inputs) runs Liger as a model does, without them.

quack (``quack``, CuTe DSL kernels; sm80 and newer): softmax over the last dim, rms_norm and fused_add_rms_norm
(``rmsnorm`` with a residual and ``prenorm``) over one trailing dim, cross_entropy without label smoothing. Its
import needs the CUTLASS DSL libraries: where they are missing the peer is unavailable, with the import's error.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..registry import OPS, Impl, OpSpec, Tier

LIGER = "liger_kernel"
LIGER_MAX_ROW = 65536  # Liger's one-row kernels: a row of at most this many elements


def _package_files(package: str, modules: tuple[str, ...], folder: str = "") -> tuple[Path, ...]:
    """The files of ``package``'s ``modules`` (under ``folder``) that exist, for a peer's source hash; none where it
    is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return ()
    root = Path(next(iter(spec.submodule_search_locations))) / folder
    return tuple(p for p in (root / f"{m}.py" for m in modules) if p.exists())


def _liger_files(*modules: str) -> tuple[Path, ...]:
    return _package_files(LIGER, (*modules, "utils"), "ops")


def liger_available(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "Liger-Kernel runs on CUDA devices only"
    if importlib.util.find_spec(LIGER) is None:
        return ("liger_kernel is not installed (a peer: pip install liger-kernel==0.8.5, or carry the wheel as "
                "scripts/gpu.sh does)")
    return None


def _liger_glu(gate: torch.Tensor, activation: str) -> Callable[..., torch.Tensor]:
    """Liger's gated product for ``activation``, after the checks of what it claims (before its import)."""
    if activation not in ("silu", "gelu_tanh"):
        raise NotImplementedError(f"swiglu (Liger peer): silu and gelu_tanh only, got activation={activation!r}")
    if gate.dim() == 0 or not 1 <= gate.shape[-1] <= LIGER_MAX_ROW:
        raise NotImplementedError(f"swiglu (Liger peer): a last dim of 1..{LIGER_MAX_ROW} only (one row a program), "
                                  f"got shape {list(gate.shape)}")
    from liger_kernel.transformers.functional import liger_geglu, liger_swiglu

    return liger_swiglu if activation == "silu" else liger_geglu


def _liger_swiglu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """As a model runs it (the timed call): its backward writes dgate and dup over the saved gate and up."""
    return _liger_glu(gate, activation)(gate, up)


def _liger_swiglu_on_copies(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The checked call: gate and up copied where a backward may follow, so the caller's stay as they were."""
    glu = _liger_glu(gate, activation)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        gate, up = gate.clone(), up.clone()
    return glu(gate, up)


def _liger_rope_claims(q: torch.Tensor, cos: torch.Tensor) -> None:
    if cos.dtype != q.dtype:  # Liger computes in cos's dtype and returns q's: torch would promote
        raise NotImplementedError(f"rotary_embedding (Liger peer): cos and sin of q's dtype {q.dtype} only, got "
                                  f"{cos.dtype}")
    if q.shape[-1] % 2:
        raise NotImplementedError(f"rotary_embedding (Liger peer): an even head_dim only, got {q.shape[-1]}")


def _liger_rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """As a model runs it (the timed call): q and k rotated in place where they are transposed [b, s, h, d] views."""
    _liger_rope_claims(q, cos)
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    return liger_rotary_pos_emb(q, k, cos, sin)


def _liger_rotary_embedding_on_copies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked call: cos and sin must repeat their halves (Liger reads the first); q, k and the output gradients
    copied (in their layout), so the caller's stay as they were."""
    _liger_rope_claims(q, cos)
    r = cos.shape[-1] // 2
    if not all(torch.equal(t[..., :r], t[..., r:]) for t in (cos, sin)):
        raise NotImplementedError("rotary_embedding (Liger peer): cos and sin whose halves repeat only (transformers' "
                                  "cat(freqs, freqs)): Liger reads their first half")
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    outs = liger_rotary_pos_emb(q.clone(), k.clone(), cos, sin)
    for o in outs:
        if o.requires_grad:
            o.register_hook(torch.clone)  # Liger's backward rotates the gradient in place where its layout allows
    return outs


def _one_dim(op: str, normalized_shape: int | Sequence[int], peer: str = "Liger") -> int:
    ns = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    if len(ns) != 1:
        raise NotImplementedError(f"{op} ({peer} peer): a single normalized dim only, got normalized_shape {ns}")
    return ns[0]


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.reshape(-1, n) if x.numel() else x


def _liger_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    from liger_kernel.ops.softmax import LigerSoftmaxFunction

    if dim not in (-1, x.dim() - 1):
        raise NotImplementedError(f"softmax (Liger peer): the last dim only, got dim={dim} for {x.dim()}-d x")
    return LigerSoftmaxFunction.apply(x)


def _liger_rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                    eps: float | None = None) -> torch.Tensor:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    n = _one_dim("rms_norm", normalized_shape)
    e = torch.finfo(x.dtype).eps if eps is None else float(eps)
    y = LigerRMSNormFunction.apply(_rows(x, n), weight, e, 0.0, "gemma", False)
    return y.view(x.shape)


def _liger_layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    n = _one_dim("layer_norm", normalized_shape)
    if weight is None or bias is None:
        raise NotImplementedError("layer_norm (Liger peer): needs both weight and bias")
    return LigerLayerNormFunction.apply(_rows(x, n), weight, bias, eps).view(x.shape)


def _liger_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0, *, dtype: torch.dtype | None = None
                         ) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_cross_entropy

    if logits.requires_grad:  # Liger writes the gradient over its input: the caller's logits get a copy's
        logits = logits.clone()
    loss = liger_cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction=reduction)
    if reduction == "mean":  # torch's mean is NaN when every target is ignored, Liger's 0 (its gradient 0 in both)
        loss = torch.where((target != ignore_index).any(), loss, torch.nan)
    return loss.to(dtype or logits.dtype)


def _liger_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, normalized_shape: int | Sequence[int],
                              weight: torch.Tensor | None = None, eps: float | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    n = _one_dim("fused_add_rms_norm", normalized_shape)
    if weight is None:
        raise NotImplementedError("fused_add_rms_norm (Liger peer): needs a weight")
    e = torch.finfo(x.dtype).eps if eps is None else float(eps)
    y, s = LigerFusedAddRMSNormFunction.apply(_rows(x, n), _rows(residual, n), weight, e, 0.0, "gemma", False)
    return y.view(x.shape), s.view(x.shape)


def _liger_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                                label_smoothing: float = 0.0, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index,
                                            label_smoothing=label_smoothing, reduction=reduction)
    if reduction == "mean":  # torch's mean is NaN when every target is ignored
        loss = torch.where((target != ignore_index).any(), loss, torch.nan)
    return loss.to(dtype or hidden.dtype)


QUACK = "quack"


def _quack_files(*modules: str) -> tuple[Path, ...]:
    return _package_files(QUACK, (*modules, "reduction_base", "utils"))


_QUACK_IMPORT: list[str | None] = []  # the import's outcome, once per process: a failed import is not cached by Python


def quack_available(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "quack runs on CUDA devices only"
    if importlib.util.find_spec(QUACK) is None:
        return "quack is not installed (a peer: pip install quack-kernels, or carry its wheels as scripts/gpu.sh does)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "quack needs compute capability 8.0 or newer"
    if not _QUACK_IMPORT:
        try:
            importlib.import_module(QUACK)
            _QUACK_IMPORT.append(None)
        except Exception as e:  # noqa: BLE001 - an import that fails (the CUTLASS DSL libraries): the peer is unavailable
            _QUACK_IMPORT.append(f"quack did not import: {type(e).__name__}: {e}")
    return _QUACK_IMPORT[0]


def _quack_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if dim not in (-1, x.dim() - 1):
        raise NotImplementedError(f"softmax (quack peer): the last dim only, got dim={dim} for {x.dim()}-d x")
    from quack import softmax

    return softmax(_rows(x, x.shape[-1])).view(x.shape) if x.numel() else torch.empty_like(x)


def _quack_rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                    eps: float | None = None) -> torch.Tensor:
    n = _one_dim("rms_norm", normalized_shape, "quack")
    from quack import rmsnorm

    e = torch.finfo(x.dtype).eps if eps is None else float(eps)
    return rmsnorm(_rows(x, n), weight, eps=e).view(x.shape)


def _quack_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, normalized_shape: int | Sequence[int],
                              weight: torch.Tensor | None = None, eps: float | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    n = _one_dim("fused_add_rms_norm", normalized_shape, "quack")
    from quack import rmsnorm

    e = torch.finfo(x.dtype).eps if eps is None else float(eps)
    y, s = rmsnorm(_rows(x, n), weight, residual=_rows(residual, n), residual_dtype=x.dtype, eps=e, prenorm=True)
    return y.view(x.shape), s.view(x.shape)


def _quack_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0, *, dtype: torch.dtype | None = None
                         ) -> torch.Tensor:
    if label_smoothing:
        raise NotImplementedError(f"cross_entropy (quack peer): no label smoothing, got {label_smoothing}")
    from quack import cross_entropy

    loss = cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    if reduction == "mean":  # torch's mean is NaN when every target is ignored
        loss = torch.where((target != ignore_index).any(), loss, torch.nan)
    return loss.to(dtype or logits.dtype)


QUACK_OPS: dict[str, tuple[Callable[..., torch.Tensor], str]] = {
    "softmax": (_quack_softmax, "softmax"),
    "rms_norm": (_quack_rms_norm, "rmsnorm"),
    "fused_add_rms_norm": (_quack_fused_add_rms_norm, "rmsnorm"),
    "cross_entropy": (_quack_cross_entropy, "cross_entropy"),
}

LIGER_OPS: dict[str, tuple[Callable[..., Any], str | tuple[str, ...]]] = {
    "softmax": (_liger_softmax, "softmax"),
    "rms_norm": (_liger_rms_norm, "rms_norm"),
    "layer_norm": (_liger_layer_norm, "layer_norm"),
    "cross_entropy": (_liger_cross_entropy, "cross_entropy"),
    "fused_add_rms_norm": (_liger_fused_add_rms_norm, "fused_add_rms_norm"),
    "linear_cross_entropy": (_liger_linear_cross_entropy, "fused_linear_cross_entropy"),
    "swiglu": (_liger_swiglu_on_copies, ("swiglu", "geglu")),
    "rotary_embedding": (_liger_rotary_embedding_on_copies,
                         ("rope", "backends/_triton/rope", "backends/_cutedsl/rope", "cutedsl/ops/rope")),
}
# the timed call where it is not the checked one (Impl.unchecked): Liger as a model runs it, over its inputs
LIGER_TIMED: dict[str, Callable[..., Any]] = {
    "swiglu": _liger_swiglu,
    "rotary_embedding": _liger_rotary_embedding,
}


def register(specs: Sequence[OpSpec] | None = None) -> list[Impl]:
    """Add the ``liger`` and ``quack`` peers to each op they cover (idempotent); returns the impls added."""
    added = []
    for name, table, timed, files, available in (("liger", LIGER_OPS, LIGER_TIMED, _liger_files, liger_available),
                                                 ("quack", QUACK_OPS, {}, _quack_files, quack_available)):
        for op, (fn, modules) in table.items():
            spec = OPS.get(op) if specs is None else next((s for s in specs if s.name == op), None)
            if spec is None or name in spec.impls:
                continue
            sources = files(*((modules,) if isinstance(modules, str) else modules))
            added.append(spec.add(Impl(name, Tier.PEER, fn, sources, devices=("cuda",), available=available,
                                       unchecked=timed.get(op))))
    return added
