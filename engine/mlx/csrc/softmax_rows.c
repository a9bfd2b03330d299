/* Softmax over the rows of a float32 matrix, in place, bit for bit MLX's CPU
 * softmax (mlx/backend/cpu/softmax.cpp at MLX 0.32, precise or not: float32
 * accumulates in float32), but vectorized.
 *
 * Why: on Linux MLX's CPU backend has no SIMD type (simd/base_simd.h, N = 1),
 * so its exp runs the Cephes polynomial one element at a time through fmaf
 * calls, ~17 ns an element here, and the softmax is most of a long-context
 * prefill (issue #32). The same polynomial, the same fmaf (exactly rounded on
 * every machine), the same order of the row's sum, compiled with the
 * vectorizer on: ~2.4 ns an element on one core. Built at run time by
 * engine.mlx.softmax_kernel with -ffp-contract=off (a contracted a*b+c would
 * round differently) and without -ffast-math (it would reorder the sums).
 *
 * causal: rows are queries of a (rows/L) x L block each; row i of a block sees
 * keys 0..offset+i (MLX's where(mask, scores, finfo.min) gives the others an
 * exp of exactly 0 and leaves the maximum alone; see mask_causal).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>

/* mlx/backend/cpu/simd/math.h exp<float, 1>, statement for statement. */
static inline float mlx_exp(float x_init) {
  float x = x_init * 1.442695f;
  float ipart = (float)floor((double)x + 0.5);
  float fpart = x - ipart;
  x = 1.535336188319500e-4f;
  x = fmaf(x, fpart, 1.339887440266574e-3f);
  x = fmaf(x, fpart, 9.618437357674640e-3f);
  x = fmaf(x, fpart, 5.550332471162809e-2f);
  x = fmaf(x, fpart, 2.402264791363012e-1f);
  x = fmaf(x, fpart, 6.931472028550421e-1f);
  x = fmaf(x, fpart, 1.000000000000000f);
  int32_t e = ((int32_t)ipart + 127) << 23;
  float p2; memcpy(&p2, &e, 4);
  float r = x_init != x_init ? x_init : p2 * x;
  r = x_init > 88.0f ? INFINITY : r;
  r = x_init < -88.0f ? 0.0f : r;
  return r;
}

static float row_max(const float* p, int64_t cols) {
  // any order gives the same maximum (a NaN anywhere is handled apart)
  float m[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
  int nan = 0;
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8)
    for (int k = 0; k < 8; k++) { float v = p[j + k]; nan |= v != v; m[k] = v > m[k] ? v : m[k]; }
  float r = -INFINITY;
  for (int k = 0; k < 8; k++) r = m[k] > r ? m[k] : r;
  for (; j < cols; j++) { float v = p[j]; nan |= v != v; r = v > r ? v : r; }
  if (nan) {  // MLX's own order: the first NaN wins
    r = -INFINITY;
    for (j = 0; j < cols; j++) { float v = p[j]; r = (v != v) ? v : (v > r ? v : r); }
  }
  return r;
}

/* MLX's causal mask, where(q_idx >= k_idx, scores, finfo.min), on rows r0..r1. */
static void mask_causal(float* data, int64_t r0, int64_t r1, int64_t cols, int64_t L, int64_t offset) {
  for (int64_t r = r0; r < r1; r++) {
    int64_t vis = offset + r % L + 1;
    if (vis < 0) vis = 0;
    float* p = data + r * cols;
    for (int64_t j = vis; j < cols; j++) p[j] = -FLT_MAX;
  }
}

static void rows_block(float* data, int64_t r0, int64_t r1, int64_t cols, int64_t L, int64_t offset) {
  if (L > 0) mask_causal(data, r0, r1, cols, L, offset);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    float* p[4];
    for (int k = 0; k < 4; k++) {
      p[k] = data + (r + k) * cols;
      float m = row_max(p[k], cols);
      float* q = p[k];
      for (int64_t j = 0; j < cols; j++) q[j] = mlx_exp(q[j] - m);
    }
    // four rows at once: each row's sum is still in MLX's order, one element after another
    float *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3];
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    for (int64_t j = 0; j < cols; j++) { s0 += p0[j]; s1 += p1[j]; s2 += p2[j]; s3 += p3[j]; }
    float s[4] = {s0, s1, s2, s3};
    for (int k = 0; k < 4; k++) {
      float inv = 1 / s[k];
      float* q = p[k];
      for (int64_t j = 0; j < cols; j++) q[j] *= inv;
    }
  }
  for (; r < r1; r++) {
    float* q = data + r * cols;
    float m = row_max(q, cols);
    for (int64_t j = 0; j < cols; j++) q[j] = mlx_exp(q[j] - m);
    float s = 0.0f;
    for (int64_t j = 0; j < cols; j++) s += q[j];
    float inv = 1 / s;
    for (int64_t j = 0; j < cols; j++) q[j] *= inv;
  }
}
typedef struct { float* d; int64_t r0, r1, cols, L, offset; } job_t;
static void* run(void* a) { job_t* j = a; rows_block(j->d, j->r0, j->r1, j->cols, j->L, j->offset); return 0; }
/* The entry point: softmax of each of `rows` rows of `cols` floats at `data`,
 * in place, on up to `nthreads` threads (whole rows each, so any split gives
 * the same bits). L > 0 applies the causal mask first (see the top). */
void softmax_rows(float* data, int64_t rows, int64_t cols, int64_t L, int64_t offset, int nthreads) {
  if (nthreads <= 1 || rows < 2) { rows_block(data, 0, rows, cols, L, offset); return; }
  if (nthreads > 16) nthreads = 16;
  if (nthreads > rows) nthreads = (int)rows;
  pthread_t th[16]; job_t jobs[16];
  for (int t = 0; t < nthreads; t++) { jobs[t].d = data; jobs[t].r0 = rows * t / nthreads; jobs[t].r1 = rows * (t + 1) / nthreads; jobs[t].cols = cols; jobs[t].L = L; jobs[t].offset = offset; }
  int started[16] = {0};
  for (int t = 1; t < nthreads; t++) started[t] = pthread_create(&th[t], 0, run, &jobs[t]) == 0;
  run(&jobs[0]);
  for (int t = 1; t < nthreads; t++) {
    if (started[t]) pthread_join(th[t], 0);
    else run(&jobs[t]);  /* no thread to be had: this one does those rows too */
  }
}
