"""torchrl's LSTMModule / GRUModule on rnnkern: ``accelerate(module)``.

In recurrent mode (``default_recurrent_mode=True`` or the
``torchrl.modules.set_recurrent_mode`` context), torchrl's default ("pad")
backend cuts each row of the [B, T] batch at every ``is_init`` into
trajectories, pads them into a [N, T'] batch, runs the RNN on it (packed) and
scatters the results back.  ``accelerate(module)`` makes that one rnnkern call
over the whole [B, T] batch with ``resets=is_init``:

    from torchrl.modules import LSTMModule
    from rnnkern.integrations.torchrl import accelerate
    lstm = accelerate(LSTMModule(input_size=4, hidden_size=32, in_key="obs", out_key="h",
                                 default_recurrent_mode=True))

torchrl's rule, which this keeps exactly: each trajectory starts from the
recurrent state stored in the tensordict at its first step (zeros when the
state keys are absent).  For a row's first step that is the carried state
(hx, whether or not ``is_init`` is set there); at a mid-row ``is_init`` it is
what the environment's primer wrote at the reset: zeros.  So the call is
``hx = state[:, 0]``, ``resets = is_init`` at steps 1.. (rnnkern's reset state
is zeros; docs/options.md).  The next-state keys torchrl writes hold each
trajectory's final state at its last step and zeros elsewhere: a one-layer
recurrence's h is its output, and an LSTM's cell state after every step comes
from the same call (the recurrence op's ``cell_steps``: the kernels write it,
and its gradient enters the backward at each step).

The module falls back to torchrl's own path (the same numbers, torchrl's
speed) where that rule does not hold or the one call does not give every
next state: a stored state at a mid-row ``is_init`` that is not zero or that
requires grad (its gradient would be lost), several layers (a lower layer's
states after each step are not the call's outputs), bidirectional,
``proj_size``.
Sequential mode (rollouts) runs torchrl's code on the converted module.
"""
from __future__ import annotations

import torch
from torch import Tensor
from tensordict.nn import dispatch
from torchrl.modules import GRUModule, LSTMModule

import rnnkern

__all__ = ["accelerate", "AcceleratedLSTMModule", "AcceleratedGRUModule"]


def _shaped(module, tensordict):
    """The [B, T] view torchrl's recurrent mode works on (its own reshaping)."""
    name = type(module).__name__
    if tensordict.ndim == 0:
        raise ValueError(f"{name}(recurrent_mode=True) requires the input tensordict to have at "
                         f"least one batch dim (time). Got a 0-d tensordict.")
    if tensordict.ndim == 1:
        return tensordict.unsqueeze(0)
    if tensordict.ndim == 2:
        return tensordict
    return tensordict.flatten(0, -2)


def _fast_path_applies(rnn, is_init: Tensor, states) -> bool:
    """Whether one rnnkern call reproduces torchrl's recurrent mode exactly."""
    if not isinstance(rnn, (rnnkern.LSTM, rnnkern.GRU)) or rnn.num_layers != 1 \
            or rnn.bidirectional or getattr(rnn, "proj_size", 0) or not rnn.batch_first:
        return False
    present = [s for s in states if s is not None]
    if not present:
        return True
    if len(present) != len(states):
        return False  # h without c (or c without h): torchrl's own error
    mid = is_init[:, 1:]
    if not bool(mid.any()):
        return True
    if any(s.requires_grad for s in present):
        return False  # torchrl differentiates the stored state at every trajectory start
    return not any(bool(s[:, 1:][mid].any()) for s in present)


def _end_mask(is_init: Tensor) -> Tensor:
    """[B, T]: the last step of each trajectory (before an is_init, or the row's end)."""
    end = torch.ones_like(is_init)
    end[:, :-1] = is_init[:, 1:]
    return end


