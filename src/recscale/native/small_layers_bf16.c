/*
 * The bf16 node's two small layers, each one pass over its operands (AVX512-BF16):
 *
 *   logit backward (a top MLP's n -> 1, h [batch, n] the ReLU output below it, w [1, n]):
 *       dh[b, i] = bf16(dz[b] w[i]), 0 where h[b, i] <= 0     bf16 [batch, n] (row stride lddh)
 *       dw[i]    = sum_b dz[b] h[b, i]                        fp32, in parts (below)
 *       db       = sum_b dz[b]
 *
 *   narrow weight gradient (a first layer in -> out with in <= 32, x [batch, in] the
 *   MLP's input, g [batch, out] the layer's output gradient):
 *       dw[o, i] = sum_b g[b, o] x[b, i]                      fp32 [out, in] (row stride in)
 *       db[o]    = sum_b g[b, o]                              fp32 [out]
 *
 * Why: on an AMX CPU these layers took torch's paths - the logit's input gradient as an
 * outer product, a ReLU mask pass and a GEMV for dw (0.35 ms of config A's 12 ms bf16
 * step, 2 vCPUs), the narrow layer's dw as a bf16 GEMM and a sum (0.40 ms) - and torch's
 * bf16 GEMMs round dw to bf16. Here each reads its operands once and the gradients of
 * the fp32 master weights come out in fp32.
 *
 * Rounding: dh is torch's product of two bf16 tensors, bit for bit: the fp32 product
 * rounded to nearest even (a NaN stays a NaN, as 0x7FC0), masked as threshold_backward masks
 * (a NaN in h keeps its gradient). Products of two bf16 values are exact in fp32. The
 * logit's sums are fp32 in sample order within a block of LOGIT_BLOCK samples, one
 * partial a block (the caller adds them: the same bits however threads split blocks);
 * the narrow layer's pair samples for vdpbf16ps (an odd last sample paired with zero;
 * denormal inputs read as zero, that instruction's rule), each output summed by one
 * thread in sample order (threads split the outputs: the same bits on any split).
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16_bits.h"
#include "recscale_native.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RS_BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define RS_SMALL_X86 1

enum { LOGIT_BLOCK = 64, NARROW_IN = 13 }; /* NARROW_IN: inputs a register pass holds */

static inline float bf16_to_float(uint16_t v) {
    union {
        uint32_t u;
        float f;
    } c = {(uint32_t)v << 16};
    return c.f;
}

/* Lane j = a[j] | b[j] << 16, j < 16 (b NULL: zero): two samples' values of 16 outputs */
RS_BF static inline __m512i pair16(const uint16_t *a, const uint16_t *b, __mmask16 m) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, a));
    if (!b) return lo;
    return _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b)), 16));
}

/* dw [o, i0 .. i0 + ni) and (with db) db[o] for 32 outputs o = o0 .. (m0, m1: which of
 * each 16 exist): 2 ni <= 2 NARROW_IN sums in registers, the batch in pairs; xp the
 * pairs' words of x (pair k, input i at xp[k in + i]). vdpbf16ps, not fp32 FMAs: on
 * the AMX Xeon VM it ran 28 of them a pair in 0.36 ms for 13 -> 512 over 2048 samples
 * on one thread, the FMAs (52, x widened once) in 0.50. */
RS_BF static inline __attribute__((always_inline)) void
narrow_block(const uint16_t *g, int64_t ldg, const uint32_t *xp, float *dw, float *db,
             int64_t in, int64_t batch, int64_t o0, __mmask16 m0, __mmask16 m1, int64_t i0,
             int ni) {
    __m512 acc[NARROW_IN][2], bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
    for (int i = 0; i < NARROW_IN; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3F803F80); /* (1.0, 1.0) */
    for (int64_t b = 0; b < batch; b += 2) {
        const uint16_t *g0 = g + b * ldg + o0, *g1 = b + 1 < batch ? g0 + ldg : NULL;
        const __m512bh p0 = (__m512bh)pair16(g0, g1, m0);
        const __m512bh p1 = (__m512bh)pair16(g0 + 16, g1 ? g1 + 16 : NULL, m1);
        const uint32_t *xk = xp + (b / 2) * in + i0;
#pragma GCC unroll 13
        for (int i = 0; i < NARROW_IN; ++i) {
            if (i >= ni) break;
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xk[i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], p0, xv);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], p1, xv);
        }
        if (db) {
            bias0 = _mm512_dpbf16_ps(bias0, p0, ones);
            bias1 = _mm512_dpbf16_ps(bias1, p1, ones);
        }
    }
    /* acc[i][h] lane j: dw[o0 + 16 h + j, i0 + i], a column of dw's rows (stride in) */
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)in));
    for (int i = 0; i < ni; ++i) {
        _mm512_mask_i32scatter_ps(dw + o0 * in + i0 + i, m0, rows, acc[i][0], 4);
        _mm512_mask_i32scatter_ps(dw + (o0 + 16) * in + i0 + i, m1, rows, acc[i][1], 4);
    }
    if (db) {
        _mm512_mask_storeu_ps(db + o0, m0, bias0);
        _mm512_mask_storeu_ps(db + o0 + 16, m1, bias1);
    }
}

