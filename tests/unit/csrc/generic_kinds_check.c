/* Kinds 10 (Q2_K) and 32 (float weights) of kvserve/ops/csrc/gguf_gemv.h, self-contained: packs
 * pseudo-random weights (kind 10: 4-bit scales and mins, fp16 super-block scales normal and
 * subnormal; kind 32: float32 of every magnitude), runs gguf_gemv (two, one and mixed parts) over
 * M = 1..9 rows, gguf_gemm_f32 and gguf_dequantize_rows, and prints a hash of the output bits per
 * case. Every build (any kernel file, any ISA) must print the same text: tests/unit/
 * test_gguf_q2k_float.py compares a NEON and a portable aarch64 build under qemu with a host one.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_gemv.h"

int gguf_gemv(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
              int64_t M, float *y, int64_t ldy, const float *bias, int64_t accumulate,
              int64_t num_threads, int64_t parts);
int gguf_gemm_f32(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
                  int64_t M, float *y, int64_t ldy, const float *bias, int64_t accumulate,
                  int64_t num_threads);
int gguf_dequantize_rows(const uint8_t *w, int64_t kind, int64_t K, const int64_t *rows, int64_t n, float *out);

static uint64_t state = 88172645463325252ull;
static uint32_t next(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 16);
}

static uint64_t hash(const float *y, int64_t n) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, y + i, 4);
        h = (h ^ u) * 1099511628211ull;
    }
    return h;
}

int main(void) {
    const int64_t N = 40, K = 512, nb = K / 32, groups = (N + 15) / 16;
    const int kinds[2] = {GGUF_K2, GGUF_W32};
    float *x = malloc(sizeof(float) * 9 * K), *y = malloc(sizeof(float) * 9 * N);
    float *rows = malloc(sizeof(float) * N * K);
    int64_t ids[40];
    for (int64_t i = 0; i < N; i++) ids[i] = (i * 7) % N;
    for (int64_t i = 0; i < 9 * K; i++) {
        const float u = (float)(int32_t)(next() % 20001 - 10000) / 10000.f;
        x[i] = i % 97 == 5 ? 40.f : u * (float)(1 + i % 5);
    }
    for (int64_t i = 0; i < 32; i++) x[K + 64 + i] = 0.f;         /* an all-zero block */
    for (int k = 0; k < 2; k++) {
        const int kind = kinds[k];
        const int64_t bytes = groups * gguf_group_bytes(kind, nb);
        uint8_t *w = malloc(bytes);
        for (int64_t i = 0; i < bytes; i++) w[i] = (uint8_t)next();
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *grp = w + g * gguf_group_bytes(kind, nb);
            for (int64_t b = 0; b < nb; b++) {
                uint8_t *p = grp + b * gguf_packed_block_bytes(kind);
                if (kind == GGUF_K2) {
                    for (int i = 0; i < 64; i++) p[i] &= 15;
                    if (b % 8 == 0) {                               /* fp16 D, DMIN: normal or subnormal */
                        uint8_t *sup = (uint8_t *)gguf_super_scales(p, kind, nb, b);
                        for (int i = 0; i < 32; i++) {
                            uint16_t h = (uint16_t)(next() % 0x5800);
                            if (i % 3 == 0) h &= 0x3ff;
                            memcpy(sup + 2 * i, &h, 2);
                        }
                    }
                } else {
                    for (int j = 0; j < 32 * 16; j++) {             /* floats of 2^-30 .. 2^8, either sign */
                        const uint32_t u = ((next() & 1u) << 31) | ((97u + next() % 38) << 23) | (next() & 0x7fffffu);
                        memcpy(p + 4 * j, &u, 4);
                    }
                }
            }
        }
        for (int parts = 0; parts < 3; parts++)
            for (int64_t M = 1; M <= 9; M++) {
                if (gguf_gemv(w, kind, N, K, x, K, M, y, N, NULL, 0, 1, parts)) return 1;
                printf("kind %d parts %d M %d gemv %016llx\n", kind, parts, (int)M, (unsigned long long)hash(y, M * N));
            }
        if (gguf_gemm_f32(w, kind, N, K, x, K, 9, y, N, NULL, 0, 1)) return 1;
        printf("kind %d gemm_f32 %016llx\n", kind, (unsigned long long)hash(y, 9 * N));
        if (gguf_dequantize_rows(w, kind, K, ids, N, rows)) return 1;
        printf("kind %d rows %016llx\n", kind, (unsigned long long)hash(rows, N * K));
        free(w);
    }
    return 0;
}
