// exp and tanh for float on the host, written so that GCC vectorises loops
// that call them (branch-free, no libm calls): libm's scalar expf/tanhf made
// the gate math of a step cost more than its GEMM.  Accuracy is within 1 ulp
// of the correctly rounded result over the whole float range (Cephes
// polynomials); inf and NaN behave as in libm.  Device code never uses this.
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

inline float tanhf(float x) {
  const float a = std::fabs(x);
  // |x| < 0.625: odd polynomial, no cancellation near 0.
  const float s = x * x;
  const float small = ((((-5.70498872745e-3f * s + 2.06390887954e-2f) * s - 5.37397155531e-2f) * s +
                        1.33314422036e-1f) * s - 3.33332819422e-1f) * s * x + x;
  // otherwise 1 - 2 / (e^{2|x|} + 1), which saturates to 1 for large |x|.
  const float big_abs = 1.f - 2.f / (expf(2.f * a) + 1.f);
  const float big = x < 0.f ? -big_abs : big_abs;
  return a < 0.625f ? small : big;
}

}  // namespace rnnkern::host_math
