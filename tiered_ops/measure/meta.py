"""What an implementation costs beyond its run time, measured: graph breaks and maintenance cost.

Per implementation (op, impl, device, source hash), collected once and stored next to its timings:
- graph breaks: ``torch._dynamo.explain`` of the op called between two pointwise ops, through the
  implementation as tiered_ops calls it, and for contrast through the same kernel without torch.library
  (raw Triton launcher, pybind11 function) where that exists;
- lines of code of its own kernel + launcher + binding (non-blank, non-comment, docstrings excluded);
- build / first-call seconds: per-object ninja seconds of the CUDA extension, recompiles of the compile
  tier across shapes of one bucket (``dynamic=False`` as used, and ``dynamic=True`` for contrast);
- registers, spills, shared memory: ``ptxas -v`` for CUDA kernels, the compiled kernels' metadata for Triton;
- portability: where each tier can run, and the architecture the CUDA build targets.
Collecting them takes seconds to minutes per implementation; ``with_progress`` says how far a sweep has got.
First-call seconds per shape and dtype are in the measurement rows; "last verified" is derived from them.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import logging
import re
import shutil
import subprocess
import sys
import time
import tokenize
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ..registry import Impl, OpSpec, Tier
from ..tiers import cuda_ext
from .fingerprint import fingerprint

log = logging.getLogger(__name__)

PORTABILITY: dict[Tier, str] = {
    Tier.EAGER: "any torch device (CPU, CUDA, ROCm, MPS, XPU)",
    Tier.COMPILE: "what inductor supports: CPU (C++/OpenMP), NVIDIA and AMD GPUs, Intel XPU",
    Tier.TRITON: "NVIDIA and AMD GPUs (and the CPU interpreter, for correctness only)",
    Tier.CUDA: "NVIDIA GPUs only; rebuilt per architecture",
    Tier.PEER: "the peer library's own (a peer is measured for comparison, never selected)",
}


# ---------------------------------------------------------------------------------------------- lines of code
def _python_code_lines(text: str) -> set[int]:
    """Line numbers holding Python code: not blank, not only a comment, not part of a docstring."""
    doc: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - doc


def _cpp_code_lines(text: str) -> set[int]:
    """Line numbers holding C/C++/CUDA code once // and /* */ comments are removed (strings kept as they are)."""
    stripped = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    stripped = re.sub(r"//[^\n]*", "", stripped)
    return {i for i, line in enumerate(stripped.splitlines(), 1) if line.strip()}


def _function_span(path: Path, text: str, name: str) -> tuple[int, int]:
    """First and last line of the definition of function ``name`` in a Python or C++ file."""
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                return first, node.end_lineno or node.lineno
        raise ValueError(f"{path.name}: no function {name!r}")
    lines = text.splitlines()
    for i, line in enumerate(lines):  # a definition starts at column 0 and names the function before '('
        if line and not line[0].isspace() and re.search(rf"\b{re.escape(name)}\s*\(", line) and ";" not in line:
            depth, seen = 0, False
            for j in range(i, len(lines)):
                depth += lines[j].count("{") - lines[j].count("}")
                seen = seen or "{" in lines[j]
                if seen and depth == 0:
                    return i + 1, j + 1
    raise ValueError(f"{path.name}: no function {name!r}")


def count_loc(path: Path, function: str | None = None) -> int:
    """Non-blank, non-comment lines of a source file, or of one function in it (docstrings excluded)."""
    text = Path(path).read_text()
    code = _python_code_lines(text) if Path(path).suffix == ".py" else _cpp_code_lines(text)
    if function is None:
        return len(code)
    first, last = _function_span(Path(path), text, function)
    return sum(1 for i in code if first <= i <= last)


def impl_loc(impl: Impl) -> int:
    """Lines of code that are this implementation's own: whole own files plus its functions in shared ones."""
    return sum(count_loc(p) for p in impl.own_code) + sum(count_loc(p, f) for p, f in impl.own_functions)


# ------------------------------------------------------------------------------------ registers and spills
_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def parse_ptxas(text: str) -> list[dict[str, Any]]:
    """One dict per kernel from ``ptxas -v`` output: kernel, arch, registers, spills, stack and shared memory."""
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            out.append(dict(kernel=m.group(1), arch=m.group(2), registers=None, spill_bytes=None, stack_bytes=None,
                            smem_bytes=0))
            continue
        if not out:
            continue
        m = _PTXAS_FRAME.search(line)
        if m:
            out[-1].update(stack_bytes=int(m.group(1)), spill_bytes=int(m.group(2)) + int(m.group(3)))
        m = _PTXAS_REGS.search(line)
        if m:
            out[-1].update(registers=int(m.group(1)), smem_bytes=int(m.group(2) or 0))
    return out


