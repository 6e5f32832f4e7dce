// Linear layers for fp32 activations: out[M, N] = x[M, K] @ dequant(w)[N, K]^T with fp32
// accumulation and weights stored as fp32, fp16, bf16, int8 or int4 (int8: one fp32 scale per
// output row or per group of G consecutive inputs of a row; int4: per group; both optionally with
// a per-group min, w = q * s + m). Group scales and mins are fp32, fp16 or two-level (a GGUF
// K-quant's: an fp16 per 256 weights times an int8 per group), expanded to fp32 a row at a time
// (linear.h: GroupRows).
//
//   nxdc::linear_f32(x, w)                 w: float32  [N, K]
//   nxdc::linear_f16(x, w)                 w: float16  [N, K]
//   nxdc::linear_bf16(x, w)                w: bfloat16 [N, K]
//   nxdc::linear_i8(x, w, scale, min=None) w: int8 [N, K]; scale: float32 [N] (per row) or
//                                          [N, K / G] (per group, G % 16 == 0; float32 / float16,
//                                          or two-level uint8 [N, 2 K / 256 + K / G]);
//                                          min: like scale (w = q * s + m) or None (w = q * s)
//   nxdc::linear_i4(x, w, scale, min=None) w: uint8 [N, K / 2], two weights a byte in 32-weight
//                                          blocks (Store<Fmt::I4>); scale [N, K / G], G % 32 == 0;
//                                          no min: w = (nibble - 8) * s, with min: nibble * s + m
//   nxdc::swiglu(x, w, scale=None, min=None)  silu(x @ gate^T) * (x @ up^T) [M, N / 2] for
//                                          w = [gate; up] in any of those formats
//
// Streaming kernel (decode, and prefill with AVX-512): every weight is converted to fp32 in
// registers (a plain load / vcvtph2ps / a 16-bit shift / vpmovsxbd + vcvtdq2ps) right after its
// load and feeds up to 8 fp32 FMA chains, one per activation row; weight rows are split across
// threads with at::parallel_for, and two software prefetch streams run ahead of the weights
// (16 KiB into L2, 2 KiB into L1) except at M = 1 for fp32 / fp16 / bf16, which reads one row at
// a time, a single linear stream that the hardware prefetcher follows.
// M <= 8 is one pass that reads each weight once (memory-bound at M = 1; at M = 8 the FMAs can
// bound it instead); larger M runs passes of <= 6 rows (4 weight rows at a time; AVX2: <= 8) over
// L2-sized tiles of weight rows, so weights still come from DRAM once. Per-row int8 scales
// multiply the finished dot product; per-group scales multiply the converted weight vector
// (exactly the fp32 q * s of the reference dequantisation). With AVX-512 this kernel serves every
// M, prefill included: it beats MKL's sgemm, which takes its AVX2 path on AMD CPUs. The
// measurements behind the choices in this file: docs/performance.md and bench/results/.
// AVX2-only CPUs, M > 32, where MKL's AVX2 sgemm wins: fp32 calls at::mm; the other formats
// dequantise blocks of 64-256 weight rows per thread into a small fp32 scratch (never the whole
// weight) and call at::mm on the block, writing a column slice of out.
//
// Every output row is summed in the same order whatever M, the tiling or the thread split
// (the lane tree of reduce_store is the same for any number of vectors): a verify graph's rows
// equal a decode graph's bit for bit, which greedy speculative decoding relies on.
//
// Two code paths chosen at run time: AVX-512 (F + BW + VL, masked K tail) and AVX2 + FMA + F16C
// (scalar K tail). The library is built with AVX2 flags and the wider paths are enabled per
// function with target attributes, so it still loads on AVX2-only CPUs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "linear.h"
#include "vexp.h"

#define NXDC_AVX2 __attribute__((target("avx2,fma,f16c")))
#define NXDC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace nxdc_cpu {
// NXDC_KERNELS_AVX2=1 forces the AVX2 path (tests use it to cover that path on AVX-512 CPUs).
// Also read by attention.cpp.
bool has_avx512() {
  static const bool yes = [] {
    const char* e = std::getenv("NXDC_KERNELS_AVX2");
    if (e && *e && std::strcmp(e, "0") != 0) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return yes;
}

bool turned_off(const char* name) {
  const char* e = std::getenv(name);
  return e && std::strcmp(e, "0") == 0;
}

// o[0..n) = silu(g) * u, 8 lanes at a time (also decode_q8.cpp's); a short tail goes through
// the same vector code (padded), so every element's bits are the same wherever it sits.
NXDC_AVX2 void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(o + j, nxdc_cpu::silu_mul(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
  if (j < n) {
    alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
    std::copy(g + j, g + n, gt);
    std::copy(u + j, u + n, ut);
    _mm256_store_ps(ot, nxdc_cpu::silu_mul(_mm256_load_ps(gt), _mm256_load_ps(ut)));
    std::copy(ot, ot + (n - j), o + j);
  }
}

NXDC_AVX512 static void halves_to_floats512(const uint16_t* h, float* d, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(d + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + j))));
  if (j < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1u);
    _mm512_mask_storeu_ps(d + j, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, h + j)));
  }
}

// Two-level scales of one row: o[g] = d[g / gps] * c[g]. AVX-512, 16 groups a step: gps 8 (Q4_K,
// Q5_K: two d's a step) or 16 (Q6_K: one); other gps, or the AVX2 path: a d at a time.
NXDC_AVX512 static void expand_k512(const uint16_t* d, const int8_t* c, int64_t ng, int64_t gps, float* o) {
  const __m512i two = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t g = 0; g < ng; g += 16) {
    const __m512 cv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + g))));
    __m512 dv;
    if (gps == 8) {
      int32_t pair;  // the two d's of these 16 groups
      std::memcpy(&pair, d + g / 8, 4);
      dv = _mm512_permutexvar_ps(two, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(pair))));
    } else {
      dv = _mm512_set1_ps(_cvtsh_ss(d[g / 16]));
    }
    _mm512_storeu_ps(o + g, _mm512_mul_ps(dv, cv));
  }
}

NXDC_AVX2 static void expand_k(const uint16_t* d, const int8_t* c, int64_t ng, int64_t gps, float* o) {
  if (has_avx512() && (gps == 8 || gps == 16) && ng % 16 == 0) return expand_k512(d, c, ng, gps, o);
  for (int64_t b = 0; b < ng / gps; ++b) {
    const __m256 f = _mm256_set1_ps(_cvtsh_ss(d[b]));
    int64_t j = b * gps;
    for (; j + 8 <= (b + 1) * gps; j += 8) {
      const __m256i cv = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j)));
      _mm256_storeu_ps(o + j, _mm256_mul_ps(f, _mm256_cvtepi32_ps(cv)));
    }
    for (; j < (b + 1) * gps; ++j) o[j] = _mm256_cvtss_f32(f) * static_cast<float>(c[j]);
  }
}

