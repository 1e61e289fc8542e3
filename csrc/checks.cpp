// The argument checks every backend runs first, and the small helpers of
// checks.h (schemas and conventions: ops.cpp).  No registrations here: this file
// is also compiled into the emulated CUDA build (csrc/cuda_emu).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers: a much faster compile
#include "checks.h"

#include <ATen/ops/empty.h>

#include <sstream>
#include <vector>

namespace rnnkern {

Cell parse_cell(c10::string_view name) {
  if (name == "rnn_tanh") return Cell::RnnTanh;
  if (name == "rnn_relu") return Cell::RnnRelu;
  if (name == "lstm") return Cell::Lstm;
  if (name == "gru") return Cell::Gru;
  if (name == "gru_reset_before") return Cell::GruResetBefore;
  if (name == "lstm_ln") return Cell::LstmLn;
  TORCH_CHECK_VALUE(false, "rnnkern: unknown cell '", std::string(name),
                    "'; expected one of rnn_tanh, rnn_relu, lstm, gru, gru_reset_before, lstm_ln");
}

const char* cell_name(Cell cell) {
  switch (cell) {
    case Cell::RnnTanh: return "rnn_tanh";
    case Cell::RnnRelu: return "rnn_relu";
    case Cell::Lstm: return "lstm";
    case Cell::Gru: return "gru";
    case Cell::GruResetBefore: return "gru_reset_before";
    case Cell::LstmLn: return "lstm_ln";
  }
  return "?";
}

int64_t zoneout_width(Cell cell, int64_t H, int64_t P) { return has_cell_state(cell) ? P + H : H; }

std::vector<int64_t> layout_sizes(const RecurrenceSizes& s, int64_t width) {
  return s.packed_rows ? std::vector<int64_t>{s.N, width} : std::vector<int64_t>{s.T, s.B, width};
}

at::ScalarType acc_type(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

Tensor empty_like_options(const Tensor& like, at::ScalarType dtype) {
  return at::empty({0}, like.options().dtype(dtype));
}

namespace {

std::string shape_str(const Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// Checks one tensor argument: dimensionality, sizes, dtype and device.
void check_arg(const char* op, const char* name, const Tensor& t, at::IntArrayRef sizes,
               const Tensor& ref) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " must be a tensor");
  TORCH_CHECK_VALUE(t.dim() == static_cast<int64_t>(sizes.size()) && t.sizes() == sizes, op,
                    ": expected ", name, " of shape ", sizes, ", got ", shape_str(t));
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": expected ", name, " of dtype ",
                   ref.scalar_type(), " (the dtype of the input), got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": expected ", name, " on ", ref.device(),
                    " (the device of the input), got ", t.device());
}

void check_floating(const char* op, const char* name, const Tensor& t) {
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kDouble || st == at::kFloat || st == at::kHalf || st == at::kBFloat16,
                   op, ": expected ", name,
                   " of a floating dtype (float64, float32, float16, bfloat16), got ", st);
}

// lengths' shape [B], dtype and device.
void check_lengths_tensor(const char* op, const Tensor& l, int64_t B) {
  TORCH_CHECK_VALUE(l.dim() == 1 && l.size(0) == B, op, ": expected lengths of shape [", B,
                    "] (one per sequence), got ", shape_str(l));
  TORCH_CHECK_TYPE(l.scalar_type() == at::kLong, op, ": expected lengths of dtype int64, got ",
                   l.scalar_type());
  TORCH_CHECK_VALUE(l.device().is_cpu(), op, ": expected lengths on the CPU (as ",
                    "torch.nn.utils.rnn.pack_padded_sequence), got ", l.device());
}

void check_lengths(const char* op, const OptTensor& lengths, int64_t T, int64_t B) {
  if (!lengths.has_value()) return;
  const Tensor& l = *lengths;
  check_lengths_tensor(op, l, B);
  if (B == 0) return;
  const auto c = l.contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(p[b] >= 0 && p[b] <= T, op, ": lengths[", b, "] = ", p[b],
                      " is outside [0, ", T, "] (T = xproj.size(0))");
  }
}

