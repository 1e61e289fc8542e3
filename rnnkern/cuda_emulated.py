"""The CUDA kernels on an emulated device: backend ``"cuda_emulated"`` (tests only).

Present only when rnnkern was built with ``RNNKERN_CUDA_EMULATION=1``: the
sources of csrc/cuda compiled with g++ against a small emulation of the CUDA
device (csrc/cuda_emu: threads as fibers, barriers checked, WMMA and cuBLAS as
checked references), registered as ``torch.ops.rnnkern_cuda_emu.*`` for CPU
tensors with the op bodies of the real CUDA backend.  So the CUDA code -- the
kernels, their launches and the bindings that unpack tensors into them --
executes in CI, where no GPU is, and is compared with the reference like every
backend.  What it cannot tell: speed, the tensor cores' rounding, and the
hardware's memory ordering (an ordinary launch runs its blocks one after
another; a cooperative one runs them all at once, ordered by its barriers,
which ThreadSanitizer checks in CI).

``set_schedule(order, seed)`` chooses the order in which a block's threads
resume after each barrier (``forward``, ``reverse``, ``shuffle``; in a
cooperative grid the last two also let one block run ahead of the others to
its next grid barrier); ``set_arch(700)`` runs the step kernel's FMA path for
half types instead of WMMA (``900``); ``set_persistent("always")`` (or True) lets the
persistent kernels (csrc/cuda/persistent.cuh) take the layers they fit, ``"auto"`` those
within a real GPU's default rule, with
``set_device_model`` giving the emulated GPU few enough SMs to run.
"""
from __future__ import annotations

from .library import WITH_CUDA_EMULATION

NAMESPACE = "rnnkern_cuda_emu"  # defined and registered by rnnkern.library

if not WITH_CUDA_EMULATION:
    raise ImportError("rnnkern was built without the emulated CUDA device "
                      "(rebuild with RNNKERN_CUDA_EMULATION=1)")
from . import _C_cuda_emu  # noqa: E402  (implements the ops for CPU tensors)

set_schedule = _C_cuda_emu.set_schedule
set_arch = _C_cuda_emu.set_arch
arch = _C_cuda_emu.arch
launches = _C_cuda_emu.launches
# Multiply-adds of the emulated cuBLAS GEMMs so far: what a host loop's products cost.
gemm_multiply_adds = _C_cuda_emu.gemm_multiply_adds
# Rows the persistent kernels' CTAs staged so far (each CTA counts its own): what
# their steps cost.
staged_rows = _C_cuda_emu.staged_rows
# Bytes they asked to prefetch so far (the next step's rows, during the grid barrier).
prefetched_bytes = _C_cuda_emu.prefetched_bytes
# Cooperative grids (every block at once, grid.sync()): the device model behind the
# occupancy query and the cooperative launch's co-residency check, and the test kernel.
set_device_model = _C_cuda_emu.set_device_model
multiprocessors = _C_cuda_emu.multiprocessors
shared_per_block = _C_cuda_emu.shared_per_block
# The persistent kernels' plan (csrc/cuda/persistent.cuh: persistent_plan) on that model.
persistent_plan = _C_cuda_emu.persistent_plan
grid_exchange = _C_cuda_emu.grid_exchange
grid_exchange_blocks = _C_cuda_emu.grid_exchange_blocks


# The persistent kernels (csrc/cuda/persistent.cuh): "never" by default here (the
# emulated suite proves the host loop), "auto" on a real GPU.
def set_persistent(mode) -> None:
    """As rnnkern.ops.set_cuda_persistent for the emulated device: "never",
    "auto" (the rule of a real GPU, never capturing here), "always", or a bool."""
    from .ops import persistent_mode_code
    _C_cuda_emu.set_persistent(persistent_mode_code(mode, "set_persistent"))


def persistent() -> str:
    """The emulated device's persistent mode."""
    from .ops import PERSISTENT_MODES
    return PERSISTENT_MODES[_C_cuda_emu.persistent()]


cooperative_launches = _C_cuda_emu.cooperative_launches
