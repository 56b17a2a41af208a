/* LoRA adapters in the layer stack (layer_stack.c includes this after stack_part_t): per linear
 * and adapter slot, scale * (x A^T) B^T added to the base output of the tokens whose request uses
 * that slot, as kvserve/lora/manager.py's LoRALinear adds it in the PyTorch forward.
 *
 * The tokens are grouped by slot once per step. Per linear, two phases of the step's parallel
 * region: the shrink (x A^T, in units of a token and LORA_CHUNK columns of its slot's A^T, run
 * LORA_TILE side by side so their sums' latencies overlap) and the expand (each thread taking
 * blocks of output columns, whose block of B^T, contiguous, it reads once for all the slot's
 * tokens). Every value is a sum in a fixed order, so a token's output does not depend on the
 * batch, the thread count or the ISA, like the rest of the stack. The base rows (slot -1) are
 * left as the base linear wrote them.
 */
#ifndef KVSERVE_LORA_DELTA_H
#define KVSERVE_LORA_DELTA_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The linears of a layer with adapters, in the order of the model's LoRA table. */
enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_LINEARS };
#define LORA_MAX_RANK 4096               /* a sanity bound on the stacked rank of one linear */

/* One slot's adapter on one linear, in bfloat16 (the adapter's values rounded once at load; each
 * widened to float32 exactly): a = A^T [K][rank], the parts' A stacked along the rank; part p
 * adds (x A_p^T) B_p^T, A_p being ranks r0 .. r0 + r, to output columns off .. off + width, with
 * b[p] = B_p^T [r][width] already multiplied by the adapter's scale, stored by blocks of
 * LORA_COLS columns: block j (columns 64 j .., bw = min(64, width - 64 j) of them) is [r][bw]
 * at b[p] + 64 j r, so the expand reads each block in one stream. a == NULL: the slot's adapter
 * leaves this linear alone; b[p] == NULL ends the parts. */
typedef struct {
    const uint16_t *a;
    int64_t rank;
    const uint16_t *b[STACK_MAX_PARTS];
    int64_t off[STACK_MAX_PARTS], width[STACK_MAX_PARTS], r0[STACK_MAX_PARTS], r[STACK_MAX_PARTS];
} stack_lora_t;

/* One step's tokens grouped by slot: rows[start[s] .. start[s + 1]) use slot s. */
typedef struct {
    int64_t slots, active, rmax;         /* active: tokens with an adapter */
    int64_t *rows, *start;
    float *shrunk;                       /* [T][rmax]: x A^T of each token with an adapter */
} lora_step_t;

/* 0 when the table's n entries (n / LORA_LINEARS layers, `slots` per linear) fit the linears'
 * output widths N[LORA_LINEARS] and every token's slot is -1 or a slot of the table; else -1. */
static int lora_check(const stack_lora_t *table, int64_t n, int64_t slots, const int64_t *N,
                      const int64_t *slot, int64_t T) {
    if (slots < 1) return -1;
    for (int64_t t = 0; t < T; t++)
        if (slot[t] < -1 || slot[t] >= slots) return -1;
    for (int64_t e = 0; e < n * slots; e++) {
        const stack_lora_t *E = &table[e];
        if (!E->a) continue;
        if (E->rank < 1 || E->rank > LORA_MAX_RANK) return -1;
        const int64_t width = N[(e / slots) % LORA_LINEARS];
        for (int p = 0; p < STACK_MAX_PARTS && E->b[p]; p++)
            if (E->off[p] < 0 || E->width[p] < 1 || E->off[p] + E->width[p] > width || E->r0[p] < 0 ||
                E->r[p] < 1 || E->r0[p] + E->r[p] > E->rank)
                return -1;
    }
    return 0;
}

/* Group the step's tokens by slot; 0, or -3 when out of memory (ls then holds nothing to free
 * twice: lora_step_free is safe either way). */
static int lora_step_init(lora_step_t *ls, const stack_lora_t *table, int64_t n, int64_t slots,
                          const int64_t *slot, int64_t T) {
    ls->slots = slots;
    ls->rmax = 1;
    for (int64_t e = 0; e < n * slots; e++)
        if (table[e].a && table[e].rank > ls->rmax) ls->rmax = table[e].rank;
    ls->rows = malloc(sizeof(int64_t) * (T + 1));
    ls->start = calloc(slots + 1, sizeof(int64_t));
    ls->shrunk = malloc(sizeof(float) * T * ls->rmax);
    if (!ls->rows || !ls->start || !ls->shrunk) return -3;
    for (int64_t t = 0; t < T; t++)
        if (slot[t] >= 0) ls->start[slot[t] + 1]++;
    for (int64_t s = 0; s < slots; s++) ls->start[s + 1] += ls->start[s];
    ls->active = ls->start[slots];
    int64_t *fill = ls->rows;                              /* counting sort, tokens in order */
    for (int64_t s = 0; s < slots; s++)
        for (int64_t t = 0, k = ls->start[s]; t < T; t++)
            if (slot[t] == s) fill[k++] = t;
    return 0;
}

