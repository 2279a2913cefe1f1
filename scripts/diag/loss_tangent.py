"""The backward graph AOTAutograd gives a compiled training call of a tiny patched Llama, around the loss: where the
call returns the logits (as the model's forward does), the backward takes a tangent for them and adds it to the
loss's gradient of the logits (``aten.add(tangents_2, view(<loss backward>))``); without the logits returned there is
no such add. Stock's add follows ``_log_softmax_backward_data``, which Inductor fuses it into; the patched graph's
follows the opaque kernel op (``tiered_ops.cross_entropy_bwd_triton``), so Inductor makes it a pass of its own.

Variants: ``stock`` (transformers' loss) and ``triton`` (the loss on tiered_ops' Triton kernel, its compiled-context
decision planted; on the CPU under TRITON_INTERPRET=1, the triton_op kept whole in the graph as export keeps it, where
on a GPU AOTAutograd replaces it by its kernel launches: the add is the same). Each run prints the backward's nodes
from its first computing node to the first matmul (the loss and the LM head's input gradient), the tangents' users,
and, at run time, whether each tangent AOTAutograd hands the backward is all zeros (the logits' gradient nobody asked
for, materialized by autograd).

    PYTHONPATH=$PWD TIERED_OPS_DB=/tmp/lt.sqlite python scripts/diag/loss_tangent.py [stock|triton] [logits|loss]
(no arguments: all four)
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402
import transformers  # noqa: E402
from functorch.compile import make_boxed_func  # noqa: E402
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402
from torch._subclasses.fake_tensor import is_fake  # noqa: E402

import tiered_ops  # noqa: E402
from tiered_ops.decide import decide  # noqa: E402
from tiered_ops.runtime import dispatch  # noqa: E402

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64)


def plant_kernel(tier: str) -> None:
    """Every compiled-context decision for cross_entropy names ``tier``; the launcher's CPU target check (it reads
    values) skipped on fake tensors; the triton_op kept as one node (no functional decomposition)."""
    why = tiered_ops.get_op("cross_entropy").impls[tier].why_not(torch.device("cpu"))  # loads and registers the ops
    if why:
        sys.exit(f"{tier} unavailable: {why}")
    import triton_src.cross_entropy as tce

    check = tce._check_targets
    tce._check_targets = lambda t, n, i: None if is_fake(t) else check(t, n, i)
    torch._functorch.config.decompose_custom_triton_ops = False
    real = dispatch.trace_plan
    dispatch.trace_plan = lambda key, described: (tier, False) if key[0] == "cross_entropy" else real(key, described)


def loss_region(gm: torch.fx.GraphModule) -> None:
    """The backward's nodes up to its first matmul, and every tangent's users."""
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name.startswith("tangents"):
            val = n.meta.get("val")
            users = ", ".join(u.name for u in n.users)
            print(f"  {n.name}: {tuple(val.shape) if val is not None else '?'} -> users [{users}]")
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        args = ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in n.args)
        print(f"  {n.name} = {n.target}({args})")
        if n.target is torch.ops.aten.mm.default:
            break


def backend(gm: torch.fx.GraphModule, example: list) -> object:
    def fw(g: torch.fx.GraphModule, _: list) -> object:
        out = next(n for n in g.graph.nodes if n.op == "output").args[0]
        print(f"forward: {len(out)} outputs")
        return make_boxed_func(g.forward)

    def bw(g: torch.fx.GraphModule, _: list) -> object:
        print("backward, the loss region:")
        loss_region(g)
        tangents = [i for i, n in enumerate(n for n in g.graph.nodes if n.op == "placeholder")
                    if n.name.startswith("tangents")]
        boxed = make_boxed_func(g.forward)

        def run(args: list) -> object:
            for i in tangents:
                print(f"  run time: input {i} {tuple(args[i].shape)} all zeros: {bool((args[i] == 0).all())}")
            return boxed(args)

        run._boxed_call = True
        return run

    return aot_module_simplified(gm, example, fw_compiler=fw, bw_compiler=bw)


def main(variant: str, returns: str) -> None:
    decide.use_store(None)
    decide.set_tuning(False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).train()
    if variant != "stock":
        tiered_ops.patch(model, ops=["cross_entropy"])
        plant_kernel(variant)

    def step(m: torch.nn.Module, x: torch.Tensor) -> object:
        out = m(input_ids=x, labels=x)
        return (out.loss, out.logits) if returns == "logits" else out.loss

    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8))
    print(f"##### {variant}, the compiled call returns {'loss and logits' if returns == 'logits' else 'the loss'}")
    got = torch.compile(step, fullgraph=True, backend=backend)(model, ids)
    (got[0] if isinstance(got, tuple) else got).backward()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "logits")
    else:
        import subprocess

        for v in ("stock", "triton"):
            for r in ("logits", "loss"):  # one process each: no compiled code or planted decision shared
                subprocess.run([sys.executable, __file__, v, r], check=True)