// The sizes of a call on packed rows (RecurrenceSizes::packed_rows), `rows`
// being xproj or output [N, *]: B from lengths, T their first (largest),
// checked sorted longest first and summing to N.  The options read per
// position of the grid (resets, zoneout, cell_steps, a reset state) keep the
// grid layout.
void check_packed_rows(const char* op, const char* name, const Tensor& rows,
                       const OptTensor& lengths, bool grid_options, RecurrenceSizes& s) {
  TORCH_CHECK_VALUE(lengths.has_value(), op, ": expected ", name,
                    " to be 3-D [T, B, *], or 2-D [N, *] (the rows of a packed batch) with "
                    "lengths, one per sequence, longest first; got ", name, " of shape ",
                    shape_str(rows), " without lengths");
  TORCH_CHECK_VALUE(!grid_options, op, ": resets, zoneout, reset states and cell_steps need ",
                    name, " as the 3-D [T, B, *] grid, not packed rows");
  const Tensor& l = *lengths;
  TORCH_CHECK_VALUE(l.dim() == 1, op, ": expected lengths of shape [B] (one per sequence), got ",
                    shape_str(l));
  check_lengths_tensor(op, l, l.size(0));
  s.B = l.size(0);
  const auto c = l.contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  int64_t sum = 0;
  for (int64_t b = 0; b < s.B; ++b) {
    TORCH_CHECK_VALUE(p[b] >= 0, op, ": lengths[", b, "] = ", p[b], " is negative");
    TORCH_CHECK_VALUE(b == 0 || p[b] <= p[b - 1], op,
                      ": packed rows need lengths sorted longest first (non-increasing), got "
                      "lengths[", b - 1, "] = ", p[b - 1], " < lengths[", b, "] = ", p[b]);
    sum += p[b];
  }
  s.T = s.B > 0 ? p[0] : 0;
  TORCH_CHECK_VALUE(rows.size(0) == sum, op, ": expected ", name, " to have ", sum,
                    " rows (the sum of lengths), got ", rows.size(0));
  s.N = sum;
  s.packed_rows = true;
}

// ln: the layer norms' gains and shift of lstm_ln ([10H]), absent for every other cell.
void check_ln(const char* op, Cell cell, const OptTensor& ln, int64_t H, const Tensor& ref) {
  if (cell == Cell::LstmLn) {
    TORCH_CHECK_VALUE(ln.has_value(), op, ": lstm_ln needs ln (the layer norms' gains and shift, [",
                      10 * H, "])");
    check_arg(op, "ln", *ln, {10 * H}, ref);
  } else {
    TORCH_CHECK_VALUE(!ln.has_value(), op, ": ln is only defined for lstm_ln, got one for ",
                      cell_name(cell));
  }
}

// resets [T, B] bool and zoneout [T, B, Z] (the dtype of the input), on its device.
void check_resets_zoneout(const char* op, Cell cell, const OptTensor& resets,
                          const OptTensor& zoneout, int64_t T, int64_t B, int64_t H, int64_t P,
                          const Tensor& ref) {
  if (resets.has_value()) {
    const Tensor& r = *resets;
    TORCH_CHECK_VALUE(r.dim() == 2 && r.size(0) == T && r.size(1) == B, op,
                      ": expected resets of shape [", T, ", ", B, "] (time, batch), got ",
                      shape_str(r));
    TORCH_CHECK_TYPE(r.scalar_type() == at::kBool, op, ": expected resets of dtype torch.bool, got ",
                     r.scalar_type());
    TORCH_CHECK_VALUE(r.device() == ref.device(), op, ": expected resets on ", ref.device(),
                      " (the device of the input), got ", r.device());
  }
  if (zoneout.has_value()) {
    const int64_t Z = zoneout_width(cell, H, P);
    check_arg(op, "zoneout", *zoneout, {T, B, Z}, ref);
  }
}

