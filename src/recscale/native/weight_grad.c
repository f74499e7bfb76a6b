/*
 * Weight and bias gradients of a dense layer from sample-major operands (AVX-512):
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
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RS_AVX512 __attribute__((target("avx512f")))
#define MR 6
#define NB 64 /* inputs per block: 4 zmm of 16 floats */
#ifndef KC
#define KC 64
#endif

/* 1 when this CPU has AVX-512F (Zen 4, Skylake-X and later Xeons). */
int recscale_avx512_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* c[r, j] (row stride ldc; rows x cols valid) = or += the 6 x (16 nq) tile
 * sum_k gp[k, r] xp[k, j]; nq is a constant at each call site (always_inline). */
RS_AVX512 static inline __attribute__((always_inline)) void
micro(const int nq, int64_t kc, const float *restrict gp, const float *restrict xp,
      float *restrict c, int64_t ldc, int64_t rows, int64_t cols, int accumulate) {
    __m512 a[MR][4];
    for (int r = 0; r < MR; ++r)
        for (int q = 0; q < nq; ++q) a[r][q] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; ++k) {
        __m512 xv[4];
        for (int q = 0; q < nq; ++q) xv[q] = _mm512_load_ps(xp + k * NB + 16 * q);
        for (int r = 0; r < MR; ++r) {
            const __m512 gv = _mm512_set1_ps(gp[k * MR + r]);
            for (int q = 0; q < nq; ++q) a[r][q] = _mm512_fmadd_ps(gv, xv[q], a[r][q]);
        }
    }
    if (rows == MR && cols == 16 * nq) {
        for (int r = 0; r < MR; ++r)
            for (int q = 0; q < nq; ++q) {
                float *p = c + r * ldc + 16 * q;
                _mm512_storeu_ps(p, accumulate ? _mm512_add_ps(a[r][q], _mm512_loadu_ps(p))
                                               : a[r][q]);
            }
        return;
    }
    /* an edge tile: through a buffer (masked stores are slow on AMD's cores) */
    float tmp[MR][NB] __attribute__((aligned(64)));
    for (int r = 0; r < MR; ++r)
        for (int q = 0; q < nq; ++q) _mm512_store_ps(&tmp[r][16 * q], a[r][q]);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j)
            c[r * ldc + j] = accumulate ? c[r * ldc + j] + tmp[r][j] : tmp[r][j];
}

/* Pack one block of kc samples, reading g and x row by row (contiguous, so the
 * prefetchers stream them; a column strip of g would thrash the L1, its rows being a
 * power-of-two stride apart):
 *     g[k, t*MR + r]  -> gp[t][k][r]      (zero past `out`)
 *     x[k, j*NB + c]  -> xp[j][k][c]      (zero past `in`)
 * and db[o] += g[k, o], xs[i] += x[k, i]. */
RS_AVX512 static void pack(const float *g, int64_t ldg, const float *x, int64_t ldx, int64_t out,
                           int64_t in, int64_t kc, float *restrict gp, float *restrict xp,
                           float *restrict db, float *restrict xs) {
    const int64_t full = out / MR, ntiles = (out + MR - 1) / MR, nblocks = (in + NB - 1) / NB;
    for (int64_t k = 0; k < kc; ++k) {
        const float *gk = g + k * ldg, *xk = x + k * ldx;
        for (int64_t t = 0; t < full; ++t) memcpy(gp + (t * kc + k) * MR, gk + t * MR, MR * sizeof(float));
        if (ntiles > full)
            for (int64_t r = 0; r < MR; ++r)
                gp[(full * kc + k) * MR + r] = full * MR + r < out ? gk[full * MR + r] : 0.0f;
        if (db)
            for (int64_t o = 0; o < out; ++o) db[o] += gk[o];
        if (xs)
            for (int64_t i = 0; i < in; ++i) xs[i] += xk[i];
        for (int64_t j = 0; j < nblocks; ++j) {
            const int64_t cols = in - j * NB < NB ? in - j * NB : NB;
            float *dst = xp + (j * kc + k) * NB;
            memcpy(dst, xk + j * NB, (size_t)cols * sizeof(float));
            if (cols < NB) memset(dst + cols, 0, (size_t)(NB - cols) * sizeof(float));
        }
    }
}

