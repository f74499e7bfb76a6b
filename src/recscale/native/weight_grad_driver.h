/*
 * The blocked driver of weight_grad.c, written once and included once per instruction
 * set (a C template): the includer defines
 *
 *     WG_NAME       the function's name            WG_TARGET  its target attribute
 *     WG_NB         inputs per packed block (KC, the samples per block, is the file's)
 *     WG_MAX_NQ     vectors in a full block (WG_NB / the vector width)
 *     WG_DISPATCH(nq, kc, gp, xb, c, ldc, rows, cols, acc)
 *                   the micro-kernel on nq vectors (a switch to one specialised call each)
 *
 * and gets  static int WG_NAME(g, ldg, x, ldx, dw, lddw, db, xs, out, in, batch)  with
 * recscale_weight_grad's contract (see weight_grad.c). Everything but the micro-kernel
 * is the same for both widths, so it lives here once rather than twice.
 */

/* Pack one block of kc samples, reading g and x row by row (contiguous, so the
 * prefetchers stream them; a column strip of g would thrash the L1, its rows being a
 * power-of-two stride apart):
 *     g[k, t*MR + r]  -> gp[t][k][r]      (zero past `out`)
 *     x[k, j*NB + c]  -> xp[j][k][c]      (zero past `in`)
 * and db[o] += g[k, o], xs[i] += x[k, i]. */
WG_TARGET static void WG_CAT(WG_NAME, _pack)(const float *g, int64_t ldg, const float *x,
                                             int64_t ldx, int64_t out, int64_t in, int64_t kc,
                                             float *restrict gp, float *restrict xp,
                                             float *restrict db, float *restrict xs) {
    const int64_t full = out / MR, ntiles = (out + MR - 1) / MR;
    const int64_t nblocks = (in + WG_NB - 1) / WG_NB;
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
            const int64_t cols = in - j * WG_NB < WG_NB ? in - j * WG_NB : WG_NB;
            float *dst = xp + (j * kc + k) * WG_NB;
            memcpy(dst, xk + j * WG_NB, (size_t)cols * sizeof(float));
            if (cols < WG_NB) memset(dst + cols, 0, (size_t)(WG_NB - cols) * sizeof(float));
        }
    }
}

/* Returns 0, or -1 without memory for the packed blocks (nothing written). */
WG_TARGET static int WG_NAME(const float *g, int64_t ldg, const float *x, int64_t ldx, float *dw,
                             int64_t lddw, float *db, float *xs, int64_t out, int64_t in,
                             int64_t batch) {
    const int64_t ntiles = (out + MR - 1) / MR, nblocks = (in + WG_NB - 1) / WG_NB;
    float *gp = aligned_alloc(64, (size_t)(ntiles * MR * KC) * sizeof(float));
    float *xp = aligned_alloc(64, (size_t)(nblocks * WG_NB * KC) * sizeof(float));
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
        WG_CAT(WG_NAME, _pack)(g + k0 * ldg, ldg, x + k0 * ldx, ldx, out, in, kc, gp, xp, db, xs);
        /* the next block's rows of g and x, spread over this block's micro-kernel calls:
         * the pack then reads them from the L2 instead of waiting on memory (config B's
         * step 173.2 -> 169.8 and 167.1 -> 164.9 ms; A level) */
        const int64_t nk = batch - k0 - kc < KC ? batch - k0 - kc : KC;
        const int64_t glines = (out + 15) / 16, xlines = (in + 15) / 16;
        const int64_t plines = nk > 0 ? nk * (glines + xlines) : 0, calls = nblocks * ntiles;
        int64_t call = 0, pdone = 0, prow = 0, pc = 0; /* lines issued; the next one's place */
        for (int64_t j = 0; j < nblocks; ++j) {
            const int64_t i0 = j * WG_NB, cols = in - i0 < WG_NB ? in - i0 : WG_NB;
            const int64_t nq = (cols + WG_NB / WG_MAX_NQ - 1) / (WG_NB / WG_MAX_NQ);
            const float *xb = xp + j * kc * WG_NB;
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
                WG_DISPATCH(nq, kc, gt, xb, c, lddw, rows, cols, acc);
            }
        }
    }
    free(gp);
    free(xp);
    return 0;
}
