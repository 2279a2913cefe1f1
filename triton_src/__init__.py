"""Triton tier of every tiered_ops op: one file per op, the same name as in cuda_src/ and tiered_ops/ops/."""
