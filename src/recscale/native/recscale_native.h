/*
 * Every function the native library exports, declared once. Each .c file includes this
 * header, so the compiler holds its definitions to these declarations; the Python
 * bindings (native/__init__.py) are made from the block between the two "python"
 * markers, and tests/test_native_header.py checks that every exported symbol is here.
 *
 * Types the bindings understand: int64_t, int, float, double, void, and pointers (any
 * pointer is passed as an address; `const char *` as bytes).
 */
#ifndef RECSCALE_NATIVE_H
#define RECSCALE_NATIVE_H

#include <stdint.h>

/* Bump with any change of a signature below (Python refuses a library of another ABI). */
#define RECSCALE_NATIVE_ABI 34

/* recscale_cpu_features(): what this CPU, its OS and hypervisor let the kernels use */
#define RS_CPU_AVX2 1        /* AVX2 + FMA + F16C: the library's floor */
#define RS_CPU_AVX512F 2     /* the wider weight-gradient, narrow-layer, interaction tiles */
#define RS_CPU_AVX512_BF16 4 /* vdpbf16ps */
#define RS_CPU_AMX_BF16 8    /* AMX tiles in bf16 */

/* @python-begin */
int recscale_native_abi(void);
int recscale_cpu_features(void);

int64_t recscale_pooled_lookup(const void *weight, int64_t dim, const int64_t *values,
                               const int64_t *offsets, int64_t batch_size, int64_t num_features,
                               int64_t f0, int64_t f1, const int64_t *row_offset,
                               const int64_t *table_size, const float *psw, void *out,
                               int64_t *rows, int64_t *bag_of_id, int64_t wt, int64_t out_bf16);
int recscale_sparse_update(int64_t kind, void *weight, int64_t dim, float *state1, float *state2,
                           const int64_t *rows, const int64_t *seg_starts, int64_t s0, int64_t s1,
                           const int64_t *bag_of_id, const float *psw, const void *grad,
                           int64_t grad_stride, float lr, float eps, float beta1, float beta2,
                           float step_size, uint8_t *dirty, int64_t wt, int64_t step,
                           uint16_t *low, int64_t grad_bf16);
int recscale_dot_forward(const float *dense, const float *emb, float *out, int64_t b0, int64_t b1,
                         int64_t k, int64_t d, int64_t has_dense, int64_t self_interaction,
                         int64_t width, int64_t dense_stride, int64_t emb_sample_stride,
                         int64_t emb_feature_stride);
int recscale_dot_backward(const float *dense, const float *emb, const float *grad_out,
                          float *grad_dense, float *grad_emb, int64_t b0, int64_t b1, int64_t k,
                          int64_t d, int64_t has_dense, int64_t self_interaction, int64_t width,
                          int64_t dense_stride, int64_t emb_sample_stride,
                          int64_t emb_feature_stride, int64_t grad_sample_stride,
                          int64_t grad_feature_stride);
int recscale_weight_grad(const float *g, int64_t ldg, const float *x, int64_t ldx, float *dw,
                         int64_t lddw, float *db, float *xs, int64_t out, int64_t in,
                         int64_t batch, int64_t isa);
int recscale_weight_grad_bf16(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx,
                              float *dw, int64_t lddw, float *db, float *xs, int64_t out,
                              int64_t in, int64_t batch);
int recscale_amx_ready(void);
int recscale_wgrad_amx_pack(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx,
                            uint16_t *a, uint16_t *b, float *sums, int64_t sums_of_x, int64_t m,
                            int64_t n, int64_t batch, int64_t mt, int64_t lo, int64_t hi);
int recscale_wgrad_amx_gemm(const uint16_t *a, const uint16_t *b, float *c, int64_t ldc,
                            int64_t rows, int64_t cols, int64_t batch, int64_t lo, int64_t hi);
int recscale_igrad_amx_pack(const uint16_t *w, int64_t ldw, int64_t k, int64_t n, uint16_t *wp,
                            int64_t lo, int64_t hi);
int recscale_igrad_amx(const uint16_t *g, int64_t ldg, const uint16_t *wp, const uint16_t *mask,
                       int64_t ldm, void *out, int64_t ldo, int64_t out_f32, float *sums,
                       const uint16_t *x, int64_t ldx, uint16_t *wa, uint16_t *wb, int64_t batch,
                       int64_t k, int64_t n, int64_t lo, int64_t hi);
int recscale_narrow_weight_grad(const float *g, int64_t ldg, const float *mask, int64_t ldm,
                                const float *x, int64_t ldx, float *dw, int64_t lddw, float *db,
                                int64_t out, int64_t in, int64_t batch);
int recscale_narrow_forward(const float *x, int64_t ldx, const float *w, int64_t ldw,
                            const float *bias, float *h, int64_t ldh, int64_t out, int64_t in,
                            int64_t batch, int64_t relu);
