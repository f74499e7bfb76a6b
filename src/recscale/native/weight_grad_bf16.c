/*
 * weight_grad.c's contract for bf16 operands, on AVX512-BF16 (vdpbf16ps):
 *
 *     dw[o, i] = sum_{b < batch} g[b, o] * x[b, i]    fp32 [out, in], row stride lddw
 *     db[o]    = sum_{b < batch} g[b, o]             fp32 [out] (skipped when NULL)
 *     xs[i]    = sum_{b < batch} x[b, i]             fp32 [in]  (skipped when NULL)
 *
 * g [batch, out] and x [batch, in] are bf16 (raw 16-bit words, row strides ldg, ldx),
 * samples in rows as the step made them. Products of two bf16 values are exact in fp32
 * and every sum is fp32: what a bf16 GEMM with fp32 accumulation computes, and the
 * results come out in fp32 - the dtype of the master weights' gradients - where
 * torch.mm(g.t(), x) rounds them to bf16, and autocast's backward then casts them back
 * to fp32 and sums the bias gradient in a pass of its own (config B's MLPs: 2.6 ms of
 * the two, measured in the chain). The products themselves run level with oneDNN's
 * (docs/performance.md). Denormal inputs read as zero (vdpbf16ps's rule).
 *
 * vdpbf16ps multiplies pairs along K, so K = the batch runs in pairs of samples (an odd
 * last sample paired with zero). Per block of KP pairs, packed as 32-bit words
 * (low half sample 2k, high half 2k + 1):
 *
 *     gp[tile][k][r]  = g[2k, o] | g[2k+1, o] << 16      o = tile * MR + r   (zero past out)
 *     xp[blk][k][c]   = x[2k, i] | x[2k+1, i] << 16      i = blk * 64 + c    (zero past in)
 *
 * and the micro-kernel keeps a 6 x 64 tile of dw in 24 zmm registers: per pair, 4 loads
 * of xp, 6 broadcasts of gp and 24 vdpbf16ps (each 32 multiply-adds). The sums db and xs
 * are taken from the packed words while packing. Threads split the outputs (or the
 * samples) as for weight_grad.c: gemm.weight_grad drives both.
 */
#include <stdint.h>

#include "recscale_native.h"
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RS_BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define MR 6
#define NB 64 /* inputs per packed block */
#define KP 64 /* sample pairs per packed block: 32 KB of xp, 1.5 KB of a g tile */
#include "weight_grad_tile.h"

/* Lane j = a[j] | b[j] << 16 for j < n (n <= 16; b NULL: zero), zero past n. */
RS_BF static inline __m512i pair16(const uint16_t *a, const uint16_t *b, int64_t n) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, a));
    if (!b) return lo;
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* The fp32 sum of each word's two bf16 halves. */
RS_BF static inline __m512 pair_sum(__m512i w) {
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
    return _mm512_add_ps(lo, hi);
}

/* s[j] += the pair sums of w for j < n (n <= 16): a plain store for a full vector
 * (masked stores are slow on AMD's cores), masked at the tail. */
RS_BF static inline void add_sums(float *s, __m512i w, int64_t n) {
    if (n >= 16) {
        _mm512_storeu_ps(s, _mm512_add_ps(_mm512_loadu_ps(s), pair_sum(w)));
        return;
    }
    const __mmask16 m = (__mmask16)((1u << n) - 1);
    _mm512_mask_storeu_ps(s, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, s), pair_sum(w)));
}

/* c[r, j] (row stride ldc; rows x cols valid) = or += sum_k gp[k, r] . xp[k, j], a
 * 6 x (16 nq) tile; nq is a constant at each call site. */
RS_BF static inline __attribute__((always_inline)) void
micro(const int nq, int64_t kp, const uint32_t *restrict gp, const uint32_t *restrict xp,
      float *restrict c, int64_t ldc, int64_t rows, int64_t cols, int accumulate) {
    __m512 a[MR][4];
    for (int r = 0; r < MR; ++r)
        for (int q = 0; q < nq; ++q) a[r][q] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kp; ++k) {
        __m512i xv[4];
        for (int q = 0; q < nq; ++q) xv[q] = _mm512_load_si512(xp + k * NB + 16 * q);
        for (int r = 0; r < MR; ++r) {
            const __m512i gv = _mm512_set1_epi32((int)gp[k * MR + r]);
            for (int q = 0; q < nq; ++q)
                a[r][q] = _mm512_dpbf16_ps(a[r][q], (__m512bh)gv, (__m512bh)xv[q]);
        }
    }
    store_tile512(nq, a, c, ldc, rows, cols, accumulate);
}

/* Pack ks samples (kp = ceil(ks / 2) pairs) of g and x, rows read in order; grow is a
 * scratch row of ntiles * MR words. */
