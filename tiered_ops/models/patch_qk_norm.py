"""Qwen3-style attention's q_norm/k_norm + RoPE through one ``tiered_ops.qk_norm_rope`` call: a rewrite of
``tiered_ops.patch``.

transformers' Qwen3 attention (and any attention whose forward holds the same lines) normalizes the per-head
projections with its RMSNorms, transposes them, and rotates them:

    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    ...
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

The rewrite is the class's own forward with those three statements changed, as syntax: the projections transposed
without the norms, and the rotation replaced by ``qk_norm_rope_call(self, query_states, key_states, cos, sin)``,
which normalizes and rotates both in one launch (the norm over head_dim gives the same values before or after the
transpose). It applies where the forward holds those statements exactly, q_norm and k_norm are transformers'
Llama-form RMSNorm and the modeling module's apply_rotary_pos_emb is the full rotate-half code (``patch_rope``). A
call the op does not take (another dtype, a weight of another dtype than q's, cos narrower than head_dim) runs the
norms and the original function.

While dynamo traces, where ``qk_norm_rope`` would trace its plain torch decomposition (its compiled-context decision,
or none yet), the attention traces its class's own code instead (its apply_rotary_pos_emb the original; its
q_norm/k_norm through their own class's forward, not the patched one: the op's decision covers them, and ``tune``,
which records the op's eager call, never asks one of rms_norm for them): Inductor gets stock's graph (the norms before
the transpose). The question is asked before the projections run, with stand-ins of q and k (``StandIn``: their
shapes, hidden_states' dtype, device and requires_grad, what the op's key reads; no node in the graph); a call the op
would not take traces the class's own forward, its norms as patched (as the rewrite's own fallback calls them).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
import types
from typing import Any, Callable

import torch
from torch import nn

from ..runtime.dispatch import public
from .patch_layers import StandIn, norm_form, tracing
from .patch_rope import _NAME, compiled, hub_kernel_chosen, rewrap, rope_form
from .swap import original_class, per_class

qk_norm_rope = public("qk_norm_rope")

_CALL = "_tiered_ops_qk_norm_rope"  # the name the rewritten forward calls

_Q = "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)"
_K = "key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)"
_ROPE = "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)"
_NEW = {_Q: "query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
        _K: "key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
        _ROPE: f"query_states, key_states = {_CALL}(self, query_states, key_states, cos, sin)"}
# stock's forward with its norms' own forwards (not their patched ones: ``swap.own_forward``'s lookup, spelled with no
# name of ours): what a trace deciding qk_norm_rope's decomposition runs. It needs no global of its own, so it runs
# in the modeling module's own globals, which a trace guards once for stock's code and this alike.
_OWN = "type(self.{n}).__dict__.get('_tiered_ops_base', type(self.{n})).forward(self.{n}, {x})"
_STOCK = {_Q: "query_states = {}.transpose(1, 2)".format(
              _OWN.format(n="q_norm", x="self.q_proj(hidden_states).view(hidden_shape)")),
          _K: "key_states = {}.transpose(1, 2)".format(
              _OWN.format(n="k_norm", x="self.k_proj(hidden_states).view(hidden_shape)"))}


def _takes(self: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the rewritten forward calls ``qk_norm_rope`` for these q, k [batch, heads, seq, head_dim] (tensors or
    ``StandIn``s), cos, sin."""
    wq, wk = self.q_norm.weight, self.k_norm.weight
    # q's dtype in patch_layers.TAKEN, asked so that a trace reads no global (no guard)
    return (q.dtype.is_floating_point and q.dtype.itemsize in (2, 4)
            and k.dtype == q.dtype and cos.dtype == q.dtype and sin.dtype == q.dtype
            and wq.dtype == q.dtype and wk.dtype == q.dtype
            and self.q_norm.variance_epsilon == self.k_norm.variance_epsilon
            and len(q.shape) == 4 and cos.dim() == 3 and cos.shape[-1] == q.shape[-1] and q.shape[-1] % 2 == 0
            and not cos.requires_grad and not sin.requires_grad)


