"""How many guards dynamo puts on a compiled decode step, stock against ``tiered_ops.patch``, on tiny transformers
models (CPU, ``backend="aot_eager"``, ``fullgraph=True``): guard lines, the guards grouped by the source they read
(the root of each guard's source, e.g. ``G['tiered_ops']`` or ``L['self']._modules['model']``), and what the patched
graph guards that the stock one does not. One variant per process (a fresh dynamo cache and a fresh tiered_ops).

    PYTHONPATH=$PWD python3 scripts/diag/guard_count.py                       # every model x variant, each in a child
    PYTHONPATH=$PWD python3 scripts/diag/guard_count.py --model llama --variant patched --show 40
    PYTHONPATH=$PWD python3 scripts/diag/guard_count.py --layers 4     # 4 decoder layers: the per-layer part is the
                                                                        # difference from 2 layers' count, halved
    PYTHONPATH=$PWD python3 scripts/diag/guard_count.py --train        # a training step's graph (grad on, backward)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

MODELS = ("llama", "qwen3")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)


def tiny(family: str, layers: int = 2):  # noqa: ANN201 (a transformers model)
    """tests/test_patch.py's tiny model of ``family`` (hidden 64, 2 layers unless ``layers``), in eval mode."""
    import torch
    import transformers as t

    torch.manual_seed(0)
    small = dict(SMALL, num_hidden_layers=layers)
    cfg = {"llama": lambda: t.LlamaConfig(**small), "qwen3": lambda: t.Qwen3Config(**small, head_dim=16)}[family]()
    cls = {"llama": t.LlamaForCausalLM, "qwen3": t.Qwen3ForCausalLM}[family]
    return cls(cfg).eval()


def guard_lines(fn) -> list[str]:  # noqa: ANN001 (a compiled callable's original function)
    """The guard tree of every cache entry dynamo holds for ``fn``'s code, one line per guard."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    code = getattr(fn, "__code__", None) or fn.__func__.__code__
    lines: list[str] = []
    for entry in _debug_get_cache_entry_list(code):
        lines += [ln for ln in str(entry.guard_manager).splitlines() if ln.strip()]
    return lines


_ROOT = re.compile(r"(G\['[^']+'\]|L\['[^']+'\])((?:\.\w+|\[[^\]]*\])*)")


def source_of(line: str) -> str | None:
    """The source a guard line reads, as dynamo writes it (``G['x'].y[...]`` or ``L['self']...``; the stock model's
    own frame names the module ``L['args'][0]``), or None. The line's comment (the code that made it) is left out."""
    m = _ROOT.search(line.split("  #")[0].replace("L['args'][0]", "L['self']"))
    return m.group(0) if m else None


def group(src: str) -> str:
    """A source's group: its global, or for the module's own attributes, the first few steps of the path."""
    if src.startswith("G["):
        head = re.match(r"G\['([^']+)'\]((?:\.\w+|\[[^\]]*\]){0,2})", src)
        return head.group(0) if head else src
    src = re.sub(r"_modules\['\d+'\]", "_modules[i]", src)  # one group for every layer
    steps = re.findall(r"\.\w+|\[[^\]]*\]", src)
    return src[: len("L['self']") + sum(len(s) for s in steps[:4])] if steps else src


def measure(model: str, variant: str, layers: int = 2, train: bool = False) -> dict:
    """Compile ``model`` and call it on one token (a decode step's shapes; no KV cache: ``use_cache=False``, the
    cache's own guards are the same for both variants), twice, then read the guards of its forward's cache entries.
    ``train``: a training step instead (8 tokens, grad on, the loss against labels, its backward).
    Tuning is off (``TIERED_OPS_TUNE=0`` unless set): the patched trace takes the eager tier, with no stored
    decision, as a first compile does."""
    os.environ.setdefault("TIERED_OPS_TUNE", "0")
    import torch

    import tiered_ops

    m = tiny(model, layers)
    if variant == "patched":
        tiered_ops.patch(m)
    ids = torch.randint(0, m.config.vocab_size, (1, 8 if train else 1))
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    for _ in range(2):  # a second call: recompiles would show as more cache entries
        if train:
            m.train()
            compiled(ids, labels=ids, use_cache=False).loss.backward()
        else:
            with torch.no_grad():
                compiled(ids, use_cache=False)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return dict(model=model, variant=variant, lines=guard_lines(m.forward),
                entries=len(_debug_get_cache_entry_list(m.forward.__func__.__code__)))


def tiered_guards(lines: list[str]) -> list[str]:
    """The guard lines (comments left out) that name tiered_ops: a global of one of its modules read by code of
    another module (``G['__import_tiered_ops_dot_...']``) or an attribute it sets on a patched class. Guards on the
    generated functions' globals (``G['___unnamed_scope_...']``) and on a module's own globals name no module: the
    difference of all guard lines, patched minus stock, is the measure; this list says which are ours by name."""
    return [ln for ln in lines if "tiered_ops" in ln.split("  #")[0]]


def report(a: dict, b: dict, show: int) -> None:
    print(f"== {a['model']}: stock {len(a['lines'])} guard lines ({a['entries']} cache entries), "
          f"patched {len(b['lines'])} ({b['entries']}); patched lines naming tiered_ops: "
          f"{len(tiered_guards(b['lines']))}")
    ga = collections.Counter(re.sub(r"\d{6,}", "N", group(s)) for s in map(source_of, a["lines"]) if s)
    gb = collections.Counter(re.sub(r"\d{6,}", "N", group(s)) for s in map(source_of, b["lines"]) if s)
    diff = {k: gb[k] - ga[k] for k in gb.keys() | ga.keys() if gb[k] != ga[k]}
    print("  guard lines by source, patched minus stock (largest first):")
    for k, n in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:show]:
        print(f"    {n:+5d}  {k}")
    extra = collections.Counter(map(normal, b["lines"])) - collections.Counter(map(normal, a["lines"]))
    print(f"  patched-only guard lines ({sum(extra.values())}; without comments, ids and tree depth), first {show}:")
    for ln in list(extra.elements())[:show]:
        print("    " + ln[:200])


def normal(line: str) -> str:
    """A guard line comparable between processes: no comment, no object id, no tree depth, the module ``L['self']``."""
    body = re.sub(r"\d{6,}", "N", line.split("  #")[0]).replace("L['args'][0]", "L['self']")
    return re.sub(r"^[| +-]*", "", body).strip()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=MODELS)
    p.add_argument("--variant", choices=("stock", "patched"))
    p.add_argument("--show", type=int, default=25, help="lines of each list printed")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny models")
    p.add_argument("--train", action="store_true", help="a training step (grad on, loss, backward), not a decode step")
    p.add_argument("--json", action="store_true", help="(a child) print the measurement as JSON")
    a = p.parse_args()
    if a.model and a.variant:
        r = measure(a.model, a.variant, a.layers, a.train)
        if a.json:
            print(json.dumps(r))
        else:
            print("\n".join(r["lines"]))
        return 0
    for model in (a.model,) if a.model else MODELS:
        got = {}
        for variant in ("stock", "patched"):
            out = subprocess.run([sys.executable, __file__, "--model", model, "--variant", variant, "--json",
                                  "--layers", str(a.layers), *(["--train"] if a.train else [])],
                                 capture_output=True, text=True, check=True, env=dict(os.environ))
            got[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        report(got["stock"], got["patched"], a.show)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
