"""Where each custom CUDA kernel earns its keep: its territories, and the ones given up with their figures.

A territory is a region of problems: (op, implementation, rows, row length, dtypes, modes, contexts). Inside it
the kernel must beat the best compiler tier (torch.compile, Triton) by its cost-aware margin beyond the noise;
``tiered-ops check`` fails when it does not, or when the evidence has no CUDA result inside it. A retired
territory is given up: its reason (with the figures that decided it) is reported, never failed, and the check
says where the kernel wins there again.

Rows and row length (``rows_and_len``): for softmax the row is ``dim``, for rms_norm and layer_norm the
normalized shape (its product), for the elementwise ops (gelu, muladd) the last dim; rows = numel / row length.
Contexts: how a model calls the op; results without a ``context`` column were measured in ``eager``.

The territories are data (``territories.json`` beside this module): op, implementation, rows, row length, dtypes,
modes, contexts, an optional margin and problem options, and for one given up the reason in words; its figures come
from the evidence, computed by the check. Kept out of every implementation's source files on purpose: declaring or
retiring a territory must not change a kernel's source hash, or the evidence that justified it would turn stale.
``python benchmarks/territories_from_results.py`` prints, per kernel and case, the figures of a results file.

A CUDA kernel that holds no territory says why it stays (``kernels`` in the same file, ``Stay``): one reason of
``REASONS`` and a sentence with its evidence, or ``remove``: marked for removal (its sources stay until a change deletes
them). ``tiered-ops check`` fails a kernel that holds no territory, states no reason and has evidence. A kernel whose
sources are deleted leaves this file too (a territory or an entry must name a CUDA implementation of the catalog);
the check reports its rows in the evidence as removed and ignores them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..decide.policy import DEFAULT_MARGINS
from ..registry import CONTEXTS, DTYPES, MODES, Context, Tier, check_context
from ..tiers.catalog import get_op


@dataclass(frozen=True)
class Territory:
    """A region a CUDA kernel exists for. Ranges are inclusive; an upper bound of None is unbounded."""

    name: str
    op: str
    impl: str
    rows: tuple[int, int | None]
    row_len: tuple[int, int | None]
    dtypes: tuple[str, ...]
    modes: tuple[str, ...]
    contexts: tuple[Context, ...] = (Context.EAGER,)
    why: str = ""
    margin: float | None = None  # None: the cost-aware CUDA margin (policy.margins()["cuda"])
    options: tuple[tuple[str, str], ...] = ()  # problem parameters a case must have, e.g. (("lengths", "powerlaw"),)
    claimed: str = ""  # the figures it was declared on, before the evidence has any

    def contains(self, rows: int, row_len: int, dtype: str, mode: str, context: Context | str,
                 problem: str | None = None) -> bool:
        """The case (rows, row length, dtype, mode, context; ``problem``: its string, for ``options``) of this
        territory's op lies inside it."""
        return (_inside(rows, self.rows) and _inside(row_len, self.row_len) and dtype in self.dtypes
                and mode in self.modes and context in self.contexts
                and (not self.options or (problem is not None
                                          and all(f"{k}={v}" in str(problem).split(",") for k, v in self.options))))

    def region(self) -> str:
        """Its region in words: "rows 1-32, row length 4096, bf16/fp32, fwd_nograd, eager"."""
        return (f"rows {_span(self.rows)}, row length {_span(self.row_len)}"
                + "".join(f", {k}={v}" for k, v in self.options)
                + f", {'/'.join(self.dtypes)}, {'/'.join(self.modes)}, {'/'.join(self.contexts)}")


def _inside(v: int, span: tuple[int, int | None]) -> bool:
    return span[0] <= v and (span[1] is None or v <= span[1])


def _span(span: tuple[int, int | None]) -> str:
    lo, hi = span
    return f"{lo}+" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"


# Why a CUDA kernel that holds no territory stays: the reasons a kernel entry may give, and what each means.
REASONS: dict[str, str] = {
    "picked": "the decision still picks it beyond the noise in cases no held territory covers, by too little or in too "
              "few cases for a territory",
    "fallback": "it runs where the compiler tiers cannot",
    "reference": "a hand-written reference the package's other kernels or its tests are built on",
    "feature": "the only tier with some form, dtype, mode or context",
    "remove": "nothing justifies it: marked for removal (its sources stay until a change deletes them)",
}


