"""README's CLI section documents the options every command takes and the exit codes."""

import re
from pathlib import Path

from tiered_ops.cli.args import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def _cli_section() -> str:
    text = README.read_text()
    return text[text.index("## CLI"):text.index("\n## ", text.index("## CLI") + 1)]


def test_the_cli_section_names_every_global_option():
    section = _cli_section()
    for action in build_parser()._actions:
        if action.option_strings and action.dest not in ("help", "cmd"):
            assert "/".join(action.option_strings) in section or all(o in section for o in action.option_strings), \
                f"README's CLI section does not mention {action.option_strings}"


def test_the_cli_section_gives_the_exit_codes():
    section = _cli_section()
    assert re.search(r"\bquiet\b.*INFO", section, re.S)
    for code in ("0 done", "2 bad input", "1 only from a failed `tiered-ops check`"):
        assert code in section, code
