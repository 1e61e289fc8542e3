"""The size grid: which (cell, B, T, H, dtype) cases a run measures.

Four families of sizes, one list per device:

============  =====================================  ======================================
family        GPU (the issue's grid)                 CPU (scaled to 2 shared cores)
============  =====================================  ======================================
latency       B 1, 16, 64 x H 256, 768, 1024; T 1024  B 1, 16, 64 x H 64, 128, 256; T 256
throughput    B 256; H 512, 1024; T 256               B 128; H 128, 256; T 64
long          B 16, H 768; T 2k, 4k, 8k, 16k          B 4, H 128; T 512, 2k, 8k
headline      B 16, H 768, T 1024 (GUIDE's targets)   B 32, H 256, T 256 (README's CPU table)
============  =====================================  ======================================

The CPU grid keeps the shape of the GPU one (three batch sizes against three hidden
sizes, a large-batch family, sequences up to thousands of steps) at a size where
the whole grid (``--full``) takes about half an hour on two shared cores.
``python -m bench`` without ``--full`` measures DEFAULT_SIZES, a few sizes of each
family (minutes); ``--quick`` replaces every family by one or two tiny sizes (about a
minute on the CPU).  The input size is the hidden size throughout (I = H).

A size that belongs to several families (the GPU headline size is also a latency
size) is measured once and tagged with every family.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FAMILIES = ("latency", "throughput", "long", "headline")
#: Cells with a torch.nn twin (the baseline every candidate is compared with).
CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
DEFAULT_CELLS = ("lstm", "gru", "rnn_tanh")
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
#: GPU: bfloat16 alone by default, so that the whole grid fits one 10-minute call on an
#: H100; add float32 / float16 with --dtypes.
DEFAULT_DTYPES = {"cpu": ("float32",), "cuda": ("bfloat16",)}


def _cross(Bs, Hs, Ts):
    return [(B, T, H) for B in Bs for H in Hs for T in Ts]


#: (B, T, H) per family, per device kind, per mode.
SIZES = {
    "cuda": {
        "latency": _cross((1, 16, 64), (256, 768, 1024), (1024,)),
        "throughput": _cross((256,), (512, 1024), (256,)),
        "long": _cross((16,), (768,), (2048, 4096, 8192, 16384)),
        "headline": [(16, 1024, 768)],
    },
    "cpu": {
        "latency": _cross((1, 16, 64), (64, 128, 256), (256,)),
        "throughput": _cross((128,), (128, 256), (64,)),
        "long": _cross((4,), (128,), (512, 2048, 8192)),
        "headline": [(32, 256, 256)],
    },
    "quick": {
        "latency": [(1, 32, 32), (8, 32, 64)],
        "throughput": [(64, 16, 64)],
        "long": [(2, 256, 32)],
        "headline": [(8, 32, 64)],
    },
}


@dataclass(frozen=True)
class Case:
    """One size of one cell in one dtype; measured forward and forward + backward."""
    cell: str
    B: int
    T: int
    H: int
    dtype: str
    families: tuple

    @property
    def I(self) -> int:  # noqa: E743  (the input size, as in the formulas)
        return self.H

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def label(self) -> str:
        return f"{self.cell} B{self.B} T{self.T} H{self.H} {self.dtype}"


#: ``python -m bench`` without --full: a few sizes of each family, so that every cell
#: and phase is measured at representative sizes in minutes (under 5 on two CPU cores).
DEFAULT_SIZES = {
    "cuda": {
        "latency": [(1, 1024, 256), (64, 1024, 1024)],
        "throughput": [(256, 256, 1024)],
        "long": [(16, 4096, 768)],
        "headline": [(16, 1024, 768)],
    },
    "cpu": {
        "latency": [(1, 256, 128), (16, 256, 128)],
        "throughput": [(128, 64, 256)],
        "long": [(4, 2048, 128)],
        "headline": [(32, 256, 256)],
    },
}
GRIDS = ("quick", "default", "full")


def sizes(device: str, grid: str) -> dict:
    """{family: [(B, T, H)]} of a grid ('quick', 'default' or 'full') on a device kind."""
    if grid not in GRIDS:
        raise ValueError(f"grid {grid!r}: expected one of {', '.join(GRIDS)}")
    if grid == "quick":
        return SIZES["quick"]
    return (DEFAULT_SIZES if grid == "default" else SIZES)[device]


def build_grid(device: str, cells, dtypes, families, grid: str) -> list[Case]:
    """Every case of the run, in a stable order (cell, dtype, then sizes by family)."""
    table = sizes(device, grid)
    cases = []
    for cell in cells:
        for dtype in dtypes:
            tags: dict[tuple, list] = {}
            for family in families:
                for size in table[family]:
                    tags.setdefault(size, []).append(family)
            for (B, T, H), fams in tags.items():
                cases.append(Case(cell, B, T, H, dtype, tuple(fams)))
    return cases
