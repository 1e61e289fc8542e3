// tanh and the logistic function for float on the host, written so that GCC
// vectorises loops that call them (branch-free, no libm calls): libm's scalar
// expf/tanhf made the gate math of a step cost more than its GEMM.  tanhf is
// within 3.5e-7 of tanh, sigmoidf within 2.2e-7 of the logistic function (see
// each); NaN propagates, +-inf saturate.  Device code never uses this.
#pragma once

#include <cmath>

namespace rnnkern::host_math {

// tanh as a rational function: x P(x^2) / Q(x^2) on [-9, 9], clamped
// outside (where tanh rounds to +-1 in float).  A minimax fit made for this
// file (numpy, Loeb iteration with Lawson reweighting; degrees 5 / 3 in
// x^2): 5e-8 from tanh in exact arithmetic, at most 3.5e-7 (6 ulp at 1) in
// float arithmetic.  One division and nine multiply-adds: 2.6x faster than
// 1 - 2 / (e^{2|x|} + 1) beside an odd polynomial for small |x| (both
// computed, branch-free), which the LSTM's two tanh per unit paid in its
// gate math (LSTM B=32 H=256: 1.65 -> 1.09 ns a unit, Zen 5).  Odd, |tanh| <= 1;
// NaN propagates.  The division stays: on an Intel Xeon (model 207, 512-bit
// vectors; the LSTM's gate math, three sigmoids and two tanh a unit, in L1) a
// reciprocal from a bit-pattern estimate and three Newton steps in its place
// ran 13% slower, one division serving two gates (1 / (q1 q2)) 20% slower, and
// four multiply-adds fewer (lower degrees) no faster: the divider and the
// other vector operations bound it about equally.
inline float tanhf(float x) {
  float a = std::fabs(x);
  a = a > 9.f ? 9.f : a;  // (NaN stays NaN)
  const float s = a * a;
  const float p = ((((1.78367252e-11f * s - 1.25902169e-8f) * s + 9.19461854e-6f) * s +
                    2.91193253e-3f) * s + 1.29106209e-1f) * s + 9.99999762e-1f;
  const float q = ((2.26933116e-4f * s + 2.37259027e-2f) * s + 4.62438524e-1f) * s + 1.f;
  float t = a * p / q;
  t = t > 1.f ? 1.f : t;  // float rounding crosses 1 near |x| = 9
  return std::copysign(t, x);
}

// The logistic function through tanhf: sigmoid(x) = (1 + tanh(x / 2)) / 2.
// Until 2026-12-03 it was 1 / (1 + expf(-x)) with a Cephes expf of this file
// (within 1 ulp), which cost a third more: 0.60 against 0.44 ns a value in
// L1, and the LSTM gate math, three sigmoids a unit, 3.25 against 2.6 ns a
// unit (B=64 H=128, Zen 3).  Within 2.2e-7 of the logistic function over the
// whole float range (checked at every 7th float; the expf form: 8.9e-8): an
// absolute bound, as for ONNX Runtime's rational logistic, so the smallest
// values lose their relative accuracy -- 0 below x = -15.8 to -16.0 (where
// the logistic is 1.4e-7 to 1.1e-7; the clone's multiply-add contraction
// decides), as torch's float32 sigmoid is 1 from x = 16.7 on.
inline float sigmoidf(float x) { return 0.5f + 0.5f * tanhf(0.5f * x); }

}  // namespace rnnkern::host_math
