"""The CPU's arithmetic ceiling: the FMA peak of the cores a run uses, from the
core's vector width, its FMA units and its clock -- the figure ``pct_peak_flops``
is measured against on the CPU.

    peak FLOP/s = threads x FMA units x lanes of the dtype x 2 (an FMA is two
                  flops) x clock

A measured GEMM is no ceiling (a run's own kernels beat torch.mm at 2048^3 by up
to 2x here, which read as 161-207% of "peak"); the FMA peak is one, when the clock
is the core's highest.  Every number it rests on is stated in the JSON
(``peaks.fma``): the core, its ISA, the units, the lanes, the clock and where
that was read.  The cores, by /proc/cpuinfo's vendor, family and model:

==================  =====================  ======================================
core                FMA units x width      fp32 flops per cycle
==================  =====================  ======================================
AMD Zen, Zen+       2 x 128-bit            2 x 4 lanes x 2 = 16
AMD Zen 2, Zen 3    2 x 256-bit (AVX2)     2 x 8 x 2 = 32
AMD Zen 4           AVX-512 on 2 x 256-bit 2 x 8 x 2 = 32 (a 512-bit op takes two)
AMD Zen 5           2 x 512-bit            2 x 16 x 2 = 64 (server and desktop parts)
AMD Zen 5, mobile   AVX-512 on 2 x 256-bit 2 x 8 x 2 = 32 (as a Zen 4)
other, AVX-512      2 x 512-bit (assumed)  64 (some Xeon parts have one unit: 32)
other, AVX2 + FMA   2 x 256-bit (assumed)  32
other               no FMA: 128-bit mul    8
                    and add, one each
==================  =====================  ======================================

float64 has half the lanes.  bfloat16 / float16 count twice the float32 rate
where the core has a dot-product instruction for them (avx512_bf16's vdpbf16ps,
avx512_fp16), else the float32 rate (torch converts and computes in float32).
Where the core has AMX's bf16 tiles (amx_bf16: Intel Sapphire Rapids and
later), bfloat16's ceiling is the tile multiply: a tdpbf16ps (16 x 16 x 32
multiply-adds) every 16 cycles, 1024 flops a cycle (a loop of them on this
project's Xeon: 1.75 T multiply-adds a second, 3.5 TFLOP/s at 3.4 GHz).
Threads are assumed to run one per core.  ``RNNKERN_BENCH_CPU_MHZ`` overrides
the clock (the JSON then says so): a virtual machine often shows only its
nominal clock, which a boosting core exceeds; where a measurement ran faster
than the peak at that clock, the run takes the clock it implies
(:func:`at_least_measured`): a loop of independent float32 FMAs
(:func:`fma_loop_tflops`, rnnkern._C.cpu_fma_rate), and torch.mm's GEMM.  The
loop is the tight one: on a Zen 4 VM stating 2.6-2.9 GHz it ran 115 GFLOP/s a
core (3.6 GHz), where torch.mm reached 92 (the clock the runs until 2026-12-01
took, so their %peak read up to 107%).
"""
from __future__ import annotations

import os
import time
from typing import Optional

from rnnkern.auto import fma_pipes_512bit
from rnnkern.check.probe import cpu_identity, cpuinfo, max_clock_mhz

#: core -> (FMA units, float32 lanes per unit, note)
CORES = {
    "AMD Zen/Zen+": (2, 4, "two 128-bit FMA pipes"),
    "AMD Zen 2": (2, 8, "two 256-bit FMA pipes"),
    "AMD Zen 3": (2, 8, "two 256-bit FMA pipes (AVX2)"),
    "AMD Zen 4": (2, 8, "AVX-512 executed on two 256-bit FMA pipes"),
    "AMD Zen 5": (2, 16, "two 512-bit FMA pipes"),
    "AMD Zen 5, mobile": (2, 8, "AVX-512 executed on two 256-bit FMA pipes"),
    "AVX-512 core": (2, 16, "assumed: two 512-bit FMA units (some Xeon parts have one)"),
    "AVX2 core": (2, 8, "assumed: two 256-bit FMA units"),
    "core without FMA": (1, 4, "assumed: one 128-bit multiply and one add per cycle"),
}


#: AMX's tdpbf16ps: 16 x 16 x 32 multiply-adds (2 flops each) every 16 cycles.
AMX_BF16_FLOPS_PER_CYCLE = 16 * 16 * 32 * 2 // 16


def core_name(identity: dict, flags: set) -> str:
    """The key of :data:`CORES` for a CPU (vendor, family, model; else its flags)."""
    family, model = identity.get("family"), identity.get("model")
    if identity.get("vendor") == "AuthenticAMD" and isinstance(family, int) and isinstance(model, int):
        if family == 0x17:
            return "AMD Zen/Zen+" if model < 0x30 else "AMD Zen 2"
        if family == 0x19:
            zen4 = 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF
            return "AMD Zen 4" if zen4 else "AMD Zen 3"
        if family == 0x1A:  # the models with 512-bit pipes: the kernels' and auto's rule
            return "AMD Zen 5" if fma_pipes_512bit("AuthenticAMD", family, model) else "AMD Zen 5, mobile"
    if "avx512f" in flags:
        return "AVX-512 core"
    if "fma" in flags and "avx2" in flags:
        return "AVX2 core"
    return "core without FMA"


