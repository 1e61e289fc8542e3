"""Triton kernels of rnnkern: the op family ``torch.ops.rnnkern_triton``.

Importing :mod:`rnnkern.triton.ops` defines and registers the ops
(``rnnkern.ops`` does it on the first ``backend="triton"`` call).

  cells.py     gate math of every cell, forward and backward (twin of csrc/cells.h)
  tiles.py     block loads and stores, tiled products, time positions
  sequence.py  the in-kernel time loop, forward and BPTT (weights on chip)
  step.py      per-step fused kernels: the single-step op, and the recurrence
               for sizes whose weights do not fit on chip
  checks.py    argument checks (twin of the check_* functions of csrc/ops.cpp)
  tuning.py    autotuning configurations
  ops.py       host wrappers, path choice, op registration
"""
