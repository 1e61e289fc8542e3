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
other, AVX-512      2 x 512-bit (assumed)  64 (some Xeon parts have one unit: 32)
other, AVX2 + FMA   2 x 256-bit (assumed)  32
other               no FMA: 128-bit mul    8
                    and add, one each
==================  =====================  ======================================

float64 has half the lanes.  bfloat16 / float16 count twice the float32 rate
where the core has a dot-product instruction for them (avx512_bf16's vdpbf16ps,
avx512_fp16), else the float32 rate (torch converts and computes in float32).
Threads are assumed to run one per core.  ``RNNKERN_BENCH_CPU_MHZ`` overrides
the clock (the JSON then says so): a virtual machine often shows only its
nominal clock, which a boosting core exceeds; where torch.mm ran faster than
the peak at that clock, the run takes the clock the GEMM implies
(:func:`at_least_measured`).
"""
from __future__ import annotations

import os
from typing import Optional

from rnnkern.check.probe import cpu_identity, cpuinfo, max_clock_mhz

#: core -> (FMA units, float32 lanes per unit, note)
CORES = {
    "AMD Zen/Zen+": (2, 4, "two 128-bit FMA pipes"),
    "AMD Zen 2": (2, 8, "two 256-bit FMA pipes"),
    "AMD Zen 3": (2, 8, "two 256-bit FMA pipes (AVX2)"),
    "AMD Zen 4": (2, 8, "AVX-512 executed on two 256-bit FMA pipes"),
    "AMD Zen 5": (2, 16, "two 512-bit FMA pipes"),
    "AVX-512 core": (2, 16, "assumed: two 512-bit FMA units (some Xeon parts have one)"),
    "AVX2 core": (2, 8, "assumed: two 256-bit FMA units"),
    "core without FMA": (1, 4, "assumed: one 128-bit multiply and one add per cycle"),
}


def core_name(identity: dict, flags: set) -> str:
    """The key of :data:`CORES` for a CPU (vendor, family, model; else its flags)."""
    family, model = identity.get("family"), identity.get("model")
    if identity.get("vendor") == "AuthenticAMD" and isinstance(family, int) and isinstance(model, int):
        if family == 0x17:
            return "AMD Zen/Zen+" if model < 0x30 else "AMD Zen 2"
        if family == 0x19:
            zen4 = 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF
            return "AMD Zen 4" if zen4 else "AMD Zen 3"
        if family == 0x1A:
            return "AMD Zen 5"
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


def at_least_measured(peak: dict, gemm_tflops: dict) -> dict:
    """``peak`` raised to what the measured float32 GEMM implies, when torch.mm ran
    faster than the FMA peak at the stated clock: the cores then ran faster than
    that clock (a virtual machine shows its nominal clock; the cores boost).  The
    clock becomes the one the GEMM implies (a lower bound of the real one), and
    the JSON says so (``stated_clock_mhz``, ``clock_source``)."""
    per_cycle = peak["flops_per_cycle_per_core"].get("float32")
    gemm = gemm_tflops.get("float32")
    if not (per_cycle and gemm and peak["clock_mhz"]):
        return peak
    implied = gemm * 1e12 / (peak["threads"] * per_cycle) / 1e6
    if implied <= peak["clock_mhz"]:
        return peak
    out = dict(peak, clock_mhz=implied, stated_clock_mhz=peak.get("stated_clock_mhz", peak["clock_mhz"]),
               clock_source=(f"implied by the measured float32 GEMM ({gemm:.3g} TFLOP/s), above the "
                             f"stated {peak['clock_mhz']:.0f} MHz ({peak['clock_source']})"))
    out["tflops"] = {k: peak["threads"] * f * implied * 1e6 / 1e12
                     for k, f in peak["flops_per_cycle_per_core"].items()}
    return out
