"""Decision packs: the decisions of one store (or of one GPU in it) with the measurements behind them, as one JSON file
that another machine merges into its own store, so a fleet of the same GPU decides without measuring.

A pack holds, per decision key (op, bucket, dtype, device fingerprint, mode), the newest fresh row of every
implementation (the rows a decision is derived from: failures included, so a failed candidate is not measured again),
each implementation's cost metadata, the device fingerprints, the exporting installation's source hashes, its
measurement method and torch/Triton versions, and the decision each key had there (for the reader; the importing
store derives its own from the rows). Importing merges the rows into a store, each once however often it is
imported, marked ``origin = 'pack:<file name>'``. A row whose implementation is not installed here, or whose source
hash or measurement method differs from the installed implementation's, is refused with the reason: its figures are
not this code's. Packs of different GPUs coexist in one store: rows are keyed by device fingerprint.

An imported choice was gated on the machine that measured it, not here: ``store.rows.from_pack`` tells the
selection layer which rows those are, so it can gate them on first use.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..buckets import decode
from ..method import CONTEXT_METHODS, METHOD_VERSION
from ..registry import OPS, Tier
from ..store.rows import PACK as ORIGIN
from ..store.rows import usable
from ..store.store import COLUMN_NAMES, Store, open_store
from ..tiers.catalog import all_ops
from .choice import note
from .policy import choose

log = logging.getLogger(__name__)

FORMAT, FORMAT_VERSION = "tiered_ops.decisions", 1
KEY = ("op", "bucket", "dtype", "device_key", "mode")
DEVICE = ("device_type", "gpu_name", "capability", "sm_count", "torch_version", "triton_version", "cuda_version")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("tiered_ops", "torch", "triton"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "none"
    return out


def decision_rows(store: Store, gpu: str | None = None) -> list[dict[str, Any]]:
    """The rows decisions are made from: per decision key and implementation, the newest row, where it is fresh for
    the installed implementation. ``gpu``: only rows of that GPU (its name as stored, its slug like
    ``nvidia-h100-80gb-hbm3``, or a device fingerprint key); a GPU the store holds no row of is a ValueError naming
    those it holds."""
    all_ops()  # registers the built-in ops
    rows = store.rows()
    if gpu is not None:
        want = gpu.lower()
        mine = [r for r in rows if want in (str(r["gpu_name"]).lower(), _slug(str(r["gpu_name"])), r["device_key"])]
        if not mine:
            held = sorted({str(r["gpu_name"]) for r in rows})
            raise ValueError(f"gpu: the store holds no row of {gpu!r}; it holds {', '.join(held) or 'no rows'}")
        rows = mine
    newest: dict[tuple, dict] = {}
    for r in rows:  # ordered by id: the newest row per (key, implementation) wins
        newest[(*[r[k] for k in KEY], r["impl"])] = r
    return [r for r in newest.values() if r["op"] in OPS and OPS[r["op"]].fresh_impl(r) is not None]


def _decisions(rows: list[dict]) -> list[dict[str, Any]]:
    """The fastest correct implementation of ours per decision key (what each key decided where it was measured)."""
    by_key: dict[tuple, list[dict]] = {}
    for r in rows:
        by_key.setdefault(tuple(r[k] for k in KEY), []).append(r)
    out = []
    for key, group in by_key.items():
        cands = [dict(impl=r["impl"], tier=r["tier"], caller_us=r["caller_us"], first_call_s=r["first_call_s"])
                 for r in group if usable(r) and r["tier"] != Tier.PEER.label]
        best, why, _ = choose(cands, "fastest")
        out.append(dict(zip(KEY, key), bucket=list(decode(key[1])), chosen=best["impl"] if best else None,
                        tier=best["tier"] if best else None, caller_us=best["caller_us"] if best else None,
                        reason=why, candidates=sorted(r["impl"] for r in group)))
    return out


def export_pack(store: Store, out: str | Path, gpu: str | None = None) -> dict[str, Any]:
    """Write the decisions of ``store`` (of ``gpu`` only, when given) and the rows behind them to ``out`` (JSON);
    returns the pack written."""
    rows = decision_rows(store, gpu)
    keep = {(r["op"], r["impl"], r["device_key"], r["source_hash"]) for r in rows}
    pack = dict(
        format=FORMAT, format_version=FORMAT_VERSION, method=METHOD_VERSION, created=time.time(),
        versions=_versions(), gpu=gpu,
        source_hashes={s.name: {i.name: i.source_hash for i in s.impls.values()} for s in all_ops()},
        devices={r["device_key"]: {k: r[k] for k in DEVICE} for r in rows},
        decisions=_decisions(rows),
        rows=[{c: r[c] for c in COLUMN_NAMES} for r in rows],
        meta=[m for m in store.meta_rows() if (m["op"], m["impl"], m["device_key"], m["source_hash"]) in keep],
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(pack, indent=1, default=str))
    tmp.replace(out)
    log.info("wrote %d decisions (%d measurements) of %d device(s) to %s", len(pack["decisions"]), len(rows),
             len(pack["devices"]), out)
    return pack


@dataclass
class ImportResult:
    """What importing one pack did: rows added, rows the store already held, rows refused with the reason."""

    path: str
    added: int = 0
    duplicates: int = 0
    refused: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    devices: Counter = field(default_factory=Counter)  # device fingerprint key -> rows accepted

    def reasons(self) -> Counter:
        """How many rows were refused for each reason."""
        return Counter(why for _, why in self.refused)


def refusal(row: dict[str, Any]) -> str | None:
    """Why a pack's row cannot be used with the installed implementations, or None."""
    spec = OPS.get(row.get("op"))
    if spec is None:
        return f"op {row.get('op')!r} is not installed here"
    impl = spec.impls.get(row.get("impl"))
    if impl is None:
        return f"{spec.name} has no implementation {row.get('impl')!r} here"
    if row.get("source_hash") != impl.source_hash:
        return (f"{spec.name} {impl.name}: measured with source {row.get('source_hash')}, the installed source is "
                f"{impl.source_hash}")
    method = CONTEXT_METHODS.get(row.get("context"), METHOD_VERSION)
    if row.get("method") != method:
        return (f"{spec.name} {impl.name}: measured with measurement method {row.get('method')}, this installation "
                f"measures with method {method} ({row.get('context') or 'eager'} context)")
    return None


