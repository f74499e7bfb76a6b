/*
 * Run the parts of a native kernel call on torch's own OpenMP thread team.
 *
 * Why: every parallel op torch runs (oneDNN's GEMMs, the ReLU masks, ...) wakes torch's
 * OpenMP worker, and our kernels split their work over a Python thread of our own. On a
 * VM a sleeping thread is woken through the hypervisor (~50 us: config A's step pays it
 * ~30 times); letting the OpenMP worker spin between ops instead does not help while our
 * Python thread also wants that core (the two fight for it: the worker then starts
 * ~400 us late). Run on the same team, our parts and torch's ops share the one worker,
 * which can then spin through the short gaps of a step (GOMP_SPINCOUNT).
 *
 * The team is libgomp's, looked up in the library torch already loaded (never a second
 * OpenMP runtime: two would each keep a worker per core). `recscale_team_init` takes
 * that library's path; without it (no libgomp, another OS) callers keep the Python pool.
 *
 * A call is one of our kernels (`recscale_team_kernel_id`), `parts` argument rows laid
 * out as
 *
 *     ints   [parts][nargs]  every argument as int64 (pointers; NULL = 0)
 *     floats [parts][nargs]  the same positions, read for the float arguments only
 *                            (NULL when the kernel takes none)
 *
 * and per part: its return code, and when it began and how long it took (seconds on
 * CLOCK_MONOTONIC, the clock of Python's time.perf_counter) for the caller's split.
 * Part p runs on team thread p; a part the team did not run (fewer threads granted,
 * e.g. inside another parallel region) runs on the caller afterwards.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>

#include "recscale_native.h"
#include <string.h>
#include <time.h>

typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_thread_num_fn)(void);

static gomp_parallel_fn gomp_parallel;
static omp_thread_num_fn omp_thread_num;

/* 1 when `path` (an already loaded OpenMP runtime) provides the GNU entry points */
int recscale_team_init(const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!h) return 0;
    gomp_parallel = (gomp_parallel_fn)dlsym(h, "GOMP_parallel");
    omp_thread_num = (omp_thread_num_fn)dlsym(h, "omp_get_thread_num");
    if (!gomp_parallel || !omp_thread_num) gomp_parallel = NULL, omp_thread_num = NULL;
    return gomp_parallel != NULL;
}

enum { K_LOOKUP, K_SPARSE_UPDATE, K_WEIGHT_GRAD, K_NARROW_WGRAD, K_NARROW_FORWARD,
       K_DOT_FORWARD, K_DOT_BACKWARD, K_ROW_MOVE, K_UNIQUE_PROBE, K_WEIGHT_GRAD_BF16,
       K_WGRAD_AMX_PACK, K_WGRAD_AMX_GEMM, K_IGRAD_AMX_PACK, K_IGRAD_AMX, K_LOGIT_BWD_BF16,
       K_NARROW_WGRAD_BF16, K_DOT_FORWARD_BF16, K_DOT_BACKWARD_BF16, K_SGD_BF16, N_KERNELS };
static const char *const kernel_names[N_KERNELS] = {
    [K_LOOKUP] = "recscale_pooled_lookup",
    [K_SPARSE_UPDATE] = "recscale_sparse_update",
    [K_WEIGHT_GRAD] = "recscale_weight_grad",
    [K_NARROW_WGRAD] = "recscale_narrow_weight_grad",
    [K_NARROW_FORWARD] = "recscale_narrow_forward",
    [K_DOT_FORWARD] = "recscale_dot_forward",
    [K_DOT_BACKWARD] = "recscale_dot_backward",
    [K_ROW_MOVE] = "recscale_row_move",
    [K_UNIQUE_PROBE] = "recscale_unique_probe_part",
    [K_WEIGHT_GRAD_BF16] = "recscale_weight_grad_bf16",
    [K_WGRAD_AMX_PACK] = "recscale_wgrad_amx_pack",
    [K_WGRAD_AMX_GEMM] = "recscale_wgrad_amx_gemm",
    [K_IGRAD_AMX_PACK] = "recscale_igrad_amx_pack",
    [K_IGRAD_AMX] = "recscale_igrad_amx",
    [K_LOGIT_BWD_BF16] = "recscale_logit_backward_bf16",
    [K_NARROW_WGRAD_BF16] = "recscale_narrow_wgrad_bf16",
    [K_DOT_FORWARD_BF16] = "recscale_dot_forward_bf16",
    [K_DOT_BACKWARD_BF16] = "recscale_dot_backward_bf16",
    [K_SGD_BF16] = "recscale_sgd_bf16",
};

