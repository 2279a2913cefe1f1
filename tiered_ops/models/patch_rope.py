"""The attention's rotary embedding through ``tiered_ops.rotary_embedding``: a rewrite of ``tiered_ops.patch``.

transformers' attention modules (Llama, Mistral, Qwen2, Qwen3, Gemma and the many that copy them) call their modeling
module's ``apply_rotary_pos_emb(query_states, key_states, cos, sin)`` from ``forward``. The rewrite swaps the module's
class (``swap``) for one whose forward is the class's own forward code run with ``apply_rotary_pos_emb`` bound to a
call of ``tiered_ops.rotary_embedding`` instead (its source compiled again in its module, that one name a variable of
its closure; decorators such as ``deprecate_kwarg`` kept around it): the rest of the forward is the class's, line for
line. It applies where the
modeling module's ``apply_rotary_pos_emb`` and ``rotate_half`` are, as syntax, transformers' rotate-half code: the full
form (Llama's: cos as wide as head_dim) or the partial one (GPT-NeoX's, Bamba's: the dims past cos's width pass
through), and where every call of it in the forward passes those four arguments (``unsqueeze_dim=1``). A call the op
does not take (a dtype other than fp32, bf16, fp16; q and k of different dtypes; cos or sin that require grad; cos
narrower than head_dim under the full form, where the original raises) runs the original function. Where the
``kernels`` package wraps that function into a hub-kernel module (``plain_function``), the function inside is the one
compared and run; an attention whose own wrapper of it ``kernels.kernelize`` gave a hub kernel is left as it is
(``hub_kernel_chosen``).
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
from .patch_layers import plain_function, same_syntax, tracing
from .swap import original_class, per_class

rotary_embedding = public("rotary_embedding")

_NAME = "apply_rotary_pos_emb"

# The transformers code the rewrite replaces, compared as syntax (docstrings, annotations, decorators and comments
# aside).
_ROTATE_HALF = """
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""
_ROPE_FULL = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""
_ROPE_PARTIAL = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed
"""


def hub_kernel_chosen(m: nn.Module) -> str | None:
    """Why an attention module is left where ``kernels.kernelize`` gave its apply_rotary_pos_emb a hub kernel: the
    attention's own wrapper of the function (``use_kernelized_func``: ``_kernel_funcs``, which the global function
    dispatches to while the attention runs) then has a forward of its own; else None."""
    own = (m.__dict__.get("_kernel_funcs") or {}).get(_NAME)
    if own is not None and "forward" in getattr(own, "__dict__", {}):
        return "its apply_rotary_pos_emb runs a hub kernel kernels.kernelize chose: left as it is"
    return None


def rope_form(fn: Any, globals_: dict[str, Any]) -> str | None:
    """'full' or 'partial' for a function that is transformers' rotate-half apply_rotary_pos_emb (its module's
    rotate_half too), else None."""
    if not same_syntax(globals_.get("rotate_half"), _ROTATE_HALF):
        return None
    if same_syntax(fn, _ROPE_FULL):
        return "full"
    return "partial" if same_syntax(fn, _ROPE_PARTIAL) else None


def _takes(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: Any, partial: bool) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)) or unsqueeze_dim != 1:
        return False
    # q's and cos's dtypes in patch_layers.TAKEN, asked so that a trace reads no global (no guard)
    if (not (q.dtype.is_floating_point and q.dtype.itemsize in (2, 4)) or k.dtype != q.dtype
            or not (cos.dtype.is_floating_point and cos.dtype.itemsize in (2, 4)) or sin.dtype != cos.dtype):
        return False
    if q.dim() != 4 or cos.dim() != 3 or cos.requires_grad or sin.requires_grad:
        return False
    return partial or cos.shape[-1] == q.shape[-1]


@functools.lru_cache(maxsize=64)
def _rope_call(original: Callable[..., Any], partial: bool) -> Callable[..., Any]:
    """apply_rotary_pos_emb through tiered_ops.rotary_embedding, ``original`` for a call the op does not take."""
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if not _takes(q, k, cos, sin, unsqueeze_dim, partial) or (
                tracing() and rotary_embedding.decomposes(q, k, cos, sin)):
            return original(q, k, cos, sin, unsqueeze_dim)
        return rotary_embedding(q, k, cos, sin)

    return apply_rotary_pos_emb


def _rebound(fwd: Callable[..., Any], name: str, value: Any) -> Callable[..., Any] | None:
    """A copy of forward ``fwd`` whose global ``name`` is ``value`` (its decorators' wrappers copied around it:
    ``rewrap``), or None where it has no source, a closure of its own, or a wrapper that does not hold what it wraps."""
    raw = inspect.unwrap(fwd)
    if not isinstance(raw, types.FunctionType) or raw.__code__.co_freevars:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(raw)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef):
        return None
    return rewrap(fwd, raw, compiled(fn, raw, name, value))


def compiled(fn: ast.FunctionDef, raw: types.FunctionType, name: str | None, value: Any) -> types.FunctionType:
    """``fn`` (a rewrite of function ``raw``'s source) compiled in ``raw``'s module, its decorators dropped, named as
    ``raw``; with ``name``, that name is ``value`` in it: a variable of its closure (the source compiled inside a
    function taking ``name``). Every other global is its module's own, not a copy: a trace guards those once for
    stock's code and this alike, where a copy of the module's globals is guarded apart (each global it reads, twice)."""
    fn = copy.deepcopy(fn)
    fn.decorator_list = []
    ast.increment_lineno(fn, raw.__code__.co_firstlineno - fn.lineno)  # the file's lines in tracebacks
    if name is None:
        tree = ast.Module(body=[fn], type_ignores=[])
    else:
        tree = ast.parse(f"def _tiered_ops_closure({name}):\n    return {fn.name}\n")
        tree.body[0].body.insert(0, fn)
    ns: dict[str, Any] = {}  # the definition lands here, not in the module's globals
    exec(compile(ast.fix_missing_locations(tree), inspect.getsourcefile(raw) or "<tiered_ops>", "exec"),  # noqa: S102
         raw.__globals__, ns)
    new = ns[fn.name] if name is None else ns["_tiered_ops_closure"](value)
    new.__qualname__, new.__module__ = raw.__qualname__, raw.__module__
    new.__dict__.update({k: v for k, v in raw.__dict__.items() if k != "__wrapped__"})
    return new


def rewrap(fwd: Any, raw: types.FunctionType, new: types.FunctionType) -> Callable[..., Any] | None:
    """``fwd`` (``raw`` under its decorators' wrappers, each holding what it wraps in its closure) with ``new`` in
    place of ``raw``; None where a wrapper does not hold what it wraps."""
    if fwd is raw:
        return new
    inner = getattr(fwd, "__wrapped__", None)
    if not isinstance(fwd, types.FunctionType) or inner is None:
        return None
    new_inner = rewrap(inner, raw, new)
    cells = fwd.__closure__ or ()
    if new_inner is None or not any(_holds(c, inner) for c in cells):
        return None
    out = types.FunctionType(fwd.__code__, fwd.__globals__, fwd.__name__, fwd.__defaults__,
                             tuple(types.CellType(new_inner) if _holds(c, inner) else c for c in cells))
    out.__kwdefaults__, out.__qualname__, out.__module__ = fwd.__kwdefaults__, fwd.__qualname__, fwd.__module__
    out.__dict__.update({k: v for k, v in fwd.__dict__.items() if k != "__wrapped__"})
    out.__wrapped__ = new_inner  # type: ignore[attr-defined]
    return out


def _holds(cell: Any, obj: Any) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _calls_with_four_arguments(fn: Callable[..., Any]) -> bool:
    """Whether the forward calls apply_rotary_pos_emb, each time with four positional arguments and no keyword."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return False
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == _NAME]
    return bool(calls) and all(len(c.args) == 4 and not c.keywords
                               and not any(isinstance(a, ast.Starred) for a in c.args) for c in calls)


@functools.lru_cache(maxsize=64)
def _routed(cls: type) -> tuple[Callable[..., Any], str] | str:
    """(the class's forward with apply_rotary_pos_emb through tiered_ops, its form) or why the class is left."""
    fwd = cls.__dict__.get("forward") or getattr(cls, "forward", None)
    raw = inspect.unwrap(fwd) if callable(fwd) else None
    if not isinstance(raw, types.FunctionType) or _NAME not in raw.__code__.co_names:
        return "its forward calls no apply_rotary_pos_emb"
    original = plain_function(raw.__globals__.get(_NAME))
    form = rope_form(original, raw.__globals__)
    if form is None:
        return "its apply_rotary_pos_emb is not transformers' rotate-half code this rewrite reproduces"
    if not _calls_with_four_arguments(fwd):
        return "its forward calls apply_rotary_pos_emb with other arguments than (q, k, cos, sin)"
    new = _rebound(fwd, _NAME, _rope_call(original, form == "partial"))
    if new is None:
        return "its forward is wrapped by a decorator this rewrite cannot see through"
    return new, form


@per_class
def _rope_attention_forward(base: type) -> Callable[..., Any]:
    """The swapped class's forward: its base's forward routed (``_routed``), itself (no call between: a trace reads
    nothing of the class per module)."""
    routed = _routed(base)
    if isinstance(routed, str):  # a class made again by pickle in a process whose transformers differs
        raise RuntimeError(f"tiered_ops.patch: {base.__qualname__} can no longer be routed: {routed}")
    return routed[0]


def rope_plan(m: nn.Module) -> tuple[Callable[..., Any], str] | str | None:
    """(forward, description) for an attention module this rewrite takes, the reason it cannot (a str), or None when
    ``m`` is no transformers module whose forward applies a rotary embedding."""
    cls = original_class(m)
    if not cls.__module__.startswith("transformers.") or "Attention" not in cls.__name__:
        return None
    fwd = getattr(cls, "forward", None)
    raw = inspect.unwrap(fwd) if callable(fwd) else None
    if not isinstance(raw, types.FunctionType) or _NAME not in raw.__code__.co_names:
        return None
    if cls is not type(m):
        return None  # swapped already: patch's own pass lists it as already patched
    if "forward" in m.__dict__:
        return "its forward is already replaced on the instance (by other code): left as it is"
    if why := hub_kernel_chosen(m):
        return why
    routed = _routed(cls)
    if isinstance(routed, str):
        return routed
    return _rope_attention_forward, f"apply_rotary_pos_emb -> tiered_ops.rotary_embedding ({routed[1]} rotary)"
