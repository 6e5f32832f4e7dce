// Linear layers of the prefill graphs (a prompt's tokens at once) on AMX bf16 tiles (TDPBF16PS)
// through PyTorch's oneDNN brgemm micro-kernel (at::native::cpublas::brgemm: bf16 x bf16, fp32
// accumulation and output).
//
//   nxdc::prefill_linear(x, w, scale=None, min=None)   out[M, N] = x @ dequant(w)^T
//   nxdc::prefill_swiglu(x, w, scale=None, min=None)   silu(x @ gate^T) * (x @ up^T), w = [gate; up]
//
// Same arguments as linear.cpp's ops. Taken for bfloat16, int8 and int4 weights: each weight is
// rounded to the bf16 nearest its fp32 dequantisation (bfloat16 weights exactly), x to bf16, and
// every product is accumulated in fp32. A prompt's matmuls are compute-bound, and a tile
// instruction multiplies many times as many pairs a cycle as fp32 FMAs (2.9-6.5x faster than
// linear.cpp at 128 rows, 1B / 8B shapes, on a 2-core Sapphire Rapids VM).
// Rounding the activations costs little next to 4-bit weights (and the K-quants' 5-6-bit ones
// with mins), and nothing for `--dtype bf16`, whose activations are bf16 already. For int8 with
// one scale a group or row it cost greedy text (SmolLM2: 11 of 20 chat prompts kept fp32's 32
// tokens, against 15 with exact products), so there x goes in as two bf16 parts, hi = bf16(x)
// and lo = bf16(x - hi), each multiplied by the same converted tile: x within 2^-17, twice the
// tile products, the weight conversion once. bf16 weights with fp32 activations (`--weights
// bf16`) take two parts too: the weights are exact in bf16, so every product is within 2^-17 of
// the exact one. Where x is bf16 already (`--dtype bf16`) lo is all zero and its pass, which
// would add exact zeros, is skipped: same bits. fp32 and fp16 weights, CPUs where oneDNN
// has no AMX (PyTorch packs bf16 for its micro-kernel only there: `could_pack`), K not a multiple
// of 32 and calls of fewer than 16 rows take linear.cpp's kernels (exact fp32 products).
//
// Only the prefill graphs call these ops: decode and verify keep linear.cpp's kernels, whose rows
// are summed in the same order whatever M (greedy speculation relies on a verify row equalling a
// decode row; a prompt's logits are computed once, by the same graph, with or without it). Here
// too (from 16 rows up) a row's sum does not depend on M, the thread split or the row's position: the tiles split
// K the same way for every call of a weight, and the micro-kernel accumulates each output element
// over K in the same order whatever the number of rows.
//
// Weights are converted a tile at a time (64 weight rows x up to 2048 inputs, 256 KiB of bf16 in
// the micro-kernel's VNNI layout: element (k, n) at [k / 2][n][k % 2]) into a per-thread buffer and
// multiplied by every activation row while they sit in L2: each weight is read and converted once
// a call, whatever M.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>

#define NXDC_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

#include "linear.h"  // the exact kernels (the fallback) and the ISA choice

namespace {

// NXDC_PREFILL_TILES=0 turns the tile path off (prefill then runs linear.cpp's kernels).
bool tiles_available() {
  static const bool yes = !nxdc_cpu::turned_off("NXDC_PREFILL_TILES") && nxdc_cpu::has_avx512() &&
                          __builtin_cpu_supports("avx512bf16") && at::native::cpublas::could_pack(at::kBFloat16);
  return yes;
}

enum class Kind { BF16, I8, I4 };
enum class Scale { None, Row, Group, GroupMin };

struct Weights {
  const void* w;
  const float* scale;  // [N] (Row) or [N, ng]
  const float* mins;   // GroupMin: [N, ng]
  int64_t K, N, ng, G;  // G: inputs per group
};

constexpr int64_t NB = 64;        // weight rows a tile (a multiple of 16)
constexpr int64_t KB_MAX = 2048;  // inputs a tile at most
constexpr int64_t MB = 128;       // activation rows a micro-kernel call at most

// Inputs per tile: K split into equal blocks of at most KB_MAX, each a multiple of 32.
int64_t k_block(int64_t K) {
  int64_t parts = (K + KB_MAX - 1) / KB_MAX;
  while (K % (parts * 32) != 0) ++parts;
  return K / parts;
}

template <Scale S>
NXDC_BF16 inline __m512 scaled(__m512 v, const Weights& a, int64_t n, int64_t k) {
  if constexpr (S == Scale::Row) return _mm512_mul_ps(v, _mm512_set1_ps(a.scale[n]));
  if constexpr (S == Scale::Group) return _mm512_mul_ps(v, _mm512_set1_ps(a.scale[n * a.ng + k / a.G]));
  if constexpr (S == Scale::GroupMin) {
    const int64_t g = n * a.ng + k / a.G;
    return _mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(a.scale[g])), _mm512_set1_ps(a.mins[g]));
  }
  return v;
}