// reset_h [B, P] and reset_c [B, H] (the cells with a cell state, then both or
// neither), in the input's dtype and on its device; only with resets.
void check_reset_state(const char* op, Cell cell, const OptTensor& resets,
                       const OptTensor& reset_h, const OptTensor& reset_c, int64_t B, int64_t H,
                       int64_t P, const Tensor& ref) {
  if (!reset_h.has_value()) {
    TORCH_CHECK_VALUE(!reset_c.has_value(), op, ": reset_c given without reset_h");
    return;
  }
  TORCH_CHECK_VALUE(resets.has_value(), op, ": reset_h given without resets (it is the state a ",
                    "reset step starts from)");
  check_arg(op, "reset_h", *reset_h, {B, P}, ref);
  if (has_cell_state(cell)) {
    TORCH_CHECK_VALUE(reset_c.has_value(), op, ": ", cell_name(cell),
                      " needs reset_c with reset_h");
    check_arg(op, "reset_c", *reset_c, {B, H}, ref);
  } else {
    TORCH_CHECK_VALUE(!reset_c.has_value(), op,
                      ": reset_c is only defined for the cells with a cell state, got one for ",
                      cell_name(cell));
  }
}

// Sizes implied by w_hh (and w_hr): H from the gate rows, P from the columns.
void sizes_from_weights(const char* op, Cell cell, const Tensor& w_hh, const OptTensor& w_hr,
                        int64_t& H, int64_t& P, int64_t& G) {
  G = gate_count(cell);
  TORCH_CHECK_VALUE(w_hh.dim() == 2, op, ": expected w_hh to be 2-D [G*H, P], got ",
                    shape_str(w_hh));
  TORCH_CHECK_VALUE(w_hh.size(0) % G == 0 && w_hh.size(0) > 0, op, ": w_hh has ", w_hh.size(0),
                    " rows, expected a positive multiple of ", G, " (the gates of ",
                    cell_name(cell), ")");
  H = w_hh.size(0) / G;
  P = w_hh.size(1);
  if (w_hr.has_value()) {
    TORCH_CHECK_VALUE(cell == Cell::Lstm, op, ": w_hr (projection) is only defined for lstm, got ",
                      cell_name(cell));
    TORCH_CHECK_VALUE(w_hr->dim() == 2 && w_hr->size(0) == P && w_hr->size(1) == H, op,
                      ": expected w_hr of shape [", P, ", ", H, "], got ", shape_str(*w_hr));
  } else {
    TORCH_CHECK_VALUE(P == H, op, ": expected w_hh of shape [", G * H, ", ", H, "], got ",
                      shape_str(w_hh));
  }
}

}  // namespace

