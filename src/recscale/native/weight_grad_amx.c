/*
 * bf16 weight gradients on AMX tiles: dW [m, n] = g^T x in fp32, for g [batch, m] and
 * x [batch, n] (bf16 rows, the samples the slow axis, any row stride), and the bias
 * gradient (the column sums of g, or of x) on the way. For a narrow input the caller
 * passes the operands swapped (x^T g) and transposes the small result.
 *
 * Why: on an AMX CPU the AVX512-BF16 kernel (weight_grad_bf16.c, vdpbf16ps) runs at a
 * sixth of oneDNN's tile GEMM, and oneDNN rounds its results to bf16 and wants g
 * transposed (a torch copy of g^T costs half the product). Here the operands are
 * packed into tiles by our own pass, and the tile products accumulate in fp32 and are
 * stored in fp32.
 *
 * AMX multiplies C [16, 16] fp32 += A [16, 32] bf16 . B [32, 16] bf16, A with its 32
 * products (the samples) contiguous in each row, B in "VNNI" rows (pairs of samples
 * interleaved). Two packed arrays, S = ceil(batch / 32) steps of 32 samples:
 *
 *   A tile (t, s) at A + (t S + s) 512:  row r, element c = g[32 s + c][16 t + r]
 *   B tile (u, s) at B + (u S + s) 512:  row q, element 2 c + e = x[32 s + 2 q + e][16 u + c]
 *
 * 1 KiB each, read with a 64-byte stride. Samples past batch and columns past m or n
 * are zeros; mt and nt (tiles of 16 outputs, of 16 inputs) are even, for 2 x 2 blocks of
 * C tiles. Packing A is a transpose: per pair of samples, the two rows' values
 * interleave into 32-bit pairs, and a 16 x 16 transpose of those pairs makes the 16
 * rows of a tile. B's rows are the interleaved pairs themselves.
 *
 * recscale_wgrad_amx_pack packs pairs of tiles [lo, hi) of the (mt + nt) / 2 (A's, then
 * B's; a pair reads 64-byte lines whole) and sums the columns of g (or of x:
 * sums_of_x); recscale_wgrad_amx_gemm then multiplies the pairs of A's tile rows
 * [lo, hi) into C [rows, cols] (row stride ldc; the blocks that cross its edge through a
 * scratch block). Each element of C is one thread's, summed in a fixed order: the same
 * bits however the parts split.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "recscale_native.h"

#ifdef RS_HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>

/* The product's blocks: K_BLOCK steps (2048 samples) of M_BLOCK pairs of A's tile rows
 * (256 outputs; 1 MiB) stay in the L2 while every pair of B's tiles passes them, and C
 * stays in the tiles for a whole block. (Config B's 1024 -> 1024 over 2048 samples on
 * 2 threads: 16 x 8 1.85 ms, 32 x 4 1.84, 64 x 4 1.75, 64 x 8 1.68.) */
enum { K_BLOCK = 64 };
enum { M_BLOCK = 8 };

/* 1 when this process may use AMX tiles: the CPU has AMX-BF16 and Linux grants the
 * tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
int recscale_amx_ready(void) {
    static int ready = -1;
    if (ready >= 0) return ready;
    ready = (recscale_cpu_features() & RS_CPU_AMX_BF16) &&
            syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ready;
}


/* Step s (samples 32 s .. 32 s + 31) of A's tiles t and t + 1 (t even); with `sums`,
 * the step's sums of g's columns 16 t .. 16 t + 31 added to them. */
RS_PACK static void pack_a(const uint16_t *g, int64_t ldg, int64_t m, int64_t batch, int64_t steps,
                           int64_t t, int64_t s, uint16_t *a, float *sums) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    __m512i r0[16], r1[16];
    for (int q = 0; q < 16; ++q) {
        const int64_t b = 32 * s + 2 * q;
        const __m512i va = load32(sample(g, ldg, b, batch), 16 * t, m);
        const __m512i vb = load32(sample(g, ldg, b + 1, batch), 16 * t, m);
        if (sums) add_pair(acc, va, vb);
        pairs32(va, vb, &r0[q], &r1[q]);
    }
    uint16_t *tile0 = a + (t * steps + s) * TILE;
    store_transposed(r0, r1, tile0, tile0 + steps * TILE);
    if (sums) add_sums(acc, sums, t, m);
}

int recscale_wgrad_amx_pack(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx,
                            uint16_t *a, uint16_t *b, float *sums, int64_t sums_of_x, int64_t m,
                            int64_t n, int64_t batch, int64_t mt, int64_t lo, int64_t hi) {
    if (!recscale_amx_ready()) return -1; /* an AMX CPU has the AVX-512 BW/VL packing needs */
    const int64_t steps = (batch + 31) / 32;
    float *sums_a = sums_of_x ? NULL : sums, *sums_b = sums_of_x ? sums : NULL;
    for (int64_t k = lo; k < hi; ++k) { /* the part's sums start at zero */
        float *dst = 2 * k < mt ? sums_a : sums_b;
        if (dst) memset(dst + 16 * (2 * k < mt ? 2 * k : 2 * k - mt), 0, 32 * sizeof(float));
    }
    /* the steps outermost: each sample's row is read along, not down a column strip (a
     * strip's lines, rows apart, miss the prefetchers and wait on memory one by one) */
    for (int64_t s = 0; s < steps; ++s)
        for (int64_t k = lo; k < hi; ++k) { /* pairs of tiles */
            if (2 * k < mt)
                pack_a(g, ldg, m, batch, steps, 2 * k, s, a, sums_a);
            else
                pack_b(x, ldx, n, batch, steps, 2 * k - mt, s, b, sums_b);
        }
    return 0;
}

