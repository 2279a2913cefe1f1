// The key of a call of tiered_ops.<op> read in C++: one byte string of everything the op's Python key reads (each
// tensor's shape, dtype, device; the other arguments' values), plus grad mode and each tensor's requires_grad, built
// without a Python object per attribute. The per-call path looks its selection up by it
// (tiered_ops/runtime/dispatch.py) and falls back to the Python key wherever this returns None: an argument of a type
// not encoded here, an integer past 64 bits, a key past the buffer, or a CUDA tensor while its stream captures a graph
// (the capture context is decided in Python), or a tensor that is traced (a Python-dispatched one: fake, functional;
// symbolic sizes). Two calls with the same bytes have the same Python key: this key only ever holds more.
//
// call_cached(table, kwnames, op, *args) is the per-call path's hit in one C call: the key of (op, *args) looked up in
// `table` (a dict of key -> function) and, where found, that function called on args (the last len(kwnames) of them
// by those names) and its result returned. A key not in the table returns the key (bytes), none returns None: the
// Python path decides (the functions in a table never return bytes or None).
//
// fast_path(func, table, op, params, defaults, required, kwnames, compiler) gives the Python function `func` (the
// generated tiered_ops.<op>, or a select_backend class's __call__ where table is that class: self._seen is the table,
// and the class's instances are called straight into it) a
// C vectorcall that does what its hot path does, without its frame: the compiler module's _is_compiling_flag false,
// the arguments bound to `params` (defaults[i] where not given; `required` marks none) for the key, then call_cached's
// lookup, and what it finds called with the arguments as given; anything else (a miss, a trace, arguments that do not
// bind) runs the function's own code, which decides as before. Dynamo traces the function's code (it never calls the
// vectorcall). fast_path(func, None) puts the function's own vectorcall back. CPython honours a function's vectorcall
// at every call site from 3.12 on; before, a call from Python code runs the function's code directly (the same path,
// slower), a call through C (star arguments, a class's __call__) takes it.
//
// The encoding of the key: call_key.h; the C-side cache a hit reads first: call_cache.h.
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "call_cache.h"
#include "call_key.h"

namespace call_cache = tiered_ops::call_cache;
using namespace tiered_ops::key_encoding;  // NOLINT: the encoding is this file's own

