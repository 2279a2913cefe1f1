"""One ``Context`` type: a member is its text (equal, hashed alike, printed as it), ``CONTEXTS`` is the order the
generated fast path indexes, and every place a user names a context (select_backend, tune, territories, the CLI)
takes a member or its text and refuses anything else, naming the argument and the allowed values."""

from __future__ import annotations

import json
import re

import pytest
import torch

import tiered_ops
from tiered_ops.analysis import territories
from tiered_ops.cli.cli import main
from tiered_ops.registry import CONTEXTS, Context, check_context
from tiered_ops.runtime import dispatch

ALLOWED = "expected one of eager, compiled, graphed"


def test_a_member_is_its_text():
    for c, text in zip(CONTEXTS, ("eager", "compiled", "graphed")):
        assert c == text and hash(c) == hash(text) and {text: 1}[c] == 1
        assert str(c) == f"{c}" == f"{c:>8}".strip() == text and json.dumps(c) == f'"{text}"'
        assert check_context(text) is c and check_context(c) is c
    assert tuple(Context) == CONTEXTS


def test_the_fast_path_index_is_the_position_in_contexts():
    """The generated key's last element is 1 while compiling, 2 while capturing, else 0: dispatch reads the context
    back as CONTEXTS[index]."""
    src = tiered_ops.softmax.__source__
    assert src.count(" else 2 if _dev >= 0 and _capturing() else 0)") == 1 and "1 if _dynamo()" in src
    assert (CONTEXTS[0], CONTEXTS[1], CONTEXTS[2]) == (Context.EAGER, Context.COMPILED, Context.GRAPHED)
    assert dispatch.CONTEXTS is CONTEXTS


@pytest.mark.parametrize("bad", ["EAGER", "jit", "", None, 0, ["eager"]])
def test_check_context_names_the_argument_and_the_allowed_values(bad):
    with pytest.raises(ValueError, match=rf"^where: {ALLOWED}, got {re.escape(repr(bad))}$"):
        check_context(bad, "where")


def test_select_backend_takes_the_member_or_its_text_alike(private_decisions):
    by_text = tiered_ops.select_backend("softmax", (4, 8), "fp32", "cpu", context="compiled")
    by_member = tiered_ops.select_backend("softmax", (4, 8), "fp32", "cpu", context=Context.COMPILED)
    assert by_member is by_text and by_text.record["context"] == "compiled"
    with pytest.raises(ValueError, match=f"context: {ALLOWED}, got 'jit'"):
        tiered_ops.select_backend("softmax", (4, 8), "fp32", "cpu", context="jit")


def test_tune_takes_the_member_or_its_text_and_names_what_it_refuses(private_decisions):
    model = torch.nn.Linear(4, 4)
    assert tiered_ops.tune(model, torch.randn(2, 4), context=Context.GRAPHED).context is Context.GRAPHED
    report = tiered_ops.tune(model, torch.randn(2, 4), context="compiled")
    assert report.context is Context.COMPILED and "context compiled" in str(report)
    with pytest.raises(ValueError, match="tune: context must be one of eager, compiled, graphed or None .*, got 'jit'"):
        tiered_ops.tune(model, torch.randn(2, 4), context="jit")


def test_territories_read_their_contexts_as_members_and_refuse_an_unknown_one(tmp_path):
    assert all(isinstance(c, Context) for t in territories.TERRITORIES for c in t.contexts)
    entry = dict(name="t", op="softmax", impl="cuda", rows=[1, 8], row_len=[1, 64], dtypes=["fp32"],
                 modes=["fwd_nograd"], contexts=["eager", "graphed"])
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"territories": [entry]}))
    (t,), _ = territories.load(path)
    assert t.contexts == (Context.EAGER, Context.GRAPHED) and t.contains(4, 32, "fp32", "fwd_nograd", "graphed")
    assert "fwd_nograd, eager/graphed" in t.region()
    path.write_text(json.dumps({"territories": [dict(entry, contexts=["eager", "replay"])]}))
    with pytest.raises(ValueError, match=f"entry 0 .* is malformed: ValueError: contexts: {ALLOWED}, got 'replay'"):
        territories.load(path)


@pytest.mark.parametrize("argv", [["select", "softmax", "4x8", "--context", "jit"],
                                  ["export", "--csv", "x.csv", "--context", "jit"],
                                  ["tune", "--module", "m:f", "--context", "jit"]])
def test_the_cli_names_the_allowed_contexts_as_text(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --context: invalid choice: 'jit' (choose from 'eager', 'compiled', 'graphed'" in err
    assert "Context." not in err