/* Whether C's 2 x 2 block of tiles at rows 16 t, columns 16 u crosses its edge. */
static inline int crosses_edge(int64_t t, int64_t u, int64_t rows, int64_t cols) {
    return 16 * t + 32 > rows || 16 * u + 32 > cols;
}

/* C's 2 x 2 block of tiles at rows 16 t, columns 16 u over steps [s0, s1): from zero or
 * from C (`load`), stored back to C - through `tmp` where the block crosses C's edge. */
RS_AMX static inline void block(const uint16_t *a, const uint16_t *b, float *c, int64_t ldc,
                                int64_t rows, int64_t cols, int64_t steps, int64_t t,
                                int64_t u, int64_t s0, int64_t s1, int load, float *tmp) {
    const int64_t cs = ldc * (int64_t)sizeof(float);
    float *c00 = c + 16 * t * ldc + 16 * u, *c10 = c00 + 16 * ldc;
    const int edge = crosses_edge(t, u, rows, cols);
    if (load) { /* never at an edge: edge blocks take all their steps at once */
        _tile_loadd(0, c00, cs);
        _tile_loadd(1, c00 + 16, cs);
        _tile_loadd(2, c10, cs);
        _tile_loadd(3, c10 + 16, cs);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    const uint16_t *a0 = a + t * steps * TILE, *a1 = a0 + steps * TILE;
    const uint16_t *b0 = b + u * steps * TILE, *b1 = b0 + steps * TILE;
    for (int64_t s = s0; s < s1; ++s)
        step_2x2(a0 + s * TILE, a1 + s * TILE, b0 + s * TILE, b1 + s * TILE);
    if (!edge) {
        _tile_stored(0, c00, cs);
        _tile_stored(1, c00 + 16, cs);
        _tile_stored(2, c10, cs);
        _tile_stored(3, c10 + 16, cs);
        return;
    }
    _tile_stored(0, tmp, 128); /* tmp: the block's 32 x 32, row stride 32 floats */
    _tile_stored(1, tmp + 16, 128);
    _tile_stored(2, tmp + 16 * 32, 128);
    _tile_stored(3, tmp + 16 * 32 + 16, 128);
    const int64_t nr = rows - 16 * t < 32 ? rows - 16 * t : 32;
    const int64_t nc = cols - 16 * u < 32 ? cols - 16 * u : 32;
    for (int64_t r = 0; r < nr; ++r) memcpy(c00 + r * ldc, tmp + 32 * r, (size_t)nc * sizeof(float));
}

RS_AMX int recscale_wgrad_amx_gemm(const uint16_t *a, const uint16_t *b, float *c, int64_t ldc,
                                   int64_t rows, int64_t cols, int64_t batch, int64_t lo,
                                   int64_t hi) {
    if (!recscale_amx_ready()) return -1;
    const int64_t steps = (batch + 31) / 32, nt = 2 * ((cols + 31) / 32);
    float tmp[32 * 32];
    load_tile_config();
    for (int64_t s0 = 0; s0 < steps; s0 += K_BLOCK) {
        const int64_t s1 = s0 + K_BLOCK < steps ? s0 + K_BLOCK : steps;
        for (int64_t p0 = lo; p0 < hi; p0 += M_BLOCK) {
            const int64_t p1 = p0 + M_BLOCK < hi ? p0 + M_BLOCK : hi;
            for (int64_t u = 0; u < nt; u += 2)
                for (int64_t p = p0; p < p1; ++p) {
                    const int64_t t = 2 * p;
                    if (!crosses_edge(t, u, rows, cols))
                        block(a, b, c, ldc, rows, cols, steps, t, u, s0, s1, s0 > 0, tmp);
                    else if (s0 == 0) /* an edge block: every step now, C written once */
                        block(a, b, c, ldc, rows, cols, steps, t, u, 0, steps, 0, tmp);
                }
        }
    }
    _tile_release();
    return 0;
}

#else /* no AMX here: the entry points exist and decline */

int recscale_amx_ready(void) { return 0; }

int recscale_wgrad_amx_pack(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx,
                            uint16_t *a, uint16_t *b, float *sums, int64_t sums_of_x, int64_t m,
                            int64_t n, int64_t batch, int64_t mt, int64_t lo, int64_t hi) {
    (void)g, (void)ldg, (void)x, (void)ldx, (void)a, (void)b, (void)sums, (void)sums_of_x;
    (void)m, (void)n;
    (void)batch, (void)mt, (void)lo, (void)hi;
    return -1;
}

int recscale_wgrad_amx_gemm(const uint16_t *a, const uint16_t *b, float *c, int64_t ldc,
                            int64_t rows, int64_t cols, int64_t batch, int64_t lo, int64_t hi) {
    (void)a, (void)b, (void)c, (void)ldc, (void)rows, (void)cols, (void)batch, (void)lo;
    (void)hi;
    return -1;
}

#endif