@dataclass(frozen=True)
class Stay:
    """Why the CUDA kernel (op, impl) stays while it holds no territory: a ``REASONS`` key and a sentence with its
    evidence. Read only while the kernel holds none (a kernel with a held territory is judged by it)."""

    op: str
    impl: str
    reason: str
    why: str


# ------------------------------------------------------------------------------------------- rows and length
_SHAPE = re.compile(r"^(scalar|\d+(?:x\d+)*)(?:,|$)")
_DIM = re.compile(r"(?:^|,)dim=(-?\d+)")
_NORMALIZED = re.compile(r"(?:^|,)normalized_shape=(?:\(([\d, ]*)\)|(\d+))")


def _parse(problem: str) -> tuple[tuple[int, ...], dict[str, Any]]:
    m = _SHAPE.match(problem)
    if not m:
        raise ValueError(f"rows_and_len: problem {problem!r} does not start with a shape like 16384x4096")
    shape = () if m.group(1) == "scalar" else tuple(int(d) for d in m.group(1).split("x"))
    kw: dict[str, Any] = {}
    if d := _DIM.search(problem):
        kw["dim"] = int(d.group(1))
    if n := _NORMALIZED.search(problem):
        kw["normalized_shape"] = tuple(int(x) for x in (n.group(1) or n.group(2)).replace(" ", "").split(",") if x)
    return shape, kw


def rows_and_len(op: str, problem: Any) -> tuple[int, int]:
    """(rows, row length) of ``problem`` (a ``Problem`` or its string, as results files hold it) of ``op``.

    The row is what the op reduces over, read from the problem's own parameters, so no op is named here: a
    ``normalized_shape`` (rms_norm, layer_norm: its product), else a ``dim`` (softmax), else the last dim
    (elementwise ops: gelu, muladd). Rows = numel / row length."""
    if isinstance(problem, str):
        shape, kw = _parse(problem)
    elif hasattr(problem, "shape") and hasattr(problem, "kw"):
        shape, kw = tuple(problem.shape), dict(problem.kw)
    else:
        raise ValueError(f"rows_and_len: problem: expected a Problem or its string like '16384x4096,dim=-1', got "
                         f"{problem!r}")
    if not shape:
        return 1, 1
    if kw.get("normalized_shape") is not None:
        ns = kw["normalized_shape"]
        ns = tuple(int(d) for d in ns) if isinstance(ns, (tuple, list)) else (int(ns),)
        if not ns or tuple(shape[len(shape) - len(ns):]) != ns:
            raise ValueError(f"rows_and_len: {op} normalized_shape {ns} is not the trailing dims of shape {shape}")
        return math.prod(shape[:len(shape) - len(ns)]), math.prod(ns)
    dim = int(kw.get("dim", -1))
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"rows_and_len: {op} dim {dim} is out of range for shape {shape}")
    return math.prod(s for i, s in enumerate(shape) if i != dim % len(shape)), shape[dim]


# ----------------------------------------------------------------------------------------------- the table
DATA = Path(__file__).with_name("territories.json")  # shipped as package data


def load(path: Path | str = DATA) -> tuple[tuple[Territory, ...], dict[str, str]]:
    """The territories of a data file and the retired ones' reasons (name -> why it was given up); a ValueError
    naming the file and the entry when one is malformed."""
    try:
        entries = json.loads(Path(path).read_text())["territories"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"territories: {path}: expected a JSON object with a 'territories' list ({e})") from None
    out, retired = [], {}
    for k, e in enumerate(entries):
        try:
            t = Territory(e["name"], e["op"], e["impl"], (int(e["rows"][0]), _hi(e["rows"][1])),
                          (int(e["row_len"][0]), _hi(e["row_len"][1])), tuple(e["dtypes"]), tuple(e["modes"]),
                          tuple(check_context(c, "contexts") for c in e.get("contexts", ["eager"])),
                          e.get("why", ""), e.get("margin"),
                          tuple(sorted((str(a), str(b)) for a, b in e.get("options", {}).items())),
                          e.get("claimed", ""))
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise ValueError(f"territories: {path}: entry {k} ({e.get('name', '?') if isinstance(e, dict) else e}) "
                             f"is malformed: {type(err).__name__}: {err}") from None
        out.append(t)
        if e.get("retired"):
            retired[t.name] = str(e["retired"])
    return tuple(out), retired