RS_BF static void pack(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx,
                       int64_t out, int64_t in, int64_t ks, uint32_t *restrict gp,
                       uint32_t *restrict xp, float *restrict db, float *restrict xs,
                       uint32_t *restrict grow) {
    const int64_t kp = (ks + 1) / 2, ntiles = (out + MR - 1) / MR, nblocks = (in + NB - 1) / NB;
    for (int64_t k = 0; k < kp; ++k) {
        const int odd = 2 * k + 1 == ks; /* the last sample, alone */
        const uint16_t *g0 = g + 2 * k * ldg, *g1 = odd ? NULL : g0 + ldg;
        const uint16_t *x0 = x + 2 * k * ldx, *x1 = odd ? NULL : x0 + ldx;
        for (int64_t o = 0; o < out; o += 16) {
            const __m512i w = pair16(g0 + o, g1 ? g1 + o : NULL, out - o);
            _mm512_storeu_si512(grow + o, w); /* lanes past out are zero; grow has room */
            if (db) add_sums(db + o, w, out - o);
        }
        for (int64_t o = out; o < ntiles * MR; ++o) grow[o] = 0;
        for (int64_t t = 0; t < ntiles; ++t)
            memcpy(gp + (t * kp + k) * MR, grow + t * MR, MR * sizeof(uint32_t));
        for (int64_t j = 0; j < nblocks; ++j) {
            uint32_t *dst = xp + (j * kp + k) * NB;
            for (int64_t q = 0; q < NB; q += 16) {
                const int64_t i = j * NB + q;
                if (i >= in) {
                    _mm512_store_si512(dst + q, _mm512_setzero_si512());
                    continue;
                }
                const __m512i w = pair16(x0 + i, x1 ? x1 + i : NULL, in - i);
                _mm512_store_si512(dst + q, w);
                if (xs) add_sums(xs + i, w, in - i);
            }
        }
    }
}

RS_BF static int weight_grad_bf16(const uint16_t *g, int64_t ldg, const uint16_t *x,
                                  int64_t ldx, float *dw, int64_t lddw, float *db, float *xs,
                                  int64_t out, int64_t in, int64_t batch) {
    const int64_t ntiles = (out + MR - 1) / MR, nblocks = (in + NB - 1) / NB;
    uint32_t *gp = aligned_alloc(64, (size_t)(ntiles * MR * KP) * sizeof(uint32_t));
    uint32_t *xp = aligned_alloc(64, (size_t)(nblocks * NB * KP) * sizeof(uint32_t));
    uint32_t *grow = malloc((size_t)(ntiles * MR + 16) * sizeof(uint32_t));
    if (!gp || !xp || !grow) {
        free(gp);
        free(xp);
        free(grow);
        return -1;
    }
    if (db) memset(db, 0, (size_t)out * sizeof(float));
    if (xs) memset(xs, 0, (size_t)in * sizeof(float));
    if (batch <= 0) /* no samples: zero gradients */
        for (int64_t o = 0; o < out; ++o) memset(dw + o * lddw, 0, (size_t)in * sizeof(float));
    for (int64_t k0 = 0; k0 < batch; k0 += 2 * KP) {
        const int64_t ks = batch - k0 < 2 * KP ? batch - k0 : 2 * KP, kp = (ks + 1) / 2;
        pack(g + k0 * ldg, ldg, x + k0 * ldx, ldx, out, in, ks, gp, xp, db, xs, grow);
        for (int64_t j = 0; j < nblocks; ++j) {
            const int64_t i0 = j * NB, cols = in - i0 < NB ? in - i0 : NB, nq = (cols + 15) / 16;
            const uint32_t *xb = xp + j * kp * NB;
            for (int64_t t = 0; t < ntiles; ++t) {
                const int64_t rows = out - t * MR < MR ? out - t * MR : MR;
                const uint32_t *gt = gp + t * MR * kp;
                float *c = dw + t * MR * lddw + i0;
                switch (nq) { /* one specialised kernel per width */
                case 4: micro(4, kp, gt, xb, c, lddw, rows, cols, k0 > 0); break;
                case 3: micro(3, kp, gt, xb, c, lddw, rows, cols, k0 > 0); break;
                case 2: micro(2, kp, gt, xb, c, lddw, rows, cols, k0 > 0); break;
                default: micro(1, kp, gt, xb, c, lddw, rows, cols, k0 > 0); break;
                }
            }
        }
    }
    free(gp);
    free(xp);
    free(grow);
    return 0;
}

/* Returns 0, or -1 where the CPU lacks AVX512-BF16 or there is no memory for the packed
 * blocks (nothing written). */
int recscale_weight_grad_bf16(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx,
                              float *dw, int64_t lddw, float *db, float *xs, int64_t out,
                              int64_t in, int64_t batch) {
    if (!(recscale_cpu_features() & RS_CPU_AVX512_BF16)) return -1;
    return weight_grad_bf16(g, ldg, x, ldx, dw, lddw, db, xs, out, in, batch);
}

#else /* not x86-64: callers keep torch's GEMM */
int recscale_weight_grad_bf16(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx,
                              float *dw, int64_t lddw, float *db, float *xs, int64_t out,
                              int64_t in, int64_t batch) {
    (void)g, (void)ldg, (void)x, (void)ldx, (void)dw, (void)lddw, (void)db, (void)xs;
    (void)out, (void)in, (void)batch;
    return -1;
}
#endif
