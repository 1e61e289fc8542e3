"""Drop-in replacements for torch.nn's recurrent modules.

Each class subclasses its torch.nn twin, so constructor arguments, parameter
names and shapes, initialisation, ``extra_repr``, ``state_dict``, pickling and
``isinstance`` checks are torch's own; only ``forward`` changes.  Layers,
directions, packing, dropout and hidden-state handling live here; each
(layer, direction) is one call of :func:`rnnkern.ops.recurrence` on the input
projection of the whole sequence, so no Python runs per time step.  A call of
one step (streaming, an RL rollout's action step) runs the whole stack as one
op, ``layers_step`` (the fused step per layer and direction, in C++), and the
commonest such call reaches it without the rest of the forward's Python
(``_one_step_forward``): a small module's one-step call was that Python's.

Extra keyword arguments: ``backend`` (see :data:`rnnkern.ops.BACKENDS`) on every
class, ``reset_after`` on :class:`GRU` and :class:`GRUCell` (``False`` selects the
classic GRU of Cho et al., ``n = tanh(W_in x + b_in + W_hn (r * h) + b_hn)``),
``zoneout`` on every class, and ``lengths=`` and ``resets=`` on the sequence
modules' ``forward``.

Beyond torch.nn, the step options and the LayerNorm cell (docs/options.md has the
rules):

- ``resets=`` ([T, B] mask laid out like the input; bool, uint8 or floating 0/1,
  with or without a trailing 1; docs/options.md): where ``resets[t, b]``,
  the state entering the step at position t of sequence b is the reset
  state's row b (``reset_state=``, hx's form, or zeros), in every layer and at
  position 0 too, as if an episode began there; hx enters position 0 otherwise.  A reverse direction gets
  the mask shifted by one position (``rev[t] = resets[t + 1]``): the episodes on
  the two sides of a boundary never see each other, in either direction.
- ``zoneout=p``: per unit and step, the state keeps its previous value with
  probability p while training (masks drawn from torch's default generator),
  and becomes ``p * previous + (1 - p) * new`` in evaluation.
- :class:`LayerNormLSTM` and :class:`LayerNormLSTMCell`: haste's layer-normalised
  LSTM (cell ``lstm_ln``), with torch.nn.LSTM's parameters plus the layer norms'
  gains and shift.  They share the layer stack of the drop-ins, but subclass
  ``torch.nn.RNNBase`` / ``RNNCellBase``, not torch.nn.LSTM / LSTMCell, whose
  forward would compute another function.

``torch.compile``: Dynamo refuses every instance of torch.nn.RNN/GRU/LSTM
(subclasses included) unless ``torch._dynamo.config.allow_rnn = True``; with that
flag set, these modules compile with ``fullgraph=True`` (padded input, with or
without ``lengths=``, and PackedSequence input).  torch offers no supported way
to lift the refusal for a subclass only: the one check is
``isinstance(value, (nn.RNN, nn.GRU, nn.LSTM)) and not config.allow_rnn`` in
Dynamo's ``VariableBuilder.wrap_module`` (torch/_dynamo/variables/builder.py,
torch 2.14), run when Dynamo first meets the module object, before any of its
code; see docs/modules.md's torch.compile section for the smallest user-side step.

``torch.jit.trace`` and ONNX export (``torch.onnx.export``, either exporter) run
torch.nn's own forward on the same parameters (:func:`_runs_torch_nn_forward`):
a TorchScript graph or ONNX model then holds torch's ``aten::lstm``/``gru``/
``rnn_*`` (ONNX ``LSTM``/``GRU``/``RNN``), which any PyTorch or ONNX runtime
can load without rnnkern, train and run at any sequence length.
``torch.jit.script`` compiles torch.nn's forward on the same Parameter objects
too (``_RnnkernOptions.__prepare_scriptable__``); the eager model keeps its
module objects, which run rnnkern again from their next call.
``torch.export.export`` and ``torch.compile`` capture rnnkern's own ops.

Inside other libraries (docs/modules.md, "Inside other libraries"):
:func:`convert` also converts subclasses whose forward reaches torch.nn's
through ``super().forward`` (pytorch-forecasting's LSTM/GRU), under a generated
class that puts rnnkern's class between theirs and torch.nn's, and warns about
the others; :func:`conversion_report` lists what it did or would do.
:func:`patch` makes torch.nn's recurrent classes construct and unpickle as
rnnkern's while active (for libraries that build their modules inside).
"""
from __future__ import annotations

import torch.nn.functional as F  # noqa: F401  (tests patch rnnkern.modules.F.dropout)

from .cells import GRUCell, LSTMCell, RNNCell
from .common import UNSUPPORTED
from .conversion import ConversionEntry, conversion_report, convert
from .layer_norm import LayerNormLSTM, LayerNormLSTMCell
from .patching import PatchHandle, is_patched, patch, unpatch
from .sequence import GRU, LSTM, RNN

__all__ = ["RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell", "LayerNormLSTM",
           "LayerNormLSTMCell", "convert", "conversion_report", "ConversionEntry", "patch", "unpatch", "is_patched", "PatchHandle",
           "UNSUPPORTED"]

# The public classes keep the address rnnkern.modules.<name>: what pickles of
# whole modules (torch.save(model)) record and load by.
for _cls in (RNN, GRU, LSTM, RNNCell, GRUCell, LSTMCell, LayerNormLSTM, LayerNormLSTMCell):
    _cls.__module__ = __name__
del _cls
