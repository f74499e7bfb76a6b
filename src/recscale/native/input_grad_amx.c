/*
 * bf16 input gradients on AMX tiles, with the ReLU mask of the layer below applied as
 * they are stored: out [batch, n] = (g [batch, k] . W [k, n]) where mask > 0, for a
 * dense layer's output gradient g and its weight W ([out, in], so k = out, n = in).
 *
 * Why: under bf16 on an AMX CPU the MLPs' backward ran torch.mm (oneDNN) for g . W and
 * then a ReLU mask over the result (threshold_backward): the mask pass reads the 2 MiB
 * product back and writes it again (0.29 ms of config A's step a 512-wide layer, on a
 * 2-vCPU Xeon). Here the product is masked while its tiles are stored, and the first
 * layer's input gradient can be stored in fp32 (no cast after it).
 *
 * Layouts. W is packed once a call into VNNI B tiles (amx_tiles.h; its rows are the
 * products' slow axis k): tile (u, s) at wp + (u S + s) 512 for S = ceil(k / 32) steps
 * and nt (even) tiles of 16 columns. Each block of 32 samples of g is copied into A tiles
 * (16 samples x 32 of k; samples past the batch and k past its end zeros, so any k
 * works - a logit's k = 1 too). A 2 x 2 block of C tiles (32 samples x 32 columns) sums every step in
 * the tiles (in chunks of K_CHUNK steps), then goes through fp32 scratch tiles: rounded
 * to bf16 (to nearest even, as torch rounds finite values) or kept in fp32, zero where
 * mask <= 0 (as threshold_backward: a NaN in mask keeps its gradient), columns past n
 * not stored.
 *
 * Speed: the tile loop runs at ~35% of the tiles' peak (2 x 2 blocks of C tiles, a load
 * of A and of B a product), which with the mask pass saved beats oneDNN's GEMM and
 * torch's mask up to 2^19 weights (the caller's rule) and loses beyond (1024 -> 1024
 * over 2048 samples, 2 threads: 2.7 against 2.2 ms).
 *
 * The layer's other gradients come from the same pass. With `sums`, each block p's
 * column sums of g (the bias gradient, in parts) go to sums[p k, p k + k). With `wa` and
 * `wb`, g and the layer's input x [batch, n] (which is the mask's tensor where there is
 * a mask) are packed as the weight gradient's tiles (weight_grad_amx.c's A and B, step p
 * for block p) while they are in registers, and recscale_wgrad_amx_gemm then multiplies
 * them: the same bits as that kernel's own packing, without its pass over g and x.
 *
 * recscale_igrad_amx_pack packs the pairs of W's tiles [lo, hi) of nt / 2;
 * recscale_igrad_amx runs the blocks of 32 samples [lo, hi). Each output is one
 * thread's, summed in a fixed order: the same bits however the parts split.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16_bits.h"
#include "recscale_native.h"

int recscale_igrad_round_only = 0;

#ifdef RS_HAVE_AMX

enum { K_CHUNK = 8 }; /* steps of 32 of k summed before the next column block */

int recscale_igrad_amx_pack(const uint16_t *w, int64_t ldw, int64_t k, int64_t n, uint16_t *wp,
                            int64_t lo, int64_t hi) {
    if (!recscale_amx_ready()) return -1;
    const int64_t steps = (k + 31) / 32;
    for (int64_t s = 0; s < steps; ++s)
        for (int64_t p = lo; p < hi; ++p) pack_b(w, ldw, n, k, steps, 2 * p, s, wp, NULL);
    return 0;
}

/* Which of 32 bf16 of x keep their gradient: all but x <= 0, as threshold_backward
 * (x > 0 as int16, or NaN: magnitude bits past +inf's) */
RS_PACK static inline __mmask32 kept(__m512i x) {
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7FFF));
    return _mm512_cmpgt_epi16_mask(x, _mm512_setzero_si512()) |
           _mm512_cmpgt_epi16_mask(mag, _mm512_set1_epi16(0x7F80));
}

