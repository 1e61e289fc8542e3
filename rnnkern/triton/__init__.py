"""Triton kernels of rnnkern: the op family ``torch.ops.rnnkern_triton``.

Importing :mod:`rnnkern.triton.ops` defines and registers the ops
(``rnnkern.ops`` does it on the first ``backend="triton"`` call).

  cells.py     gate math of every cell, forward and backward (twin of csrc/cells.h)
  tiles.py     block loads and stores, tiled products, time positions
  sequence.py  the in-kernel time loop, forward and BPTT (weights on chip)
  step/        per-step fused kernels: the single-step op, and the recurrence
               for sizes whose weights do not fit on chip (forward.py,
               backward.py; tile.py: the tile prologue and state stores they share)
  checks.py    argument checks (twin of the check_* functions of csrc/ops.cpp)
  tuning.py    autotuning configurations
  ops.py       host wrappers, path choice, op registration
  aot.py       compiles every kernel for a GPU target without a GPU
               (``python -m rnnkern.triton.aot``)

Without a GPU the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is imported).
"""
