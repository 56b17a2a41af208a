/* The rate of one ISA build's gguf_group_dot (kvserve/ops/csrc/gguf_gemv.h) on a group whose
 * weights stay in L1: GMAC/s on one thread for a kind, a K and a number of activation rows, and a
 * checksum of the outputs (the same on every build: they give the same bits). Random weights and
 * activations, fixed seed. Build and run, e.g. for AVX2 (flags: kvserve/ops/cpu_kernels.py):
 *
 *   C=kvserve/ops/csrc; gcc -O3 -ffp-contract=off -fno-fast-math -mavx2 -mfma -mf16c -I$C \
 *       scripts/group_dot_rate.c $C/gguf_gemv_avx2.c -o /tmp/group_dot_rate
 *   /tmp/group_dot_rate 18 8 4     # nb = K / 32 blocks, rows, kind (4, 8, 14 or 18)
 *   /tmp/group_dot_rate 18 8 4 1   # the same with one-part activations (gguf-a8: every xb 0)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gguf_gemv.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int nb = argc > 1 ? atoi(argv[1]) : 18, R = argc > 2 ? atoi(argv[2]) : 8, kind = argc > 3 ? atoi(argv[3]) : 4;
    const int one_part = argc > 4 && atoi(argv[4]) != 0;
    const int64_t pb = gguf_packed_block_bytes(kind);
    if (pb == 0 || nb < 1 || R < 1 || R > GGUF_TILE_M) {
        fprintf(stderr, "usage: %s NB ROWS(1..%d) KIND(4|8|14|18) [ONE_PART(0|1)]\n", argv[0], GGUF_TILE_M);
        return 2;
    }
    enum { GROUPS = 8 };   /* cycled through, so no call reuses the previous one's registers */
    srand(1);
    uint8_t *w = aligned_alloc(64, (size_t)(GROUPS + GGUF_PREFETCH) * nb * pb);
    for (int64_t i = 0; i < (int64_t)(GROUPS + GGUF_PREFETCH) * nb * pb; i++) w[i] = (uint8_t)rand();
    const int64_t scales = gguf_ints_offset(kind);   /* scales first: make them finite */
    for (int64_t blk = 0; blk < (int64_t)GROUPS * nb; blk++) {
        uint8_t *p = w + blk * pb;
        if (kind == GGUF_Q4 || kind == GGUF_Q8)
            for (int64_t i = 0; i < scales; i += 2) { p[i] = (uint8_t)rand(); p[i + 1] = 0x20; }   /* fp16 ~ 0.008 */
        else
            for (int64_t i = 0; i < scales; i += 4) { const float f = 0.01f * (rand() % 100 + 1); memcpy(p + i, &f, 4); }
    }
    int8_t *xq = malloc((size_t)R * nb * 64);
    int16_t *x16 = malloc((size_t)R * nb * 64);
    float *dx = malloc(sizeof(float) * R * nb), *sx = malloc(sizeof(float) * R * nb);
    int32_t *sq = malloc(sizeof(int32_t) * R * nb), *sq0 = malloc(sizeof(int32_t) * R * nb);
    for (int64_t i = 0; i < (int64_t)R * nb; i++) {   /* consistent parts: x16 = 256 xa + xb, sums */
        int8_t *a = xq + i * 64;
        int32_t s = 0, s0 = 0;
        for (int j = 0; j < 32; j++) {
            a[j] = (int8_t)(rand() % 255 - 127);
            a[32 + j] = one_part ? 0 : (int8_t)(rand() % 255 - 127);
            x16[i * 32 + j] = (int16_t)(256 * a[j] + a[32 + j]);
            s += x16[i * 32 + j];
            if (j < 16) s0 += x16[i * 32 + j];
        }
        sq[i] = s, sq0[i] = s0, dx[i] = 1e-4f, sx[i] = 0.5f;
    }
    const gguf_acts_t acts = {xq, x16, dx, sx, sq, sq0, one_part};
    float out[GGUF_TILE_M * GGUF_ROWS];
    double best = 1e30, check = 0;
    for (int rep = 0; rep < 20; rep++) {
        const int calls = 2000;
        const double t0 = now();
        for (int i = 0; i < calls; i++) {
            gguf_group_dot(w + (int64_t)(i % GROUPS) * nb * pb, kind, nb, &acts, R, out);
            check += out[i % (R * GGUF_ROWS)];
        }
        const double dt = (now() - t0) / calls;
        best = dt < best ? dt : best;
    }
    printf("%s kind %d%s, K %d, %d rows: %.3f us a call, %.2f GMAC/s (checksum %.6g)\n", gguf_kernel_isa(), kind, one_part ? " one part" : "",
           32 * nb, R, best * 1e6, (double)GGUF_ROWS * 32 * nb * R / best / 1e9, check);
    return 0;
}
