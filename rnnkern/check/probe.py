"""The environment probe: what machine, software and checkout a run happens on.

One source for the field self-check's report (:func:`environment`) and the
benchmarks' metadata (bench/suite.py, bench/resets.py): the CPU's model and
ISA flags (Linux's /proc/cpuinfo), the vector ISA torch and rnnkern dispatch
to and any environment variable that caps it, the GPU, package versions, the
git commit of a source checkout and the load average.
"""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

import torch

from .. import _C, __version__, ops

#: The package directory (rnnkern/) and the checkout it may sit in.
PACKAGE = Path(__file__).resolve().parent.parent
ROOT = PACKAGE.parent

#: Environment variables that cap the vector ISA of a kernel (torch's ATen, oneDNN
#: in torch.nn and OpenVINO, MKL, rnnkern): a run made under a cap says so.
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
            "MKL_ENABLE_INSTRUCTIONS", "RNNKERN_CPU_VECTOR_BITS", "RNNKERN_CPU_FMA_BITS")


def package_version(name: str) -> Optional[str]:
    """The installed version of a distribution, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cpuinfo() -> tuple[Optional[str], Optional[set]]:
    """(model name, ISA flags) of the first CPU in Linux's /proc/cpuinfo;
    (None, None) elsewhere."""
    model, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and flags is None:
                flags = set(value.split())
    except OSError:
        pass  # not Linux: the model from platform, the ISA unknown
    return model, flags


def cpu_identity() -> dict:
    """Vendor, family, model number and stepping of the first CPU (Linux's
    /proc/cpuinfo; None where it does not say), with its model name: enough to
    tell a core generation apart where the model name is only "AMD EPYC"."""
    fields = {"vendor_id": "vendor", "cpu family": "family", "model": "model", "stepping": "stepping"}
    out = dict.fromkeys(fields.values())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in fields and out[fields[key]] is None:
                value = value.strip()
                out[fields[key]] = int(value) if value.isdigit() else value
            elif not key and any(v is not None for v in out.values()):
                break  # the end of the first CPU's block
    except OSError:
        pass
    out["name"] = cpu_model()
    return out


def max_clock_mhz() -> tuple[Optional[float], str]:
    """The CPU's highest clock in MHz and where it was read: cpufreq's
    cpuinfo_max_freq, lscpu's "CPU max MHz", else /proc/cpuinfo's "cpu MHz"
    (the clock the kernel last saw: a virtual machine often shows the nominal
    clock there, which a boosting core exceeds); (None, why) when none says."""
    try:
        khz = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text().strip()
        return float(khz) / 1e3, "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"
    except (OSError, ValueError):
        pass
    try:
        run = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=20)
        for line in run.stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "CPU max MHz" and value.strip():
                return float(value.strip().replace(",", ".")), "lscpu: CPU max MHz"
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "cpu MHz":
                return (float(value), "/proc/cpuinfo: cpu MHz (the current clock as the kernel sees it; "
                                      "a boosting core can run faster)")
    except (OSError, ValueError):
        pass
    return None, "no clock found (no cpufreq, lscpu max MHz or /proc/cpuinfo cpu MHz)"


def cpu_model() -> str:
    """The CPU's model name (platform's processor or machine where /proc/cpuinfo is missing)."""
    return cpuinfo()[0] or platform.processor() or platform.machine()


def cpu_info() -> dict:
    """Model and the ISA extensions rnnkern's CPU kernels dispatch on (Linux's
    /proc/cpuinfo; elsewhere only what platform and torch tell): the self-check's record."""
    flags = cpuinfo()[1]
    isa = None if flags is None else sorted(f for f in flags if f in (
        "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
        "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile"))
    return {"model": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "isa": isa, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "rnnkern_cpu_isa": _C.cpu_isa()}


def cpu_isa() -> dict:
    """What the CPU offers, what torch and rnnkern dispatch to, and any caps set:
    the benchmarks' record."""
    flags = cpuinfo()[1] or set()
    recorded = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")
    isa = {"cpu_flags": [f for f in recorded if f in flags],
           "torch_capability": torch.backends.cpu.get_cpu_capability(),
           "rnnkern_vector_bits": _C.cpu_vector_bits(), "rnnkern_fma_pipe_bits": _C.cpu_fma_pipe_bits()}
    caps = {k: os.environ[k] for k in ISA_CAPS if os.environ.get(k)}
    if caps:
        isa["caps"] = caps
    return isa


def gpu_info() -> Optional[dict]:
    """The first visible CUDA GPU (None without one) and the driver nvidia-smi reports."""
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    driver = None
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=20)
        driver = run.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        driver = None  # no nvidia-smi (a container without it): the driver stays unknown
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2 ** 30, 1), "count": torch.cuda.device_count(),
            "driver": driver}


def git_commit() -> Optional[str]:
    """``git describe --always --dirty`` of the source checkout rnnkern runs from
    (None for an installed copy)."""
    if not (ROOT / ".git").exists():
        return None
    try:
        run = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() or None


def load_average() -> Optional[list]:
    """The 1, 5 and 15 minute load averages, None where the OS has none."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:  # not available on this OS
        return None


def environment() -> dict:
    """The self-check report's ``environment`` record."""
    return {
        "rnnkern": __version__, "rnnkern_path": str(PACKAGE), "git": git_commit(),
        "rnnkern_cuda_kernels": ops.WITH_CUDA,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": package_version("triton"), "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "python": platform.python_version(), "os": platform.platform(),
        "cpu": cpu_info(), "gpu": gpu_info(), "load_average": load_average(),
    }


def environment_lines(env: dict) -> list[str]:
    cpu, gpu = env["cpu"], env["gpu"]
    isa = "ISA unknown" if cpu["isa"] is None else ("ISA " + " ".join(cpu["isa"]) if cpu["isa"] else "no AVX")
    if cpu["isa"] is not None and "avx512f" not in cpu["isa"]:
        isa += " (no AVX-512)"
    lines = [f"rnnkern {env['rnnkern']} ({env['git'] or env['rnnkern_path']}), CUDA kernels "
             f"{'built' if env['rnnkern_cuda_kernels'] else 'not built'}",
             f"torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), triton {env['triton']}, "
             f"python {env['python']}, {env['os']}",
             f"CPU: {cpu['model']}, {cpu['cores']} cores, torch uses {cpu['torch_threads']} threads, {isa}, "
             f"torch dispatch {cpu['torch_cpu_capability']}, rnnkern's CPU kernels at {cpu['rnnkern_cpu_isa']}"]
    if gpu:
        lines.append(f"GPU: {gpu['name']} (sm_{gpu['capability'].replace('.', '')}, {gpu['sms']} SMs, "
                     f"{gpu['memory_gib']} GiB), driver {gpu['driver']}, {gpu['count']} visible")
    else:
        lines.append("GPU: none visible")
    load = env["load_average"]
    if load and load[0] > (cpu["cores"] or 1):
        lines.append(f"note: load average {load[0]} on {cpu['cores']} cores: other processes compete "
                     "for the CPU; this run is slower, and the CPU backend is not timed")
    return lines