static void lora_step_free(lora_step_t *ls) {
    free(ls->rows);
    free(ls->start);
    free(ls->shrunk);
}

#define LORA_COLS 64                     /* output columns per unit of the expand, per block of B */
#define LORA_CHUNK 16                    /* shrink columns per unit */
#define LORA_TILE 4                      /* shrink units run side by side */

/* The build's widest float32 vector (GCC/Clang vector types: AVX-512, AVX2, else SSE or NEON),
 * LORA_VL lanes. Each lane is one element's own sum: its adds and multiplies are the scalar IEEE
 * ones (no contraction: -ffp-contract=off), so every build computes the same bits. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define LORA_VL 16
typedef __m512 lora_vf;
static inline lora_vf lora_load(const uint16_t *p) {  /* LORA_VL bfloat16 values, widened exactly */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__)
#include <immintrin.h>
#define LORA_VL 8
typedef __m256 lora_vf;
static inline lora_vf lora_load(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#else
#define LORA_VL 4
typedef float lora_vf __attribute__((vector_size(16)));
typedef uint16_t lora_vh __attribute__((vector_size(8)));
typedef uint32_t lora_vu __attribute__((vector_size(16)));
static inline lora_vf lora_load(const uint16_t *p) {
    lora_vh h;
    memcpy(&h, p, sizeof h);
    const lora_vu u = __builtin_convertvector(h, lora_vu) << 16;
    lora_vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif
#define LORA_CV (LORA_CHUNK / LORA_VL)  /* vectors per shrink unit */
#define LORA_BV (LORA_COLS / LORA_VL)   /* vectors per block of the expand */

/* A bfloat16 value as the float32 it stands for (exact). */
static inline float lora_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* out[0..n) = sum over i < K, in order, of x[i] * a[i * lda + 0..n) (one unit of the shrink). */
static void lora_shrink_cols(const float *x, const uint16_t *a, int64_t lda, int64_t K, int64_t n,
                             float *out) {
    float acc[LORA_CHUNK];
    for (int64_t j = 0; j < n; j++) acc[j] = 0.f;
    for (int64_t i = 0; i < K; i++) {
        const float xi = x[i];
        const uint16_t *ai = a + i * lda;
        for (int64_t j = 0; j < n; j++) acc[j] += xi * lora_bf16(ai[j]);
    }
    for (int64_t j = 0; j < n; j++) out[j] = acc[j];
}

/* lora_shrink_cols of `nu` units of LORA_CHUNK columns each, side by side: each element the same
 * sum in the same order, the units' chains independent (their latencies overlap). */
static inline __attribute__((always_inline)) void lora_shrink_tile(int nu, const float *const *x,
                                                                   const uint16_t *const *a,
                                                                   const int64_t *lda, int64_t K,
                                                                   float *const *out) {
    lora_vf acc[LORA_TILE][LORA_CV];
    for (int u = 0; u < nu; u++)
        for (int v = 0; v < LORA_CV; v++) acc[u][v] = (lora_vf){0};
    for (int64_t i = 0; i < K; i++)
        for (int u = 0; u < nu; u++) {
            const float xi = x[u][i];
            const uint16_t *ai = a[u] + i * lda[u];
            for (int v = 0; v < LORA_CV; v++) acc[u][v] += xi * lora_load(ai + v * LORA_VL);
        }
    for (int u = 0; u < nu; u++) memcpy(out[u], acc[u], sizeof acc[u]);
}

/* y[0..n) += sum over k < r, in order, of s[k] * b[k * ldb + 0..n). */
static void lora_expand_cols(const float *s, const uint16_t *b, int64_t ldb, int64_t r, int64_t n,
                             float *y) {
    if (n == LORA_COLS) {                /* a whole block: its sums in registers */
        lora_vf acc[LORA_BV];
        for (int c = 0; c < LORA_BV; c++) acc[c] = (lora_vf){0};
        for (int64_t k = 0; k < r; k++) {
            const float sk = s[k];
            const uint16_t *bk = b + k * ldb;
            for (int c = 0; c < LORA_BV; c++) acc[c] += sk * lora_load(bk + c * LORA_VL);
        }
        for (int c = 0; c < LORA_BV; c++) {
            lora_vf yc;
            memcpy(&yc, y + c * LORA_VL, sizeof yc);
            yc += acc[c];
            memcpy(y + c * LORA_VL, &yc, sizeof yc);
        }
        return;
    }
    float acc[LORA_COLS];
    for (int64_t c = 0; c < n; c++) acc[c] = 0.f;
    for (int64_t k = 0; k < r; k++) {
        const float sk = s[k];
        const uint16_t *bk = b + k * ldb;
        for (int64_t c = 0; c < n; c++) acc[c] += sk * lora_bf16(bk[c]);
    }
    for (int64_t c = 0; c < n; c++) y[c] += acc[c];
}

/* The shrink's units of linear e: (token, LORA_CHUNK columns of its slot's A^T), the tokens in
 * slot order; unit u's slot, token row (index into ls->rows), first column and width. */
static inline void lora_unit(const lora_step_t *ls, const stack_lora_t *e, int64_t u, int64_t *slot,
                             int64_t *i, int64_t *j0, int64_t *w) {
    int64_t s = 0;
    for (;; s++) {
        const int64_t chunks = e[s].a ? (e[s].rank + LORA_CHUNK - 1) / LORA_CHUNK : 0;
        const int64_t n = chunks * (ls->start[s + 1] - ls->start[s]);
        if (u < n) {
            *slot = s;
            *i = ls->start[s] + u / chunks;
            *j0 = (u % chunks) * LORA_CHUNK;
            *w = e[s].rank - *j0 < LORA_CHUNK ? e[s].rank - *j0 : LORA_CHUNK;
            return;
        }
        u -= n;
    }
}

/* y[t][0..N) += the deltas of linear `e` (its `slots` entries) for every token with an adapter
 * that targets it; x: the linear's float32 input [T][ldx] of K columns. Two phases of the step's
 * parallel region (the shrink over tiles of (token, columns) units, the expand over blocks of
 * output columns): call it from every thread (every thread takes the same branches). Each value
 * is a sum in a fixed order whatever the thread, the tiling, the batch or the vector width. */
static void lora_add(const lora_step_t *ls, const stack_lora_t *e, int64_t K, int64_t N, const float *x,
                     int64_t ldx, float *y, int64_t ldy) {
    if (!e || !ls->active) return;
    int64_t units = 0;
    for (int64_t s = 0; s < ls->slots; s++)
        if (e[s].a) units += (e[s].rank + LORA_CHUNK - 1) / LORA_CHUNK * (ls->start[s + 1] - ls->start[s]);
    if (!units) return;
    const int64_t rmax = ls->rmax, slots = ls->slots;
    const int64_t tiles = (units + LORA_TILE - 1) / LORA_TILE;
    #pragma omp for schedule(static)
    for (int64_t q = 0; q < tiles; q++) {
        const float *tx[LORA_TILE];
        const uint16_t *ta[LORA_TILE];
        int64_t tlda[LORA_TILE];
        float *tout[LORA_TILE];
        int nu = 0;
        for (int64_t u = q * LORA_TILE; u < units && u < (q + 1) * LORA_TILE; u++) {
            int64_t s, i, j0, w;
            lora_unit(ls, e, u, &s, &i, &j0, &w);
            const int64_t t = ls->rows[i];
            const float *xt = x + t * ldx;
            const uint16_t *a = e[s].a + j0;
            float *out = ls->shrunk + t * rmax + j0;
            if (w < LORA_CHUNK) {        /* a narrow unit on its own */
                lora_shrink_cols(xt, a, e[s].rank, K, w, out);
                continue;
            }
            tx[nu] = xt, ta[nu] = a, tlda[nu] = e[s].rank, tout[nu] = out;
            nu++;
        }
        switch (nu) {                    /* one copy per width, its loops unrolled */
        case 4: lora_shrink_tile(4, tx, ta, tlda, K, tout); break;
        case 3: lora_shrink_tile(3, tx, ta, tlda, K, tout); break;
        case 2: lora_shrink_tile(2, tx, ta, tlda, K, tout); break;
        case 1: lora_shrink_tile(1, tx, ta, tlda, K, tout); break;
        default: break;
        }
    }
    const int64_t blocks = (N + LORA_COLS - 1) / LORA_COLS;
    #pragma omp for schedule(static)
    for (int64_t cb = 0; cb < blocks; cb++) {
        const int64_t c0 = cb * LORA_COLS, c1 = c0 + LORA_COLS < N ? c0 + LORA_COLS : N;
        for (int64_t s = 0; s < slots; s++) {
            const stack_lora_t *E = &e[s];
            if (!E->a || ls->start[s + 1] == ls->start[s]) continue;
            for (int p = 0; p < STACK_MAX_PARTS && E->b[p]; p++) {
                const int64_t off = E->off[p], width = E->width[p], r = E->r[p];
                const int64_t lo = c0 > off ? c0 : off, hi = c1 < off + width ? c1 : off + width;
                /* the part's blocks of B^T that [lo, hi) meets (one, when off is a multiple of
                 * LORA_COLS) */
                for (int64_t c = lo; c < hi;) {
                    const int64_t pb = (c - off) / LORA_COLS, pc0 = off + pb * LORA_COLS;
                    const int64_t bw = width - pb * LORA_COLS < LORA_COLS ? width - pb * LORA_COLS : LORA_COLS;
                    const int64_t end = hi < pc0 + bw ? hi : pc0 + bw;
                    const uint16_t *b = E->b[p] + pb * LORA_COLS * r + (c - pc0);
                    for (int64_t i = ls->start[s]; i < ls->start[s + 1]; i++) {
                        const int64_t t = ls->rows[i];
                        lora_expand_cols(ls->shrunk + t * rmax + E->r0[p], b, bw, r, end - c, y + t * ldy + c);
                    }
                    c = end;
                }
            }
        }
    }
}

#endif
