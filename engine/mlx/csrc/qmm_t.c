/* y = x @ dequantize(w)^T for MLX's affine quantization, float32, bit for bit
 * MLX's CPU quantized_matmul (mlx/backend/cpu/quantized.cpp at MLX 0.32,
 * _qmm_t), but vectorized and on several threads.
 *
 * Why: on x86 MLX's CPU SIMD layer has one lane (simd/base_simd.h), so its
 * _qmm_t_simd path is compiled out and quantized_matmul runs the scalar
 * _qmm_t, one weight at a time, on the one thread of the CPU stream: a
 * Qwen2.5-1.5B token takes seconds (issues #41, #45). Its arithmetic, per
 * output y[m][n]:
 *
 *     sum = 0
 *     for k in 0..K-1 (in order):  sum += x[m][k] * (scale[n][k/gs] * q[n][k] + bias[n][k/gs])
 *
 * every product and sum rounded on its own (the wheel is built without FMA
 * contraction), and one output's sum strictly in k order. The same statements
 * give the same bits, so this kernel keeps them and vectorizes across
 * outputs instead: 8 rows n in the 8 lanes of a vector, each lane running its
 * own row's sum in k order. A block of 8 rows x 8 packed words is loaded and
 * transposed (lane r of word-vector j = row r's word j), so each shift+mask
 * gives the next k for all 8 rows. Built by engine.mlx.qmm_kernel with
 * -ffp-contract=off (a fused multiply-add would round once where MLX rounds
 * twice) and without -ffast-math (it would reorder the sums).
 *
 * A tile is NB blocks of 8 rows x MB rows of x: NB*MB independent sums keep
 * the adders busy (one sum is a chain of dependent adds). Threads split the
 * output rows; a row's result does not depend on the split.
 *
 * With AVX-512 (F, BW) the tiles hold 16 rows a 512-bit vector instead (see
 * tile16: fewer instructions a weight, and a prefetch that the 16 row streams
 * need); the 8-row tiles stay for other CPUs and for a last block of 8 rows.
 * Measured in docs/bench/cpu-qmm.md, against the previous source with
 * python -m bench.cpu.qmm_ab.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <pthread.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#ifndef PF_ROWS
#define PF_ROWS 32 /* the AVX-512 tiles' prefetch distance: two tiles */
#endif
#ifndef PREFETCH
#define PREFETCH 128 /* words: 512 bytes */
#endif
#define AI static inline __attribute__((always_inline))

AI v8f splat(float v) { return (v8f){v, v, v, v, v, v, v, v}; }

typedef struct {
  float* y;
  const float* x;
  const uint32_t* w;
  const float* s;
  const float* b;
  int64_t M, N, K, gs;
  int64_t n0, n1;     /* this job's rows: [n0, n1) */
  int64_t next0, next1; /* the rows this thread most likely takes next (next0 < 0: none) */
} job_t;

/* Where a tile of `rows` weight rows at row n prefetches: `dist` rows ahead
 * while that stays inside [n, n1), else as far into the rows this thread
 * takes next [next0, next1); NULL past both. Not simply `dist` rows on in
 * memory: with two threads those rows are often the other core's, and a
 * line fetched into this core's L2 for the other core is a wasted read (the
 * 1.5B's decode matrices: 17 GB/s with that, 22-26 with this). */
AI const char* ahead_row(const void* base, int64_t row_bytes, int64_t n, int64_t dist, int64_t rows, int64_t n1,
                         int64_t next0, int64_t next1) {
  int64_t t = n + dist;
  if (t + rows > n1) {
    if (next0 < 0) return 0;
    t = next0 + (t - n1);
    if (t + rows > next1) return 0;
  }
  return (const char*)base + t * row_bytes;
}

/* out[j] lane r = src[r * stride + j], j, r < 8 */
AI void transpose8(const uint32_t* src, int64_t stride, v8u out[8]) {
#if defined(__AVX__)
  __m256 r0 = _mm256_loadu_ps((const float*)(src + 0 * stride));
  __m256 r1 = _mm256_loadu_ps((const float*)(src + 1 * stride));
  __m256 r2 = _mm256_loadu_ps((const float*)(src + 2 * stride));
  __m256 r3 = _mm256_loadu_ps((const float*)(src + 3 * stride));
  __m256 r4 = _mm256_loadu_ps((const float*)(src + 4 * stride));
  __m256 r5 = _mm256_loadu_ps((const float*)(src + 5 * stride));
  __m256 r6 = _mm256_loadu_ps((const float*)(src + 6 * stride));
  __m256 r7 = _mm256_loadu_ps((const float*)(src + 7 * stride));
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  out[0] = (v8u)_mm256_permute2f128_ps(s0, s4, 0x20);
  out[1] = (v8u)_mm256_permute2f128_ps(s1, s5, 0x20);
  out[2] = (v8u)_mm256_permute2f128_ps(s2, s6, 0x20);
  out[3] = (v8u)_mm256_permute2f128_ps(s3, s7, 0x20);
  out[4] = (v8u)_mm256_permute2f128_ps(s0, s4, 0x31);
  out[5] = (v8u)_mm256_permute2f128_ps(s1, s5, 0x31);
  out[6] = (v8u)_mm256_permute2f128_ps(s2, s6, 0x31);
  out[7] = (v8u)_mm256_permute2f128_ps(s3, s7, 0x31);
#else
  for (int j = 0; j < 8; j++)
    for (int r = 0; r < 8; r++) out[j][r] = src[r * stride + j];
#endif
}

