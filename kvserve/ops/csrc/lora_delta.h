/* LoRA adapters in the layer stack (layer_stack.c includes this after stack_part_t): per linear
 * and adapter slot, scale * (x A^T) B^T added to the base output of the tokens whose request uses
 * that slot, as kvserve/lora/manager.py's LoRALinear adds it in the PyTorch forward.
 *
 * The tokens are grouped by slot once per step. Per linear, two phases of the step's parallel
 * region: the shrink (x A^T, each thread taking whole tokens) and the expand (each thread taking
 * blocks of output columns, whose B^T columns it reads once for all the slot's tokens). Every
 * value is a sum in a fixed order, so a token's output does not depend on the batch, the thread
 * count or the ISA, like the rest of the stack. The base rows (slot -1) are left as the base linear wrote them.
 */
#ifndef KVSERVE_LORA_DELTA_H
#define KVSERVE_LORA_DELTA_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The linears of a layer with adapters, in the order of the model's LoRA table. */
enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_LINEARS };
#define LORA_MAX_RANK 4096               /* a sanity bound on the stacked rank of one linear */

/* One slot's adapter on one linear, its matrices transposed so both products run along
 * contiguous rows, in bfloat16 (the adapter's values rounded once at load; each widened to
 * float32 exactly): a = A^T [K][rank], the parts' A stacked along the rank; part p adds
 * (x A_p^T) B_p^T, A_p being ranks r0 .. r0 + r, to output columns off .. off + width, with
 * b[p] = B_p^T [r][width] already multiplied by the adapter's scale. a == NULL: the slot's
 * adapter leaves this linear alone; b[p] == NULL ends the parts. */
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

#define LORA_COLS 64                     /* output columns per unit of the expand */

/* A bfloat16 value as the float32 it stands for (exact). */
static inline float lora_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* acc[0..n) = sum over i < K, in order, of x[i] * a[i][0..n) (a: [K][n] rows). */
static void lora_shrink_row(const float *x, const uint16_t *a, int64_t K, int64_t n, float *acc) {
    for (int64_t j = 0; j < n; j++) acc[j] = 0.f;
    for (int64_t i = 0; i < K; i++) {
        const float xi = x[i];
        const uint16_t *ai = a + i * n;
        for (int64_t j = 0; j < n; j++) acc[j] += xi * lora_bf16(ai[j]);
    }
}

/* y[0..n) += sum over k < r, in order, of s[k] * b[k][0..n) (b rows `ldb` apart). */
static void lora_expand_cols(const float *s, const uint16_t *b, int64_t ldb, int64_t r, int64_t n, float *y) {
    float acc[LORA_COLS];
    for (int64_t c = 0; c < n; c++) acc[c] = 0.f;
    for (int64_t k = 0; k < r; k++) {
        const float sk = s[k];
        const uint16_t *bk = b + k * ldb;
        for (int64_t c = 0; c < n; c++) acc[c] += sk * lora_bf16(bk[c]);
    }
    for (int64_t c = 0; c < n; c++) y[c] += acc[c];
}

/* y[t][0..N) += the deltas of linear `e` (its `slots` entries) for every token with an adapter
 * that targets it; x: the linear's float32 input [T][ldx] of K columns. Two phases of the step's
 * parallel region (the shrink over tokens, the expand over blocks of output columns): call it
 * from every thread (every thread takes the same branches). Each value is a sum in a fixed
 * order whatever the thread or the vector width. */
static void lora_add(const lora_step_t *ls, const stack_lora_t *e, int64_t K, int64_t N, const float *x,
                     int64_t ldx, float *y, int64_t ldy) {
    if (!e || !ls->active) return;
    int any = 0;
    for (int64_t s = 0; s < ls->slots; s++) any |= e[s].a && ls->start[s + 1] > ls->start[s];
    if (!any) return;
    const int64_t rmax = ls->rmax, slots = ls->slots;
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < ls->active; i++) {       /* tokens in slot order */
        const int64_t t = ls->rows[i];
        int64_t s = 0;
        while (ls->start[s + 1] <= i) s++;
        if (e[s].a) lora_shrink_row(x + t * ldx, e[s].a, K, e[s].rank, ls->shrunk + t * rmax);
    }
    const int64_t blocks = (N + LORA_COLS - 1) / LORA_COLS;
    #pragma omp for schedule(static)
    for (int64_t cb = 0; cb < blocks; cb++) {
        const int64_t c0 = cb * LORA_COLS, c1 = c0 + LORA_COLS < N ? c0 + LORA_COLS : N;
        for (int64_t s = 0; s < slots; s++) {
            const stack_lora_t *E = &e[s];
            if (!E->a || ls->start[s + 1] == ls->start[s]) continue;
            for (int p = 0; p < STACK_MAX_PARTS && E->b[p]; p++) {
                const int64_t lo = c0 > E->off[p] ? c0 : E->off[p];
                const int64_t hi = c1 < E->off[p] + E->width[p] ? c1 : E->off[p] + E->width[p];
                if (lo >= hi) continue;
                const uint16_t *b = E->b[p] + (lo - E->off[p]);
                for (int64_t i = ls->start[s]; i < ls->start[s + 1]; i++) {
                    const int64_t t = ls->rows[i];
                    lora_expand_cols(ls->shrunk + t * rmax + E->r0[p], b, E->width[p], E->r[p], hi - lo,
                                     y + t * ldy + lo);
                }
            }
        }
    }
}

#endif
