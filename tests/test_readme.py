"""The README is a page a newcomer reads first and docs/ holds the rest: the README is short with the two commands
near the top, every page is linked and every relative link resolves, every command in a code block parses, every
Python block runs (here or in the test named for it), and docs/cli.md documents every global option and the exit
codes."""

import re
import shlex
from pathlib import Path

import pytest
import torch

import tiered_ops
from tiered_ops.cli.args import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _cli_section() -> str:
    return (ROOT / "docs" / "cli.md").read_text()


def test_the_cli_section_names_every_global_option():
    section = _cli_section()
    for action in build_parser()._actions:
        if action.option_strings and action.dest not in ("help", "cmd"):
            assert "/".join(action.option_strings) in section or all(o in section for o in action.option_strings), \
                f"docs/cli.md does not mention {action.option_strings}"


def test_the_cli_section_gives_the_exit_codes():
    section = _cli_section()
    assert re.search(r"\bquiet\b.*INFO", section, re.S)
    for code in ("0 done", "2 bad input", "1 only from a failed `tiered-ops check`"):
        assert code in section, code


def test_the_readme_is_a_page_with_the_two_commands_near_the_top():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150
    top = "\n".join(lines[:40])
    assert "bash scripts/bench.sh" in top and "bash scripts/test.sh" in top
    assert max(len(line) for line in lines if not line.startswith("|")) <= 120


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())  # a link inside a code block is code
    return [m for m in LINK.findall(text) if not re.match(r"[a-z]+:", m)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    missing = []
    for link in _links(page):
        path = link.split("#")[0]
        if path and not (page.parent / path).exists():
            missing.append(link)
    assert not missing, f"{page.relative_to(ROOT)}: no such file: {missing}"


def test_every_docs_page_is_linked_from_the_readme_or_the_docs_index():
    linked = {(README.parent / link.split("#")[0]).resolve() for link in _links(README)}
    linked |= {(ROOT / "docs" / link.split("#")[0]).resolve() for link in _links(ROOT / "docs" / "README.md")}
    assert not [p.name for p in DOCS if p.resolve() not in linked]


def _commands(page: Path) -> list[str]:
    """The `tiered-ops` and `bash` lines of the page's bash blocks, without their comments."""
    out = []
    for lang, body in FENCE.findall(page.read_text()):
        if lang == "bash":
            out += [line.split("  #")[0].strip() for line in body.splitlines() if line.strip()]
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_in_a_bash_block_parses(page):
    parser = build_parser()
    for line in _commands(page):
        words = shlex.split(line)
        if words[0] == "tiered-ops":
            parser.parse_args(words[1:])  # SystemExit (2) on an option that does not exist
        elif words[0] == "bash":
            assert (ROOT / words[1]).is_file(), line
        else:
            raise AssertionError(f"{page.name}: a bash line the test does not know how to check: {line}")


# Every Python block, by page and first line: run here, or the test that runs it as written.
RUN_ELSEWHERE = {
    ("model-code.md", "import torch"): "tests/test_tune.py::test_readme_snippet_runs (needs transformers)",
    ("model-code.md", "import torch, tiered_ops"): "tests/test_install.py::test_readme_model_code_runs_as_written",
    ("compile.md", "import torch, transformers, tiered_ops"):
        "tests/test_compile_first.py::test_the_docs_snippet_runs_as_written (needs transformers)",
}


def _python_blocks() -> list[tuple[str, str]]:
    return [(p.name, body) for p in PAGES for lang, body in FENCE.findall(p.read_text()) if lang == "python"]


RUN_HERE = {
    ("README.md", "import torch"): "test_the_readme_model_example_runs_as_written",
    ("model-code.md", 'tiered_ops.set_tuning("background")'): "test_the_background_tuning_block_runs_as_written",
}


def test_every_python_block_is_run_by_a_test():
    here = [(page, body.splitlines()[0]) for page, body in _python_blocks()]
    assert len(set(here)) == len(here) and set(here) == set(RUN_ELSEWHERE) | set(RUN_HERE), here
    for name in RUN_HERE.values():
        assert callable(globals()[name])
    for test in RUN_ELSEWHERE.values():
        file, name = test.split(" ")[0].split("::")
        assert f"def {name}(" in (ROOT / file).read_text(), test


def test_the_readme_model_example_runs_as_written(capsys, monkeypatch):
    """As written, tuning off (the trace then queues nothing): patch, compile, call."""
    monkeypatch.setenv("TIERED_OPS_TUNE", "0")
    code = FENCE.findall(README.read_text())
    code = next(body for lang, body in code if lang == "python")
    assert "tiered_ops.patch(model)" in code and "torch.compile(model)" in code
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert "swapped 2 module(s)" in capsys.readouterr().out
    x = ns["x"].double()
    lin, ln, _ = ns["model"]
    with torch.no_grad():
        want = torch.nn.functional.gelu(torch.nn.functional.layer_norm(
            torch.nn.functional.linear(x, lin.weight.double(), lin.bias.double()), (256,), ln.weight.double(),
            ln.bias.double()))
    torch.testing.assert_close(ns["y"].double(), want, rtol=1e-4, atol=1e-5)


def test_the_background_tuning_block_runs_as_written():
    page = ROOT / "docs" / "model-code.md"
    body = next(b for lang, b in FENCE.findall(page.read_text()) if lang == "python" and "background" in b)
    x = torch.randn(4, 64)
    try:
        exec(compile(body, str(page), "exec"), dict(tiered_ops=tiered_ops, x=x))
    finally:
        tiered_ops.set_tuning(None)