namespace {

// The function cached in `table` under k's bytes (a new reference), or nullptr: not there (then *key, where asked,
// holds the key made, a new reference) or an error set.
PyObject* lookup(PyObject* table, const KeyBuffer& k, PyObject** key = nullptr) {
  PyObject* bytes = PyBytes_FromStringAndSize(k.data, static_cast<Py_ssize_t>(k.n));
  if (bytes == nullptr) return nullptr;
  PyObject* fn = PyDict_GetItemWithError(table, bytes);  // borrowed
  Py_XINCREF(fn);  // the call may drop the table's entry
  if (fn == nullptr && key != nullptr && !PyErr_Occurred())
    *key = bytes;
  else
    Py_DECREF(bytes);
  return fn;
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
  PyObject* key = nullptr;
  PyObject* fn = lookup(args[0], k, &key);
  if (fn == nullptr) return key;  // a miss: the key; nullptr: an error set
  const Py_ssize_t nkw = PyTuple_GET_SIZE(args[1]);
  PyObject* out = PyObject_Vectorcall(fn, args + 3, static_cast<size_t>(nargs - 3 - nkw), nkw ? args[1] : nullptr);
  Py_DECREF(fn);
  return out;
}

// A function given the fast path: what its hot path reads, bound once.
constexpr Py_ssize_t kMaxParams = 16;
constexpr size_t kEncoded = 160;
struct Fast {  // what every hit reads first, then the defaults, then the names (read only for keywords)
  PyObject* func = nullptr;  // the references below are owned (released when the fast path is taken away)
  vectorcallfunc own = nullptr;  // the function's own vectorcall
  PyObject* table = nullptr;  // nullptr: self._seen of a method's first argument
  PyObject* cls = nullptr;  // a method's class, whose instances' calls come here directly (class_call)
  PyObject* op = nullptr;
  PyObject* flags = nullptr;  // the compiler module's __dict__
  Py_ssize_t nparams = 0, npositional = 0;  // all, and those before the keyword-only ones
  // The key's bytes of the op's name, encoded[0, at[0]), and of default i, encoded[at[i], at[i + 1]) where it was
  // encoded once (an immutable value of an encoded type; empty: read from defaults[i] on each call), so a hit does
  // not read those objects.
  uint16_t at[kMaxParams + 1] = {};
  char encoded[kEncoded] = {};
  PyObject* defaults[kMaxParams] = {};  // nullptr: required
  PyObject* names[kMaxParams] = {};
};
std::vector<std::pair<PyObject*, Fast*>> fast_functions;  // (func, its Fast): one contiguous run to scan
std::vector<std::pair<PyObject*, Fast*>> fast_classes;  // (a method's class, its Fast)
ternaryfunc python_call = nullptr;  // what a Python class's tp_call was (CPython's __call__ slot) before class_call
PyObject* compiling_flag = nullptr;  // "_is_compiling_flag"
PyObject* seen_name = nullptr;  // "_seen"

Fast* find_fast(PyObject* func) {
  for (const auto& [fn, f] : fast_functions)
    if (fn == func) return f;
  return nullptr;
}

// The key of a call bound to f's parameters (arg[i] nullptr: parameter i takes its default): the bytes fill() makes
// of (op, every argument), the op's and the defaults' from f's encoding where it has them.
bool fill_bound(KeyBuffer& k, const Fast* f, PyObject* const* arg) {
  if (!k.tag(c10::GradMode::is_enabled() ? 1 : 0) || !k.put(f->encoded, f->at[0])) return false;
  bool asked = false;
  for (Py_ssize_t i = 0; i < f->nparams; ++i) {
    if (arg[i] != nullptr) {
      if (!put_arg(k, arg[i], asked)) return false;
    } else if (f->at[i + 1] > f->at[i]) {
      if (!k.put(f->encoded + f->at[i], f->at[i + 1] - f->at[i])) return false;
    } else if (f->defaults[i] == nullptr || !put_arg(k, f->defaults[i], asked)) {
      return false;  // a required parameter not given: the function's own code raises
    }
  }
  return true;
}

// f's encoding of its op's name and of each default that is an immutable value of an encoded type; false where the
// name does not fit (the fast path is then not given).
bool encode_once(Fast* f) {
  KeyBuffer k;
  bool asked = false;
  if (!put_arg(k, f->op, asked) || k.n > kEncoded) return false;
  std::memcpy(f->encoded, k.data, k.n);
  size_t n = f->at[0] = static_cast<uint16_t>(k.n);
  for (Py_ssize_t i = 0; i < f->nparams; ++i) {
    PyObject* d = f->defaults[i];
    KeyBuffer one;
    const bool fixed = d != nullptr && (d == Py_None || PyBool_Check(d) || PyLong_CheckExact(d) ||
                                        PyFloat_CheckExact(d) || PyUnicode_CheckExact(d) || THPDtype_Check(d));
    if (fixed && put_arg(one, d, asked) && n + one.n <= kEncoded) {
      std::memcpy(f->encoded + n, one.data, one.n);
      n += one.n;
    }
    f->at[i + 1] = static_cast<uint16_t>(n);
  }
  return true;
}

// Whether dynamo traces: the compiler module's flag, from the cache where it holds it, else read.
bool compiling_now(PyObject* flags) {
  const int known = call_cache::compiling(flags);
  if (known >= 0) return known != 0;
  PyObject* flag = PyDict_GetItemWithError(flags, compiling_flag);  // borrowed
  PyErr_Clear();
  return flag != Py_False;
}

// f's hot path for a call of its function (callable) with args.
PyObject* hot_call(const Fast* f, PyObject* callable, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  if (compiling_now(f->flags)) return f->own(callable, args, nargsf, kwnames);
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  PyObject* const* given = args;
  PyObject* table = f->table;
  PyObject* self = nullptr;  // a method's first argument: its self._seen is the table, read only on a miss
  if (table == nullptr) {
    if (nargs < 1) return f->own(callable, args, nargsf, kwnames);
    self = args[0];
    ++given;
    --nargs;
  }
  // bound as the function binds them: arg[i] what parameter i is given (nullptr: its default)
  PyObject* arg[kMaxParams] = {};
  bool bound = nargs <= f->npositional;
  for (Py_ssize_t i = 0; bound && i < nargs; ++i) arg[i] = given[i];
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t j = 0; bound && j < nkw; ++j) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, j);
    Py_ssize_t at = -1;
    for (Py_ssize_t i = 0; i < f->nparams && at < 0; ++i)
      if (f->names[i] == name || PyUnicode_Compare(f->names[i], name) == 0) at = i;
    bound = at >= 0 && arg[at] == nullptr;
    if (bound) arg[at] = given[nargs + j];
  }
  KeyBuffer k;
  PyObject* fn = nullptr;
  if (bound && fill_bound(k, f, arg)) {
    PyObject* owner = self != nullptr ? self : table;
    uint64_t hash = 0;
    fn = call_cache::find(owner, k.data, k.n, &hash);
    if (fn != nullptr) {
      Py_INCREF(fn);  // the call may drop the table's entry
    } else {
      PyObject* seen = self != nullptr ? PyObject_GetAttr(self, seen_name) : Py_NewRef(table);
      if (seen != nullptr && PyDict_Check(seen) && (fn = lookup(seen, k)) != nullptr)
        call_cache::put(owner, seen, k.data, k.n, hash, fn);
      Py_XDECREF(seen);
    }
  }
  if (fn == nullptr) {
    PyErr_Clear();
    return f->own(callable, args, nargsf, kwnames);
  }
  // the arguments as the caller gave them: every implementation takes the op's signature, its defaults included
  // (a keyword passed on costs each of its wrappers a dict)
  PyObject* out = PyObject_Vectorcall(fn, given, static_cast<size_t>(nargs), kwnames);
  Py_DECREF(fn);
  return out;
}

