"""Which GPUs' evidence is current and which is archived: ``reports/gpus.toml``, data beside the evidence.

    # GPUs whose evidence gates CI (tiered-ops check); archived ones are history: read, marked, never failing.
    current = ["nvidia-h200"]
    [archived.nvidia-h100]
    tree = "b8ba9b8"        # the tree of its last sweep
    date = "2026-11-28"     # that sweep's day (UTC)
    note = "..."            # optional, in words

A GPU is named as its folder under ``reports/`` is (``nvidia-h200``). A results file's GPU is the folder under the
directory holding ``gpus.toml`` it lies in (``reports/nvidia-h100/training/results.csv`` is the H100's), else its
own folder; a row's GPU is its ``gpu_name`` made a slug (``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``),
matched to a listed GPU it starts with (``nvidia-h100``). A GPU listed nowhere is current: its evidence gates, as
all evidence did before this file existed, and with no file at all (an installed package without a checkout) every
GPU is current. Bringing an archived GPU back is moving its name to ``current``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE_NAME = "gpus.toml"


@dataclass(frozen=True)
class Archived:
    """An archived GPU: the tree and the day of its last sweep, and a note in words."""

    name: str
    tree: str
    date: str
    note: str = ""

    def describe(self) -> str:
        return f"last swept at tree {self.tree} on {self.date}" + (f"; {self.note}" if self.note else "")


@dataclass(frozen=True)
class Gpus:
    """The current and archived GPUs of one ``gpus.toml`` (``path``; None: no file, every GPU current)."""

    current: tuple[str, ...] = ()
    archived: dict[str, Archived] = field(default_factory=dict)
    path: Path | None = None

    def archive(self, gpu: str | None) -> Archived | None:
        """The archived entry of ``gpu`` (a listed name or a row's slug), None where it is current."""
        name = self.name(gpu)
        return self.archived.get(name) if name is not None else None

    def is_current(self, gpu: str | None) -> bool:
        return self.archive(gpu) is None

    def name(self, gpu: str | None) -> str | None:
        """The listed GPU that ``gpu`` (a folder name or a ``gpu_name`` like "NVIDIA H100 80GB HBM3") is, else its
        slug; None for no name."""
        if gpu is None or gpu != gpu or not str(gpu).strip():
            return None
        s = slug(str(gpu))
        listed = sorted([*self.current, *self.archived], key=len, reverse=True)  # the longest name that fits
        return next((g for g in listed if s == g or s.startswith(g + "-")), s)

    def of_file(self, results: str | Path) -> str:
        """The GPU of a results file: its folder right under this file's directory, else its own folder."""
        p = Path(results).resolve()
        if self.path is not None:
            base = self.path.resolve().parent
            if base in p.parents and len(p.relative_to(base).parts) > 1:
                return p.relative_to(base).parts[0]
        return p.parent.name


def slug(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def find(results: str | Path, levels: int = 3) -> Path | None:
    """The ``gpus.toml`` of a results file: in its parent's parent (``reports/`` for ``reports/<gpu>/results.csv``)
    or up to ``levels`` folders above that; None when there is none."""
    for d in list(Path(results).resolve().parents)[1:1 + levels]:
        if (d / FILE_NAME).is_file():
            return d / FILE_NAME
    return None


def load(path: str | Path | None) -> Gpus:
    """The GPUs of ``path`` (None: no file, every GPU current); a ValueError naming the file and what is wrong."""
    if path is None:
        return Gpus()
    path = Path(path)
    try:
        data = _parse(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"gpus: {path}: {e}") from None
    unknown = sorted(set(data) - {"current", "archived"})
    current, archived = data.get("current", []), data.get("archived", {})
    if unknown or not isinstance(current, list) or not all(isinstance(g, str) for g in current) \
            or not isinstance(archived, dict):
        raise ValueError(f"gpus: {path}: expected `current = [\"<gpu>\", ...]` and `[archived.<gpu>]` tables with "
                         f"tree and date" + (f"; unknown keys: {', '.join(unknown)}" if unknown else ""))
    out = {}
    for name, e in archived.items():
        if not isinstance(e, dict) or not e.get("tree") or not e.get("date") or set(e) - {"tree", "date", "note"}:
            raise ValueError(f"gpus: {path}: [archived.{name}] needs tree and date (and at most a note), got "
                             f"{e!r}")
        out[name] = Archived(name, str(e["tree"]), str(e["date"]), str(e.get("note", "")))
    if both := sorted(set(current) & set(out)):
        raise ValueError(f"gpus: {path}: {', '.join(both)} both current and archived: keep one")
    return Gpus(tuple(current), out, path)


def _parse(text: str) -> dict[str, Any]:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # Python 3.10: the subset this file uses
        return parse_subset(text)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"not TOML: {e}") from None


_TABLE = re.compile(r"^\[([A-Za-z0-9_.-]+)\]$")
_PAIR = re.compile(r"^([A-Za-z0-9_-]+)\s*=\s*(.+)$")
_STRING = re.compile(r'"([^"\\]*)"')


def parse_subset(text: str) -> dict[str, Any]:
    """The TOML this file needs, for Pythons without ``tomllib``: ``[a.b]`` tables, ``key = "string"`` and
    ``key = ["a", "b"]`` on one line, ``#`` comments; a ValueError naming the line for anything else."""
    out: dict[str, Any] = {}
    table = out
    for n, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r'\s*#[^"]*$', "", raw).strip()
        if not line:
            continue
        if m := _TABLE.match(line):
            table = out
            for part in m.group(1).split("."):
                table = table.setdefault(part, {})
            continue
        m = _PAIR.match(line)
        value = m.group(2).strip() if m else ""
        if m and _STRING.fullmatch(value):
            table[m.group(1)] = value[1:-1]
        elif m and value.startswith("[") and value.endswith("]") and \
                not _STRING.sub("", value[1:-1]).replace(",", "").strip():
            table[m.group(1)] = _STRING.findall(value)
        else:
            raise ValueError(f"line {n}: {raw.strip()!r}: expected [table], key = \"string\" or key = [\"a\", ...]")
    return out
