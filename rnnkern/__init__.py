"""rnnkern: fused recurrent kernels (tanh/ReLU RNN, GRU, LSTM) as drop-in
replacements for torch.nn.RNN / GRU / LSTM and their cells.

    import rnnkern
    lstm = rnnkern.LSTM(256, 512, num_layers=2, batch_first=True)   # like torch.nn.LSTM
    model = rnnkern.convert(model)   # swap every torch.nn RNN/GRU/LSTM in a model
    with rnnkern.patch():            # torch.nn.LSTM(...) & co. build rnnkern's inside
        model = some_library.build()
    rnnkern.check()                  # the field self-check (python -m rnnkern.check)

Beyond torch.nn: ``resets=`` on forward (episode boundaries), ``zoneout=`` on every
module and cell, and the layer-normalised LSTM (:class:`LayerNormLSTM`,
:class:`LayerNormLSTMCell`).

Functional ops (one layer, one direction) are in :mod:`rnnkern.ops`, the
pure-PyTorch ground truth in :mod:`rnnkern.reference`.
"""
from . import _torch_warnings, auto, ops, reference
from .auto import explain
from .modules import (GRU, LSTM, RNN, GRUCell, LayerNormLSTM, LayerNormLSTMCell, LSTMCell, RNNCell,
                      conversion_report, convert, is_patched, patch, unpatch)

__all__ = ["RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell", "LayerNormLSTM",
           "LayerNormLSTMCell", "convert", "conversion_report", "patch", "unpatch",
           "is_patched", "explain", "auto", "ops", "reference", "check"]
__version__ = "0.1.0"

_torch_warnings.install()  # before anything imports torch.utils.cpp_extension (see there)


def __getattr__(name):
    # rnnkern.check, the field self-check (a package), is imported on first use:
    # `import rnnkern` stays light.  The package is callable: rnnkern.check() runs
    # rnnkern.check.check().
    if name == "check":
        import importlib
        return importlib.import_module(".check", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
