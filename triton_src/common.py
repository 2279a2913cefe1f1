"""Launch helpers shared by the Triton kernels (block sizes, warps, input checks) and their shared jit helpers."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> str | None:
    """Why the Triton tier cannot run on ``device``, or None."""
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreted():
        return None
    return "no CUDA device (set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU interpreter)"


def timeable(device: torch.device) -> str | None:
    if device.type == "cuda" and not interpreted():
        return None
    return "the Triton interpreter is for correctness, not speed"


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOATS:
        raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.device.type != "cuda" and not interpreted():
        raise ValueError(f"{op}: {name} must be a CUDA tensor (or TRITON_INTERPRET=1 on the CPU), got {t.device}")


# Longest row a forward program keeps in registers: 32 fp32 values per thread at 32 warps (1024 threads, so at
# most 64 registers each). The backward keeps two rows (x or y, and dy): it stays at 16384.
MAX_FUSED_FWD = 32768


def num_warps_for(block: int) -> int:
    """Warps per program for a block of `block` elements: about 8-16 elements per thread up to 16384, then
    32 warps (32 per thread at 32768)."""
    return max(1, min(16, block // 512)) if block <= 16384 else 32


def row_settings(n: int, max_fused: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for rows of n elements: short rows pack several rows in one program."""
    block = triton.next_power_of_2(max(n, 1))
    if block > max_fused:
        block = max_fused
    rows = max(1, min(16, 2048 // block))
    return block, rows, num_warps_for(block * rows)


CPU_SMS = 4  # the SM count taken on the Triton interpreter (CPU): grids of a few programs
_sms: dict[tuple, int] = {}


def sm_count(device: torch.device) -> int:
    """The device's multiprocessor count (read once per device); CPU_SMS off a GPU."""
    key = (device.type, device.index)
    if key not in _sms:
        _sms[key] = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
                     else CPU_SMS)
    return _sms[key]


def target_programs(device: torch.device) -> int:
    """Programs that fill the device a few times over (4 per SM); a handful on the CPU interpreter."""
    return 4 * sm_count(device) if device.type == "cuda" else 4


def check_same(op: str, name: str, t: torch.Tensor, like: torch.Tensor, like_name: str = "x") -> None:
    """``t`` has the dtype and device of ``like`` (an error naming both arguments otherwise)."""
    if t.dtype != like.dtype:
        raise TypeError(f"{op}: {name} must have the dtype of {like_name} ({like.dtype}), got {t.dtype}")
    if t.device != like.device:
        raise ValueError(f"{op}: {name} must be on {like.device} like {like_name}, got {t.device}")


def check_norm(op: str, x: torch.Tensor, normalized_shape: list[int], **params: torch.Tensor | None) -> int:
    """Validate a normalization's x, normalized_shape and affine parameters (weight=..., bias=...); the
    normalized size n."""
    check_float(op, "x", x)
    k = len(normalized_shape)
    if not 1 <= k <= x.dim() or list(x.shape[x.dim() - k:]) != list(normalized_shape):
        raise ValueError(f"{op}: normalized_shape {list(normalized_shape)} must match the trailing "
                         f"dims of x, got x of shape {list(x.shape)}")
    for name, t in params.items():
        if t is not None:
            check_same(op, name, t, x)
            if list(t.shape) != list(normalized_shape):
                raise ValueError(f"{op}: {name} must have shape {list(normalized_shape)}, got {list(t.shape)}")
    n = 1
    for d in normalized_shape:
        n *= d
    return n


@triton.jit
def _rows_tile(rows, cols, n_rows, n_cols):
    # A (rows, cols) tile of contiguous (n_rows, n_cols) rows: its element offsets (int64) and mask
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return offs, mask


@triton.jit
def _dy_x_rstd_tile(dy_ptr, x_ptr, rstd_ptr, rows, cols, r_end, n_cols):
    # dy and x (fp32) of the rows below r_end of a (rows, cols) tile, the rows' rstd; the tile's offsets and mask
    offs, mask = _rows_tile(rows, cols, r_end, n_cols)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rows < r_end, other=0.0)
    return offs, mask, dy, x, rstd


@triton.jit
def _dy_times_w(dy_row, w_ptr, idx, mask, w_offset, HAS_W: tl.constexpr, OFFSET: tl.constexpr):
    # dy[idx] in fp32, times w[idx] in fp32 (plus w_offset with OFFSET) where there is a weight
    g = tl.load(dy_row + idx, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if OFFSET:
            w = w + w_offset
        g = g * w
    return g


@triton.jit
def _online_lse_step(m, s, x):
    # One block of a row into per-lane running (max m, sum s of exp(x - m)); the new (m, s)
    m_new = tl.maximum(m, x)
    keep = m_new != -float("inf")  # lanes that saw only -inf add nothing (avoids -inf - -inf)
    shift = tl.where(keep, m_new, 0.0)  # the lanes not kept compute nothing invalid either
    s = tl.where(keep, s * tl.exp(m - shift) + tl.exp(x - shift), s)
    return m_new, s
