/*
 * Weight and bias gradients of a dense layer from sample-major operands (AVX-512, or
 * AVX2 + FMA where a CPU or its hypervisor offers no AVX-512):
 *
 *     dw[o, i] = sum_{b < batch} g[b, o] * x[b, i]           dw  [out, in], row stride lddw
 *     db[o]    = sum_{b < batch} g[b, o]                     db  [out] (skipped when NULL)
 *     xs[i]    = sum_{b < batch} x[b, i]                     xs  [in]  (skipped when NULL)
 *
 * xs is for a narrow input (13 -> 512): the caller swaps the operands, dw^T = x^T g, so
 * the kernel's tiles run over the 512 side (13 columns would fill 13 of 16 lanes and
 * make the kernel load-bound), and the bias gradient is then the swapped x's sum.
 *
 * g [batch, out] (row stride ldg) is the gradient of the layer's output, x [batch, in]
 * (row stride ldx) its input; both are read as the step made them, samples in rows.
 * The results are written, not accumulated. Threads split the outputs: pass g + o0,
 * dw + o0 * lddw, db + o0 and out = o1 - o0 (gemm.weight_grad cuts at multiples of MR).
 *
 * Why not torch.mm(g.t(), x): that is MKL's sgemm with A transposed and K = the batch,
 * 150-175 GFLOP/s on config A's layers (2-core Zen 4), where oneDNN runs the same FLOPs
 * at 205-220 but only from g^T laid out feature-major (a transposed copy of g costs what
 * it saves). And the bias gradient, a separate pass over g in torch, comes free here
 * while g's rows are packed.
 *
 * Blocking (the usual GEMM scheme, with K = the batch): per block of KC = 64 samples,
 * g's columns are packed in tiles of MR = 6 outputs ([tile][k][6]: the micro-kernel
 * reads 6 consecutive floats per sample and broadcasts each) and x's in blocks of 64
 * inputs ([block][k][64], zero past `in`). The micro-kernel keeps a 6 x 64 tile of dw in
 * 24 zmm registers: per sample 4 loads, 6 broadcasts and 24 FMAs - FMA-bound (116
 * GFLOP/s a core alone; the whole product 100-107 on one thread, packing included).
 * KC = 64 keeps a packed block of x (16 KB) in the L1 beside g's tile: isolated 1-3%
 * faster than 128 at configs A and B's layers (e.g. 1024 -> 1024 on 2 threads 21.4 ->
 * 20.8 ms), in the step A 37.83 -> 37.28, 40.34 -> 39.67 ms and B 167.1 -> 164.8,
 * 163.1 -> 161.8 ms A/B in one process (one A pair of four the other way, in noise).
 *
 * AVX2 (16 ymm registers): the classic 6 x 16 tile - 12 accumulators, 2 loads of x and
 * 6 broadcasts of g per sample for 12 FMAs, blocks of NB = 16 inputs, KC = 64 too (256
 * measured level: config A's step 47.96 against 48.19 ms median, alternating steps). It
 * is for a host that hides AVX-512 (a 2-core EPYC VM, family 25): there MKL's AVX2
 * sgemm is close (isolated within noise of it), but in config A's step this kernel won
 * 78 of 120 alternating steps, median 50.71 -> 49.52 ms - the bias sum folded into the
 * packing, and the operands read in place. The blocked driver is shared
 * (weight_grad_driver.h, included once per width).
 */
#include <stdint.h>

#include "recscale_native.h"
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RS_AVX512 __attribute__((target("avx512f")))
#define RS_AVX2 __attribute__((target("avx2,fma")))
#define MR 6
#define WG_CAT_(a, b) a##b
#define WG_CAT(a, b) WG_CAT_(a, b)
#ifndef KC
#define KC 64
#endif
#include "weight_grad_tile.h"

/* c[r, j] (row stride ldc; rows x cols valid) = or += the 6 x (16 nq) tile
 * sum_k gp[k, r] xp[k, j] (xp rows of 64); nq is a constant at each call site. */
RS_AVX512 static inline __attribute__((always_inline)) void
micro512(const int nq, int64_t kc, const float *restrict gp, const float *restrict xp,
         float *restrict c, int64_t ldc, int64_t rows, int64_t cols, int accumulate) {
    __m512 a[MR][4];
    for (int r = 0; r < MR; ++r)
        for (int q = 0; q < nq; ++q) a[r][q] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; ++k) {
        __m512 xv[4];
        for (int q = 0; q < nq; ++q) xv[q] = _mm512_load_ps(xp + k * 64 + 16 * q);
        for (int r = 0; r < MR; ++r) {
            const __m512 gv = _mm512_set1_ps(gp[k * MR + r]);
            for (int q = 0; q < nq; ++q) a[r][q] = _mm512_fmadd_ps(gv, xv[q], a[r][q]);
        }
    }
    store_tile512(nq, a, c, ldc, rows, cols, accumulate);
}

