"""The layer-normalised LSTM (cell ``lstm_ln``): :class:`LayerNormLSTM` on the
sequence modules' layer stack and :class:`LayerNormLSTMCell` on the cells'
step, with the layer norms' parameters and their initialisation."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from .cells import _CellMixin, _cell_sizes
from .sequence import _RecurrentMixin

#: The layer norms' parameters of lstm_ln, in the order of the op's ``ln``: name
#: stem, width in hidden units, initial value.
_LN_PARAMETERS = (("ln_ih_weight", 4, 1.0), ("ln_hh_weight", 4, 1.0),
                  ("ln_cell_weight", 1, 1.0), ("ln_cell_bias", 1, 0.0))


class LayerNormLSTM(_RecurrentMixin, nn.RNNBase):
    """The layer-normalised LSTM (haste's LayerNormLSTM, torch's gate order i, f, g, o)::

        a   = LN(x W_ih^T) * g_ih + LN(h W_hh^T) * g_hh + b_ih + b_hh
        c_t = sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(g)
        h_t = sigmoid(o) * tanh(LN(c_t) * g_c + beta_c)

    (LN: normalisation over the whole vector, eps 1e-5.)  The constructor and
    forward are torch.nn.LSTM's without ``proj_size``, plus ``zoneout=`` and
    ``backend=``; forward takes the same inputs (padded, ``lengths=``,
    PackedSequence, hx = (h_0, c_0), batch_first, unbatched, ``resets=``).

    Parameters: torch.nn.LSTM's (``weight_ih_l{k}[_reverse]``, ``weight_hh_...``,
    ``bias_ih_...``, ``bias_hh_...``, with its initialisation: a seeded
    construction draws torch.nn.LSTM's values), then per layer and direction
    ``ln_ih_weight_l{k}[_reverse]`` (g_ih, 4H), ``ln_hh_weight_...`` (g_hh, 4H),
    ``ln_cell_weight_...`` (g_c, H), ``ln_cell_bias_...`` (beta_c, H); gains
    start at 1, the shift at 0.

    A subclass of torch.nn.RNNBase (the parameter bookkeeping of torch.nn.LSTM,
    whose cuDNN flattening and ``_flat_weights`` it shares), not of
    torch.nn.LSTM: ``isinstance(m, nn.LSTM)`` would promise torch.nn's function.
    So torch.compile does not need ``torch._dynamo.config.allow_rnn`` for it.
    """

    _has_torch_nn_twin = False
    #: hx is the pair (h, c), permuted as torch.nn.LSTM permutes it.
    permute_hidden = nn.LSTM.permute_hidden

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 zoneout: float = 0.0, backend: str = "auto", device=None, dtype=None):
        super().__init__("LSTM", input_size, hidden_size, num_layers=num_layers, bias=bias,
                         batch_first=batch_first, dropout=dropout, bidirectional=bidirectional,
                         proj_size=0, device=device, dtype=dtype)
        names = []
        for layer in range(num_layers):
            for suffix in ("", "_reverse")[:2 if bidirectional else 1]:
                group = []
                for stem, width, _ in _LN_PARAMETERS:
                    name = f"{stem}_l{layer}{suffix}"
                    setattr(self, name, nn.Parameter(
                        torch.empty(width * hidden_size, device=device, dtype=dtype)))
                    group.append(name)
                names.append(tuple(group))
        self._ln_names = names
        self._reset_ln()
        self._init_rnnkern(backend, zoneout=zoneout)

    @property
    def cell(self) -> str:
        return "lstm_ln"

    def reset_parameters(self) -> None:
        """torch.nn.LSTM's initialisation of its weights and biases (the same
        draws in the same order), gains 1 and shifts 0."""
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for name in self._flat_weights_names:
            nn.init.uniform_(getattr(self, name), -stdv, stdv)
        self._reset_ln()

    def _reset_ln(self) -> None:
        # (torch.nn.RNNBase.__init__ calls reset_parameters before the layer
        # norms' parameters exist.)
        with torch.no_grad():
            for names in self._ln_names or ():
                for name, (_, _, value) in zip(names, _LN_PARAMETERS):
                    getattr(self, name).fill_(value)

    def _autocast_result_dtypes(self, x: Tensor, hx, dtype: torch.dtype, packed: bool):
        """Under autocast every result is in the autocast dtype (torch.nn has no
        layer-norm LSTM whose CPU quirks to follow; its CUDA rule)."""
        return (dtype,) * 3


class LayerNormLSTMCell(_CellMixin, nn.RNNCellBase):
    """One step of :class:`LayerNormLSTM` (cell ``lstm_ln``): ``forward(input,
    hx=None) -> (h, c)``, as torch.nn.LSTMCell's (hx = (h, c) or None for zeros,
    unbatched 1-D input, the same error messages).

    Parameters: torch.nn.LSTMCell's (``weight_ih`` [4H, I], ``weight_hh`` [4H, H],
    ``bias_ih``, ``bias_hh``; its initialisation), then ``ln_ih_weight`` (4H),
    ``ln_hh_weight`` (4H), ``ln_cell_weight`` (H), ``ln_cell_bias`` (H): gains 1,
    shift 0.  A subclass of torch.nn.RNNCellBase, not of torch.nn.LSTMCell."""

    _has_torch_nn_twin = False

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, zoneout: float = 0.0,
                 backend: str = "auto", device=None, dtype=None):
        input_size, hidden_size = _cell_sizes(input_size, hidden_size)
        super().__init__(input_size, hidden_size, bias, num_chunks=4, device=device, dtype=dtype)
        for stem, width, _ in _LN_PARAMETERS:
            setattr(self, stem, nn.Parameter(torch.empty(width * hidden_size, device=device,
                                                         dtype=dtype)))
        self._reset_ln()
        self._init_rnnkern(backend, zoneout=zoneout)

    @property
    def cell(self) -> str:
        return "lstm_ln"

    def _ln(self) -> Tensor:
        """The op's ``ln``: ``[g_ih (4H), g_hh (4H), g_c (H), beta_c (H)]``."""
        return torch.cat([self.ln_ih_weight, self.ln_hh_weight, self.ln_cell_weight,
                          self.ln_cell_bias])

    def reset_parameters(self) -> None:
        """torch.nn.LSTMCell's initialisation of its weights and biases (the same
        draws in the same order), gains 1 and shift 0."""
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            weight = getattr(self, name)
            if weight is not None:
                nn.init.uniform_(weight, -stdv, stdv)
        self._reset_ln()

    def _reset_ln(self) -> None:
        # (torch.nn.RNNCellBase.__init__ calls reset_parameters before the layer
        # norms' parameters exist.)
        with torch.no_grad():
            for stem, _, value in _LN_PARAMETERS:
                if getattr(self, stem, None) is not None:
                    getattr(self, stem).fill_(value)

    def _autocast_result_dtypes(self, x: Tensor, parts, dtype: torch.dtype):
        """Every result in the autocast dtype (as LayerNormLSTM)."""
        return (dtype, dtype)
