// An op's training call as one C++ autograd node: the eager fast path (tiered_ops/tiers/native.py) calls OP_train_cuda
// where a gradient is needed, instead of a Python torch.autograd.Function around OP_cuda. Its forward runs OP_cuda and
// saves what the backward reads, its backward runs OP_bwd_cuda: the engine runs it in C++, without the GIL or a
// Python frame. What a node saves and returns is the op's autograd declaration in tiered_ops/ops/<op>.py
// (setup_context and backward); the GPU tests compare the two paths' gradients.
//
// An op's wrapper file defines a torch::autograd::Function<Node> after OP_cuda and OP_bwd_cuda, a function OP_train_cuda
// with OP_cuda's arguments and outputs (a tensor, or a list for several) that returns Node::apply(...), and one
// TIERED_OPS_CUDA_TRAIN(OP) line.
#pragma once
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

#include "binding.h"

namespace tiered_ops {

using AutogradCtx = torch::autograd::AutogradContext;
using Grads = torch::autograd::variable_list;

// An optional tensor as the kernels' functions take it, from a saved (possibly undefined) tensor.
inline c10::optional<at::Tensor> saved_optional(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// The gradient of an output that no gradient reached (undefined: the node does not materialize them), as zeros like
// `like` in `dtype`.
inline at::Tensor grad_or_zeros(const at::Tensor& g, const at::Tensor& like, at::ScalarType dtype) {
  return g.defined() ? g : at::zeros_like(like, like.options().dtype(dtype));
}

}  // namespace tiered_ops

// The pybind11 function OP_train_cuda (defined in the op's wrapper file), exported beside OP_cuda and OP_bwd_cuda.
#define TIERED_OPS_CUDA_TRAIN(OP)                                                                     \
  static const ::tiered_ops::PybindExportEntry OP##_train_pybind_export(#OP, [](pybind11::module_& m) { \
    m.def(#OP "_train_cuda", &OP##_train_cuda);                                                       \
  })