PyObject* fast_call(PyObject* callable, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const Fast* f = find_fast(callable);
  if (f == nullptr) {  // taken away while a caller held a vectorcall pointer: the generic path
    return _PyFunction_Vectorcall(callable, args, nargsf, kwnames);
  }
  return hot_call(f, callable, args, nargsf, kwnames);
}

// An instance of a fast method's class called: what CPython's __call__ slot would do (find __call__ on the type, put
// self before the arguments, call it), without the lookup; keyword arguments take that slot.
PyObject* class_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  const Fast* f = nullptr;
  for (const auto& [c, cf] : fast_classes)
    if (c == reinterpret_cast<PyObject*>(Py_TYPE(self))) f = cf;
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  if (f == nullptr || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) > 0) || n >= kMaxParams)
    return python_call(self, args, kwargs);
  PyObject* stack[kMaxParams + 1];
  stack[0] = self;
  for (Py_ssize_t i = 0; i < n; ++i) stack[i + 1] = PyTuple_GET_ITEM(args, i);
  return hot_call(f, f->func, stack, static_cast<size_t>(n + 1), nullptr);
}

void release(Fast* f) {
  if (f->cls != nullptr) {
    auto* type = reinterpret_cast<PyTypeObject*>(f->cls);
    if (type->tp_call == class_call) type->tp_call = python_call;
    const auto at = std::find(fast_classes.begin(), fast_classes.end(), std::make_pair(f->cls, f));
    if (at != fast_classes.end()) fast_classes.erase(at);
    Py_DECREF(f->cls);
  }
  Py_XDECREF(f->func);
  Py_XDECREF(f->table);
  Py_XDECREF(f->op);
  Py_XDECREF(f->flags);
  for (Py_ssize_t i = 0; i < f->nparams; ++i) {
    Py_XDECREF(f->names[i]);
    Py_XDECREF(f->defaults[i]);
  }
  delete f;
}

void set_vectorcall(PyObject* func, vectorcallfunc v) {
#if PY_VERSION_HEX >= 0x030C0000
  PyFunction_SetVectorcall(reinterpret_cast<PyFunctionObject*>(func), v);
#else
  reinterpret_cast<PyFunctionObject*>(func)->vectorcall = v;
#endif
}

// The class's instances called through class_call, where the class's __call__ is f's function and its call slot is
// CPython's own (the first such class tells which that is).
void give_class_call(Fast* f, PyObject* cls) {
  auto* type = reinterpret_cast<PyTypeObject*>(cls);
  PyObject* call = PyObject_GetAttrString(cls, "__call__");
  const bool own = call == f->func && (python_call == nullptr || type->tp_call == python_call);
  Py_XDECREF(call);
  PyErr_Clear();
  if (!own || type->tp_call == nullptr || type->tp_call == class_call || !(type->tp_flags & Py_TPFLAGS_HEAPTYPE))
    return;
  python_call = type->tp_call;
  f->cls = Py_NewRef(cls);
  fast_classes.emplace_back(cls, f);
  type->tp_call = class_call;
}