int64_t GroupRows::row_bytes() const { return kind == Kind::K ? 2 * nsb + ng : ng * (kind == Kind::F16 ? 2 : 4); }

NXDC_AVX2 const float* GroupRows::row(int64_t n, float* buf) const {
  if (!p) return nullptr;
  if (kind == Kind::F32) return static_cast<const float*>(p) + n * ng;
  if (kind == Kind::K) {
    const uint8_t* r = static_cast<const uint8_t*>(p) + n * row_bytes();
    expand_k(reinterpret_cast<const uint16_t*>(r), reinterpret_cast<const int8_t*>(r + 2 * nsb), ng, ng / nsb, buf);
    return buf;
  }
  const uint16_t* h = static_cast<const uint16_t*>(p) + n * ng;
  if (has_avx512()) {
    halves_to_floats512(h, buf, ng);
    return buf;
  }
  int64_t j = 0;
  for (; j + 8 <= ng; j += 8)
    _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j))));
  for (; j < ng; ++j) buf[j] = _cvtsh_ss(h[j]);
  return buf;
}

GroupRows GroupRows::from(int64_t n0) const {
  GroupRows r = *this;
  if (p) r.p = static_cast<const char*>(p) + n0 * row_bytes();
  return r;
}

int64_t scale_groups(const at::Tensor& t, int64_t K) {
  if (t.dim() != 2) return 0;
  if (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf) return t.size(1);
  if (t.scalar_type() != at::kByte || K <= 0 || K % SUPER) return 0;
  const int64_t nsb = K / SUPER, ng = t.size(1) - 2 * nsb;  // whole groups a super-block
  return ng > 0 && ng % nsb == 0 ? ng : 0;
}

GroupRows group_rows(const at::Tensor& t, int64_t K) {
  if (!t.defined()) return {};
  GroupRows g;
  g.p = t.data_ptr();
  if (t.scalar_type() == at::kByte) {
    g.kind = GroupRows::Kind::K;
    g.nsb = K / SUPER;
    g.ng = scale_groups(t, K);
  } else {
    g.kind = t.scalar_type() == at::kHalf ? GroupRows::Kind::F16 : GroupRows::Kind::F32;
    g.ng = t.dim() == 2 ? t.size(1) : 1;
  }
  return g;
}

at::Tensor scales_f32(const at::Tensor& t_, int64_t K) {
  if (t_.scalar_type() != at::kByte) return t_.to(at::kFloat).contiguous();
  const at::Tensor t = t_.contiguous();
  const GroupRows g = group_rows(t, K);
  const int64_t N = t.size(0);
  at::Tensor out = at::empty({N, g.ng}, t.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) g.row(n, o + n * g.ng);
  });
  return out;
}

float* scratch_floats(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}
}  // namespace nxdc_cpu

namespace {

using nxdc_cpu::has_avx512;
using nxdc_cpu::silu_mul_row;

enum class Fmt { F32, F16, BF16, I8, I4 };
// Group: w = q * s; GroupMin: w = q * s + m (multiply, then add: never fused, so the bits equal
// the reference dequantisation and gguf's for Q4_1 / Q4_K / Q5_K)
enum class Scale { None, Row, Group, GroupMin };

template <Fmt F>
struct Store {
  using T = uint16_t;
};
template <>
struct Store<Fmt::F32> {
  using T = float;
};
template <>
struct Store<Fmt::I8> {
  using T = int8_t;
};
// int4: two weights a byte, in blocks of 32 weights = 16 bytes per row: byte j of block b holds
// weight 32b + j in its low nibble and weight 32b + 16 + j in its high nibble (GGUF Q4_0's
// order). Symmetric (Scale::Group): w = (nibble - 8) * s; asymmetric (GroupMin): nibble * s + m.
template <>
struct Store<Fmt::I4> {
  using T = uint8_t;
};

// Weights per step of the inner loops (an int4 step is one 16-byte block) and the bytes of a row.
template <Fmt F>
constexpr int64_t step_weights() {
  return F == Fmt::I4 ? 32 : 16;
}
template <Fmt F>
constexpr int64_t row_elems(int64_t K) {  // a row's length in Store<F>::T
  return F == Fmt::I4 ? K / 2 : K;
}
constexpr bool grouped(Scale S) { return S == Scale::Group || S == Scale::GroupMin; }

template <Fmt F>
inline float to_float(typename Store<F>::T v) {
  if constexpr (F == Fmt::F32) {
    return v;
  } else if constexpr (F == Fmt::F16) {
    return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
  } else if constexpr (F == Fmt::BF16) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    static_assert(F == Fmt::I8, "to_float: int4 has no scalar tail (K % 32 == 0)");
    return static_cast<float>(v);
  }
}

// Per-row bookkeeping shared by both paths: gidx[k / 16] is the scale column of the 16 weights
// starting at k (grouped int8 only).
struct Args {
  const float* x;
  const void* w;
  nxdc_cpu::GroupRows scale;  // [N] (Row: fp32) or [N, ng] groups (fp32, fp16 or two-level)
  nxdc_cpu::GroupRows mins;   // GroupMin: [N, ng], beside scale
  const int32_t* gidx;
  float* out;
  int64_t K, N, ng;  // ng: scale columns per row (grouped)
};

// Row n's group scales and mins as fp32 (grouped S; buf: 2 * ng floats for fp16 ones).
template <Scale S>
inline void group_params(const Args& a, int64_t n, float* buf, const float*& sr, const float*& mr) {
  if constexpr (grouped(S)) {
    sr = a.scale.row(n, buf);
    mr = a.mins.row(n, buf + a.ng);
  }
}

// ---------------------------------------------------------------- AVX-512 (16 floats a vector)

// Software prefetch, bytes ahead of the weight stream: one stream into L2 far ahead, one into L1
// close ahead. At M = 8 the loop is compute-bound and the hardware prefetcher alone leaves memory
// idle while the FMAs run; a prefetch far enough ahead lets memory and compute overlap. A single
// L1 stream does not always suffice (on some CPUs fp32 at M = 8 still takes about memory time
// plus FMA time); the far L2 stream overlaps the two. The AVX2 path keeps one L1 stream.
constexpr int64_t PF_L2_BYTES = 16384;
constexpr int64_t PF_L1_BYTES = 2048;
constexpr int64_t PF_BYTES_AVX2 = 8192;

