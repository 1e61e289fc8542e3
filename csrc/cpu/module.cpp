// The CPU backend's functions of the rnnkern._C module (module.h): the buffer
// cache, the ISA level and vector width of the kernels, the count of
// parallel regions, for rnnkern.ops and the tests; and the runner of two
// calls at once (a bidirectional layer's directions, rnnkern/modules).
#include "../module.h"

#include <ATen/ThreadLocalState.h>

#include <string>

#include "buffers.h"
#include "gemm.h"
#include "isa.h"
#include "pairs.h"
#include "parallel.h"
#include "schedule.h"

namespace rnnkern::cpu {
namespace {

PyObject* empty_cpu_cache(PyObject*, PyObject*) {
  return PyLong_FromLongLong(empty_cache());
}

// The x86 ISA level the CPU kernels' vectorised loops run at in this process:
// the level a pinned build (RNNKERN_CPU_ISA) was compiled for, else the clone
// target_clones picks on this CPU.
PyObject* cpu_isa(PyObject*, PyObject*) {
#if defined(RNNKERN_CPU_ISA)
  return PyUnicode_FromString(RNNKERN_STRINGIFY(RNNKERN_CPU_ISA));
#elif defined(RNNKERN_CPU_DISPATCH)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return PyUnicode_FromString("x86-64-v4");
  if (__builtin_cpu_supports("x86-64-v3")) return PyUnicode_FromString("x86-64-v3");
  return PyUnicode_FromString("x86-64");
#else
  return PyUnicode_FromString("native");  // one version, compiled for the build's target
#endif
}

// The width of the CPU products' vectors in this process (gemm.h): 512 on
// CPUs with AVX-512 unless RNNKERN_CPU_VECTOR_BITS=256, else 256.
PyObject* cpu_vector_bits(PyObject*, PyObject*) {
  return PyLong_FromLong(gemm::wide_vectors() ? 512 : 256);
}

// The width of the cores' FMA pipes as rnnkern tells them apart (gemm.h).
PyObject* cpu_fma_pipe_bits(PyObject*, PyObject*) {
  return PyLong_FromLong(gemm::fma_pipe_bits());
}

// FLOP/s of the calling thread's float32 multiply-adds (gemm::fma_rate).
PyObject* cpu_fma_rate(PyObject*, PyObject* arg) {
  const long long iterations = PyLong_AsLongLong(arg);
  if (iterations == -1 && PyErr_Occurred()) return nullptr;
  if (iterations <= 0) {
    PyErr_Format(PyExc_ValueError, "cpu_fma_rate: iterations must be positive, got %lld", iterations);
    return nullptr;
  }
  double rate = 0;
  Py_BEGIN_ALLOW_THREADS
  rate = gemm::fma_rate(iterations);
  Py_END_ALLOW_THREADS
  return PyFloat_FromDouble(rate);
}

// How bfloat16 products run in this process (pairs.h): "native" (the
// AVX512_BF16 dot-product instruction), "emulated" (its portable emulation,
// for tests), "amx" (AMX's tiles), "amx_emulated" (the tile driver on
// emulated tiles, for tests) or "float32".
const char* const kBf16Modes[] = {"float32", "native", "emulated", "amx", "amx_emulated"};
constexpr int kBf16ModeCount = sizeof(kBf16Modes) / sizeof(kBf16Modes[0]);

PyObject* cpu_bf16_products(PyObject*, PyObject*) {
  return PyUnicode_FromString(kBf16Modes[static_cast<int>(pairs::mode())]);
}

// Sets it; "native" and "amx" raise where the CPU, the build or the OS
// lacks them.
PyObject* set_cpu_bf16_products(PyObject*, PyObject* arg) {
  const char* want = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : nullptr;
  for (int m = 0; want != nullptr && m < kBf16ModeCount; ++m) {
    if (std::string(want) != kBf16Modes[m]) continue;
    if (!pairs::set_mode(static_cast<pairs::Mode>(m))) {
      PyErr_SetString(PyExc_RuntimeError,
                      static_cast<pairs::Mode>(m) == pairs::Mode::Tiles
                          ? "set_cpu_bf16_products: 'amx' needs a CPU with AMX-BF16, a Linux that "
                            "grants the process AMX's tile state, and a build with the 512-bit "
                            "kernels"
                          : "set_cpu_bf16_products: 'native' needs a CPU with AVX512_BF16 and a "
                            "build with the 512-bit kernels");
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  PyErr_SetString(PyExc_ValueError,
                  "set_cpu_bf16_products: expected 'float32', 'native', 'emulated', 'amx' or "
                  "'amx_emulated'");
  return nullptr;
}

PyObject* cpu_parallel_regions(PyObject*, PyObject*) {
  return PyLong_FromLongLong(parallel_regions.load());
}

// The Python error of a call, fetched (owned) so that another may run meanwhile;
// dropped or restored with the GIL held.
struct FetchedError {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject* exception = nullptr;
  void fetch() { exception = PyErr_GetRaisedException(); }
  bool set() const { return exception != nullptr; }
  void restore() {  // gives the reference back to Python as the current error
    PyErr_SetRaisedException(exception);
    exception = nullptr;
  }
  void drop() { Py_CLEAR(exception); }
#else
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  void fetch() { PyErr_Fetch(&type, &value, &traceback); }
  bool set() const { return type != nullptr; }
  void restore() {  // gives the references back to Python as the current error
    PyErr_Restore(type, value, traceback);
    type = value = traceback = nullptr;
  }
  void drop() {
    Py_CLEAR(type);
    Py_CLEAR(value);
    Py_CLEAR(traceback);
  }
#endif
};

// run_concurrently(a, b) -> (a(), b()): the two calls at once, as the two
// workers of a parallel region of torch's own threads (a() on this thread).
// Two recurrences that each keep one core busy (a bidirectional layer's
// directions at a small batch: a step too small to split between threads)
// then take the time of one.  torch's threads, not one of our own: a thread
// beside them met torch's worker still spinning after the region before
// (libgomp spins a while before it sleeps) and ran at half speed.  Inside,
// every kernel's own parallel loop runs on its one thread (ATen runs a
// nested parallel_for inline), so each call's results are the bits it gives
// alone.  The worker runs with this thread's thread-local state (grad and
// inference mode, autocast, the dispatch keys and modes: at::ThreadLocalState,
// as at::launch passes it on); each call holds the GIL only between ops.  An
// error of either is raised after both have finished (a()'s first).
PyObject* run_concurrently(PyObject*, PyObject* args) {
  PyObject *a, *b;
  if (!PyArg_ParseTuple(args, "OO:run_concurrently", &a, &b)) return nullptr;
  if (!PyCallable_Check(a) || !PyCallable_Check(b)) {
    PyErr_SetString(PyExc_TypeError, "run_concurrently: a and b must be callables");
    return nullptr;
  }
  const at::ThreadLocalState state;
  PyObject* calls[2] = {a, b};
  PyObject* results[2] = {nullptr, nullptr};
  FetchedError errors[2];
  Py_BEGIN_ALLOW_THREADS
  for_each_worker(2, [&](int64_t t) {
    at::ThreadLocalStateGuard guard(state);
    const PyGILState_STATE gil = PyGILState_Ensure();
    results[t] = PyObject_CallNoArgs(calls[t]);
    if (results[t] == nullptr) errors[t].fetch();
    PyGILState_Release(gil);
  });
  Py_END_ALLOW_THREADS
  if (errors[0].set() || errors[1].set()) {
    Py_XDECREF(results[0]);
    Py_XDECREF(results[1]);
    const int first = errors[0].set() ? 0 : 1;
    errors[1 - first].drop();
    errors[first].restore();
    return nullptr;
  }
  PyObject* both = PyTuple_Pack(2, results[0], results[1]);
  Py_DECREF(results[0]);
  Py_DECREF(results[1]);
  return both;
}

// cpu_recurrence_threads(cell, B, H, P, elem_bytes) -> the threads a
// recurrence of these sizes runs its steps on (schedule.h's Split, at torch's
// thread count): whether a bidirectional layer's directions gain from
// running at once (rnnkern/modules: each gets one thread there).
PyObject* cpu_recurrence_threads(PyObject*, PyObject* args) {
  const char* cell;
  long long B, H, P, elem_bytes;
  if (!PyArg_ParseTuple(args, "sLLLL:cpu_recurrence_threads", &cell, &B, &H, &P, &elem_bytes)) {
    return nullptr;
  }
  try {
    const Cell c = parse_cell(cell);
    const RecurrenceSizes z{c, 1, B, H, P, gate_count(c), P != H};
    return PyLong_FromSize_t(Split(z, size_t(elem_bytes)).unit_workers());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

const ModuleFunctions functions({
    {"cpu_recurrence_threads", cpu_recurrence_threads, METH_VARARGS,
     "cpu_recurrence_threads(cell, B, H, P, elem_bytes): the threads a CPU recurrence of these "
     "sizes runs its steps on at torch's thread count."},
    {"run_concurrently", run_concurrently, METH_VARARGS,
     "run_concurrently(a, b) -> (a(), b()): the two calls at once on two of torch's threads, "
     "with this thread's autograd and dispatch state; an error of either is raised after both "
     "finish."},
    {"empty_cpu_cache", empty_cpu_cache, METH_NOARGS,
     "Returns the CPU buffers cached by rnnkern to the system; the bytes released."},
    {"cpu_isa", cpu_isa, METH_NOARGS,
     "The x86 ISA level of the CPU kernels' vectorised loops in this process."},
    {"cpu_vector_bits", cpu_vector_bits, METH_NOARGS,
     "The vector width (bits) of the CPU kernels' products in this process."},
    {"cpu_fma_pipe_bits", cpu_fma_pipe_bits, METH_NOARGS,
     "The width (bits) of the cores' FMA pipes as rnnkern tells them apart: 512 on AMD's server "
     "and desktop Zen 5, 256 elsewhere; RNNKERN_CPU_FMA_BITS overrides."},
    {"cpu_fma_rate", cpu_fma_rate, METH_O,
     "FLOP/s of `iterations` rounds of float32 multiply-adds on the calling thread, in the "
     "vectors the CPU products use: the core's FMA peak at its running clock."},
    {"cpu_parallel_regions", cpu_parallel_regions, METH_NOARGS,
     "The number of parallel regions rnnkern's CPU kernels have opened in this process."},
    {"cpu_bf16_products", cpu_bf16_products, METH_NOARGS,
     "How the CPU kernels multiply bfloat16 operands: 'native', 'emulated' or 'float32'."},
    {"set_cpu_bf16_products", set_cpu_bf16_products, METH_O,
     "Sets how the CPU kernels multiply bfloat16 operands ('native', 'emulated', 'float32')."},
});

}  // namespace
}  // namespace rnnkern::cpu
