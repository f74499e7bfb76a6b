/*
 * The store of an AVX-512 weight-gradient micro-kernel's tile, shared by the fp32 kernel
 * (weight_grad.c) and the bf16 one (weight_grad_bf16.c): both keep an MR x (16 nq) tile
 * of dw in zmm accumulators a[r][q] and write it here. The includer defines MR and
 * includes <immintrin.h>; always inlined (the accumulators stay in registers), into
 * functions whose target includes avx512f.
 *
 * c[r, 16 q + j] (row stride ldc; rows x cols valid) = a[r][q][j], or += with accumulate.
 */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
store_tile512(const int nq, __m512 a[MR][4], float *restrict c, int64_t ldc, int64_t rows,
              int64_t cols, int accumulate) {
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
    float tmp[MR][64] __attribute__((aligned(64)));
    for (int r = 0; r < MR; ++r)
        for (int q = 0; q < nq; ++q) _mm512_store_ps(&tmp[r][16 * q], a[r][q]);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j)
            c[r * ldc + j] = accumulate ? c[r * ldc + j] + tmp[r][j] : tmp[r][j];
}