def _norm_call(original: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        if _takes(self, q, k, cos, sin):
            return qk_norm_rope(q, k, cos, sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon)
        return original(self.q_norm(q), self.k_norm(k), cos, sin)

    return call


def _rewritten(raw: types.FunctionType, new: dict[str, str], name: str | None, value: Any
               ) -> types.FunctionType | str:
    """The forward ``raw`` with the statements ``new`` maps replaced by theirs, its global ``name`` bound to
    ``value`` (a variable of its closure: ``compiled``; None: no name rebound), or why not."""
    dumps = {ast.dump(ast.parse(k).body[0]): ast.parse(v).body[0] for k, v in new.items()}
    if raw.__code__.co_freevars:
        return "its forward uses a closure"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(raw)))
    except (OSError, TypeError, SyntaxError):
        return "no source to compare"
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef):
        return "no source to compare"
    found = [i for i, st in enumerate(fn.body) if ast.dump(st) in dumps]
    if len(found) != len(dumps) or {ast.dump(fn.body[i]) for i in found} != set(dumps):
        return "its forward does not hold Qwen3's q_norm/k_norm and apply_rotary_pos_emb lines"
    for i in found:
        fn.body[i] = copy.deepcopy(dumps[ast.dump(fn.body[i])])
    return compiled(fn, raw, name, value)


def _made(cls: type, stock: bool) -> Callable[..., Any] | str:
    fwd = getattr(cls, "forward", None)
    raw = inspect.unwrap(fwd) if callable(fwd) else None
    if not isinstance(raw, types.FunctionType):
        return "its forward has no source"
    if rope_form(raw.__globals__.get(_NAME), raw.__globals__) != "full":
        return "its apply_rotary_pos_emb is not transformers' full rotate-half code"
    new = _rewritten(raw, _STOCK, None, None) if stock else _rewritten(
        raw, _NEW, _CALL, _norm_call(raw.__globals__[_NAME]))
    if isinstance(new, str):
        return new
    return rewrap(fwd, raw, new) or "its forward is wrapped by a decorator this rewrite cannot see through"


@functools.lru_cache(maxsize=64)
def _routed(cls: type) -> Callable[..., Any] | str:
    """The class's forward with q_norm, k_norm + apply_rotary_pos_emb through one qk_norm_rope call, or why not."""
    return _made(cls, False)


@functools.lru_cache(maxsize=64)
def _stock_routed(cls: type) -> Callable[..., Any] | str:
    """The class's forward as it is, but for its q_norm and k_norm called through their own class's forward: what a
    trace runs where qk_norm_rope would trace its decomposition. That decision covers the norms (``tune`` records the
    op's call, never theirs), so a patched norm there would ask for an rms_norm decision no tune makes."""
    return _made(cls, True)