template <Fmt F>
NXDC_AVX512 inline __m512 load16(const typename Store<F>::T* p) {
  if constexpr (F == Fmt::F32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (F == Fmt::F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (F == Fmt::BF16) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
}

template <Fmt F>
NXDC_AVX512 inline __m512 load16_mask(const typename Store<F>::T* p, __mmask16 m) {
  if constexpr (F == Fmt::F32) {
    return _mm512_maskz_loadu_ps(m, p);
  } else if constexpr (F == Fmt::F16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  } else if constexpr (F == Fmt::BF16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
  }
}

// Sums of n <= 16 vectors, lane-reduced: out[i] = sum of the lanes of v[i] (transpose-add tree,
// ~2 shuffles + 1 add per pair per level instead of a full reduction per vector).
template <int C>
NXDC_AVX512 inline void reduce_store(const __m512* v, float* dst) {
  static_assert(C >= 1 && C <= 16, "reduce_store: 1..16 vectors");
  if constexpr (C == 1) {
    dst[0] = _mm512_reduce_add_ps(v[0]);
  } else {
    // Level 1, pairs (a, b): [a.b0 + a.b2, a.b1 + a.b3, b.b0 + b.b2, b.b1 + b.b3] (bN: 128-bit
    // blocks), i.e. blocks (A0, A1, B0, B1) whose lanes sum to a's and b's totals.
    constexpr int C2 = (C + 1) / 2;
    __m512 l1[C2];
    for (int i = 0; i < C2; ++i) {
      __m512 a = v[2 * i], b = (2 * i + 1 < C) ? v[2 * i + 1] : _mm512_setzero_ps();
      __m512 lo = _mm512_shuffle_f32x4(a, b, 0x44), hi = _mm512_shuffle_f32x4(a, b, 0xEE);
      l1[i] = _mm512_add_ps(lo, hi);
    }
    // Level 2, pairs (p, q) = ((A0, A1, B0, B1), (C0, C1, D0, D1)): (A0, B0, C0, D0) +
    // (A1, B1, C1, D1), so block j of l2[i] holds 4 partials of v[4i + j].
    constexpr int C4 = (C2 + 1) / 2;
    __m512 l2[C4];
    for (int i = 0; i < C4; ++i) {
      __m512 p = l1[2 * i], q = (2 * i + 1 < C2) ? l1[2 * i + 1] : _mm512_setzero_ps();
      __m512 lo = _mm512_shuffle_f32x4(p, q, 0x88), hi = _mm512_shuffle_f32x4(p, q, 0xDD);
      l2[i] = _mm512_add_ps(lo, hi);
    }
    // Levels 3-4: the 4 partials within each 128-bit block.
    if constexpr (C4 == 1) {
      __m512 s = l2[0];
      s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));  // lane i + lane i^2 within block
      s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));  // + lane i^1
      alignas(64) float t[16];
      _mm512_store_ps(t, s);
      for (int i = 0; i < C; ++i) dst[i] = t[4 * i];
    } else {
      __m512 z = _mm512_setzero_ps();
      __m512 a = l2[0], b = C4 > 1 ? l2[1] : z, c = C4 > 2 ? l2[2] : z, d = C4 > 3 ? l2[3] : z;
      __m512 t0 = _mm512_unpacklo_ps(a, b), t1 = _mm512_unpackhi_ps(a, b);  // a0 b0 a1 b1 | a2 b2 a3 b3
      __m512 t2 = _mm512_unpacklo_ps(c, d), t3 = _mm512_unpackhi_ps(c, d);
      __m512 s01 = _mm512_add_ps(t0, t1);  // a02 b02 a13 b13
      __m512 s23 = _mm512_add_ps(t2, t3);  // c02 d02 c13 d13
      __m512 u0 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23)));
      __m512 u1 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23)));
      __m512 s = _mm512_add_ps(u0, u1);  // per block: a, b, c, d totals of that block's vector
      // Block j of l2[i] belongs to v[4i + j]; lane l of block j in s is l2[l]'s block j,
      // i.e. vector v[4l + j]. Store so that dst[4l + j] = lane (4j + l).
      alignas(64) float t[16];
      _mm512_store_ps(t, s);
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < C4; ++l)
          if (4 * l + j < C) dst[4 * l + j] = t[4 * j + l];
    }
  }
}

// Per-group scaling of a converted weight vector: w * s, or w * s + m (GroupMin).
template <Scale S>
NXDC_AVX512 __attribute__((always_inline)) inline __m512 scale512(__m512 w, const float* sr, const float* mr,
                                                                  int64_t g) {
  if constexpr (S == Scale::Group) return _mm512_mul_ps(w, _mm512_set1_ps(sr[g]));
  if constexpr (S == Scale::GroupMin) return _mm512_add_ps(_mm512_mul_ps(w, _mm512_set1_ps(sr[g])), _mm512_set1_ps(mr[g]));
  return w;
}

// acc[r][m] += wv[r] * x[m, k..k+16) for every r, m.
template <Fmt F, int R, int M>
NXDC_AVX512 __attribute__((always_inline)) inline void fma512(__m512 (&acc)[R][M], const __m512 (&wv)[R],
                                                              const float* x, int64_t K, int64_t k) {
  for (int m = 0; m < M; ++m) {
    __m512 xv = _mm512_loadu_ps(x + m * K + k);
    // int8, M >= 4: keep xv in a register. Left alone, gcc folds the load into each of the R
    // FMAs (R loads of the same vector), and with the two int8 conversion ops per weight vector
    // the loop then runs out of load/issue slots before FMA slots. Every format's 3-row blocks
    // (M = 7, 8) gain from it too. Not pinned where it does not help: fp32 / fp16 / bf16 with
    // 2 weight rows, int8 at M = 1, and fp16 / bf16 at M = 5, 6 (mixed results).
    if constexpr ((F == Fmt::I8 && M >= 4 && R > 1) || (R == 3 && M >= 7)) asm("" : "+v"(xv));
    for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
  }
}

