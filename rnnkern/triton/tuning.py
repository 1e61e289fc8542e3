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

#: The smallest block side of a tl.dot on NVIDIA GPUs.
MIN_DOT = 16


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
