"""tiered-ops' arguments: the parser of every subcommand and the parsing of shapes, dtypes, modes and op options.

The op options (``--dim``, ``--normalized-shape``, ``--no-weight``, ...) come from the ops' declarations: the
keyword parameters of each ``spec.problem``. ``--db`` is accepted before or after the subcommand.
"""

from __future__ import annotations

import argparse
import inspect
import re
from typing import NoReturn

import torch

from ..decide.policy import POLICIES
from ..registry import CONTEXTS, DTYPES, MODES, OpSpec, Problem
from ..tiers.catalog import all_ops, get_op
from .decisions import add_decisions_parser
from .tune import add_tune_parser

# A shape whose first dim is negative ("-1x4") reads to argparse as an option; main() hands it on with a leading
# space (no longer an option, stripped by _shape) so that the shape's own error names it.
_DASHED_SHAPE = re.compile(r"-\d+(?:[x×]-?\d+)+")


def _shape(text: str) -> tuple[int, ...]:
    text = text.strip()
    try:
        shape = tuple(int(d) for d in text.lower().replace("×", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like 16384x4096, got {text!r}") from None
    if any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"dims must be positive, got {text}")
    return shape


def _problem_text(text: str) -> tuple[tuple[int, ...], dict[str, str]]:
    """``DIMS[,name=value...]``, as a report prints a problem (``8192x4096,vocab=32000``): the dims, and the op's
    options as given (typed against the op that takes them: ``shape_problem``)."""
    dims, *rest = text.strip().split(",")
    params = {}
    for item in rest:
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise argparse.ArgumentTypeError(
                f"an op option after the dims must look like vocab=32000, got {item!r} in {text.strip()!r}")
        params[name.strip()] = value.strip()
    return _shape(dims), params


def _bool(text: str) -> bool:
    low = text.lower()
    if low not in ("true", "false", "1", "0"):
        raise ValueError(f"must be True or False, got {text!r}")
    return low in ("true", "1")


def shape_problem(spec: OpSpec, shape: tuple[int, ...], params: dict[str, str]) -> Problem:
    """``spec``'s problem of ``shape`` with the options ``params`` (as written, typed by the op's own parameters); an
    option the op does not take, or a value of the wrong kind, is an error that names the op and the option."""
    takes = {p.name: p for p in list(inspect.signature(spec.problem).parameters.values())[1:]}
    wrong = [k for k in params if k not in takes]
    if wrong:
        raise ValueError(f"--shapes: {spec.name} takes no option {', '.join(wrong)}; "
                         + (f"its options: {', '.join(takes)}" if takes else "it takes no options"))
    typed: dict[str, object] = {}
    for name, value in params.items():
        kind = _param_type(takes[name])
        try:
            typed[name] = _bool(value) if kind is bool else kind(value)  # type: ignore[operator]
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"--shapes: {spec.name}'s option {name}: {e}") from None
    return spec.problem(shape, **typed)


def _dtypes(text: str) -> list[torch.dtype]:
    out = []
    for name in text.split(","):
        if name not in DTYPES:
            raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
        out.append(DTYPES[name])
    return out


def _modes(text: str) -> list[str]:
    out = [m.strip() for m in text.split(",")]
    for m in out:
        if m not in MODES:
            raise argparse.ArgumentTypeError(f"mode must be one of {', '.join(MODES)}, got {m!r}")
    return out


def _shard(text: str) -> tuple[int, int]:
    """``i/n``: shard i (1-based) of n."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shard must look like 2/4 (shard 2 of 4), got {text!r}") from None
    if n < 1 or not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"shard i/n needs 1 <= i <= n, got {text}")
    return i, n


def _gpus(text: str) -> str:
    if text != "all" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"gpus must be 'all' or a number of GPUs (1, 2, ...), got {text!r}")
    return text


def _op_params() -> dict[str, tuple[inspect.Parameter, list[str]]]:
    """Every keyword parameter of the ops' declarations (``spec.problem(shape, **params)``), with the ops taking it."""
    out: dict[str, tuple[inspect.Parameter, list[str]]] = {}
    for spec in all_ops():
        for prm in list(inspect.signature(spec.problem).parameters.values())[1:]:
            out.setdefault(prm.name, (prm, []))[1].append(spec.name)
    return out


