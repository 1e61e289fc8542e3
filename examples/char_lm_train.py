"""Character-level language model on rnnkern: the trainer behind ``examples/char_lm.py``.

A recurrent network reads text one character at a time and predicts the next one
(softmax over the characters, cross-entropy loss); it is judged by its
perplexity, ``exp(mean cross-entropy)``: the number of characters it is, on
average, as unsure between as a uniform guess would be.  A model that has learnt
nothing scores the vocabulary size; one that knows the letter frequencies, about
20 on English; context is what brings it lower.

The pieces, in the order the data flows (``examples/char_lm.py`` is the command line):

- corpus: :func:`load_text` (the documentation shipped with Python itself,
  ``pydoc_data.topics``, so it works offline, or a file), :class:`Vocab`,
  :func:`split_held_out`;
- batches: :class:`OffsetBatches` (``S`` parallel streams read at offsets,
  for stateful truncated BPTT) and :class:`RandomChunks` (chunks at random
  offsets, state reset per batch); both shard their streams across DDP ranks;
- model: :class:`CharLM` (one-hot or embedding input, ``rnnkern.RNN`` / ``GRU`` /
  ``LSTM``, output layer), whose :meth:`CharLM.cells` and :meth:`CharLM.step` run the
  same weights one token at a time through rnnkern's cells (the fused step op);
- :func:`train` (Adam, gradient clipping by global norm, perplexity per epoch on the
  training and held-out text, checkpoints, DDP), :func:`evaluate`, :func:`generate`,
  :func:`plot_perplexity`, :func:`save_checkpoint` / :func:`load_model`.

Tensors are time-major, as in the recurrent layers: tokens ``[T, B]``, logits ``[T, B, V]``.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import rnnkern

__all__ = ["Config", "Vocab", "OffsetBatches", "RandomChunks", "CharLM", "EpochStats", "Trained",
           "load_text", "split_held_out", "make_batches", "train", "evaluate", "perplexity",
           "generate", "save_checkpoint", "load_checkpoint", "load_model", "plot_perplexity",
           "init_distributed", "CELLS", "BACKENDS", "DTYPES", "SAMPLERS"]

#: Recurrent cells the model can use (rnnkern's names; ``gru_reset_before`` is the
#: classic GRU, which torch.nn lacks).
CELLS = ("lstm", "gru", "gru_reset_before", "rnn_tanh", "rnn_relu")
#: rnnkern's backends, plus ``torch``: the same model on torch.nn's modules, the baseline.
BACKENDS = tuple(b for b in rnnkern.ops.BACKENDS) + ("torch",)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
SAMPLERS = ("sequential", "random")

State = Tuple[Tensor, ...]  # (h,) or (h, c), each [layers, B, hidden]


# ------------------------------------------------------------------ corpus ----

def load_text(path: Optional[str] = None, max_chars: Optional[int] = None) -> str:
    """The text of ``path`` (UTF-8), or by default the documentation that ships with
    Python (``pydoc_data.topics``: about 460 000 characters of English prose and code,
    present on every installation, so the example needs no download).  ``max_chars``
    keeps only the beginning."""
    if path is None:
        from pydoc_data.topics import topics
        text = "\n".join(topics[key] for key in sorted(topics))
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    if max_chars is not None:
        if max_chars < 2:
            raise ValueError(f"max_chars: expected at least 2 characters, got {max_chars}")
        text = text[:max_chars]
    if len(text) < 2:
        raise ValueError(f"text: expected at least 2 characters, {path or 'the corpus'} has {len(text)}")
    return text


class Vocab:
    """The characters of a text, each with an id (sorted, so the same text always
    gives the same ids)."""

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars) or not chars:
            raise ValueError("chars: expected a non-empty string of distinct characters")
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "Vocab":
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        """Ids [len(text)] (int64)."""
        try:
            return torch.tensor([self._ids[c] for c in text], dtype=torch.int64)
        except KeyError:
            unknown = sorted(set(text) - set(self._ids))
            raise ValueError(f"text contains characters outside the vocabulary: {unknown!r}") from None

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


def split_held_out(ids: Tensor, fraction: float) -> Tuple[Tensor, Tensor]:
    """(training, held-out): the held-out text is the last ``fraction`` of the corpus,
    one contiguous piece, so that no training chunk overlaps it."""
    if not 0 <= fraction < 1:
        raise ValueError(f"held_out: expected a fraction in [0, 1), got {fraction}")
    n_held = int(len(ids) * fraction)
    if fraction > 0 and n_held < 2:
        raise ValueError(f"held_out: {fraction} of {len(ids)} characters leaves fewer than 2 "
                         "held-out characters; use a larger fraction or text")
    return ids[: len(ids) - n_held], ids[len(ids) - n_held:]


# ----------------------------------------------------------------- batches ----

class OffsetBatches:
    """Mini-batches for stateful truncated BPTT.

    The training text (length N, read as a ring) is read by ``S = batch * world``
    parallel streams; stream ``s`` starts at ``s * N // S``.  Each batch holds the
    next ``bptt`` characters of every stream ([bptt, batch] inputs, and the targets,
    the same shifted by one), continuing exactly where the previous batch stopped
    -- also across epochs -- so the hidden state left by one batch is the right
    initial state for the next.  A stream that reaches the end of the text wraps
    to its beginning ("return to the head").

    Under data-parallel training rank ``r`` reads streams ``r*batch .. (r+1)*batch - 1``:
    a contiguous share of the text, and together the ranks read exactly the batch a
    single process with ``S`` streams would.  One epoch is ``ceil(N / (S * bptt))``
    batches: every character is read once (the last batch overlaps a little).
    """

    stateful = True

    def __init__(self, ids: Tensor, batch: int, bptt: int, rank: int = 0, world: int = 1):
        _check_batches_args(ids, batch, bptt, rank, world)
        self.ids, self.batch, self.bptt = ids, batch, bptt
        n, streams = len(ids), batch * world
        self.starts = torch.arange(rank * batch, (rank + 1) * batch) * n // streams
        self.steps = -(-n // (streams * bptt))
        self.position = 0  # characters each stream has read so far (mod N)

    def __len__(self) -> int:
        return self.steps

    def batches(self, epoch: int = 0) -> Iterator[Tuple[Tensor, Tensor]]:
        """The next ``len(self)`` batches (inputs [bptt, batch], targets [bptt, batch])."""
        del epoch  # the position alone says where the streams are
        offsets = torch.arange(self.bptt + 1).unsqueeze(1)
        for _ in range(self.steps):
            chunk = self.ids[(self.starts + self.position + offsets) % len(self.ids)]
            self.position = (self.position + self.bptt) % len(self.ids)
            yield chunk[:-1], chunk[1:]

    def state_dict(self) -> dict:
        return {"kind": "sequential", "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


class RandomChunks:
    """Random sampling: each epoch cuts the training text into
    non-overlapping chunks of ``bptt`` characters from a random offset in
    ``[0, bptt)``, shuffles them and serves ``S = batch * world`` chunks per batch.
    Neighbouring examples are unrelated, so the hidden state starts from zero in
    every batch (``stateful = False``).

    The order depends only on ``(seed, epoch)``, so every rank draws the same global
    batch and takes its own ``batch`` chunks of it; every epoch has the same number
    of batches on every rank (the count for the largest offset)."""

    stateful = False

    def __init__(self, ids: Tensor, batch: int, bptt: int, rank: int = 0, world: int = 1,
                 seed: int = 0):
        _check_batches_args(ids, batch, bptt, rank, world)
        self.ids, self.batch, self.bptt, self.seed = ids, batch, bptt, seed
        self.rank, self.streams = rank, batch * world
        # Chunk starts s need s + bptt <= N - 1 (the last target); fewest at offset bptt - 1.
        self.steps = len(range(bptt - 1, len(ids) - bptt, bptt)) // self.streams
        if self.steps == 0:
            raise ValueError(f"text: {len(ids)} characters hold fewer than {self.streams} chunks "
                             f"of bptt={bptt}; use a longer text or fewer streams")

    def __len__(self) -> int:
        return self.steps

    def batches(self, epoch: int = 0) -> Iterator[Tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        offset = int(torch.randint(self.bptt, (), generator=g))
        starts = torch.arange(offset, len(self.ids) - self.bptt, self.bptt)
        starts = starts[torch.randperm(len(starts), generator=g)]
        offsets = torch.arange(self.bptt + 1).unsqueeze(1)
        for k in range(self.steps):
            first = k * self.streams + self.rank * self.batch
            chunk = self.ids[starts[first: first + self.batch] + offsets]
            yield chunk[:-1], chunk[1:]

    def state_dict(self) -> dict:
        return {"kind": "random"}

    def load_state_dict(self, state: dict) -> None:
        pass  # the order is a function of (seed, epoch)


def _check_batches_args(ids: Tensor, batch: int, bptt: int, rank: int, world: int) -> None:
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"ids: expected a 1-D int64 tensor, got {ids.dim()}-D {ids.dtype}")
    if batch < 1:
        raise ValueError(f"batch: expected at least 1 stream, got {batch}")
    if bptt < 1:
        raise ValueError(f"bptt: expected at least 1 step, got {bptt}")
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < world ({world}), got {rank}")
    if len(ids) < max(2, bptt + 1):
        raise ValueError(f"text: {len(ids)} characters are too few for bptt={bptt}")


def make_batches(kind: str, ids: Tensor, batch: int, bptt: int, rank: int = 0, world: int = 1,
                 seed: int = 0):
    """``"sequential"`` -> :class:`OffsetBatches`, ``"random"`` -> :class:`RandomChunks`."""
    if kind == "sequential":
        return OffsetBatches(ids, batch, bptt, rank, world)
    if kind == "random":
        return RandomChunks(ids, batch, bptt, rank, world, seed)
    raise ValueError(f"sampler: expected one of {', '.join(SAMPLERS)}, got {kind!r}")


# ------------------------------------------------------------------- model ----

_LAYERS = {"lstm": (rnnkern.LSTM, nn.LSTM), "gru": (rnnkern.GRU, nn.GRU),
           "gru_reset_before": (rnnkern.GRU, None), "rnn_tanh": (rnnkern.RNN, nn.RNN),
           "rnn_relu": (rnnkern.RNN, nn.RNN)}
_CELL_MODULES = {"lstm": (rnnkern.LSTMCell, nn.LSTMCell), "gru": (rnnkern.GRUCell, nn.GRUCell),
                 "gru_reset_before": (rnnkern.GRUCell, None),
                 "rnn_tanh": (rnnkern.RNNCell, nn.RNNCell), "rnn_relu": (rnnkern.RNNCell, nn.RNNCell)}


def _cell_kwargs(cell: str, backend: str) -> dict:
    kw = {} if backend == "torch" else {"backend": backend}
    if cell.startswith("rnn_"):
        kw["nonlinearity"] = cell[4:]
    if cell == "gru_reset_before":
        kw["reset_after"] = False
    return kw


def check_model_args(cell: str, backend: str) -> None:
    if cell not in CELLS:
        raise ValueError(f"cell: expected one of {', '.join(CELLS)}, got {cell!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch" and _LAYERS[cell][1] is None:
        raise ValueError(f"backend: 'torch' (torch.nn) has no {cell}; use an rnnkern backend")


class CharLM(nn.Module):
    """Characters -> (one-hot or embedding) -> recurrent layers -> linear -> logits.

    ``embed=0`` feeds one-hot vectors; otherwise an ``nn.Embedding`` of
    that width.  ``backend`` is an rnnkern backend, or ``"torch"`` for torch.nn's
    modules (the baseline); the parameter names are the same either way, so a
    checkpoint moves freely between them."""

    def __init__(self, vocab_size: int, cell: str = "lstm", hidden: int = 256, layers: int = 1,
                 embed: int = 64, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        check_model_args(cell, backend)
        for name, value, least in (("vocab_size", vocab_size, 1), ("hidden", hidden, 1),
                                   ("layers", layers, 1), ("embed", embed, 0)):
            if value < least:
                raise ValueError(f"{name}: expected at least {least}, got {value}")
        self.vocab_size, self.cell, self.hidden, self.layers, self.embed = (
            vocab_size, cell, hidden, layers, embed)
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        self.embedding = nn.Embedding(vocab_size, embed, **factory) if embed else None
        layer_cls = _LAYERS[cell][1 if backend == "torch" else 0]
        self.rnn = layer_cls(embed or vocab_size, hidden, layers, **_cell_kwargs(cell, backend),
                             **factory)
        self.head = nn.Linear(hidden, vocab_size, **factory)

    def spec(self) -> dict:
        """What it takes to rebuild this model (stored in checkpoints)."""
        return {"cell": self.cell, "hidden": self.hidden, "layers": self.layers, "embed": self.embed}

    def inputs(self, tokens: Tensor) -> Tensor:
        """The input vectors of ``tokens`` (any shape): [..., embed or vocab_size]."""
        if self.embedding is not None:
            return self.embedding(tokens)
        return F.one_hot(tokens, self.vocab_size).to(self.head.weight.dtype)

    def forward(self, tokens: Tensor, state: Optional[State] = None) -> Tuple[Tensor, State]:
        """tokens [T, B] -> logits [T, B, V], final state ((h,) or (h, c), [layers, B, hidden])."""
        hx = None if state is None else (state if self.cell == "lstm" else state[0])
        out, hx = self.rnn(self.inputs(tokens), hx)
        return self.head(out), (tuple(hx) if self.cell == "lstm" else (hx,))

    def cells(self, backend: Optional[str] = None) -> List[nn.Module]:
        """One cell per layer (rnnkern.LSTMCell / GRUCell / RNNCell, or torch.nn's
        for backend 'torch') sharing this model's parameters -- the same tensors,
        not copies -- for running the trained layers one token at a time."""
        backend = self.backend if backend is None else backend
        check_model_args(self.cell, backend)
        cls = _CELL_MODULES[self.cell][1 if backend == "torch" else 0]
        cells = []
        for layer in range(self.layers):
            # Built on the meta device (no memory, no draw from the random generator),
            # then given the layer's own parameters.
            cell = cls(self.rnn.input_size if layer == 0 else self.hidden, self.hidden,
                       bias=self.rnn.bias, device="meta", **_cell_kwargs(self.cell, backend))
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                if getattr(cell, name) is not None:
                    setattr(cell, name, getattr(self.rnn, f"{name}_l{layer}"))
            cells.append(cell)
        return cells

    def step(self, cells: Sequence[nn.Module], tokens: Tensor, state: Optional[list] = None):
        """One character per sequence through ``cells`` (from :meth:`cells`):
        tokens [B] -> logits [B, V], and the new per-layer state (a list of ``h``,
        or of ``(h, c)`` for LSTM) to pass to the next call."""
        x = self.inputs(tokens)
        new_state = []
        for layer, cell in enumerate(cells):
            s = cell(x, None if state is None else state[layer])
            new_state.append(s)
            x = s[0] if isinstance(s, tuple) else s
        return self.head(x), new_state


# ----------------------------------------------------------- distributed ----

def init_distributed(device_type: str = "cpu") -> Tuple[int, int]:
    """(rank, world size).  Under ``torchrun`` (WORLD_SIZE > 1 in the environment)
    joins the process group first: gloo for CPU training, nccl for CUDA."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # DistributedDataParallel imports torch._dynamo.  Imported after
        # init_process_group, torch._dynamo (or torch._inductor) leaves the
        # default group referenced from C++: destroy_process_group then no
        # longer joins gloo's threads (seen on torch 2.14.1), they run on into the
        # interpreter's exit, and a rank sometimes aborted there ("terminate
        # called without an active exception").  Imported first, the group
        # goes, threads and all, at destroy_process_group.
        import torch._dynamo  # noqa: F401
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shutdown_distributed() -> None:
    """Leaves the process group, if any, once every rank has got here.  A rank
    that tore gloo down while another was still at work (rank 0 checkpointing
    after gathering the streams' states, then sampling) sometimes aborted inside
    gloo ("terminate called without an active exception", 1 run in 20 here)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _device(name: str, world: int) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _all_reduce_sum(values: List[float], device: torch.device) -> List[float]:
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _gather_streams(state: Optional[State]) -> Optional[State]:
    """The hidden state of every rank's streams, concatenated along the batch: the
    state of all ``batch * world`` streams, in stream order (rank-major)."""
    if state is None or not dist.is_initialized():
        return state
    gathered = []
    for s in state:
        parts = [torch.empty_like(s) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, s.contiguous())
        gathered.append(torch.cat(parts, dim=1))
    return tuple(gathered)


# ---------------------------------------------------------------- training ----

@dataclass
class Config:
    """Everything :func:`train` needs (the command line's options, one to one)."""
    cell: str = "lstm"
    layers: int = 1
    hidden: int = 256
    embed: int = 64              # 0: one-hot input
    backend: str = "auto"        # rnnkern backend, or "torch" for the torch.nn baseline
    device: str = "cpu"
    dtype: str = "float32"       # bfloat16 / float16: mixed precision (see train())
    bptt: int = 64               # truncated-BPTT chunk length
    batch: int = 32              # streams per process (x world size in total under DDP)
    epochs: int = 10             # total, counting epochs already in a resumed checkpoint
    lr: float = 2e-3             # Adam
    clip: float = 1.0            # max global gradient norm (0: no clipping)
    sampler: str = "sequential"  # or "random"
    held_out: float = 0.1        # fraction of the text (its end) kept for evaluation
    seed: int = 0
    text: Optional[str] = None   # a UTF-8 file; None: Python's own documentation
    max_chars: Optional[int] = None
    steps_per_epoch: Optional[int] = None  # cap on batches per epoch (quick runs)
    checkpoint: Optional[str] = None       # saved after every epoch (rank 0)
    resume: bool = False                   # continue from `checkpoint`
    plot: Optional[str] = None             # PNG of perplexity per epoch, redrawn every epoch
    progress: bool = True                  # tqdm bar (rank 0)
    verbose: bool = True                   # a line per epoch (rank 0)

    def check(self) -> None:
        check_model_args(self.cell, self.backend)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler: expected one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        for name in ("layers", "hidden", "bptt", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected at least 1, got {getattr(self, name)}")
        for name in ("embed", "epochs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected at least 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected a positive learning rate, got {self.lr}")
        if not self.clip >= 0:
            raise ValueError(f"clip: expected a norm >= 0 (0: no clipping), got {self.clip}")
        if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch: expected at least 1, got {self.steps_per_epoch}")
        if self.resume and not self.checkpoint:
            raise ValueError("resume: needs checkpoint= (the file to resume from)")


@dataclass
class EpochStats:
    epoch: int                     # 1-based
    train_ppl: float               # exp(mean cross-entropy) over the epoch's training batches
    held_out_ppl: Optional[float]  # exp(mean cross-entropy) over the held-out text, after the epoch
    seconds: float                 # training time of the epoch (evaluation excluded)
    tokens: int                    # characters trained on in the epoch (all ranks)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class Trained:
    model: CharLM
    vocab: Vocab
    history: List[EpochStats]
    step_losses: List[float]  # this run's training loss per batch (this rank's batch)


def perplexity(mean_nll: float) -> float:
    """exp(mean cross-entropy in nats)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return float("inf")


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # half types: softmax in float32


def _precision(dtype: torch.dtype) -> Tuple[torch.dtype, Optional[torch.dtype]]:
    """(parameter dtype, autocast dtype or None).  Half types train in mixed
    precision: float32 parameters and optimizer state (Adam's moments and epsilon
    underflow in float16), the layers computing in the half type under autocast."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32, dtype
    return dtype, None


def _detach(state: Optional[State]) -> Optional[State]:
    return None if state is None else tuple(s.detach() for s in state)


def _eval_streams(ids: Tensor, streams: int) -> Tuple[Tensor, Tensor]:
    """All ``len(ids) - 1`` (input, target) pairs as ``streams`` contiguous rows
    [streams, L], padded at the end (input 0, target -100: ignored)."""
    pieces = torch.tensor_split(torch.arange(len(ids) - 1), streams)
    width = max(len(p) for p in pieces)
    x = torch.zeros(streams, width, dtype=torch.int64)
    y = torch.full((streams, width), -100, dtype=torch.int64)
    for row, p in enumerate(pieces):
        x[row, : len(p)] = ids[p]
        y[row, : len(p)] = ids[p + 1]
    return x, y


@torch.no_grad()
def evaluate(model: CharLM, ids: Tensor, batch: int, bptt: int,
             autocast: Optional[torch.dtype] = None) -> float:
    """Mean cross-entropy (nats) of predicting every character of ``ids`` from the
    ones before it: the text is cut into ``batch * world`` contiguous streams (rank
    ``r`` runs its ``batch`` of them) read in chunks of ``bptt`` with the state
    carried across chunks; every one of the ``len(ids) - 1`` predictions counts once.
    ``autocast``: compute in this half type (as in mixed-precision training)."""
    if len(ids) < 2:
        raise ValueError(f"ids: expected at least 2 characters to evaluate, got {len(ids)}")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = model.head.weight.device
    x, y = _eval_streams(ids, batch * world)
    x, y = (t[rank * batch: (rank + 1) * batch].t().to(device) for t in (x, y))
    was_training = model.training
    model.eval()
    nll, count, state = 0.0, 0, None
    for t0 in range(0, x.size(0), bptt):
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits, state = model(x[t0: t0 + bptt], state)
        target = y[t0: t0 + bptt]
        nll += F.cross_entropy(logits.flatten(0, 1).to(_loss_dtype(logits.dtype)), target.flatten(),
                               ignore_index=-100, reduction="sum").item()
        count += int((target != -100).sum())
    model.train(was_training)
    nll, count = _all_reduce_sum([nll, count], device)
    return nll / count


def train(cfg: Config, text: Optional[str] = None) -> Trained:
    """Trains (or resumes training of) a :class:`CharLM` as ``cfg`` says and returns
    it with its per-epoch history.  ``text`` overrides ``cfg.text``.  Under
    ``torchrun`` it trains data-parallel (DDP) on every rank; rank 0 writes the
    checkpoint and the plot.

    ``float32`` / ``float64`` train in that type throughout; ``bfloat16`` / ``float16``
    in mixed precision: float32 parameters, the forward under ``torch.autocast``
    (rnnkern's modules and cells honour it), float16 with a gradient scaler."""
    cfg.check()
    rank, world = init_distributed(torch.device(cfg.device).type)
    device = _device(cfg.device, world)
    dtype, autocast = _precision(DTYPES[cfg.dtype])
    lead = rank == 0

    ckpt = load_checkpoint(cfg.checkpoint) if cfg.resume else None
    if ckpt and lead and cfg.verbose:
        print(f"resuming {cfg.checkpoint} after epoch {len(ckpt['history'])}: the model's "
              f"shape {ckpt['model']} comes from the checkpoint", file=sys.stderr)
    text = load_text(cfg.text, cfg.max_chars) if text is None else text
    vocab = Vocab(ckpt["vocab"]) if ckpt else Vocab.from_text(text)
    train_ids, held_ids = split_held_out(vocab.encode(text), cfg.held_out)
    spec = ckpt["model"] if ckpt else {"cell": cfg.cell, "hidden": cfg.hidden,
                                       "layers": cfg.layers, "embed": cfg.embed}

    torch.manual_seed(cfg.seed)
    model = CharLM(len(vocab), **spec, backend=cfg.backend, device=device, dtype=dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast == torch.float16)
    batches = make_batches(cfg.sampler, train_ids, cfg.batch, cfg.bptt, rank, world, cfg.seed)
    history: List[EpochStats] = []
    state: Optional[State] = None
    if ckpt:
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        if ckpt["sampler"]["kind"] == cfg.sampler:
            batches.load_state_dict(ckpt["sampler"])
        history = [EpochStats(**e) for e in ckpt["history"]]
        state = _resume_state(ckpt.get("hidden"), batches, rank, device, dtype)
    net = model
    if world > 1:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)

    step_losses: List[float] = []
    for epoch in range(len(history), cfg.epochs):
        mean_loss, seconds, tokens, state, losses = _train_epoch(
            net, model, optimizer, scaler, autocast, batches, state, cfg, epoch, device, world, lead)
        step_losses += losses
        held = evaluate(model, held_ids, cfg.batch, cfg.bptt, autocast) if len(held_ids) else None
        stats = EpochStats(epoch + 1, perplexity(mean_loss),
                           None if held is None else perplexity(held), seconds, tokens)
        history.append(stats)
        if lead and cfg.verbose:
            held_txt = "" if held is None else f"  held-out ppl {stats.held_out_ppl:7.3f}"
            print(f"epoch {stats.epoch:3d}/{cfg.epochs}  train ppl {stats.train_ppl:7.3f}{held_txt}"
                  f"  {seconds:6.1f} s  {stats.tokens_per_s / 1e3:7.1f}k tok/s", flush=True)
        all_states = _gather_streams(state if batches.stateful else None)
        if lead and cfg.checkpoint:
            save_checkpoint(cfg.checkpoint, model, vocab, optimizer, batches, history, all_states, cfg,
                            scaler)
        if lead and cfg.plot:
            plot_perplexity(history, cfg.plot, title=_plot_title(model, cfg, world))
    return Trained(model, vocab, history, step_losses)


def _train_epoch(net, model: CharLM, optimizer, scaler, autocast: Optional[torch.dtype], batches,
                 state, cfg: Config, epoch: int, device: torch.device, world: int, lead: bool):
    steps = len(batches) if cfg.steps_per_epoch is None else min(len(batches), cfg.steps_per_epoch)
    bar = None
    if lead and cfg.progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="batch",
                   file=sys.stderr, dynamic_ncols=True, leave=False)
    tokens_per_step = cfg.batch * cfg.bptt * world
    loss_dtype = _loss_dtype(DTYPES[cfg.dtype])
    amp = autocast is not None
    model.train()
    losses = []
    _sync(device)
    start = time.perf_counter()
    for step, (x, y) in enumerate(itertools.islice(batches.batches(epoch), steps)):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if not batches.stateful:
            state = None
        with torch.autocast(device.type, dtype=autocast, enabled=amp):
            logits, state = net(x, state)
        loss = F.cross_entropy(logits.flatten(0, 1).to(loss_dtype), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        # Under DDP the gradients arrive averaged over the ranks.  The scaler is a
        # no-op except in float16 (where small gradients would underflow).
        scaler.scale(loss).backward()
        if cfg.clip > 0:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        scaler.step(optimizer)
        scaler.update()
        state = _detach(state)  # truncated BPTT: the next chunk starts from this state
        losses.append(loss.detach())
        if bar is not None and (step % 10 == 9 or step + 1 == steps):
            elapsed = time.perf_counter() - start
            recent = torch.stack(losses[-10:]).mean().item()
            bar.set_postfix_str(f"{tokens_per_step * (step + 1) / elapsed / 1e3:.1f}k tok/s  "
                                f"ppl {perplexity(recent):.2f}", refresh=False)
            bar.update(step + 1 - bar.n)
    _sync(device)
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    losses = torch.stack(losses).double().tolist()
    total, count = _all_reduce_sum([sum(losses), len(losses)], device)
    return total / count, seconds, tokens_per_step * len(losses), state, losses


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _resume_state(hidden: Optional[State], batches, rank: int, device, dtype) -> Optional[State]:
    """This rank's share of the saved stream states, when the sampler is stateful and
    the number of streams has not changed (otherwise the streams restart from zero)."""
    if hidden is None or not batches.stateful:
        return None
    streams = batches.batch * (dist.get_world_size() if dist.is_initialized() else 1)
    if hidden[0].size(1) != streams:
        if rank == 0:
            print(f"resume: the checkpoint holds {hidden[0].size(1)} streams, this run reads "
                  f"{streams}; their hidden states start from zero", file=sys.stderr)
        return None
    sl = slice(rank * batches.batch, (rank + 1) * batches.batch)
    return tuple(h[:, sl].to(device=device, dtype=dtype) for h in hidden)


# -------------------------------------------------------------- sampling ----

@torch.no_grad()
def generate(model: CharLM, vocab: Vocab, prompt: str, length: int, temperature: float = 1.0,
             seed: Optional[int] = None, backend: Optional[str] = None) -> str:
    """``prompt`` followed by ``length`` sampled characters.

    Every character, the prompt's included, goes through the model one at a time:
    the trained layers run as cells (:meth:`CharLM.cells`, one fused step op per
    layer and character).  The next character is drawn from
    ``softmax(logits / temperature)``; ``temperature=0`` takes the most likely one."""
    if not prompt:
        raise ValueError("prompt: expected at least one character to start from")
    if length < 0:
        raise ValueError(f"length: expected at least 0, got {length}")
    if not temperature >= 0:
        raise ValueError(f"temperature: expected a value >= 0 (0: most likely character), got {temperature}")
    device = model.head.weight.device
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    cells = model.cells(backend)
    state = None
    logits = None
    for token in vocab.encode(prompt).to(device):
        logits, state = model.step(cells, token.view(1), state)
    out = []
    for _ in range(length):
        scores = logits[0].double().cpu()
        if temperature == 0:
            token = int(scores.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(scores / temperature, 0), 1, generator=g))
        out.append(token)
        logits, state = model.step(cells, torch.tensor([token], device=device), state)
    return prompt + vocab.decode(out)