def read_pack(path: str | Path) -> dict[str, Any]:
    """The pack at ``path``; a file that is not one is a ValueError naming it and what was expected."""
    try:
        pack = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"pack {path}: cannot be read as JSON: {e}") from None
    if not isinstance(pack, dict) or pack.get("format") != FORMAT or not isinstance(pack.get("rows"), list):
        raise ValueError(f"pack {path}: not a decision pack (expected a JSON object with format {FORMAT!r} and rows, "
                         "written by `tiered-ops decisions export`)")
    if pack.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"pack {path}: format version {pack.get('format_version')}, this tiered_ops reads "
                         f"{FORMAT_VERSION}")
    return pack


def import_pack(path: str | Path, store: Store) -> ImportResult:
    """Merge the rows of the pack at ``path`` into ``store`` (each once, marked ``pack:<file name>``), with the cost
    metadata of their implementations; rows that do not match the installed implementations are refused (logged
    with the reason, listed in the result)."""
    all_ops()
    pack, result = read_pack(path), ImportResult(str(path))
    origin = f"{ORIGIN}{Path(path).name}"
    accepted = []
    for row in pack["rows"]:
        why = refusal(row)
        if why is not None:
            result.refused.append((row, why))
            continue
        accepted.append({c: row.get(c) for c in COLUMN_NAMES} | {"origin": origin})
        result.devices[row["device_key"]] += 1
    result.added = store.merge(accepted)
    result.duplicates = len(accepted) - result.added
    kept = {(r["op"], r["impl"], r["device_key"], r["source_hash"]) for r in accepted}
    for m in pack.get("meta", []):
        key = (m.get("op"), m.get("impl"), m.get("device_key"), m.get("source_hash"))
        if key in kept and store.get_meta(*key) is None:
            store.put_meta(*key, m["meta"], timestamp=m.get("timestamp"))
    for why, n in result.reasons().items():
        log.warning("pack %s: %d row(s) refused: %s", path, n, why)
    log.info("pack %s: %d row(s) added, %d already stored, %d refused", path, result.added, result.duplicates,
             len(result.refused))
    return result


def load_decisions(path: str | Path, store: Store | None = None) -> ImportResult:
    """For model code: merge the decision pack at ``path`` into ``store`` (default: the store at ``TIERED_OPS_DB``, or
    the per-user one), so ``tiered_ops.<op>`` decides from it without measuring. Call it before the ops' first
    calls (decisions made earlier in the process are cached). Refused rows are logged with the reason."""
    return import_pack(path, store if store is not None else open_store())


def decisions(store: Store, gpu: str | None = None, only_provisional: bool = False) -> list[dict[str, Any]]:
    """The store's eager-caller decisions under the ``fastest`` policy, one per (op, bucket, dtype, device, mode):
    the chosen implementation (None where nothing correct was timed clean), its caller time, and ``provisional``
    (why, or None: final). ``gpu`` as ``decision_rows``."""
    by_key: dict[tuple, list[dict]] = {}
    for r in decision_rows(store, gpu):
        by_key.setdefault(tuple(r[k] for k in KEY), []).append(r)
    out = []
    for key, group in sorted(by_key.items()):
        spec = OPS[key[0]]
        cands = [dict(impl=r["impl"], tier=r["tier"], caller_us=r["caller_us"], first_call_s=r["first_call_s"])
                 for r in group if usable(r) and r["tier"] != Tier.PEER.label]
        best, why, _ = choose(cands, "fastest")
        busy = note(spec, group)
        if only_provisional and busy is None:
            continue
        out.append(dict(zip(KEY, key), chosen=best["impl"] if best else None,
                        caller_us=best["caller_us"] if best else None, reason=why, provisional=busy))
    return out
