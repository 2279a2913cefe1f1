"""The Hugging Face norm forms' contract is declared once (tiered_ops/ops/rms_norm.py: FORM_FLAGS, FORM_CHECKS,
FORM_WEIGHT_DTYPE, form_error, out_dtype). The Triton tier calls it; the CUDA tier keeps its own TORCH_CHECKs for direct
callers of the C++ ops (cuda_src/binding.h: hf_norm_weight, hf_out_dtype). Here those C++ functions are read from their
text and evaluated, statement by statement, over every combination of the form's flags, a weight or none and the
dtypes of x and the weight, and each outcome (the check that fails, by its message; y's dtype) is compared with the
declaration's. A statement the reader does not know fails the test: extend the reader, do not skip it."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from tiered_ops.ops import rms_norm as decl

ROOT = Path(__file__).resolve().parents[1]
CUDA_SRC = ROOT / "cuda_src"
DTYPES = {"Float": torch.float32, "Half": torch.float16, "BFloat16": torch.bfloat16}
# C++ text -> Python, in this order (the C++ names of binding.h's form functions)
TOKENS = (
    (r"\bt\.has_value\(\)|\bt->defined\(\)", "given"),
    (r"\bt->scalar_type\(\)", "w"),
    (r"\bx\.scalar_type\(\)", "x"),
    (r"\bat::k(\w+)", r"DT_\1"),
    (r"&&", " and "),
    (r"\|\|", " or "),
    (r"!(?!=)", " not "),
    (r"\btrue\b", "True"),
    (r"\bfalse\b", "False"),
)
NAMES = {"weight_offset", "cast_before_weight", "has_w", "given", "w", "x", "w_fp32", "and", "or", "not", "True",
         "False", "if", "else", *(f"DT_{k}" for k in DTYPES)}


def _matching(s: str, i: int, open_: str = "(", close: str = ")") -> int:
    """The index of the bracket closing the one at s[i] (string literals skipped)."""
    depth, quoted = 0, False
    for j in range(i, len(s)):
        c = s[j]
        if c == '"' and s[j - 1] != "\\":
            quoted = not quoted
        elif not quoted and c == open_:
            depth += 1
        elif not quoted and c == close:
            depth -= 1
            if depth == 0:
                return j
    raise AssertionError(f"unbalanced {open_}{close} from {s[i:i + 60]!r}")


def _split(s: str, sep: str) -> list[str]:
    """s split at ``sep`` outside brackets and string literals."""
    out, depth, quoted, start = [], 0, False, 0
    for j, c in enumerate(s):
        if c == '"' and s[j - 1] != "\\":
            quoted = not quoted
        elif not quoted and c in "([{":
            depth += 1
        elif not quoted and c in ")]}":
            depth -= 1
        elif not quoted and depth == 0 and c == sep:
            out.append(s[start:j].strip())
            start = j + 1
    tail = s[start:].strip()
    return out + ([tail] if tail else [])


def body(text: str, name: str) -> list[str]:
    """The statements of the C++ function ``name`` defined in ``text`` (comments dropped)."""
    text = re.sub(r"//[^\n]*", "", text)
    m = re.search(rf"\b{name}\(", text)
    assert m, f"{name} not found"
    close = _matching(text, m.end() - 1)
    start = text.index("{", close)
    return _split(text[start + 1:_matching(text, start, "{", "}")], ";")


def py(cond: str) -> str:
    """A C++ condition or expression of the form functions as Python (``a ? b : c`` too); an unknown name fails."""
    for pat, rep in TOKENS:
        cond = re.sub(pat, rep, cond)
    ternary = re.fullmatch(r"(.*)\?(.*):(.*)", cond, re.S)
    if ternary:
        cond = f"({ternary[2]}) if ({ternary[1]}) else ({ternary[3]})"
    unknown = set(re.findall(r"[A-Za-z_][\w.>-]*", cond)) - NAMES
    assert not unknown, f"a C++ condition this test does not read: {cond!r} ({sorted(unknown)})"
    return " ".join(cond.split())


def message(args: list[str]) -> str:
    """A TORCH_CHECK's message after its op name: literals joined, every other expression as {}."""
    parts = []
    for a in args:
        lits = re.fullmatch(r'(\s*"(?:[^"\\]|\\.)*"\s*)+', a)
        parts.append("".join(re.findall(r'"((?:[^"\\]|\\.)*)"', a)) if lits else "{}")
    text = "".join(parts)
    assert text.startswith("{}: "), f"a message not of the form op, \": ...\": {text!r}"
    return text[4:]


def run_checks(statements: list[str], env: dict) -> str | None:
    """Evaluate hf_norm_weight's statements in order: the message of the first TORCH_CHECK that fails, or None where
    the function returns (``env`` then holds what it assigned, w_fp32 included)."""
    for st in statements:
        st = " ".join(st.split())
        if st.startswith("TORCH_CHECK("):
            cond, *msg = _split(st[len("TORCH_CHECK("):_matching(st, len("TORCH_CHECK"))], ",")
            if re.search(r"device\(\)|sizes\(\)", cond):  # the weight's device and shape: the plain norm's checks
                continue
            if not eval(py(cond), {}, env):  # noqa: S307 - our own header's conditions, translated above
                return message(msg)
        elif st.startswith("if ("):
            close = _matching(st, 3)
            assert st[close + 1:].strip().startswith("return"), f"an if that does not return: {st!r}"
            if eval(py(st[4:close]), {}, env):  # noqa: S307
                return None
        elif m := re.fullmatch(r"(?:const bool (\w+)|\*(w_fp32)) = (.*)", st):
            env[m[1] or m[2]] = eval(py(m[3]), {}, env)  # noqa: S307
        elif st.startswith("check_cuda("):
            continue
        elif st.startswith("return"):
            return None
        else:
            raise AssertionError(f"a statement of hf_norm_weight this test does not read: {st!r}")
    return None


