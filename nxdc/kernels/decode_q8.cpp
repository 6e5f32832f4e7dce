// Linear layers of the decode and verify graphs on integer dot products (AVX-512 VNNI VPDPBUSD:
// 64 unsigned-byte x signed-byte products a instruction, summed by 4 into int32 lanes), for
// int4 and grouped int8 weights, the method llama.cpp's CPU backend uses for its quantized types.
//
//   nxdc::linear_q8(x, w, scale, min=None)   out[M, N] = q8(x) @ dequant(w)^T
//   nxdc::swiglu_q8(x, w, scale, min=None)   silu(q8(x) @ gate^T) * (q8(x) @ up^T), w = [gate; up]
//
// Same arguments as linear.cpp's linear_i4 / linear_i8 / swiglu. q8(x): each activation row is
// quantized to int8 in blocks of 32, one fp32 scale a block (amax / 127, round to nearest: llama.cpp's
// Q8_0). A weight is an unsigned code u and its group's scale s (and min m):
//   int4 symmetric   w = (u - 8) * s         u = nibble
//   int4 asymmetric  w = u * s + m           u = nibble
//   int8             w = (u - 128) * s (+ m) u = q + 128 (the stored byte with its sign bit flipped)
// so a row's sum is  sum_lanes float(D) * s * sa  +  sum_groups (m - c * s) * A,  where D is the
// int32 sum of u * q8 over a lane's 4 (int8) or 8 (int4: low and high nibbles) bytes, sa the
// activation block's scale, c = 8 / 0 / 128 and A = sa * (sum of a group's q8 values), computed
// once a call. The weight's bits are read once, as in linear.cpp, and never converted to fp32:
// int4 costs 11 instructions per 128 weights instead of about 36. The results differ from the
// exact kernels by the activations' rounding (relative error <= 1/254 of a block's largest value).
//
// Every output row is summed in the same order whatever M, the weight rows beside it or the
// thread split, and an activation row's quantization does not depend on the other rows: a verify
// graph's rows equal a decode graph's bit for bit, which greedy speculative decoding relies on.
//
// Taken where the CPU has AVX-512 VNNI and the group size is 32 or 64 int4 weights (16 or 32 int8)
// or a multiple of 128 (64); otherwise, and with NXDC_DECODE_Q8=0, these ops are linear.cpp's exact ones.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#define NXDC_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

#include "linear.h"  // the exact kernels (the fallback and the argument checks), ISA choice, SiLU

namespace {

bool vnni_available() {
  static const bool yes = !nxdc_cpu::turned_off("NXDC_DECODE_Q8") && nxdc_cpu::has_avx512() &&
                          __builtin_cpu_supports("avx512vnni");
  return yes;
}

enum class Kind { I8, I4 };

// Weights a chunk: one 64-byte line of a row (int4: 4 blocks of 32, int8: 64 weights).
template <Kind F>
constexpr int64_t chunk_weights() {
  return F == Kind::I4 ? 128 : 64;
}

// The weights' lanes per group scale: 4 (4 groups a chunk), 8 (2) or 16 (a chunk within one
// group); 0: another group size (the exact path).
int64_t lanes_per_scale(Kind F, int64_t G) {
  const int64_t ch = F == Kind::I4 ? 128 : 64;
  if (G == ch / 4) return 4;
  if (G == ch / 2) return 8;
  return G % ch == 0 ? 16 : 0;
}

struct Weights {
  const uint8_t* w;
  nxdc_cpu::GroupRows scale;  // [N, ng]: fp32, fp16 or two-level
  nxdc_cpu::GroupRows mins;   // [N, ng] or none
  int64_t K, N, ng, G;
};

// One call's activations, quantized once: per row, the int8 values in the weights' byte order
// (int4: a chunk's 4 low halves, then its 4 high halves; int8: as they are), zero-padded to
// whole chunks; each weight lane's activation scale (16 a chunk); A per weight group, and -c * A.
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> lane, A, Ac;
  int64_t KP = 0, LN = 0, ng = 0;  // per row: q bytes, lane scales, groups
};

// A view of rows [m0, m0 + M) of Acts.
struct ActRows {
  const int8_t* q;
  const float *lane, *A, *Ac;
  int64_t KP, LN, ng;
};

