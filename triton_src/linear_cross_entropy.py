"""linear_cross_entropy, Triton tier: cross_entropy(hidden @ weight.T + bias, target) over chunks of tokens, never
holding the [N, V] logits.

Per chunk of ``chunk`` rows: the float32 logits [chunk, V] from one GEMM (``torch.mm``, float32 output from
bfloat16/float16 inputs with ``out_dtype`` on CUDA: accumulated and kept in float32), then cross_entropy's forward
kernel (``triton_src/cross_entropy.py``: online softmax, one pass per row) writes each row's float32 loss and lse;
the reduction over all N rows is cross_entropy's reduction kernel.
Gradients, two ways. A scalar loss ("mean", "sum") whose forward runs with a gradient wanted (``grads``): the forward
makes them from the logits it has, as Liger's fused linear cross-entropy does: cross_entropy's backward kernel turns
the chunk's logits into dlogits (in place in float32; into a chunk of hidden's dtype otherwise) for an output
gradient of 1 (over the count of non-ignored targets for "mean"), then dhidden[chunk] = dlogits @ weight and
dweight += dlogits.T @ hidden[chunk] (float32 accumulator), dbias += the column sums of dlogits: 3 GEMMs a chunk in
all. The backward only scales them by the output gradient. Otherwise ("none", or no gradient wanted: inference
computes and holds nothing more) the forward keeps the lse alone and the backward, per chunk, makes the logits again
(one GEMM), the dlogits from them and the saved lse (scaled by the output gradient), and the same two GEMMs: 4.

Bytes per chunk (forward): the GEMM writes 4 * chunk * V, the kernel reads them once; with the gradients (and in the
recomputing backward) 4 * chunk * V read again, 2 * chunk * V (bf16 dlogits) written and read twice by the GEMMs.
Peak extra memory: one chunk's float32 logits and dlogits (one buffer in float32: the dlogits overwrite the logits),
and the float32 [V, H] dweight accumulator for any dtype (with the gradients in the forward it lives from the forward
to the backward, with dhidden [N, H], as Liger's). Half inputs add one float32 [V, H] product a chunk (the logits
freed first), which float32 accumulates in place (addmm_). The forward's gradients hold less: a half chunk's dlogits
are written over its float32 logits (``_lce_dlogits``: the first half of each row's bytes, V % 8 == 0) and the
product is made in ``DW_PARTS`` slices of the vocabulary, so that the chunk's one buffer and a slice [V / 8, H] are
alive beside the accumulators: its peak stays below the recomputing backward's, which holds the logits and a
dlogits chunk beside them.
Limits: the vocabulary is not split (a chunk holds whole rows); on the CPU (interpreter) the GEMM runs on float32
copies (correctness only). Versions: v1 — token chunks, lse saved, the logits recomputed in the backward; v2 — the
gradients of a scalar loss made in the forward (one GEMM a chunk fewer; v1 stays for "none"); v3 — v2's dlogits
over the logits and its product in slices (its peak was the recomputing backward's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import num_warps_for
from .cross_entropy import GROUP, REDUCE_BLOCK, _block, _ce_bwd, _ce_fwd, _ce_reduce, _check_targets
from .launch import Step, register_ops

OP = "linear_cross_entropy_triton"


def _check(op: str, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
           reduction: str, label_smoothing: float, chunk: int, dtype: torch.dtype | None = None) -> None:
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] < 1:
        raise ValueError(f"{op}: hidden must be [N, H] and weight [V, H] with V >= 1, got {list(hidden.shape)} and "
                         f"{list(weight.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != hidden.dtype or t.device != hidden.device):
            raise TypeError(f"{op}: {name} must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), "
                            f"got {t.dtype} on {t.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias must have shape [V] = [{weight.shape[0]}], got {list(bias.shape)}")
    if target.dtype != torch.int64 or tuple(target.shape) != (hidden.shape[0],) or target.device != hidden.device:
        raise ValueError(f"{op}: target must be int64 [N] = [{hidden.shape[0]}] on {hidden.device}, got "
                         f"{target.dtype} {list(target.shape)} on {target.device}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if dtype not in (None, torch.float32, hidden.dtype):
        raise ValueError(f"{op}: dtype must be None, torch.float32 or hidden's dtype ({hidden.dtype}), got {dtype}")
    if chunk < 1:
        raise ValueError(f"{op}: chunk must be >= 1, got {chunk}")


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float32: accumulated and written in float32 (cuBLAS with a float32 output on CUDA)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())  # the CPU has no mixed-precision mm: the interpreter checks correctness


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's float32 logits [rows, V], contiguous: the GEMM's own buffer (the bias added in place)."""
    out = _mm32(h, weight.t())
    return out if bias is None else out.add_(bias.float())


def _fwd_step(v: int, smooth: bool, rows: int) -> Step:
    block = _block(v)
    return Step(_ce_fwd, (rows,), num_warps_for(block), BLOCK_V=block, GROUP=min(GROUP, block), SMOOTH=smooth)


