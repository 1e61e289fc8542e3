"""convert(): torch.nn's recurrent modules inside a model become rnnkern's, in place."""
from __future__ import annotations

import torch.nn as nn

from .cells import GRUCell, LSTMCell, RNNCell
from .common import _check_backend
from .sequence import GRU, LSTM, RNN

_REPLACEMENTS = {
    nn.RNN: RNN, nn.GRU: GRU, nn.LSTM: LSTM,
    nn.RNNCell: RNNCell, nn.GRUCell: GRUCell, nn.LSTMCell: LSTMCell,
}


def convert(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Turns every torch.nn RNN/GRU/LSTM (and cell) inside ``model`` into its rnnkern
    twin, in place: the same module objects and the same parameters, so the model
    computes the same function.  Returns ``model``.

    Only modules whose type is exactly a torch.nn recurrent class change (a
    subclass may override ``forward``); modules that already are rnnkern's are
    left as they are, so converting twice changes nothing."""
    _check_backend(backend)
    for module in model.modules():
        original = type(module)
        replacement = _REPLACEMENTS.get(original)
        if replacement is not None:
            module.__class__ = replacement
            try:
                module._init_rnnkern(backend)
            except ValueError:  # an RNNCell with an unknown nonlinearity: leave it as it was
                module.__class__ = original
                raise
    return model