// One step of R rows against M activation rows: 16 weights, or (int4) one 32-weight block.
// int4 converts through a 16-entry table per row and block, the nibble values times the group's
// scale (plus its min): one vpermps (which reads only an index's low 4 bits) per 16 weights does
// the nibble's conversion and scaling at once, and the table's entries are exactly the fp32
// (q * s) (+ m) of the reference dequantisation. The block's low-nibble half is summed before
// its high half, for any R and M.
template <Fmt F, Scale S, int R, int M>
NXDC_AVX512 __attribute__((always_inline)) inline void step512(__m512 (&acc)[R][M],
                                                               const typename Store<F>::T* (&wr)[R],
                                                               const float* (&sr)[R], const float* (&mr)[R],
                                                               const float* x, int64_t K, const int32_t* gidx,
                                                               int64_t k) {
  __m512 wv[R];
  if constexpr (F == Fmt::I4) {
    const __m512 levels = S == Scale::GroupMin
                              ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                              : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 table[R];
    __m512i bytes[R];
    for (int r = 0; r < R; ++r) {
      table[r] = scale512<S>(levels, sr[r], mr[r], gidx[k >> 4]);
      bytes[r] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[r] + (k >> 1))));
      wv[r] = _mm512_permutexvar_ps(bytes[r], table[r]);
    }
    fma512<F, R, M>(acc, wv, x, K, k);
    for (int r = 0; r < R; ++r) wv[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes[r], 4), table[r]);
    fma512<F, R, M>(acc, wv, x, K, k + 16);
  } else {
    for (int r = 0; r < R; ++r) wv[r] = scale512<S>(load16<F>(wr[r] + k), sr[r], mr[r], grouped(S) ? gidx[k >> 4] : 0);
    fma512<F, R, M>(acc, wv, x, K, k);
  }
}

// Lane-reduce the R x M accumulators (16 at a time) and write out[m, n + r] (times the row scale).
template <Scale S, int R, int M>
NXDC_AVX512 __attribute__((always_inline)) inline void store512(__m512 (&acc)[R][M], const Args& a, int64_t n) {
  constexpr int C = R * M;
  float s[C];
  __m512 flat[C];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) flat[m * R + r] = acc[r][m];
  constexpr int C0 = C < 16 ? C : 16;
  reduce_store<C0>(flat, s);
  if constexpr (C > 16) {
    constexpr int C1 = C - 16;
    static_assert(C1 <= 16, "at most 32 accumulators");
    reduce_store<C1>(flat + 16, s + 16);
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float y = s[m * R + r];
      if constexpr (S == Scale::Row) y *= *a.scale.row(n + r, nullptr);
      a.out[m * a.N + n + r] = y;
    }
}

// R weight rows x M activation rows per block, rows [n0, n1).
template <Fmt F, Scale S, int R, int M>
NXDC_AVX512 void block512(const Args& a, int64_t n0, int64_t n1) {
  using T = typename Store<F>::T;
  constexpr int64_t STEP = step_weights<F>();
  constexpr int64_t L = 64 / static_cast<int64_t>(sizeof(T)) * (F == Fmt::I4 ? 2 : 1);  // weights per line
  constexpr int V = static_cast<int>(L / STEP);                                         // steps per line
  const T* w = static_cast<const T*>(a.w);
  const float* x = a.x;
  const int64_t K = a.K, RK = row_elems<F>(K);
  const int64_t KL = K - K % L, KS = K - K % STEP;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K % 16)) - 1u);  // (0 for int4: K % 32 == 0)
  float* pbuf = grouped(S) ? nxdc_cpu::scratch_floats(2 * R * a.ng) : nullptr;
  int64_t n = n0;
  if (R > 1) {  // start the streams: the first bytes of this thread's rows
    const char* p0 = reinterpret_cast<const char*>(w + n0 * RK);
    const int64_t bytes = (n1 - n0) * RK * static_cast<int64_t>(sizeof(T));
    for (int64_t off = 0; off < std::min(PF_L1_BYTES, bytes); off += 64) _mm_prefetch(p0 + off, _MM_HINT_T0);
    for (int64_t off = PF_L1_BYTES; off < std::min(PF_L2_BYTES, bytes); off += 64) _mm_prefetch(p0 + off, _MM_HINT_T1);
  }
  for (; n + R <= n1; n += R) {
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    const T* wr[R];
    const float* sr[R] = {};
    const float* mr[R] = {};
    for (int r = 0; r < R; ++r) {
      wr[r] = w + (n + r) * RK;
      group_params<S>(a, n + r, pbuf + 2 * r * a.ng, sr[r], mr[r]);
    }
    // The R rows are contiguous: linear prefetch streams PF_L1 / PF_L2 bytes ahead of the block
    // start, R lines each per iteration (the rate at which the block's lines are consumed).
    // R = 1 reads one linear stream, which the hardware prefetcher follows best alone.
    const char* pf1 = reinterpret_cast<const char*>(wr[0]) + PF_L1_BYTES;
    const char* pf2 = reinterpret_cast<const char*>(wr[0]) + PF_L2_BYTES;
    int64_t k = 0;
    for (; k < KL; k += L) {
      if constexpr (R > 1) {
        for (int r = 0; r < R; ++r, pf1 += 64, pf2 += 64) {
          _mm_prefetch(pf2, _MM_HINT_T1);
          _mm_prefetch(pf1, _MM_HINT_T0);
        }
      }
      for (int v = 0; v < V; ++v) step512<F, S, R, M>(acc, wr, sr, mr, x, K, a.gidx, k + STEP * v);
    }
    for (; k < KS; k += STEP) step512<F, S, R, M>(acc, wr, sr, mr, x, K, a.gidx, k);
    if constexpr (F != Fmt::I4) {
      if (tail) {  // K % 16 leftover weights (never with group scales: G % 16 == 0)
        __m512 wv[R];
        for (int r = 0; r < R; ++r) wv[r] = load16_mask<F>(wr[r] + KS, tail);
        for (int m = 0; m < M; ++m) {
          __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * K + KS);
          for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
        }
      }
    }
    store512<S, R, M>(acc, a, n);
  }
  if constexpr (R > 1) {
    if (n < n1) block512<F, S, 1, M>(a, n, n1);  // leftover rows
  }
}

// ------------------------------------------------------------------- AVX2 (8 floats a vector)

template <Fmt F>
NXDC_AVX2 inline __m256 load8(const typename Store<F>::T* p) {
  if constexpr (F == Fmt::F32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (F == Fmt::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (F == Fmt::BF16) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  } else {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
}

NXDC_AVX2 inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

template <Scale S>
NXDC_AVX2 inline __m256 scale256(__m256 w, const float* sr, const float* mr, int64_t g) {
  if constexpr (S == Scale::Group) return _mm256_mul_ps(w, _mm256_set1_ps(sr[g]));
  if constexpr (S == Scale::GroupMin) return _mm256_add_ps(_mm256_mul_ps(w, _mm256_set1_ps(sr[g])), _mm256_set1_ps(mr[g]));
  return w;
}

// Weights [k + 8h, k + 8h + 8) of an int4 block at p (h = 0..3: bytes 0-7 / 8-15, low nibbles,
// then high), as fp32 levels: nibble - 8 (symmetric) or nibble (GroupMin).
template <Scale S>
NXDC_AVX2 inline __m256 load8_i4(const uint8_t* p, int h) {
  __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * (h & 1))));
  e = h < 2 ? _mm256_and_si256(e, _mm256_set1_epi32(15)) : _mm256_srli_epi32(e, 4);
  if constexpr (S != Scale::GroupMin) e = _mm256_sub_epi32(e, _mm256_set1_epi32(8));
  return _mm256_cvtepi32_ps(e);
}

