"""rms_norm(x, normalized_shape, weight=None, eps=None): torch.nn.functional.rms_norm semantics.

y = x * rsqrt(mean(x^2 over the trailing normalized_shape dims) + eps) * weight, in x's dtype;
eps=None means torch's default: the eps of the compute dtype (torch.finfo(torch.float32).eps for float32, bfloat16
and float16 x, float64's for float64). weight has shape normalized_shape and any floating dtype: another dtype than
x's is promoted as torch does (the math in the wider dtype, y in x's dtype).
Bucket: (rows rounded up to a power of two, the normalized size n, whether there is a weight).
Bytes: read x + write y (+ weight once). Backward: read x and dy, write dx (+ weight, + dw once).
Autograd of the kernel ops: save x and weight; the backward kernel recomputes rsqrt(mean(x^2) + eps).

Hugging Face's norm forms (keyword-only, named by what they change in the math, so that one flag serves every model
class written that way): ``weight_offset=o`` multiplies by (o + weight) formed in fp32 (Gemma: o = 1,
``(x.float() * rsqrt(mean(x^2) + eps) * (1.0 + weight.float())).type_as(x)``); ``cast_before_weight=True`` rounds
the normalized x to x's dtype before the weight multiplies it (Llama, Mistral, Qwen2/3:
``weight * hidden_states.to(input_dtype)``), and the output has ``promote(weight.dtype, x.dtype)``, so a float32
weight over bf16 activations gives a float32 output, as there. In both forms the weight may be float32 while x is
bf16/fp16; the two flags together (no Hugging Face norm has that form) are an error. The gradients are those of the
math: through the cast, as autograd passes a gradient through ``.to()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..registry import BadInput, Inputs, OpSpec, Problem, make_problem, pow2_ceil, register_op
from ._common import call, check_eps, check_norm, gen, norm_param, norm_shape, norm_split, randn, values

# ---- The Hugging Face norm forms' contract (this op's and fused_add_rms_norm's), declared once -----------------------
# The flags, the weight dtype a form takes besides x's, the checks in the order they apply with their errors, y's dtype.
# The Triton tier (triton_src/rms_norm.py) calls form_error, form_exception and out_dtype; the CUDA tier keeps its
# TORCH_CHECKs for direct callers (cuda_src/binding.h: hf_norm_weight, hf_out_dtype), and tests/test_hf_norm.py reads
# them and evaluates them against this declaration.
FORM_FLAGS = ("weight_offset", "cast_before_weight")
FORM_WEIGHT_DTYPE = torch.float32  # a form's weight over a bfloat16/float16 x: float32 or x's dtype
# name -> (error, message after "<op>: "; {x} and {w} are x's and the weight's dtypes)
FORM_CHECKS: dict[str, tuple[type[Exception], str]] = {
    "exclusive": (ValueError, "weight_offset and cast_before_weight together: no such norm form"),
    "offset_needs_weight": (ValueError, "weight_offset needs a weight (it multiplies by offset + weight)"),
    "weight_dtype": (TypeError, "weight must have the dtype of x ({x}) or float32, got {w}"),
}


def form_error(weight_offset: float, cast_before_weight: bool, has_weight: bool,
               weight_dtype: torch.dtype | None = None, x_dtype: torch.dtype | None = None) -> str | None:
    """The first of FORM_CHECKS a call breaks (its name), or None. The weight's dtype is checked where both dtypes
    are given; a float64 x (the float64 reference) takes any weight: the cast is exact there."""
    if weight_offset and cast_before_weight:
        return "exclusive"
    if weight_offset and not has_weight:
        return "offset_needs_weight"
    if (weight_offset or cast_before_weight) and weight_dtype is not None and x_dtype is not None \
            and weight_dtype not in (x_dtype, FORM_WEIGHT_DTYPE) and x_dtype != torch.float64:
        return "weight_dtype"
    return None


def form_exception(name: str, op: str, x_dtype: torch.dtype | None = None,
                   weight_dtype: torch.dtype | None = None) -> Exception:
    """The error of the check ``name`` of FORM_CHECKS, for ``op``."""
    error, text = FORM_CHECKS[name]
    return error(f"{op}: " + text.format(x=x_dtype, w=weight_dtype))


def out_dtype(x: torch.Tensor, weight: torch.Tensor | None, cast_before_weight: bool) -> torch.dtype:
    """The output's dtype: x's, or promote(weight, x) where the weight multiplies after the cast."""
    return torch.promote_types(weight.dtype, x.dtype) if cast_before_weight and weight is not None else x.dtype


def check_form(x: torch.Tensor, weight: torch.Tensor | None, weight_offset: float, cast_before_weight: bool,
               op: str = "rms_norm") -> None:
    """The Hugging Face form's arguments (FORM_CHECKS): a weight for an offset, not both flags, a weight of x's dtype
    or float32."""
    w_dtype = None if weight is None else weight.dtype
    bad = form_error(weight_offset, cast_before_weight, weight is not None, w_dtype, x.dtype)
    if bad is not None:
        raise form_exception(bad, op, x.dtype, w_dtype)


def hf_norm(x: torch.Tensor, dims: tuple[int, ...], weight: torch.Tensor | None, eps: float, weight_offset: float,
            cast_before_weight: bool) -> torch.Tensor:
    """The Hugging Face forms in torch ops, in their order: fp32 math for bf16/fp16 (float64 stays float64, where
    the cast is exact and the form is the math)."""
    xf = x if x.dtype == torch.float64 else x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
    if cast_before_weight:
        h = h.to(x.dtype)
        return h if weight is None else weight * h
    w = weight if x.dtype == torch.float64 else weight.float()
    return (h * (weight_offset + w)).to(x.dtype)


def reference(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
              eps: float | None = None, *, weight_offset: float = 0.0, cast_before_weight: bool = False
              ) -> torch.Tensor:
    """Eager tier and reference: torch's own rms_norm (computes in fp32 for low precision); the Hugging Face forms
    as their modules compute them."""
    if not weight_offset and not cast_before_weight:
        return F.rms_norm(x, norm_shape(normalized_shape), weight, eps)
    check_form(x, weight, weight_offset, cast_before_weight)
    ns = norm_shape(normalized_shape)
    return hf_norm(x, tuple(range(x.dim() - len(ns), x.dim())), weight, _eps(x, eps), weight_offset,
                   cast_before_weight)


def validate(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None, *, weight_offset: float = 0.0, cast_before_weight: bool = False) -> None:
    """The contract of a call (every tier): x floating, normalized_shape x's trailing dims, weight of that shape on
    x's device (any floating dtype: torch promotes; x's or float32 in a Hugging Face form), eps a float or None."""
    ns = check_norm("rms_norm", x, normalized_shape)
    norm_param("rms_norm", "weight", weight, x, ns)
    check_eps("rms_norm", eps, optional=True)
    if weight_offset or cast_before_weight:
        check_form(x, weight, weight_offset, cast_before_weight)


def takes_mixed(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                eps: float | None = None, *, weight_offset: float = 0.0, cast_before_weight: bool = False) -> bool:
    """Whether every tier takes this call's mix of dtypes as it is: a Hugging Face form's float32 weight over a
    bfloat16/float16 x is part of the form (the kernels read it as float32), not a promotion."""
    return bool(weight_offset or cast_before_weight)


def form_params(weight_offset: float, cast_before_weight: bool) -> dict[str, Any]:
    """A problem's Hugging Face form parameters: only those set, so a plain problem (and its bucket) stays as it was."""
    return {k: v for k, v in (("weight_offset", float(weight_offset)), ("cast_before_weight", bool(cast_before_weight)))
            if v}


