// The encoding of a call's key (call_key.cpp): one byte string built without a Python object per attribute.
//
// Encoding, per argument: a tag, then its payload: 'T' tensor (dtype, device type, device index, requires_grad, dim,
// sizes), 'N' None, 'B' bool, 'I' int (8 bytes), 'F' float (its 8 bytes), 'S' str (length, UTF-8), 'Q' a tuple or
// list of ints (length, each 8 bytes), 'D' a torch.dtype. The first argument is the op's name.
#pragma once

#include <Python.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>

#ifndef TIERED_OPS_CALL_KEY_NO_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace tiered_ops::key_encoding {

struct KeyBuffer {
  char data[512];
  size_t n = 0;
  bool put(const void* p, size_t len) {
    if (n + len > sizeof(data)) return false;
    std::memcpy(data + n, p, len);
    n += len;
    return true;
  }
  bool tag(char t) { return put(&t, 1); }
  bool i64(int64_t v) { return put(&v, sizeof v); }
};

// Whether the current stream of a CUDA tensor's device captures a graph (no context is created for the query). Torch's
// default stream is the legacy stream (handle 0), which a capture cannot be begun on: a call on it asks the CUDA
// runtime nothing (the query is a driver call on every eager call otherwise).
inline bool capturing(const at::Tensor& t) {
#ifndef TIERED_OPS_CALL_KEY_NO_CUDA
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
  if (stream == nullptr) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return true;  // unknown: the Python path decides
  }
  return status != cudaStreamCaptureStatusNone;
#else
  (void)t;
  return false;
#endif
}

inline bool put_int(KeyBuffer& k, PyObject* o) {
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return k.i64(v);
}

inline bool put_tensor(KeyBuffer& k, PyObject* o, bool& asked) {
  const at::Tensor& t = THPVariable_Unpack(o);
  if (t.layout() != c10::kStrided) return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->is_python_dispatch() || impl->key_set().has(c10::DispatchKey::Functionalize) ||
      impl->has_symbolic_sizes_strides())
    return false;  // traced (export, a fake or functional tensor): the Python key reads the context
  if (!asked && t.is_cuda()) {
    asked = true;
    if (capturing(t)) return false;
  }
  const auto sizes = t.sizes();
  const int8_t head[5] = {static_cast<int8_t>(t.scalar_type()), static_cast<int8_t>(t.device().type()),
                          static_cast<int8_t>(t.device().index()), static_cast<int8_t>(t.requires_grad()),
                          static_cast<int8_t>(sizes.size())};
  if (!k.tag('T') || !k.put(head, sizeof head)) return false;
  return k.put(sizes.data(), sizes.size() * sizeof(int64_t));
}

// One argument; false where it cannot be encoded (the caller then returns None). `asked`: whether the capture state
// was asked already (once per call: the current stream, as the Python key asks it). The exact types come first, each
// one pointer comparison; a subclass of Tensor (a Parameter) is found by its type's MRO after them (THPVariable_Check
// would ask the metaclass's __instancecheck__, in Python, of every argument that is no tensor).
inline bool put_arg(KeyBuffer& k, PyObject* o, bool& asked) {
  PyTypeObject* type = Py_TYPE(o);
  if (reinterpret_cast<PyObject*>(type) == THPVariableClass) return put_tensor(k, o, asked);
  if (o == Py_None) return k.tag('N');
  if (type == &PyBool_Type) return k.tag('B') && k.tag(o == Py_True ? 1 : 0);
  if (type == &PyLong_Type) return k.tag('I') && put_int(k, o);
  if (type == &PyFloat_Type) {
    const double v = PyFloat_AS_DOUBLE(o);
    return k.tag('F') && k.put(&v, sizeof v);
  }
  if (type == &PyUnicode_Type) {
    Py_ssize_t len = 0;
    const char* s = PyUnicode_AsUTF8AndSize(o, &len);
    if (s == nullptr) {
      PyErr_Clear();
      return false;
    }
    return k.tag('S') && k.i64(len) && k.put(s, static_cast<size_t>(len));
  }
  if (PyTuple_Check(o) || type == &PyList_Type) {  // torch.Size is a tuple
    const Py_ssize_t len = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    if (!k.tag('Q') || !k.i64(len)) return false;
    for (Py_ssize_t i = 0; i < len; ++i)
      if (!PyLong_CheckExact(items[i]) || !put_int(k, items[i])) return false;
    return true;
  }
  if (THPVariableClass != nullptr && PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(THPVariableClass)))
    return put_tensor(k, o, asked);
  if (THPDtype_Check(o)) return k.tag('D') && k.tag(static_cast<char>(reinterpret_cast<THPDtype*>(o)->scalar_type));
  return false;
}

// The key of (op, *args) in k; false where an argument cannot be encoded.
inline bool fill(KeyBuffer& k, PyObject* const* args, Py_ssize_t nargs) {
  k.tag(c10::GradMode::is_enabled() ? 1 : 0);
  bool asked = false;
  for (Py_ssize_t i = 0; i < nargs; ++i)
    if (!put_arg(k, args[i], asked)) return false;
  return true;
}

}  // namespace tiered_ops::key_encoding