// Weights [k, k + 32) of row n as 32 bf16 (16 pairs, one 32-bit word each), each the bf16
// nearest to the reference dequantisation's fp32 value (q * s, then + m; int4 through the same
// 16-entry table as linear.cpp).
template <Kind F, Scale S>
NXDC_BF16 inline __m512i row32(const Weights& a, int64_t n, int64_t k) {
  if constexpr (F == Kind::BF16) {
    return _mm512_loadu_si512(static_cast<const uint16_t*>(a.w) + n * a.K + k);
  } else if constexpr (F == Kind::I8) {
    const int8_t* p = static_cast<const int8_t*>(a.w) + n * a.K + k;
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    lo = scaled<S>(lo, a, n, k);
    hi = scaled<S>(hi, a, n, k + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else {
    const uint8_t* p = static_cast<const uint8_t*>(a.w) + n * (a.K / 2) + k / 2;
    const __m512 levels = S == Scale::GroupMin
                              ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                              : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 table = scaled<S>(levels, a, n, k);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512 lo = _mm512_permutexvar_ps(bytes, table);
    const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
}

// r[i] (row i, 16 words) -> r[p] (word p of rows 0..15): a 16 x 16 transpose of 32-bit words.
NXDC_BF16 inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // u[4q + j], lane L: word 4L + j of rows 4q .. 4q + 3
    u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), y0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i x1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44),
                  y1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(x0, x1, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(x0, x1, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(y0, y1, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(y0, y1, 0xDD);
  }
}

// Weight rows [n0, n0 + rows) x inputs [k0, k0 + kb) into dst in VNNI layout [kb / 2][NB][2];
// rows past `rows` (a partial last tile) are zero.
template <Kind F, Scale S>
NXDC_BF16 void pack_tile(const Weights& a, int64_t n0, int64_t rows, int64_t k0, int64_t kb, uint16_t* dst) {
  for (int64_t r0 = 0; r0 < NB; r0 += 16) {
    for (int64_t k = 0; k < kb; k += 32) {
      __m512i v[16];
      for (int i = 0; i < 16; ++i)
        v[i] = r0 + i < rows ? row32<F, S>(a, n0 + r0 + i, k0 + k) : _mm512_setzero_si512();
      transpose16(v);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + ((k / 2 + p) * NB + r0) * 2, v[p]);
    }
  }
}

// x [M, K] fp32 -> bf16 hi (round to nearest even) and, where lo is given, the bf16 of what hi
// leaves (x - hi: hi + lo is x within 2^-17 of it).
NXDC_BF16 void to_bf16(const float* x, uint16_t* hi, uint16_t* lo, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    _mm256_mask_storeu_epi16(hi + i, m, h);
    if (lo) {
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm256_mask_storeu_epi16(lo + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back)));
    }
  }
}