template <Fmt F, Scale S, int R, int M>
NXDC_AVX2 void block256(const Args& a, int64_t n0, int64_t n1) {
  using T = typename Store<F>::T;
  const T* w = static_cast<const T*>(a.w);
  const float* x = a.x;
  const int64_t K = a.K, N = a.N, K8 = K - K % 8, RK = row_elems<F>(K);
  float* pbuf = grouped(S) ? nxdc_cpu::scratch_floats(2 * R * a.ng) : nullptr;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    const T* wr[R];
    const float* sr[R] = {};
    const float* mr[R] = {};
    for (int r = 0; r < R; ++r) {
      wr[r] = w + (n + r) * RK;
      group_params<S>(a, n + r, pbuf + 2 * r * a.ng, sr[r], mr[r]);
    }
    const char* pf = reinterpret_cast<const char*>(wr[0]) + PF_BYTES_AVX2;  // one L1 stream
    for (int64_t k = 0; k < K8; k += 8) {
      if (R > 1 && (row_elems<F>(k) * static_cast<int64_t>(sizeof(T))) % 64 == 0 && (F != Fmt::I4 || k % 32 == 0))
        for (int r = 0; r < R; ++r, pf += 64) _mm_prefetch(pf, _MM_HINT_T0);  // a new line of every row
      __m256 wv[R];
      const int64_t g = grouped(S) ? a.gidx[k >> 4] : 0;
      for (int r = 0; r < R; ++r) {
        if constexpr (F == Fmt::I4)  // block k & ~31, quarter (k / 8) % 4
          wv[r] = scale256<S>(load8_i4<S>(wr[r] + ((k & ~int64_t(31)) >> 1), (k >> 3) & 3), sr[r], mr[r], g);
        else
          wv[r] = scale256<S>(load8<F>(wr[r] + k), sr[r], mr[r], g);
      }
      for (int m = 0; m < M; ++m) {
        __m256 xv = _mm256_loadu_ps(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        float y = hsum256(acc[r][m]);
        if constexpr (F != Fmt::I4)  // (int4: K % 32 == 0)
          for (int64_t k = K8; k < K; ++k) y += to_float<F>(wr[r][k]) * x[m * K + k];  // scalar K tail
        if constexpr (S == Scale::Row) y *= *a.scale.row(n + r, nullptr);
        a.out[m * N + n + r] = y;
      }
  }
  if constexpr (R > 1) {
    if (n < n1) block256<F, S, 1, M>(a, n, n1);
  }
}

// ------------------------------------------------------------------------------ dispatch

template <Fmt F, Scale S, int R, int M>
void block(const Args& a, int64_t n0, int64_t n1, bool wide) {
  if (wide)
    block512<F, S, R, M>(a, n0, n1);
  else
    block256<F, S, R, M>(a, n0, n1);
}

// Weight rows [n0, n1) against a.x's first `rows` (1..8) activation rows; R (weight rows per
// inner block) shrinks as M grows, keeping R * M accumulators within the register file.
// At M = 1, fp32 / fp16 / bf16 read one row at a time: each thread's weights are then a single
// linear stream, which the hardware prefetcher alone follows best on Zen 4; four-row blocks, with
// or without the software prefetch streams, are slower there (on the AVX2 path too). fp16 / bf16
// on Intel take four-row blocks (intel_cpu, above). int8 / int4 keep four rows: their rows are
// only a few cache lines, and one row at a time is much slower.
//
// With AVX-512, fp16 / bf16 at M >= 5 and int8 at M >= 3 take more weight rows per block (3-5,
// up to 24 accumulators: fewer activation loads per FMA, as the prefill passes do). The
// converted 16-bit and int8 weights make these rows FMA- and issue-bound, not memory-bound, so
// saving loads pays off (the bits are the same). fp32 takes them at M = 7, 8 only, where what
// bounds it depends on the host's read rate: 3 rows against 2 is faster when weights arrive
// faster than 2-row blocks use them (FMA-bound) and slightly slower when memory-bound. The fast
// case is where batch 8 is furthest from its targets, so it decides. At M = 5, 6 fp32 keeps
// R = 2 (more rows are not faster there). Figures: docs/performance.md.
// int4 never takes them: its step holds a table and the bytes per weight row besides the
// accumulators, and 3-5 rows would spill.
template <Fmt F>
constexpr int64_t wide_rows_min() {
  return F == Fmt::I4 ? 9 : F == Fmt::I8 ? 3 : (F == Fmt::F32 ? 7 : 5);
}

// fp16 / bf16 at M = 1 on Intel CPUs: four-row blocks with the software prefetch streams. On a
// 2-core AVX-512 Xeon VM (2026-12-06) they read 41-49 GB/s where the one-row stream read 17-35
// (14336 x 4096 bf16: 2.5-2.8 ms against 5.6-6.4), at every shape from SmolLM2's 960 x 576 up; the
// Zen 4 measurements behind one row at a time stand for AMD. The bits are the same either way.
bool intel_cpu() {
  static const bool yes = __builtin_cpu_is("intel");
  return yes;
}

template <Fmt F, Scale S>
void rows_block(const Args& a, int64_t rows, int64_t n0, int64_t n1, bool wide) {
  if constexpr (F == Fmt::F16 || F == Fmt::BF16) {
    if (rows == 1 && intel_cpu()) {
      block<F, S, 4, 1>(a, n0, n1, wide);
      return;
    }
  }
  if (wide && rows >= wide_rows_min<F>()) {
    switch (rows) {
      case 3: block512<F, S, 5, 3>(a, n0, n1); return;
      case 4: block512<F, S, 4, 4>(a, n0, n1); return;
      case 5: block512<F, S, 4, 5>(a, n0, n1); return;
      case 6: block512<F, S, 4, 6>(a, n0, n1); return;
      case 7: block512<F, S, 3, 7>(a, n0, n1); return;
      default: block512<F, S, 3, 8>(a, n0, n1); return;
    }
  }
  switch (rows) {
    case 1: block<F, S, (F == Fmt::I8 || F == Fmt::I4) ? 4 : 1, 1>(a, n0, n1, wide); break;
    case 2: block<F, S, 4, 2>(a, n0, n1, wide); break;
    case 3: block<F, S, 3, 3>(a, n0, n1, wide); break;
    case 4: block<F, S, 2, 4>(a, n0, n1, wide); break;
    case 5: block<F, S, 2, 5>(a, n0, n1, wide); break;
    case 6: block<F, S, 2, 6>(a, n0, n1, wide); break;
    case 7: block<F, S, 2, 7>(a, n0, n1, wide); break;
    default: block<F, S, 2, 8>(a, n0, n1, wide); break;
  }
}

// One pass of a multi-pass call (M > 8): `rows` (4..8) activation rows against an L2-resident tile
// of weight rows. With AVX-512, passes are at most 6 rows against 4 weight rows at a time (24
// accumulators, 10 loads per 24 FMAs): faster than passes of 8 rows against 2, most of all where
// AVX-512 runs on 256-bit units. Weight x activation rows of 3 x 8, 4 x 7, 6 x 4, 5 x 5 and 4 x 8
// are slower. Every variant gives the same bits, as each row's sum does not depend on the tiling.
template <Fmt F, Scale S>
void pass_block(const Args& a, int64_t rows, int64_t n0, int64_t n1, bool wide) {
  if (wide && F != Fmt::I4) {
    switch (rows) {
      case 6: block512<F, S, 4, 6>(a, n0, n1); return;
      case 5: block512<F, S, 4, 5>(a, n0, n1); return;
      case 4: block512<F, S, 4, 4>(a, n0, n1); return;
      default: break;
    }
  }
  rows_block<F, S>(a, rows, n0, n1, wide);
}

// The streaming kernel for any M: weight rows split across threads in units of 16. M <= 8 is one
// pass, which reads each weight once from memory; larger M runs passes of at most 6 activation
// rows with AVX-512 (8 on AVX2), split evenly (9 -> 4 + 5, 16 -> 5 + 5 + 6): each thread walks
// its rows in L2-sized tiles and runs every pass over a tile before moving on, so weights still
// come from DRAM once.
constexpr int64_t U = 16;  // weight rows per unit of the thread split

struct Plan {
  bool wide;       // AVX-512 path
  int64_t passes;  // 1 for M <= 8
  int64_t tile;    // weight rows per L2 tile (passes > 1)
  int64_t grain;   // units per thread at least
};

template <Fmt F>
Plan plan(const Args& a, int64_t M) {
  const int64_t K = a.K;
  const int64_t RB = row_elems<F>(K) * static_cast<int64_t>(sizeof(typename Store<F>::T));  // bytes a row
  // M = 8 is one pass, fp32 included: with the L2 prefetch stream, one pass of 8 rows is faster
  // than two passes of 4 over each L2-sized tile.
  const bool wide = has_avx512();
  const int64_t pass_rows = wide ? 6 : 8;
  const int64_t passes = M <= 8 ? 1 : (M + pass_rows - 1) / pass_rows;
  // at least ~64 KiB-pass of weights per thread before splitting: tiny layers stay on one thread
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, U * RB * passes));
  const int64_t tile = std::max<int64_t>(U, (256 * 1024) / std::max<int64_t>(1, RB) / U * U);
  return {wide, passes, tile, grain};
}