ActRows rows_of(const Acts& a, int64_t m0) {
  return {a.q.data() + m0 * a.KP, a.lane.data() + m0 * a.LN, a.A.data() + m0 * a.ng,
          a.Ac.empty() ? nullptr : a.Ac.data() + m0 * a.ng, a.KP, a.LN, a.ng};
}

template <Kind F>
constexpr int bias_levels(bool mins) {  // c: the code of a zero weight
  return F == Kind::I8 ? 128 : (mins ? 0 : 8);
}

// Row x [K] into its slots of a (row m). Blocks of 32 (the last may be 16: int8 K % 32 == 16).
template <Kind F>
NXDC_VNNI void quantize_row(const float* x, int64_t K, int64_t G, int c, Acts& a, int64_t m) {
  int8_t* q = a.q.data() + m * a.KP;
  float* lane = a.lane.data() + m * a.LN;
  float* A = a.A.data() + m * a.ng;
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const int64_t len = std::min<int64_t>(32, K - k0);
    const __mmask16 lo = len >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1u);
    const __mmask16 hi = len > 16 ? static_cast<__mmask16>((1u << (len - 16)) - 1u) : 0;
    const __m512 v0 = _mm512_maskz_loadu_ps(lo, x + k0), v1 = _mm512_maskz_loadu_ps(hi, x + k0 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float sa = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    const int64_t b = k0 / 32;
    int8_t *d0, *d1;
    if constexpr (F == Kind::I4) {  // chunk b / 4, block b % 4: low halves at 16 (b % 4), high at 64 + 16 (b % 4)
      d0 = q + (b / 4) * 128 + (b % 4) * 16;
      d1 = d0 + 64;
      for (int l = 0; l < 4; ++l) lane[(b / 4) * 16 + (b % 4) * 4 + l] = sa;
    } else {  // chunk b / 2, lanes 8 (b % 2) .. + 8
      d0 = q + k0;
      d1 = d0 + 16;
      for (int l = 0; l < 8; ++l) lane[(b / 2) * 16 + (b % 2) * 8 + l] = sa;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d0), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d1), _mm512_cvtsepi32_epi8(q1));
    // A: each 16-value half into its group (G >= 16), in order
    const float s0 = sa * static_cast<float>(_mm512_reduce_add_epi32(_mm512_maskz_mov_epi32(lo, q0)));
    const float s1 = sa * static_cast<float>(_mm512_reduce_add_epi32(_mm512_maskz_mov_epi32(hi, q1)));
    A[k0 / G] += s0;
    if (len > 16) A[(k0 + 16) / G] += s1;
  }
  if (!a.Ac.empty())
    for (int64_t g = 0; g < a.ng; ++g) a.Ac[m * a.ng + g] = -static_cast<float>(c) * A[g];
}

template <Kind F>
Acts quantize(const float* x, int64_t M, int64_t K, int64_t G, bool mins) {
  constexpr int64_t CH = chunk_weights<F>();
  Acts a;
  const int64_t chunks = (K + CH - 1) / CH;
  a.KP = chunks * CH;
  a.LN = chunks * 16;
  a.ng = K / G;
  const int c = bias_levels<F>(mins);
  a.q.assign(M * a.KP, 0);
  a.lane.assign(M * a.LN, 0.0f);
  a.A.assign(M * a.ng, 0.0f);
  if (c != 0) a.Ac.assign(M * a.ng, 0.0f);
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row<F>(x + m * K, K, G, c, a, m);
  });
  return a;
}

// The group scales of chunk c's 16 lanes (n valid groups in a tail chunk).
template <int LPS>
NXDC_VNNI __attribute__((always_inline)) inline __m512 lane_scales(const float* s, int64_t c, int64_t first,
                                                                   __mmask16 valid) {
  if constexpr (LPS == 4) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(valid & 0xF, s + 4 * c));
  } else if constexpr (LPS == 8) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(valid & 0x3, s + 2 * c));
  } else {
    return _mm512_set1_ps(s[first]);
  }
}

