// The key of a call of tiered_ops.<op> read in C++: one byte string of everything the op's Python key reads (each
// tensor's shape, dtype, device; the other arguments' values), plus grad mode and each tensor's requires_grad, built
// without a Python object per attribute. The per-call path looks its selection up by it (tiered_ops/decide/dispatch.py)
// and falls back to the Python key wherever this returns None: an argument of a type not encoded here, an integer past
// 64 bits, a key past the buffer, or a CUDA tensor while its stream captures a graph (the capture context is decided
// in Python), or a tensor that is traced (a Python-dispatched one: fake, functional; symbolic sizes). Two calls with the
// same bytes have the same Python key: this key only ever holds more.
//
// call_cached(table, kwnames, op, *args) is the per-call path's hit in one C call: the key of (op, *args) looked up in
// `table` (a dict of key -> function) and, where found, that function called on args (the last len(kwnames) of them
// by those names) and its result returned. A key not in the table returns the key (bytes), none returns None: the
// Python path decides (the functions in a table never return bytes or None).
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

// The key of (op, *args) in k; false where an argument cannot be encoded.
bool fill(KeyBuffer& k, PyObject* const* args, Py_ssize_t nargs) {
  k.tag(c10::GradMode::is_enabled() ? 1 : 0);
  bool asked = false;
  for (Py_ssize_t i = 0; i < nargs; ++i)
    if (!put_arg(k, args[i], asked)) return false;
  return true;
}

PyObject* call_key(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  KeyBuffer k;
  if (!fill(k, args, nargs)) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize(k.data, static_cast<Py_ssize_t>(k.n));
}

PyObject* call_cached(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 3 || !PyDict_Check(args[0]) || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) > nargs - 3) {
    PyErr_SetString(PyExc_TypeError, "call_cached(table: dict, kwnames: tuple, op: str, *args)");
    return nullptr;
  }
  KeyBuffer k;
  if (!fill(k, args + 2, nargs - 2)) Py_RETURN_NONE;
  PyObject* key = PyBytes_FromStringAndSize(k.data, static_cast<Py_ssize_t>(k.n));
  if (key == nullptr) return nullptr;
  PyObject* fn = PyDict_GetItemWithError(args[0], key);  // borrowed
  if (fn == nullptr) {
    if (!PyErr_Occurred()) return key;
    Py_DECREF(key);
    return nullptr;
  }
  Py_DECREF(key);
  Py_INCREF(fn);  // the call may drop the table's entry
  const Py_ssize_t nkw = PyTuple_GET_SIZE(args[1]);
  PyObject* out = PyObject_Vectorcall(fn, args + 3, static_cast<size_t>(nargs - 3 - nkw), nkw ? args[1] : nullptr);
  Py_DECREF(fn);
  return out;
}

PyMethodDef call_key_def = {"call_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_key)),
                            METH_FASTCALL,
                            "call_key(op, *args) -> bytes | None: the per-call key of tiered_ops.<op>(*args)"};

PyMethodDef call_cached_def = {
    "call_cached", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_cached)), METH_FASTCALL,
    "call_cached(table, kwnames, op, *args): table[key](*args) where key = call_key(op, *args) is in table, else key"};

}  // namespace

namespace tiered_ops {

// Plain CPython functions (METH_FASTCALL: no argument tuple, no pybind11 conversion on the per-call path).
PyObject* call_key_function() { return PyCFunction_New(&call_key_def, nullptr); }
PyObject* call_cached_function() { return PyCFunction_New(&call_cached_def, nullptr); }

}  // namespace tiered_ops