/* One tile: rows n .. n + 8*NB of y, rows m .. m + MB of x. */
AI void tile(const job_t* J, int64_t n, int64_t m, const int BITS, const int NB, const int MB) {
  const int PF = 32 / BITS;
  const uint32_t MASK = (1u << BITS) - 1u;
  const int64_t K = J->K, KW = K / PF, gs = J->gs, G = K / gs, N = J->N;
  const float* x = J->x + m * K;
  /* fixed sizes (NB <= 8, MB <= 4): with the loops unrolled the sums live in registers */
  v8f acc[8][4];
  v8f sc[8] = {0}, bi[8] = {0};
  v8u tw[8][8];
#pragma GCC unroll 8
  for (int nb = 0; nb < NB; nb++)
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; mb++) acc[nb][mb] = splat(0.0f);
  int64_t next_group = 0, g = 0;
  for (int64_t kw = 0; kw < KW; kw += 8) {
    const int nw = KW - kw < 8 ? (int)(KW - kw) : 8;
    for (int nb = 0; nb < NB; nb++) {
      const uint32_t* src = J->w + (n + 8 * nb) * KW + kw;
      /* a tile reads 8*NB rows side by side, more streams than the hardware
         prefetcher follows: ask for each row's line PREFETCH words ahead */
      if ((kw & 15) == 0)
        for (int r = 0; r < 8; r++) __builtin_prefetch(src + r * KW + PREFETCH);
      if (nw == 8) {
        transpose8(src, KW, tw[nb]);
      } else {
        for (int j = 0; j < nw; j++)
          for (int r = 0; r < 8; r++) tw[nb][j][r] = src[r * KW + j];
      }
    }
    for (int j = 0; j < nw; j++) {
      const int64_t k0 = (kw + j) * PF;
      if (k0 == next_group) { /* a new group: its scale and bias for the tile's rows */
#pragma GCC unroll 8
        for (int nb = 0; nb < NB; nb++) {
          float ts[8], tb[8];
          for (int r = 0; r < 8; r++) {
            ts[r] = J->s[(n + 8 * nb + r) * G + g];
            tb[r] = J->b[(n + 8 * nb + r) * G + g];
          }
          memcpy(&sc[nb], ts, sizeof ts);
          memcpy(&bi[nb], tb, sizeof tb);
        }
        next_group += gs;
        g++;
      }
#pragma GCC unroll 1
      for (int p = 0; p < PF; p++) {
        v8f xk[4];
#pragma GCC unroll 16
        for (int mb = 0; mb < MB; mb++) xk[mb] = splat(x[mb * K + k0 + p]);
#pragma GCC unroll 16
        for (int nb = 0; nb < NB; nb++) {
          v8u q = (tw[nb][j] >> (unsigned)(BITS * p)) & MASK;
          v8f d = __builtin_convertvector((v8i)q, v8f);
          d = sc[nb] * d; /* MLX: scale * w + bias, two roundings */
          d = d + bi[nb];
#pragma GCC unroll 16
          for (int mb = 0; mb < MB; mb++) acc[nb][mb] += xk[mb] * d;
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int nb = 0; nb < NB; nb++)
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; mb++) memcpy(J->y + (m + mb) * N + n + 8 * nb, &acc[nb][mb], sizeof(v8f));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The AVX-512 path: 16 rows in the 16 lanes of a 512-bit vector, the same
 * per-lane statements. On Zen 4 a 512-bit op runs as two 256-bit halves, so
 * the width alone does not pay; what pays is fewer instructions a weight:
 * one op issued does 16 lanes, and at 8 bits a byte comes out of its word
 * with one in-lane byte shuffle (which also zero-extends it) instead of a
 * shift and a mask. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

AI v16f splat16(float v) { return (v16f){v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }

/* out[j] lane r = src[r * stride + j], j < 8, r < 16: the 8x8 transpose
 * above, on rows r and r + 8 in the two 256-bit halves at once */
AI void transpose16x8(const uint32_t* src, int64_t stride, __m512i out[8]) {
  __m512i r[8];
  for (int i = 0; i < 8; i++)
    r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(src + i * stride))),
                              _mm256_loadu_si256((const __m256i*)(src + (i + 8) * stride)), 1);
  __m512 t0 = _mm512_castsi512_ps(_mm512_unpacklo_epi32(r[0], r[1]));
  __m512 t1 = _mm512_castsi512_ps(_mm512_unpackhi_epi32(r[0], r[1]));
  __m512 t2 = _mm512_castsi512_ps(_mm512_unpacklo_epi32(r[2], r[3]));
  __m512 t3 = _mm512_castsi512_ps(_mm512_unpackhi_epi32(r[2], r[3]));
  __m512 t4 = _mm512_castsi512_ps(_mm512_unpacklo_epi32(r[4], r[5]));
  __m512 t5 = _mm512_castsi512_ps(_mm512_unpackhi_epi32(r[4], r[5]));
  __m512 t6 = _mm512_castsi512_ps(_mm512_unpacklo_epi32(r[6], r[7]));
  __m512 t7 = _mm512_castsi512_ps(_mm512_unpackhi_epi32(r[6], r[7]));
  __m512i s0 = _mm512_castps_si512(_mm512_shuffle_ps(t0, t2, 0x44));
  __m512i s1 = _mm512_castps_si512(_mm512_shuffle_ps(t0, t2, 0xEE));
  __m512i s2 = _mm512_castps_si512(_mm512_shuffle_ps(t1, t3, 0x44));
  __m512i s3 = _mm512_castps_si512(_mm512_shuffle_ps(t1, t3, 0xEE));
  __m512i s4 = _mm512_castps_si512(_mm512_shuffle_ps(t4, t6, 0x44));
  __m512i s5 = _mm512_castps_si512(_mm512_shuffle_ps(t4, t6, 0xEE));
  __m512i s6 = _mm512_castps_si512(_mm512_shuffle_ps(t5, t7, 0x44));
  __m512i s7 = _mm512_castps_si512(_mm512_shuffle_ps(t5, t7, 0xEE));
  /* s0's 128-bit lanes: word 0 of rows 0-3, word 4 of rows 0-3, word 0 of rows 8-11, word 4 of rows 8-11 */
  const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  out[0] = _mm512_permutex2var_epi64(s0, lo, s4);
  out[1] = _mm512_permutex2var_epi64(s1, lo, s5);
  out[2] = _mm512_permutex2var_epi64(s2, lo, s6);
  out[3] = _mm512_permutex2var_epi64(s3, lo, s7);
  out[4] = _mm512_permutex2var_epi64(s0, hi, s4);
  out[5] = _mm512_permutex2var_epi64(s1, hi, s5);
  out[6] = _mm512_permutex2var_epi64(s2, hi, s6);
  out[7] = _mm512_permutex2var_epi64(s3, hi, s7);
}

/* value p of every lane's word, as float */
AI v16f unpack16(__m512i w, int p, const int BITS) {
  const uint32_t MASK = (1u << BITS) - 1u;
  const int PF = 32 / BITS;
  __m512i q;
  if (p == PF - 1) q = _mm512_srli_epi32(w, BITS * p);
  else if (p == 0) q = _mm512_and_si512(w, _mm512_set1_epi32((int)MASK));
  else if (BITS == 8) /* byte p of each dword to its low byte, the rest zero: one in-lane shuffle */
    q = _mm512_shuffle_epi8(w, _mm512_or_si512(_mm512_set1_epi32((int)(0x80808000u | (uint32_t)p)),
                                               _mm512_set_epi32(12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0)));
  else q = _mm512_and_si512(_mm512_srli_epi32(w, BITS * p), _mm512_set1_epi32((int)MASK));
  return (v16f)_mm512_cvtepi32_ps(q);
}

/* The scales and biases of group g for rows n .. n + 16, a lane each. */
AI void group16(const job_t* J, int64_t n, int64_t g, v16f* sc, v16f* bi) {
  const int64_t G = J->K / J->gs;
  float ts[16], tb[16];
  for (int r = 0; r < 16; r++) {
    ts[r] = J->s[(n + r) * G + g];
    tb[r] = J->b[(n + r) * G + g];
  }
  memcpy(sc, ts, sizeof ts);
  memcpy(bi, tb, sizeof tb);
}

/* tile16 at M = 1 where groups are whole steps (8 words): the group's
 * scales once, the step unrolled, ~1.1x. */