def form_problem(op: str, shape: tuple[int, ...], normalized_shape: int | Sequence[int] | None, weight: bool,
                 weight_offset: float, cast_before_weight: bool) -> Problem:
    """The problem of an RMS norm in a Hugging Face form (this op's, and ``fused_add_rms_norm``'s): normalized_shape
    (default the last dim) x's trailing dims, weight_offset only with a weight and without cast_before_weight."""
    ns = norm_shape(shape[-1:] if normalized_shape is None else normalized_shape, op)
    if not 1 <= len(ns) <= len(shape) or tuple(shape[len(shape) - len(ns):]) != ns:
        raise ValueError(f"{op}: normalized_shape {list(ns)} must match the trailing dims of x, "
                         f"got x of shape {list(shape)}")
    bad = form_error(weight_offset, cast_before_weight, bool(weight))
    if bad is not None:
        raise form_exception(bad, op)
    return make_problem(shape, normalized_shape=ns, weight=bool(weight),
                        **form_params(weight_offset, cast_before_weight))


def _problem(shape: tuple[int, ...], normalized_shape: int | Sequence[int] | None = None, weight: bool = True,
             weight_offset: float = 0.0, cast_before_weight: bool = False) -> Problem:
    return form_problem("rms_norm", shape, normalized_shape, weight, weight_offset, cast_before_weight)


def _problem_of(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                eps: float | None = None, *, weight_offset: float = 0.0, cast_before_weight: bool = False) -> Problem:
    return _problem(tuple(x.shape), normalized_shape, weight is not None, weight_offset, cast_before_weight)


def _bucket(p: Problem) -> tuple:
    rows, n = norm_split(p)
    kw = p.kw
    form = tuple((k, kw[k]) for k in ("weight_offset", "cast_before_weight") if k in kw)  # a plain bucket: none
    return (pow2_ceil(rows), n, kw["weight"], *form)