def _recurrent_forward(module, tensordict, rnn, lstm: bool):
    shape = tensordict.shape
    td = _shaped(module, tensordict)
    is_init = td["is_init"].squeeze(-1)
    if is_init.dtype != torch.bool:
        is_init = is_init != 0
    keys = module.in_keys  # value, the state(s), is_init
    value = td.get(keys[0])
    states = [td.get(k, None) for k in keys[1:3 if lstm else 2]]
    if not _fast_path_applies(rnn, is_init, states):
        return None
    B, T = value.shape[:2]
    H = rnn.hidden_size
    # The state entering step 0: stored there (layer 0 of 1), else zeros.
    first = [s[:, 0, 0] if s is not None else value.new_zeros(B, H) for s in states]
    resets = is_init.clone()
    resets[:, 0] = False  # torchrl's step 0 starts from the stored state, is_init or not
    hx = tuple(f.unsqueeze(0) for f in first)
    if lstm:
        # The module's own layer stack (its backend, autocast and checks), with
        # the cell state after every step as the LSTM's c_n.
        rnn.check_input(value, None)  # torch.nn's input errors, as the module's forward
        out, (_, c_steps) = rnn._run_layers(value.transpose(0, 1), hx, None, None, resets.t(),
                                            cell_steps=True)
        out, c_steps = out.transpose(0, 1), c_steps[0].transpose(0, 1)  # [B, T, H]
    else:
        out, _ = rnn(value, hx[0], resets=resets)
    end = _end_mask(is_init).view(B, T, 1, 1)
    # The state after each step, kept wherever a trajectory ends: a one-layer
    # recurrence's h is its output (its last row is h_n), and the LSTM's c
    # after every step comes from the call.
    next_states = [out, c_steps] if lstm else [out]
    td.set(module.out_keys[0], out)
    for key, s in zip(module.out_keys[1:], next_states):
        s = s.unsqueeze(2)
        td.set(key, torch.where(end, s, torch.zeros_like(s)))
    if shape != td.shape or td is not tensordict:
        tensordict.update(td.reshape(shape))
    return tensordict


class _OneCallRecurrentMode:
    """forward in recurrent mode as one rnnkern call where it applies (module
    docstring), torchrl's own forward otherwise.  ``_rnnkern_rnn``: the
    attribute holding the torch.nn module; ``_rnnkern_lstm``: whether it
    carries a cell state (names torchrl's classes do not use)."""

    _rnnkern_rnn: str
    _rnnkern_lstm: bool

    @dispatch
    def forward(self, tensordict):
        if self.recurrent_mode:
            done = _recurrent_forward(self, tensordict, getattr(self, self._rnnkern_rnn),
                                      lstm=self._rnnkern_lstm)
            if done is not None:
                return done
        return super().forward(tensordict)


class AcceleratedLSTMModule(_OneCallRecurrentMode, LSTMModule):
    """An LSTMModule whose recurrent mode is one rnnkern call (module docstring)."""

    _rnnkern_rnn, _rnnkern_lstm = "lstm", True


class AcceleratedGRUModule(_OneCallRecurrentMode, GRUModule):
    """A GRUModule whose recurrent mode is one rnnkern call (module docstring)."""

    _rnnkern_rnn, _rnnkern_lstm = "gru", False


_ACCELERATED = {LSTMModule: AcceleratedLSTMModule, GRUModule: AcceleratedGRUModule}


def accelerate(module, backend: str = "auto"):
    """Makes a torchrl ``LSTMModule`` or ``GRUModule`` (or every one inside
    ``module``) run on rnnkern, in place, and returns it: its LSTM/GRU is
    converted (:func:`rnnkern.convert`: same parameters) and its class becomes
    :class:`AcceleratedLSTMModule` / :class:`AcceleratedGRUModule` (subclasses:
    isinstance still holds; in/out keys, primers and output layout unchanged).
    Accelerating twice changes nothing."""
    found = False
    for sub in module.modules():
        cls = type(sub)
        if cls in _ACCELERATED.values():
            found = True
            continue
        if cls not in _ACCELERATED:
            continue
        rnn = sub.lstm if cls is LSTMModule else sub.gru
        # torch.nn's module, or rnnkern's already (rnnkern.convert or
        # rnnkern.patch before this call)
        if type(rnn) not in ((torch.nn.LSTM, rnnkern.LSTM) if cls is LSTMModule
                             else (torch.nn.GRU, rnnkern.GRU)):
            raise TypeError(f"rnnkern.integrations.torchrl.accelerate: {cls.__name__} holds a "
                            f"{type(rnn).__module__}.{type(rnn).__qualname__} (python_based=True?); "
                            f"make_cudnn_based() gives it the torch.nn module rnnkern replaces")
        rnnkern.convert(sub, backend=backend)
        sub.__class__ = _ACCELERATED[cls]
        found = True
    if not found:
        raise TypeError(f"rnnkern.integrations.torchrl.accelerate: no torchrl LSTMModule or GRUModule "
                        f"in {type(module).__name__}")
    return module
