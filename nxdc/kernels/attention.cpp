// Prefill / decode / verify attention over the static KV cache, fp32 queries and accumulation:
//
//   nxdc::attend(q [B, H, R, D], k_cache [N, H, S, D], v_cache [N, H, S, D], positions [B, T],
//                rows [B] = None) -> out [B, H, R, D]
//
// Sequence b of q reads the cache's batch row rows[b] (None: row b, and N == B): a serving graph
// works on a few of the cache's rows, chosen at run time, without copying them.
//
// The caches are float32, float16 or bfloat16 (`nxdc export --kv-cache`); 16-bit keys and values
// are converted to fp32 in registers as they are read (half the bytes of a memory-bound read).
//
// H is the number of KV heads; the R = G * T query rows of a KV head are its G query heads times
// the T new tokens (row g * T + t), as model/attention.py groups them. Row g * T + t of sequence b
// attends to cache slots 0 .. positions[b, t] (its own and every earlier position) and to nothing
// else: softmax(q . k_s / sqrt(D)) over those slots, then the weighted sum of their v_s.
//
// Why not SDPA: PyTorch's CPU flash attention runs each tiny decode block through MKL's sgemm,
// which is slow at these sizes, and reads every slot of the bucket, masked or not. This reads
// only the slots a row attends to, once per KV head for all of its query rows, and scores 8 keys
// at a time (8 independent FMA chains: one q . k chain is latency-bound). A fresh prefill's mask
// is causal, so it skips the upper triangle as well, which makes prefill faster than causal GQA
// SDPA or masked SDPA (figures: docs/performance.md and bench/results/).
//
// Every row is computed by the same code in the same order whatever B, T, R, S or the thread
// split, so a verify graph's row equals the decode graph's row bit for bit (greedy speculation
// relies on it, as on the linear kernels).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "vexp.h"

namespace nxdc_cpu {
bool has_avx512();  // linear.cpp
}

namespace {

#define NXDC_AVX2 __attribute__((target("avx2,fma,f16c")))
// The same 256-bit arithmetic with AVX-512VL's 32 vector registers (two rows at once need ~20).
#define NXDC_AVX512VL __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))

using nxdc_cpu::exp_neg;

// 8 cache elements as fp32: a plain load, vcvtph2ps, or a 16-bit shift (bf16 is fp32's top half).
template <typename T>
NXDC_AVX2 inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>, "attend: float, Half or BFloat16 caches");
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
}

NXDC_AVX2 inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Lane j of the result = the sum of the lanes of a[j]; each by the same tree,
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), whatever j.
NXDC_AVX2 inline __m256 hsum8(const __m256 (&a)[8]) {
  // q0: the lane-0..3 and lane-4..7 partial sums of a[0..3] (low / high half); q1: of a[4..7]
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// dst[j] = scale * (q . k[j]) for 8 keys (D a multiple of 8): 8 FMA chains, one transposed sum.
template <typename T>
NXDC_AVX2 inline void dot8(const float* q, const T* const (&k)[8], int64_t D, float scale, float* dst) {
  __m256 acc[8];
  __m256 qv = _mm256_loadu_ps(q);
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(qv, load8(k[j]));
  for (int64_t d = 8; d < D; d += 8) {
    qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k[j] + d), acc[j]);
  }
  _mm256_storeu_ps(dst, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
}

// dot8 for two query rows against the same 8 keys, each key vector loaded once for both: each
// row's arithmetic is exactly dot8's (same chains, same sum tree), so its scores are dot8's bits.
template <typename T>
NXDC_AVX512VL inline void dot8x2(const float* q0, const float* q1, const T* const (&k)[8], int64_t D, float scale,
                                 float* dst0, float* dst1) {
  __m256 a0[8], a1[8];
  __m256 q0v = _mm256_loadu_ps(q0), q1v = _mm256_loadu_ps(q1);
  for (int j = 0; j < 8; ++j) {
    const __m256 kv = load8(k[j]);
    a0[j] = _mm256_mul_ps(q0v, kv);
    a1[j] = _mm256_mul_ps(q1v, kv);
  }
  for (int64_t d = 8; d < D; d += 8) {
    q0v = _mm256_loadu_ps(q0 + d);
    q1v = _mm256_loadu_ps(q1 + d);
    for (int j = 0; j < 8; ++j) {
      const __m256 kv = load8(k[j] + d);
      a0[j] = _mm256_fmadd_ps(q0v, kv, a0[j]);
      a1[j] = _mm256_fmadd_ps(q1v, kv, a1[j]);
    }
  }
  const __m256 sv = _mm256_set1_ps(scale);
  _mm256_storeu_ps(dst0, _mm256_mul_ps(hsum8(a0), sv));
  _mm256_storeu_ps(dst1, _mm256_mul_ps(hsum8(a1), sv));
}

