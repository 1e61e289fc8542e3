// Which x86 ISA levels the CPU kernels are compiled for (RNNKERN_CPU_CLONES).
#pragma once

// Functions holding the vectorised loops are compiled for several x86 ISA
// levels and picked at load time (the binary stays portable).  A build with
// RNNKERN_CPU_ISA=<level> (setup.py) pins them to that one level instead: GCC's
// target_clones resolver reads CPUID and has no override, so this is how CI runs
// the lower levels' code on a CPU whose dispatch would pick a higher one.
#define RNNKERN_STRINGIFY_(x) #x
#define RNNKERN_STRINGIFY(x) RNNKERN_STRINGIFY_(x)
#if defined(RNNKERN_CPU_ISA)
#define RNNKERN_CPU_CLONES __attribute__((target("arch=" RNNKERN_STRINGIFY(RNNKERN_CPU_ISA))))
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define RNNKERN_CPU_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#define RNNKERN_CPU_DISPATCH 1
#else
#define RNNKERN_CPU_CLONES
#endif

// The products (gemm.h) also come in a 512-bit version, compiled for
// x86-64-v4 and chosen at run time on CPUs with AVX-512 (gemm::wide_vectors):
// GCC's target_clones compile one source per level, so the vector width, a
// type, cannot differ between the clones.  A pinned build uses it only when
// pinned to x86-64-v4 (setup.py passes RNNKERN_CPU_ISA_V4).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    (!defined(RNNKERN_CPU_ISA) || defined(RNNKERN_CPU_ISA_V4))
#define RNNKERN_CPU_WIDE_VECTORS 1
#define RNNKERN_CPU_WIDE_TARGET __attribute__((target("arch=x86-64-v4"), noinline))
#endif

// float16 values widen to float32 on F16C's vcvtph2ps (x86-64-v3 and up),
// chosen by CPUID (gemm::widen_half); a build pinned below v3 keeps the
// portable conversion.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    (!defined(RNNKERN_CPU_ISA) || defined(RNNKERN_CPU_ISA_F16C))
#define RNNKERN_CPU_F16C 1
#endif
