/*
 * The dot interaction on AMX tiles, for bf16 T (dot_interaction_bf16.c's in_bf16: the
 * native lookup's bf16 pooled vectors and the bf16 bottom MLP's row) with a bf16 output
 * row and gradient: k <= 32 rows, d = 16 or a multiple of 32 up to 256, no self pairs. Same
 * contract as recscale_dot_forward_bf16 / recscale_dot_backward_bf16 (dot_interaction.c
 * draws T, the row and G), which call these where they apply.
 *
 * Why: with d = 128 (config B) the AVX-512 tiles (dot_interaction_avx512.c) spend
 * 27 x 26 / 2 x 128 FMAs a sample forward and 27 x 27 x 128 back on the fp32 units; a
 * tile product does 16 x 16 x 32 multiply-adds in one instruction. One thread, warm,
 * 2048 x 27 rows (host A, 2026-11-29), ns a sample forward / backward against the AVX-512
 * kernels: d = 16 215 / 283 against 318 / 360 (the narrow ones), 32 240 / 340 against
 * 594 / 545, 64 338 / 576 against 1210 / 1288. In a step the rows come cold from memory
 * and the gain shrinks (docs/performance.md).
 *
 * Per sample, T's rows padded with zeros to 32 (two row tiles, m = 0, 1), and d = 16 to
 * one step of 32 columns (its backward has one column tile):
 *
 *   forward   A tile (m, s) = rows 16 m .. 16 m + 15, columns 32 s .. 32 s + 31 (as
 *             stored); B tile (m, s) = the same block transposed as 32-bit pairs (VNNI:
 *             row q holds T[16 m + c][32 s + 2 q + e] at 2 c + e). C(0, 0), C(0, 1), C(1, 1)
 *             sum A(i, s) . B(j, s) over s: the Gram matrix's upper half, in fp32. The row
 *             is the dense row, the pairs i < j in triu order rounded to bf16, zeros.
 *   backward  the coefficients G (32 x 32 bf16, G_ij = G_ji = g_p, exact) as two A tiles:
 *             row i's pairs are contiguous in g (j > i), and U^T comes from U by pairing
 *             rows (VNNI) and transposing 32-bit 16 x 16 blocks; T as B tiles (rows 2 q
 *             and 2 q + 1 interleaved, 16 columns a tile). grad_T = G . T in fp32 tiles,
 *             32 columns at a time, rounded to bf16 into the gradient rows (the dense row's
 *             plus its pass-through g[0 .. d) first).
 *
 * The sums are fp32 over exact bf16 products, in the tiles' order: not the AVX-512
 * kernels' bits (tests compare with a tolerance); rounding to bf16 as torch casts
 * (bf16_bits.h). Each sample is one thread's: the same bits however a batch splits.
 */
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16_bits.h"
#include "recscale_native.h"

int recscale_dot_amx = 1; /* 0: the AVX-512 kernels instead (benchmarks/step_ab.py, tests) */

#ifdef RS_HAVE_AMX

enum { MAX_STEPS = 8 }; /* d <= 256 */

int recscale_dot_amx_applies(int64_t k, int64_t d, int64_t self_interaction) {
    return recscale_dot_amx && !self_interaction && k >= 2 && k <= 32 &&
           (d == 16 || (d % 32 == 0 && d <= 32 * MAX_STEPS)) && recscale_amx_ready();
}

/* Sample b's row r of T (NULL past k: zeros) */
static inline const uint16_t *t_row(const uint16_t *dense, const uint16_t *emb, int64_t b,
                                    int64_t r, int64_t k, int64_t e0, int64_t dsb, int64_t esb,
                                    int64_t esf) {
    if (r >= k) return NULL;
    return r < e0 ? dense + b * dsb : emb + b * esb + (r - e0) * esf;
}

/* A and B tiles of the forward (above) for row tiles [0, mt) and steps [0, steps) */
RS_PACK static void forward_pack(const uint16_t *const rows[32], int64_t mt, int64_t steps,
                                 int64_t d, uint16_t *a, uint16_t *bt) {
    for (int64_t m = 0; m < mt; ++m)
        for (int64_t s = 0; s < steps; ++s) {
            __m512i r[16];
            uint16_t *at = a + (m * steps + s) * TILE, *btile = bt + (m * steps + s) * TILE;
            for (int i = 0; i < 16; ++i) {
                r[i] = load32(rows[16 * m + i], 32 * s, d);
                _mm512_storeu_si512(at + 32 * i, r[i]);
            }
            transpose16(r);
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512(btile + 32 * i, r[i]);
        }
}