/* Rows [0, nr) of a 32 x 32 fp32 block (its 4 tiles of 16 x 16 one after another, in
 * row-major order of tiles) to out at column c0 (< n):
 * masked, columns past n left alone; `to32` converts a row's 32 values to bf16. One
 * body for two targets: with AVX512-BF16 (every AMX CPU so far) one vcvtne2ps2bf16 a
 * row (a NaN keeps its sign), else the rounding in integer steps (a NaN becomes
 * torch's 0x7FC0). On 2 threads, 512 -> 256 over 2048 samples: the integer rounding's
 * epilogue took 0.12 ms of the call's 0.31, vcvtne2ps2bf16's 0.05 of 0.24. */
#define STORE_BLOCK_BODY(to32)                                                              \
    const int64_t left = n - c0;                                                          \
    const __mmask32 cols = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1); \
    for (int64_t q = 0; q < 16; ++q) {                                                    \
        __m512i xr[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};                 \
        for (int64_t r = 2 * q; r < 2 * q + 2 && r < nr; ++r) {                            \
            const float *row = tmp + (r / 16) * 512 + (r % 16) * 16; /* tile (r / 16, 0)'s */ \
            const __m512 v0 = _mm512_load_ps(row), v1 = _mm512_load_ps(row + 256);       \
            const __m512i xm = mask ? _mm512_maskz_loadu_epi16(cols, mask + r * ldm + c0)  \
                                    : _mm512_setzero_si512();                             \
            const __mmask32 on = mask ? kept(xm) : (__mmask32)0xFFFFFFFFu;                \
            if (wb) xr[r - 2 * q] = wx == mask ? xm : _mm512_maskz_loadu_epi16(cols, wx + r * ldx + c0); \
            if (out_f32) {                                                                \
                float *dst = (float *)out + r * ldo + c0;                                 \
                _mm512_mask_storeu_ps(dst, (__mmask16)(cols & on), v0);                   \
                _mm512_mask_storeu_ps(dst + 16, (__mmask16)((cols & on) >> 16), v1);      \
                if (~on & cols) { /* zeros where the mask is off */                      \
                    _mm512_mask_storeu_ps(dst, (__mmask16)(cols & ~on), _mm512_setzero_ps()); \
                    _mm512_mask_storeu_ps(dst + 16, (__mmask16)((cols & ~on) >> 16), _mm512_setzero_ps()); \
                }                                                                         \
            } else {                                                                      \
                _mm512_mask_storeu_epi16((uint16_t *)out + r * ldo + c0, cols,           \
                                         _mm512_maskz_mov_epi16(on, to32(v0, v1)));       \
            }                                                                             \
        }                                                                                 \
        if (wb) { /* x's two rows interleaved: row q of its B tiles c0 / 16, + 1 */       \
            __m512i p0, p1;                                                               \
            pairs32(xr[0], xr[1], &p0, &p1);                                              \
            _mm512_storeu_si512(wb + 32 * q, p0);                                         \
            _mm512_storeu_si512(wb + wsteps * TILE + 32 * q, p1);                         \
        }                                                                                 \
    }

RS_PACK static inline __m512i round32(__m512 v0, __m512 v1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(rs_bf16_round16(v0)), rs_bf16_round16(v1), 1);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static inline __m512i
cvt32(__m512 v0, __m512 v1) {
    return (__m512i)_mm512_cvtne2ps_pbh(v1, v0); /* v0's values in the low half */
}