// acc[r][m] += float(D) * s * sa for chunk c of R weight rows and M activation rows.
template <Kind F, int LPS, int R, int M, bool TAIL>
NXDC_VNNI __attribute__((always_inline)) inline void chunk(__m512 (&acc)[R][M], const uint8_t* (&wr)[R],
                                                           const float* (&sr)[R], const ActRows& x, int64_t c,
                                                           int64_t first, __mmask64 bytes, __mmask16 valid) {
  constexpr int64_t CH = chunk_weights<F>();
  for (int r = 0; r < R; ++r) {
    const __m512i wb = TAIL ? _mm512_maskz_loadu_epi8(bytes, wr[r] + c * 64) : _mm512_loadu_si512(wr[r] + c * 64);
    const __m512 sw = lane_scales<LPS>(sr[r], c, first, valid);
    __m512i u0, u1;
    if constexpr (F == Kind::I4) {
      const __m512i m4 = _mm512_set1_epi8(0x0F);
      u0 = _mm512_and_si512(wb, m4);
      u1 = _mm512_and_si512(_mm512_srli_epi16(wb, 4), m4);
    } else {
      u0 = _mm512_xor_si512(wb, _mm512_set1_epi8(static_cast<char>(0x80)));
    }
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = x.q + m * x.KP + c * CH;
      __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, _mm512_loadu_si512(xq));
      if constexpr (F == Kind::I4) d = _mm512_dpbusd_epi32(d, u1, _mm512_loadu_si512(xq + 64));
      const __m512 t = _mm512_mul_ps(sw, _mm512_loadu_ps(x.lane + m * x.LN + c * 16));
      acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), t, acc[r][m]);
    }
  }
}

// sum_g (m_g - c * s_g) * A_g of weight row n, activation row m.
template <bool MIN, bool BIAS>
NXDC_VNNI inline float group_terms(const float* s, const float* mn, const ActRows& x, int m) {
  const float* A = x.A + m * x.ng;
  const float* Ac = BIAS ? x.Ac + m * x.ng : nullptr;
  __m512 t = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.ng; g += 16) {
    const __mmask16 k = x.ng - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (x.ng - g)) - 1u);
    if constexpr (MIN) t = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, mn + g), _mm512_maskz_loadu_ps(k, A + g), t);
    if constexpr (BIAS) t = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, s + g), _mm512_maskz_loadu_ps(k, Ac + g), t);
  }
  return _mm512_reduce_add_ps(t);
}

constexpr int64_t PF_L2_BYTES = 16384, PF_L1_BYTES = 2048;  // as linear.cpp's streams

// Weight rows [n0, n1), R at a time, against M activation rows: out[m * ldo + n - n0].
template <Kind F, int LPS, bool MIN, int R, int M>
NXDC_VNNI void rows(const Weights& a, const ActRows& x, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  constexpr int64_t CH = chunk_weights<F>();
  constexpr bool BIAS = bias_levels<F>(MIN) != 0;
  const int64_t RB = F == Kind::I4 ? a.K / 2 : a.K, full = a.K / CH, tail = a.K % CH;
  const __mmask64 tail_bytes = (1ull << (F == Kind::I4 ? tail / 2 : tail)) - 1ull;  // tail < CH
  const __mmask16 tail_valid = static_cast<__mmask16>((1u << (tail / a.G)) - 1u);   // LPS 4 / 8 only
  float* pbuf = nxdc_cpu::scratch_floats(2 * R * a.ng);  // fp16 scales and mins, as fp32
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[R][M];
    const uint8_t* wr[R];
    const float *sr[R], *mr[R];
    for (int r = 0; r < R; ++r) {
      wr[r] = a.w + (n + r) * RB;
      sr[r] = a.scale.row(n + r, pbuf + 2 * r * a.ng);
      mr[r] = a.mins.row(n + r, pbuf + (2 * r + 1) * a.ng);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    }
    const char* pf1 = reinterpret_cast<const char*>(wr[0]) + PF_L1_BYTES;
    const char* pf2 = reinterpret_cast<const char*>(wr[0]) + PF_L2_BYTES;
    for (int64_t c = 0; c < full; ++c) {
      for (int r = 0; r < R; ++r, pf1 += 64, pf2 += 64) {  // the R rows are contiguous: R lines a chunk
        _mm_prefetch(pf2, _MM_HINT_T1);
        _mm_prefetch(pf1, _MM_HINT_T0);
      }
      chunk<F, LPS, R, M, false>(acc, wr, sr, x, c, c * CH / a.G, 0, 0xFFFF);
    }
    if (tail) chunk<F, LPS, R, M, true>(acc, wr, sr, x, full, 0, tail_bytes, tail_valid);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        out[m * ldo + n + r - n0] = _mm512_reduce_add_ps(acc[r][m]) + group_terms<MIN, BIAS>(sr[r], mr[r], x, m);
  }
  if constexpr (R > 1) {
    if (n < n1) rows<F, LPS, MIN, 1, M>(a, x, n, n1, out + (n - n0), ldo);
  }
}

