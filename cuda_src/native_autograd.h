// An op's training call as one C++ autograd node: the eager fast path (tiered_ops/tiers/native.py) calls OP_train_cuda
// where a gradient is needed, instead of a Python torch.autograd.Function around OP_cuda. OP_train_cuda runs the
// forward's launch and, where an input requires a gradient, records a KernelNode<State> the way torch's generated
// kernels record theirs: the node's next edges, its saved tensors as SavedVariables, the output's history; its backward
// runs the op's backward launch in the engine, in C++, without the GIL or a Python frame. torch::autograd::Function<T>
// does the same through generic machinery (its inputs' and outputs' metadata, an IValue map of saved arguments, its
// outputs wrapped one by one) that costs the host several microseconds a call more. What a node saves and returns is
// the op's autograd declaration in tiered_ops/ops/<op>.py (setup_context and backward); the GPU tests compare the two
// paths' gradients.
//
// An op's wrapper file defines, after OP_cuda and OP_bwd_cuda, a State struct (kName, kSaved, its plain arguments, and
// `Grads backward(Grads& grads, std::array<at::Tensor, kSaved>& saved) const` returning one gradient a differentiable
// input, in the order of the node's next edges), a function OP_train_cuda with OP_cuda's arguments that returns the
// op's outputs (a tensor, or a tuple for several) and records the node with record_node, and one
// TIERED_OPS_CUDA_TRAIN(OP) line.
//
// Not supported on this path, as with torch::autograd::Function: forward-mode AD (a dual input is an error) and
// compiled autograd (the engine's error names the node). torch.compile and functorch transforms take the registered op.
#pragma once
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

#include "binding.h"

namespace tiered_ops {

using Grads = torch::autograd::variable_list;

// Whether this torch holds autograd nodes by std::shared_ptr (up to 2.11) rather than c10::intrusive_ptr (later).
constexpr bool kSharedNodes =
    std::is_same_v<decltype(torch::autograd::Edge::function), std::shared_ptr<torch::autograd::Node>>;

// The node of an op's training call: State's arguments, its saved tensors, its backward.
template <class State>
struct KernelNode final : torch::autograd::Node {
  State state;
  std::array<torch::autograd::SavedVariable, State::kSaved> saved;

  std::string name() const override { return State::kName; }

  void release_variables() override {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto& s : saved) s.reset_data();
  }

  Grads apply(Grads&& grads) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::array<at::Tensor, State::kSaved> tensors;
    for (size_t i = 0; i < saved.size(); ++i) tensors[i] = saved[i].unpack(owning(this));  // freed: the engine's error
    return state.backward(grads, tensors);
  }

 private:
  // This node as the owning pointer a saved output's unpack needs (its grad_fn, which it does not hold).
  template <class N>
  static auto owning(N* node) {
    if constexpr (kSharedNodes)
      return node->shared_from_this();
    else
      return c10::intrusive_ptr<N>::unsafe_reclaim_from_nonowning(node);
  }
};

// A new node of type N, owned the way this torch owns nodes (deleteNode frees a long graph without deep recursion).
template <class N>
auto new_node() {
  if constexpr (kSharedNodes)
    return std::shared_ptr<N>(new N(), [](N* node) { deleteNode(node); });
  else
    return c10::make_intrusive<N>();
}

// Records the training call's node over `outputs` (their gradients reach its backward in this order) when an input
// requires a gradient under grad mode: its next edges are `inputs`' (a tensor or an optional one each: the order of
// State::backward's gradients), `saved` its saved tensors (the inputs' or, with `is_output`, the outputs' already
// recorded: mark them by index in `output_saved`). The outputs must come from the forward's launch under
// forward_guard(), so that they have no history of their own.
template <class State, class... Inputs>
void record_node(const char* op, State state, std::initializer_list<at::Tensor> outputs,
                 std::initializer_list<std::pair<at::Tensor, bool>> saved, const Inputs&... inputs) {
  if (!torch::autograd::compute_requires_grad(inputs...)) return;
  TORCH_CHECK(!(torch::autograd::isFwGradDefined(c10::optional<at::Tensor>(inputs)) || ...), op,
              ": forward-mode AD (a dual tensor input) is not implemented on the CUDA tier's training call");
  auto node = new_node<KernelNode<State>>();
  node->state = std::move(state);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  for (const at::Tensor& out : outputs) torch::autograd::set_history(out, node);
  size_t i = 0;
  for (const auto& [t, is_output] : saved) node->saved[i++] = torch::autograd::SavedVariable(t, is_output);
}

// The forward of a training call runs below autograd (x.contiguous() and the allocations record nothing).
using ForwardGuard = at::AutoDispatchBelowADInplaceOrView;

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
