// Peak fp32 multiply-add rate of this CPU: 12 independent FMA chains per thread (enough to hide
// FMA latency on two pipes), 256-bit and, where the CPU has it, 512-bit vectors, on 1..T threads.
// Prints one line per (width, threads): "<bits> <threads> <GFLOP/s>". Built and run by
// bench/ceilings.py: gcc -O3 -fopenmp fma_peak.c.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS 12

__attribute__((target("avx2,fma"))) static float run256(long n) {
  __m256 a[CHAINS], x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
  for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_ps((float)i);
  for (long k = 0; k < n; k++) {
    for (int i = 0; i < CHAINS; i++) a[i] = _mm256_fmadd_ps(a[i], x, y);
    __asm__ volatile("" : "+x"(x));  // keep the loop: x may change
  }
  float out[8], s = 0;
  for (int i = 0; i < CHAINS; i++) {
    _mm256_storeu_ps(out, a[i]);
    s += out[0];
  }
  return s;
}

__attribute__((target("avx512f"))) static float run512(long n) {
  __m512 a[CHAINS], x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
  for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_ps((float)i);
  for (long k = 0; k < n; k++) {
    for (int i = 0; i < CHAINS; i++) a[i] = _mm512_fmadd_ps(a[i], x, y);
    __asm__ volatile("" : "+v"(x));
  }
  float s = 0;
  for (int i = 0; i < CHAINS; i++) s += _mm512_reduce_add_ps(a[i]);
  return s;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  const long n = argc > 2 ? atol(argv[2]) : 50000000L;
  float sink = 0;
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    fprintf(stderr, "fma_peak: this CPU has no AVX2 + FMA\n");
    return 2;
  }
  for (int bits = 256; bits <= 512; bits += 256) {
    if (bits == 512 && !__builtin_cpu_supports("avx512f")) break;
    for (int t = 1; t <= threads; t++) {
      double best = 1e30;
      for (int rep = 0; rep < 3; rep++) {
        const double t0 = now();
#pragma omp parallel num_threads(t) reduction(+ : sink)
        sink += bits == 256 ? run256(n) : run512(n);
        const double dt = now() - t0;
        if (dt < best) best = dt;
      }
      printf("%d %d %.1f\n", bits, t, t * (double)n * CHAINS * (bits / 32) * 2 / best / 1e9);
    }
  }
  return sink == 1.2345f;  // never: the sums are used
}
