"""What every candidate shares: the calling convention (a *layer* and its
weights, :class:`Built`), the candidate record (:class:`Candidate`), and the
case's weights copied into torch.nn's or rnnkern's module or cell."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

import rnnkern

from ..grid import Case

Layer = Callable[[Tensor, Tensor, Optional[Tensor]], tuple]

#: cell -> (torch.nn class, rnnkern class, constructor keywords)
MODULES = {
    "lstm": (nn.LSTM, rnnkern.LSTM, {}),
    "gru": (nn.GRU, rnnkern.GRU, {}),
    "rnn_tanh": (nn.RNN, rnnkern.RNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (nn.RNN, rnnkern.RNN, {"nonlinearity": "relu"}),
}

#: cell -> (torch.nn cell class, rnnkern cell class, constructor keywords)
CELL_MODULES = {
    "lstm": (nn.LSTMCell, rnnkern.LSTMCell, {}),
    "gru": (nn.GRUCell, rnnkern.GRUCell, {}),
    "rnn_tanh": (nn.RNNCell, rnnkern.RNNCell, {"nonlinearity": "tanh"}),
    "rnn_relu": (nn.RNNCell, rnnkern.RNNCell, {"nonlinearity": "relu"}),
}
PHASES = ("forward", "forward_backward")


@dataclass
class Built:
    layer: Layer
    params: list  # weight_ih, weight_hh, bias_ih, bias_hh
    #: what the candidate runs with, as the engine reports it back (the peers'
    #: session options / compiled-model properties); copied into the JSON as "engine"
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    name: str
    label: str
    #: None when it can run on this device, else why not
    unavailable: Callable[[torch.device], Optional[str]]
    #: None when it runs this case, else why not
    skip: Callable[[Case, torch.device, dict], Optional[str]]
    build: Callable[[Case, nn.Module, torch.device], Built]
    #: the phases it runs; the others are listed as not run, with ``phase_note``
    phases: tuple = PHASES
    phase_note: str = ""


def torch_module(cell: str, I: int, H: int, seed: int) -> nn.Module:
    """The case's weights: a torch.nn module with torch's own initialisation, float64, CPU."""
    torch_cls, _, kw = MODULES[cell]
    torch.manual_seed(seed)
    return torch_cls(I, H, **kw).double()


def copy_module(cls, src: nn.Module, case: Case, device: torch.device, dtype, **extra) -> nn.Module:
    """``cls`` (a layer or a cell class) with the weights of ``src`` (a one-layer
    torch.nn layer: a cell takes its ``*_l0`` weights)."""
    kw = MODULES[case.cell][2]
    m = cls(case.I, case.H, **kw, **extra).to(device=device, dtype=dtype)
    state = src.state_dict()
    if isinstance(m, nn.RNNCellBase):
        state = {k.removesuffix("_l0"): v for k, v in state.items()}
    m.load_state_dict(state)
    if hasattr(m, "flatten_parameters"):
        m.flatten_parameters()
    return m


def module_layer(m: nn.Module, lstm: bool) -> Built:
    def layer(x, h0, c0):
        if lstm:
            out, (h, c) = m(x, (h0.unsqueeze(0), c0.unsqueeze(0)))
            return out, h[0], c[0]
        out, h = m(x, h0.unsqueeze(0))
        return out, h[0], None

    params = [m.weight_ih_l0, m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0]
    return Built(layer, params)


def cell_layer(m: nn.Module, lstm: bool) -> Built:
    """A cell behind the layer convention: x [1, B, I] -> the cell on x[0] ->
    (h.unsqueeze(0), h, c)."""
    def layer(x, h0, c0):
        if lstm:
            h, c = m(x[0], (h0, c0))
            return h.unsqueeze(0), h, c
        h = m(x[0], h0)
        return h.unsqueeze(0), h, None

    params = [m.weight_ih, m.weight_hh, m.bias_ih, m.bias_hh]
    return Built(layer, params)


def case_module(which: int, src: nn.Module, case: Case, device, dtype, **extra) -> Built:
    """The case's module (``which``: 0 torch.nn, 1 rnnkern) as a layer: the
    sequence module, or for a cell call the cell."""
    lstm = case.cell == "lstm"
    if case.call == "cell":
        m = copy_module(CELL_MODULES[case.cell][which], src, case, device, dtype, **extra)
        return cell_layer(m, lstm)
    return module_layer(copy_module(MODULES[case.cell][which], src, case, device, dtype, **extra), lstm)


def _no_skip(case, device, options):
    return None


def _always(device):
    return None