/* the id `recscale_team_run` takes for the kernel `name`, or -1 */
int64_t recscale_team_kernel_id(const char *name) {
    for (int64_t k = 0; k < N_KERNELS; ++k)
        if (strcmp(name, kernel_names[k]) == 0) return k;
    return -1;
}

/* one part: argument k of the row is I(k) (integer), P(k) (pointer) or F(k) (float) */
static int64_t call_kernel(int64_t kernel, const int64_t *i, const float *f) {
#define I(k) i[k]
#define P(k) ((void *)(intptr_t)i[k])
#define F(k) f[k]
    switch (kernel) {
    case K_LOOKUP:
        return recscale_pooled_lookup(P(0), I(1), P(2), P(3), I(4), I(5), I(6), I(7), P(8), P(9),
                                      P(10), P(11), P(12), P(13), I(14), I(15));
    case K_SPARSE_UPDATE:
        return recscale_sparse_update(I(0), P(1), I(2), P(3), P(4), P(5), P(6), I(7), I(8), P(9),
                                      P(10), P(11), I(12), F(13), F(14), F(15), F(16), F(17),
                                      P(18), I(19), I(20), P(21), I(22));
    case K_WEIGHT_GRAD:
        return recscale_weight_grad(P(0), I(1), P(2), I(3), P(4), I(5), P(6), P(7), I(8), I(9),
                                    I(10), I(11));
    case K_WEIGHT_GRAD_BF16:
        return recscale_weight_grad_bf16(P(0), I(1), P(2), I(3), P(4), I(5), P(6), P(7), I(8),
                                         I(9), I(10));
    case K_WGRAD_AMX_PACK:
        return recscale_wgrad_amx_pack(P(0), I(1), P(2), I(3), P(4), P(5), P(6), I(7), I(8), I(9),
                                       I(10), I(11), I(12), I(13));
    case K_WGRAD_AMX_GEMM:
        return recscale_wgrad_amx_gemm(P(0), P(1), P(2), I(3), I(4), I(5), I(6), I(7), I(8));
    case K_IGRAD_AMX_PACK:
        return recscale_igrad_amx_pack(P(0), I(1), I(2), I(3), P(4), I(5), I(6));
    case K_IGRAD_AMX:
        return recscale_igrad_amx(P(0), I(1), P(2), P(3), I(4), P(5), I(6), I(7), P(8), P(9), I(10),
                                  P(11), P(12), I(13), I(14), I(15), I(16), I(17));
    case K_LOGIT_BWD_BF16:
        return recscale_logit_backward_bf16(P(0), I(1), P(2), P(3), P(4), P(5), P(6), I(7), I(8),
                                            I(9), I(10), I(11), I(12));
    case K_NARROW_WGRAD_BF16:
        return recscale_narrow_wgrad_bf16(P(0), I(1), P(2), I(3), P(4), P(5), I(6), I(7), I(8),
                                          I(9), I(10));
    case K_NARROW_WGRAD:
        return recscale_narrow_weight_grad(P(0), I(1), P(2), I(3), P(4), I(5), P(6), I(7), P(8),
                                           I(9), I(10), I(11));
    case K_NARROW_FORWARD:
        return recscale_narrow_forward(P(0), I(1), P(2), I(3), P(4), P(5), I(6), I(7), I(8), I(9),
                                       I(10));
    case K_DOT_FORWARD:
        return recscale_dot_forward(P(0), P(1), P(2), I(3), I(4), I(5), I(6), I(7), I(8), I(9),
                                    I(10), I(11), I(12));
    case K_DOT_FORWARD_BF16:
        return recscale_dot_forward_bf16(P(0), P(1), P(2), I(3), I(4), I(5), I(6), I(7), I(8),
                                         I(9), I(10), I(11), I(12), I(13));
    case K_DOT_BACKWARD_BF16:
        return recscale_dot_backward_bf16(P(0), P(1), P(2), P(3), P(4), I(5), I(6), I(7), I(8),
                                          I(9), I(10), I(11), I(12), I(13), I(14), I(15), I(16),
                                          I(17));
    case K_DOT_BACKWARD:
        return recscale_dot_backward(P(0), P(1), P(2), P(3), P(4), I(5), I(6), I(7), I(8), I(9),
                                     I(10), I(11), I(12), I(13), I(14), I(15), I(16));
    case K_ROW_MOVE:
        return recscale_row_move(P(0), I(1), I(2), P(3), P(4), P(5), I(6), (int)I(7), I(8), P(9),
                                 P(10), P(11));
    case K_UNIQUE_PROBE:
        return recscale_unique_probe_part(P(0), I(1), I(2), P(3), I(4), P(5), P(6), P(7), P(8),
                                          P(9));
    case K_SGD_BF16:
        return recscale_sgd_bf16(I(0), P(1), P(2), P(3), P(4), I(5), F(6), F(7), I(8), I(9));
    default:
        return -1000;
    }
#undef I
#undef P
#undef F
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

typedef struct {
    int64_t kernel, parts, nargs;
    const int64_t *ints;
    const float *floats;
    int64_t *rc;
    double *began, *took;
    volatile int64_t *done; /* [parts]: 1 once run */
} Job;

static void run_part(const Job *j, int64_t p) {
    j->began[p] = now();
    const float *f = j->floats ? j->floats + p * j->nargs : NULL; /* NULL: no float args */
    j->rc[p] = call_kernel(j->kernel, j->ints + p * j->nargs, f);
    j->took[p] = now() - j->began[p];
    j->done[p] = 1;
}

static void team_body(void *data) {
    const Job *j = (const Job *)data;
    const int64_t p = omp_thread_num();
    if (p < j->parts) run_part(j, p);
}

/* MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6) on the calling thread:
 * subnormal fp32 operands and results taken as 0. A GEMM whose inputs drift into
 * subnormals (DCNv2's cross layers in training) otherwise runs each such value through a
 * microcode assist: the default model with DCNv2, 55 -> 500 ms a step within 30 steps. */
static void set_flush_denormal(void *data) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    const unsigned bits = 0x8040, csr = __builtin_ia32_stmxcsr();
    __builtin_ia32_ldmxcsr(*(const int *)data ? (csr | bits) : (csr & ~bits));
#else
    (void)data;
#endif
}