RecurrenceSizes check_recurrence(c10::string_view cell_str, const Tensor& xproj, const Tensor& h0,
                                 const OptTensor& c0, const Tensor& w_hh, const OptTensor& b_ih,
                                 const OptTensor& b_hh, const OptTensor& w_hr,
                                 const OptTensor& lengths, const OptTensor& resets,
                                 const OptTensor& zoneout, const OptTensor& ln,
                                 const OptTensor& reset_h, const OptTensor& reset_c,
                                 bool cell_steps, bool allow_packed_rows) {
  const char* op = "rnnkern.recurrence";
  RecurrenceSizes s{};
  s.cell = parse_cell(cell_str);
  check_floating(op, "xproj", xproj);
  const bool rows = allow_packed_rows && xproj.dim() == 2;
  TORCH_CHECK_VALUE(rows || xproj.dim() == 3, op, ": expected xproj to be 3-D [T, B, G*H]",
                    allow_packed_rows ? " or 2-D [N, G*H] (the rows of a packed batch)" : "",
                    ", got ", shape_str(xproj));
  sizes_from_weights(op, s.cell, w_hh, w_hr, s.H, s.P, s.G);
  if (rows) {
    check_packed_rows(op, "xproj", xproj, lengths,
                      resets.has_value() || zoneout.has_value() || reset_h.has_value() ||
                          reset_c.has_value() || cell_steps,
                      s);
  } else {
    s.T = xproj.size(0);
    s.B = xproj.size(1);
    s.N = s.T * s.B;
  }
  s.has_proj = w_hr.has_value();
  const int64_t width = xproj.size(xproj.dim() - 1);
  TORCH_CHECK_VALUE(width == s.G * s.H, op, ": expected xproj.size(", xproj.dim() - 1, ") == ",
                    s.G * s.H, " (", s.G, " gates x hidden size ", s.H, "), got ", width);
  check_arg(op, "w_hh", w_hh, {s.G * s.H, s.P}, xproj);
  check_arg(op, "h0", h0, {s.B, s.P}, xproj);
  if (has_cell_state(s.cell)) {
    TORCH_CHECK_VALUE(c0.has_value(), op, ": ", cell_name(s.cell), " needs c0");
    check_arg(op, "c0", *c0, {s.B, s.H}, xproj);
  } else {
    TORCH_CHECK_VALUE(!c0.has_value(), op, ": c0 is only defined for lstm, got one for ",
                      cell_name(s.cell));
  }
  if (b_ih.has_value()) check_arg(op, "b_ih", *b_ih, {s.G * s.H}, xproj);
  if (b_hh.has_value()) check_arg(op, "b_hh", *b_hh, {s.G * s.H}, xproj);
  if (w_hr.has_value()) check_arg(op, "w_hr", *w_hr, {s.P, s.H}, xproj);
  check_lengths(op, lengths, s.T, s.B);
  check_resets_zoneout(op, s.cell, resets, zoneout, s.T, s.B, s.H, s.P, xproj);
  check_ln(op, s.cell, ln, s.H, xproj);
  check_reset_state(op, s.cell, resets, reset_h, reset_c, s.B, s.H, s.P, xproj);
  s.has_resets = resets.has_value();
  s.has_zoneout = zoneout.has_value();
  s.has_reset_state = reset_h.has_value();
  TORCH_CHECK_VALUE(!cell_steps || s.cell == Cell::Lstm, op,
                    ": cell_steps (the cell state after every step) needs cell 'lstm', got '",
                    cell_name(s.cell), "'");
  s.cell_steps = cell_steps;
  return s;
}

