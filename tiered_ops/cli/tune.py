"""``tiered-ops tune --module pkg.mod:make_model_and_inputs [--train]``: patch the model the function returns,
record one real step and measure exactly its calls (``tiered_ops.tune``)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Sequence

from ..decide import decide
from ..models.patching import patch
from ..models.tuning import tune
from ..registry import CONTEXTS


def add_tune_parser(subparsers: Any, parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """Add the ``tune`` subcommand to ``subparsers`` (the result of ``add_subparsers``)."""
    what = "patch a model, record one real step's tiered_ops calls, measure and store exactly those"
    s = subparsers.add_parser("tune", help=what, description=what, parents=list(parents))
    s.add_argument("--module", required=True, metavar="PKG.MOD:FUNCTION",
                   help="a function returning (model, example_inputs); example_inputs is a tuple of positional "
                        "arguments, a dict of keyword arguments or one tensor")
    s.add_argument("--train", action="store_true", help="a training step (forward and backward), not inference")
    s.add_argument("--context", choices=[c.value for c in CONTEXTS], help="how the model will run (recorded)")
    s.add_argument("--ops", help="comma-separated ops to patch (default: all that patch knows)")
    s.add_argument("--no-patch", action="store_true", help="do not patch the model: it calls tiered_ops itself")
    return s


def load_factory(spec: str) -> Any:
    """The function named by ``pkg.mod:function`` (the current directory is importable, as with python -m)."""
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"--module: expected PKG.MOD:FUNCTION, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--module: cannot import {mod_name!r}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--module: {mod_name!r} has no function {fn_name!r}")
    return fn


def cmd_tune(args: argparse.Namespace) -> int:
    if getattr(args, "db", None):
        decide.use_store(args.db)
    made = load_factory(args.module)()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise ValueError(f"--module: {args.module} must return (model, example_inputs), got {type(made).__name__}")
    model, inputs = made
    if not args.no_patch:
        print(patch(model, ops=args.ops.split(",") if args.ops else None))
    print(tune(model, inputs, train=args.train, context=args.context))
    return 0
