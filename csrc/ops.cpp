// Schemas of the rnnkern ops (the argument checks every backend runs: checks.h).
//
// The ops work on one layer in one direction; modules (rnnkern/modules/)
// stack them.  Conventions (torch.nn's):
//   xproj     [T, B, G*H]  X_t W_ih^T for every step: the time-independent half
//                          of [X_t, H_{t-1}] [W_ih; W_hh]^T, one GEMM outside;
//                          the biases are added inside (b_in must stay apart
//                          from b_hn in the GRU candidate)
//   h0        [B, P]       P = H, or proj_size for an LSTM with w_hr
//   c0        [B, H]       LSTM only
//   w_hh      [G*H, P], b_ih [G*H], b_hh [G*H], w_hr [P, H] (LSTM projection)
//   lengths   [B] int64 on the CPU: steps of each sequence; a finished
//             sequence keeps its state and its outputs are 0.  With reverse,
//             each sequence runs from its own last step back to 0.
//             On the CPU xproj may instead be packed rows [N, G*H]: the real
//             positions only, time-major as PackedSequence.data, with lengths
//             sorted longest first (checks.h: RecurrenceSizes::packed_rows);
//             output, workspace and their gradients are then [N, *] likewise.
//   output    [T, B, P]    h_t at its time position
//   workspace [T, B, workspace_size(cell, H)]  what the backward needs (cells.h);
//             empty when train=False
//   resets    [T, B] bool: the step at position t of sequence b starts from
//             h0[b] (and c0[b]) where true; by position in either direction
//   zoneout   [T, B, Z] (Z = P + H with a cell state, else H): per unit the
//             weight of the state a step started from in its new state
//             (h part first); any strides along T and B (an evaluation-mode
//             mask may be an expanded [Z] vector)
//   ln        [10H] lstm_ln only: gains of LN(x W_ih^T) (4H) and of
//             LN(h W_hh^T) (4H), gain (H) and shift (H) of LN(c_t)
// Half-precision inputs are computed in float; the workspace is kept in float.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers: a much faster compile
#include <torch/library.h>

// The argument checks every backend runs are in checks.cpp (also linked into
// the emulated CUDA build, which registers no schemas of its own); each
// backend registers its implementations from its own folder (cpu/bindings.cpp,
// cpu/linear.cpp, cuda/bindings.cpp); the rnnkern._C module is module.cpp's.