// Up to 8 activation rows: R weight rows a block keep R * M accumulators in registers.
template <Kind F, int LPS, bool MIN>
void rows_any(const Weights& a, const ActRows& x, int64_t M, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  switch (M) {
    case 1: rows<F, LPS, MIN, 4, 1>(a, x, n0, n1, out, ldo); break;
    case 2: rows<F, LPS, MIN, 4, 2>(a, x, n0, n1, out, ldo); break;
    case 3: rows<F, LPS, MIN, 2, 3>(a, x, n0, n1, out, ldo); break;
    case 4: rows<F, LPS, MIN, 2, 4>(a, x, n0, n1, out, ldo); break;
    case 5: rows<F, LPS, MIN, 1, 5>(a, x, n0, n1, out, ldo); break;
    case 6: rows<F, LPS, MIN, 1, 6>(a, x, n0, n1, out, ldo); break;
    case 7: rows<F, LPS, MIN, 1, 7>(a, x, n0, n1, out, ldo); break;
    default: rows<F, LPS, MIN, 1, 8>(a, x, n0, n1, out, ldo); break;
  }
}

constexpr int64_t U = 16;  // weight rows per unit of the thread split

// Weight rows [n0, n1) against all M rows: passes of at most 8 activation rows over L2-sized
// tiles of weight rows (a weight comes from memory once whatever M).
template <Kind F, int LPS, bool MIN>
void rows_all(const Weights& a, const Acts& x, int64_t M, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t RB = F == Kind::I4 ? a.K / 2 : a.K;
  const int64_t tile = M <= 8 ? n1 - n0 : std::max<int64_t>(U, (256 * 1024) / std::max<int64_t>(1, RB) / U * U);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t m0 = 0; m0 < M; m0 += 8)
      rows_any<F, LPS, MIN>(a, rows_of(x, m0), std::min<int64_t>(8, M - m0), t0, t1, out + m0 * ldo + (t0 - n0), ldo);
  }
}

// Whether this call takes the integer path (else linear.cpp's exact kernels).
bool integer_path(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  const auto t = w.scalar_type();
  if (!vnni_available() || (t != at::kByte && t != at::kChar) || x.dim() != 2 || w.dim() != 2) return false;
  const int64_t K = x.size(1), ng = nxdc_cpu::scale_groups(scale, K);
  if (K == 0 || ng == 0 || K % ng != 0 || x.size(0) == 0 || w.size(0) == 0) return false;
  return lanes_per_scale(t == at::kByte ? Kind::I4 : Kind::I8, K / ng) != 0;
}

struct Call {
  at::Tensor x, w, s, m;
  Weights a;
  Kind F;
  int64_t lps;
  Acts acts;
};

Call prepare(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& scale, const std::optional<at::Tensor>& min) {
  Call c;
  c.x = x_.contiguous();
  c.w = w_.contiguous();
  c.s = scale.contiguous();
  if (min.has_value()) c.m = min->contiguous();
  const int64_t K = c.x.size(1), ng = nxdc_cpu::scale_groups(c.s, K);
  c.F = c.w.scalar_type() == at::kByte ? Kind::I4 : Kind::I8;
  c.a = Weights{static_cast<const uint8_t*>(c.w.data_ptr()), nxdc_cpu::group_rows(c.s, K), nxdc_cpu::group_rows(c.m, K), K, c.w.size(0), ng, K / ng};
  c.lps = lanes_per_scale(c.F, K / ng);
  const float* xp = c.x.data_ptr<float>();
  const int64_t M = c.x.size(0);
  c.acts = c.F == Kind::I4 ? quantize<Kind::I4>(xp, M, K, K / ng, c.m.defined())
                           : quantize<Kind::I8>(xp, M, K, K / ng, c.m.defined());
  return c;
}