def _bwd_step(v: int, rows: int) -> Step:
    block = _block(v)
    return Step(_ce_bwd, (rows,), num_warps_for(block), BLOCK_V=block)


@triton.jit
def _lce_dlogits(x_ptr, t_ptr, lse_ptr, g_ptr, dx_ptr, dx_stride, n_cols, ignore_index, smoothing,
                 BLOCK_V: tl.constexpr):
    # cross_entropy's backward of one row of float32 logits (x, rows of n_cols) for the output gradient g[0], into dx
    # rows of dx_stride elements. dx may lie over x: half-width dlogits written over the first half of the row's own
    # float32 bytes, each block stored after a barrier that follows every load of the block (a store reaches back to
    # elements of this block or of earlier ones, all read by then; never forward to a block not yet read).
    smoothing = tl.cast(smoothing, tl.float32)  # Inductor passes float arguments as fp64
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    x_row = x_ptr + row * n_cols
    dx_row = dx_ptr + row * dx_stride
    if t == ignore_index:
        # torch's gradient of an ignored row is 0 * softmax: 0, or NaN across the row where its lse is not finite
        m = tl.full([BLOCK_V], -float("inf"), tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=-float("inf"))
            m = tl.maximum(m, tl.where(x != x, float("inf"), x))
        z = tl.zeros([BLOCK_V], tl.float32) + tl.max(m, axis=0) * 0.0  # NaN for +-inf
        tl.debug_barrier()
        for start in range(0, n_cols, BLOCK_V):
            tl.store(dx_row + start + cols, z.to(dx_ptr.dtype.element_ty), mask=start + cols < n_cols)
    else:
        g = tl.load(g_ptr)
        lse = tl.load(lse_ptr + row)
        ok = (t >= 0) & (t < n_cols)
        off = smoothing / n_cols
        for start in range(0, n_cols, BLOCK_V):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0)
            d = tl.exp(x - lse) - off - tl.where(start + cols == t, 1.0 - smoothing, 0.0)
            d = tl.where(ok, d * g, float("nan"))
            tl.debug_barrier()
            tl.store(dx_row + start + cols, d.to(dx_ptr.dtype.element_ty), mask=mask)


DW_PARTS = 8  # the forward's dweight product of half inputs, made in this many slices of the vocabulary