def cpp_outcomes(binding: str) -> dict[tuple, tuple]:
    """(weight_offset, cast_before_weight, x dtype, weight dtype or None) -> (failed check's message or None, y's
    dtype or None) as binding.h computes them."""
    checks, out = body(binding, "hf_norm_weight"), body(binding, "hf_out_dtype")
    assert len(out) == 1 and out[0].startswith("return"), out
    consts = {f"DT_{k}": v for k, v in DTYPES.items()}
    result = {}
    for offset, cast, x, w in itertools.product((0.0, 1.0), (False, True), list(DTYPES.values()),
                                                [None, *DTYPES.values()]):
        env = dict(consts, weight_offset=offset, cast_before_weight=cast, x=x, w=w, given=w is not None)
        failed = run_checks(checks, env)
        y = None if failed else eval(py(out[0][len("return"):]), {}, env)  # noqa: S307
        result[(offset, cast, x, w)] = (failed, y)
    return result


def declared_outcomes() -> dict[tuple, tuple]:
    """The same table from the declaration (the weight's dtype outside a form is the plain norm's, not the form's:
    y's dtype is compared where the form takes the weight)."""
    result = {}
    for offset, cast, x, w in itertools.product((0.0, 1.0), (False, True), list(DTYPES.values()),
                                                [None, *DTYPES.values()]):
        bad = decl.form_error(offset, cast, w is not None, w, x)
        failed = re.sub(r"\{\w+\}", "{}", decl.FORM_CHECKS[bad][1]) if bad else None
        xt, wt = torch.empty(0, dtype=x), None if w is None else torch.empty(0, dtype=w)
        result[(offset, cast, x, w)] = (failed, None if failed else decl.out_dtype(xt, wt, cast))
    return result


def _compare(cpp: dict, want: dict) -> list[str]:
    diffs = []
    for k, (failed, y) in want.items():
        offset, cast, x, w = k
        got_failed, got_y = cpp[k]
        plain_mix = not (offset or cast) and w is not None and w != x  # the plain norm's dtype check, not the form's
        if got_failed != failed or (failed is None and not plain_mix and got_y != y):
            diffs.append(f"weight_offset={offset} cast_before_weight={cast} x={x} weight={w}: C++ "
                         f"{got_failed or got_y}, declared {failed or y}")
    return diffs


def test_cuda_checks_match_the_declared_contract():
    """binding.h's hf_norm_weight and hf_out_dtype give, for every flag, weight and dtype combination, the outcome
    the declaration gives: the same check fails (the same message), or both take the call with the same y dtype."""
    diffs = _compare(cpp_outcomes((CUDA_SRC / "binding.h").read_text()), declared_outcomes())
    assert not diffs, "cuda_src/binding.h and tiered_ops/ops/rms_norm.py disagree:\n" + "\n".join(diffs)


@pytest.mark.parametrize("edit", [
    ("at::kFloat, op", "at::kHalf, op"),  # another weight dtype allowed
    ("TORCH_CHECK(!(weight_offset != 0 && cast_before_weight)", "TORCH_CHECK(true"),  # a check dropped
    ("needs a weight (it", "needs a weight (as it"),  # a message reworded
    ("w_fp32 && cast_before_weight ? at::kFloat", "w_fp32 ? at::kFloat"),  # another output dtype
], ids=["weight dtype", "check dropped", "message", "output dtype"])
def test_the_comparison_sees_a_cuda_check_that_drifts(edit):
    text = (CUDA_SRC / "binding.h").read_text()
    assert edit[0] in text, f"the edit {edit[0]!r} no longer applies to binding.h: update this test"
    assert _compare(cpp_outcomes(text.replace(edit[0], edit[1], 1)), declared_outcomes())


def test_cuda_ops_take_the_declared_flags_and_check_them():
    """Each norm op's C++ wrapper takes the declared flags (schema and signature) and checks them with
    hf_norm_weight in its forward and its backward."""
    for op in ("rms_norm", "fused_add_rms_norm"):
        text = (CUDA_SRC / f"{op}.cpp").read_text()
        assert text.count("hf_norm_weight(") == 2, op
        schema = ", ".join(f"{t} {f}={d}" for t, f, d in zip(("float", "bool"), decl.FORM_FLAGS, ("0.", "False")))
        assert " ".join(text.split()).replace('" "', "").count(schema) == 2, (op, schema)
    sig = " ".join((CUDA_SRC / "binding.h").read_text().split())
    assert f"double {decl.FORM_FLAGS[0]}, bool {decl.FORM_FLAGS[1]}" in sig