// Output rows [n0, n1) of a, all M activation rows.
template <Fmt F, Scale S>
void rows_range(const Args& a, int64_t M, const Plan& p, int64_t n0, int64_t n1) {
  const int64_t K = a.K, N = a.N;
  if (p.passes == 1) {
    rows_block<F, S>(a, M, n0, n1, p.wide);
    return;
  }
  for (int64_t t0 = n0; t0 < n1; t0 += p.tile) {
    const int64_t t1 = std::min(n1, t0 + p.tile);
    for (int64_t q = 0, m0 = 0; q < p.passes; ++q) {
      const int64_t rows = (M - m0) / (p.passes - q);
      Args ap = a;
      ap.x = a.x + m0 * K;
      ap.out = a.out + m0 * N;
      pass_block<F, S>(ap, rows, t0, t1, p.wide);
      m0 += rows;
    }
  }
}

template <Fmt F, Scale S>
void stream(const Args& a, int64_t M) {
  const Plan p = plan<F>(a, M);
  at::parallel_for(0, (a.N + U - 1) / U, p.grain, [&](int64_t u0, int64_t u1) {
    rows_range<F, S>(a, M, p, u0 * U, std::min(a.N, u1 * U));
  });
}

// The rows [row0, row0 + n) of a's weight, written to dst [M, n].
template <Fmt F>
Args row_slice(const Args& a, int64_t row0, int64_t n, float* dst) {
  Args b = a;
  b.w = static_cast<const typename Store<F>::T*>(a.w) + row0 * row_elems<F>(a.K);
  b.scale = a.scale.from(row0);
  b.mins = a.mins.from(row0);
  b.out = dst;
  b.N = n;
  return b;
}

// SwiGLU on the streaming kernel: out[M, I] = silu(x @ gate^T) * (x @ up^T), w = [gate; up]
// [2I, K] (model/fused.py's gate_up_proj). The threads split the I columns; each computes the gate
// and the up rows of its own columns (the same sums as stream() gives them) into a scratch that
// stays in its caches and applies silu * up there. With stream() and the SiLU in the compiled
// graph instead, one thread runs the SiLU over rows another has written, reading them core to
// core while the other idles.
// At M <= 8 a thread's gate rows and up rows are two streams; larger M takes half an L2 tile of
// each at a time.
template <Fmt F, Scale S>
void stream_swiglu(const Args& a, int64_t M, float* out) {
  const int64_t I = a.N / 2;
  const Plan p = plan<F>(a, M);
  const int64_t chunk = p.passes == 1 ? I : std::max<int64_t>(U, p.tile / 2 / U * U);
  at::parallel_for(0, (I + U - 1) / U, std::max<int64_t>(1, p.grain / 2), [&](int64_t u0, int64_t u1) {
    const int64_t c0 = u0 * U, c1 = std::min(I, u1 * U);
    // every element is written before it is read: no zeroing on the decode path
    const std::unique_ptr<float[]> buf(new float[2 * M * std::min(chunk, c1 - c0)]);
    for (int64_t j0 = c0; j0 < c1; j0 += chunk) {
      const int64_t n = std::min(chunk, c1 - j0);
      float* g = buf.get();
      float* u = g + M * n;
      rows_range<F, S>(row_slice<F>(a, j0, n, g), M, p, 0, n);
      rows_range<F, S>(row_slice<F>(a, I + j0, n, u), M, p, 0, n);
      for (int64_t m = 0; m < M; ++m) silu_mul_row(g + m * n, u + m * n, out + m * I + j0, n);
    }
  });
}