/* The upper half of the Gram matrix (C(0, 0), C(0, 1), C(1, 1)) into G [32][32] fp32 */
RS_AMX static void gram(const uint16_t *a, const uint16_t *bt, int64_t mt, int64_t steps,
                        float *G) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(4, a + s * TILE, 64);
        _tile_loadd(6, bt + s * TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (mt > 1) {
            _tile_loadd(5, a + (steps + s) * TILE, 64);
            _tile_loadd(7, bt + (steps + s) * TILE, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, G, 128);
    if (mt > 1) {
        _tile_stored(1, G + 16, 128);
        _tile_stored(3, G + 16 * 32 + 16, 128);
    }
}

/* out = [dense row (d) | G's pairs i < j, triu order, rounded | zeros to width] */
RS_PACK static void forward_store(const float *G, const uint16_t *dense_row, uint16_t *out,
                                  int64_t k, int64_t d, int64_t width) {
    int64_t p = 0;
    if (dense_row) { /* widened and rounded back: the bits torch's cast of the fp32 row gives */
        for (int64_t c = 0; c < d; c += 16)
            _mm256_storeu_si256((__m256i *)(out + c),
                                rs_bf16_round16(rs_bf16_widen16(
                                    _mm256_loadu_si256((const __m256i *)(dense_row + c)))));
        p = d;
    }
    for (int64_t i = 0; i + 1 < k; ++i) { /* row i's pairs: G[i][i + 1 .. k) */
        rs_bf16_round_n(G + 32 * i + i + 1, out + p, k - 1 - i);
        p += k - 1 - i;
    }
    if (p < width) memset(out + p, 0, (size_t)(width - p) * sizeof(uint16_t));
}

RS_AMX int recscale_dot_forward_amx(const uint16_t *dense, const uint16_t *emb, uint16_t *out,
                                    int64_t b0, int64_t b1, int64_t k, int64_t d,
                                    int64_t has_dense, int64_t width, int64_t dsb, int64_t esb,
                                    int64_t esf) {
    if (!recscale_dot_amx_applies(k, d, 0)) return -1;
    const int64_t e0 = has_dense ? 1 : 0, mt = k > 16 ? 2 : 1, steps = (d + 31) / 32;
    uint16_t a[2 * MAX_STEPS * TILE] __attribute__((aligned(64)));
    uint16_t bt[2 * MAX_STEPS * TILE] __attribute__((aligned(64)));
    float G[32 * 32] __attribute__((aligned(64)));
    const uint16_t *rows[32];
    load_tile_config();
    for (int64_t b = b0; b < b1; ++b) {
        for (int64_t r = 0; r < 32; ++r) rows[r] = t_row(dense, emb, b, r, k, e0, dsb, esb, esf);
        forward_pack(rows, mt, steps, d, a, bt);
        gram(a, bt, mt, steps, G);
        forward_store(G, e0 ? rows[0] : NULL, out + b * width, k, d, width);
    }
    _tile_release();
    return 0;
}

/* G's two A tiles (32 x 32 bf16) from sample's pair gradients gp (triu order) */
RS_PACK static void backward_coefficients(const uint16_t *gp, int64_t k, uint16_t *a) {
    __m512i u[32], p0[16], p1[16];
    const uint64_t below_k = ((uint64_t)1 << k) - 1;
    int64_t off = 0;
    for (int64_t i = 0; i < 32; ++i) {
        if (i + 1 < k) { /* row i: g_p at columns i + 1 .. k - 1, read from gp + off */
            const __mmask32 m = (__mmask32)(below_k & ~(((uint64_t)2 << i) - 1));
            u[i] = _mm512_maskz_loadu_epi16(m, (const uint16_t *)((uintptr_t)(gp + off) -
                                                                  2 * (uintptr_t)(i + 1)));
            off += k - 1 - i;
        } else {
            u[i] = _mm512_setzero_si512();
        }
    }
    for (int q = 0; q < 16; ++q) pairs32(u[2 * q], u[2 * q + 1], &p0[q], &p1[q]);
    transpose16(p0); /* p0[c]: column c of U (rows 0 .. 31) - row c of U^T */
    transpose16(p1);
    for (int i = 0; i < 16; ++i) { /* U and U^T do not overlap: their sum is their OR */
        _mm512_storeu_si512(a + 32 * i, _mm512_or_si512(u[i], p0[i]));
        _mm512_storeu_si512(a + 32 * (16 + i), _mm512_or_si512(u[16 + i], p1[i]));
    }
}

/* T as B tiles: tile v (columns 16 v .. 16 v + 15), row q = rows 2 q, 2 q + 1 interleaved */
RS_PACK static void backward_pack_t(const uint16_t *const rows[32], int64_t steps, int64_t d,
                                    uint16_t *bt) {
    for (int q = 0; q < 16; ++q)
        for (int64_t w = 0; w < steps; ++w) {
            __m512i p0, p1;
            pairs32(load32(rows[2 * q], 32 * w, d), load32(rows[2 * q + 1], 32 * w, d),
                    &p0, &p1);
            _mm512_storeu_si512(bt + 2 * w * TILE + 32 * q, p0);
            if (d - 32 * w > 16) _mm512_storeu_si512(bt + (2 * w + 1) * TILE + 32 * q, p1);
        }
}

/* Rows [0, k) of grad_T's columns 32 w .. 32 w + 31 (fp32 in C) rounded into the
 * gradient rows; row 0 of a dense sample adds its pass-through g first. */
RS_PACK static void backward_store(const float *C, uint16_t *const out[32], const uint16_t *g0,
                                   int64_t k, int64_t w, int halves) {
    for (int64_t i = 0; i < k; ++i)
        for (int h = 0; h < halves; ++h) {
            __m512 v = _mm512_loadu_ps(C + 32 * i + 16 * h);
            if (i == 0 && g0)
                v = _mm512_add_ps(v, rs_bf16_widen16(_mm256_loadu_si256(
                                         (const __m256i *)(g0 + 32 * w + 16 * h))));
            _mm256_storeu_si256((__m256i *)(out[i] + 32 * w + 16 * h), rs_bf16_round16(v));
        }
}

RS_AMX static void backward_products(const uint16_t *a, const uint16_t *bt, int64_t mt,
                                     int64_t steps, int64_t d, uint16_t *const out[32],
                                     const uint16_t *g0, int64_t k, float *C) {
    _tile_loadd(4, a, 64);
    if (mt > 1) _tile_loadd(5, a + TILE, 64);
    for (int64_t w = 0; w < steps; ++w) {
        const int halves = d - 32 * w > 16 ? 2 : 1; /* d = 16: one column tile */
        _tile_zero(0);
        _tile_loadd(6, bt + 2 * w * TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_stored(0, C, 128);
        if (halves > 1) {
            _tile_zero(1);
            _tile_loadd(7, bt + (2 * w + 1) * TILE, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_stored(1, C + 16, 128);
        }
        if (mt > 1) {
            _tile_zero(2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_stored(2, C + 16 * 32, 128);
            if (halves > 1) {
                _tile_zero(3);
                _tile_dpbf16ps(3, 5, 7);
                _tile_stored(3, C + 16 * 32 + 16, 128);
            }
        }
        backward_store(C, out, g0, k, w, halves);
    }
}

RS_AMX int recscale_dot_backward_amx(const uint16_t *dense, const uint16_t *emb,
                                     const uint16_t *g16, uint16_t *grad_dense,
                                     uint16_t *grad_emb, int64_t b0, int64_t b1, int64_t k,
                                     int64_t d, int64_t has_dense, int64_t width, int64_t dsb,
                                     int64_t esb, int64_t esf, int64_t gsb, int64_t gsf) {
    if (!recscale_dot_amx_applies(k, d, 0)) return -1;
    const int64_t e0 = has_dense ? 1 : 0, mt = k > 16 ? 2 : 1, steps = (d + 31) / 32;
    uint16_t a[2 * TILE] __attribute__((aligned(64)));
    uint16_t bt[2 * MAX_STEPS * TILE] __attribute__((aligned(64)));
    float C[32 * 32] __attribute__((aligned(64)));
    const uint16_t *rows[32];
    uint16_t *out[32];
    load_tile_config();
    for (int64_t b = b0; b < b1; ++b) {
        for (int64_t r = 0; r < 32; ++r) {
            rows[r] = t_row(dense, emb, b, r, k, e0, dsb, esb, esf);
            out[r] = r >= k ? NULL : r < e0 ? grad_dense + b * d : grad_emb + b * gsb + (r - e0) * gsf;
        }
        const uint16_t *g = g16 + b * width;
        backward_coefficients(g + e0 * d, k, a);
        backward_pack_t(rows, steps, d, bt);
        backward_products(a, bt, mt, steps, d, out, e0 ? g : NULL, k, C);
    }
    _tile_release();
    return 0;
}

#else /* no AMX intrinsics in this compiler: the entry points decline */

int recscale_dot_amx_applies(int64_t k, int64_t d, int64_t self_interaction) {
    (void)k, (void)d, (void)self_interaction;
    return 0;
}

int recscale_dot_forward_amx(const uint16_t *dense, const uint16_t *emb, uint16_t *out,
                             int64_t b0, int64_t b1, int64_t k, int64_t d, int64_t has_dense,
                             int64_t width, int64_t dsb, int64_t esb, int64_t esf) {
    (void)dense, (void)emb, (void)out, (void)b0, (void)b1, (void)k, (void)d, (void)has_dense;
    (void)width, (void)dsb, (void)esb, (void)esf;
    return -1;
}

int recscale_dot_backward_amx(const uint16_t *dense, const uint16_t *emb, const uint16_t *g16,
                              uint16_t *grad_dense, uint16_t *grad_emb, int64_t b0, int64_t b1,
                              int64_t k, int64_t d, int64_t has_dense, int64_t width, int64_t dsb,
                              int64_t esb, int64_t esf, int64_t gsb, int64_t gsf) {
    (void)dense, (void)emb, (void)g16, (void)grad_dense, (void)grad_emb, (void)b0, (void)b1;
    (void)k, (void)d, (void)has_dense, (void)width, (void)dsb, (void)esb, (void)esf, (void)gsb;
    (void)gsf;
    return -1;
}

#endif