/* set_flush_denormal on every thread of a `threads` team (libgomp reuses the caller's
 * pool, so these are the threads of torch's next parallel region; a thread the pool adds
 * later is created by the caller and inherits its MXCSR). 0, or -1 without a team or
 * off x86. */
int recscale_team_flush_denormal(int64_t on, int64_t threads) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (!gomp_parallel || threads < 1) return -1;
    int flag = on != 0;
    gomp_parallel(set_flush_denormal, &flag, (unsigned)threads, 0);
    return 0;
#else
    (void)on, (void)threads;
    return -1;
#endif
}

/* 0 when every part ran (their codes in rc), -1 without a team or for an unknown kernel */
int recscale_team_run(int64_t kernel, int64_t parts, int64_t nargs, const int64_t *ints,
                      const float *floats, int64_t *rc, double *began, double *took,
                      int64_t *done) {
    if (!gomp_parallel || kernel < 0 || kernel >= N_KERNELS || parts < 1) return -1;
    for (int64_t p = 0; p < parts; ++p) done[p] = 0;
    Job j = {kernel, parts, nargs, ints, floats, rc, began, took, done};
    gomp_parallel(team_body, &j, (unsigned)parts, 0);
    for (int64_t p = 0; p < parts; ++p)
        if (!done[p]) run_part(&j, p);
    return 0;
}
