"""The layouts Inductor gives the GPT-2 loss's [N, V] buffers: transformers' ForCausalLMLoss (stock) against
tiered_ops' causal_lm_loss (tiered), each after the LM head, compiled alone (fullgraph) and run forward and backward.

Prints every buffer of the generated code whose shape has the vocabulary (50257, or 50264 where Inductor pads a
matmul's dimension to 8), with its strides (50304: rows padded to 128 bytes). One variant per process, so that
neither reuses the other's compiled code; the tiered variant calls its step once in eager first, where tiered_ops
decides (TIERED_OPS_DB: the store it decides from).

    python scripts/diag/loss_padding.py stock|tiered CACHE_DIR [N]       # N tokens (default 256)
"""

import glob
import os
import re
import sys

os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[2]
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
import torch  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from tiered_ops.models.patch_layers import causal_lm_loss  # noqa: E402

V, N, H = 50257, int(sys.argv[3]) if len(sys.argv) > 3 else 256, 768
lin = torch.nn.Linear(H, V, bias=False).to("cuda", torch.bfloat16)
loss_fn = {"stock": ForCausalLMLoss, "tiered": causal_lm_loss}[sys.argv[1]]


def step(h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lin(h)
    return loss_fn(logits, labels, V), logits


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(1, N, H, dtype=torch.bfloat16, device="cuda", requires_grad=True),
            torch.randint(0, V, (1, N), device="cuda"))


f = torch.compile(step, fullgraph=True)
step(*inputs())[0].backward()
f(*inputs())[0].backward()
for p in glob.glob(sys.argv[2] + "/**/*.py", recursive=True):
    s = open(p).read()
    if "def call" in s:
        for m in re.findall(r"empty_strided_cuda\(\([^)]*\), \([^)]*\)", s):
            if str(V)[:3] in m or "5026" in m or "5030" in m:
                print(os.path.basename(p)[:8], m)
