// The tiered_ops CUDA extension's module: the `tiered_ops` library namespace and the pybind11 module. Each op
// registers itself from its own wrapper file (cuda_src/<op>.cpp, TIERED_OPS_CUDA_OP in binding.h); nothing here
// names an op.
#include "binding.h"

namespace tiered_ops {

std::vector<std::pair<const char*, PybindExport>>& pybind_exports() {
  static std::vector<std::pair<const char*, PybindExport>> exports;
  return exports;
}

PyObject* call_key_function();  // call_key.cpp: the per-call key of tiered_ops.<op>, and its cached call
PyObject* call_cached_function();
PyObject* fast_path_function();


}  // namespace tiered_ops

// The namespace is this extension's; the ops' schemas are fragments of it, one per op file.
TORCH_LIBRARY(tiered_ops, m) {}

// Static initializers (each op file's registration) have run when Python initializes the module.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::list ops;
  for (const auto& [op, add] : tiered_ops::pybind_exports()) {
    add(m);
    ops.append(op);
  }
  m.attr("registered_ops") = ops;  // the ops whose files registered, in load order
  m.attr("call_key") = pybind11::reinterpret_steal<pybind11::object>(tiered_ops::call_key_function());
  m.attr("call_cached") = pybind11::reinterpret_steal<pybind11::object>(tiered_ops::call_cached_function());
  m.attr("fast_path") = pybind11::reinterpret_steal<pybind11::object>(tiered_ops::fast_path_function());
}