def fma_peak(threads: int, dtypes, clock_mhz: Optional[float] = None, clock_source: str = "",
             identity: Optional[dict] = None, flags: Optional[set] = None) -> dict:
    """The FMA peak of ``threads`` cores per dtype name (TFLOP/s), and every number
    behind it.  Without ``clock_mhz`` the clock is read (:func:`max_clock_mhz`,
    or ``RNNKERN_BENCH_CPU_MHZ``)."""
    identity = cpu_identity() if identity is None else identity
    flags = (cpuinfo()[1] or set()) if flags is None else flags
    if clock_mhz is None:
        override = os.environ.get("RNNKERN_BENCH_CPU_MHZ")
        if override:
            clock_mhz, clock_source = float(override), "RNNKERN_BENCH_CPU_MHZ (set by the user)"
        else:
            clock_mhz, clock_source = max_clock_mhz()
    core = core_name(identity, flags)
    units, lanes, note = CORES[core]
    per_cycle = {}
    for name in dtypes:
        if name == "float64":
            per_cycle[name] = units * lanes // 2 * 2
        elif name == "bfloat16" and "amx_bf16" in flags:
            per_cycle[name] = AMX_BF16_FLOPS_PER_CYCLE
        elif (name == "bfloat16" and "avx512_bf16" in flags) or (name == "float16" and "avx512_fp16" in flags):
            per_cycle[name] = units * lanes * 2 * 2
        else:
            per_cycle[name] = units * lanes * 2
    tflops = ({name: threads * f * clock_mhz * 1e6 / 1e12 for name, f in per_cycle.items()}
              if clock_mhz else {})
    return {"tflops": tflops, "core": core, "cpu": identity, "fma_units": units, "fp32_lanes_per_unit": lanes,
            "flops_per_fma": 2, "flops_per_cycle_per_core": per_cycle, "core_note": note,
            "threads": threads, "clock_mhz": clock_mhz, "clock_source": clock_source,
            "formula": "threads x FMA units x lanes of the dtype x 2 flops x clock (one thread per core)"}


def fma_loop_tflops(threads: int, rounds: int = 3, seconds: float = 0.05) -> float:
    """The float32 FMA rate of this core as a loop of independent multiply-adds
    measures it (``rnnkern._C.cpu_fma_rate``, in the vectors rnnkern's products
    use), best of ``rounds`` of about ``seconds`` each, times ``threads``: TFLOP/s.
    The core's FMA peak at the clock it actually runs, which a virtual machine's
    stated clock understates (a Zen 4 VM: 2.6-2.9 GHz stated, 115 GFLOP/s a core
    measured, a 3.6 GHz boost)."""
    from rnnkern import _C
    probe = 100_000
    t0 = time.perf_counter()
    _C.cpu_fma_rate(probe)  # (also wakes the core's clock up)
    iterations = max(probe, int(probe * seconds / max(time.perf_counter() - t0, 1e-6)))
    best = max(_C.cpu_fma_rate(iterations) for _ in range(rounds))
    return threads * best / 1e12


def at_least_measured(peak: dict, gemm_tflops: dict, loop_tflops: Optional[float] = None) -> dict:
    """``peak`` raised to what a measurement implies when it ran faster than the
    FMA peak at the stated clock: the float32 GEMM (torch.mm) and the FMA loop
    (:func:`fma_loop_tflops`, TFLOP/s for ``peak``'s threads).  The cores then ran
    faster than that clock (a virtual machine shows its nominal clock; the cores
    boost); the clock becomes the highest the measurements imply (a lower bound
    of the real one: the loop's is the tight one, torch.mm reached 80% of it on a
    Zen 4), and the JSON says so (``stated_clock_mhz``, ``clock_source``,
    ``fma_loop_tflops``)."""
    per_cycle = peak["flops_per_cycle_per_core"].get("float32")
    if loop_tflops is not None:
        peak = dict(peak, fma_loop_tflops=loop_tflops)
    if not (per_cycle and peak["clock_mhz"]):
        return peak
    implied = []
    gemm = gemm_tflops.get("float32")
    if gemm:
        implied.append((gemm * 1e12 / (peak["threads"] * per_cycle) / 1e6,
                        f"implied by the measured float32 GEMM ({gemm:.3g} TFLOP/s)"))
    if loop_tflops:
        implied.append((loop_tflops * 1e12 / (peak["threads"] * per_cycle) / 1e6,
                        f"implied by a float32 FMA loop (rnnkern._C.cpu_fma_rate: {loop_tflops:.3g} TFLOP/s)"))
    if not implied:
        return peak
    clock, how = max(implied)
    if clock <= peak["clock_mhz"]:
        return peak
    # Raised again (the suite measures once more at its end): against the clock
    # first stated and its source, not the last raise's (which would nest).
    stated = peak.get("stated_clock_mhz", peak["clock_mhz"])
    stated_source = peak.get("stated_clock_source", peak["clock_source"])
    out = dict(peak, clock_mhz=clock, stated_clock_mhz=stated, stated_clock_source=stated_source,
               clock_source=f"{how}, above the stated {stated:.0f} MHz ({stated_source})")
    out["tflops"] = {k: peak["threads"] * f * clock * 1e6 / 1e12
                     for k, f in peak["flops_per_cycle_per_core"].items()}
    return out