// p[0..len) <- exp(p - max) (p padded to a multiple of 8; padding lanes become 0); returns 1 / sum.
NXDC_AVX2 inline float softmax_row(float* p, int64_t len) {
  const int64_t len8 = (len + 7) / 8 * 8;
  for (int64_t s = len; s < len8; ++s) p[s] = -std::numeric_limits<float>::infinity();
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t s = 0; s < len8; s += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + s));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(m4));
  __m256 sum = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t s = 0; s < len8; s += 8) {
    const __m256 keep = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(len - s)), lane));
    const __m256 e = _mm256_and_ps(exp_neg(_mm256_sub_ps(_mm256_loadu_ps(p + s), m)), keep);
    _mm256_storeu_ps(p + s, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.0f / hsum(sum);
}

// o[0..D) = inv * sum_s p[s] v[s]; the D / 8 accumulators stay in registers for D <= 128.
template <int D, typename T>
NXDC_AVX2 void weighted_sum(float* o, const float* p, const T* v, int64_t len, float inv) {
  __m256 acc[D / 8];
  for (int j = 0; j < D / 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < len; ++s) {
    const __m256 ps = _mm256_set1_ps(p[s]);
    for (int j = 0; j < D / 8; ++j) acc[j] = _mm256_fmadd_ps(ps, load8(v + s * D + 8 * j), acc[j]);
  }
  for (int j = 0; j < D / 8; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(acc[j], _mm256_set1_ps(inv)));
}

template <typename T>
NXDC_AVX2 void weighted_sum_any(float* o, const float* p, const T* v, int64_t len, int64_t D, float inv) {
  for (int64_t j = 0; j < D; j += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t s = 0; s < len; ++s) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[s]), load8(v + s * D + j), acc);
    _mm256_storeu_ps(o + j, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
  }
}