TORCH_LIBRARY(rnnkern, m) {
  // The step options resets and zoneout, and the LayerNorm cell's gains ln
  // (rnnkern/reference.py's module docstring has the formulas), come last with
  // defaults, so that calls without them keep their form (a backend lacking
  // one would be listed in rnnkern.modules.UNSUPPORTED, which the modules
  // check before any call).  A reset step starts from h0 (c0), or from
  // reset_h (reset_c) where given: then h0 enters only each row's first step
  // (a reset there is the caller's to resolve, by passing the reset state as
  // that row's h0), and the restarts' gradient is grad_reset_h, not grad_h0's.
  // grad_reset_h, grad_reset_c: empty [0] without reset_h (without reset_c).
  // cell_steps (lstm only): c_n is the cell state after every step, [T, B, H]
  // at the steps' time positions, zeros past a row's length (the last step's
  // state is c_n[T - 1] forward without lengths); its gradient grad_c_n is
  // then [T, B, H] too.  What torchrl's next-state keys need (the state at
  // each trajectory's end) without recomputing the gates.
  m.def(
      "recurrence(str cell, Tensor xproj, Tensor h0, Tensor? c0, Tensor w_hh, Tensor? b_ih, "
      "Tensor? b_hh, Tensor? w_hr, Tensor? lengths, bool reverse, bool train, "
      "Tensor? resets=None, Tensor? zoneout=None, Tensor? ln=None, Tensor? reset_h=None, "
      "Tensor? reset_c=None, bool cell_steps=False) "
      "-> (Tensor output, Tensor h_n, Tensor c_n, Tensor workspace)");
  // Inference (CPU): recurrence from the input itself, xproj = x W_ih^T made
  // inside (x [T, B, I], w_ih [G*H, I]), a plain cell without lengths or
  // options; the same results as linear then recurrence.  Refuses inputs
  // that need gradients: modules call it only where none are needed.
  m.def(
      "recurrence_from_input(str cell, Tensor x, Tensor w_ih, Tensor h0, Tensor? c0, "
      "Tensor w_hh, Tensor? b_ih, Tensor? b_hh, bool reverse) "
      "-> (Tensor output, Tensor h_n, Tensor c_n)");
  m.def(
      "recurrence_backward(str cell, Tensor grad_output, Tensor grad_h_n, Tensor? grad_c_n, "
      "Tensor h0, Tensor? c0, Tensor w_hh, Tensor? w_hr, Tensor output, Tensor workspace, "
      "Tensor? lengths, bool reverse, Tensor? resets=None, Tensor? zoneout=None, "
      "Tensor? ln=None, Tensor? reset_h=None, Tensor? reset_c=None) "
      "-> (Tensor grad_xproj, Tensor grad_h0, Tensor grad_c0, Tensor grad_w_hh, "
      "Tensor grad_b_ih, Tensor grad_b_hh, Tensor grad_w_hr, Tensor grad_ln, "
      "Tensor grad_reset_h, Tensor grad_reset_c)");
  m.def(
      "step(str cell, Tensor x, Tensor h, Tensor? c, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
      "Tensor? b_hh, Tensor? ln=None) -> (Tensor h_new, Tensor c_new, Tensor workspace)");
  m.def(
      "step_backward(str cell, Tensor grad_h_new, Tensor? grad_c_new, Tensor x, Tensor h, "
      "Tensor? c, Tensor w_ih, Tensor w_hh, Tensor h_new, Tensor workspace, Tensor? ln=None, "
      "int needs=255) "
      "-> (Tensor grad_x, Tensor grad_h, Tensor grad_c, Tensor grad_w_ih, Tensor grad_w_hh, "
      "Tensor grad_b_ih, Tensor grad_b_hh, Tensor grad_ln)");
  // One step of a whole layer stack by `step`, per layer and direction
  // (CompositeImplicitAutograd, every family: layers_step.cpp): a one-step
  // call of a module.  input [1, B, I] ([B, 1, I] with batch_first), h0 (c0)
  // [L*D, B, H] and weights as torch.nn's hx and _flat_weights (w_ih, w_hh[,
  // b_ih, b_hh] per layer and direction).  c_n: empty [0] without a cell state.
  m.def(
      "layers_step(str cell, Tensor input, Tensor h0, Tensor? c0, Tensor[] weights, "
      "int num_layers, bool bidirectional, bool batch_first) "
      "-> (Tensor output, Tensor h_n, Tensor c_n)");
  // step_backward's `needs`: bit i set when output i is wanted (grad_x = bit 0
  // ... grad_ln = bit 7); an unwanted output is an empty [0] tensor, and a
  // backend may skip its work (one step's products are the call's cost: a
  // cell fed data needs no grad_x).
  // The input projection X W_ih^T as one large product (CPU backend; other
  // backends use torch's matmul).
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  // Zeros of `size` in like's dtype (CPU): from the buffer cache
  // (cpu/buffers.h) when large.  The time-major grid a packed batch's rows
  // are scattered into: fresh from the system, its page faults cost more than
  // the scatter itself (a 48 MB grid: ~25 ms against ~3 ms to clear a cached
  // block).  Not differentiable: callers pass a detached `like`.
  m.def("grid_zeros(Tensor like, int[] size) -> Tensor");
  // x copied into a dense tensor (CPU: a pooled buffer, cpu/buffers.h) whose
  // dimensions lie in memory in `order`, outermost first ([0, 1, ..., n-1]:
  // row-major).  The copies rnnkern makes of a caller's transposed tensors (a
  // batch-first input, sb3-contrib's sequence-major features) and of their
  // gradients, which come back in the caller's layout (autograd.cpp): fresh
  // memory for them cost a page fault per 4 KiB, and a gradient in a layout
  // other than its tensor's costs the caller one more copy.
  m.def("relayout(Tensor x, int[] order) -> Tensor");
  // The create_graph=True backward of `op` ("recurrence" or "step"): gradients
  // of the reference formulation recomputed from the saved inputs (the op's
  // differentiable arguments in its order, then ln; None where absent),
  // differentiable, for the inputs whose bit is set in `needs`.  `constants`:
  // lengths, resets, zoneout (recurrence; empty for step).  Implemented in
  // Python (rnnkern/ops.py); called by the autograd formulas (autograd.cpp).
  m.def(
      "reference_grads(str op, str cell, Tensor?[] inputs, Tensor?[] grads, "
      "Tensor?[] constants, bool reverse, int needs) -> Tensor[]");
  m.def(
      "linear_backward(Tensor grad_y, Tensor x, Tensor weight, bool need_x, bool need_weight) "
      "-> (Tensor grad_x, Tensor grad_weight)");
}