// Dequantise rows [n0, n0 + rows) of w into dst [rows, K] fp32 (exact for f16 / bf16;
// q * s rounded to fp32 for int8, as dequantize_int8 does).
template <Fmt F, Scale S>
NXDC_AVX2 void dequant_rows(const Args& a, int64_t n0, int64_t rows, float* dst) {
  using T = typename Store<F>::T;
  const T* w = static_cast<const T*>(a.w);
  const int64_t K = a.K, K8 = K - K % 8;
  float* pbuf = nxdc_cpu::scratch_floats(2 * a.ng);
  for (int64_t i = 0; i < rows; ++i) {
    const T* wr = w + (n0 + i) * row_elems<F>(K);
    const float *sr = nullptr, *mr = nullptr;
    if constexpr (S == Scale::Row) sr = a.scale.row(n0 + i, nullptr);
    group_params<S>(a, n0 + i, pbuf, sr, mr);
    float* d = dst + i * K;
    const float rs = S == Scale::Row ? sr[0] : 1.0f;
    for (int64_t k = 0; k < K8; k += 8) {
      const int64_t g = grouped(S) ? a.gidx[k >> 4] : 0;
      __m256 v;
      if constexpr (F == Fmt::I4)
        v = load8_i4<S>(wr + ((k & ~int64_t(31)) >> 1), (k >> 3) & 3);
      else
        v = load8<F>(wr + k);
      if constexpr (S == Scale::Row) v = _mm256_mul_ps(v, _mm256_set1_ps(rs));
      v = scale256<S>(v, sr, mr, g);
      _mm256_storeu_ps(d + k, v);
    }
    if constexpr (F != Fmt::I4)
      for (int64_t k = K8; k < K; ++k) d[k] = to_float<F>(wr[k]) * rs;  // (no tail with groups)
  }
}

// Up to how many activation rows the streaming kernel beats dequantise + at::mm. With AVX-512 it
// is at least as fast as at::mm (MKL takes its AVX2 path on AMD) at every M, so it takes any M;
// on the AVX2 path at::mm wins from about M = 64.
int64_t stream_rows_max() { return has_avx512() ? std::numeric_limits<int64_t>::max() : 32; }

// M > stream_rows_max(): per thread, dequantise blocks of weight rows into a small fp32 scratch
// (never the whole weight) and let at::mm (single-threaded inside the parallel region) do the block.
template <Fmt F, Scale S>
void run_large(const Args& a, const at::Tensor& x, at::Tensor& out) {
  const int64_t K = a.K, N = a.N;
  const int64_t threads = std::max<int>(1, at::get_num_threads());
  const int64_t target = std::clamp<int64_t>((64 * 1024) / std::max<int64_t>(1, K), 64, 256);  // ~256 KiB scratch
  int64_t nblk = (N + target - 1) / target;
  nblk = (nblk + threads - 1) / threads * threads;  // a multiple of the thread count: even split
  int64_t nb = (N + nblk - 1) / nblk;
  nb = std::max<int64_t>(16, (nb + 15) / 16 * 16);
  nblk = (N + nb - 1) / nb;
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    at::Tensor scratch = at::empty({nb, K}, x.options());
    float* sp = scratch.data_ptr<float>();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * nb, rows = std::min(nb, N - n0);
      dequant_rows<F, S>(a, n0, rows, sp);
      at::Tensor o = out.narrow(1, n0, rows);
      at::mm_out(o, x, scratch.narrow(0, 0, rows).t());
    }
  });
}

// A call's checked arguments: contiguous tensors kept alive for the pointers in `a` (a.out is the
// caller's).
struct Call {
  at::Tensor x, w, scale, mins;
  std::vector<int32_t> gidx;
  Args a;
  Scale S;
  int64_t M;
};

// int8 / int4 take a scale ([N] per row, int8 only, or [N, K / G] per group of G inputs) and,
// per group, an optional min (w = q * s + m).
template <Fmt F>
Call prepare(const char* name, const at::Tensor& x, const at::Tensor& w, const at::Tensor* scale,
             const at::Tensor* mins = nullptr) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, name, ": expected x [M, K] and w [N, K], got ", x.sizes(), " and ",
              w.sizes());
  const int64_t per_byte = F == Fmt::I4 ? 2 : 1;  // int4: w is [N, K / 2] bytes
  TORCH_CHECK(x.size(1) == w.size(1) * per_byte, name, ": x has K=", x.size(1), " but w has K=", w.size(1) * per_byte);
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), name, ": CPU tensors only");
  const int64_t K = x.size(1), N = w.size(0);
  Call c;
  c.S = Scale::None;
  c.M = x.size(0);
  int64_t ng = 0;
  if (scale) {
    TORCH_CHECK(((scale->scalar_type() == at::kFloat && scale->dim() == 1) || nxdc_cpu::scale_groups(*scale, K) > 0) &&
                    scale->device().is_cpu(),
                name, ": scale must be a float32 CPU tensor [N] or [N, K / G] (group scales: float32 or float16, "
                "or two-level: uint8 [N, 2 * K / 256 + K / G]), got ", scale->scalar_type(), " ", scale->sizes());
    TORCH_CHECK(scale->size(0) == N, name, ": scale has ", scale->size(0), " rows, w has ", N);
    c.scale = scale->contiguous();
    if (scale->dim() == 1) {
      TORCH_CHECK(F != Fmt::I4 && !mins, name, ": int4 weights and mins need group scales [N, K / G]");
      c.S = Scale::Row;
      ng = 1;
    } else {
      ng = nxdc_cpu::scale_groups(*scale, K);
      const int64_t unit = F == Fmt::I4 ? 32 : 16;
      TORCH_CHECK(ng > 0 && K % ng == 0 && (K / ng) % unit == 0, name, ": group scales [N, K / G] need G = K / ",
                  "scale.size(1) to be a whole multiple of ", unit, "; got K=", K, " and ", ng, " groups");
      c.S = mins ? Scale::GroupMin : Scale::Group;
      const int64_t G = K / ng;
      c.gidx.resize(K / 16);
      for (int64_t i = 0; i < K / 16; ++i) c.gidx[i] = static_cast<int32_t>((i * 16) / G);
    }
  }
  if (mins) {
    TORCH_CHECK(mins->scalar_type() == c.scale.scalar_type() && mins->device().is_cpu() &&
                    mins->sizes() == c.scale.sizes(),
                name, ": min must be a CPU tensor of scale's dtype and shape (", c.scale.scalar_type(), " ",
                c.scale.sizes(), "), got ", mins->scalar_type(), " ", mins->sizes());
    c.mins = mins->contiguous();
  }
  c.x = x.contiguous();
  c.w = w.contiguous();
  c.a = Args{c.x.data_ptr<float>(),
             c.w.data_ptr(),
             nxdc_cpu::group_rows(c.scale, K),
             nxdc_cpu::group_rows(c.mins, K),
             c.gidx.data(),
             nullptr,
             K,
             N,
             ng};
  return c;
}

