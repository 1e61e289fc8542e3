"""Integrations with reinforcement-learning libraries (docs/rl.md).

Each submodule imports its library on import, so import the one you use:

* :mod:`rnnkern.integrations.sb3` -- ``accelerate(model)`` for sb3-contrib's
  RecurrentPPO: the policy's LSTMs become rnnkern's and its per-step
  ``_process_sequence`` loop becomes one call per sequence batch with
  ``resets=episode_starts``.
* :mod:`rnnkern.integrations.torchrl` -- ``accelerate(module)`` for torchrl's
  ``LSTMModule`` / ``GRUModule``: recurrent mode runs one call over the whole
  [B, T] batch with ``is_init`` as resets instead of splitting and padding it
  into trajectories.

This package itself imports nothing heavy.
"""