def _hi(v: Any) -> int | None:
    return None if v is None else int(v)


TERRITORIES, RETIRED = load()


def load_kernels(path: Path | str = DATA) -> tuple[Stay, ...]:
    """The kernel entries of a data file (``kernels``: op, impl, reason, why; none where it has no such list); a
    ValueError naming the file and the entry when one is malformed, gives an unknown reason or names a kernel twice."""
    try:
        entries = json.loads(Path(path).read_text()).get("kernels", [])
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"territories: {path}: expected a JSON object ({e})") from None
    out: list[Stay] = []
    for k, e in enumerate(entries):
        try:
            s = Stay(str(e["op"]), str(e["impl"]), str(e["reason"]), str(e["why"]))
        except (KeyError, TypeError) as err:
            raise ValueError(f"territories: {path}: kernel entry {k} is malformed: {type(err).__name__}: {err} "
                             "(expected op, impl, reason, why)") from None
        if s.reason not in REASONS:
            raise ValueError(f"territories: {path}: kernel entry {k} ({s.op} {s.impl}): reason {s.reason!r}: expected "
                             f"one of {', '.join(REASONS)}")
        if not s.why.strip():
            raise ValueError(f"territories: {path}: kernel entry {k} ({s.op} {s.impl}): 'why' is empty: say why, "
                             "with the evidence")
        if any((x.op, x.impl) == (s.op, s.impl) for x in out):
            raise ValueError(f"territories: {path}: kernel {s.op} {s.impl} has two entries")
        out.append(s)
    return tuple(out)


KERNELS = load_kernels()


def validate_kernels(kernels: tuple[Stay, ...] | list[Stay] = KERNELS) -> None:
    """Raise ValueError naming the entry when a kernel entry names an unknown op or no CUDA implementation of it."""
    for s in kernels:
        impl = get_op(s.op).impls.get(s.impl)
        if impl is None or impl.tier != Tier.CUDA:
            raise ValueError(f"kernel entry {s.op} {s.impl}: {s.op} has no CUDA implementation {s.impl!r}")


def validate(territories: tuple[Territory, ...] | list[Territory] = TERRITORIES,
             retired: dict[str, str] | None = None, kernels: tuple[Stay, ...] | list[Stay] = KERNELS) -> None:
    """Raise ValueError naming the entry when a territory names an unknown op, a non-CUDA implementation, an unknown
    dtype, mode or context, an empty range, a name used twice or retired without being declared, or overlaps
    another territory of its kernel (a case must belong to one territory); or a kernel entry is not a CUDA kernel."""
    retired = RETIRED if retired is None else retired
    validate_kernels(kernels)
    names = [t.name for t in territories]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"territories: names used twice: {', '.join(dup)}")
    if unknown := sorted(set(retired) - set(names)):
        raise ValueError(f"territories: retired but not declared: {', '.join(unknown)}")
    for t in territories:
        impl = get_op(t.op).impls.get(t.impl)
        if impl is None or impl.tier != Tier.CUDA:
            raise ValueError(f"territory {t.name}: {t.op} has no CUDA implementation {t.impl!r}")
        if t.margin is not None and not 0 <= t.margin < 10:
            raise ValueError(f"territory {t.name}: margin {t.margin}: expected a fraction like 0.1")
        for what, values, known in (("dtype", t.dtypes, DTYPES), ("mode", t.modes, MODES),
                                    ("context", t.contexts, CONTEXTS)):
            if not values or set(values) - set(known):
                raise ValueError(f"territory {t.name}: {what}s {tuple(map(str, values))}: expected some of "
                                 f"{', '.join(known)}")
        for what, (lo, hi) in (("rows", t.rows), ("row_len", t.row_len)):
            if lo < 0 or (hi is not None and hi < lo):
                raise ValueError(f"territory {t.name}: {what} ({lo}, {hi}) is no range (0 <= low <= high)")
    for i, a in enumerate(territories):
        for b in territories[i + 1:]:
            if (a.op, a.impl) == (b.op, b.impl) and _meet(a.rows, b.rows) and _meet(a.row_len, b.row_len) and \
                    set(a.dtypes) & set(b.dtypes) and set(a.modes) & set(b.modes) and \
                    set(a.contexts) & set(b.contexts) and _options_meet(a.options, b.options):
                raise ValueError(f"territories {a.name} and {b.name} overlap: a case must belong to one territory")