// f(std::integral_constant<Scale, S>) for the call's scale kind.
template <typename Fn>
void with_scale(Scale S, Fn&& f) {
  switch (S) {
    case Scale::None: f(std::integral_constant<Scale, Scale::None>{}); break;
    case Scale::Row: f(std::integral_constant<Scale, Scale::Row>{}); break;
    case Scale::Group: f(std::integral_constant<Scale, Scale::Group>{}); break;
    case Scale::GroupMin: f(std::integral_constant<Scale, Scale::GroupMin>{}); break;
  }
}

// out[M, N] = x @ dequant(w)^T for a prepared call (a.out = out, K > 0).
template <Fmt F, Scale S>
void linear_into(const Call& c, const Args& a, at::Tensor& out) {
  if (F == Fmt::F32 && c.M > stream_rows_max()) {  // AVX2-only CPUs: MKL's sgemm, nothing to convert
    at::mm_out(out, c.x, c.w.t());
  } else if (c.M <= stream_rows_max()) {
    stream<F, S>(a, c.M);
  } else {
    run_large<F, S>(a, c.x, out);
  }
}

template <Fmt F>
at::Tensor lowp_linear(const char* name, const at::Tensor& x, const at::Tensor& w, const at::Tensor* scale,
                       const at::Tensor* mins = nullptr) {
  Call c = prepare<F>(name, x, w, scale, mins);
  auto out = at::empty({c.M, c.a.N}, x.options());
  if (c.M == 0 || c.a.N == 0) return out;
  if (c.a.K == 0) return out.zero_();
  c.a.out = out.data_ptr<float>();
  with_scale(c.S, [&](auto s) { linear_into<F, decltype(s)::value>(c, c.a, out); });
  return out;
}

// out[M, I] = silu(x @ gate^T) * (x @ up^T) for w = [gate; up] [2I, K].
template <Fmt F>
at::Tensor lowp_swiglu(const at::Tensor& x, const at::Tensor& w, const at::Tensor* scale,
                       const at::Tensor* mins = nullptr) {
  Call c = prepare<F>("swiglu", x, w, scale, mins);
  TORCH_CHECK(c.a.N % 2 == 0, "swiglu: w must stack gate and up rows [2I, K], got ", c.a.N, " rows");
  const int64_t I = c.a.N / 2, M = c.M;
  auto out = at::empty({M, I}, x.options());
  if (M == 0 || I == 0) return out;
  if (c.a.K == 0) return out.zero_();
  with_scale(c.S, [&](auto s) {
    constexpr Scale S = decltype(s)::value;
    if (M <= stream_rows_max()) {
      stream_swiglu<F, S>(c.a, M, out.data_ptr<float>());
      return;
    }
    auto full = at::empty({M, 2 * I}, x.options());  // AVX2 at M > 32: at::mm, then the SiLU
    Args a = c.a;
    a.out = full.data_ptr<float>();
    linear_into<F, S>(c, a, full);
    const float* f = full.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) silu_mul_row(f + m * 2 * I, f + m * 2 * I + I, o + m * I, I);
    });
  });
  return out;
}

}  // namespace

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "linear_f32: w must be float32, got ", w.scalar_type());
  return lowp_linear<Fmt::F32>("linear_f32", x, w, nullptr);
}

at::Tensor linear_f16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kHalf, "linear_f16: w must be float16, got ", w.scalar_type());
  return lowp_linear<Fmt::F16>("linear_f16", x, w, nullptr);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "linear_bf16: w must be bfloat16, got ", w.scalar_type());
  return lowp_linear<Fmt::BF16>("linear_bf16", x, w, nullptr);
}

const at::Tensor* opt(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& min) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "linear_i8: w must be int8, got ", w.scalar_type());
  return lowp_linear<Fmt::I8>("linear_i8", x, w, &scale, opt(min));
}

at::Tensor linear_i4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& min) {
  TORCH_CHECK(w.scalar_type() == at::kByte, "linear_i4: w must be uint8 (two int4 a byte), got ", w.scalar_type());
  return lowp_linear<Fmt::I4>("linear_i4", x, w, &scale, opt(min));
}

// The weight's dtype picks the format, as for the linear ops; int8 / int4 (uint8 storage) need
// their scale, and take an optional min.
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& min) {
  const auto t = w.scalar_type();
  const bool quant = t == at::kChar || t == at::kByte;
  TORCH_CHECK(scale.has_value() == quant, "swiglu: int8 / int4 weights take a scale, other formats none");
  TORCH_CHECK(quant || !min.has_value(), "swiglu: only int8 / int4 weights take a min");
  if (t == at::kFloat) return lowp_swiglu<Fmt::F32>(x, w, nullptr);
  if (t == at::kHalf) return lowp_swiglu<Fmt::F16>(x, w, nullptr);
  if (t == at::kBFloat16) return lowp_swiglu<Fmt::BF16>(x, w, nullptr);
  if (t == at::kByte) return lowp_swiglu<Fmt::I4>(x, w, &*scale, opt(min));
  TORCH_CHECK(t == at::kChar, "swiglu: w must be float32, float16, bfloat16, int8 or int4 (uint8), got ", t);
  return lowp_swiglu<Fmt::I8>(x, w, &*scale, opt(min));
}

TORCH_LIBRARY(nxdc, m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor");
  m.def("linear_f16(Tensor x, Tensor w) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("linear_i8(Tensor x, Tensor w, Tensor scale, Tensor? min=None) -> Tensor");
  m.def("linear_i4(Tensor x, Tensor w, Tensor scale, Tensor? min=None) -> Tensor");
  m.def("swiglu(Tensor x, Tensor w, Tensor? scale=None, Tensor? min=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdc, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_f16", &linear_f16);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_i8", &linear_i8);
  m.impl("linear_i4", &linear_i4);
  m.impl("swiglu", &swiglu);
}
