"""``tiered-ops decisions list|export|import``: a store's decisions, provisional ones marked
(``tiered_ops.decide.choice``), and decision packs on the command line (``tiered_ops.packs``)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from ..decide.packs import decisions, export_pack, import_pack
from ..store.store import Store
from .io import out_file


def add_decisions_parser(subparsers: argparse._SubParsersAction,
                         parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """The ``decisions`` subcommand and its ``export`` / ``import`` actions (``parents``: the options every
    subcommand takes, e.g. ``--db``)."""
    help = ("list the decisions of a store (provisional ones marked), export them with the measurements behind them, "
            "or import such a pack")
    s = subparsers.add_parser("decisions", help=help, description=help, parents=list(parents))
    actions = s.add_subparsers(dest="decisions_cmd", required=True, metavar="ACTION", help="list, export or import")
    ls = actions.add_parser("list", parents=list(parents), help="one line per decision; provisional ones say why",
                            description="the decision of each (op, bucket, dtype, device, mode) of an eager caller "
                                        "under the fastest policy; a decision made while some of its candidates' "
                                        "timings were taken on a busy machine is provisional until they are timed "
                                        "again")
    ls.add_argument("--provisional", action="store_true", help="only the provisional decisions")
    ls.add_argument("--gpu", help="only this GPU's decisions: its name, slug or fingerprint")
    e = actions.add_parser("export", parents=list(parents), help="write a decision pack (JSON)",
                           description="write the decisions (op, bucket, dtype, GPU, mode) of the store with the rows "
                                       "behind them, fingerprints, source hashes and versions")
    e.add_argument("--out", required=True, help="the pack to write, e.g. pack.json")
    e.add_argument("--gpu", help="only this GPU's decisions: its name, slug (nvidia-h100-80gb-hbm3) or fingerprint")
    i = actions.add_parser("import", parents=list(parents), help="merge a decision pack into the store",
                           description="merge a pack's rows into the store (each once); rows whose source or "
                                       "measurement method differs from the installed implementation are refused")
    i.add_argument("pack", help="a pack written by `tiered-ops decisions export`")
    return s


def cmd_decisions(args: argparse.Namespace) -> int:
    """Run ``decisions list`` or ``decisions export`` (exit 0), or ``decisions import`` (exit 1 when any row was
    refused)."""
    if args.decisions_cmd == "list":
        return _list(args)
    if args.decisions_cmd == "export":
        out_file(args.out, "--out")
    store = Store(getattr(args, "db", None))
    packs = logging.getLogger("tiered_ops.decide.packs")  # its summary and refusals are printed below: not twice
    level = packs.level
    packs.setLevel(logging.ERROR)
    try:
        if args.decisions_cmd == "export":
            pack = export_pack(store, args.out, args.gpu)
            print(f"wrote {len(pack['decisions'])} decisions ({len(pack['rows'])} measurements, "
                  f"{len(pack['devices'])} device(s)) from {store.path} to {args.out}")
            return 0
        result = import_pack(args.pack, store)
        print(f"{args.pack} into {store.path}: {result.added} measurement(s) added, {result.duplicates} already "
              f"stored, {len(result.refused)} refused")
        for device, n in sorted(result.devices.items()):
            print(f"  {n} for {device}")
        for why, n in result.reasons().most_common():
            print(f"refused {n}: {why}", file=sys.stderr)
        return 1 if result.refused else 0
    finally:
        packs.setLevel(level)
        store.close()


def _list(args: argparse.Namespace) -> int:
    store = Store(getattr(args, "db", None))
    try:
        rows = decisions(store, args.gpu, only_provisional=args.provisional)
    finally:
        store.close()
    for d in rows:
        chosen = f"{d['chosen']} {d['caller_us']:.1f} us" if d["chosen"] else "eager (nothing correct timed clean)"
        print(f"{d['op']} {d['bucket']} {d['dtype']} {d['mode']}: {chosen}"
              + (f" - {d['provisional']}" if d["provisional"] else ""))
    n = sum(d["provisional"] is not None for d in rows)
    print(f"{len(rows)} decision(s), {n} provisional, in {store.path}")
    return 0
