"""The size grid: which (cell, B, T, H, dtype, call) cases a run measures.

Seven families of sizes, one list per device:

============  =====================================  ======================================
family        GPU (the benchmark's grid)             CPU (scaled to 2 shared cores)
============  =====================================  ======================================
latency       B 1, 16, 64 x H 256, 768, 1024; T 1024  B 1, 16, 64 x H 64, 128, 256; T 256
throughput    B 256; H 512, 1024; T 256               B 128; H 128, 256; T 64
long          B 16, H 768; T 2k, 4k, 8k, 16k          B 4, H 128; T 512, 2k, 8k
headline      B 16, H 768, T 1024 (the GPU targets)   B 32, H 256, T 256 (README's CPU table)
peers         the CPU sizes (the peers are CPU only)  LSTM B32 T256 H256, B1 T256 H128,
                                                     B64 T64 H128; GRU B1 T256 H128,
                                                     B32 T256 H256; RNN B32 T256 H256
step          B 1, 16 x H 64, 256, and B 1 H 8;       the same
              T 1, as a sequence call and as a cell
              call
short         B 1, 16, 64 x H 256, 1024; T 16, 64    B 1, 16, 64 x H 32, 64, 128, 256;
                                                     T 8, 32
bf16          the CPU sizes                          B 32 T 128 H 256, B 64 T 64 H 512,
                                                     B 16 T 128 H 512, in bfloat16 and
                                                     float32 whatever --dtypes
packed        (CPU only)                             232 sequences, longest 100, the others
                                                     of exponential lengths (mean 17.5),
                                                     I 64, H 128; float32, forward+backward
============  =====================================  ======================================

``peers`` is the table of rnnkern against the CPU inference engines a user
would pick instead (ONNX Runtime, OpenVINO; bench/candidates/peers.py): its sizes are set
per cell.  ``step`` is the one-step regime (RL agents stepping one observation at a
time, streaming inference, token-by-token generation): every size is measured twice,
as a T=1 call of the sequence module (``rnnkern.LSTM`` vs ``torch.nn.LSTM``) and as a
call of the cell (``rnnkern.LSTMCell`` vs ``torch.nn.LSTMCell``).  ``short`` is the
short-sequence regime between them (a truncated-BPTT window, an RL library's chunk of a
rollout, a streaming chunk): there a call's fixed costs weigh against its steps, and
``backend="auto"`` decides such calls by these rows rather than by T >= 64 ones.  ``bf16`` measures
bfloat16 beside float32 at the same sizes, whatever ``--dtypes`` says, so that the
report gives each candidate's bf16 speed against its own float32: what bf16 is worth
where the CPU has the bf16 dot-product instruction (AVX512_BF16, which oneDNN's bf16
RNNs and rnnkern's bf16 pairs run on).  ``packed`` is a study rather than cases of the
grid (bench/packed.py, ``python -m bench.packed`` on its own): a PackedSequence of a few
long and many short sequences, what splitting RL trajectories at episode ends gives,
against torch.nn's packed path (which costs the real steps), with rnnkern's ``lengths=``
on the same batch padded and its dense batch of the same number of steps; its results go
to the JSON's ``packed`` list and the report's packed table.  None of these five is in the
default run (``--families peers step short bf16 packed`` asks for them; ``--full`` and
``--quick`` include them).

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

FAMILIES = ("latency", "throughput", "long", "headline", "peers", "step", "short", "bf16", "packed",
            "speech")
#: Families that are studies of their own (bench/packed.py, bench/speech.py), not cases of
#: the grid.
STUDY_FAMILIES = ("packed", "speech")
#: The packed study's batch: (longest T, sequences B, I, H, mean length of the others).
PACKED_SIZES = {"cpu": (100, 232, 64, 128, 17.5), "quick": (12, 9, 4, 8, 3.0)}
#: The families of ``python -m bench`` without --families (--full and --quick: all).
DEFAULT_FAMILIES = ("latency", "throughput", "long", "headline")
#: How a case calls its module: "sequence" (nn.LSTM & co. on [T, B, I]) or "cell"
#: (nn.LSTMCell & co. on [B, I], one step).
CALLS = ("sequence", "cell")
#: The calls of each family's sizes (default: sequence calls only).
FAMILY_CALLS = {"step": CALLS}
#: Families measured in their own dtypes whatever --dtypes says.
FAMILY_DTYPES = {"bf16": ("bfloat16", "float32")}
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


#: The peer table: (B, T, H) per cell (ReLU RNN: the tanh one's size).
PEER_SIZES = {
    "lstm": [(32, 256, 256), (1, 256, 128), (64, 64, 128)],
    "gru": [(1, 256, 128), (32, 256, 256)],
    "rnn_tanh": [(32, 256, 256)],
    "rnn_relu": [(32, 256, 256)],
}
#: The one-step sizes, plus B=1 H=8 (a call that is almost nothing but
#: its per-call cost).
STEP_SIZES = [(1, 1, 8)] + _cross((1, 16), (64, 256), (1,))
#: The bfloat16 sizes: issue 24's B=32 T=128 H=256 and B=64 T=64 H=512, and B=16 T=128
#: H=512, a small batch whose weights outgrow L2, where no other CPU row stands near
#: (an Intel Xeon's two-thread LSTM forward there: 0.88x torch.nn's while the nearest
#: rows, B=16-32 H=256, said 1.28-1.29x, 2026-12-06).
BF16_SIZES = [(32, 128, 256), (64, 64, 512), (16, 128, 512)]
#: The short sequences (T 8 and 32 on the CPU), B 1, 16 and 64.
SHORT_SIZES = {"cuda": _cross((1, 16, 64), (256, 1024), (16, 64)),
               "cpu": _cross((1, 16, 64), (32, 64, 128, 256), (8, 32))}


#: (B, T, H) per family, per device kind, per mode; a family whose sizes depend on
#: the cell (peers) maps each cell to its list.
SIZES = {
    "cuda": {
        "latency": _cross((1, 16, 64), (256, 768, 1024), (1024,)),
        "throughput": _cross((256,), (512, 1024), (256,)),
        "long": _cross((16,), (768,), (2048, 4096, 8192, 16384)),
        "headline": [(16, 1024, 768)],
        "peers": PEER_SIZES,
        "step": STEP_SIZES,
        "short": SHORT_SIZES["cuda"],
        "bf16": BF16_SIZES,
    },
    "cpu": {
        "latency": _cross((1, 16, 64), (64, 128, 256), (256,)),
        "throughput": _cross((128,), (128, 256), (64,)),
        "long": _cross((4,), (128,), (512, 2048, 8192)),
        "headline": [(32, 256, 256)],
        "peers": PEER_SIZES,
        "step": STEP_SIZES,
        "short": SHORT_SIZES["cpu"],
        "bf16": BF16_SIZES,
    },
    "quick": {
        "latency": [(1, 32, 32), (8, 32, 64)],
        "throughput": [(64, 16, 64)],
        "long": [(2, 256, 32)],
        "headline": [(8, 32, 64)],
        "peers": {cell: [(4, 16, 32)] for cell in PEER_SIZES},
        "step": [(1, 1, 32)],
        "short": [(4, 8, 16)],
        "bf16": [(4, 16, 32)],
    },
}


@dataclass(frozen=True)
class Case:
    """One size of one cell in one dtype; measured forward and forward + backward.
    ``call`` is "sequence" (the layer: nn.LSTM & co.) or "cell" (nn.LSTMCell & co.,
    one step: T is then 1)."""
    cell: str
    B: int
    T: int
    H: int
    dtype: str
    families: tuple
    call: str = "sequence"

    def __post_init__(self):
        if self.call not in CALLS:
            raise ValueError(f"call {self.call!r}: expected one of {', '.join(CALLS)}")
        if self.call == "cell" and self.T != 1:
            raise ValueError(f"a cell call is one step: T must be 1, got {self.T}")

    @property
    def I(self) -> int:  # noqa: E743  (the input size, as in the formulas)
        return self.H

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def label(self) -> str:
        if self.call == "cell":
            return f"{self.cell} cell B{self.B} H{self.H} {self.dtype}"
        return f"{self.cell} B{self.B} T{self.T} H{self.H} {self.dtype}"


#: ``python -m bench`` without --full: a few sizes of each family, so that every cell
#: and phase is measured at representative sizes in minutes (under 5 on two CPU cores).
DEFAULT_SIZES = {
    "cuda": {
        "latency": [(1, 1024, 256), (64, 1024, 1024)],
        "throughput": [(256, 256, 1024)],
        "long": [(16, 4096, 768)],
        "headline": [(16, 1024, 768)],
        "peers": PEER_SIZES,
        "step": STEP_SIZES,
        "short": SHORT_SIZES["cuda"],
        "bf16": BF16_SIZES,
    },
    "cpu": {
        "latency": [(1, 256, 128), (16, 256, 128)],
        "throughput": [(128, 64, 256)],
        "long": [(4, 2048, 128)],
        "headline": [(32, 256, 256)],
        "peers": PEER_SIZES,
        "step": STEP_SIZES,
        "short": SHORT_SIZES["cpu"],
        "bf16": BF16_SIZES,
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


def family_sizes(table: dict, family: str, cell: str) -> list:
    """The (B, T, H) of one family for one cell (peers: the cell's own list)."""
    entry = table[family]
    return list(entry.get(cell, ())) if isinstance(entry, dict) else list(entry)


def build_grid(device: str, cells, dtypes, families, grid: str) -> list[Case]:
    """Every case of the run, in a stable order (cell, dtype, then sizes by family;
    a step size's sequence call before its cell call).  A family of FAMILY_DTYPES
    runs in its own dtypes, not in ``dtypes``."""
    table = sizes(device, grid)
    every = list(dict.fromkeys([*dtypes, *(d for f in families for d in FAMILY_DTYPES.get(f, ()))]))
    cases = []
    for cell in cells:
        for dtype in every:
            tags: dict[tuple, list] = {}
            for family in families:
                if family in STUDY_FAMILIES or dtype not in FAMILY_DTYPES.get(family, dtypes):
                    continue
                for size in family_sizes(table, family, cell):
                    for call in FAMILY_CALLS.get(family, ("sequence",)):
                        tags.setdefault((*size, call), []).append(family)
            for (B, T, H, call), fams in tags.items():
                cases.append(Case(cell, B, T, H, dtype, tuple(fams), call))
    return cases