def _flag(prm: inspect.Parameter) -> str:
    """The option of an op parameter: --no-weight for a flag that is on by default, else --normalized-shape."""
    return f"--{'no-' if prm.default is True else ''}{prm.name.replace('_', '-')}"


def _param_type(prm: inspect.Parameter) -> object:
    """How an op parameter's option value is parsed: dims (64x256) for a sequence of ints, else by its annotation
    or default (int, float, str)."""
    ann = prm.annotation if isinstance(prm.annotation, str) else getattr(prm.annotation, "__name__", "")
    if "Sequence" in ann:
        return _shape
    if isinstance(prm.default, (int, float, str)):
        return type(prm.default)
    return {"int": int, "float": float}.get(ann.split("|")[0].strip(), str)


def _add_op_options(s: argparse.ArgumentParser) -> None:
    """One option per op parameter: a flag for a bool, else a value parsed by ``_param_type``."""
    for name, (prm, ops) in _op_params().items():
        d, takes, words = prm.default, ", ".join(ops), name.replace("_", " ")
        kw = dict(dest=f"param_{name}", default=argparse.SUPPRESS)  # absent: the op's default
        if isinstance(d, bool):
            s.add_argument(_flag(prm), action="store_const", const=not d,
                           help=f"{takes}: {'without' if d else 'with'} {words}", **kw)
        else:
            kind = _param_type(prm)
            s.add_argument(_flag(prm), type=kind, metavar="DIMS" if kind is _shape else name.upper(), **kw,
                           help=f"{takes}: {words} (default {'from the shape' if d is None else d})")


def op_kwargs(op: str, args: argparse.Namespace) -> dict:
    """The op parameters given on the command line; an option the op does not take is an error that names it."""
    given = {k.removeprefix("param_"): v for k, v in vars(args).items() if k.startswith("param_")}
    takes = list(inspect.signature(get_op(op).problem).parameters.values())[1:]
    wrong = [k for k in given if k not in {p.name for p in takes}]
    if wrong:
        known = _op_params()
        raise ValueError(f"{op} takes no {', '.join(_flag(known[k][0]) for k in wrong)}; "
                         + (f"its options: {', '.join(_flag(p) for p in takes)}" if takes else "it takes no options"))
    return given


def protect_shapes(argv: list[str]) -> list[str]:
    """``argv`` with each dashed shape (``-1x4``) made a plain argument, so that its parser says what is wrong."""
    return [" " + a if _DASHED_SHAPE.fullmatch(a) else a for a in argv]


