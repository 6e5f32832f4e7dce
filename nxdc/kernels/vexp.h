// Vector exp shared by the kernels: attention's softmax (attention.cpp) and the SwiGLU epilogue
// of the gate/up matvec (linear.cpp). Part of the library's digest (nxdc/kernels/__init__.py).
#pragma once
#include <immintrin.h>

namespace nxdc_cpu {

// exp(x) for x <= 0, Cephes' expf: 2^n * p(r), r = x - n ln 2, |rel err| < 2e-7; below -87.3
// (exp < 1.2e-38) it returns ~1e-38 instead of underflowing.
__attribute__((target("avx2,fma,f16c"))) inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// silu(g) * u = g * u / (1 + exp(-g)) for 8 lanes, through exp(-|g|) <= 1 so nothing overflows:
// g >= 0: g / (1 + e); g < 0: g * e / (1 + e), with e = exp(-|g|), taken as 0 where exp_neg would
// clamp (|g| > 87.3: silu(g) is g, or -0 below).
__attribute__((target("avx2,fma,f16c"))) inline __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 na = _mm256_or_ps(g, _mm256_set1_ps(-0.0f));  // -|g|
  const __m256 e = _mm256_and_ps(exp_neg(na), _mm256_cmp_ps(na, _mm256_set1_ps(-87.3f), _CMP_GE_OQ));
  const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), g);  // sign bit of g picks g * e
  return _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

}  // namespace nxdc_cpu
