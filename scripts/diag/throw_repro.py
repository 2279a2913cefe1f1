"""Minimal repro: does a TORCH_CHECK failure inside a tiered_ops CUDA op crash the process?"""
import sys

import torch

from tiered_ops.tiers import cuda_ext

assert cuda_ext.load() is None
case = sys.argv[1]
a = torch.randn(4, 5, device="cuda")
try:
    if case == "shape":
        torch.ops.tiered_ops.gelu_cuda(a, torch.randn(4, device="cuda"), "none")  # bias of 4 for rows of 5
    elif case == "cpu":
        torch.ops.tiered_ops.gelu_cuda(a.cpu(), None, "none")
    elif case == "dim":
        torch.ops.tiered_ops.softmax_cuda(a, 5)
    elif case == "ok":
        print(torch.ops.tiered_ops.gelu_cuda(a, None, "none").shape)
except Exception as e:
    print("raised", type(e).__name__, str(e).splitlines()[0])
print("survived", case)
