/*
 * The one CPU-feature check of the native library, and its ABI number.
 */
#include "recscale_native.h"

int recscale_native_abi(void) { return RECSCALE_NATIVE_ABI; }

/* A mask of RS_CPU_*, asked once: what this CPU has and its OS and hypervisor expose. */
int recscale_cpu_features(void) {
    static int features = -1;
    if (features >= 0) return features;
    int f = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) /* f16c: fp16 rows (row_format.h) */
        f |= RS_CPU_AVX2;
    if (__builtin_cpu_supports("avx512f")) f |= RS_CPU_AVX512F;
    if (__builtin_cpu_supports("avx512bf16")) f |= RS_CPU_AVX512_BF16;
    if (__builtin_cpu_supports("amx-bf16")) f |= RS_CPU_AMX_BF16;
#endif
    features = f;
    return f;
}
