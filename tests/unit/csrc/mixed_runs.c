/* Mixed parts (gguf_gemv.h) with planted two-part blocks that differ between the rows: a kernel
 * that walks runs of one-part blocks (every row of its pass with a zero xb) must take the
 * two-part body wherever any row of the pass has two parts. Per row, the blocks given two parts
 * (MIXED_TWO); rows 0..8 give every gemv pass of 1..8 rows (M = 1..9; pairs for AVX, 4 + rest for
 * NEON) blocks where only the first, only a later or several rows have two parts, two-part blocks
 * at both ends and side by side, and runs of one-part blocks between them. An all-zero block (row
 * 4, block 7) has xb zero too. Prints every output's bits per kind and M; exits 1 if mixed
 * quantization did not give exactly the planted blocks two parts.
 * Built by tests/unit/test_mixed_parts_runs.py (every x86 build the host executes) and
 * tests/unit/test_arm_kernels.py (NEON under qemu). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "gguf_gemv.h"
int gguf_gemv(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
              int64_t M, float *y, int64_t ldy, const float *bias, int64_t accumulate,
              int64_t num_threads, int64_t parts);
void gguf_quantize_block(void *ws, int64_t M, int64_t K, int64_t r, int64_t b, const float *src, int64_t parts);
int64_t gguf_workspace_bytes(int64_t M, int64_t K);

enum { N = 40, NB = 16, K = 32 * NB, M_MAX = 9 };   /* K: whole K-quant super-blocks */
static const char *MIXED_TWO[M_MAX] = {"0 5", "5 6 11", "2", "8", "", "3 4", "11", "1 9", "0 10"};
static uint64_t st = 7;
static uint32_t rnd(void) { st = st * 6364136223846793005ull + 1442695040888963407ull; return (uint32_t)(st >> 33); }
static float unit(void) { return (float)(rnd() >> 7) * (1.f / 16777216.f); }   /* [0, 1), exact */
static int two_part(int r, int b) {
    for (const char *p = MIXED_TWO[r]; *p;) { char *e; if (strtol(p, &e, 10) == b) return 1; p = *e ? e + 1 : e; }
    return 0;
}

int main(void) {
    static float x[M_MAX * K], y[M_MAX * N];
    for (int r = 0; r < M_MAX; r++) {
        const float s = (float)(1 << (r % 4)) / 2;                  /* a power of 2: x / max|x| exact */
        for (int b = 0; b < NB; b++) {
            float *xb = x + r * K + 32 * b;
            for (int j = 0; j < 32; j++)                            /* two parts: every xa 0 but one */
                xb[j] = two_part(r, b) ? (rnd() & 1 ? 1 : -1) * (0.3f + 0.15f * unit()) * s : (2 * unit() - 1) * s;
            if (two_part(r, b)) xb[(7 * r + 3 * b) % 32] = 127 * s;
            if (r == 4 && b == 7) memset(xb, 0, 32 * sizeof(float));
        }
    }
    int8_t *ws = aligned_alloc(64, (size_t)(gguf_workspace_bytes(1, 32) + 63) / 64 * 64);
    for (int r = 0; r < M_MAX; r++)
        for (int b = 0; b < NB; b++) {                              /* the workspace starts with xq */
            gguf_quantize_block(ws, 1, 32, 0, 0, x + r * K + 32 * b, GGUF_MIXED_PARTS);
            int nz = 0;
            for (int j = 32; j < 64; j++) nz |= ws[j];
            if (!nz != !two_part(r, b)) { printf("row %d block %d: xb %s\n", r, b, nz ? "not zero" : "zero"); return 1; }
        }
    static const int kinds[5] = {GGUF_Q4, GGUF_Q8, GGUF_K4, GGUF_K8, GGUF_F8};
    for (int t = 0; t < 5; t++) {
        const int kind = kinds[t];
        const int64_t pb = gguf_packed_block_bytes(kind), gbytes = gguf_group_bytes(kind, NB);
        const int64_t nw = (N + 15) / 16 * gbytes;
        uint8_t *w = malloc((size_t)nw);
        for (int64_t i = 0; i < nw; i++) w[i] = (uint8_t)rnd();
        for (int64_t g = 0; g < (N + 15) / 16; g++)                 /* finite scales */
            for (int64_t b = 0; b < NB; b++) {
                uint8_t *p = (uint8_t *)gguf_group_blocks(w, kind, NB, g) + b * pb;
                if (kind == GGUF_F8) {
                    for (int i = 0; i < 48; i++) {
                        const float f = (float)((int)(rnd() % 2001) - 1000) / 65536;
                        memcpy(p + 4 * i, &f, 4);
                    }
                    continue;
                }
                if (gguf_has_super(kind)) {                         /* fp16 d, dmin once per 8 blocks */
                    if (b % 8) continue;
                    p = (uint8_t *)gguf_super_scales(p, kind, NB, b);
                }
                const int halves = kind == GGUF_Q8 ? 16 : 32;
                for (int i = 0; i < halves; i++) {
                    const int e = gguf_has_super(kind) ? 1 + (int)(rnd() % 6) : 3 + (int)(rnd() % 10);
                    const uint16_t h = (uint16_t)((e << 10) | (rnd() & 0x3ff) | (i >= 16 && rnd() & 1 ? 0x8000 : 0));
                    memcpy(p + 2 * i, &h, 2);
                }
            }
        for (int M = 1; M <= M_MAX; M++) {
            if (gguf_gemv(w, kind, N, K, x, K, M, y, N, NULL, 0, 1, GGUF_MIXED_PARTS)) return 1;
            printf("kind %2d M %d:", kind, M);
            for (int i = 0; i < M * N; i++) { uint32_t u; memcpy(&u, y + i, 4); printf(" %08x", u); }
            printf("\n");
        }
        free(w);
    }
    fprintf(stderr, "mixed_runs: kernel %s\n", gguf_kernel_isa());
    return 0;
}
