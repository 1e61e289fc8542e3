// exp and tanh for float on the host, written so that GCC vectorises loops
// that call them (branch-free, no libm calls): libm's scalar expf/tanhf made
// the gate math of a step cost more than its GEMM.  expf is within 1 ulp of
// the correctly rounded result over the whole float range (Cephes
// polynomial); tanhf within 3.5e-7 (see there); inf and NaN behave as in
// libm.  Device code never uses this.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace rnnkern::host_math {

inline float pow2i(int32_t n) {  // 2^n for n in [-126, 127]
  const int32_t bits = (n + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float expf(float x) {
  // Clamp so that 2^n below stays representable in two factors; exp of the
  // clamped ends is already inf (above) or rounds to 0 (below).  NaN passes
  // the comparisons unchanged and propagates through the polynomial.
  x = x > 88.8f ? 88.8f : x;
  x = x < -104.f ? -104.f : x;
  const float n = std::floor(1.44269504088896341f * x + 0.5f);  // round(x / ln 2)
  float r = x - n * 0.693359375f;                                 // ln 2, split hi
  r = r - n * -2.12194440e-4f;                                    // and lo
  const float p = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
                     4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * (r * r) +
                  r + 1.0f;
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t n1 = ni >> 1;  // n in [-150, 129]: split so each factor is a normal float
  return p * pow2i(n1) * pow2i(ni - n1);
}

// tanh as a rational function: x P(x^2) / Q(x^2) on [-9, 9], clamped
// outside (where tanh rounds to +-1 in float).  A minimax fit made for this
// file (numpy, Loeb iteration with Lawson reweighting; degrees 5 / 3 in
// x^2): 5e-8 from tanh in exact arithmetic, at most 3.5e-7 (6 ulp at 1) in
// float arithmetic.  One division and nine multiply-adds: 2.6x faster than
// 1 - 2 / (e^{2|x|} + 1) beside an odd polynomial for small |x| (both
// computed, branch-free), which the LSTM's two tanh per unit paid in its
// gate math (LSTM B=32 H=256: 1.65 -> 1.09 ns a unit, Zen 5).  Odd, |tanh| <= 1;
// NaN propagates.
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

}  // namespace rnnkern::host_math
