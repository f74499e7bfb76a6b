/*
 * The dot interaction's bf16 edges (dot_interaction.c's contract, AVX512-BF16 CPUs): the
 * forward's output row written in bf16 and the backward's incoming gradient read in
 * bf16, for a bf16 top MLP on either side. T (the bottom MLP's output and the pooled
 * embeddings) stays fp32 unless in_bf16 (below); every sum is fp32.
 *
 *     forward   out16[b] = bf16(out[b])    rounded to nearest even as torch casts fp32
 *                                          to bf16 (a NaN stays a NaN: 0x7FC0)
 *     backward  the fp32 kernel's results for g[b] = float(g16[b])  (exact)
 *
 * in_bf16 (d a multiple of 16: d >= 64, or 16 and 32 with k <= 32): T comes in bf16 too
 * (the native lookup's bf16 pooled vectors and the bf16 bottom MLP's output), read by
 * the AVX-512 tiles (dot_interaction_avx512.c) or the narrow kernels
 * (dot_interaction_narrow.c) widened exactly - the fp32 kernel's sums on the widened
 * rows - and T's gradients written in bf16 (rounded as above); where AMX applies
 * (dot_interaction_amx.c: d = 16 or a multiple of 32, k <= 32, no self pairs) the tiles
 * take the whole range instead, their fp32 sums in the tiles' order. So config B's [2048, 27,
 * 128] pooled vectors and their gradient cross memory at half the bytes.
 *
 * Both run the kernels over blocks of BLOCK samples into (or out of) a scratch block of
 * fp32 rows that stays in the core's cache. Why: the fp32 output row of
 * config A's interaction ([2048, 368], 3 MiB) was written, read back by the top MLP's
 * cast to bf16 and written again as 1.5 MiB; its gradient came back as fp32 from the
 * top MLP's first layer. On a 2-vCPU VM each pass over a few MiB of activation costs
 * 0.1-0.2 ms.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16_bits.h"
#include "recscale_native.h"

enum { BLOCK = 32 }; /* samples a scratch block: 32 x 480 fp32 = 60 KiB for config B */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RS_DOT_BF16_X86 1

/* n bf16 -> fp32 (exact) */
RS_BF16_BITS static void to_fp32(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = rs_lanes16(n - i);
        _mm512_mask_storeu_ps(dst + i, m, rs_bf16_widen16(_mm256_maskz_loadu_epi16(m, src + i)));
    }
}
#endif

/* recscale_dot_forward's arguments (dense, emb bf16 with in_bf16); out16 [b, width] bf16 */
int recscale_dot_forward_bf16(const void *dense, const void *emb, uint16_t *out16, int64_t b0,
                              int64_t b1, int64_t k, int64_t d, int64_t has_dense,
                              int64_t self_interaction, int64_t width, int64_t dense_stride,
                              int64_t emb_sample_stride, int64_t emb_feature_stride,
                              int64_t in_bf16) {
#ifdef RS_DOT_BF16_X86
    if (!rs_bf16_ready()) return -1;
    if (in_bf16 && recscale_dot_amx_applies(k, d, self_interaction)) /* bf16 in and out */
        return recscale_dot_forward_amx(dense, emb, out16, b0, b1, k, d, has_dense, width,
                                        dense_stride, emb_sample_stride, emb_feature_stride);
    float *rows = malloc((size_t)(BLOCK * width) * sizeof(float));
    int rc = rows ? 0 : -2;
    for (int64_t c0 = b0; c0 < b1 && rc == 0; c0 += BLOCK) {
        const int64_t n = b1 - c0 < BLOCK ? b1 - c0 : BLOCK;
        if (in_bf16) /* the AVX-512 kernels read the bf16 rows in place */
            rc = recscale_dot_forward_avx512(
                has_dense ? (const uint16_t *)dense + c0 * dense_stride : NULL,
                (const uint16_t *)emb + c0 * emb_sample_stride, rows, 0, n, k, d, has_dense != 0,
                self_interaction ? 0 : 1, width, dense_stride, emb_sample_stride,
                emb_feature_stride, 1);
        else
            rc = recscale_dot_forward(
                has_dense ? (const float *)dense + c0 * dense_stride : NULL,
                (const float *)emb + c0 * emb_sample_stride, rows, 0, n, k, d, has_dense,
                self_interaction, width, dense_stride, emb_sample_stride, emb_feature_stride);
        if (rc == 0) rs_bf16_round_n(rows, out16 + c0 * width, n * width);
    }
    free(rows);
    return rc;
#else
    (void)dense, (void)emb, (void)out16, (void)b0, (void)b1, (void)k, (void)d, (void)has_dense;
    (void)self_interaction, (void)width, (void)dense_stride, (void)emb_sample_stride;
    (void)emb_feature_stride, (void)in_bf16;
    return -1;
#endif
}

