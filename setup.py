"""Builds rnnkern._C from csrc/: the C++ CPU kernels always, the CUDA kernels
whenever nvcc and a CUDA build of torch are present.

Environment knobs:
  RNNKERN_SKIP_CUDA=1      build the CPU kernels only
  CUDA_HOME                the CUDA toolkit (default: found from the nvcc on PATH,
                           following a wrapper script to the real toolkit; else
                           /usr/local/cuda or the newest /usr/local/cuda-*)
  TORCH_CUDA_ARCH_LIST     GPU architectures (default: recent ones, see below)
  MAX_JOBS                 parallel compile jobs (ninja); NVCC_THREADS per nvcc call
  RNNKERN_CPU_ISA          x86-64 | x86-64-v2 | x86-64-v3 | x86-64-v4: compile the CPU
                           kernels' vectorised loops for this one ISA level instead of
                           choosing at load time (CI tests the lower levels this way)
  RNNKERN_CUDA_EMULATION   1: also build rnnkern._C_cuda_emu, the CUDA kernels compiled
                           with g++ for an emulated device on the CPU (tests only, see
                           csrc/cuda_emu/prelude.h); asan / tsan: the same under
                           AddressSanitizer+UBSan / ThreadSanitizer (CI, .ci/cuda_emulation.sh)
  RNNKERN_CUDA_EMULATION_ONLY=1  build that extension alone (beside an existing install)
"""
import glob
import os
import re
import shutil
import subprocess

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _toolkit_of(nvcc):
    """The toolkit directory of an nvcc binary, following wrapper scripts."""
    nvcc = os.path.realpath(nvcc)
    with open(nvcc, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"#!"):  # e.g. `exec /usr/local/cuda-13.0/bin/nvcc "$@"`
        match = re.search(rb"(/[^\s\"']+/bin/nvcc)\b", head)
        if match is None:
            return None
        nvcc = os.path.realpath(match.group(1).decode())
    toolkit = os.path.dirname(os.path.dirname(nvcc))
    return toolkit if os.path.exists(os.path.join(toolkit, "include", "cuda_runtime.h")) else None