RS_PACK static void store_block(const float *tmp, int64_t nr, int64_t c0, int64_t n,
                                const uint16_t *mask, int64_t ldm, void *out, int64_t ldo,
                                int64_t out_f32, const uint16_t *wx, int64_t ldx, uint16_t *wb,
                                int64_t wsteps) {
    STORE_BLOCK_BODY(round32)
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void
store_block_cvt(const float *tmp, int64_t nr, int64_t c0, int64_t n,
                const uint16_t *mask, int64_t ldm, void *out, int64_t ldo, int64_t out_f32,
                const uint16_t *wx, int64_t ldx, uint16_t *wb, int64_t wsteps) {
    STORE_BLOCK_BODY(cvt32)
}

/* Samples [b0, b0 + nr) of g as A tiles, zeros past nr (so the last block needs no
 * other path): tile (s, h) at ab + (2 s + h) 512 holds samples b0 + 16 h .., k 32 s ...
 * With `sums`, the block's column sums of g in fp32 (sums[0, k)), in sample order. With
 * `wa`, the same values as the weight gradient's A tiles (weight_grad_amx.c: g
 * transposed, tile (t, p) at wa + (t S + p) 512 for S = wsteps, p this block's step). */
RS_PACK static void copy_rows(const uint16_t *g, int64_t ldg, int64_t b0, int64_t nr, int64_t k,
                              int64_t steps, uint16_t *ab, float *sums, uint16_t *wa,
                              int64_t wsteps) {
    for (int64_t s = 0; s < steps; ++s) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        __m512i r0[16], r1[16];
        for (int64_t q = 0; q < 16; ++q) {
            const int64_t r = 2 * q;
            const __m512i va = r < nr ? load32(g + (b0 + r) * ldg, 32 * s, k) : _mm512_setzero_si512();
            const __m512i vb = r + 1 < nr ? load32(g + (b0 + r + 1) * ldg, 32 * s, k)
                                          : _mm512_setzero_si512();
            _mm512_store_si512(ab + (2 * s + r / 16) * TILE + 32 * (r % 16), va);
            _mm512_store_si512(ab + (2 * s + r / 16) * TILE + 32 * (r % 16 + 1), vb);
            if (sums) add_pair(acc, va, vb);
            if (wa) pairs32(va, vb, &r0[q], &r1[q]);
        }
        if (sums) { /* columns 32 s .. of k */
            const int64_t left = k - 32 * s;
            const __mmask32 cols = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
            _mm512_mask_storeu_ps(sums + 32 * s, (__mmask16)cols, _mm512_add_ps(acc[0], acc[2]));
            _mm512_mask_storeu_ps(sums + 32 * s + 16, (__mmask16)(cols >> 16),
                                  _mm512_add_ps(acc[1], acc[3]));
        }
        if (wa) store_transposed(r0, r1, wa + 2 * s * wsteps * TILE, wa + (2 * s + 1) * wsteps * TILE);
    }
}

/* The block's A tiles (ab) times every column tile of wp, stored. k runs in chunks of
 * K_CHUNK steps (16 KiB of A) across all the column tiles, the sums of a chunk left in
 * `acc` for the next as whole tiles of 1 KiB (on 2 threads at batch 2048, without chunks / with:
 * a 368 -> 512 layer 0.57 / 0.52 ms, 1024 -> 1024 2.88 / 2.70). */