// rows_all for the call's kind, lanes per scale and mins: weight rows [n0, n1) into out.
template <Kind F>
void run_kind(const Call& c, int64_t M, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const Weights& a = c.a;
  const Acts& x = c.acts;
  if (c.m.defined()) {
    if (c.lps == 4) rows_all<F, 4, true>(a, x, M, n0, n1, out, ldo);
    else if (c.lps == 8) rows_all<F, 8, true>(a, x, M, n0, n1, out, ldo);
    else rows_all<F, 16, true>(a, x, M, n0, n1, out, ldo);
  } else {
    if (c.lps == 4) rows_all<F, 4, false>(a, x, M, n0, n1, out, ldo);
    else if (c.lps == 8) rows_all<F, 8, false>(a, x, M, n0, n1, out, ldo);
    else rows_all<F, 16, false>(a, x, M, n0, n1, out, ldo);
  }
}

void run_rows(const Call& c, int64_t M, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  if (c.F == Kind::I4)
    run_kind<Kind::I4>(c, M, n0, n1, out, ldo);
  else
    run_kind<Kind::I8>(c, M, n0, n1, out, ldo);
}

int64_t grain(const Call& c, int64_t M) {  // at least ~64 KiB of weights a thread
  const int64_t RB = c.F == Kind::I4 ? c.a.K / 2 : c.a.K;
  return std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, U * RB * ((M + 7) / 8)));
}

}  // namespace

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& min) {
  auto exact = [&](const at::Tensor& xs) {
    TORCH_CHECK(w.scalar_type() == at::kByte || w.scalar_type() == at::kChar,
                "linear_q8: w must be int8 or int4 (uint8), got ", w.scalar_type());
    return w.scalar_type() == at::kByte ? linear_i4(xs, w, scale, min) : linear_i8(xs, w, scale, min);
  };
  if (!integer_path(x, w, scale)) return exact(x);
  exact(x.narrow(0, 0, 0));  // the exact op's argument checks, on a zero-row call
  Call c = prepare(x, w, scale, min);
  const int64_t M = c.x.size(0), N = c.a.N;
  at::Tensor out = at::empty({M, N}, x.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (N + U - 1) / U, grain(c, M), [&](int64_t u0, int64_t u1) {
    const int64_t n0 = u0 * U, n1 = std::min(N, u1 * U);
    run_rows(c, M, n0, n1, o + n0, N);
  });
  return out;
}

// The threads split the I output columns; each computes the gate and up rows of its own columns
// into a scratch and applies silu * up there (as linear.cpp's swiglu).
at::Tensor swiglu_q8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& min) {
  if (!integer_path(x, w, scale) || w.size(0) % 2 != 0) return swiglu(x, w, scale, min);
  swiglu(x.narrow(0, 0, 0), w, scale, min);  // the checks
  Call c = prepare(x, w, scale, min);
  const int64_t M = c.x.size(0), I = c.a.N / 2;
  at::Tensor out = at::empty({M, I}, x.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (I + U - 1) / U, std::max<int64_t>(1, grain(c, M) / 2), [&](int64_t u0, int64_t u1) {
    const int64_t c0 = u0 * U, c1 = std::min(I, u1 * U), n = c1 - c0;
    std::vector<float> buf(2 * M * n);
    float *g = buf.data(), *u = g + M * n;
    run_rows(c, M, c0, c1, g, n);
    run_rows(c, M, I + c0, I + c1, u, n);
    for (int64_t m = 0; m < M; ++m) nxdc_cpu::silu_mul_row(g + m * n, u + m * n, o + m * I + c0, n);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(nxdc, m) {
  m.def("linear_q8(Tensor x, Tensor w, Tensor scale, Tensor? min=None) -> Tensor");
  m.def("swiglu_q8(Tensor x, Tensor w, Tensor scale, Tensor? min=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdc, CPU, m) {
  m.impl("linear_q8", &linear_q8);
  m.impl("swiglu_q8", &swiglu_q8);
}