/* recscale_dot_backward's arguments; grad16 [b, width] bf16 (row stride width); with
 * in_bf16 dense, emb, grad_dense ([b, d]) and grad_emb are bf16 */
int recscale_dot_backward_bf16(const void *dense, const void *emb, const uint16_t *grad16,
                               void *grad_dense, void *grad_emb, int64_t b0, int64_t b1,
                               int64_t k, int64_t d, int64_t has_dense, int64_t self_interaction,
                               int64_t width, int64_t dense_stride, int64_t emb_sample_stride,
                               int64_t emb_feature_stride, int64_t grad_sample_stride,
                               int64_t grad_feature_stride, int64_t in_bf16) {
#ifdef RS_DOT_BF16_X86
    if (!rs_bf16_ready()) return -1;
    if (in_bf16 && recscale_dot_amx_applies(k, d, self_interaction))
        return recscale_dot_backward_amx(dense, emb, grad16, grad_dense, grad_emb, b0, b1, k, d,
                                         has_dense, width, dense_stride, emb_sample_stride,
                                         emb_feature_stride, grad_sample_stride,
                                         grad_feature_stride);
    float *rows = malloc((size_t)(BLOCK * width) * sizeof(float));
    int rc = rows ? 0 : -2;
    rs_dot_part_samples = b1 - b0; /* fp32 stores stream as for the whole part */
    for (int64_t c0 = b0; c0 < b1 && rc == 0; c0 += BLOCK) {
        const int64_t n = b1 - c0 < BLOCK ? b1 - c0 : BLOCK;
        to_fp32(grad16 + c0 * width, rows, n * width);
        if (in_bf16) /* the AVX-512 kernels read T and write its gradients in bf16 in place */
            rc = recscale_dot_backward_avx512(
                has_dense ? (const uint16_t *)dense + c0 * dense_stride : NULL,
                (const uint16_t *)emb + c0 * emb_sample_stride, rows,
                has_dense ? (uint16_t *)grad_dense + c0 * d : NULL,
                (uint16_t *)grad_emb + c0 * grad_sample_stride, 0, n, k, d, has_dense != 0,
                self_interaction ? 0 : 1, width, dense_stride, emb_sample_stride,
                emb_feature_stride, grad_sample_stride, grad_feature_stride, 1);
        else
            rc = recscale_dot_backward(
                has_dense ? (const float *)dense + c0 * dense_stride : NULL,
                (const float *)emb + c0 * emb_sample_stride, rows,
                has_dense ? (float *)grad_dense + c0 * d : NULL,
                (float *)grad_emb + c0 * grad_sample_stride, 0, n, k, d, has_dense,
                self_interaction, width, dense_stride, emb_sample_stride, emb_feature_stride,
                grad_sample_stride, grad_feature_stride);
    }
    rs_dot_part_samples = 0;
    free(rows);
    return rc;
#else
    (void)dense, (void)emb, (void)grad16, (void)grad_dense, (void)grad_emb, (void)b0, (void)b1;
    (void)k, (void)d, (void)has_dense, (void)self_interaction, (void)width, (void)dense_stride;
    (void)emb_sample_stride, (void)emb_feature_stride, (void)grad_sample_stride;
    (void)grad_feature_stride, (void)in_bf16;
    return -1;
#endif
}
