/*
 * What the AMX kernels share (weight_grad_amx.c, input_grad_amx.c): the compiler test
 * (RS_HAVE_AMX where the compiler has the intrinsics), the tile configuration, and the
 * VNNI packing of a matrix whose rows are the products' slow axis.
 *
 * A "VNNI" B tile (u, s) holds rows 32 s .. 32 s + 31 of a matrix src [rows, cols]
 * (row stride ld), columns 16 u .. 16 u + 15, as 16 rows of 64 bytes: row q, element
 * 2 c + e = src[32 s + 2 q + e][16 u + c]; rows past `rows` and columns past `cols` are
 * zeros. pack_b writes tiles u and u + 1 (u even) of step s at bp + (u S + s) 512, S the
 * steps of the packed array.
 */
#ifndef RECSCALE_AMX_TILES_H
#define RECSCALE_AMX_TILES_H

#include <stdint.h>
#include <string.h>

/* AMX intrinsics: GCC 11, clang 12; older ones build their kernels' declining stubs */
#if defined(__x86_64__) && defined(__linux__) &&                                    \
    ((defined(__clang__) && __clang_major__ >= 12) ||                                \
     (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11))
#include <immintrin.h>

#define RS_PACK __attribute__((target("avx512f,avx512bw,avx512vl")))
#define RS_AMX __attribute__((target("amx-tile,amx-bf16")))
#define RS_HAVE_AMX 1

enum { TILE = 512 };  /* bf16 elements in one 16 x 32 tile */

/* 32 bf16 of `row` from column c0 (those at or past `cols` zero), or zeros. */
RS_PACK static inline __m512i load32(const uint16_t *row, int64_t c0, int64_t cols) {
    if (!row || c0 >= cols) return _mm512_setzero_si512();
    const int64_t left = cols - c0;
    const __mmask32 mask = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
    return _mm512_maskz_loadu_epi16(mask, row + c0);
}


/* The 32-bit pairs (a[c], b[c]) in order: c = 0..15 in *p0, c = 16..31 in *p1. */
RS_PACK static inline void pairs32(__m512i a, __m512i b, __m512i *p0, __m512i *p1) {
    const __m512i lo = _mm512_unpacklo_epi16(a, b); /* 128-bit lane L: c 8 L .. 8 L + 3 */
    const __m512i hi = _mm512_unpackhi_epi16(a, b); /* c 8 L + 4 .. 8 L + 7 */
    *p0 = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi);
    *p1 = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi);
}


/* r[i][j] -> r[j][i] for 16 x 16 32-bit elements */
RS_PACK static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4 i + c], 128-bit lane L: column 4 L + c of rows 4 i .. 4 i + 3 */
    for (int i = 0; i < 4; ++i) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        const __m512i x01 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i x23 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i y01 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i y23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
        r[c] = _mm512_shuffle_i32x4(x01, y01, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + c] = _mm512_shuffle_i32x4(x01, y01, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + c] = _mm512_shuffle_i32x4(x23, y23, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + c] = _mm512_shuffle_i32x4(x23, y23, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* The A tiles of g transposed from pairs32's output for 16 pairs of samples: r0 (columns
 * 0-15) becomes tile0's 16 rows, r1 (columns 16-31) tile1's - row c holds column c's 32
 * samples in order. */
RS_PACK static inline void store_transposed(__m512i r0[16], __m512i r1[16], uint16_t *tile0,
                                            uint16_t *tile1) {
    transpose16(r0);
    transpose16(r1);
    for (int i = 0; i < 16; ++i) {
        _mm512_storeu_si512(tile0 + 32 * i, r0[i]);
        _mm512_storeu_si512(tile1 + 32 * i, r1[i]);
    }
}

/* fp32 sums += the 16 bf16 of v */
RS_PACK static inline __m512 add_bf16(__m512 sums, __m256i v) {
    return _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
}


/* acc[h] (+ acc[2 + h]): the sums of columns 16 h .. 16 h + 15 of 32, over rows va, vb */
RS_PACK static inline void add_pair(__m512 acc[4], __m512i va, __m512i vb) {
    acc[0] = add_bf16(acc[0], _mm512_castsi512_si256(va));
    acc[1] = add_bf16(acc[1], _mm512_extracti64x4_epi64(va, 1));
    acc[2] = add_bf16(acc[2], _mm512_castsi512_si256(vb));
    acc[3] = add_bf16(acc[3], _mm512_extracti64x4_epi64(vb, 1));
}


/* sums[16 t ..] += the column sums add_pair gathered, those before `cols` */
RS_PACK static inline void add_sums(const __m512 acc[4], float *sums, int64_t t, int64_t cols) {
    for (int h = 0; h < 2; ++h) {
        const int64_t left = cols - 16 * (t + h);
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        float *dst = sums + 16 * (t + h);
        _mm512_mask_storeu_ps(dst, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst),
                                                       _mm512_add_ps(acc[h], acc[2 + h])));
    }
}


/* Sample b's row of src, or NULL past the batch (its values read as zeros). */
static inline const uint16_t *sample(const uint16_t *src, int64_t ld, int64_t b, int64_t batch) {
    return b < batch ? src + b * ld : NULL;
}


/* Step s of B's tiles u and u + 1 (u even) of x [batch, n]; with `sums`, the step's sums
 * of its columns 16 u .. 16 u + 31 added to them. */
RS_PACK static inline void pack_b(const uint16_t *x, int64_t ldx, int64_t n, int64_t batch, int64_t steps,
                           int64_t u, int64_t s, uint16_t *bp, float *sums) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    uint16_t *tile0 = bp + (u * steps + s) * TILE, *tile1 = tile0 + steps * TILE;
    for (int q = 0; q < 16; ++q) {
        const int64_t b = 32 * s + 2 * q;
        const __m512i va = load32(sample(x, ldx, b, batch), 16 * u, n);
        const __m512i vb = load32(sample(x, ldx, b + 1, batch), 16 * u, n);
        if (sums) add_pair(acc, va, vb);
        __m512i p0, p1;
        pairs32(va, vb, &p0, &p1);
        _mm512_storeu_si512(tile0 + 32 * q, p0);
        _mm512_storeu_si512(tile1 + 32 * q, p1);
    }
    if (sums) add_sums(acc, sums, u, n);
}


typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* C tiles 0-3 (a 2 x 2 block), A tiles 4-5, B tiles 6-7: all 16 rows of 64 bytes */
RS_AMX static inline void load_tile_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}


/* One step of a 2 x 2 block of C tiles (0-3): C[i][j] += A_i . B_j for A tiles a0, a1
 * (loaded into tiles 4, 5) and B tiles b0, b1 (6, 7), each 1 KiB with 64-byte rows. */
RS_AMX static inline void step_2x2(const uint16_t *a0, const uint16_t *a1, const uint16_t *b0,
                                   const uint16_t *b1) {
    _tile_loadd(4, a0, 64);
    _tile_loadd(5, a1, 64);
    _tile_loadd(6, b0, 64);
    _tile_loadd(7, b1, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

#endif /* the compiler has the AMX intrinsics */
#endif