def _inputs(p: Problem, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = gen(device, seed)
    ns = p.kw["normalized_shape"]
    x = randn(p.shape, dtype, device, g)
    w = (1 + 0.5 * randn(ns, torch.float32, device, g)).to(dtype) if p.kw["weight"] else None
    form = form_params(p.kw.get("weight_offset", 0.0), p.kw.get("cast_before_weight", False))
    return Inputs((x, ns, w, torch.finfo(dtype).eps), form)  # eps of x's dtype, also for the float64 reference


def _bytes(p: Problem, dt: torch.dtype) -> int:
    rows, n = norm_split(p)
    return (2 * rows * n + (n if p.kw["weight"] else 0)) * dt.itemsize


def _bwd_bytes(p: Problem, dt: torch.dtype) -> int:
    rows, n = norm_split(p)
    return (3 * rows * n + (2 * n if p.kw["weight"] else 0)) * dt.itemsize


def default_eps(x: torch.Tensor) -> float:
    """torch's eps for eps=None: that of the compute dtype (float32 for float32, bfloat16 and float16 x)."""
    return torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps


def _eps(x: torch.Tensor, eps: float | None) -> float:
    return default_eps(x) if eps is None else float(eps)


def _kernel_args(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
                 eps: float | None = None, *, weight_offset: float = 0.0, cast_before_weight: bool = False) -> tuple:
    """F.rms_norm's signature onto the kernel ops' schema (x, int[] normalized_shape, weight?, float eps,
    float weight_offset, bool cast_before_weight)."""
    if weight_offset or cast_before_weight:
        check_form(x, weight, weight_offset, cast_before_weight)
    return x, list(norm_shape(normalized_shape)), weight, _eps(x, eps), float(weight_offset), bool(cast_before_weight)


def _fake(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float,
          weight_offset: float = 0.0, cast_before_weight: bool = False) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format, dtype=out_dtype(x, weight, cast_before_weight))


def _bwd_fake(dy: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
              eps: float, weight_offset: float = 0.0, cast_before_weight: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if weight is not None else x.new_empty((0,))
    return torch.empty_like(x, memory_format=torch.contiguous_format), dw


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, ctx.normalized_shape, weight, ctx.eps, *form = inputs
    ctx.form = tuple(form)  # (weight_offset, cast_before_weight)
    ctx.save_for_backward(x, weight)


def _backward_for(bwd: Callable[..., tuple]) -> Callable[..., tuple]:
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        dx, dw = bwd(grad, x, ctx.normalized_shape, weight, ctx.eps, *ctx.form)
        return dx, None, (dw if weight is not None else None), None, *(None,) * len(ctx.form)

    return backward


BAD_INPUTS = (
    BadInput("weight not floating", call(values(4, 8), (8,), values(8, dtype=torch.int32)), TypeError,
             r"rms_norm: weight must be a floating tensor"),
    # the per-call path's key holds an optional tensor's shape: a weight of another shape is validated again
    BadInput("weight of another shape", call(values(3, 8), (8,), values(4)), ValueError,
             r"rms_norm: weight must have shape normalized_shape \[8\], got \[4\]",
             good=call(values(3, 8), (8,), values(8))),
    BadInput("weight of 7", call(values(4, 8), (8,), values(7)), ValueError, r"rms_norm: weight must have shape"),
    BadInput("normalized_shape not x's", call(values(4, 8), (7,), None), ValueError, r"rms_norm: normalized_shape"),
    BadInput("normalized_shape too long", call(values(3, 4), (5,)), ValueError, r"rms_norm: normalized_shape"),
)

SPEC = register_op(OpSpec(
    name="rms_norm", reference=reference, make_inputs=_inputs, problem=_problem, problem_of=_problem_of,
    bucket=_bucket, bytes_moved=_bytes,
    bwd_bytes=_bwd_bytes, grad_args=(0, 2), autograd=(_setup, _backward_for),
    bwd_fake=_bwd_fake,
    edge_problems=lambda: [
        _problem((1, 4096)),  # 1 row
        _problem((4096, 1)),  # 1 column
        _problem((1823, 781)),  # no multiple of any block
        _problem((2, 20003)),  # a row longer than one block: the backward's looped kernels
        _problem((2, 40009)),  # longer than the forward's register-resident rows: looped kernels
        _problem((4, 6, 33), normalized_shape=(6, 33)),  # normalized over two trailing dims
        _problem((5, 64), weight=False),  # no weight
        _problem((0, 16)),  # empty
        _problem((1823, 781), weight_offset=1.0),  # Gemma's form: (1 + w), then one rounding
        _problem((1823, 781), cast_before_weight=True),  # Llama's form: rounded to x's dtype, then the weight
        _problem((2, 40009), cast_before_weight=True),  # Llama's form, looped kernels
        _problem((5, 64), weight=False, cast_before_weight=True),  # the cast alone
    ],
    default_problems=lambda dev: [_problem(s) for s in (
        [(16384, 4096), (4096, 32768), (65536, 256), (32, 4096), (1, 4096), (12, 250000)] if dev == "cuda"
        else [(256, 1024), (8, 65536)])],
    source=Path(__file__), fake=_fake, eager=reference, kernel_args=_kernel_args, validate=validate,
    takes_mixed=takes_mixed, bad_inputs=BAD_INPUTS,
))