RecurrenceSizes check_recurrence_backward(c10::string_view cell_str, const Tensor& grad_output,
                                          const Tensor& grad_h_n, const OptTensor& grad_c_n,
                                          const Tensor& h0, const OptTensor& c0, const Tensor& w_hh,
                                          const OptTensor& w_hr, const Tensor& output,
                                          const Tensor& workspace, const OptTensor& lengths,
                                          const OptTensor& resets, const OptTensor& zoneout,
                                          const OptTensor& ln, const OptTensor& reset_h,
                                          const OptTensor& reset_c, bool allow_packed_rows) {
  const char* op = "rnnkern.recurrence_backward";
  RecurrenceSizes s{};
  s.cell = parse_cell(cell_str);
  check_floating(op, "output", output);
  const bool rows = allow_packed_rows && output.dim() == 2;
  TORCH_CHECK_VALUE(rows || output.dim() == 3, op, ": expected output to be 3-D [T, B, P]",
                    allow_packed_rows ? " or 2-D [N, P] (the rows of a packed batch)" : "",
                    ", got ", shape_str(output));
  sizes_from_weights(op, s.cell, w_hh, w_hr, s.H, s.P, s.G);
  if (rows) {
    check_packed_rows(op, "output", output, lengths,
                      resets.has_value() || zoneout.has_value() || reset_h.has_value() ||
                          reset_c.has_value() || (grad_c_n.has_value() && grad_c_n->dim() == 3),
                      s);
  } else {
    s.T = output.size(0);
    s.B = output.size(1);
    s.N = s.T * s.B;
  }
  s.has_proj = w_hr.has_value();
  check_arg(op, "output", output, layout_sizes(s, s.P), output);
  check_arg(op, "grad_output", grad_output, layout_sizes(s, s.P), output);
  check_arg(op, "grad_h_n", grad_h_n, {s.B, s.P}, output);
  check_arg(op, "h0", h0, {s.B, s.P}, output);
  check_arg(op, "w_hh", w_hh, {s.G * s.H, s.P}, output);
  if (w_hr.has_value()) check_arg(op, "w_hr", *w_hr, {s.P, s.H}, output);
  if (has_cell_state(s.cell)) {
    TORCH_CHECK_VALUE(c0.has_value() && grad_c_n.has_value(), op, ": ", cell_name(s.cell),
                      " needs c0 and grad_c_n");
    check_arg(op, "c0", *c0, {s.B, s.H}, output);
    // [T, B, H]: the gradient of a cell_steps call's c_n (every step's c).
    s.cell_steps = s.cell == Cell::Lstm && grad_c_n->dim() == 3;
    if (s.cell_steps)
      check_arg(op, "grad_c_n", *grad_c_n, {s.T, s.B, s.H}, output);
    else
      check_arg(op, "grad_c_n", *grad_c_n, {s.B, s.H}, output);
  }
  const int64_t W = workspace_size(s.cell, s.H, zoneout.has_value());
  if (W > 0) {
    TORCH_CHECK_VALUE(workspace.dim() == output.dim(), op,
                      ": the workspace is empty; the forward ran with train=False");
    const std::vector<int64_t> want = layout_sizes(s, W);
    TORCH_CHECK_VALUE(workspace.sizes() == at::IntArrayRef(want), op,
                      ": expected workspace of shape ", at::IntArrayRef(want), ", got ",
                      shape_str(workspace));
    TORCH_CHECK_TYPE(workspace.scalar_type() == acc_type(output.scalar_type()), op,
                     ": expected workspace of dtype ", acc_type(output.scalar_type()), ", got ",
                     workspace.scalar_type());
    TORCH_CHECK_VALUE(workspace.device() == output.device(), op, ": expected workspace on ",
                      output.device(), ", got ", workspace.device());
  }
  check_lengths(op, lengths, s.T, s.B);
  check_resets_zoneout(op, s.cell, resets, zoneout, s.T, s.B, s.H, s.P, output);
  check_ln(op, s.cell, ln, s.H, output);
  check_reset_state(op, s.cell, resets, reset_h, reset_c, s.B, s.H, s.P, output);
  s.has_resets = resets.has_value();
  s.has_zoneout = zoneout.has_value();
  s.has_reset_state = reset_h.has_value();
  return s;
}

namespace {

StepSizes check_step_args(const char* op, c10::string_view cell_str, const Tensor& x,
                          const Tensor& h, const OptTensor& c, const Tensor& w_ih,
                          const Tensor& w_hh, const OptTensor& b_ih, const OptTensor& b_hh,
                          const OptTensor& ln) {
  StepSizes s{};
  s.cell = parse_cell(cell_str);
  check_floating(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": expected x to be 2-D [B, I], got ", shape_str(x));
  int64_t P = 0;
  sizes_from_weights(op, s.cell, w_hh, std::nullopt, s.H, P, s.G);
  s.B = x.size(0);
  s.I = x.size(1);
  check_arg(op, "w_ih", w_ih, {s.G * s.H, s.I}, x);
  check_arg(op, "w_hh", w_hh, {s.G * s.H, s.H}, x);
  check_arg(op, "h", h, {s.B, s.H}, x);
  check_ln(op, s.cell, ln, s.H, x);
  if (has_cell_state(s.cell)) {
    TORCH_CHECK_VALUE(c.has_value(), op, ": ", cell_name(s.cell), " needs c");
    check_arg(op, "c", *c, {s.B, s.H}, x);
  } else {
    TORCH_CHECK_VALUE(!c.has_value(), op, ": c is only defined for lstm, got one for ",
                      cell_name(s.cell));
  }
  if (b_ih.has_value()) check_arg(op, "b_ih", *b_ih, {s.G * s.H}, x);
  if (b_hh.has_value()) check_arg(op, "b_hh", *b_hh, {s.G * s.H}, x);
  return s;
}

}  // namespace

