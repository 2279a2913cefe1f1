// What the C fast path of tiered_ops.<op> reads on a hit, kept where a cold cache pays least (call_key.cpp).
//
// A hit looked its function up in a Python dict (dispatch.py's _hot, or a select_backend callable's _seen: key
// bytes -> function): a bytes object made for the call, hashed with SipHash, then the dict's index, its entry and the
// stored key compared. After an implementation whose own work evicts the CPU caches (a few ATen ops do), each of those
// is a miss (benchmarks/PERF_LOG.md has the figures). This cache holds (owner, key bytes) -> function in one array (a
// slot: one contiguous run of lines), and the compiler module's _is_compiling_flag as one int. The owner is the table
// itself, or for a select_backend callable the callable (so a hit does not read its _seen through the instance).
//
// Exactness comes from dict watchers (Python 3.12+): every table a slot came from is watched, and so is the __dict__ of
// every callable that owns a slot; any change to a watched dict (an entry added, replaced, deleted, the dict cleared or
// freed) makes every slot stale before the change takes effect, so a slot's borrowed function is always one its table
// still holds, and an owner's slot never outlives its _seen binding or the owner itself. (Not caught: a callable's
// __dict__ replaced while the old one is kept alive elsewhere.) The flag is updated from the
// compiler module's dict the same way; it is "unknown" (the dict is read) after anything but an assignment. Before
// 3.12, with no watcher free, or in a free-threaded build (the state here relies on the GIL), nothing is cached: every
// call reads the dicts as before.
#pragma once

#include <Python.h>

#include <cstdint>
#include <cstring>

#if PY_VERSION_HEX >= 0x030C0000 && !defined(Py_GIL_DISABLED)
#define TIERED_OPS_CALL_CACHE 1
#endif

namespace tiered_ops::call_cache {

constexpr size_t kSlots = 256;  // a power of two
constexpr size_t kKeyBytes = 216;  // a longer key is not cached (the dict serves it)

struct alignas(64) Slot {
  uint64_t gen = 0;  // the generation it was filled in (stale when the state's has moved on)
  uint64_t hash = 0;
  PyObject* owner = nullptr;  // borrowed: the table, or the callable whose _seen it is
  PyObject* fn = nullptr;  // borrowed: held by the table for as long as the generation holds
  uint64_t n = 0;
  char key[kKeyBytes];
};

struct State {
  int watcher = -1;  // none: nothing cached
  uint64_t gen = 1;
  PyObject* flags = nullptr;  // the compiler module's dict (watched; borrowed: forgotten when it is freed)
  PyObject* flag_name = nullptr;  // owned
  int compiling = -1;  // -1: unknown (read the dict), 0: the flag is False, 1: anything else
  Slot slots[kSlots];
};

inline State& state() {
  static State s;
  return s;
}

inline uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    h = (h ^ v) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  uint64_t tail = 0;
  std::memcpy(&tail, p + i, n - i);
  h = (h ^ tail) * 0xc4ceb9fe1a85ec53ull;
  return h ^ (h >> 29);
}

#ifdef TIERED_OPS_CALL_CACHE
inline int on_dict_event(PyDict_WatchEvent event, PyObject* dict, PyObject* key, PyObject* new_value) {
  State& s = state();
  if (dict != s.flags) {
    ++s.gen;  // a table changes: every slot stale
    return 0;
  }
  if (event == PyDict_EVENT_DEALLOCATED) {
    s.flags = nullptr;
    s.compiling = -1;
    return 0;
  }
  // (a module dict's keys are str: comparing two raises nothing)
  const bool flag = key != nullptr && (key == s.flag_name || (PyUnicode_CheckExact(key) &&
                                                              PyUnicode_Compare(key, s.flag_name) == 0));
  if (event == PyDict_EVENT_ADDED || event == PyDict_EVENT_MODIFIED) {
    if (flag) s.compiling = new_value == Py_False ? 0 : 1;
  } else if (flag || key == nullptr) {  // the flag deleted, the dict cleared or cloned over
    s.compiling = -1;
  }
  return 0;
}
#endif

// Once: a watcher, and the compiler module's dict `flags` watched for `name`. Nothing is cached where this fails.
inline void start(PyObject* flags, PyObject* name) {
#ifdef TIERED_OPS_CALL_CACHE
  State& s = state();
  if (s.watcher >= 0 || s.flag_name != nullptr) return;
  s.flag_name = Py_NewRef(name);
  const int w = PyDict_AddWatcher(on_dict_event);
  if (w < 0 || PyDict_Watch(w, flags) < 0) {
    PyErr_Clear();
    if (w >= 0) PyDict_ClearWatcher(w);
    return;
  }
  s.watcher = w;
  s.flags = flags;
  PyObject* v = PyDict_GetItemWithError(flags, name);  // borrowed
  PyErr_Clear();
  s.compiling = v == nullptr ? -1 : v == Py_False ? 0 : 1;
#else
  (void)flags;
  (void)name;
#endif
}

// The compiler module's flag: -1 unknown (read its dict), 0 False, 1 anything else.
inline int compiling(PyObject* flags) {
  const State& s = state();
  return s.flags == flags ? s.compiling : -1;
}

// The function cached for (owner, key) (borrowed), or nullptr; *hash: what put() takes for the same pair.
inline PyObject* find(PyObject* owner, const char* key, size_t n, uint64_t* hash) {
  State& s = state();
  if (s.watcher < 0 || n > kKeyBytes) return nullptr;
  const uint64_t h = hash_bytes(key, n) ^ (reinterpret_cast<uintptr_t>(owner) * 0x9E3779B97F4A7C15ull);
  *hash = h;
  for (size_t probe = 0; probe < 2; ++probe) {
    const Slot& slot = s.slots[(h + probe) & (kSlots - 1)];
    if (slot.gen == s.gen && slot.hash == h && slot.owner == owner && slot.n == n &&
        std::memcmp(slot.key, key, n) == 0)
      return slot.fn;
  }
  return nullptr;
}

// Keep fn (found in table under key, hash from find() for (owner, key)) for the next calls. The table is watched from
// now on, and where the owner is a callable (not the table), its __dict__ too (made where its attributes were inline).
inline void put(PyObject* owner, PyObject* table, const char* key, size_t n, uint64_t hash, PyObject* fn) {
#ifdef TIERED_OPS_CALL_CACHE
  State& s = state();
  if (s.watcher < 0 || n > kKeyBytes) return;
  PyObject* attrs = owner == table ? nullptr : PyObject_GenericGetDict(owner, nullptr);  // a new reference
  const bool watched = PyDict_Watch(s.watcher, table) == 0 &&
                       (owner == table || (attrs != nullptr && PyDict_Watch(s.watcher, attrs) == 0));
  Py_XDECREF(attrs);  // the owner holds it
  if (!watched) {
    PyErr_Clear();
    return;
  }
  Slot* slot = &s.slots[hash & (kSlots - 1)];
  if (slot->gen == s.gen) slot = &s.slots[(hash + 1) & (kSlots - 1)];  // the second way, replaced when both are live
  slot->gen = s.gen;
  slot->hash = hash;
  slot->owner = owner;
  slot->fn = fn;
  slot->n = n;
  std::memcpy(slot->key, key, n);
#else
  (void)owner, (void)table, (void)key, (void)n, (void)hash, (void)fn;
#endif
}

}  // namespace tiered_ops::call_cache