def _options_meet(a: tuple[tuple[str, str], ...], b: tuple[tuple[str, str], ...]) -> bool:
    """A problem can have both territories' options: none of their shared options differs."""
    da, db = dict(a), dict(b)
    return all(da[k] == db[k] for k in da.keys() & db.keys())


def _meet(a: tuple[int, int | None], b: tuple[int, int | None]) -> bool:
    return (b[1] is None or a[0] <= b[1]) and (a[1] is None or b[0] <= a[1])


def markdown(territories: tuple[Territory, ...] | list[Territory] = TERRITORIES,
             retired: dict[str, str] | None = None, kernels: tuple[Stay, ...] | list[Stay] = KERNELS) -> str:
    """The section of docs/territories.md on which CUDA kernel defends what, and why each kernel that holds no
    territory stays (tests/test_check.py holds the page to it)."""
    retired = RETIRED if retired is None else retired
    held = [t for t in territories if t.name not in retired]
    lines = ["## Which CUDA kernels defend what", "",
             "A custom CUDA kernel is kept for the territories it exists for "
             "(`tiered_ops/analysis/territories.json`): inside "
             "one it must beat the best compiler tier (torch.compile, Triton) by its "
             f"{100 * DEFAULT_MARGINS['cuda']:.0f} % margin beyond the noise, or `tiered-ops check` fails (CI checks "
             "the `reports/<gpu>/results.csv` of the GPUs `reports/gpus.toml` names current; an archived GPU's "
             "evidence is reported, never failing). Everywhere else the compiler tiers are the answer. The "
             "check compares with the compiler tiers only: where plain eager is faster still, selection picks eager.",
             ""]
    if held:
        lines += ["| kernel | territory | region |", "|---|---|---|"]
        lines += [f"| {t.op} {t.impl} | {t.name} | {t.region()} |" for t in held]
    else:
        lines += ["**No CUDA kernel defends a territory on the committed evidence**: everywhere it was measured, a "
                  "compiler tier (or Triton launched as cheaply as eager) is as fast within the noise, or faster. The "
                  "kernels stay, measured and reported, for the check to flag where one wins again."]
    if held:
        lines += ["", "A held territory with no row of its op in a results file is reported by the check as not yet "
                  "measured (never failed); one whose rows are stale fails until a sweep measures it again."]
    whys = {t.why: [u.name for u in held if u.why == t.why] for t in held if t.why}
    lines += [""] + [f"Why {', '.join(names)}: {why}." for why, names in whys.items()]
    held_kernels = {(t.op, t.impl) for t in held}
    stays = [k for k in kernels if (k.op, k.impl) not in held_kernels]
    if stays:
        lines += ["", "A kernel that holds no territory says why it stays (`kernels` in the same file; `tiered-ops "
                  "check` states it with the kernel's figures on the evidence, and fails a kernel that holds none, "
                  "states no reason and has evidence):", "", "| kernel | stays as | why |", "|---|---|---|"]
        lines += [f"| {k.op} {k.impl} | {'marked for removal' if k.reason == 'remove' else k.reason} | {k.why} |"
                  for k in stays]
    gone = [t.name for t in territories if t.name in retired]
    lines += ["", f"Given up ({len(gone)}; reported by the check, never failed, each with its reason in "
              "`tiered_ops/analysis/territories.json` and its figures computed from the evidence by "
              "`tiered-ops check`): "
              + ", ".join(gone) + "."]
    return "\n".join(lines) + "\n"