AI void tile16_m1(const job_t* J, int64_t n, int64_t m, const int BITS) {
  const int PF = 32 / BITS;
  const int64_t K = J->K, KW = K / PF, gs = J->gs, G = K / gs, GW = gs / PF;
  const float* x = J->x + m * K;
  const uint32_t* src = J->w + n * KW;
  const char* ahead = ahead_row(J->w, KW * 4, n, PF_ROWS, 16, J->n1, J->next0, J->next1); /* as in tile16 */
  v16f acc = splat16(0.0f), sc, bi;
  __m512i tw[8];
  for (int64_t g = 0, kw = 0; g < G; g++) {
    group16(J, n, g, &sc, &bi);
    for (const int64_t kend = kw + GW; kw < kend; kw += 8) {
      if (ahead) {
#pragma GCC unroll 8
        for (int l = 0; l < 8; l++) __builtin_prefetch(ahead + 64 * l, 0, 2);
        ahead += 512;
      }
      transpose16x8(src + kw, KW, tw);
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++)
#pragma GCC unroll 16
        for (int p = 0; p < PF; p++) {
          v16f d = unpack16(tw[j], p, BITS);
          d = sc * d; /* MLX: scale * w + bias, two roundings */
          d = d + bi;
          acc += splat16(x[(kw + j) * PF + p]) * d;
        }
    }
  }
  memcpy(J->y + m * J->N + n, &acc, sizeof acc);
}
/* One tile: rows n .. n + 16 of y, rows m .. m + MB of x. One block of 16
 * rows, not several side by side as the 8-row tiles: the whole block's words
 * for 8 k-words and its scales stay in registers (two blocks spill them: a
 * third slower in L2), and one sum a lane is not the limit here. */
AI void tile16(const job_t* J, int64_t n, int64_t m, const int BITS, const int MB) {
  const int PF = 32 / BITS;
  const int64_t K = J->K, KW = K / PF, gs = J->gs, N = J->N;
  const float* x = J->x + m * K;
  const uint32_t* src = J->w + n * KW;
  /* The rows PF_ROWS ahead follow in memory: fetched into L2 in address
     order, a tile's size over a tile's steps, the next tiles start warm; 16
     streams of a few lines each are more than the hardware prefetcher
     follows (measured: half the speed of an L2-resident matrix without it). */
  const char* ahead = ahead_row(J->w, KW * 4, n, PF_ROWS, 16, J->n1, J->next0, J->next1);
  if (MB == 1 && (gs / PF) % 8 == 0) {
    tile16_m1(J, n, m, BITS);
    return;
  }
  v16f acc[4];
  v16f sc = {0}, bi = {0};
  __m512i tw[8];
#pragma GCC unroll 4
  for (int mb = 0; mb < MB; mb++) acc[mb] = splat16(0.0f);
  int64_t next_group = 0, g = 0;
  for (int64_t kw = 0; kw < KW; kw += 8) {
    const int nw = KW - kw < 8 ? (int)(KW - kw) : 8;
    if (ahead) {
#pragma GCC unroll 8
      for (int l = 0; l < 8; l++) __builtin_prefetch(ahead + 64 * l, 0, 2);
      ahead += 512;
    }
    if (nw == 8) {
      transpose16x8(src + kw, KW, tw);
    } else {
      for (int j = 0; j < nw; j++) {
        uint32_t t[16];
        for (int r = 0; r < 16; r++) t[r] = src[r * KW + kw + j];
        memcpy(&tw[j], t, sizeof t);
      }
    }
    for (int j = 0; j < nw; j++) {
      const int64_t k0 = (kw + j) * PF;
      if (k0 == next_group) { /* a new group: its scale and bias for the tile's rows */
        group16(J, n, g, &sc, &bi);
        next_group += gs;
        g++;
      }
#pragma GCC unroll 16
      for (int p = 0; p < PF; p++) {
        v16f d = unpack16(tw[j], p, BITS);
        d = sc * d; /* MLX: scale * w + bias, two roundings */
        d = d + bi;
#pragma GCC unroll 4
        for (int mb = 0; mb < MB; mb++) acc[mb] += splat16(x[mb * K + k0 + p]) * d;
      }
    }
  }
#pragma GCC unroll 4
  for (int mb = 0; mb < MB; mb++) memcpy(J->y + (m + mb) * N + n, &acc[mb], sizeof(v16f));
}
#define HAVE_TILE16 1
#else
#define HAVE_TILE16 0
#endif

/* Rows that do not fill a block of 8: MLX's loop as it is. */
static void rows_scalar(const job_t* J, int bits, int64_t n0, int64_t n1) {
  const int PF = 32 / bits;
  const uint32_t MASK = (1u << bits) - 1u;
  const int64_t K = J->K, KW = K / PF, gs = J->gs, G = K / gs;
  for (int64_t m = 0; m < J->M; m++)
    for (int64_t n = n0; n < n1; n++) {
      const float* x = J->x + m * K;
      float sum = 0.0f;
      for (int64_t k = 0; k < K; k++) {
        float scale = J->s[n * G + k / gs], bias = J->b[n * G + k / gs];
        uint32_t q = (J->w[n * KW + k / PF] >> (bits * (k % PF))) & MASK;
        sum += x[k] * (scale * (float)q + bias);
      }
      J->y[m * J->N + n] = sum;
    }
}

#if HAVE_TILE16
/* A 16-row tile where two blocks of 8 are left (*step = 2 blocks), x's rows
 * four at a time; 0 where not (the 8-row tiles below take it). */
/* Each (bits, rows of x) tile a function of its own: inlined together
 * into one loop the M = 2 tiles ran ~10% slower than alone. */
#define DEFINE_TILE16(BITS, MB) \
  __attribute__((noinline)) static void tile16_##BITS##_##MB(const job_t* J, int64_t n, int64_t m) { tile16(J, n, m, BITS, MB); }
#define DEFINE_TILES16(BITS) DEFINE_TILE16(BITS, 1) DEFINE_TILE16(BITS, 2) DEFINE_TILE16(BITS, 3) DEFINE_TILE16(BITS, 4)
DEFINE_TILES16(2)
DEFINE_TILES16(4)
DEFINE_TILES16(8)

AI int TILE16(const job_t* J, int64_t n, int64_t left, const int BITS, int* step) {
  if (left < 2) return 0;
  static void (*const tiles[3][4])(const job_t*, int64_t, int64_t) = {
      {tile16_2_1, tile16_2_2, tile16_2_3, tile16_2_4},
      {tile16_4_1, tile16_4_2, tile16_4_3, tile16_4_4},
      {tile16_8_1, tile16_8_2, tile16_8_3, tile16_8_4}};
  void (*const* t)(const job_t*, int64_t, int64_t) = tiles[BITS == 2 ? 0 : BITS == 4 ? 1 : 2];
  int64_t m = 0;
  for (; m + 4 <= J->M; m += 4) t[3](J, n, m);
  if (J->M > m) t[J->M - m - 1](J, n, m);
  *step = 2;
  return 1;
}
#else
#define TILE16(J, n, left, BITS, step) 0
#endif