def _listed(s: argparse.ArgumentParser, name: str, parse: object, help: str) -> None:
    """``--NAME`` taking a comma list, and its older plural spelling ``--NAMEs`` as a hidden alias."""
    s.add_argument(f"--{name}", type=parse, help=help)
    s.add_argument(f"--{name}s", dest=name, type=parse, help=argparse.SUPPRESS)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes options only as spelled (``--dtyp`` is not ``--dtype``) and reports a
    mistake on one line, with where to read the usage, rather than the whole usage first."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} -h`: the usage)\n")

    def parse_args(self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
                   ) -> argparse.Namespace:
        """As argparse's, but an argument no parser takes is reported by the subcommand it followed."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
            sub = subs[0].choices.get(getattr(parsed, subs[0].dest, None)) if subs else None
            (sub or self).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def _globals(default: object) -> argparse.ArgumentParser:
    """The options every subcommand takes, before it (``default``) or after it (absent: the value given before)."""
    g = Parser(add_help=False)
    g.add_argument("--db", default=default,
                   help="SQLite store path (default: $TIERED_OPS_DB or ~/.cache/tiered_ops/results.sqlite)")
    g.add_argument("-q", "--quiet", action="store_true", default=default if default is argparse.SUPPRESS else False,
                   help="warnings and errors only (default: also what is tuned or measured, and how long it took)")
    return g


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; each subcommand's name is ``cmd`` in the parsed namespace."""
    p = Parser(prog="tiered-ops", parents=[_globals(None)],
                                description="Gate every tier of every op against float64, time it, store it, and "
                                            "select the fastest correct one per shape. `tiered-ops COMMAND -h`: the "
                                            "arguments of one command.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", help="one of these:")
    common = [_globals(argparse.SUPPRESS)]
    device = Parser(add_help=False)
    device.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when there is one)")
    progress = Parser(add_help=False)
    progress.add_argument("--no-progress", action="store_true", help="no progress bar (a log line every 50 measured)")
    ops = ", ".join(s.name for s in all_ops())

    def command(name: str, help: str, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[*common, *parents])

    s = command("list", "ops x implementations and whether each can run here", device)

    s = command("bench", "gate, time and store every implementation; write a report folder and print a summary",
                device, progress)
    s.add_argument("--ops", help=f"comma-separated ops (default: all): {ops}")
    s.add_argument("--impls", help="comma-separated implementation names, e.g. eager,triton (default: all)")
    s.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                   help="import this module first: it registers more ops (e.g. tests.plants); repeatable")
    s.add_argument("--shapes", type=_problem_text, nargs="+",
                   help="shapes like 16384x4096, with the op's options as a report prints them: 8192x4096,vocab=32000 "
                        "(default: the op's own)")
    _listed(s, "dtype", _dtypes, "comma-separated: fp32,bf16,fp16 (default bf16,fp32 on GPU, fp32 on CPU)")
    _listed(s, "mode", _modes, f"comma-separated: {','.join(MODES)} (default: all)")
    s.add_argument("--force", action="store_true", help="re-measure even when fresh results are stored")
    s.add_argument("--no-meta", action="store_true",
                   help="skip the cost metadata (graph breaks, lines of code, build seconds) after the measurements")
    s.add_argument("--csv", help="also write this sweep's rows to a CSV file")
    s.add_argument("--out", metavar="DIR",
                   help="the report folder: results.csv, README.md and the plots of this sweep (default "
                        "./tiered_ops_report/<device>/, or under $TIERED_OPS_REPORT)")
    s.add_argument("--no-report", action="store_true", help="print the summary only; write no report folder")
    s.add_argument("--tables", action="store_true",
                   help="also print every measurement per op, the decision under each policy and the winner per mode "
                        "(the report folder holds the same)")
    s.add_argument("--gate-all", action="store_true",
                   help="gate every candidate (default: the Triton and compile tiers are timed first and gated only "
                        "where a choice would name them; the others are stored as never chosen)")
    s.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one candidate may take (first call, checks and timing) before it is killed "
                        "and recorded as timed out (default 300)")
    s.add_argument("--in-process", action="store_true",
                   help="measure in this process (for debugging): a crashing or hanging kernel then stops the sweep")
    s.add_argument("--shard", type=_shard, metavar="I/N",
                   help="only the cases of shard I of N (by a stable hash of op, problem and dtype): N runs with "
                        "1/N ... N/N cover the sweep exactly once")
    s.add_argument("--gpus", type=_gpus, metavar="all|N",
                   help="spread the cases over the visible GPUs (all) or the first N, one worker process per GPU "
                        "(default: all where several are visible, unless --device, --shard or --in-process is given)")

    s = command("select", "the implementation chosen for an op at a shape, and why", device)
    s.add_argument("op", help=f"the op: {ops}")
    s.add_argument("shape", type=_shape, help="shape of the op's first input, like 16384x4096")
    s.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="default fp32")
    s.add_argument("--mode", default="fwd_nograd", choices=list(MODES),
                   help="what the decision is for: inference (fwd_nograd, default) or training (fwd+bwd), ...")
    s.add_argument("--context", default="eager", choices=[c.value for c in CONTEXTS],
                   help="who launches the op: a Python caller (eager, default), a torch.compile graph (compiled) or "
                   "a CUDA-graph replay (graphed)")
    _add_op_options(s)
    s.add_argument("--no-tune", action="store_true", help="do not measure when no decision is stored")
    s.add_argument("--policy", choices=list(POLICIES), help="default: fastest")
    s.add_argument("--budget", type=int, help="memory: bytes a call may allocate above its inputs")
    s.add_argument("--calls", type=int, help="cold-start: expected number of calls (default 1000)")
    s.add_argument("--json", action="store_true", help="print the full decision record")

    s = command("info", "graph breaks and maintenance cost of every implementation of an op", device)
    s.add_argument("op", help=f"the op: {ops}")
    s.add_argument("--json", action="store_true", help="print each implementation's metadata as JSON")

    s = command("check", "fail (exit 1) when a CUDA kernel no longer holds its territories "
                         "(tiered_ops/analysis/territories.json)"
                         ", or its evidence is stale", device, progress)
    s.add_argument("--results", nargs="+", help="committed results CSV(s), e.g. reports/nvidia-h200/results.csv: "
                                                "a current GPU's rows gate, an archived GPU's are information")
    s.add_argument("--all", metavar="DIR", help="every DIR/<gpu>/results.csv (CI: --all reports), with DIR/gpus.toml")
    s.add_argument("--gpus", metavar="FILE", help="the current and archived GPUs (default: the gpus.toml of the "
                                                  "results' folder, e.g. reports/gpus.toml; none: every GPU current)")
    s.add_argument("--live", action="store_true", help="measure the default problems inside the territories now on "
                                                       "this GPU, then check")
    _listed(s, "dtype", _dtypes, "--live: comma-separated dtypes (default: the territories')")
    _listed(s, "mode", _modes, "--live: comma-separated modes (default: the territories')")

    s = command("report", "render a per-GPU report (Markdown, CSV, plots) from results")
    s.add_argument("--results", nargs="+", required=True, help="results CSV(s) from `export` or a committed report")
    s.add_argument("--meta", help="cost metadata JSON lines from `export --meta` (graph breaks, LOC, build s)")
    s.add_argument("--out", required=True, help="folder to write, e.g. reports/nvidia-h100")
    s.add_argument("--command", help="the command that produced the results, named in the report (default: "
                                     "\"not recorded\")")
    s.add_argument("--no-csv", action="store_true", help="do not copy the results into the folder (they sit beside it)")
    s.add_argument("--repeat", nargs="+", help="results of a second sweep on the same GPU: report the agreement rate")
    s.add_argument("--targets-spec", help="speed targets JSON (e.g. benchmarks/targets.json): add their section")
    s.add_argument("--targets", help="with --targets-spec: folder with grid.csv, picks.csv, dispatch.csv "
                                     "(`targets --live`) for the targets measured there")

    s = command("targets", "speed targets from data: measure a regret grid and the dispatch cost (--live), or render "
                           "every target's figure from results", device)
    s.add_argument("--results", nargs="+", help="the default sweep's results CSV(s)")
    s.add_argument("--spec", help="the speed targets and thresholds, JSON (e.g. benchmarks/targets.json)")
    s.add_argument("--grid", help="--live: the regret grid's points, CSV or JSON of op, shape, dtype, mode, params "
                                  "(e.g. benchmarks/grid.csv)")
    s.add_argument("--live", action="store_true", help="measure the grid (--grid) and the dispatch cost (--spec) now "
                                                       "on this GPU")
    s.add_argument("--out-dir", help="where grid.csv, picks.csv and dispatch.csv are written (--live) or read")
    s.add_argument("--timeout", type=float, default=300.0, help="--live: seconds one candidate may take")

    s = command("compare", "the cross-GPU view (reports/README.md) from per-GPU results files")
    s.add_argument("--results", nargs="+", required=True, help="reports/<gpu>/results.csv of each GPU")
    s.add_argument("--out", default="reports/README.md", help="the Markdown file to write (default reports/README.md)")

    s = command("export", "write every stored measurement to CSV")
    s.add_argument("--csv", required=True, help="the CSV file to write")
    s.add_argument("--context", default="eager", choices=[*(c.value for c in CONTEXTS), "*"],
                   help="the rows measured as this caller runs the op (default eager; '*': every row)")
    s.add_argument("--meta", help="also write every implementation's cost metadata as JSON lines")

    add_decisions_parser(sub, common)
    add_tune_parser(sub, common)
    return p