def _dlogits_over(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the forward's dlogits of a chunk go: over the chunk's float32 logits (in place in float32; in a half
    dtype over the first half of each row's bytes, a view of row stride 2 V), so that the chunk holds one buffer,
    not the logits and a dlogits chunk beside them. A separate chunk where V % 8 != 0 (a row of the view would not
    start 16-byte aligned for the GEMMs) and inside a torch.compile trace (its functionalization would copy)."""
    if dtype == torch.float32:
        return logits
    rows, v = logits.shape
    if v % 8 or torch.compiler.is_compiling():
        return logits.new_empty((rows, v), dtype=dtype)
    return logits.view(dtype)[:, :v]


def _scale(grad: torch.Tensor, target: torch.Tensor, reduction: str, ignore_index: int) -> torch.Tensor:
    """The dlogits' scale of the output gradient ``grad``, float32: for "mean" over the count of targets not ignored
    ([1], one launch: the count stays on the device), else ``grad`` itself ([1] for "sum", [N] for "none")."""
    if reduction != "mean":
        return grad.float().reshape(-1).contiguous()
    scale = torch.empty((1,), dtype=torch.float32, device=target.device)
    Step(_ce_reduce, (1,), 4, BLOCK=REDUCE_BLOCK, MEAN=True, SUM_ROWS=False)(False, grad, target, scale,
                                                                             target.shape[0], ignore_index)
    return scale


def linear_cross_entropy_launch(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                bias: torch.Tensor | None, ignore_index: int, reduction: str, label_smoothing: float,
                                dtype: torch.dtype | None, chunk: int, grads: bool
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss in ``dtype``, else hidden's: [] or [N] for "none"; lse float32 [N]; dhidden, dweight, dbias), chunk by
    chunk. ``grads`` (a scalar loss only): the gradients of an output gradient of 1 made here, chunk by chunk from the
    logits at hand (dhidden [N, H] in hidden's dtype, dweight float32 [V, H], dbias float32 [V] or [0]); else the
    three are empty ([0]) and the backward recomputes the logits."""
    _check(OP, hidden, weight, target, bias, reduction, label_smoothing, chunk, dtype)
    if grads and reduction == "none":
        raise ValueError(f"{OP}: grads needs a scalar loss (reduction 'mean' or 'sum'), got reduction 'none'")
    n, v = hidden.shape[0], int(weight.shape[0])
    _check_targets(target, v, ignore_index)
    tc = target.contiguous()
    losses, lses = [], []
    dh, dw, db = (hidden.new_empty((0,)) for _ in range(3))  # three outputs: three tensors
    if grads:
        dh = hidden.new_empty(hidden.shape)
        dw = weight.new_zeros(weight.shape, dtype=torch.float32)
        db = weight.new_zeros((v,) if bias is not None else (0,), dtype=torch.float32)
        scale = _scale(torch.ones((1,), dtype=torch.float32, device=tc.device), tc, reduction, ignore_index)
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        h, t = hidden[start:start + rows], tc[start:start + rows]
        logits = _logits(h, weight, bias)
        loss, lse = logits.new_empty((rows,)), logits.new_empty((rows,))
        _fwd_step(v, label_smoothing > 0, rows)(False, logits, t, loss, lse, v, v, ignore_index, label_smoothing)
        losses.append(loss)
        lses.append(lse)
        if not grads:
            del logits  # freed here: the name would hold it while the next chunk's GEMM allocates
            continue
        # the logits become dlogits over themselves (``_dlogits_over``), the GEMMs' input; dweight's product of
        # half inputs in slices of the vocabulary: the chunk's buffer and one slice alive, never a [V, H] product
        dlogits = _dlogits_over(logits, hidden.dtype)
        block = _block(v)
        Step(_lce_dlogits, (rows,), num_warps_for(block), BLOCK_V=block)(
            False, logits, t, lse, scale, dlogits, dlogits.stride(0), v, ignore_index, label_smoothing)
        del logits
        _chunk_grads(dlogits, h, weight, dh[start:start + rows], dw, db if bias is not None else None, DW_PARTS)
        del dlogits
    loss = torch.cat(losses) if losses else hidden.new_empty((0,), dtype=torch.float32)
    lse = torch.cat(lses) if lses else hidden.new_empty((0,), dtype=torch.float32)
    if reduction == "none":
        return loss.to(dtype or hidden.dtype), lse, dh, dw, db
    out = hidden.new_empty((), dtype=dtype or hidden.dtype)
    Step(_ce_reduce, (1,), 4, BLOCK=REDUCE_BLOCK, MEAN=reduction == "mean", SUM_ROWS=True)(
        False, loss, tc, out, n, ignore_index)
    return out, lse, dh, dw, db


def _chunk_grads(dlogits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, dh_rows: torch.Tensor,
                 dw: torch.Tensor, db: torch.Tensor | None, parts: int = 1) -> None:
    """One chunk's share of the gradients from its dlogits: dhidden's rows written, dweight's (and dbias's) float32
    accumulators added to; a half dweight product in ``parts`` slices of the vocabulary (each [V / parts, H])."""
    torch.mm(dlogits, weight, out=dh_rows)
    if dlogits.dtype == torch.float32:
        dw.addmm_(dlogits.t(), h)  # into the accumulator: no [V, H] product
    else:
        v = dlogits.shape[1]
        step = -(-v // (8 * parts)) * 8  # slices start 16-byte aligned (half elements) for the GEMMs
        for a in range(0, v, step):  # a float32 product of half inputs, then added
            dw[a:a + step].add_(_mm32(dlogits[:, a:a + step].t(), h))
    if db is not None:
        db.add_(dlogits.sum(0, dtype=torch.float32))


def linear_cross_entropy_bwd_launch(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                    target: torch.Tensor, bias: torch.Tensor | None, lse: torch.Tensor,
                                    ignore_index: int, reduction: str, label_smoothing: float, chunk: int
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dhidden [N, H], dweight [V, H], dbias [V] or [0] without a bias), in hidden's dtype, chunk by chunk."""
    op = "linear_cross_entropy_bwd_triton"
    _check(op, hidden, weight, target, bias, reduction, label_smoothing, chunk)
    n, v = hidden.shape[0], int(weight.shape[0])
    want = (n,) if reduction == "none" else ()
    if tuple(grad.shape) != want:
        raise ValueError(f"{op}: grad must have shape {list(want)} for reduction {reduction!r}, got {list(grad.shape)}")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (n,):
        raise ValueError(f"{op}: lse must be a float32 [N] = [{n}] tensor, got {lse.dtype} {list(lse.shape)}")
    tc, lc = target.contiguous(), lse.contiguous()
    scale = _scale(grad, tc, reduction, ignore_index)
    per_row = 1 if reduction == "none" else 0
    dw = weight.new_zeros(weight.shape, dtype=torch.float32)
    db = weight.new_zeros((v,) if bias is not None else (0,), dtype=torch.float32)
    dh = hidden.new_empty(hidden.shape)
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        h = hidden[start:start + rows]
        logits = _logits(h, weight, bias)
        dlogits = logits if hidden.dtype == torch.float32 else hidden.new_empty((rows, v))
        g = scale[start:start + rows] if per_row else scale
        _bwd_step(v, rows)(False, logits, tc[start:start + rows].contiguous(), lc[start:start + rows].contiguous(),
                           g.contiguous(), per_row, dlogits, v, v, ignore_index, label_smoothing)
        del logits
        _chunk_grads(dlogits, h, weight, dh[start:start + rows], dw, db if bias is not None else None)
        del dlogits
    return dh, dw.to(weight.dtype), db.to(weight.dtype)


linear_cross_entropy_triton, linear_cross_entropy_bwd_triton = register_ops(
    "linear_cross_entropy", linear_cross_entropy_launch, linear_cross_entropy_bwd_launch)