void recscale_logit_forward(const float *h, int64_t ldh, const float *w, float bias, float *z,
                            int64_t batch, int64_t n);
void recscale_logit_backward(const float *h, int64_t ldh, const float *w, const float *dz,
                             float *dw, float *db, float *dh, int64_t lddh, int64_t batch,
                             int64_t n, int mask);

int recscale_logit_backward_bf16(const uint16_t *h, int64_t ldh, const uint16_t *w,
                                 const uint16_t *dz, float *dwp, float *dbp, uint16_t *dh,
                                 int64_t lddh, int64_t batch, int64_t n, int64_t mask, int64_t lo,
                                 int64_t hi);
int recscale_narrow_wgrad_bf16(const uint16_t *g, int64_t ldg, const uint16_t *x, int64_t ldx,
                               float *dw, float *db, int64_t out, int64_t in, int64_t batch,
                               int64_t lo, int64_t hi);

int recscale_dot_forward_bf16(const void *dense, const void *emb, uint16_t *out16, int64_t b0,
                              int64_t b1, int64_t k, int64_t d, int64_t has_dense,
                              int64_t self_interaction, int64_t width, int64_t dense_stride,
                              int64_t emb_sample_stride, int64_t emb_feature_stride,
                              int64_t in_bf16);
int recscale_dot_backward_bf16(const void *dense, const void *emb, const uint16_t *grad16,
                               void *grad_dense, void *grad_emb, int64_t b0, int64_t b1,
                               int64_t k, int64_t d, int64_t has_dense, int64_t self_interaction,
                               int64_t width, int64_t dense_stride, int64_t emb_sample_stride,
                               int64_t emb_feature_stride, int64_t grad_sample_stride,
                               int64_t grad_feature_stride, int64_t in_bf16);
/* 1 when the two above run bf16 T on AMX tiles (dot_interaction_amx.c): k <= 32 rows, d
 * = 16 or a multiple of 32 up to 256, no self pairs, an AMX CPU and recscale_dot_amx set */
int recscale_dot_amx_applies(int64_t k, int64_t d, int64_t self_interaction);

/* dense_sgd.c: SGD over a list of fp32 tensors (addresses in w, g; wb: bf16 copies or 0),
 * blocks [lo, hi) of `block` elements numbered through the list; -1 without AVX2 */
int recscale_sgd_bf16(int64_t tensors, const int64_t *w, const int64_t *g, const int64_t *wb,
                      const int64_t *numel, int64_t block, float lr, float wd, int64_t lo,
                      int64_t hi);

int recscale_team_init(const char *path);
int64_t recscale_team_kernel_id(const char *name);
int recscale_team_run(int64_t kernel, int64_t parts, int64_t nargs, const int64_t *ints,
                      const float *floats, int64_t *rc, double *began, double *took,
                      int64_t *done);
int recscale_team_flush_denormal(int64_t on, int64_t threads);

int64_t recscale_row_io(int fd, int write, const int64_t *pos, int64_t n, int64_t row_bytes,
                        void *buf, int64_t depth, int64_t engine);
int recscale_io_uring_available(void);
/* the process that set up the calling thread's ring (0: none yet, or no io_uring) */
int recscale_io_uring_owner(void);
int64_t recscale_row_io_direct(int fd, int write, const int64_t *pos, int64_t n,
                               int64_t row_bytes, void *buf, int64_t depth, int64_t engine,
                               int64_t block);
void recscale_row_copy(void *base, int write, const int64_t *pos, int64_t n, int64_t row_bytes,
                       void *buf);
int64_t recscale_row_move(float *table, int64_t table_width, int64_t table_rows,
                          const int32_t *position, const int64_t *rows, const int64_t *slots,
                          int64_t n, int to_table, int64_t parts, const int64_t *part_base,
                          const int64_t *part_width, const int64_t *part_col);
int64_t recscale_unique_ids(const int64_t *ids, int64_t n, int64_t *uniq, int64_t *inverse);
int64_t recscale_cache_probe(const int32_t *slot_of_row, int64_t num_rows, const int64_t *rows,
                             int64_t n, int64_t *slots, int64_t *missing);
int64_t recscale_unique_probe(const int64_t *ids, int64_t n, const int32_t *slot_of_row,
                              int64_t num_rows, int64_t *uniq, int64_t *inverse, int64_t *slots,
                              int64_t *missing, int64_t *counts);
int64_t recscale_disjoint_cuts(const int64_t *ids, int64_t n, int64_t parts, int64_t *bounds);
int64_t recscale_unique_probe_part(const int64_t *ids, int64_t lo, int64_t hi,
                                   const int32_t *slot_of_row, int64_t num_rows, int64_t *uniq,
                                   int64_t *inverse, int64_t *slots, int64_t *missing,
                                   int64_t *counts);