/* The same with ymm registers: a 6 x (8 nq) tile, nq <= 2, xp rows of 16. */
RS_AVX2 static inline __attribute__((always_inline)) void
micro256(const int nq, int64_t kc, const float *restrict gp, const float *restrict xp,
         float *restrict c, int64_t ldc, int64_t rows, int64_t cols, int accumulate) {
    __m256 a[MR][2];
    for (int r = 0; r < MR; ++r)
        for (int q = 0; q < nq; ++q) a[r][q] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; ++k) {
        __m256 xv[2];
        for (int q = 0; q < nq; ++q) xv[q] = _mm256_load_ps(xp + k * 16 + 8 * q);
        for (int r = 0; r < MR; ++r) {
            const __m256 gv = _mm256_broadcast_ss(gp + k * MR + r);
            for (int q = 0; q < nq; ++q) a[r][q] = _mm256_fmadd_ps(gv, xv[q], a[r][q]);
        }
    }
    if (rows == MR && cols == 8 * nq) {
        for (int r = 0; r < MR; ++r)
            for (int q = 0; q < nq; ++q) {
                float *p = c + r * ldc + 8 * q;
                _mm256_storeu_ps(p, accumulate ? _mm256_add_ps(a[r][q], _mm256_loadu_ps(p))
                                               : a[r][q]);
            }
        return;
    }
    float tmp[MR][16] __attribute__((aligned(32)));
    for (int r = 0; r < MR; ++r)
        for (int q = 0; q < nq; ++q) _mm256_store_ps(&tmp[r][8 * q], a[r][q]);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j)
            c[r * ldc + j] = accumulate ? c[r * ldc + j] + tmp[r][j] : tmp[r][j];
}

#define WG_NAME weight_grad_avx512
#define WG_TARGET RS_AVX512
#define WG_NB 64
#define WG_MAX_NQ 4
#define WG_DISPATCH(nq, ...)                                                                  \
    switch (nq) { /* one specialised kernel per width */                                      \
    case 4: micro512(4, __VA_ARGS__); break;                                                  \
    case 3: micro512(3, __VA_ARGS__); break;                                                  \
    case 2: micro512(2, __VA_ARGS__); break;                                                  \
    default: micro512(1, __VA_ARGS__); break;                                                 \
    }
#include "weight_grad_driver.h"
#undef WG_NAME
#undef WG_TARGET
#undef WG_NB
#undef WG_MAX_NQ
#undef WG_DISPATCH

#define WG_NAME weight_grad_avx2
#define WG_TARGET RS_AVX2
#define WG_NB 16
#define WG_MAX_NQ 2
#define WG_DISPATCH(nq, ...)                                                                  \
    switch (nq) {                                                                             \
    case 2: micro256(2, __VA_ARGS__); break;                                                  \
    default: micro256(1, __VA_ARGS__); break;                                                 \
    }
#include "weight_grad_driver.h"

/* isa: 0 the widest this CPU runs, 1 AVX2 (tests reach it on AVX-512 CPUs), 2 AVX-512.
 * Returns 0, or -1 when the ISA asked for is missing or there is no memory for the
 * packed blocks (nothing written). The library loads only where AVX2 + FMA run. */
int recscale_weight_grad(const float *g, int64_t ldg, const float *x, int64_t ldx, float *dw,
                         int64_t lddw, float *db, float *xs, int64_t out, int64_t in,
                         int64_t batch, int64_t isa) {
    const int wide = (recscale_cpu_features() & RS_CPU_AVX512F) != 0;
    if (isa == 2 && !wide) return -1;
    if (isa == 2 || (isa == 0 && wide))
        return weight_grad_avx512(g, ldg, x, ldx, dw, lddw, db, xs, out, in, batch);
    return weight_grad_avx2(g, ldg, x, ldx, dw, lddw, db, xs, out, in, batch);
}

#else /* not x86-64: callers keep torch's GEMM */
int recscale_weight_grad(const float *g, int64_t ldg, const float *x, int64_t ldx, float *dw,
                         int64_t lddw, float *db, float *xs, int64_t out, int64_t in,
                         int64_t batch, int64_t isa) {
    (void)g, (void)ldg, (void)x, (void)ldx, (void)dw, (void)lddw, (void)db, (void)xs;
    (void)out, (void)in, (void)batch, (void)isa;
    return -1;
}
#endif