// out = xh @ B (+ xl @ B where xl is given: the activations' second bf16 part, on the same
// converted tile), tile by tile.
template <Kind F, Scale S>
void tiles(const Weights& a, const at::BFloat16* xh, const at::BFloat16* xl, int64_t M, float* out) {
  const int64_t K = a.K, N = a.N, kb = k_block(K);
  const int64_t ntiles = (N + NB - 1) / NB;
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    std::unique_ptr<uint16_t[]> buf(new uint16_t[kb * NB]);
    const auto* B = reinterpret_cast<const at::BFloat16*>(buf.get());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NB, rows = std::min(NB, N - n0);
      for (int64_t k0 = 0; k0 < K; k0 += kb) {
        pack_tile<F, S>(a, n0, rows, k0, kb, buf.get());
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
          const int64_t mb = std::min(MB, M - m0);
          float* C = out + m0 * N + n0;
          at::native::cpublas::brgemm(mb, rows, kb, K, NB, N, k0 > 0, xh + m0 * K + k0, B, C, true);
          if (xl) at::native::cpublas::brgemm(mb, rows, kb, K, NB, N, true, xl + m0 * K + k0, B, C, true);
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

Kind kind_of(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kBFloat16: return Kind::BF16;
    case at::kChar: return Kind::I8;
    default: return Kind::I4;
  }
}

// Fewer activation rows than this take linear.cpp's kernels: a tile's conversion is paid once
// whatever M, and below ~16 rows streaming the weight is faster (a prefill graph's lm_head, which
// scores only each sequence's last token).
constexpr int64_t M_MIN = 16;

// Whether this call takes the tile path (else linear.cpp's kernels).
bool tiled(const at::Tensor& x, const at::Tensor& w) {
  const auto t = w.scalar_type();
  return tiles_available() && (t == at::kBFloat16 || t == at::kChar || t == at::kByte) && x.dim() == 2 &&
         x.scalar_type() == at::kFloat && x.size(1) > 0 && x.size(1) % 32 == 0 && x.size(0) >= M_MIN &&
         w.size(0) > 0;
}

// out = x @ dequant(w)^T on tiles; arguments already checked by linear.cpp's rules (see check()).
at::Tensor tiled_linear(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor* scale, const at::Tensor* mins) {
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  // fp16 or two-level (GGUF K-quant) group scales and mins converted once a call: a prompt's
  // products cost far more than the conversion (a few bytes a 32-weight group)
  auto f32 = [&](const at::Tensor* t) { return t ? nxdc_cpu::scales_f32(*t, K) : at::Tensor(); };
  at::Tensor s = f32(scale), m = f32(mins);
  Weights a{w.data_ptr(), s.defined() ? s.data_ptr<float>() : nullptr, m.defined() ? m.data_ptr<float>() : nullptr,
            K, N, 0, K};
  Scale S = Scale::None;
  if (s.defined()) {
    S = s.dim() == 1 ? Scale::Row : (m.defined() ? Scale::GroupMin : Scale::Group);
    a.ng = s.dim() == 1 ? 1 : s.size(1);
    a.G = K / a.ng;
  }
  const Kind F = kind_of(w);
  // int8 codes with one scale (--weights int8, int8-row, a kept Q8_0) are finer than bf16's
  // activations, and bf16 weights exact: those take the activations as two bf16 parts (twice
  // the tile products, the conversion once). int4 and the K-quants' int8 with mins are coarse
  // enough for one.
  bool split = (F == Kind::I8 && S != Scale::GroupMin) || F == Kind::BF16;
  at::Tensor xb = at::empty({split ? 2 * M : M, K}, x.options().dtype(at::kBFloat16));
  auto* xp = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  uint16_t* lp = split ? xp + M * K : nullptr;
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    to_bf16(xs + r0 * K, xp + r0 * K, lp ? lp + r0 * K : nullptr, (r1 - r0) * K);
  });
  if (F == Kind::BF16)  // bf16 activations (--dtype bf16): lo is +-0 throughout, nothing to add
    split = std::any_of(lp, lp + M * K, [](uint16_t v) { return (v & 0x7FFF) != 0; });
  at::Tensor out = at::empty({M, N}, x.options());
  const auto* xbp = xb.data_ptr<at::BFloat16>();
  const auto* xlp = split ? xbp + M * K : nullptr;
  float* o = out.data_ptr<float>();
  auto run = [&](auto f, auto s) { tiles<decltype(f)::value, decltype(s)::value>(a, xbp, xlp, M, o); };
  using KB = std::integral_constant<Kind, Kind::BF16>;
  using K8 = std::integral_constant<Kind, Kind::I8>;
  using K4 = std::integral_constant<Kind, Kind::I4>;
  using SN = std::integral_constant<Scale, Scale::None>;
  using SR = std::integral_constant<Scale, Scale::Row>;
  using SG = std::integral_constant<Scale, Scale::Group>;
  using SM = std::integral_constant<Scale, Scale::GroupMin>;
  if (F == Kind::BF16) {
    run(KB{}, SN{});
  } else if (F == Kind::I8) {
    if (S == Scale::Row) run(K8{}, SR{});
    else if (S == Scale::Group) run(K8{}, SG{});
    else run(K8{}, SM{});
  } else {
    if (S == Scale::Group) run(K4{}, SG{});
    else run(K4{}, SM{});
  }
  return out;
}

const at::Tensor* opt(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

// linear.cpp's op for w's format: the exact path, and the checks every call goes through first.
at::Tensor exact_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                        const std::optional<at::Tensor>& min) {
  switch (w.scalar_type()) {
    case at::kFloat: return linear_f32(x, w);
    case at::kHalf: return linear_f16(x, w);
    case at::kBFloat16: return linear_bf16(x, w);
    case at::kChar:
      TORCH_CHECK(scale.has_value(), "prefill_linear: int8 weights take a scale");
      return linear_i8(x, w, *scale, min);
    case at::kByte:
      TORCH_CHECK(scale.has_value(), "prefill_linear: int4 weights take a scale");
      return linear_i4(x, w, *scale, min);
    default: TORCH_CHECK(false, "prefill_linear: w must be float32, float16, bfloat16, int8 or int4 (uint8), got ",
                         w.scalar_type());
  }
}

}  // namespace

at::Tensor prefill_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                          const std::optional<at::Tensor>& min) {
  if (!tiled(x, w)) return exact_linear(x, w, scale, min);
  // the exact op's argument checks, on a zero-row call (nothing computed)
  exact_linear(x.narrow(0, 0, 0), w, scale, min);
  return tiled_linear(x, w, opt(scale), opt(min));
}

at::Tensor prefill_swiglu(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                          const std::optional<at::Tensor>& min) {
  if (!tiled(x, w)) return swiglu(x, w, scale, min);
  swiglu(x.narrow(0, 0, 0), w, scale, min);  // the checks
  const at::Tensor full = tiled_linear(x, w, opt(scale), opt(min));
  const int64_t I = w.size(0) / 2;
  return at::silu(full.narrow(1, 0, I)) * full.narrow(1, I, I);
}

TORCH_LIBRARY_FRAGMENT(nxdc, m) {
  m.def("prefill_linear(Tensor x, Tensor w, Tensor? scale=None, Tensor? min=None) -> Tensor");
  m.def("prefill_swiglu(Tensor x, Tensor w, Tensor? scale=None, Tensor? min=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdc, CPU, m) {
  m.impl("prefill_linear", &prefill_linear);
  m.impl("prefill_swiglu", &prefill_swiglu);
}