/* Tiles of NB blocks along the job's rows (then single blocks for what is
 * left), MB rows of x at a time (then fewer for what is left). */
#define DEFINE_ROWS(BITS)                                                                        \
  static void rows_##BITS(const job_t* J) {                                                      \
    int64_t n = J->n0;                                                                           \
    const int64_t end = J->n0 + ((J->n1 - J->n0) & ~(int64_t)7);                                 \
    while (n < end) {                                                                            \
      const int64_t left = (end - n) / 8;                                                        \
      int64_t m = 0;                                                                             \
      int step;                                                                                  \
      if (TILE16(J, n, left, BITS, &step)) {                                                     \
        n += 8 * (int64_t)step;                                                                  \
        continue;                                                                                \
      }                                                                                          \
      if (J->M == 1 && left >= 8) {                                                              \
        tile(J, n, 0, BITS, 8, 1);                                                               \
        step = 8;                                                                                \
      } else if (J->M == 2 && left >= 4) {                                                       \
        tile(J, n, 0, BITS, 4, 2);                                                               \
        step = 4;                                                                                \
      } else if (J->M == 3 && left >= 2) {                                                       \
        tile(J, n, 0, BITS, 2, 3);                                                               \
        step = 2;                                                                                \
      } else if (J->M >= 4 && left >= 2) {                                                       \
        for (; m + 4 <= J->M; m += 4) tile(J, n, m, BITS, 2, 4);                                 \
        for (; m < J->M; m++) tile(J, n, m, BITS, 2, 1);                                         \
        step = 2;                                                                                \
      } else {                                                                                   \
        for (; m + 4 <= J->M; m += 4) tile(J, n, m, BITS, 1, 4);                                 \
        for (; m < J->M; m++) tile(J, n, m, BITS, 1, 1);                                         \
        step = 1;                                                                                \
      }                                                                                          \
      n += 8 * (int64_t)step;                                                                    \
    }                                                                                            \
    if (end < J->n1) rows_scalar(J, BITS, end, J->n1);                                           \
  }
DEFINE_ROWS(2)
DEFINE_ROWS(4)
DEFINE_ROWS(8)

static void run_job(const job_t* J, int bits) {
  if (bits == 4) rows_4(J);
  else if (bits == 8) rows_8(J);
  else rows_2(J);
}

/* ---- the threads ----
 *
 * Threads take chunks of CHUNK rows off a shared counter, not fixed shares:
 * on a machine shared with other work one core may be slower than the other,
 * and a fixed split waits for the slower. A row's result does not depend on
 * which thread computes it.
 *
 * The threads are made once and kept (a decode step makes ~200 calls; a
 * pthread_create and join per call cost more than a small matrix's work),
 * woken per call through a condition variable. They do not spin for the
 * next call: on a machine shared with other work a spinning thread takes a
 * core from it (a whole decode step measured ~5-15% slower with a 100 us
 * spin under load 3 on 2 cores, and no faster when quieter). The caller works too and waits only for the
 * chunks to be done, never for a worker to wake: a worker that wakes late
 * finds the counter spent (the call's number is in the counter's high bits,
 * so a late worker cannot take a chunk of the next call). Calls from several
 * threads take turns (a mutex); after fork() the child starts with no workers
 * and makes them again on its first call. */
#define CHUNK 64
#define MAX_THREADS 16

/* fn(ctx, c, next): run chunk c; next is the chunk this thread most likely
 * takes after it (-1: none), where its tiles may prefetch. */
typedef void (*chunk_fn)(const void* ctx, int64_t c, int64_t next);