// weighted_sum<64> for two rows (lengths len0, len1), each value vector loaded once while both
// rows use it; every accumulator still adds its s = 0, 1, ... terms in order: weighted_sum's bits.
template <typename T>
NXDC_AVX512VL void weighted_sum2_64(float* o0, float* o1, const float* p0, const float* p1, const T* v, int64_t len0,
                                    int64_t len1, float inv0, float inv1) {
  __m256 a0[8], a1[8];
  for (int j = 0; j < 8; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  const int64_t both = std::min(len0, len1);
  int64_t s = 0;
  for (; s < both; ++s) {
    const __m256 ps0 = _mm256_set1_ps(p0[s]), ps1 = _mm256_set1_ps(p1[s]);
    for (int j = 0; j < 8; ++j) {
      const __m256 vv = load8(v + s * 64 + 8 * j);
      a0[j] = _mm256_fmadd_ps(ps0, vv, a0[j]);
      a1[j] = _mm256_fmadd_ps(ps1, vv, a1[j]);
    }
  }
  for (int64_t t = s; t < len0; ++t) {
    const __m256 ps = _mm256_set1_ps(p0[t]);
    for (int j = 0; j < 8; ++j) a0[j] = _mm256_fmadd_ps(ps, load8(v + t * 64 + 8 * j), a0[j]);
  }
  for (int64_t t = s; t < len1; ++t) {
    const __m256 ps = _mm256_set1_ps(p1[t]);
    for (int j = 0; j < 8; ++j) a1[j] = _mm256_fmadd_ps(ps, load8(v + t * 64 + 8 * j), a1[j]);
  }
  for (int j = 0; j < 8; ++j) {
    _mm256_storeu_ps(o0 + 8 * j, _mm256_mul_ps(a0[j], _mm256_set1_ps(inv0)));
    _mm256_storeu_ps(o1 + 8 * j, _mm256_mul_ps(a1[j], _mm256_set1_ps(inv1)));
  }
}

// Softmax of one row's scores p (len of them) and its weighted sum of values into o.
template <typename T>
NXDC_AVX2 inline void finish_row(float* p, int64_t len, const T* v, int64_t D, float* o) {
  const float inv = softmax_row(p, len);
  if (D == 64)
    weighted_sum<64>(o, p, v, len, inv);
  else if (D == 128)
    weighted_sum<128>(o, p, v, len, inv);
  else
    weighted_sum_any(o, p, v, len, D, inv);
}

// The next (sequence, KV head) task this thread runs: its caches and how many of their slots it
// reads (k == nullptr: none).
template <typename T>
struct Next {
  const T* k = nullptr;
  const T* v = nullptr;
  int64_t slots = 0;
};

// Memory traffic to overlap with the arithmetic of key block s0 (of n slots): the keys KEYS_AHEAD
// blocks on, that block's values, which the weighted sums read after the scores, and this block's
// share of the next task's keys and values, so that they are in L2 when it starts. Without it a
// call reads its cache, then computes, and a cache coming from memory rather than L2 / L3 costs
// the whole read on top of the arithmetic. The keys run ahead because the hardware prefetcher
// alone leaves the key pass waiting on memory; 2 to 16 blocks ahead do about the same (16-bit
// caches best from 8), and prefetching into L1 instead of L2 gains nothing.
// always_inline: gcc 12 otherwise emitted this function out of line with its prefetches removed.
constexpr int64_t KEYS_AHEAD = 8;

// Into L2: the rows of the 8-slot block that starts at slot s0 of c (those below n).
template <typename T>
NXDC_AVX2 __attribute__((always_inline)) inline void prefetch_rows(const T* c, int64_t s0, int64_t n, int64_t D) {
  const int64_t row = D * static_cast<int64_t>(sizeof(T));
  const char* p = reinterpret_cast<const char*>(c + s0 * D);
  for (int64_t off = 0, end = std::min<int64_t>(8, n - s0) * row; off < end; off += 64)
    _mm_prefetch(p + off, _MM_HINT_T1);
}

template <typename T>
NXDC_AVX2 __attribute__((always_inline)) inline void prefetch_block(const T* k, const T* v, int64_t s0, int64_t n,
                                                                    int64_t D, const Next<T>& nx) {
  prefetch_rows(k, s0 + 8 * KEYS_AHEAD, n, D);  // nothing past the last block
  prefetch_rows(v, s0, n, D);
  const int64_t row = D * static_cast<int64_t>(sizeof(T));
  if (!nx.k) return;
  const int64_t lines = (nx.slots * row + 63) / 64, blocks = (n + 7) / 8, b = s0 / 8;
  const char* nk = reinterpret_cast<const char*>(nx.k);
  const char* nv = reinterpret_cast<const char*>(nx.v);
  for (int64_t l = lines * b / blocks, l1 = lines * (b + 1) / blocks; l < l1; ++l) {
    _mm_prefetch(nk + 64 * l, _MM_HINT_T1);
    _mm_prefetch(nv + 64 * l, _MM_HINT_T1);
  }
}

// One (sequence, KV head): rows [R, D] of q against slots of k / v [S, D]; last[r] is the last
// slot row r attends to. scores: scratch, R rows of n8 floats.
template <typename T>
NXDC_AVX2 void head(const float* q, const T* k, const T* v, float* out, const int64_t* last, int64_t R, int64_t D,
                    float scale, std::vector<float>& scores, const Next<T>& nx) {
  const int64_t n = *std::max_element(last, last + R) + 1, n8 = (n + 7) / 8 * 8;
  scores.resize(static_cast<size_t>(R * n8));
  // Keys in blocks of 8 (past n: key n - 1 again, its score landing in padding), each block for
  // every row that reaches it; a score depends neither on its block nor on the other rows.
  for (int64_t s0 = 0; s0 < n; s0 += 8) {
    const T* ks[8];
    for (int j = 0; j < 8; ++j) ks[j] = k + std::min<int64_t>(s0 + j, n - 1) * D;
    prefetch_block(k, v, s0, n, D, nx);
    for (int64_t r = 0; r < R; ++r)
      if (s0 <= last[r]) dot8(q + r * D, ks, D, scale, scores.data() + r * n8 + s0);
  }
  for (int64_t r = 0; r < R; ++r) finish_row(scores.data() + r * n8, last[r] + 1, v, D, out + r * D);
}

// head() with rows taken two at a time where both reach a key block: the key and value vectors
// are loaded once for the pair (the 32 registers of AVX-512VL hold both rows' accumulators).
// Same bits as head(); faster than one row at a time on long prefills.
template <typename T>
NXDC_AVX512VL void head_pairs(const float* q, const T* k, const T* v, float* out, const int64_t* last, int64_t R,
                              int64_t D, float scale, std::vector<float>& scores, const Next<T>& nx) {
  const int64_t n = *std::max_element(last, last + R) + 1, n8 = (n + 7) / 8 * 8;
  scores.resize(static_cast<size_t>(R * n8));
  float* sc = scores.data();
  for (int64_t s0 = 0; s0 < n; s0 += 8) {
    const T* ks[8];
    for (int j = 0; j < 8; ++j) ks[j] = k + std::min<int64_t>(s0 + j, n - 1) * D;
    prefetch_block(k, v, s0, n, D, nx);
    for (int64_t r = 0; r < R; r += 2) {
      const bool a = s0 <= last[r], b = r + 1 < R && s0 <= last[r + 1];
      if (a && b)
        dot8x2(q + r * D, q + (r + 1) * D, ks, D, scale, sc + r * n8 + s0, sc + (r + 1) * n8 + s0);
      else if (a)
        dot8(q + r * D, ks, D, scale, sc + r * n8 + s0);
      else if (b)
        dot8(q + (r + 1) * D, ks, D, scale, sc + (r + 1) * n8 + s0);
    }
  }
  int64_t r = 0;
  if (D == 64) {
    for (; r + 1 < R; r += 2) {
      float *p0 = sc + r * n8, *p1 = p0 + n8;
      const int64_t len0 = last[r] + 1, len1 = last[r + 1] + 1;
      const float inv0 = softmax_row(p0, len0), inv1 = softmax_row(p1, len1);
      weighted_sum2_64(out + r * D, out + (r + 1) * D, p0, p1, v, len0, len1, inv0, inv1);
    }
  }
  for (; r < R; ++r) finish_row(sc + r * n8, last[r] + 1, v, D, out + r * D);
}

// Every (sequence, KV head) of the call in blocks of up to ROWS query rows, split across threads;
// `tokens` positions per sequence. A block costs its rows' lengths, which grow along a prefill's
// causal rows, so each thread takes every threads-th block (a contiguous split would give one
// thread the long rows); blocking also keeps a prefill's few KV heads (3 in SmolLM2) from leaving
// one of 2 threads idle a third of the time. Rows are independent: blocking changes no result.
constexpr int64_t ROWS = 32;

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const int64_t* pos, const int64_t* cache_rows,
         int64_t tokens, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = kc.size(2);
  const float* qp = q.data_ptr<float>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const bool pairs = R > 1 && nxdc_cpu::has_avx512();
  const int64_t blocks = (R + ROWS - 1) / ROWS, units = B * H * blocks;
  // small calls stay on one thread: ~64K multiply-adds of work per thread at least
  const int64_t work = R * D * (*std::max_element(pos, pos + B * tokens) + 1) * B * H;
  const int64_t threads = std::clamp<int64_t>(work / (64 * 1024), 1, std::min<int64_t>(units, at::get_num_threads()));
  // Unit u: query rows [r0, r0 + rows) of (sequence, KV head) bh; row r attends up to its token's position.
  struct Unit {
    int64_t bh, r0, rows;
  };
  const auto unit = [&](int64_t u) {
    const int64_t r0 = (u % blocks) * ROWS;
    return Unit{u / blocks, r0, std::min(ROWS, R - r0)};
  };
  const auto last_slot = [&](const Unit& x, int64_t r) { return pos[x.bh / H * tokens + (x.r0 + r) % tokens]; };
  // where (sequence, KV head) bh's slots start in the caches
  const auto cache_at = [&](int64_t bh) { return ((cache_rows ? cache_rows[bh / H] : bh / H) * H + bh % H) * S * D; };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    std::vector<int64_t> last(static_cast<size_t>(ROWS));
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t u = t; u < units; u += threads) {
        const Unit cur = unit(u);
        for (int64_t r = 0; r < cur.rows; ++r) last[r] = last_slot(cur, r);
        Next<T> nx;  // the unit this thread runs next, to prefetch
        if (u + threads < units) {
          const Unit next = unit(u + threads);
          for (int64_t r = 0; r < next.rows; ++r) nx.slots = std::max(nx.slots, last_slot(next, r) + 1);
          nx.k = kp + cache_at(next.bh);
          nx.v = vp + cache_at(next.bh);
        }
        (pairs ? head_pairs<T> : head<T>)(qp + (cur.bh * R + cur.r0) * D, kp + cache_at(cur.bh), vp + cache_at(cur.bh),
                                          op + (cur.bh * R + cur.r0) * D, last.data(), cur.rows, D, scale, scores,
                                          nx);
      }
  });
}

}  // namespace

