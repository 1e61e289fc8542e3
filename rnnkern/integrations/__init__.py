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
* :mod:`rnnkern.integrations.pytest_plugin` -- ``python -m pytest -p
  rnnkern.integrations.pytest_plugin [--rnnkern=accelerate]``: a library's own
  test suite with torch.nn's recurrent modules built as rnnkern's (and, with
  ``accelerate``, the two above applied to what it builds), counted in the
  summary.

This package itself imports nothing heavy.
"""