static struct {
  pthread_mutex_t call; /* one call at a time */
  pthread_mutex_t mu;   /* with wake: workers sleep on it */
  pthread_cond_t wake;
  int workers;      /* started so far */
  int want;         /* workers that take part in this call (index < want) */
  uint32_t gen;     /* the call's number; a change wakes the workers */
  uint64_t counter; /* gen << 40 | front << 20 | back (atomic): chunks [front, back) are left */
  int64_t done; /* chunks finished (atomic) */
  chunk_fn fn;
  const void* ctx;
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

/* Take and run chunks of call `gen` until none is left: the calling thread
 * from the front, the workers from the back. With two threads each walks a
 * run of neighbouring chunks, so the rows it prefetches past its chunk are
 * its own next ones (see ahead_row), and the two still share the work as it
 * comes: a slower core takes fewer chunks. */
#define FIELD 0xFFFFFull /* 20 bits: front and back */
#define GEN_OF(cur) ((uint32_t)((cur) >> 40) & 0xFFFFFFu)
static void take_chunks(uint32_t gen, int from_back) {
  uint64_t cur = __atomic_load_n(&P.counter, __ATOMIC_ACQUIRE);
  for (;;) {
    const int64_t front = (int64_t)((cur >> 20) & FIELD), back = (int64_t)(cur & FIELD);
    if (GEN_OF(cur) != (gen & 0xFFFFFFu) || front >= back) return;
    const int64_t c = from_back ? back - 1 : front;
    const uint64_t want = from_back ? cur - 1 : cur + (1ull << 20);
    if (!__atomic_compare_exchange_n(&P.counter, &cur, want, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
    const int64_t next = from_back ? (c - 1 >= front ? c - 1 : -1) : (c + 1 < back ? c + 1 : -1);
    P.fn(P.ctx, c, next); /* the call waits for this chunk: its fn and ctx stay valid */
    __atomic_fetch_add(&P.done, 1, __ATOMIC_RELEASE);
    cur = __atomic_load_n(&P.counter, __ATOMIC_ACQUIRE);
  }
}

static void* worker(void* arg) {
  const int index = (int)(intptr_t)arg;
  uint32_t seen = 0;
  for (;;) {
    pthread_mutex_lock(&P.mu);
    while (__atomic_load_n(&P.gen, __ATOMIC_ACQUIRE) == seen) pthread_cond_wait(&P.wake, &P.mu);
    seen = __atomic_load_n(&P.gen, __ATOMIC_ACQUIRE);
    pthread_mutex_unlock(&P.mu);
    if (index < __atomic_load_n(&P.want, __ATOMIC_ACQUIRE)) take_chunks(seen, 1);
  }
  return 0;
}

static void at_fork_prepare(void) { pthread_mutex_lock(&P.call); }
static void at_fork_parent(void) { pthread_mutex_unlock(&P.call); }
static void at_fork_child(void) { /* only the forking thread lives on: no workers, fresh locks */
  pthread_mutex_init(&P.call, 0);
  pthread_mutex_init(&P.mu, 0);
  pthread_cond_init(&P.wake, 0);
  P.workers = 0;
}
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void register_fork(void) { pthread_atfork(at_fork_prepare, at_fork_parent, at_fork_child); }

/* fn(ctx, c) for every c in [0, chunks), on up to nthreads threads (this one included). */
static void parallel_for(int64_t chunks, chunk_fn fn, const void* ctx, int nthreads) {
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  if (nthreads > chunks) nthreads = (int)chunks;
  if (nthreads <= 1 || chunks >= (int64_t)FIELD) {
    for (int64_t c = 0; c < chunks; c++) fn(ctx, c, c + 1 < chunks ? c + 1 : -1);
    return;
  }
  pthread_once(&fork_once, register_fork);
  pthread_mutex_lock(&P.call);
  while (P.workers < nthreads - 1) { /* a thread that cannot start leaves its chunks to the others */
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int ok = pthread_create(&th, &attr, worker, (void*)(intptr_t)P.workers) == 0;
    pthread_attr_destroy(&attr);
    if (!ok) break;
    P.workers++;
  }
  P.fn = fn;
  P.ctx = ctx;
  __atomic_store_n(&P.done, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&P.want, nthreads - 1, __ATOMIC_RELAXED);
  const uint32_t gen = P.gen + 1;
  __atomic_store_n(&P.counter, (uint64_t)(gen & 0xFFFFFFu) << 40 | (uint64_t)chunks, __ATOMIC_RELEASE);
  pthread_mutex_lock(&P.mu);
  __atomic_store_n(&P.gen, gen, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&P.wake);
  pthread_mutex_unlock(&P.mu);
  take_chunks(gen, 0);
  /* the chunks others took are under way: short waits */
  while (__atomic_load_n(&P.done, __ATOMIC_ACQUIRE) < chunks) {
#if defined(__SSE2__)
    _mm_pause();
#endif
  }
  /* spent for good (front past back): a worker still holding this call's
     last counter value cannot take a chunk once the next call's fields are written */
  __atomic_store_n(&P.counter, (uint64_t)(gen & 0xFFFFFFu) << 40 | FIELD << 20, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&P.call);
}

typedef struct {
  job_t base;
  int bits;
  int64_t chunks;
} qmm_ctx_t;

/* chunk c's rows: CHUNK each, the last also the rows past the last whole chunk */
AI int64_t chunk_end(int64_t c, int64_t chunks, int64_t N, int64_t size) { return c == chunks - 1 ? N : (c + 1) * size; }

/* the rows [*next0, *next1) of chunk `next` (-1, -1: none), where a chunk's last tiles prefetch */
AI void next_rows(int64_t next, int64_t chunks, int64_t N, int64_t size, int64_t* next0, int64_t* next1) {
  *next0 = next < 0 ? -1 : next * size;
  *next1 = next < 0 ? -1 : chunk_end(next, chunks, N, size);
}

static void qmm_chunk(const void* a, int64_t c, int64_t next) {
  const qmm_ctx_t* p = a;
  job_t j = p->base;
  j.n0 = c * CHUNK;
  j.n1 = chunk_end(c, p->chunks, p->base.N, CHUNK);
  next_rows(next, p->chunks, p->base.N, CHUNK, &j.next0, &j.next1);
  run_job(&j, p->bits);
}

/* The entry point. x: M x K, w: N x K*bits/32 words, scales and biases: N x
 * K/group_size, y: M x N, all C-contiguous. Returns 0, or -1 for what it does
 * not handle (bits other than 2, 4, 8; K not whole groups; a group not whole
 * words). Up to `nthreads` threads. */
int qmm_t(float* y, const float* x, const uint32_t* w, const float* scales, const float* biases, int64_t M,
          int64_t N, int64_t K, int bits, int group_size, int nthreads) {
  if ((bits != 2 && bits != 4 && bits != 8) || group_size <= 0 || K % group_size || group_size % (32 / bits))
    return -1;
  if (M <= 0 || N <= 0) return 0;
  qmm_ctx_t ctx = {{y, x, w, scales, biases, M, N, K, group_size, 0, N, -1, -1}, bits, N / CHUNK > 0 ? N / CHUNK : 1};
  if (nthreads <= 1 || ctx.chunks == 1) {
    run_job(&ctx.base, bits);
    return 0;
  }
  parallel_for(ctx.chunks, qmm_chunk, &ctx, nthreads);
  return 0;
}

/* ---- dequantize: the layer's weight as float32, bit for bit mx.dequantize ----
 *
 * For prefill-sized calls (many rows of x) a float32 GEMM on the dequantized
 * weight beats the kernel above (engine.mlx.qmm_linear picks by rows; the
 * threshold's measurement is there). MLX's CPU dequantize computes each
 * value as scale * q + bias, two roundings (checked against mx.dequantize
 * in tests/engine/test_qmm_kernel.py); so does this, 16 values a vector:
 * the words holding 16 consecutive values are loaded, each lane picks its
 * word (a constant permute) and shifts out its own bits. Threads take
 * chunks of rows, as above; a value does not depend on the split. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

AI void dq_row(float* out, const uint32_t* w, const float* s, const float* b, int64_t K, int64_t gs, const int BITS) {
  const int PF = 32 / BITS, WPV = 16 / PF; /* values a word, words a vector of 16 values */
  const uint32_t MASK = (1u << BITS) - 1u;
  v16u idx, sh;
  for (int i = 0; i < 16; i++) {
    idx[i] = (uint32_t)(i / PF);
    sh[i] = (uint32_t)(BITS * (i % PF));
  }
  const int64_t G = K / gs;
  for (int64_t g = 0; g < G; g++) {
    const float sc = s[g], bi = b[g];
    const v16f S = {sc, sc, sc, sc, sc, sc, sc, sc, sc, sc, sc, sc, sc, sc, sc, sc};
    const v16f B = {bi, bi, bi, bi, bi, bi, bi, bi, bi, bi, bi, bi, bi, bi, bi, bi};
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
      v16u t = {0};
      memcpy(&t, w + k / PF, (size_t)WPV * sizeof(uint32_t));
      v16u q = (__builtin_shuffle(t, idx) >> sh) & MASK;
      v16f d = S * __builtin_convertvector((v16i)q, v16f); /* MLX: scale * w + bias, two roundings */
      d = d + B;
      memcpy(out + k, &d, sizeof d);
    }
  }
}

/* A group that is not whole vectors of 16 (no MLX group size is): MLX's expression, one value at a time. */
static void dq_row_scalar(float* out, const uint32_t* w, const float* s, const float* b, int64_t K, int64_t gs, int bits) {
  const int PF = 32 / bits;
  const uint32_t MASK = (1u << bits) - 1u;
  for (int64_t k = 0; k < K; k++) {
    uint32_t q = (w[k / PF] >> (bits * (k % PF))) & MASK;
    out[k] = s[k / gs] * (float)q + b[k / gs];
  }
}

typedef struct {
  float* out;
  const uint32_t* w;
  const float* s;
  const float* b;
  int64_t N, K, gs;
  int bits;
  int64_t chunks;
} dq_ctx_t;

static void dq_chunk(const void* a, int64_t c, int64_t next) {
  (void)next;
  const dq_ctx_t* p = a;
  const int64_t KW = p->K * p->bits / 32, G = p->K / p->gs;
  const int64_t n0 = c * CHUNK, n1 = chunk_end(c, p->chunks, p->N, CHUNK);
  for (int64_t n = n0; n < n1; n++) {
    float* o = p->out + n * p->K;
    const uint32_t* w = p->w + n * KW;
    const float *s = p->s + n * G, *b = p->b + n * G;
    if (p->gs % 16) dq_row_scalar(o, w, s, b, p->K, p->gs, p->bits);
    else if (p->bits == 8) dq_row(o, w, s, b, p->K, p->gs, 8);
    else if (p->bits == 4) dq_row(o, w, s, b, p->K, p->gs, 4);
    else dq_row(o, w, s, b, p->K, p->gs, 2);
  }
}

/* out (N x K float32) = dequantize(w, scales, biases) as mx.dequantize
 * computes it (affine); the same shapes and refusals as qmm_t. */
int dequantize(float* out, const uint32_t* w, const float* scales, const float* biases, int64_t N, int64_t K, int bits,
               int group_size, int nthreads) {
  if ((bits != 2 && bits != 4 && bits != 8) || group_size <= 0 || K % group_size || group_size % (32 / bits))
    return -1;
  if (N <= 0 || K <= 0) return 0;
  dq_ctx_t ctx = {out, w, scales, biases, N, K, group_size, bits, N / CHUNK > 0 ? N / CHUNK : 1};
  parallel_for(ctx.chunks, dq_chunk, &ctx, nthreads);
  return 0;
}

/* ---- the integer dot path: 8-bit weights against x rounded to int16 ----
 *
 * Not MLX's arithmetic, and not bit for bit: the same product with x rounded
 * to int16, for decode where the exact loop above is bound by its arithmetic
 * (a multiply and two adds a weight in MLX's order, one dependent sum a lane)
 * rather than by the bytes it reads. Per group g of a row n:
 *
 *     y[m][n] += scale[n][g] * (xs[m][g] * sum_k q[n][k] * x16[m][k]) + bias[n][g] * sx[m][g]
 *
 * where x16 is x rounded to int16 with one scale xs a group of x (max |x| /
 * 32767, round to nearest even), and sx is the exact float sum of x over the
 * group, so the bias term loses nothing. The integer sums run on AVX-512
 * VNNI's vpdpwssd (two int16 products a 32-bit lane): a packed word's four
 * weight bytes become two int16 pairs by one mask and one shift-and-mask.
 *
 * Why int16 and not int8 (vpdpbusd, one instruction for 64 weights, ~1.4x
 * faster at one row): x rounded to int8 (~0.5% error a product) turns a
 * last-bit difference in x into a ~1/127 step of one of its values. A verify
 * forward's attention sums in another order than a one-token step's, so its
 * x differs from the step's in the last bits; through 28 layers of int8
 * rounding that was enough to change greedy tokens (the real pair at
 * gamma = 3: 0 of 2 rounds identical to plain decode). Rounded to int16
 * (~1e-5 a product) the step is 256x finer. Its cost in quality is measured
 * by python -m bench.cpu.weight_format (q8dot). Bits 8 only, groups of 32,
 * 64 or 128, a CPU with AVX-512 VNNI; otherwise qmm_t_dot returns -1 and the
 * caller keeps the exact kernel. A row's result does not depend on the other
 * rows of the call (the integer sums are exact in any order). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MAX_GW 32      /* words of a group: groups up to 128, so a group's int32 sum stays < 2^31 */
#define DOT_M_BLOCK 32 /* rows of x a pass over a chunk's weights */
typedef struct {
  job_t base;
  const int16_t* x16; /* M x K: x rounded to int16 a group */
  const int32_t* xp;  /* M x K/2: x16's pairs as dot16 takes them */
  const float* xs;    /* M x G: a group's scale of x16 */
  const float* sx;    /* M x G: x's exact sum over the group */
  int64_t chunks;
} dot_ctx_t;

/* Rows n .. n + 16 of y, rows m .. m + MB of x: the block's words for 8
 * k-words transposed (lane r of word-vector j = row r's word j) and used by
 * the MB rows of x, each row's sums in registers. A row of x gets the same
 * operations in the same order whatever MB and M are (the integer sums are
 * exact in any order), so its result does not depend on the batch. */
AI void dot16(const dot_ctx_t* D, int64_t n, int64_t m, const char* ahead, const int MB) {
  const job_t* J = &D->base;
  const int64_t K = J->K, KW = K / 4, gs = J->gs, G = K / gs, GW = gs / 4;
  const uint32_t* src = J->w + n * KW;
  const __m512i lo = _mm512_set1_epi32(0x00FF00FF);
  __m512 acc[4];
  __m512i tw[8];
  v16f sc, bi;
#pragma GCC unroll 4
  for (int mb = 0; mb < MB; mb++) acc[mb] = _mm512_setzero_ps();
  for (int64_t g = 0, kw = 0; g < G; g++) {
    group16(J, n, g, &sc, &bi);
    __m512i a[4][2];
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; mb++) a[mb][0] = a[mb][1] = _mm512_setzero_si512();
    for (const int64_t kend = kw + GW; kw < kend; kw += 8) {
      if (ahead) { /* as in tile16 */
#pragma GCC unroll 8
        for (int l = 0; l < 8; l++) __builtin_prefetch(ahead + 64 * l, 0, 2);
        ahead += 512;
      }
      transpose16x8(src + kw, KW, tw);
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++) {
        /* a word's 4 bytes (k .. k + 3) as two int16 pairs: (k, k + 2) and (k + 1, k + 3) */
        const __m512i w02 = _mm512_and_si512(tw[j], lo), w13 = _mm512_and_si512(_mm512_srli_epi32(tw[j], 8), lo);
#pragma GCC unroll 4
        for (int mb = 0; mb < MB; mb++) {
          const int32_t* xp = D->xp + (m + mb) * (K / 2) + 2 * (kw + j);
          a[mb][0] = _mm512_dpwssd_epi32(a[mb][0], w02, _mm512_set1_epi32(xp[0]));
          a[mb][1] = _mm512_dpwssd_epi32(a[mb][1], w13, _mm512_set1_epi32(xp[1]));
        }
      }
    }
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; mb++) {
      const int64_t i = (m + mb) * G + g;
      /* sum q x16 (|.| < 2^31: 128 x 255 x 32767), then to float: one rounding */
      const __m512 c = _mm512_cvtepi32_ps(_mm512_add_epi32(a[mb][0], a[mb][1]));
      acc[mb] = _mm512_fmadd_ps((__m512)sc, _mm512_mul_ps(c, _mm512_set1_ps(D->xs[i])), acc[mb]);
      acc[mb] = _mm512_fmadd_ps((__m512)bi, _mm512_set1_ps(D->sx[i]), acc[mb]);
    }
  }