StepSizes check_step(c10::string_view cell_str, const Tensor& x, const Tensor& h,
                     const OptTensor& c, const Tensor& w_ih, const Tensor& w_hh,
                     const OptTensor& b_ih, const OptTensor& b_hh, const OptTensor& ln) {
  return check_step_args("rnnkern.step", cell_str, x, h, c, w_ih, w_hh, b_ih, b_hh, ln);
}

StepSizes check_step_backward(c10::string_view cell_str, const Tensor& grad_h_new,
                              const OptTensor& grad_c_new, const Tensor& x, const Tensor& h,
                              const OptTensor& c, const Tensor& w_ih, const Tensor& w_hh,
                              const Tensor& h_new, const Tensor& workspace, const OptTensor& ln) {
  const char* op = "rnnkern.step_backward";
  StepSizes s =
      check_step_args(op, cell_str, x, h, c, w_ih, w_hh, std::nullopt, std::nullopt, ln);
  check_arg(op, "grad_h_new", grad_h_new, {s.B, s.H}, x);
  check_arg(op, "h_new", h_new, {s.B, s.H}, x);
  if (has_cell_state(s.cell)) {
    TORCH_CHECK_VALUE(grad_c_new.has_value(), op, ": ", cell_name(s.cell), " needs grad_c_new");
    check_arg(op, "grad_c_new", *grad_c_new, {s.B, s.H}, x);
  }
  const int64_t W = workspace_size(s.cell, s.H);
  TORCH_CHECK_VALUE(workspace.sizes() == at::IntArrayRef({s.B, W}), op,
                    ": expected workspace of shape [", s.B, ", ", W, "], got ",
                    shape_str(workspace));
  TORCH_CHECK_TYPE(workspace.scalar_type() == acc_type(x.scalar_type()), op,
                   ": expected workspace of dtype ", acc_type(x.scalar_type()), ", got ",
                   workspace.scalar_type());
  TORCH_CHECK_VALUE(workspace.device() == x.device(), op, ": expected workspace on ", x.device(),
                    ", got ", workspace.device());
  return s;
}

RecurrenceSizes check_recurrence_from_input(c10::string_view cell, const Tensor& x,
                                            const Tensor& w_ih, const Tensor& h0,
                                            const OptTensor& c0, const Tensor& w_hh,
                                            const OptTensor& b_ih, const OptTensor& b_hh) {
  const char* op = "rnnkern.recurrence_from_input";
  check_floating(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() == 3, op, ": expected x to be 3-D [T, B, I], got ", shape_str(x));
  TORCH_CHECK_VALUE(w_hh.dim() == 2, op, ": expected w_hh to be 2-D [G*H, H], got ", shape_str(w_hh));
  TORCH_CHECK_VALUE(w_ih.dim() == 2 && w_ih.size(0) == w_hh.size(0) && w_ih.size(1) == x.size(2), op,
                    ": expected w_ih of shape [", w_hh.size(0), ", ", x.size(2), "] (w_hh.size(0), x.size(2)), got ",
                    shape_str(w_ih));
  check_arg(op, "w_ih", w_ih, w_ih.sizes(), x);
  // The rest as recurrence's, xproj [T, B, G*H] standing for x W_ih^T.
  const Tensor xproj = x.new_empty({1}).expand({x.size(0), x.size(1), w_ih.size(0)});
  return check_recurrence(cell, xproj, h0, c0, w_hh, b_ih, b_hh, std::nullopt, std::nullopt,
                          std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
}

void check_linear(const Tensor& x, const Tensor& weight) {
  const char* op = "rnnkern.linear";
  check_floating(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": expected x to be 2-D [M, K], got ", shape_str(x));
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(1), op,
                    ": expected weight of shape [N, ", x.size(1), "], got ", shape_str(weight));
  check_arg(op, "weight", weight, weight.sizes(), x);
}

void check_linear_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight) {
  check_linear(x, weight);
  check_arg("rnnkern.linear_backward", "grad_y", grad_y, {x.size(0), weight.size(0)}, x);
}

}  // namespace rnnkern
