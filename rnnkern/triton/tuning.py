"""Autotuning configurations of the Triton kernels.

On a GPU each kernel family tries a few block shapes, keyed on the hidden size
(and the cell, whose gate count changes the register load).  Under
``TRITON_INTERPRET=1`` autotuning would run every configuration, so there is a
single small one: blocks smaller than the test sizes, so that CI exercises
several tiles, masked tails and several K blocks.
"""
import os

import triton

#: True when the kernels run on the CPU through Triton's interpreter (it must be
#: chosen before triton is imported, as tests/conftest.py does).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _version(text: str) -> tuple:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def check_interpreter_versions() -> None:
    """Triton's interpreter before 3.8 converts one-element arrays to Python
    scalars, which numpy 2.4 made an error ("only 0-dimensional arrays can be
    converted to Python scalars"): every kernel would fail deep inside Triton.
    Seen with Triton 3.6 and numpy 2.4/2.5; Triton 3.8 runs with numpy 2.4."""
    if not INTERPRET:
        return
    import numpy
    if _version(triton.__version__) < (3, 8) and _version(numpy.__version__) >= (2, 4):
        raise RuntimeError(
            f"TRITON_INTERPRET=1 with triton {triton.__version__} needs numpy < 2.4 (found "
            f"{numpy.__version__}): its interpreter fails on every kernel with numpy >= 2.4. "
            "Install numpy<2.4, or triton >= 3.8.")


check_interpreter_versions()

#: The smallest block side of a tl.dot on NVIDIA GPUs.
MIN_DOT = 16


def batch_class(B: int) -> int:
    """The autotuners' key for the batch (every autotuned kernel's B_CLASS):
    B rounded up to a power of two, at most 256.  The best BLOCK_B depends on it
    (at B=4 a 64-row tile computes 60 padding rows, at B=256 a 16-row one
    launches 16 programs where 4 would do), so a configuration tuned at one
    batch size does not stick to another; rounding keeps a run of changing
    batch sizes (RL rollouts, the last short batch of an epoch) from re-tuning
    at each."""
    return min(1 << max(B - 1, 0).bit_length(), 256)


def step_configs():
    """Per-step kernels: tiles of BLOCK_B rows x BLOCK_H units, K in BLOCK_K steps."""
    if INTERPRET:
        return [triton.Config({"BLOCK_B": 4, "BLOCK_H": 4, "BLOCK_K": 4}, num_warps=1)]
    return [
        triton.Config({"BLOCK_B": bb, "BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bb, bh, bk, w, st in [
            (16, 32, 64, 4, 3), (16, 64, 64, 4, 3), (32, 32, 64, 4, 3),
            (64, 64, 32, 4, 3), (64, 64, 64, 8, 3), (128, 64, 32, 8, 3),
        ]
    ]


def loop_configs():
    """In-kernel time loops: one program per BLOCK_B rows holds every unit."""
    if INTERPRET:
        return [triton.Config({"BLOCK_B": 4}, num_warps=1)]
    return [triton.Config({"BLOCK_B": bb}, num_warps=w) for bb, w in [(16, 4), (16, 8), (32, 8), (64, 8)]]


def row_configs():
    """Row kernels (LSTM-LN's layer norms): BLOCK_B whole rows per program, the
    units in chunks of BLOCK_H.  Under the interpreter, chunks smaller than the
    test sizes, so that the loops over chunks and their masked tails run."""
    if INTERPRET:
        return [triton.Config({"BLOCK_B": 2, "BLOCK_H": 4}, num_warps=1)]
    return [triton.Config({"BLOCK_B": bb, "BLOCK_H": bh}, num_warps=w)
            for bb, bh, w in [(1, 256, 4), (2, 256, 4), (4, 128, 4), (8, 128, 8)]]