#pragma GCC unroll 4
  for (int mb = 0; mb < MB; mb++) _mm512_storeu_ps(J->y + (m + mb) * J->N + n, acc[mb]);
}
__attribute__((noinline)) static void dot16_1(const dot_ctx_t* D, int64_t n, int64_t m, const char* ahead) {
  dot16(D, n, m, ahead, 1);
}
__attribute__((noinline)) static void dot16_2(const dot_ctx_t* D, int64_t n, int64_t m, const char* ahead) {
  dot16(D, n, m, ahead, 2);
}
__attribute__((noinline)) static void dot16_3(const dot_ctx_t* D, int64_t n, int64_t m, const char* ahead) {
  dot16(D, n, m, ahead, 3);
}
__attribute__((noinline)) static void dot16_4(const dot_ctx_t* D, int64_t n, int64_t m, const char* ahead) {
  dot16(D, n, m, ahead, 4);
}

/* A row past the last block of 16: the same sums, one row at a time. */
static void dot_row(const dot_ctx_t* D, int64_t n, int64_t m) {
  const job_t* J = &D->base;
  const int64_t K = J->K, gs = J->gs, G = K / gs;
  const uint8_t* q = (const uint8_t*)(J->w + n * (K / 4));
  const int16_t* x16 = D->x16 + m * K;
  float acc = 0.0f;
  for (int64_t g = 0; g < G; g++) {
    int32_t s = 0;
    for (int64_t k = g * gs; k < (g + 1) * gs; k++) s += (int32_t)q[k] * (int32_t)x16[k];
    const int64_t i = m * G + g;
    acc += J->s[n * G + g] * ((float)s * D->xs[i]) + J->b[n * G + g] * D->sx[i];
  }
  J->y[m * J->N + n] = acc;
}

