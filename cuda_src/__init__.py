"""CUDA tier of every tiered_ops op: the .cu/.cuh/.h/.cpp files here are package data, built by tiered_ops.cuda_ext."""
