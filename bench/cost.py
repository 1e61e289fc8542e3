"""How much arithmetic and memory traffic one benchmark call costs: the numbers
behind the achieved TFLOP/s and GB/s columns.

All formulas are in :func:`cost`; nothing else in bench/ counts FLOPs or bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rnnkern.reference import gate_count, workspace_width

#: Element-wise operations per hidden unit and time step of the forward gate math
#: (bias adds, the x + h sum, products; a sigmoid, tanh or ReLU counts as one).
POINTWISE_FORWARD = {
    "rnn_tanh": 4,   # xp + b_ih + hp + b_hh (3 adds), tanh
    "rnn_relu": 4,
    "lstm": 21,      # 4 gates x 3 adds, 3 sigmoids + 2 tanh, c = f*c + i*g (3), h = o*tanh(c) (1)
    "gru": 17,       # r, z: 3 adds + sigmoid each; n: 2 bias adds, r*hn, add, tanh; h = (1-z)n + zh (4)
}
#: The backward of the gate math is counted as twice its forward.
POINTWISE_BACKWARD_FACTOR = 2


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float


def cost(cell: str, T: int, B: int, I: int, H: int, dtype: torch.dtype, phase: str) -> Cost:
    """FLOPs and bytes of one call of a one-layer, one-direction recurrent layer.

    ``phase`` is ``"forward"`` (inference: no workspace saved) or
    ``"forward_backward"`` (a training forward, then the backward to the input and
    to every weight and bias).  G is the gate count (RNN 1, GRU 3, LSTM 4), s the
    bytes per element of ``dtype``, a those of the accumulate type (float32 for the
    half types), W the values per hidden unit and step saved for the backward
    (rnnkern's workspace: LSTM 5, GRU 4, RNN 0 -- the output itself serves).

    FLOPs (a multiply-add is 2):

    - forward: input projection ``2 T B I G H`` + recurrent product ``2 T B H G H``
      + gate math ``T B H * POINTWISE_FORWARD[cell]``;
    - backward: every product twice more (the gradient of its input and of its
      weight: ``2 * (2 T B I G H + 2 T B H G H)``), the bias gradients ``2 T B G H``
      (two biases), and the gate math ``POINTWISE_BACKWARD_FACTOR`` times its forward.

    Bytes: the compulsory DRAM traffic of the two-phase algorithm that all the
    candidates share (one GEMM for the input projection of every step, then the time
    loop keeping its state on chip): each tensor of T steps that must exist in
    memory is counted once per write and once per read, the weights once per pass.

    - forward: read x ``T B I s``; write and read back the projection
      ``2 T B G H s``; read the weights ``(G H I + G H H + 2 G H) s`` and the initial
      states; write the output ``T B H s`` and the final states; in training also
      write the saved activations ``T B W H a``;
    - backward: read grad_output and the output ``2 T B H s`` and the saved
      activations ``T B W H a``; write the gate gradients ``T B G H s`` and read them
      three times (input gradient, input-weight and recurrent-weight gradients);
      read x and write its gradient ``2 T B I s``; read the weights once
      ``(G H I + G H H) s`` and write their gradients ``(G H I + G H H + 2 G H) s``;
      read/write the state gradients.

    The pointwise FLOPs are below 2% of the total for H >= 64, so TFLOP/s measures
    how well the products run; GB/s against the copy bandwidth tells whether a
    small-batch case is memory- or latency-bound.
    """
    if cell not in POINTWISE_FORWARD:
        raise ValueError(f"no cost model for cell {cell!r}; expected one of {', '.join(POINTWISE_FORWARD)}")
    if phase not in ("forward", "forward_backward"):
        raise ValueError(f"phase must be 'forward' or 'forward_backward', got {phase!r}")
    G = gate_count(cell)
    W = workspace_width(cell)
    s = torch.empty((), dtype=dtype).element_size()
    a = 4 if dtype in (torch.float16, torch.bfloat16) else s
    states = 2 if cell == "lstm" else 1  # (h, c) or h
    rows = T * B                          # rows of the time-parallel products

    gemm_fwd = 2 * rows * I * G * H + 2 * rows * H * G * H
    pointwise_fwd = rows * H * POINTWISE_FORWARD[cell]
    weights = (G * H * I + G * H * H + 2 * G * H) * s
    fwd_bytes = (rows * I * s + 2 * rows * G * H * s + weights + 2 * states * B * H * s
                 + rows * H * s)
    if phase == "forward":
        return Cost(flops=float(gemm_fwd + pointwise_fwd), bytes=float(fwd_bytes))

    fwd_bytes += rows * W * H * a
    bwd_flops = 2 * gemm_fwd + 2 * rows * G * H + POINTWISE_BACKWARD_FACTOR * pointwise_fwd
    bwd_bytes = (2 * rows * H * s + rows * W * H * a
                 + 4 * rows * G * H * s
                 + 2 * rows * I * s
                 + (G * H * I + G * H * H) * s + weights
                 + 2 * states * B * H * s)
    return Cost(flops=float(gemm_fwd + pointwise_fwd + bwd_flops), bytes=float(fwd_bytes + bwd_bytes))