# ------------------------------------------------------------ checkpoints ----

CHECKPOINT_FORMAT = "rnnkern.char_lm/1"


def save_checkpoint(path: str, model: CharLM, vocab: Vocab, optimizer, batches,
                    history: List[EpochStats], hidden: Optional[State], cfg: Config,
                    scaler=None) -> None:
    """Everything to resume exactly where training stopped: weights, optimizer
    moments, the sampler's position and the streams' hidden states (so that the
    next chunk continues from the state the last one left).  Written to a temporary
    file first, so an interrupted save never leaves a broken checkpoint."""
    ckpt = {
        "format": CHECKPOINT_FORMAT,
        "vocab": vocab.chars,
        "model": model.spec(),
        "state_dict": {k: v.cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "sampler": batches.state_dict(),
        "hidden": None if hidden is None else tuple(h.cpu() for h in hidden),
        "history": [dataclasses.asdict(e) for e in history],
        "config": {k: v for k, v in dataclasses.asdict(cfg).items()},
    }
    tmp = f"{path}.tmp"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint: {path} is not a {CHECKPOINT_FORMAT} checkpoint")
    return ckpt


def load_model(path: str, backend: str = "auto", device: str = "cpu",
               dtype: str = "float32") -> Tuple[CharLM, Vocab, List[EpochStats]]:
    """The trained model of a checkpoint (for sampling), its vocabulary and history,
    with its parameters in ``dtype`` (half types too: inference needs no float32 copy)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    ckpt = load_checkpoint(path)
    vocab = Vocab(ckpt["vocab"])
    model = CharLM(len(vocab), **ckpt["model"], backend=backend, device="meta")
    model.load_state_dict(ckpt["state_dict"], assign=True)
    model.to(device=device, dtype=DTYPES[dtype])
    return model, vocab, [EpochStats(**e) for e in ckpt["history"]]


# ----------------------------------------------------------------- plots ----

def _plot_title(model: CharLM, cfg: Config, world: int) -> str:
    input_txt = "one-hot" if model.embed == 0 else f"embed {model.embed}"
    streams = f"{cfg.batch}x{world}" if world > 1 else f"{cfg.batch}"
    layers = f"{model.layers} layer{'s' if model.layers > 1 else ''}"
    return (f"{model.cell} ({cfg.backend}), {layers} x {model.hidden}, {input_txt}, "
            f"{cfg.sampler} batches of {streams} x {cfg.bptt}, {cfg.dtype}")


def plot_perplexity(history: List[EpochStats], path: str, title: str = ""):
    """A PNG of training and held-out perplexity per epoch (log scale); returns the
    matplotlib Figure."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig = Figure(figsize=(6.4, 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    epochs = [e.epoch for e in history]
    ax.plot(epochs, [e.train_ppl for e in history], "o-", label="training")
    held = [(e.held_out_ppl, e.epoch) for e in history if e.held_out_ppl is not None]
    if held:
        (line,) = ax.plot([e for _, e in held], [p for p, _ in held], "s-", label="held-out")
        best, at = min(held)
        # The best epoch is a ring on the curve; its figures go in the legend, which
        # sits below the axes: a label inside them lands on a curve for some runs.
        ax.plot([at], [best], "o", ms=11, mfc="none", mec=line.get_color(), mew=1.5,
                label=f"best held-out {best:.3f} (epoch {at})")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("perplexity (exp of mean cross-entropy)")
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.savefig(path)
    return fig
