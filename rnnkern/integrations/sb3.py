"""sb3-contrib's RecurrentPPO on rnnkern: ``accelerate(model)``.

sb3-contrib's ``RecurrentActorCriticPolicy._process_sequence(features,
lstm_states, episode_starts, lstm)`` runs the LSTM one step at a time whenever
an episode starts inside the sequence batch, masking the state entering each
step with ``(1 - episode_start) * state``.  That is exactly rnnkern's
``resets=`` rule (docs/options.md: where ``resets[t, b]`` the state entering
step t, position 0 included, is zeros), so the loop becomes one fused call.

    from sb3_contrib import RecurrentPPO
    from rnnkern.integrations.sb3 import accelerate
    model = accelerate(RecurrentPPO("MlpLstmPolicy", "CartPole-v1"))
    model.learn(10_000)

Only the given policy instance changes: its LSTMs are converted in place
(:func:`rnnkern.convert`: the same module objects and parameters, so the
optimizer built before still updates them) and ``_process_sequence`` is
replaced on the instance; sb3-contrib's class is left alone.  ``model.save()``
writes what it writes without rnnkern; ``RecurrentPPO.load()`` builds an
unaccelerated model: accelerate it again.
"""
from __future__ import annotations

import torch
from torch import Tensor

import rnnkern
from sb3_contrib.common.recurrent.policies import RecurrentActorCriticPolicy

__all__ = ["accelerate", "fused_process_sequence"]

_sb3_process_sequence = RecurrentActorCriticPolicy._process_sequence


def fused_process_sequence(features: Tensor, lstm_states: tuple, episode_starts: Tensor,
                           lstm: torch.nn.LSTM) -> tuple:
    """sb3-contrib's ``_process_sequence`` as one rnnkern call: the same
    reshapes (``n_seq`` sequences laid out one after the other in ``features``,
    so ``[n_seq * T, F] -> [n_seq, T, F] -> [T, n_seq, F]``; T is 1 during
    rollout collection), ``resets=episode_starts`` in place of the per-step
    ``(1 - episode_start) * state`` mask, and the output flattened back to
    ``[n_seq * T, H]`` sequence by sequence.  An LSTM that is not rnnkern's runs
    sb3-contrib's own loop."""
    if not isinstance(lstm, rnnkern.LSTM):
        return _sb3_process_sequence(features, lstm_states, episode_starts, lstm)
    n_seq = lstm_states[0].shape[1]
    if features.shape[0] == n_seq:  # T=1, a rollout's action step: fewer views (~5 us each)
        lstm_output, lstm_states = lstm(features.unsqueeze(0), tuple(lstm_states),
                                        resets=episode_starts.reshape(1, n_seq))
        return lstm_output[0], lstm_states
    features_sequence = features.reshape((n_seq, -1, lstm.input_size)).swapaxes(0, 1)
    starts = episode_starts.reshape((n_seq, -1)).swapaxes(0, 1)
    lstm_output, lstm_states = lstm(features_sequence, tuple(lstm_states), resets=starts)
    # Sequence-major again, through rnnkern's copy (on the CPU pooled, its
    # gradient coming back time-major, as the LSTM's backward reads it).
    lstm_output = rnnkern.ops.dense(lstm_output.transpose(0, 1))
    return torch.flatten(lstm_output, start_dim=0, end_dim=1), lstm_states


def accelerate(model, backend: str = "auto"):
    """Makes a RecurrentPPO model (or a RecurrentActorCriticPolicy) run its
    LSTMs on rnnkern, in place, and returns it.  Shared-LSTM, separate
    actor/critic LSTMs and critic-without-LSTM policies are all handled (each
    LSTM the policy has is converted; ``_process_sequence`` serves them all).
    Accelerating twice changes nothing."""
    policy = getattr(model, "policy", model)
    if not isinstance(policy, RecurrentActorCriticPolicy):
        raise TypeError(f"rnnkern.integrations.sb3.accelerate: expected a RecurrentPPO model or a "
                        f"RecurrentActorCriticPolicy, got {type(model).__name__}")
    for name in ("lstm_actor", "lstm_critic"):
        lstm = getattr(policy, name, None)
        if lstm is not None:
            rnnkern.convert(lstm, backend=backend)
    # A staticmethod on the class: a plain function on the instance is called the
    # same way (self._process_sequence(features, states, starts, lstm)).
    policy._process_sequence = fused_process_sequence
    return model
