// The CPU recurrence's forward driver.  Per time step: one GEMM
// hproj = H_{t-1} W_hh^T into a buffer allocated once, then one pass over the
// batch rows that adds xproj, the bias and applies the cell's gate math
// (rows.h, cells.h), writing h_t, c_t and the workspace.  GRU with the reset
// gate before the product needs a second GEMM (on r * h) and pass; an LSTM
// projection a GEMM h = (o * tanh c) W_hr^T.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers: a much faster compile
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "buffers.h"
#include "products.h"
#include "recurrence.h"
#include "rows.h"
#include "schedule.h"

namespace rnnkern::cpu {

// How many steps' x_t W_ih^T a worker makes in one product where that
// product is its own (ForwardArgs::x_rows on bf16 pairs).  On AMX's tiles a
// worker whose two weights as pairs outgrow this Xeon's 2 MB of L2 streams
// them from L3 every step; one product for kx steps streams W_ih once per kx
// steps and reuses each of its tiles for kx times the rows (bf16 forward, one
// thread, the median of 11-21 interleaved rounds' ratios to torch.nn, one
// step a product -> kx = 4: LSTM B=64 T=64 H=512 (4 MB) 1.01 -> 1.17x, B=16
// T=128 H=512 1.17 -> 1.29x, B=32 T=64 H=384 (2.4 MB) 1.14 -> 1.30x, GRU B=64
// H=512 (3 MB) 1.82 -> 2.01x).  Within L2 it lost 1-8% (LSTM B=32 H=256, 1 MB
// of weights: likely the block's float32 C, 512 KB at kx = 4, crowding the
// cache), and past 256 rows a product
// (B=128 H=512: kx = 4 0.96x of kx = 1, kx = 2 1.01x).  Each row of a
// product on tiles has the bits it has alone (pairs.h), so kx moves no bit.
constexpr int64_t kXStepsWeightBytes = int64_t(2) << 20;
constexpr int64_t kXStepsMaxRows = 256;

template <typename A>
int64_t x_steps_per_product(const ForwardArgs<A>& a, const Split& split,
                            const std::vector<StepWeightT<A>>& w_x, const std::vector<StepWeightT<A>>& w_h) {
  const pairs::Mode mode = pairs::mode();
  if (!a.bf16_products || (mode != pairs::Mode::Tiles && mode != pairs::Mode::TilesEmulated)) return 1;
  int64_t kx = a.z.T;
  for (size_t t = 0; t < split.unit_workers(); ++t) {
    const auto [r, u, sl] = split.unit_work(t);
    const int64_t bytes = (w_x[u].pair_panels.data.size() + w_h[u].pair_panels.data.size()) *
                          int64_t(sizeof(uint32_t));
    if (bytes <= kXStepsWeightBytes) return 1;
    kx = std::min({kx, int64_t(4), std::max<int64_t>(1, kXStepsMaxRows / r.nb)});
  }
  return kx;
}

// Options per step, forward:
//  * resets: a restarting row reads the reset state (a.reset_h, a.reset_c:
//    h0, c0 unless given) where it would read the previous state, and
//    reset_h W_hh^T (step 0's product of the row when that is h0, kept at
//    step 0; else one more product at step 0) in place of its row of the
//    step's product: the product itself and the state buffers are those of a
//    call without resets.
//  * zoneout: the row kernels blend each new state with the one the step
//    started from (the projected h of an LSTM with a projection after its
//    product); the mask rows are read where they lie.
//  * lstm_ln: see ln_product below.
template <typename A>
void forward_impl(const ForwardArgs<A>& a, Tensor& output, Tensor& h_n, Tensor& c_n,
                  Tensor& ws, Tensor& output_bf16) {
  const RecurrenceSizes& z = a.z;
  const int64_t T = z.T, B = z.B, H = z.H, P = z.P, G = z.G;
  const int64_t GH = G * H;
  const int64_t W = workspace_size(z.cell, H, z.has_zoneout);  // per row and step
  const int64_t nsave = workspace_width(z.cell, z.has_zoneout);
  const auto opt = a.h0.options();
  const bool lstm = has_cell_state(z.cell);
  const bool ln_cell = z.cell == Cell::LstmLn;
  const bool reset_before = z.cell == Cell::GruResetBefore;
  const bool save = a.train;
  const Options<A> opts = options_of<A>(z, a.resets, a.zoneout);
  const bool resets = opts.resets != nullptr, zone = opts.zone != nullptr;

  // Packed weights per unit (output) slice, scratch per worker, allocated once.
  // On AMX's tiles a step's products take a fifth of their time on vdpbf16ps
  // and the weights each worker streams per step decide the split: with the
  // input projection inside the steps, W_ih's too (bf16 LSTM B=64 T=64 H=512,
  // two threads, 4 MB of weights: by units 13.0 ms, by rows 15.5 ms, the two
  // alternated five times; on vdpbf16ps by rows was 3-5% faster, Split).
  const int64_t streamed_w_ih =
      a.x_rows.defined() && a.bf16_products && pairs::mode() == pairs::Mode::Tiles
          ? a.w_ih.numel() * int64_t(sizeof(uint16_t))
          : 0;
  const Split split(z, a.bf16_products ? sizeof(uint16_t) : sizeof(A), a.pos.lengths, streamed_w_ih,
                    min_rows_per_worker(z, a.bf16_products));
  // (bf16 pairs are packed for one step too: converting W to float32 for the
  // float32 product in place costs more than packing its pairs)
  const bool in_place = T == 1 && !a.bf16_products;  // see kMaxInPlaceRows
  const bool x_inside = a.x_rows.defined();  // ForwardArgs::x_rows
  // x_t W_ih^T a product of its own (x_own_of): on bf16 pairs, and for the
  // float32 GRU and RNN, whose formulas do not add xproj and hproj first.
  const bool x_own = x_inside && (a.bf16_products || z.cell != Cell::Lstm);
  std::vector<StepWeightT<A>> w_slice, w_n_slice, w_r_slice, w_x_slice;
  TORCH_CHECK(!x_inside || (!in_place && !a.pos.lengths && !a.resets.defined() && !z.has_proj &&
                            z.cell != Cell::GruResetBefore && z.cell != Cell::LstmLn &&
                            a.x_rows.size(1) <= (a.bf16_products ? pairs::kChunk : gemm::kKC)),
              "rnnkern internal: x W_ih^T inside the step products of a plain call only");
  for (const Slice& sl : split.units) {
    if (x_inside) w_x_slice.push_back(gate_rows_t<A>(a.w_ih, G, sl, false, B, a.bf16_products));
    // reset-before: the slice's r, z rows; W_hn multiplies r * h separately.
    w_slice.push_back(gate_rows_t<A>(reset_before ? a.w_hh.narrow(0, 0, 2 * H) : a.w_hh,
                                     reset_before ? 2 : G, sl, in_place, B, a.bf16_products));
    if (reset_before)
      w_n_slice.push_back(gate_rows_t<A>(a.w_hh.narrow(0, 2 * H, H), 1, sl, in_place, B, a.bf16_products));
  }
  for (const Slice& sl : split.outs)
    w_r_slice.push_back(gate_rows_t<A>(a.w_hr, 1, sl, in_place, B, a.bf16_products));
  // A reset state of its own needs its own product (reset_h W_hh^T, made at
  // step 0); else that is h0's, step 0's product.
  const bool own_reset = resets && z.has_reset_state && T > 1;
  std::vector<Tensor> hproj, hproj0, hn, hq;
  for (size_t t = 0; t < split.unit_workers(); ++t) {
    const auto [r, u, sl] = split.unit_work(t);
    hproj.push_back(at::empty({r.nb, w_slice[u].cols()}, opt));
    if (resets && (!ln_cell || own_reset)) hproj0.push_back(at::empty({r.nb, w_slice[u].cols()}, opt));
    if (reset_before) hn.push_back(at::empty({r.nb, sl.n}, opt));
  }
  // x_own: each worker's rows of x_t W_ih^T, for kx steps at a time (x_steps_per_product).
  const int64_t kx = x_own ? x_steps_per_product(a, split, w_x_slice, w_slice) : 1;
  std::vector<Tensor> xq;
  std::vector<std::vector<uint16_t, gemm::UninitAllocator<uint16_t>>> xg;  // their rows of x, gathered
  for (size_t t = 0; x_own && t < split.unit_workers(); ++t) {
    const auto [r, u, sl] = split.unit_work(t);
    xq.push_back(at::empty({kx * r.nb, w_slice[u].cols()}, opt));
    xg.emplace_back(kx > 1 && r.nb < B ? static_cast<size_t>(kx * r.nb * a.x_rows.size(1)) : 0);
  }
  // The first time position of the kx steps whose x W_ih^T step s reads from
  // xq (x_inside: no lengths, every row at one position).
  auto x_block_first = [&](int64_t s) {
    const int64_t s0 = s - s % kx, m = std::min(kx, T - s0);
    return a.pos.reverse ? T - s0 - m : s0;
  };
  for (size_t t = 0; t < split.out_workers(); ++t)
    hq.push_back(at::empty({split.out_work(t).r.nb, split.out_work(t).sl.n}, opt));
  // lstm_ln: the rows' workers (all of them split by rows, one split by
  // units), the whole product's rows split by units, reset_h W_hh^T with resets,
  // and a workspace row per worker for calls that keep none.
  const size_t ln_row_workers = split.by_rows ? split.rows.size() : 1;
  const Tensor hfull = ln_cell && !split.by_rows ? at::empty({B, GH}, opt) : Tensor();
  const Tensor hproj0_ln = ln_cell && resets ? at::empty({B, GH}, opt) : Tensor();
  std::vector<Tensor> ln_scratch;
  for (size_t t = 0; ln_cell && !save && t < ln_row_workers; ++t)
    ln_scratch.push_back(at::empty({W}, opt));
  // Without lengths or a projection, h_t is written straight into the
  // output (all rows of a step at one position), which is then the next
  // step's h_{t-1}: no state buffer and no copy.
  const bool h_in_out = !a.pos.lengths && !z.has_proj;
  // The output rounded to bf16 as each step leaves it (rounds_rows_in_steps):
  // from step 1 on the step's product reads h_{t-1} as those rows' pairs.
  uint16_t* out16 = nullptr;
  if constexpr (std::is_same_v<A, float>) {
    if (rounds_rows_in_steps(z, a.bf16_products) && h_in_out && T > 1) {
      output_bf16 = pooled_empty(output.sizes(), output.options().dtype(at::kBFloat16));
      out16 = reinterpret_cast<uint16_t*>(output_bf16.data_ptr());
    }
  }
  Tensor h_buf[2] = {a.h0.clone(), h_in_out ? Tensor() : at::empty({B, P}, opt)};
  Tensor c_buf[2];
  if (lstm) c_buf[0] = a.c0.clone(), c_buf[1] = at::empty({B, H}, opt);
  const Tensor rh = reset_before ? at::empty({B, H}, opt) : Tensor();
  const Tensor h_full = z.has_proj ? at::empty({B, H}, opt) : Tensor();

  // A bfloat16 call's xproj stays bf16 (ForwardArgs): widened a row's gate
  // blocks at a time as the gate math reads them, in cache, instead of a float
  // copy of the whole (the call's largest buffer: 16 MB at LSTM B=32 T=128
  // H=256, written and read back).
  // (x W_ih^T inside the steps' products: xproj reads as zeros.)
  const std::vector<A> x_zeros(static_cast<size_t>(x_inside ? GH : 0), A(0));
  const bool x_bf16 = !x_inside && a.xproj.scalar_type() == at::kBFloat16;
  const char* x_bytes = x_inside ? nullptr : static_cast<const char*>(a.xproj.const_data_ptr());
  const int64_t x_size = x_bf16 ? 2 : int64_t(sizeof(A));
  const A* xp = x_bf16 || x_inside ? nullptr : cptr<A>(a.xproj);
  // xproj's row `row` at unit j0: gate k of unit j0 + j at [k * H + j], j < n.
  auto x_of = [&](int64_t row, int64_t j0, int64_t n) -> const A* {
    if (x_inside) return x_zeros.data() + j0;
    if (!x_bf16) return xp + row * GH + j0;
    thread_local std::vector<A> wide;
    if (static_cast<int64_t>(wide.size()) < GH) wide.resize(static_cast<size_t>(GH));
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x_bytes) + row * GH + j0;
    A* dst = wide.data() + j0;
    for (int64_t k = 0; k < G; ++k) {
      if constexpr (std::is_same_v<A, float>)
        pairs::widen_bf16(n, src + k * H, dst + k * H);
      else  // (a bf16 call computes in float: not reached)
        for (int64_t j = 0; j < n; ++j) dst[k * H + j] = A(pairs::from_bf16(src[k * H + j]));
    }
    return dst;
  };
  // x_own: row q of a worker's x_t W_ih^T (gate k of unit j0 + j at
  // q[k * n + j]) laid out as x_of's rows, rounded to bf16 on pairs (as
  // linear's bf16 output is).
  auto x_own_of = [&](const A* q, int64_t j0, int64_t n) -> const A* {
    if (!a.bf16_products && n == H) return q;  // all the units (j0 = 0): x_of's layout already
    thread_local std::vector<A> wide;
    if (static_cast<int64_t>(wide.size()) < GH) wide.resize(static_cast<size_t>(GH));
    for (int64_t k = 0; k < G; ++k) {
      A* dst = wide.data() + k * H + j0;
      if constexpr (std::is_same_v<A, float>)
        if (a.bf16_products) {
          pairs::round_to_bf16(n, q + k * n, dst);
          continue;
        }
      copy_row(dst, q + k * n, n);
    }
    return wide.data() + j0;
  };
  // Every cell but the GRU candidate needs only the sum of the two biases.
  const Tensor bias_sum = a.b_x.add(a.b_h);
  const A* bias = cptr<A>(bias_sum);
  const A* bx = cptr<A>(a.b_x);
  const A* bh = cptr<A>(a.b_h);
  const A* lnp = cptr<A>(a.ln);
  // The states a restarting row starts from (h0, c0 unless given: not h_buf[0],
  // c_buf[0], which are overwritten from step 2 on).
  const A* reset_hp = cptr<A>(a.reset_h);
  const A* reset_cp = lstm ? cptr<A>(a.reset_c) : nullptr;
  A* out = ptr<A>(output);
  A* wsp = save ? ptr<A>(ws) : nullptr;
  A* c_steps = z.cell_steps ? ptr<A>(c_n) : nullptr;  // [T, B, H]: c_t at its position
  // The state buffers of step s.
  auto h_next_of = [&](int64_t s) {
    return h_in_out ? out + a.pos.at(0, s) * B * P : ptr<A>(h_buf[(s + 1) & 1]);
  };
  auto h_prev_of = [&](int64_t s) -> const A* {
    return h_in_out && s > 0 ? h_next_of(s - 1) : ptr<A>(h_buf[s & 1]);
  };
  auto c_prev_of = [&](int64_t s) { return lstm ? ptr<A>(c_buf[s & 1]) : nullptr; };
  auto c_next_of = [&](int64_t s) { return lstm ? ptr<A>(c_buf[(s + 1) & 1]) : nullptr; };
  // The rows of a worker's block its step-s products cover (Positions::
  // live_rows): the finished rows past the last running one are skipped.
  // Not with the weights in place (T == 1): there the product's method
  // depends on its number of rows, and a single step has nothing to skip.
  auto live = [&](const Rows& r, int64_t s) { return in_place ? r.nb : a.pos.live_rows(r.b0, r.nb, s); };
  // Whether row b (at time position p) restarts from the reset state at step s
  // (step 0 starts from h0, c0 whatever resets says: the op's rule).
  auto restarts = [&](int64_t p, int64_t b, int64_t s) { return s > 0 && opts.restart(p, b); };