// fast_path(func, None) or fast_path(func, table, op, params, defaults, required, kwnames, compiler) -> bool: whether
// func now has the fast path. table: a dict, or the class whose __call__ func is (self._seen is the table; the class's
// instances are then called through class_call, where the class still has CPython's own __call__ slot).
PyObject* fast_path(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || !PyFunction_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "fast_path(func: function, table: dict | type | None, ...)");
    return nullptr;
  }
  PyObject* func = args[0];
  if (Fast* old = find_fast(func)) {  // taken away first (given again below where asked)
    set_vectorcall(func, old->own);
    fast_functions.erase(std::find(fast_functions.begin(), fast_functions.end(), std::make_pair(func, old)));
    release(old);
  }
  if (nargs == 2 && args[1] == Py_None) Py_RETURN_FALSE;
  if (nargs != 8 || !(PyType_Check(args[1]) || PyDict_Check(args[1])) || !PyUnicode_Check(args[2]) ||
      !PyTuple_Check(args[3]) || !PyTuple_Check(args[4]) || !PyTuple_Check(args[6]) || !PyModule_Check(args[7]) ||
      PyTuple_GET_SIZE(args[3]) != PyTuple_GET_SIZE(args[4]) || PyTuple_GET_SIZE(args[3]) > kMaxParams ||
      PyTuple_GET_SIZE(args[6]) > PyTuple_GET_SIZE(args[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "fast_path(func, table: dict | type, op: str, params: tuple[str], defaults: tuple (aligned), "
                    "required: object, kwnames: tuple[str] (the tail of params), compiler: module)");
    return nullptr;
  }
  if (compiling_flag == nullptr) {
    compiling_flag = PyUnicode_InternFromString("_is_compiling_flag");
    seen_name = PyUnicode_InternFromString("_seen");
    if (compiling_flag == nullptr || seen_name == nullptr) return nullptr;
  }
  auto* f = new Fast;
  f->own = reinterpret_cast<PyFunctionObject*>(func)->vectorcall;
  f->func = Py_NewRef(func);
  const bool method = PyType_Check(args[1]);
  f->table = method ? nullptr : Py_NewRef(args[1]);
  f->op = Py_NewRef(args[2]);
  f->flags = Py_NewRef(PyModule_GetDict(args[7]));
  f->nparams = PyTuple_GET_SIZE(args[3]);
  f->npositional = f->nparams - PyTuple_GET_SIZE(args[6]);
  for (Py_ssize_t i = 0; i < f->nparams; ++i) {
    PyObject* d = PyTuple_GET_ITEM(args[4], i);
    f->names[i] = Py_NewRef(PyTuple_GET_ITEM(args[3], i));
    f->defaults[i] = d == args[5] ? nullptr : Py_NewRef(d);
  }
  if (!encode_once(f)) {
    release(f);
    Py_RETURN_FALSE;
  }
  fast_functions.emplace_back(func, f);
  call_cache::start(f->flags, compiling_flag);
  set_vectorcall(func, fast_call);
  if (method) give_class_call(f, args[1]);
  Py_RETURN_TRUE;
}

PyMethodDef call_key_def = {"call_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_key)),
                            METH_FASTCALL,
                            "call_key(op, *args) -> bytes | None: the per-call key of tiered_ops.<op>(*args)"};

PyMethodDef call_cached_def = {
    "call_cached", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_cached)), METH_FASTCALL,
    "call_cached(table, kwnames, op, *args): table[key](*args) where key = call_key(op, *args) is in table, else key"};

PyMethodDef fast_path_def = {
    "fast_path", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_path)), METH_FASTCALL,
    "fast_path(func, table, op, params, defaults, required, kwnames, compiler): func's hot path in C; "
    "fast_path(func, None): its own again"};

}  // namespace

namespace tiered_ops {

// Plain CPython functions (METH_FASTCALL: no argument tuple, no pybind11 conversion on the per-call path).
PyObject* call_key_function() { return PyCFunction_New(&call_key_def, nullptr); }
PyObject* call_cached_function() { return PyCFunction_New(&call_cached_def, nullptr); }
PyObject* fast_path_function() { return PyCFunction_New(&fast_path_def, nullptr); }

}  // namespace tiered_ops