void recscale_unique_probe_join(const int64_t *bounds, int64_t parts, const int64_t *counts,
                                int64_t *uniq, int64_t *inverse, int64_t *slots,
                                int64_t *missing, int64_t *total);
void recscale_cache_install(int32_t *slot_of_row, int64_t *row_of_slot, uint8_t *dirty,
                            const int64_t *rows, const int64_t *slots, int64_t n);
void recscale_cache_touch(double *score, const int64_t *slots, int64_t n, int lru,
                          double value);
int64_t recscale_cache_candidates(const int64_t *slots, int64_t n, const uint8_t *blocked,
                                  const int64_t *row_of_slot, const double *score, int64_t *cand,
                                  double *cand_score);
void recscale_cache_clear(int32_t *slot_of_row, int64_t *row_of_slot, double *score,
                          const int64_t *victims, int64_t n);
/* @python-end */

/* Between the C files only. */
int rs_uring_rw(int fd, int write, int64_t n, const int64_t *off, char *const *ptr,
                const int64_t *len, int64_t depth);
/* bf: T (dense, emb) and, in the backward, its gradients bf16 */
int recscale_dot_forward_wide(const void *dense, const void *emb, float *out, int64_t b0,
                              int64_t b1, int64_t k, int64_t d, int64_t e0, int64_t offset,
                              int64_t width, int64_t dsb, int64_t esb, int64_t esf, int64_t bf);
int recscale_dot_backward_wide(const void *dense, const void *emb, const float *g,
                               void *grad_dense, void *grad_emb, int64_t b0, int64_t b1,
                               int64_t k, int64_t d, int64_t e0, int64_t offset, int64_t width,
                               int64_t dsb, int64_t esb, int64_t esf, int64_t gsb, int64_t gsf,
                               int64_t bf);
/* dot_interaction_narrow.c: the AVX-512 interaction for any d - its narrow kernels (d = 16
 * or 32, k <= 32), else the wide ones above; bf as theirs */
int recscale_dot_forward_avx512(const void *dense, const void *emb, float *out, int64_t b0,
                                int64_t b1, int64_t k, int64_t d, int64_t e0, int64_t offset,
                                int64_t width, int64_t dsb, int64_t esb, int64_t esf, int64_t bf);
int recscale_dot_backward_avx512(const void *dense, const void *emb, const float *g,
                                 void *grad_dense, void *grad_emb, int64_t b0, int64_t b1,
                                 int64_t k, int64_t d, int64_t e0, int64_t offset, int64_t width,
                                 int64_t dsb, int64_t esb, int64_t esf, int64_t gsb, int64_t gsf,
                                 int64_t bf);
extern _Thread_local int64_t rs_dot_part_samples; /* dot_interaction_avx512.c */
/* dot_interaction_amx.c: bf16 T, bf16 row and gradient on AMX tiles (where
 * recscale_dot_amx_applies); -1 where they do not apply */
int recscale_dot_forward_amx(const uint16_t *dense, const uint16_t *emb, uint16_t *out,
                             int64_t b0, int64_t b1, int64_t k, int64_t d, int64_t has_dense,
                             int64_t width, int64_t dsb, int64_t esb, int64_t esf);
int recscale_dot_backward_amx(const uint16_t *dense, const uint16_t *emb, const uint16_t *g16,
                              uint16_t *grad_dense, uint16_t *grad_emb, int64_t b0, int64_t b1,
                              int64_t k, int64_t d, int64_t has_dense, int64_t width, int64_t dsb,
                              int64_t esb, int64_t esf, int64_t gsb, int64_t gsf);
__attribute__((visibility("hidden"))) int recscale_tile_scratch(int64_t k, int64_t d, float **zero,
                                                                const float ***rows,
                                                                int64_t **start);
__attribute__((visibility("hidden"))) void recscale_tile_scratch_free(float *zero,
                                                                      const float **rows,
                                                                      int64_t *start);

/* Test hooks (set through ctypes): which kernel width runs, when stores stream, how
 * fp32 becomes bf16. */
extern int recscale_dot_wide;                 /* dot_interaction.c */
extern int recscale_dot_amx;                  /* dot_interaction_amx.c: 0 = AVX-512 */
extern int recscale_narrow_isa;               /* narrow_layer.c */
extern int64_t recscale_dot_stream_bytes;     /* dot_interaction_avx512.c */
extern int recscale_igrad_round_only;         /* input_grad_amx.c: 1 = no vcvtne2ps2bf16 */
extern int recscale_sgd_wide;                 /* dense_sgd.c: 0 = the AVX2 pass */

#endif