  // Phase 1, per unit slice: the slice's recurrent GEMM and gate math.
  auto gates = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    const int64_t j0 = sl.j0, n = sl.n;
    const A* h_prev = h_prev_of(s);
    A* h_next = h_next_of(s);
    const A* c_prev = c_prev_of(s);
    A* c_next = c_next_of(s);
    // The next step's rows of xproj, from memory into cache while this step's
    // GEMM computes: a call's xproj outgrows the caches (LSTM B=32 T=256
    // H=256: 32 MB), and a step's rows span more pages than the hardware
    // prefetchers follow.
    if (s + 1 < T && !x_inside) {
      for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
        const int64_t p = a.pos.at(b, s + 1);
        if (p < 0) continue;
        const char* row = x_bytes + (a.pos.row(p, b) * GH + j0) * x_size;
        for (int64_t k = 0; k < G; ++k)
          for (int64_t off = 0; off < n * x_size; off += 64)
            __builtin_prefetch(row + k * H * x_size + off);
      }
    }
    const int64_t nl = live(r, s);
    // x_t W_ih^T (every row at one position): the h_{t-1} W_hh^T below added
    // to it, or (x_own) its own.
    const bool add_h = x_inside && !x_own;
    if (x_inside && a.bf16_products) {
      // x_own on pairs: steps s .. s + m - 1 at once (time positions p0 ..
      // p0 + m - 1, in either direction), the worker's rows of them in place
      // where it has the whole batch, else gathered.
      if constexpr (std::is_same_v<A, float>) {
        if (s % kx == 0) {
          const int64_t I = a.x_rows.size(1);
          const int64_t m = std::min(kx, T - s);
          const int64_t p0 = x_block_first(s);
          const uint16_t* xb = pairs::bf16_bits(a.x_rows);
          const uint16_t* rows = xb + (p0 * B + r.b0) * I;
          if (m > 1 && r.nb < B) {
            for (int64_t i = 0; i < m; ++i)
              std::memcpy(xg[t].data() + i * r.nb * I, xb + ((p0 + i) * B + r.b0) * I,
                          sizeof(uint16_t) * r.nb * I);
            rows = xg[t].data();
          }
          step_gemm(m * r.nb, rows, I, w_x_slice[u], ptr<A>(xq[t]), false);
        }
      }
    } else if (x_inside) {
      const int64_t x0 = a.pos.row(a.pos.at(r.b0, s), r.b0) * a.x_rows.size(1);
      step_gemm<A>(nl, cptr<A>(a.x_rows) + x0, a.x_rows.size(1), w_x_slice[u],
                   ptr<A>(x_own ? xq[t] : hproj[t]), false);
    }
    bool multiplied = false;
    if constexpr (std::is_same_v<A, float>) {
      if (out16 != nullptr && s > 0) {  // h_{t-1}: the output rows of step s - 1
        step_gemm(nl, out16 + a.pos.at(0, s - 1) * B * P + r.b0 * P, P, w_slice[u],
                  ptr<A>(hproj[t]), add_h);
        multiplied = true;
      }
    }
    if (!multiplied) step_gemm<A>(nl, h_prev + r.b0 * P, P, w_slice[u], ptr<A>(hproj[t]), add_h);
    A* hp = ptr<A>(hproj[t]);
    const int64_t ldh = n;
    const int64_t hrow = hproj[t].size(1);
    if (own_reset && s == 0)  // reset_h W_hh^T
      step_gemm<A>(r.nb, reset_hp + r.b0 * P, P, w_slice[u], ptr<A>(hproj0[t]), false);
    else if (resets && s == 0)
      copy_row(ptr<A>(hproj0[t]), hp, nl * hrow);  // h0 W_hh^T
    const int64_t x_p0 = x_block_first(s);  // xq's first time position (x_own)
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        // Finished sequence: state unchanged, zeros at the padding position s
        // (where the layout has one).
        if (!z.has_proj) copy_row(h_next + b * H + j0, h_prev + b * H + j0, n);
        if (lstm) copy_row(c_next + b * H + j0, c_prev + b * H + j0, n);
        if (reset_before) zero_row(ptr<A>(rh) + b * H + j0, n);
        if (!a.pos.padded()) continue;
        if (!z.has_proj) zero_row(out + (s * B + b) * H + j0, n);
        if (c_steps) zero_row(c_steps + (s * B + b) * H + j0, n);
        for (int64_t k = 0; k < nsave && save; ++k) zero_row(wsp + (s * B + b) * W + k * H + j0, n);
        continue;
      }
      const int64_t row = a.pos.row(p, b);
      const A* x = x_own ? x_own_of(ptr<A>(xq[t]) + ((p - x_p0) * r.nb + b - r.b0) * G * n, j0, n)
                         : x_of(row, j0, n);
      A* hh = hp + (b - r.b0) * hrow;
      A* w = save ? wsp + row * W + j0 : nullptr;
      A* h = z.has_proj ? ptr<A>(h_full) + b * H + j0 : h_next + b * P + j0;
      // The state the step starts from (h_s: unprojected cells only).
      const bool restart = restarts(p, b, s);
      if (restart) copy_row(hh, ptr<A>(hproj0[t]) + (b - r.b0) * hrow, hrow);
      const A* h_s = z.has_proj ? nullptr : (restart ? reset_hp : h_prev) + b * H + j0;
      const A* c_s = lstm ? (restart ? reset_cp : c_prev) + b * H + j0 : nullptr;
      const A* m = opts.mask(p, b);
      const A* mh = zone ? m + j0 : nullptr;
      const A* mc = zone ? m + opts.zc + j0 : nullptr;
      switch (z.cell) {
        case Cell::RnnTanh:
        case Cell::RnnRelu:
          bool_switch(save, [&](auto kSave) {
            bool_switch(zone, [&](auto kZone) {
              constexpr bool S = decltype(kSave)::value, Z = decltype(kZone)::value;
              if (z.cell == Cell::RnnRelu)
                rnn_forward_row<A, true, S, Z>(n, x, hh, bias + j0, h, h_s, mh, w);
              else
                rnn_forward_row<A, false, S, Z>(n, x, hh, bias + j0, h, h_s, mh, w);
            });
          });
          break;
        case Cell::Lstm:
          bool_switch(save, [&](auto kSave) {
            bool_switch(zone, [&](auto kZone) {
              bool_switch(zone && !z.has_proj, [&](auto kZoneH) {
                lstm_forward_row<A, decltype(kSave)::value, decltype(kZone)::value,
                                 decltype(kZoneH)::value>(n, H, ldh, x, hh, bias + j0, c_s,
                                                          c_next + b * H + j0, h, w, h_s, mh, mc);
              });
            });
          });
          if (c_steps) copy_row(c_steps + row * H + j0, c_next + b * H + j0, n);
          break;
        case Cell::Gru:
          bool_switch(save, [&](auto kSave) {
            bool_switch(zone, [&](auto kZone) {
              gru_forward_row<A, decltype(kSave)::value, decltype(kZone)::value>(
                  n, H, ldh, x, hh, bx + j0, bh + j0, h_s, h, w, mh);
            });
          });
          break;
        case Cell::GruResetBefore:
          gru_rb_gates_row<A>(n, H, ldh, x, hh, bias + j0, h_s, hh, ptr<A>(rh) + b * H + j0);
          continue;  // h comes in phase 2
        case Cell::LstmLn:
          continue;  // ln_product and ln_rows
      }
      if (!z.has_proj && !h_in_out) copy_row(out + row * H + j0, h, n);
      if constexpr (std::is_same_v<A, float>)
        if (out16 != nullptr) pairs::narrow_bf16(n, h, out16 + row * H + j0);
    }
  };

  // Reset-before GRU, phase 2: the candidate's GEMM on r * h (all units), then h.
  auto candidate = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    const int64_t j0 = sl.j0, n = sl.n;
    const A* h_prev = h_prev_of(s);
    A* h_next = h_next_of(s);
    step_gemm<A>(live(r, s), ptr<A>(rh) + r.b0 * H, H, w_n_slice[u], ptr<A>(hn[t]), false);
    const A* rz = ptr<A>(hproj[t]);  // r, z of the slice, from phase 1
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) continue;
      const int64_t row = a.pos.row(p, b);
      const int64_t i = b - r.b0;
      A* h = h_next + b * H + j0;
      A* w = save ? wsp + row * W + j0 : nullptr;
      const A* h_s = (restarts(p, b, s) ? reset_hp : h_prev) + b * H + j0;
      const A* mh = zone ? opts.mask(p, b) + j0 : nullptr;
      bool_switch(save, [&](auto kSave) {
        bool_switch(zone, [&](auto kZone) {
          gru_rb_candidate_row<A, decltype(kSave)::value, decltype(kZone)::value>(
              n, H, n, x_of(row, j0, n), ptr<A>(hn[t]) + i * n, bias + j0, rz + i * 2 * n, h_s,
              h, w, mh);
        });
      });
      if (!h_in_out) copy_row(out + row * H + j0, h, n);
    }
  };

  // LSTM projection, phase 2, per output slice: h_t = (o * tanh c) W_hr^T.
  auto project = [&](size_t t, int64_t s) {
    const auto [r, oi, o] = split.out_work(t);
    const A* h_prev = h_prev_of(s);
    A* h_next = h_next_of(s);
    step_gemm<A>(live(r, s), ptr<A>(h_full) + r.b0 * H, H, w_r_slice[oi], ptr<A>(hq[t]), false);
    const A* q = ptr<A>(hq[t]);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        copy_row(h_next + b * P + o.j0, h_prev + b * P + o.j0, o.n);
        if (a.pos.padded()) zero_row(out + (s * B + b) * P + o.j0, o.n);
        continue;
      }
      if (zone) {
        const A* h_s = (restarts(p, b, s) ? reset_hp : h_prev) + b * P + o.j0;
        zoneout_row<A>(o.n, opts.mask(p, b) + o.j0, h_s, q + (b - r.b0) * o.n,
                       h_next + b * P + o.j0);
      } else {
        copy_row(h_next + b * P + o.j0, q + (b - r.b0) * o.n, o.n);
      }
      copy_row(out + a.pos.row(p, b) * P + o.j0, h_next + b * P + o.j0, o.n);
    }
  };

  // lstm_ln.  Its layer norms need whole rows: of h_{t-1} W_hh^T (4H) and of
  // c~ (H).  Split by rows, every worker has them (its slice is all units)
  // and runs both phases back to back.  Split by units, each worker runs its
  // slice of the product (the step's bulk: at least kMinStepMacsPerWorker
  // multiply-adds a worker) and copies it into a buffer of whole rows; then
  // one thread runs the rows' layer norms and gate math, O(B H) against each
  // worker's O(B H H / workers) product.  So a step still has one meeting of
  // the threads (its product), where splitting the layer norms by units too
  // would add a reduction phase, and a meeting, per layer norm.
  auto ln_product = [&](size_t t, int64_t s) {
    const auto [r, u, sl] = split.unit_work(t);
    const int64_t nl = live(r, s);
    step_gemm<A>(nl, h_prev_of(s) + r.b0 * P, P, w_slice[u], ptr<A>(hproj[t]), false);
    // A reset state of its own: its product, into hproj0_ln's whole rows.
    if (own_reset && s == 0) {
      step_gemm<A>(r.nb, reset_hp + r.b0 * P, P, w_slice[u], ptr<A>(hproj0[t]), false);
      const A* rw = ptr<A>(hproj0[t]);
      for (int64_t i = 0; i < r.nb; ++i) {
        if (split.by_rows) {
          copy_row(ptr<A>(hproj0_ln) + (r.b0 + i) * GH, rw + i * GH, GH);
        } else {
          for (int64_t k = 0; k < G; ++k)
            copy_row(ptr<A>(hproj0_ln) + (r.b0 + i) * GH + k * H + sl.j0,
                     rw + (i * G + k) * sl.n, sl.n);
        }
      }
    }
    if (split.by_rows) return;
    const A* hp = ptr<A>(hproj[t]);  // [B, G*n]: gate k of unit j0 + j at k*n + j
    for (int64_t b = 0; b < nl; ++b)
      for (int64_t k = 0; k < G; ++k)
        copy_row(ptr<A>(hfull) + b * GH + k * H + sl.j0, hp + (b * G + k) * sl.n, sl.n);
  };
  auto ln_rows = [&](size_t t, int64_t s) {
    const Rows r = split.rows_of(t);
    const A* h_prev = h_prev_of(s);
    A* h_next = h_next_of(s);
    const A* c_prev = c_prev_of(s);
    A* c_next = c_next_of(s);
    for (int64_t b = r.b0; b < r.b0 + r.nb; ++b) {
      const int64_t p = a.pos.at(b, s);
      if (p < 0) {
        copy_row(h_next + b * H, h_prev + b * H, H);
        copy_row(c_next + b * H, c_prev + b * H, H);
        if (!a.pos.padded()) continue;
        zero_row(out + (s * B + b) * H, H);
        if (save) zero_row(wsp + (s * B + b) * W, W);
        continue;
      }
      const int64_t row = a.pos.row(p, b);
      A* hh = split.by_rows ? ptr<A>(hproj[t]) + (b - r.b0) * GH : ptr<A>(hfull) + b * GH;
      const bool restart = restarts(p, b, s);
      if (resets && !own_reset && s == 0) copy_row(ptr<A>(hproj0_ln) + b * GH, hh, GH);  // h0 W_hh^T
      if (restart) copy_row(hh, ptr<A>(hproj0_ln) + b * GH, GH);
      const A* h_s = (restart ? reset_hp : h_prev) + b * H;
      const A* c_s = (restart ? reset_cp : c_prev) + b * H;
      const A* m = opts.mask(p, b);
      A* w = save ? wsp + row * W : ptr<A>(ln_scratch[t]);
      A* h = h_next + b * H;
      bool_switch(zone, [&](auto kZone) {
        lstm_ln_forward_row<A, decltype(kZone)::value>(H, x_of(row, 0, H), hh, bias, lnp, h_s, c_s,
                                                       zone ? m : nullptr,
                                                       zone ? m + opts.zc : nullptr, w,
                                                       c_next + b * H, h);
      });
      if (!h_in_out) copy_row(out + row * H, h, H);
    }
  };

  if (ln_cell) {
    run_steps(split, T, false, phase(true, split.unit_workers(), ln_product),
              phase(true, ln_row_workers, ln_rows));
  } else {
    run_steps(split, T, false, phase(true, split.unit_workers(), gates),
              phase(reset_before, split.unit_workers(), candidate),
              phase(z.has_proj, split.out_workers(), project));
  }
  if (h_in_out && T > 0)
    h_n.copy_(output[a.pos.at(0, T - 1)]);
  else
    h_n.copy_(h_buf[h_in_out ? 0 : T & 1]);
  if (lstm && !z.cell_steps) c_n.copy_(c_buf[T & 1]);
}