RS_AMX static void row_block(const uint16_t *ab, const uint16_t *wp, int64_t steps, int64_t nt,
                             int64_t nr, int64_t n, const uint16_t *mask, int64_t ldm, void *out,
                             int64_t ldo, int64_t out_f32, float *acc, int cvt,
                             const uint16_t *wx, int64_t ldx, uint16_t *wb,
                             int64_t wsteps) {
    for (int64_t s0 = 0; s0 < steps; s0 += K_CHUNK) {
        const int64_t s1 = s0 + K_CHUNK < steps ? s0 + K_CHUNK : steps;
        for (int64_t u = 0; u < nt; u += 2) {
            float *c = acc + 512 * u; /* the block's 4 tiles, 1 KiB each */
            if (s0 == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else {
                _tile_loadd(0, c, 64);
                _tile_loadd(1, c + 256, 64);
                _tile_loadd(2, c + 512, 64);
                _tile_loadd(3, c + 768, 64);
            }
            const uint16_t *b0 = wp + u * steps * TILE, *b1 = b0 + steps * TILE;
            for (int64_t s = s0; s < s1; ++s)
                step_2x2(ab + 2 * s * TILE, ab + (2 * s + 1) * TILE, b0 + s * TILE, b1 + s * TILE);
            _tile_stored(0, c, 64);
            _tile_stored(1, c + 256, 64);
            _tile_stored(2, c + 512, 64);
            _tile_stored(3, c + 768, 64);
            if (s1 < steps) continue;
            uint16_t *wbu = wb ? wb + u * wsteps * TILE : NULL;
            if (cvt)
                store_block_cvt(c, nr, 16 * u, n, mask, ldm, out, ldo, out_f32, wx, ldx, wbu, wsteps);
            else
                store_block(c, nr, 16 * u, n, mask, ldm, out, ldo, out_f32, wx, ldx, wbu, wsteps);
        }
    }
}

RS_AMX int recscale_igrad_amx(const uint16_t *g, int64_t ldg, const uint16_t *wp,
                              const uint16_t *mask, int64_t ldm, void *out, int64_t ldo,
                              int64_t out_f32, float *sums, const uint16_t *x, int64_t ldx,
                              uint16_t *wa, uint16_t *wb, int64_t batch, int64_t k, int64_t n,
                              int64_t lo, int64_t hi) {
    if (!recscale_amx_ready()) return -1;
    if (wb && !x) return -2;
    const int64_t wsteps = (batch + 31) / 32;
    const int64_t steps = (k + 31) / 32, nt = 2 * ((n + 31) / 32);
    const int cvt = !recscale_igrad_round_only && (recscale_cpu_features() & RS_CPU_AVX512_BF16);
    uint16_t *ab = aligned_alloc(64, (size_t)(2 * steps * TILE) * sizeof(uint16_t));
    float *acc = aligned_alloc(64, (size_t)(512 * nt) * sizeof(float));
    if (!ab || !acc) {
        free(ab);
        free(acc);
        return -3;
    }
    load_tile_config();
    for (int64_t p = lo; p < hi; ++p) {
        const int64_t b0 = 32 * p, nr = batch - b0 < 32 ? batch - b0 : 32;
        copy_rows(g, ldg, b0, nr, k, steps, ab, sums ? sums + p * k : NULL,
                  wa ? wa + p * TILE : NULL, wsteps);
        const uint16_t *m = mask ? mask + b0 * ldm : NULL;
        void *o = out_f32 ? (void *)((float *)out + b0 * ldo) : (void *)((uint16_t *)out + b0 * ldo);
        const uint16_t *xb = x ? x + b0 * ldx : NULL;
        row_block(ab, wp, steps, nt, nr, n, m, ldm, o, ldo, out_f32, acc, cvt, xb, ldx, wb ? wb + p * TILE : NULL,
                  wsteps);
    }
    _tile_release();
    free(ab);
    free(acc);
    return 0;
}

#else /* no AMX here: the entry points exist and decline */

int recscale_igrad_amx_pack(const uint16_t *w, int64_t ldw, int64_t k, int64_t n, uint16_t *wp,
                            int64_t lo, int64_t hi) {
    (void)w, (void)ldw, (void)k, (void)n, (void)wp, (void)lo, (void)hi;
    return -1;
}

int recscale_igrad_amx(const uint16_t *g, int64_t ldg, const uint16_t *wp, const uint16_t *mask,
                       int64_t ldm, void *out, int64_t ldo, int64_t out_f32, float *sums,
                       const uint16_t *x, int64_t ldx, uint16_t *wa, uint16_t *wb, int64_t batch,
                       int64_t k, int64_t n, int64_t lo, int64_t hi) {
    (void)g, (void)ldg, (void)wp, (void)mask, (void)ldm, (void)out, (void)ldo, (void)out_f32;
    (void)sums, (void)x, (void)ldx, (void)wa, (void)wb;
    (void)batch, (void)k, (void)n, (void)lo, (void)hi;
    return -1;
}

#endif
