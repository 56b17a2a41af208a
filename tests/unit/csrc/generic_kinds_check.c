/* Kinds 10 (Q2_K), 32 (float weights), 33 and 34 (fp16 and bf16 weights) of
 * kvserve/ops/csrc/gguf_gemv.h, self-contained: packs pseudo-random weights (kind 10: 4-bit scales
 * and mins, fp16 super-block scales normal and subnormal; kind 32: float32 of every magnitude;
 * kinds 33, 34: fp16 values normal and subnormal, bf16 values, each also packed as kind 32), runs
 * gguf_gemv (two, one and mixed parts) over M = 1..9 rows, gguf_gemm_f32 and
 * gguf_dequantize_rows, and prints a hash of the output bits per case; kinds 33 and 34 must give
 * the bits of kind 32 holding the same values (exit status 1 if not). Every build (any kernel file, any ISA) must print the same text: tests/unit/
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
            uint8_t *grp = (uint8_t *)gguf_group_blocks(w, kind, nb, g);
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
    for (int f = 0; f < 2; f++) {                                   /* fp16, bf16 against kind 32 */
        const int kind = f ? GGUF_B16 : GGUF_W16;
        const int64_t n16 = groups * gguf_group_bytes(kind, nb) / 2;
        uint8_t *w16 = malloc(2 * n16), *w32 = malloc(4 * n16);     /* element e: the same weight in both */
        for (int64_t e = 0; e < n16; e++) {
            const uint16_t sign = (uint16_t)((next() & 1u) << 15);
            const uint16_t h = kind == GGUF_W16 ? (uint16_t)(sign | next() % 0x7c00)      /* finite, subnormals too */
                                                : (uint16_t)(sign | (97u + next() % 38) << 7 | (next() & 0x7f));
            const uint32_t u = kind == GGUF_W16 ? 0 : (uint32_t)h << 16;
            float v;
            memcpy(&v, &u, 4);
            if (kind == GGUF_W16) v = half_to_float(h);
            memcpy(w16 + 2 * e, &h, 2);
            memcpy(w32 + 4 * e, &v, 4);
        }
        float *y32 = malloc(sizeof(float) * N * K);
        int same = 1;
        for (int parts = 0; parts < 4; parts++)                     /* 3: the float32 GEMM */
            for (int64_t M = 1; M <= 9; M++) {
                const int64_t n = M * N;
                for (int t = 0; t < 2; t++) {
                    const uint8_t *w = t ? w16 : w32;
                    const int64_t kk = t ? kind : GGUF_W32;
                    float *o = t ? y : y32;
                    if (parts < 3 ? gguf_gemv(w, kk, N, K, x, K, M, o, N, NULL, 0, 1, parts)
                                  : gguf_gemm_f32(w, kk, N, K, x, K, M, o, N, NULL, 0, 1))
                        return 1;
                }
                same &= memcmp(y, y32, sizeof(float) * n) == 0;
                printf("kind %d parts %d M %d %s %016llx\n", kind, parts % 3, (int)M, parts < 3 ? "gemv" : "gemm_f32",
                       (unsigned long long)hash(y, n));
            }
        if (gguf_dequantize_rows(w16, kind, K, ids, N, rows) || gguf_dequantize_rows(w32, GGUF_W32, K, ids, N, y32))
            return 1;
        same &= memcmp(rows, y32, sizeof(float) * N * K) == 0;
        printf("kind %d rows %016llx\n", kind, (unsigned long long)hash(rows, N * K));
        free(w16);
        free(w32);
        free(y32);
        if (!same) {
            printf("kind %d differs from kind 32 holding the same values\n", kind);
            return 1;
        }
    }
    return 0;
}