/* A chunk of CHUNK weight rows, x's rows DOT_M_BLOCK at a time: the chunk's
 * weights (CHUNK x K bytes) stay in L2 while each block of x's rows passes
 * over them. */
static void dot_chunk(const void* a, int64_t c, int64_t next) {
  const dot_ctx_t* D = a;
  const int64_t N = D->base.N, M = D->base.M, KW = D->base.K / 4;
  const int64_t n0 = c * CHUNK, n1 = chunk_end(c, D->chunks, N, CHUNK);
  int64_t next0, next1;
  next_rows(next, D->chunks, N, CHUNK, &next0, &next1);
  for (int64_t m0 = 0; m0 < M; m0 += DOT_M_BLOCK) {
    const int64_t m1 = M - m0 < DOT_M_BLOCK ? M : m0 + DOT_M_BLOCK;
    int64_t n = n0;
    for (; n + 16 <= n1; n += 16) {
      /* the first pass over the tile's weights prefetches; later ones find them in L2 */
      const char* ahead = m0 == 0 ? ahead_row(D->base.w, KW * 4, n, PF_ROWS, 16, n1, next0, next1) : 0;
      int64_t m = m0;
      for (; m + 4 <= m1; m += 4, ahead = 0) dot16_4(D, n, m, ahead);
      if (m1 - m == 3) dot16_3(D, n, m, ahead);
      else if (m1 - m == 2) dot16_2(D, n, m, ahead);
      else if (m1 - m == 1) dot16_1(D, n, m, ahead);
    }
    for (; n < n1; n++)
      for (int64_t m = m0; m < m1; m++) dot_row(D, n, m);
  }
}

/* x's rows rounded to int16 a group (scale max|x| / 32767, nearest even), the
 * same values in dot16's pair order, each group's scale, and its exact sum. */
static void quantize_x(const float* x, int64_t M, int64_t K, int64_t gs, int16_t* x16, int32_t* xp, float* xs,
                       float* sx) {
  const int64_t G = K / gs;
  /* within each 4 values k .. k + 3: k, k + 2, k + 1, k + 3 (the pairs dot16 multiplies) */
  const __m512i order = _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17, 18, 16, 15, 13, 14,
                                         12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0);
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < G; g++) {
      const float* xg = x + m * K + g * gs;
      float amax = 0.0f, sum = 0.0f;
      for (int64_t k = 0; k < gs; k++) {
        const float v = xg[k], a = v < 0 ? -v : v;
        amax = a > amax ? a : amax;
        sum += v;
      }
      xs[m * G + g] = amax / 32767.0f;
      sx[m * G + g] = sum;
      const __m512 inv = _mm512_set1_ps(amax > 0 ? 32767.0f / amax : 0.0f);
      int16_t* out = x16 + m * K + g * gs;
      for (int64_t k = 0; k < gs; k += 32) {
        const __m256i r0 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + k), inv)));
        const __m256i r1 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + k + 16), inv)));
        const __m512i r = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
        _mm512_storeu_si512(out + k, r);
        _mm512_storeu_si512(xp + m * (K / 2) + (g * gs + k) / 2, _mm512_permutexvar_epi16(order, r));
      }
    }
}
#define HAVE_DOT 1
#else
#define HAVE_DOT 0
#endif

/* The entry point of the integer dot path: qmm_t's arguments (bits must be 8).
 * Returns 0, or -1 where the path does not apply (then call qmm_t). */
int qmm_t_dot(float* y, const float* x, const uint32_t* w, const float* scales, const float* biases, int64_t M,
              int64_t N, int64_t K, int bits, int group_size, int nthreads) {
#if HAVE_DOT
  if (bits != 8 || group_size <= 0 || K % group_size || group_size % 32 || group_size > 4 * MAX_GW || M <= 0)
    return -1;
  if (N <= 0) return 0;
  const int64_t G = K / group_size;
  int16_t* x16 = malloc((size_t)(M * K) * sizeof(int16_t));
  int32_t* xp = malloc((size_t)(M * K / 2) * sizeof(int32_t));
  float* xf = malloc((size_t)(2 * M * G) * sizeof(float));
  if (!x16 || !xp || !xf) {
    free(x16);
    free(xp);
    free(xf);
    return -1;
  }
  quantize_x(x, M, K, group_size, x16, xp, xf, xf + M * G);
  dot_ctx_t ctx = {{y, x, w, scales, biases, M, N, K, group_size, 0, N, -1, -1}, x16, xp, xf, xf + M * G,
                   N / CHUNK > 0 ? N / CHUNK : 1};
  parallel_for(ctx.chunks, dot_chunk, &ctx, nthreads); /* one thread or one chunk: here, in order */
  free(x16);
  free(xp);
  free(xf);
  return 0;
#else
  (void)y, (void)x, (void)w, (void)scales, (void)biases, (void)M, (void)N, (void)K, (void)bits, (void)group_size,
      (void)nthreads;
  return -1;
#endif
}

