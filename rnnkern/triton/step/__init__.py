"""Per-step kernels: one time step, tiled over (batch rows, hidden units).

They serve three callers:
  * the single-step op (cells, token-by-token generation), where the product
    ``[x_t, h_{t-1}] [W_ih; W_hh]^T`` runs as one accumulation over the
    concatenated K: the K blocks of x against W_ih, then those of h against
    W_hh, into the same accumulators, fused with the gates;
  * the recurrence beyond the in-kernel time loop (:mod:`.sequence`) where
    the spread kernels do not run (LSTM-LN, more tiles than SMs, or
    RNNKERN_TRITON_PATH=step): a Python loop launches them once per step (twice for
    the reset-before GRU and the LSTM projection) with the step index as a
    kernel argument, never synchronising with the host, so the loop can be
    captured in a CUDA graph.  The recurrent GEMM is fused with the gates.
  * the spread kernels (:mod:`..spread`), which call the bodies of the
    recurrence's kernels (the ``*_tile`` jit functions each kernel wraps) once
    per step inside one launch, with a grid barrier between steps.

Every kernel reads its inputs and writes separate outputs (states ping-pong
between two buffers), so a kernel can be re-run by the autotuner without
changing the result.  The gate formulas come from :mod:`.cells`.

Kernels (F: forward, B: backward):
  F gates_forward_kernel       xproj (or x W_ih^T) + h W_hh^T, gates, state update
  F gru_rb_candidate_kernel    reset-before GRU, stage 2: (r*h) W_hn^T, candidate
  F projection_forward_kernel  LSTM projection h = (o*tanh c) W_hr^T
  F ln_projections_kernel      LSTM-LN, stage 1: h W_hh^T (and x W_ih^T), raw
  F lstm_ln_forward_kernel     LSTM-LN, stage 2: layer norms, gates, state update
  B gates_backward_kernel      carried dh (+ dA_{t+1} W_hh), the cell's backward
                               (LSTM-LN: up to the output gate and dy)
  B gru_rb_reset_kernel        reset-before GRU, stage 2: dn W_hn, reset gate
  B projection_backward_kernel LSTM projection: carried dh (+ dA_{t+1} W_hh) + grad_output
  B lstm_ln_backward_kernel    LSTM-LN, stage 2: the layer norms' backward, the gates
  B input_grad_kernel          [dA_x W_ih | dh + dA_h W_hh]: grad of x and h

Resets and zoneout (constexpr flags HAS_RESETS, HAS_ZONEOUT; the kernels
without them are unchanged).  The states ping-pong between two buffers, so a
kernel that stores the next state stores the state the next step *starts*
from: the reset state (the p_h0 / p_c0 arguments: h0, c0 unless given) where
that step is a reset (next_reset_rows).  The recurrent product then never
needs to know about resets, and the final state (no step after it) is the real
one.  Backward, the carry that arrives at step s is the gradient of step s+1's
start state: where step s+1 was a reset, the kernel that first reads it (the
GEMM part dA_{s+1} W_hh and the direct part) adds it to a sum for grad_h0
(grad_c0), or grad_reset_h (grad_reset_c) where the reset state is given, and
carries nothing to step s.  The sums ping-pong
between two buffers too (read one, write the other, every element), so that
every kernel stays re-runnable.  Zoneout
blends the start state and the candidate per unit, the mask read through its
strides; its backward splits the gradient of the state into the two.

LSTM-LN needs whole-row reductions (4H values for the two gate layer norms,
H for the cell's), while these kernels split the units of a row across
programs.  Rather than one program per row holding 4H units (registers for
H beyond the in-kernel loop's limit, and the recurrent GEMM on B / BLOCK_B
programs only), the GEMM stays tiled and writes the raw h W_hh^T, and a row
kernel (BLOCK_B rows per program, looping over the units in BLOCK_H chunks)
reduces the statistics, then runs the gates and the cell norm: two launches
per step each way.

The package: tile.py (the tile prologue and the state stores every kernel
shares), forward.py (the F kernels), backward.py (the B kernels).
"""
from .backward import (gates_backward_kernel, gru_rb_reset_kernel, input_grad_kernel,  # noqa: F401
                       lstm_ln_backward_kernel, projection_backward_kernel)
from .forward import (gates_forward_kernel, gru_rb_candidate_kernel, ln_projections_kernel,  # noqa: F401
                      lstm_ln_forward_kernel, projection_forward_kernel)