def nvcc_path() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)


@functools.lru_cache(maxsize=None)
def _ptxas_cached(path: str, digest: str, arch: str) -> tuple[dict[str, Any], ...]:
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    r = subprocess.run([nvcc, "-c", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                        "-Xptxas", "-v", path, "-o", "/dev/null"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed: {r.stderr.strip()[-300:]}")
    return tuple(parse_ptxas(r.stderr))


def ptxas_report(cu: Path, arch: str = "90") -> list[dict[str, Any]]:
    """Registers and spills of every kernel in a kernel-only ``.cu`` file (plain nvcc, no torch, no GPU)."""
    return list(_ptxas_cached(str(cu), hashlib.sha256(Path(cu).read_bytes()).hexdigest(), arch))


def triton_kernel_report(op: str) -> list[dict[str, Any]]:
    """Registers, spills and shared memory of every compiled specialization of the op's Triton kernels."""
    import importlib

    from triton.runtime.jit import JITFunction

    mod = importlib.import_module(f"triton_src.{op}")
    out = []
    for name, fn in vars(mod).items():
        if not isinstance(fn, JITFunction):
            continue
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else {}
            for ck in kernels.values():
                ck._init_handles()
                out.append(dict(kernel=name, registers=ck.n_regs, spill_bytes=ck.n_spills,
                                smem_bytes=getattr(ck.metadata, "shared", None),
                                num_warps=getattr(ck.metadata, "num_warps", None)))
    return out


def _summary(kernels: list[dict[str, Any]]) -> dict[str, Any]:
    regs = [k["registers"] for k in kernels if k.get("registers") is not None]
    return dict(kernels=len(kernels), max_registers=max(regs) if regs else None,
                spill_bytes=sum(k.get("spill_bytes") or 0 for k in kernels),
                max_smem_bytes=max((k.get("smem_bytes") or 0 for k in kernels), default=None))


# ----------------------------------------------------------------------------------------------- graph breaks
def _between_pointwise(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` between two pointwise ops: sin of its first argument, each of its outputs doubled."""
    def model(first: torch.Tensor, *rest: Any) -> Any:
        out = fn(first.sin(), *rest)
        return tuple(o * 2 for o in out) if isinstance(out, tuple) else out * 2

    return model


def explain(fn: Callable[..., torch.Tensor], args: tuple) -> dict[str, Any]:
    """Graphs, graph breaks and break reasons of ``fn`` called between two pointwise ops, under dynamo."""
    try:
        e = torch._dynamo.explain(_between_pointwise(fn))(*args)
    except Exception as ex:  # recorded: the tier cannot be traced here (e.g. Triton on the CPU)
        lines = [ln for ln in str(ex).splitlines() if ln.strip()]
        first = lines[0][:200] if lines else ""
        return dict(graphs=None, breaks=None, reasons=[], error=f"{type(ex).__name__}: {first}")
    reasons = sorted({str(b.reason).splitlines()[0][:160] for b in e.break_reasons})
    return dict(graphs=e.graph_count, breaks=e.graph_break_count, reasons=reasons, error=None)


def graph_breaks(spec: OpSpec, impl: Impl, device: torch.device) -> dict[str, Any]:
    """explain() through the implementation as selected, and through its unregistered contrast if any."""
    why = impl.why_not(device)  # also loads what the implementation needs (extension, Triton module)
    if why is not None:
        return {"error": f"unavailable: {why}"}
    problem = spec.edge_problems()[0]  # small: explain runs the op once for real
    inp = spec.make_inputs(problem, torch.float32, device, 0)
    out = {"registered": explain(impl.fn, inp.args), "problem": str(problem)}
    contrast = impl.unregistered() if impl.unregistered is not None else None
    out["unregistered"] = explain(contrast, inp.args) if contrast is not None else None
    return out


def recompiles_in_bucket(spec: OpSpec, eager: Callable[..., torch.Tensor], device: torch.device) -> dict[str, Any]:
    """Graphs dynamo compiles for 3 shapes of one bucket (leading dim varied): static vs dynamic shapes."""
    defaults = spec.default_problems(device.type)
    base = defaults[-2] if len(defaults) > 1 else defaults[0]
    shapes = []
    for r in (base.shape[0], base.shape[0] - 1, base.shape[0] // 2 + 1):
        p = spec.problem((r, *base.shape[1:]), **base.kw)
        if r >= 1 and spec.bucket(p) == spec.bucket(base) and p not in shapes:
            shapes.append(p)
    out: dict[str, Any] = {"shapes": [str(p) for p in shapes]}
    for label, dynamic in (("static", False), ("dynamic", True)):
        count = [0]

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            count[0] += 1
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(eager, backend=backend, dynamic=dynamic)
        for p in shapes:
            inp = spec.make_inputs(p, torch.float32, device, 0)
            compiled(*inp.args, **inp.kwargs)
        out[label] = count[0] - 1  # recompiles after the first graph
    torch._dynamo.reset()
    return out


# ---------------------------------------------------------------------------------------------------- collect
def collect(spec: OpSpec, impl: Impl, device: torch.device) -> dict[str, Any]:
    """Every cost figure of one implementation on this device; a figure that cannot be had says why."""
    meta: dict[str, Any] = dict(tier=impl.tier.label, portability=PORTABILITY[impl.tier], loc=impl_loc(impl))
    why = impl.why_not(device)
    meta["graph_breaks"] = graph_breaks(spec, impl, device)
    if impl.tier == Tier.COMPILE:
        meta["recompiles"] = recompiles_in_bucket(spec, spec.impls["eager"].fn, device)
    if impl.tier == Tier.CUDA:
        info = cuda_ext.build_info()
        arch = (info.get("arch") or "sm_90").removeprefix("sm_")
        meta["archs"] = f"sm_{arch}" + ("" if info else " (checked with nvcc only: no extension built here)")
        cu = cuda_ext.CUDA_SRC / f"{spec.name}.cu"
        if info:
            objs = info["objects"]
            meta["build_s_own"] = next((s for t, s in objs.items() if t.startswith(f"{spec.name}.cuda")), None)
            meta["build_s_extension"] = info["build_s"]
        try:
            meta["kernels"] = ptxas_report(cu, arch)
            meta.update(_summary(meta["kernels"]))
        except Exception as e:
            meta["kernels_error"] = str(e)[:300]
    if impl.tier == Tier.TRITON:
        if device.type == "cuda" and why is None:
            try:
                meta["kernels"] = triton_kernel_report(spec.name)
                meta.update(_summary(meta["kernels"]))
            except Exception as e:
                meta["kernels_error"] = f"{type(e).__name__}: {e}"[:300]
        else:
            meta["kernels_error"] = "no compiled kernels here (interpreter or no GPU)"
    return meta


def stored_or_collect(store: Any, spec: OpSpec, impl: Impl, device: torch.device, device_key: str | None = None,
                      collector: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The implementation's metadata for this device and source, collected and stored on first use.
    ``device_key``: the device's fingerprint key when already known; ``collector``: how to collect it when it
    is missing (default: ``collect`` in this process; the sweep passes one that asks a worker process)."""
    key = device_key or fingerprint(device).key
    meta = store.get_meta(spec.name, impl.name, key, impl.source_hash)
    if meta is None:
        meta = collector() if collector is not None else collect(spec, impl, device)
        store.put_meta(spec.name, impl.name, key, impl.source_hash, meta)
    return meta


def breaks_str(meta: dict[str, Any]) -> str:
    """'0' graph breaks through the op, '0/1' with the unregistered contrast's count after the slash."""
    gb = meta.get("graph_breaks") or {}

    def one(d: dict | None) -> str:
        return "-" if not d or d.get("breaks") is None else str(d["breaks"])

    reg = one(gb.get("registered"))
    return reg + (f"/{one(gb['unregistered'])}" if gb.get("unregistered") else "")


def with_progress(pairs: Sequence[tuple[OpSpec, Impl]], bar: bool = True) -> Iterator[tuple[OpSpec, Impl]]:
    """The (op, implementation) pairs of a cost-metadata phase, one at a time, saying how far it has got: a tqdm
    bar on stderr when ``bar`` and stderr is a terminal, else an INFO log line per implementation."""
    if bar and sys.stderr.isatty():
        from ..progress import Progress

        with Progress(pairs, desc="cost metadata", unit="impl", file=sys.stderr, dynamic_ncols=True) as shown:
            for spec, impl in shown:
                shown.set_postfix_str(f"{spec.name} {impl.name}")
                yield spec, impl
        return
    start = time.perf_counter()
    for n, (spec, impl) in enumerate(pairs, 1):
        log.info("cost metadata %d/%d: %s %s (%.0f s into the phase)", n, len(pairs), spec.name, impl.name,
                 time.perf_counter() - start)
        yield spec, impl