at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& positions, const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4 && positions.dim() == 2,
              "attend: expected q [B, H, R, D], caches [N, H, S, D], positions [B, T]; got ", q.sizes(), ", ",
              k_cache.sizes(), ", ", positions.sizes());
  const auto kt = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attend: q must be float32, got ", q.scalar_type());
  TORCH_CHECK((kt == at::kFloat || kt == at::kHalf || kt == at::kBFloat16) && v_cache.scalar_type() == kt,
              "attend: caches must be both float32, float16 or bfloat16; got ", kt, " and ", v_cache.scalar_type());
  TORCH_CHECK(positions.scalar_type() == at::kLong, "attend: positions must be int64");
  TORCH_CHECK(q.size(3) % 8 == 0 && q.size(3) > 0, "attend: head_dim must be a multiple of 8, got ", q.size(3));
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = k_cache.size(2);
  const int64_t N = k_cache.size(0), T = positions.size(1);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && (rows.has_value() || N == B) && k_cache.size(1) == H &&
                  k_cache.size(3) == D,
              "attend: cache shape ", k_cache.sizes(), " does not match q ", q.sizes());
  TORCH_CHECK(positions.size(0) == B && T > 0 && R % T == 0, "attend: positions ", positions.sizes(),
              " do not match q ", q.sizes());
  auto qc = q.contiguous();
  auto kc = k_cache.contiguous();  // the caches are contiguous buffers: no copy
  auto vc = v_cache.contiguous();
  auto pc = positions.contiguous();
  const int64_t* pos = pc.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < S, "attend: position ", pos[i], " outside the cache (", S, " slots)");
  at::Tensor rc;
  const int64_t* rp = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->size(0) == B,
                "attend: rows must be int64 [", B, "], got ", rows->sizes());
    rc = rows->contiguous();
    rp = rc.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(rp[b] >= 0 && rp[b] < N, "attend: row ", rp[b], " outside the cache (", N, " rows)");
  }
  auto out = at::empty_like(qc);
  if (kt == at::kFloat)
    run<float>(qc, kc, vc, pos, rp, T, out);
  else if (kt == at::kHalf)
    run<c10::Half>(qc, kc, vc, pos, rp, T, out);
  else
    run<c10::BFloat16>(qc, kc, vc, pos, rp, T, out);
  return out;
}

TORCH_LIBRARY_FRAGMENT(nxdc, m) { m.def("attend(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, Tensor? rows=None) -> Tensor"); }
TORCH_LIBRARY_IMPL(nxdc, CPU, m) { m.impl("attend", &attend); }