/* 1 where qmm_t_dot can run on this build (AVX-512 VNNI), else 0. */
int qmm_t_dot_available(void) { return HAVE_DOT; }

/* ---- fmm_t: y = x @ w^T for a float32 weight, few rows of x ----
 *
 * Why: at decode a float32 layer reads its whole weight for one to a few
 * rows of x. MLX hands that to OpenBLAS's sgemm, which here reads SmolLM2's
 * decode weights at ~11 GB/s (one row) and ~8 GB/s (eight) against the ~25
 * GB/s two cores stream (python -m bench.cpu.fmm): its packing and blocking
 * are built for large matrices. This streams each weight row once, from
 * memory into registers, against up to 8 rows of x held in L1: MR rows of x
 * times NR weight rows of accumulators, 16 lanes of k each, reduced once at
 * the end. Not OpenBLAS's summation order, so not its bits (~1e-7 relative;
 * tests/engine/test_fmm_kernel.py bounds it): engine.mlx.qmm_linear states
 * the switch (``EMBER_FMM=0``, ``ember serve --no-fmm-kernel``) that keeps
 * MLX's. Threads split the weight rows, as above; a row's result does not
 * depend on the split or on the other rows of x. */
#ifndef FPF
#define FPF 2 /* prefetch the weight rows this many tiles ahead */
#endif
#define FCHUNK 32 /* weight rows a chunk: 32 x K floats stay in L2 for M > 8 */

typedef struct {
  float* y;
  const float* x;
  const float* w;
  int64_t M, N, K, chunks;
} fmm_ctx_t;

#if defined(__AVX512F__)
/* y[m][r] for m < MR (rows of x from x0), r < NR (weight rows from w0). */
AI void fmm_tile(const float* x0, const float* w0, float* y0, int64_t N, int64_t K, const char* ahead, const int MR,
              const int NR) {
  /* Fixed sizes, not [NR][MR]: with MR and NR parameters these were variable
     length arrays, which GCC keeps on the stack even once MR and NR are
     constants: every FMA loaded and stored its accumulator (8 rows of x ran
     at ~7 GB/s a core). Fixed arrays, indexed by constants once unrolled,
     live in registers. */
  __m512 acc[8][8];
#pragma GCC unroll 8
  for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[8];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++) {
      if (ahead) _mm_prefetch(ahead + (r * K + k) * 4, _MM_HINT_T0);
      wv[r] = _mm512_loadu_ps(w0 + r * K + k);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++) {
      const __m512 xv = _mm512_loadu_ps(x0 + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < NR; r++) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  if (k < K) { /* K not a multiple of 16: the last lanes masked */
    const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);
    __m512 wv[8];
#pragma GCC unroll 8
    for (int r = 0; r < NR; r++) wv[r] = _mm512_maskz_loadu_ps(mask, w0 + r * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x0 + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < NR; r++) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++) y0[m * N + r] = _mm512_reduce_add_ps(acc[r][m]);
}

/* Weight rows [n0, n1) against MR rows of x: NR rows a tile (registers: NR*MR
 * accumulators + NR weights + 1 x of 32), then single rows for the rest; the
 * rows FPF tiles ahead prefetched (into the rows [next0, next1) this thread
 * takes next, past n1: ahead_row), where pf is set. */
#define FMM_ROWS(MR, NR)                                                                                  \
  static void fmm_rows_##MR(const float* x0, const float* w, float* y0, int64_t N, int64_t K, int64_t n0,  \
                            int64_t n1, int pf, int64_t next0, int64_t next1) {                           \
    int64_t n = n0;                                                                                       \
    for (; n + NR <= n1; n += NR)                                                                         \
      fmm_tile(x0, w + n * K, y0 + n, N, K, pf ? ahead_row(w, K * 4, n, FPF * NR, NR, n1, next0, next1) : 0, \
               MR, NR);                                                                                   \
    for (; n < n1; n++) fmm_tile(x0, w + n * K, y0 + n, N, K, 0, MR, 1);                                 \
  }
FMM_ROWS(1, 8)
FMM_ROWS(2, 6)
FMM_ROWS(3, 6)
FMM_ROWS(4, 4)
FMM_ROWS(5, 4)
FMM_ROWS(6, 3)
FMM_ROWS(7, 3)
FMM_ROWS(8, 3)
typedef void (*fmm_rows_fn)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int, int64_t,
                            int64_t);
static const fmm_rows_fn fmm_rows[9] = {0, fmm_rows_1, fmm_rows_2, fmm_rows_3, fmm_rows_4,
                                        fmm_rows_5, fmm_rows_6, fmm_rows_7, fmm_rows_8};
#define HAVE_FMM 1
#else
#define HAVE_FMM 0
#endif

static void fmm_chunk(const void* a, int64_t c, int64_t next) {
#if HAVE_FMM
  const fmm_ctx_t* p = a;
  const int64_t n0 = c * FCHUNK, n1 = chunk_end(c, p->chunks, p->N, FCHUNK);
  int64_t next0, next1;
  next_rows(next, p->chunks, p->N, FCHUNK, &next0, &next1);
  for (int64_t m = 0; m < p->M; m += 8) {
    const int mr = p->M - m < 8 ? (int)(p->M - m) : 8;
    fmm_rows[mr](p->x + m * p->K, p->w, p->y + m * p->N, p->N, p->K, n0, n1, m == 0, next0, next1);
  }
#else
  (void)a, (void)c, (void)next;
#endif
}

/* The entry point: y (M x N) = x (M x K) @ w^T, w (N x K), all C-contiguous
 * float32. Returns 0, or -1 where this build has no kernel (no AVX-512). */
int fmm_t(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K, int nthreads) {
  if (!HAVE_FMM || M < 0 || N < 0 || K <= 0) return -1;
  if (M == 0 || N == 0) return 0;
  fmm_ctx_t ctx = {y, x, w, M, N, K, N / FCHUNK > 0 ? N / FCHUNK : 1};
  parallel_for(ctx.chunks, fmm_chunk, &ctx, nthreads); /* one thread or one chunk: here, in order */
  return 0;
}

/* 1 where fmm_t can run on this build (AVX-512), else 0. */
int fmm_t_available(void) { return HAVE_FMM; }

/* ---- the bandwidth probe's reader ----
 *
 * n bytes read 256 at a time with nothing but an xor per load, so the loads
 * are the only limit (bench.cpu.weight_format's floor: a numpy sum, which
 * adds floats, read ~24 GB/s on two cores of a host where this reads ~30). */
uint64_t stream_read(const void* p, int64_t n) {
  const uint8_t* b = p;
  uint64_t acc = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(b + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(b + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(b + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(b + i + 192));
  }
  a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  uint64_t lanes[8];
  _mm512_storeu_si512(lanes, a0);
  for (int l = 0; l < 8; l++) acc ^= lanes[l];
#endif
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    memcpy(&v, b + i, 8);
    acc ^= v;
  }
  for (; i < n; i++) acc ^= b[i];
  return acc;
}