def _traced_as_stock(self: nn.Module, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """While dynamo traces: which of stock's forwards the call traces, asked with stand-ins of q and k [batch, heads,
    seq, head_dim] (hidden_states' dtype, device and requires_grad): "patched" where the op would not be called (the
    class's own forward, its norms as patched: an eager call runs them too, so ``tune`` records their calls); "own"
    where ``qk_norm_rope`` would trace its decomposition (``_stock_routed``: the norms' own forwards); None (the
    rewrite) where it would call a kernel, or where the call is not the form the rewrite reads (hidden_states [batch,
    seq, hidden], position_embeddings (cos, sin)). Under autocast q and k come out in autocast's dtype, never float32:
    float32 norm weights, which the op does not take with them, trace stock's code; others the rewrite's own path."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    pos = args[1] if len(args) > 1 else kwargs.get("position_embeddings")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not isinstance(pos, tuple) or len(pos) != 2:
        return None
    if torch.is_autocast_enabled(hidden.device.type):
        return "patched" if self.q_norm.weight.dtype == torch.float32 else None
    cos, sin = pos
    b, s = hidden.shape[:2]
    # the parameters read in stock's order (each projection's, then its norm's): the compiled graph takes them as
    # inputs in the order it first reads them, as stock's does. head_dim is the norms' size and the heads are read off
    # the projections' weights ([heads * head_dim, hidden]): a tensor's own guard covers its shape, where reading
    # the config's ints (or head_dim's type) adds guards; the config's where a projection has no such weight
    q_rows = _read(self.q_proj)
    wq = self.q_norm.weight
    k_rows = _read(self.k_proj)
    wk = self.k_norm.weight
    d = wq.shape[-1]
    if q_rows is None or k_rows is None or q_rows % d or k_rows % d:
        config = getattr(self, "config", None)
        heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
        if not (isinstance(heads, int) and isinstance(kv_heads, int)):
            return None
    else:
        heads, kv_heads = q_rows // d, k_rows // d
    q, k = StandIn((b, heads, s, d), hidden), StandIn((b, kv_heads, s, d), hidden)
    if not _takes(self, q, k, cos, sin):
        return "patched"
    return "own" if qk_norm_rope.decomposes(q, k, cos, sin, StandIn(wq.shape, wq), StandIn(wk.shape, wk),
                                            self.q_norm.variance_epsilon) else None


def _read(proj: nn.Module) -> int | None:
    """A linear projection's weight and bias read, as its forward reads them first: the weight's rows (None where it
    has no 2-D weight parameter). Read from ``_parameters``, the source stock's trace guards already (``getattr``
    with a default guards each module's attribute apart: lines per layer)."""
    params = proj._parameters
    w = params.get("weight")
    if w is None or w.dim() != 2:
        return None
    bias = params.get("bias")
    if bias is not None:
        bias.dtype  # noqa: B018
    return w.shape[0]


@per_class
def _qk_norm_attention_forward(base: type) -> Callable[..., Any]:
    """The swapped class's forward: its base's forward rewritten (``_routed``), or while dynamo traces, stock's code
    where ``_traced_as_stock`` says so; each forward held in the closure (a trace reads nothing of the class per
    module)."""
    routed, stock, own = _routed(base), _stock_routed(base), base.forward
    for made in (routed, stock):
        if isinstance(made, str):  # a class made again by pickle in a process whose transformers differs
            raise RuntimeError(f"tiered_ops.patch: {base.__qualname__} can no longer be routed: {made}")

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if tracing():
            how = _traced_as_stock(self, args, kwargs)
            if how == "own":
                return stock(self, *args, **kwargs)
            if how == "patched":
                return own(self, *args, **kwargs)
        return routed(self, *args, **kwargs)

    return forward


def qk_norm_plan(m: nn.Module) -> tuple[Callable[..., Any], str] | str | None:
    """(forward, description) for a Qwen3-style attention this rewrite takes, the reason it cannot (a str), or None
    when ``m`` has no q_norm and k_norm RMSNorms (or is swapped already)."""
    cls = original_class(m)
    qn, kn = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
    if (cls is not type(m) or not cls.__module__.startswith("transformers.") or not isinstance(qn, nn.Module)
            or not isinstance(kn, nn.Module) or "RMSNorm" not in type(qn).__name__):
        return None
    if "forward" in m.__dict__:
        return "its forward is already replaced on the instance (by other code): left as it is"
    if why := hub_kernel_chosen(m):
        return why
    if norm_form(original_class(qn)) != "llama" or norm_form(original_class(kn)) != "llama":
        return "its q_norm/k_norm are not the Llama-form RMSNorm"
    routed = _routed(cls)
    if isinstance(routed, str):
        return routed
    return _qk_norm_attention_forward, "q_norm, k_norm + apply_rotary_pos_emb -> tiered_ops.qk_norm_rope (one launch)"