// A batch of one runs each step's product on one row: h_{t-1} W_hh^T streams
// W_hh (LSTM H=128: 256 KB, from L2) at the cache's bandwidth while the FMA
// units wait, and the input projection before the loop (X W_ih^T over all
// steps) keeps them busy with no stream to wait on.  Here the projection of
// the next chunk of kProjectionTileRows steps is spread over the steps of
// this one, inside their products (gemm::row_with_tiles_wide), into a ring of
// two chunks' rows: its multiply-adds run in the shadow of the products'
// loads, and xproj never leaves the caches (one thread, Zen 4, T=256: LSTM
// H=128 1.19x linear then recurrence, GRU 1.17x, RNN 1.22x).
void forward_from_input(const FromInputArgs& a, Tensor& output, Tensor& h_n, Tensor& c_n) {
#if defined(RNNKERN_CPU_WIDE_VECTORS)
  TORCH_CHECK(gemm::wide_vectors(), "rnnkern internal: forward_from_input runs on 512-bit vectors");
  using A = float;
  const int64_t T = a.T, I = a.I, H = a.H, GH = a.G * a.H;
  const int64_t R = gemm::kProjectionTileRows;
  gemm::PackedB<A> w_hh_t, w_ih_t;
  w_hh_t.resize(H, GH);
  gemm::pack_panels<A>(w_hh_t, cptr<A>(a.w_hh), 1, H, 0, w_hh_t.panels());
  w_ih_t.resize(I, GH);
  gemm::pack_panels<A>(w_ih_t, cptr<A>(a.w_ih), 1, I, 0, w_ih_t.panels());
  const int64_t panels = w_ih_t.panels();
  std::vector<A> ring(static_cast<size_t>(2 * R * GH));
  // Each chunk's rows of x transposed (ProjectionTiles::xt), two chunks' in turn;
  // the rows past T (a last, partial chunk) zeros.
  std::vector<A> xt(static_cast<size_t>(2 * R * I));
  const bool lstm = a.cell == Cell::Lstm;
  const Tensor bias_sum = a.b_x.add(a.b_h);
  const A* bias = cptr<A>(bias_sum);
  const A* bx = cptr<A>(a.b_x);
  const A* bh = cptr<A>(a.b_h);
  std::vector<A> hh(static_cast<size_t>(GH));
  std::vector<A> c_buf(static_cast<size_t>(lstm ? 2 * H : 0));
  if (lstm) std::copy_n(cptr<A>(a.c0), H, c_buf.data());
  A* out = ptr<A>(output);
  auto position = [&](int64_t s) { return a.reverse ? T - 1 - s : s; };
  auto transpose_chunk = [&](int64_t q) {
    A* dst = xt.data() + (q & 1) * R * I;
    const int64_t s0 = q * R, rows = std::min(R, T - s0);
    for (int64_t r = 0; r < R; ++r) {
      const A* row = r < rows ? a.x + position(s0 + r) * a.ldx : nullptr;
      for (int64_t k = 0; k < I; ++k) dst[k * R + r] = row ? row[k] : A(0);
    }
  };
  // Chunk q's tiles over panels [p0, p1).
  auto chunk_tiles = [&](int64_t q, int64_t p0, int64_t p1) {
    gemm::ProjectionTiles<A> t;
    t.xt = xt.data() + (q & 1) * R * I;
    t.w = &w_ih_t;
    t.y = ring.data() + (q & 1) * R * GH;
    t.ldy = GH;
    t.p0 = p0;
    t.p1 = p1;
    return t;
  };
  const gemm::PackedB<A> none;
  transpose_chunk(0);
  gemm::row_with_tiles_wide<A>(nullptr, none, nullptr, chunk_tiles(0, 0, panels));
  const int64_t chunks = (T + R - 1) / R;
  for (int64_t s = 0; s < T; ++s) {
    const int64_t q = s / R, i = s % R;
    if (i == 0 && q + 1 < chunks) transpose_chunk(q + 1);
    const A* h_prev = s == 0 ? cptr<A>(a.h0) : out + position(s - 1) * H;
    A* h = out + position(s) * H;
    // The next chunk's share of panels for this step (none past the last).
    const gemm::ProjectionTiles<A> tiles = q + 1 < chunks
        ? chunk_tiles(q + 1, panels * i / R, panels * (i + 1) / R) : gemm::ProjectionTiles<A>{};
    gemm::row_with_tiles_wide<A>(h_prev, w_hh_t, hh.data(), tiles);
    const A* x = ring.data() + ((q & 1) * R + i) * GH;
    switch (a.cell) {
      case Cell::RnnTanh:
        rnn_forward_row<A, false, false, false>(H, x, hh.data(), bias, h, h_prev, nullptr, nullptr);
        break;
      case Cell::RnnRelu:
        rnn_forward_row<A, true, false, false>(H, x, hh.data(), bias, h, h_prev, nullptr, nullptr);
        break;
      case Cell::Lstm:
        lstm_forward_row<A, false, false, false>(H, H, H, x, hh.data(), bias, c_buf.data() + (s & 1) * H,
                                                 c_buf.data() + ((s + 1) & 1) * H, h, nullptr, h_prev,
                                                 nullptr, nullptr);
        break;
      case Cell::Gru:
        gru_forward_row<A, false, false>(H, H, H, x, hh.data(), bx, bh, h_prev, h, nullptr, nullptr);
        break;
      default:
        TORCH_CHECK(false, "rnnkern internal: forward_from_input runs the plain cells only");
    }
  }
  h_n.copy_(output[position(T - 1)]);
  if (lstm) std::copy_n(c_buf.data() + (T & 1) * H, H, ptr<A>(c_n));
#else
  TORCH_CHECK(false, "rnnkern internal: forward_from_input runs on 512-bit vectors, not in this build");
#endif
}

template void forward_impl<float>(const ForwardArgs<float>&, Tensor&, Tensor&, Tensor&, Tensor&,
                                  Tensor&);
template void forward_impl<double>(const ForwardArgs<double>&, Tensor&, Tensor&, Tensor&, Tensor&,
                                   Tensor&);

}  // namespace rnnkern::cpu
