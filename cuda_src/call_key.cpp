// The key of a call of tiered_ops.<op> read in C++: one byte string of everything the op's Python key reads (each
// tensor's shape, dtype, device; the other arguments' values), plus grad mode and each tensor's requires_grad, built
// without a Python object per attribute. The per-call path looks its selection up by it (tiered_ops/decide/dispatch.py)
// and falls back to the Python key wherever this returns None: an argument of a type not encoded here, an integer past
// 64 bits, a key past the buffer, or a CUDA tensor while its stream captures a graph (the capture context is decided
// in Python). Two calls with the same bytes have the same Python key: this key only ever holds more.
//
// Encoding, per argument: a tag, then its payload: 'T' tensor (dtype, device type, device index, requires_grad, dim,
// sizes), 'N' None, 'B' bool, 'I' int (8 bytes), 'F' float (its 8 bytes), 'S' str (length, UTF-8), 'Q' a tuple or
// list of ints (length, each 8 bytes), 'D' a torch.dtype. The first argument is the op's name.
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

namespace {

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

// Whether the current stream of a CUDA tensor's device captures a graph (no context is created for the query).
bool capturing(const at::Tensor& t) {
#ifndef TIERED_OPS_CALL_KEY_NO_CUDA
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(t.get_device()).stream(), &status) != cudaSuccess) {
    cudaGetLastError();
    return true;  // unknown: the Python path decides
  }
  return status != cudaStreamCaptureStatusNone;
#else
  (void)t;
  return false;
#endif
}

bool put_int(KeyBuffer& k, PyObject* o) {
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return k.i64(v);
}

// One argument; false where it cannot be encoded (the caller then returns None). `asked`: whether the capture state
// was asked already (once per call: the current stream, as the Python key asks it).
bool put_arg(KeyBuffer& k, PyObject* o, bool& asked) {
  // A tensor by its type's MRO (THPVariable_Check would ask the metaclass's __instancecheck__, in Python, of every
  // argument that is no tensor).
  if (THPVariableClass != nullptr && PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(THPVariableClass))) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (t.layout() != c10::kStrided) return false;
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
  if (o == Py_None) return k.tag('N');
  if (PyBool_Check(o)) return k.tag('B') && k.tag(o == Py_True ? 1 : 0);
  if (PyLong_CheckExact(o)) return k.tag('I') && put_int(k, o);
  if (PyFloat_CheckExact(o)) {
    const double v = PyFloat_AS_DOUBLE(o);
    return k.tag('F') && k.put(&v, sizeof v);
  }
  if (PyUnicode_CheckExact(o)) {
    Py_ssize_t len = 0;
    const char* s = PyUnicode_AsUTF8AndSize(o, &len);
    if (s == nullptr) {
      PyErr_Clear();
      return false;
    }
    return k.tag('S') && k.i64(len) && k.put(s, static_cast<size_t>(len));
  }
  if (PyTuple_Check(o) || PyList_CheckExact(o)) {
    const Py_ssize_t len = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    if (!k.tag('Q') || !k.i64(len)) return false;
    for (Py_ssize_t i = 0; i < len; ++i)
      if (!PyLong_CheckExact(items[i]) || !put_int(k, items[i])) return false;
    return true;
  }
  if (THPDtype_Check(o)) return k.tag('D') && k.tag(static_cast<char>(reinterpret_cast<THPDtype*>(o)->scalar_type));
  return false;
}

PyObject* call_key(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  KeyBuffer k;
  k.tag(c10::GradMode::is_enabled() ? 1 : 0);
  bool asked = false;
  for (Py_ssize_t i = 0; i < nargs; ++i)
    if (!put_arg(k, args[i], asked)) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize(k.data, static_cast<Py_ssize_t>(k.n));
}

PyMethodDef call_key_def = {"call_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_key)),
                            METH_FASTCALL,
                            "call_key(op, *args) -> bytes | None: the per-call key of tiered_ops.<op>(*args)"};

}  // namespace

namespace tiered_ops {

// A plain CPython function (METH_FASTCALL: no argument tuple, no pybind11 conversion on the per-call path).
PyObject* call_key_function() { return PyCFunction_New(&call_key_def, nullptr); }

}  // namespace tiered_ops
