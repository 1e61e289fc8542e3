// The CPU backend's functions of the rnnkern._C module (module.h): the buffer
// cache, the ISA level and vector width of the kernels, and the count of
// parallel regions, for rnnkern.ops and the tests.
#include "../module.h"

#include <string>

#include "buffers.h"
#include "gemm.h"
#include "isa.h"
#include "pairs.h"
#include "parallel.h"

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

// How bfloat16 products run in this process (pairs.h): "native" (the
// AVX512_BF16 dot-product instruction), "emulated" (its portable emulation,
// for tests) or "float32".
const char* const kBf16Modes[] = {"float32", "native", "emulated"};

PyObject* cpu_bf16_products(PyObject*, PyObject*) {
  return PyUnicode_FromString(kBf16Modes[static_cast<int>(pairs::mode())]);
}

// Sets it; "native" raises where the CPU or the build lacks the instruction.
PyObject* set_cpu_bf16_products(PyObject*, PyObject* arg) {
  const char* want = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : nullptr;
  for (int m = 0; want != nullptr && m < 3; ++m) {
    if (std::string(want) != kBf16Modes[m]) continue;
    if (!pairs::set_mode(static_cast<pairs::Mode>(m))) {
      PyErr_SetString(PyExc_RuntimeError,
                      "set_cpu_bf16_products: 'native' needs a CPU with AVX512_BF16 and a build "
                      "with the 512-bit kernels");
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  PyErr_SetString(PyExc_ValueError,
                  "set_cpu_bf16_products: expected 'float32', 'native' or 'emulated'");
  return nullptr;
}

PyObject* cpu_parallel_regions(PyObject*, PyObject*) {
  return PyLong_FromLongLong(parallel_regions.load());
}

const ModuleFunctions functions({
    {"empty_cpu_cache", empty_cpu_cache, METH_NOARGS,
     "Returns the CPU buffers cached by rnnkern to the system; the bytes released."},
    {"cpu_isa", cpu_isa, METH_NOARGS,
     "The x86 ISA level of the CPU kernels' vectorised loops in this process."},
    {"cpu_vector_bits", cpu_vector_bits, METH_NOARGS,
     "The vector width (bits) of the CPU kernels' products in this process."},
    {"cpu_parallel_regions", cpu_parallel_regions, METH_NOARGS,
     "The number of parallel regions rnnkern's CPU kernels have opened in this process."},
    {"cpu_bf16_products", cpu_bf16_products, METH_NOARGS,
     "How the CPU kernels multiply bfloat16 operands: 'native', 'emulated' or 'float32'."},
    {"set_cpu_bf16_products", set_cpu_bf16_products, METH_O,
     "Sets how the CPU kernels multiply bfloat16 operands ('native', 'emulated', 'float32')."},
});

}  // namespace
}  // namespace rnnkern::cpu