def find_cuda_home():
    if os.environ.get("RNNKERN_SKIP_CUDA", "0") == "1":
        return None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return _toolkit_of(os.path.join(home, "bin", "nvcc"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        return _toolkit_of(nvcc)
    # Images that install the toolkit without putting it on PATH: the usual places.
    for home in ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]:
        if os.path.exists(os.path.join(home, "bin", "nvcc")):
            return _toolkit_of(os.path.join(home, "bin", "nvcc"))
    return None


CUDA_HOME = find_cuda_home()
if CUDA_HOME:
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported.
    os.environ["CUDA_HOME"] = CUDA_HOME

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

WITH_CUDA = CUDA_HOME is not None and torch.version.cuda is not None


def nvcc_release():
    out = subprocess.run([os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"],
                         capture_output=True, text=True, check=True).stdout
    major, minor = re.search(r"release (\d+)\.(\d+)", out).groups()
    return int(major), int(minor)


def pip_cuda_libraries():
    """Headers and cuBLAS from the nvidia-* wheels a CUDA build of torch brings
    (a toolkit installed for nvcc alone may lack cuBLAS)."""
    try:
        import nvidia
    except ImportError:
        return [], [], []
    include_dirs, library_dirs, link = [], [], []
    for base in nvidia.__path__:
        for pkg in sorted(glob.glob(os.path.join(base, "*"))):
            if os.path.isdir(os.path.join(pkg, "include")):
                include_dirs.append(os.path.join(pkg, "include"))
            cublas = sorted(glob.glob(os.path.join(pkg, "lib", "libcublas.so*")))
            if cublas and not link:
                library_dirs.append(os.path.join(pkg, "lib"))
                link.append("-l:" + os.path.basename(cublas[0]))
    return include_dirs, library_dirs, link


CPU_ISA_LEVELS = ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")


def cpu_isa_flags():
    isa = os.environ.get("RNNKERN_CPU_ISA", "")
    if not isa:
        return []
    if isa not in CPU_ISA_LEVELS:
        raise SystemExit(f"RNNKERN_CPU_ISA={isa!r}: expected one of {', '.join(CPU_ISA_LEVELS)}")
    return (
        [f"-DRNNKERN_CPU_ISA={isa}"]
        + (["-DRNNKERN_CPU_ISA_V4"] if isa == "x86-64-v4" else [])
        + (["-DRNNKERN_CPU_ISA_F16C"] if isa in ("x86-64-v3", "x86-64-v4") else [])
    )


def extensions():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # -g0: Python's sysconfig adds -g, which doubles the compile time of the torch headers.
    cxx = ["-O3", "-g0", "-fopenmp", "-fno-trapping-math"] + cpu_isa_flags()
    if not WITH_CUDA:
        return [CppExtension("rnnkern._C", sources, extra_compile_args={"cxx": cxx},
                             extra_link_args=["-fopenmp"])]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        # T4 (7.5) on; V100 (7.0) where the toolkit still builds it (CUDA 13 dropped it);
        # and the newest as PTX too, which the driver compiles for GPUs after the list --
        # without both, those GPUs get "no kernel image is available".
        release = nvcc_release()
        archs = (["7.0"] if release < (13, 0) else []) + ["7.5", "8.0", "8.6", "8.9", "9.0"]
        if release >= (12, 8):
            archs += ["10.0", "12.0"]
        archs[-1] += "+PTX"
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    sources += sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu"))
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
            "--threads", os.environ.get("NVCC_THREADS", "2")]
    include_dirs, library_dirs, link = pip_cuda_libraries()
    has_cublas = bool(link) or os.path.exists(os.path.join(CUDA_HOME, "lib64", "libcublas.so"))
    return [CUDAExtension("rnnkern._C", sources, include_dirs=include_dirs,
                          library_dirs=library_dirs,
                          extra_compile_args={"cxx": cxx + ["-DRNNKERN_WITH_CUDA"], "nvcc": nvcc},
                          extra_link_args=["-fopenmp"] + (link or (["-lcublas"] if has_cublas else [])))]


def cuda_headers():
    """Directories with the CUDA runtime, half/bf16 and cuBLAS headers: the
    nvidia-* wheels of a CUDA build of torch, else the toolkit."""
    dirs = [d for d in pip_cuda_libraries()[0] if os.path.exists(os.path.join(d, "cuda_runtime.h"))
            or os.path.exists(os.path.join(d, "cublas_v2.h"))]
    if CUDA_HOME:
        dirs.append(os.path.join(CUDA_HOME, "include"))
    return dirs


EMULATION_SANITIZERS = {
    "1": [],
    "asan": ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"],
    "tsan": ["-fsanitize=thread"],
}


def emulation_extensions():
    """rnnkern._C_cuda_emu: the CUDA sources compiled as C++ for the emulated
    device (csrc/cuda_emu), with the real backend's op bodies.  Test-only."""
    mode = os.environ.get("RNNKERN_CUDA_EMULATION", "")
    if not mode:
        return []
    if mode not in EMULATION_SANITIZERS:
        raise SystemExit(f"RNNKERN_CUDA_EMULATION={mode!r}: expected one of {', '.join(EMULATION_SANITIZERS)}")
    headers = cuda_headers()
    if not any(os.path.exists(os.path.join(d, "cuda_runtime.h")) for d in headers):
        raise SystemExit("RNNKERN_CUDA_EMULATION: the CUDA headers are missing (a CUDA build of torch "
                         "brings them in its nvidia-* wheels; or set CUDA_HOME)")
    sanitize = EMULATION_SANITIZERS[mode]
    kernels = ["csrc/cuda_emu/runtime.cpp", "csrc/cuda_emu/kernels_sm90.cpp",
               "csrc/cuda_emu/kernels_sm70.cpp", "csrc/cuda_emu/kernels_cooperative.cpp"]
    # -O1 -g1 under the sanitizers: reports with file and line (line tables, no
    # variables), built in two thirds of -g's time (the torch headers' debug info).
    opt = ["-O1", "-g1"] if sanitize else ["-O2", "-g0"]
    return [CppExtension("rnnkern._C_cuda_emu", kernels + ["csrc/cuda_emu/bindings.cpp", "csrc/checks.cpp"],
                         include_dirs=[os.path.join(ROOT, "csrc", "cuda_emu", "include")] + headers,
                         extra_compile_args={"cxx": opt + sanitize + ["-Wno-attributes"]},
                         extra_link_args=sanitize)]


class BuildExtensionSaysWhat(BuildExtension):
    """torch's BuildExtension, first saying what it builds: a build takes minutes and
    pip shows nothing of it without -v."""

    def run(self):
        if os.environ.get("RNNKERN_CUDA_EMULATION"):
            print("rnnkern: building rnnkern._C_cuda_emu: the CUDA sources for an emulated device "
                  f"(tests only, RNNKERN_CUDA_EMULATION={os.environ['RNNKERN_CUDA_EMULATION']})",
                  flush=True)
        if os.environ.get("RNNKERN_CUDA_EMULATION_ONLY") == "1":
            return super().run()
        if WITH_CUDA:
            archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(";", " ")
            what = (f"C++ CPU kernels and CUDA kernels for compute capabilities {archs} "
                    f"(toolkit {CUDA_HOME}); this takes minutes: about 6 on 2 cores for 9.0 alone, "
                    f"more with each architecture")
        else:
            why = "RNNKERN_SKIP_CUDA=1" if os.environ.get("RNNKERN_SKIP_CUDA", "0") == "1" else \
                "no nvcc found" if CUDA_HOME is None else "torch is a CPU-only build"
            what = f"C++ CPU kernels only ({why}); this takes 1-3 minutes on 2 cores"
        print(f"rnnkern: building rnnkern._C: {what}", flush=True)
        super().run()


setup(
    packages=find_packages(include=["rnnkern", "rnnkern.*"]),
    package_data={"rnnkern": ["auto_table.json"]},  # backend="auto"'s measurements
    ext_modules=(emulation_extensions() if os.environ.get("RNNKERN_CUDA_EMULATION_ONLY") == "1"
                 else extensions() + emulation_extensions()),
    cmdclass={"build_ext": BuildExtensionSaysWhat},
)
