// The CPU backend's functions of the rnnkern._C module (module.h): the buffer
// cache, the ISA level and vector width of the kernels, and the count of
// parallel regions, for rnnkern.ops and the tests.
#include "../module.h"

#include "buffers.h"
#include "gemm.h"
#include "isa.h"
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
});

}  // namespace
}  // namespace rnnkern::cpu