/* Returns 0, or -1 without AVX-512 or memory for the packed blocks (nothing written). */
RS_AVX512 int recscale_weight_grad(const float *g, int64_t ldg, const float *x, int64_t ldx,
                                   float *dw, int64_t lddw, float *db, float *xs, int64_t out,
                                   int64_t in, int64_t batch) {
    if (!recscale_avx512_supported()) return -1;
    const int64_t ntiles = (out + MR - 1) / MR, nblocks = (in + NB - 1) / NB;
    float *gp = aligned_alloc(64, (size_t)(ntiles * MR * KC) * sizeof(float));
    float *xp = aligned_alloc(64, (size_t)(nblocks * NB * KC) * sizeof(float));
    if (!gp || !xp) {
        free(gp);
        free(xp);
        return -1;
    }
    if (db) memset(db, 0, (size_t)out * sizeof(float));
    if (xs) memset(xs, 0, (size_t)in * sizeof(float));
    if (batch <= 0) /* no samples: zero gradients */
        for (int64_t o = 0; o < out; ++o) memset(dw + o * lddw, 0, (size_t)in * sizeof(float));
    for (int64_t k0 = 0; k0 < batch; k0 += KC) {
        const int64_t kc = batch - k0 < KC ? batch - k0 : KC;
        const int acc = k0 > 0;
        pack(g + k0 * ldg, ldg, x + k0 * ldx, ldx, out, in, kc, gp, xp, db, xs);
        /* the next block's rows of g and x, spread over this block's micro-kernel calls:
         * the pack then reads them from the L2 instead of waiting on memory (config B's
         * step 173.2 -> 169.8 and 167.1 -> 164.9 ms; A level) */
        const int64_t nk = batch - k0 - kc < KC ? batch - k0 - kc : KC;
        const int64_t glines = (out + 15) / 16, xlines = (in + 15) / 16;
        const int64_t plines = nk > 0 ? nk * (glines + xlines) : 0, calls = nblocks * ntiles;
        int64_t call = 0, pdone = 0, prow = 0, pc = 0; /* lines issued; the next one's place */
        for (int64_t j = 0; j < nblocks; ++j) {
            const int64_t i0 = j * NB, cols = in - i0 < NB ? in - i0 : NB, nq = (cols + 15) / 16;
            const float *xb = xp + j * kc * NB;
            for (int64_t t = 0; t < ntiles; ++t) {
                for (const int64_t le = plines * (call + 1) / calls; pdone < le; ++pdone) {
                    const float *p = pc < glines ? g + (k0 + kc + prow) * ldg + 16 * pc
                                                 : x + (k0 + kc + prow) * ldx + 16 * (pc - glines);
                    _mm_prefetch((const char *)p, _MM_HINT_T1);
                    if (++pc == glines + xlines) { /* counters, not a division per line */
                        pc = 0;
                        ++prow;
                    }
                }
                ++call;
                const int64_t rows = out - t * MR < MR ? out - t * MR : MR;
                const float *gt = gp + t * MR * kc;
                float *c = dw + t * MR * lddw + i0;
                switch (nq) { /* one specialised kernel per width */
                case 4: micro(4, kc, gt, xb, c, lddw, rows, cols, acc); break;
                case 3: micro(3, kc, gt, xb, c, lddw, rows, cols, acc); break;
                case 2: micro(2, kc, gt, xb, c, lddw, rows, cols, acc); break;
                default: micro(1, kc, gt, xb, c, lddw, rows, cols, acc); break;
                }
            }
        }
    }
    free(gp);
    free(xp);
    return 0;
}

#else /* not x86-64: callers keep torch's GEMM */
int recscale_avx512_supported(void) { return 0; }
int recscale_weight_grad(const float *g, int64_t ldg, const float *x, int64_t ldx, float *dw,
                         int64_t lddw, float *db, float *xs, int64_t out, int64_t in,
                         int64_t batch) {
    (void)g, (void)ldg, (void)x, (void)ldx, (void)dw, (void)lddw, (void)db, (void)xs;
    (void)out, (void)in, (void)batch;
    return -1;
}
#endif