#else /* not x86-64: the library does not load there (recscale_cpu_features) */
#define RS_BF
#endif

/* Blocks [lo, hi) of LOGIT_BLOCK samples: block p's dw sums to dwp[p n, p n + n), its db
 * to dbp[p]; dh for its samples (NULL: not wanted). mask: zero dh where h <= 0. The
 * columns run in chunks of 256, whose sums stay in 16 registers through the block. */
RS_BF int recscale_logit_backward_bf16(const uint16_t *h, int64_t ldh, const uint16_t *w,
                                       const uint16_t *dz, float *dwp, float *dbp, uint16_t *dh,
                                       int64_t lddh, int64_t batch, int64_t n, int64_t mask,
                                       int64_t lo, int64_t hi) {
#ifdef RS_SMALL_X86
    if (!rs_bf16_ready()) return -1;
    for (int64_t p = lo; p < hi; ++p) {
        const int64_t b0 = p * LOGIT_BLOCK;
        const int64_t b1 = b0 + LOGIT_BLOCK < batch ? b0 + LOGIT_BLOCK : batch;
        float bsum = 0.0f;
        for (int64_t b = b0; b < b1; ++b) bsum += bf16_to_float(dz[b]);
        dbp[p] = bsum;
        for (int64_t c0 = 0; c0 < n; c0 += 256) {
            const int64_t left = n - c0;
            const int nq = left >= 256 ? 16 : (int)((left + 15) / 16);
            __m512 acc[16];
            for (int q = 0; q < 16; ++q) acc[q] = _mm512_setzero_ps();
            for (int64_t b = b0; b < b1; ++b) {
                const __m512 gv = _mm512_set1_ps(bf16_to_float(dz[b]));
                const uint16_t *hb = h + b * ldh + c0;
                uint16_t *dh_row = dh ? dh + b * lddh + c0 : NULL;
#pragma GCC unroll 16
                for (int q = 0; q < 16; ++q) {
                    if (q >= nq) break;
                    const __mmask16 m = rs_lanes16(left - 16 * q);
                    const __m256i hv = _mm256_maskz_loadu_epi16(m, hb + 16 * q);
                    acc[q] = _mm512_fmadd_ps(gv, rs_bf16_widen16(hv), acc[q]);
                    if (dh_row) {
                        const __m256i wv = _mm256_maskz_loadu_epi16(m, w + c0 + 16 * q);
                        const __m256i d = rs_bf16_round16(_mm512_mul_ps(gv, rs_bf16_widen16(wv)));
                        const __mmask16 keep = mask ? (__mmask16)(m & rs_bf16_kept16(hv)) : m;
                        _mm256_mask_storeu_epi16(dh_row + 16 * q, m, _mm256_maskz_mov_epi16(keep, d));
                    }
                }
            }
            float *dw = dwp + p * n + c0;
            for (int q = 0; q < nq; ++q) _mm512_mask_storeu_ps(dw + 16 * q, rs_lanes16(left - 16 * q), acc[q]);
        }
    }
    return 0;
#else
    (void)h, (void)ldh, (void)w, (void)dz, (void)dwp, (void)dbp, (void)dh, (void)lddh;
    (void)batch, (void)n, (void)mask, (void)lo, (void)hi;
    return -1;
#endif
}

/* Outputs in blocks of 32 [lo, hi): dw [out, in] fp32 (rows of in), db [out] (NULL: not
 * wanted). x is first packed in pairs of samples (a call's copy: 2 B x in a sample). */
RS_BF int recscale_narrow_wgrad_bf16(const uint16_t *g, int64_t ldg, const uint16_t *x,
                                     int64_t ldx, float *dw, float *db, int64_t out, int64_t in,
                                     int64_t batch, int64_t lo, int64_t hi) {
#ifdef RS_SMALL_X86
    if (!rs_bf16_ready()) return -1;
    const int64_t pairs = (batch + 1) / 2;
    uint32_t *xp = malloc((size_t)(pairs * in) * sizeof(uint32_t));
    if (!xp) return -3;
    for (int64_t k = 0; k < pairs; ++k) {
        const uint16_t *x0 = x + 2 * k * ldx, *x1 = 2 * k + 1 < batch ? x0 + ldx : NULL;
        for (int64_t i = 0; i < in; ++i)
            xp[k * in + i] = (uint32_t)x0[i] | (x1 ? (uint32_t)x1[i] << 16 : 0u);
    }
    for (int64_t t = lo; t < hi; ++t) {
        const int64_t o0 = 32 * t;
        const __mmask16 m0 = rs_lanes16(out - o0), m1 = rs_lanes16(out - o0 - 16);
        for (int64_t i0 = 0; i0 < in; i0 += NARROW_IN) {
            const int ni = in - i0 < NARROW_IN ? (int)(in - i0) : NARROW_IN;
            narrow_block(g, ldg, xp, dw, i0 == 0 ? db : NULL, in, batch, o0, m0, m1, i0, ni);
        }
    }
    free(xp);
    return 0;
#else
    (void)g, (void)ldg, (void)x, (void)ldx, (void)dw, (void)db, (void)out, (void)in;
    (void)batch, (void)lo, (void)hi;
    return -1;
#endif
}
