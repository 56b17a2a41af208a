/* A whole forward step of a Llama-family model in one call, for any flat batch: the tokens of
 * every scheduled chunk (prompt chunks and decodes alike) go through every layer without
 * returning to Python (eager PyTorch spends ~60 small ops per layer on them). The math is the
 * model's (kvserve/model/llama.py), kernel for kernel:
 *
 *   h = embed[ids]
 *   per layer:  x = rmsnorm(h) * ln1
 *               q, k, v = x Wqkv^T (+ b);  q, k = rope(q, k)   (rotate-half layout)
 *                 (Qwen3: q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm per head first;
 *                  partial rotary: rope turns each head's first rotary_dim dims only)
 *               write k, v at the tokens' slots of the paged pool
 *               h += attention(q, pool) Wo^T (+ b)              (paged_attention.c)
 *               x = rmsnorm(h) * ln2
 *               h += (silu(x Wg^T) * x Wu^T) Wd^T               (gguf_gemv.c, fused gate/up)
 *   out = rmsnorm(h) * norm      (only for the rows the caller asks for)
 *
 * A pipeline stage runs its own range of layers (the layer table holds those): h_in, when not
 * NULL, holds the previous stage's hidden states [T][hidden] in place of the embedding, and with
 * final_norm 0 out receives the rows of h as they leave the last layer (no final norm).
 *
 * Token t has position positions[t], KV slot slots[t] and belongs to the sequence whose block
 * table is tables + seq[t] * table_stride; it attends over positions 0..positions[t] of that
 * table (its own key included: this step's K/V are written before attention runs).
 *
 * LoRA adapters (lora_delta.h): with a per-token adapter slot (lora_slot, -1: the base model),
 * each linear an adapter targets adds scale * (x A^T) B^T to the base output of the tokens using
 * that adapter, x being the linear's float32 input (the normed state, the attention output, the
 * SiLU product), never the quantized copy the integer GEMV reads.
 *
 * Every linear is a GGUF-packed weight (gguf_gemv.c): prompt tokens (prompt[t] != 0) go through
 * its float32 GEMM, the others (decodes) through its integer GEMV. With activations as one 8-bit
 * part per block (act_parts GGUF_ONE_PART: the gguf-a8 format, llama.cpp's precision) or one or
 * two by block (GGUF_MIXED_PARTS: gguf-mixed; gguf_gemv.h) every token takes the integer GEMV,
 * which then does up to twice the float32 GEMM's work per cycle. Activations and norms are
 * float32, the KV pool float32, IEEE half or int8 rows with a scale (kv_format.h). Each
 * token's numbers are computed on their own, in a fixed order, and its kernels depend only on whether it is a prompt
 * token: the output does not depend on the other tokens of the batch, the thread count or the
 * ISA (see gguf_gemv.h and paged_attention.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fixed_math.h"
#include "gguf_gemv.h"
#include "half.h"
#include "kv_format.h"

int64_t gguf_workspace_bytes(int64_t M, int64_t K);
int gguf_gemv_check(int64_t kind, int64_t K);
int64_t gguf_f32_workspace_bytes(int64_t M, int64_t N, int64_t K, int64_t threads);
void gguf_gemm_f32_team(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
                        const int64_t *rows, int64_t M, float *y, int64_t ldy, const float *bias,
                        int64_t accumulate, void *ws);
void gguf_gemv_team(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
                    const int64_t *rows, int64_t M, float *y, int64_t ldy, const float *bias,
                    int64_t accumulate, void *ws, int64_t parts);
void gguf_quantize_block(void *ws, int64_t M, int64_t K, int64_t r, int64_t b, const float *src, int64_t parts);
void gguf_gemv_quantized_team(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const int64_t *rows, int64_t M,
                              float *y, int64_t ldy, const float *bias, int64_t accumulate, void *ws,
                              int64_t parts);
void paged_attention_team(const float *q, const void *k_cache, const void *v_cache, float *out,
                          const int64_t *qrow, const int64_t *qseq, const int64_t *tables, int64_t table_stride,
                          const int64_t *lens, int64_t num_rows, int64_t num_heads, int64_t kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, int64_t window, int64_t kv_format);

/* One packed part of a linear's output rows: a fused linear (q/k/v, gate/up) whose parts differ in
 * kind (llama-quantize's Q4_K_M keeps v as Q6_K beside a Q4_K q and k) runs them side by side,
 * each into its own columns of the output; rows == 0 ends the list. */
#define STACK_MAX_PARTS 3
typedef struct {
    const uint8_t *w;                                /* gguf_gemv packed weights */
    int64_t kind, rows;
} stack_part_t;

#include "lora_delta.h"

typedef struct {
    const float *ln1, *ln2;                          /* RMSNorm weights [hidden] */
    stack_part_t qkv[STACK_MAX_PARTS], o, gate_up[STACK_MAX_PARTS], down;
    const float *qkv_bias, *o_bias;                  /* NULL when the layer has none */
    void *k_cache, *v_cache;      /* [blocks][block_size][kv_heads] rows (kv_format.h): float32[head_dim],
                                     int8[head_dim] + float32 scale, or IEEE half[head_dim] */
    const float *q_norm, *k_norm;    /* per-head RMSNorm weights [head_dim] (Qwen3), or NULL */
} stack_layer_t;

typedef struct {
    int64_t num_layers, hidden, num_heads, kv_heads, head_dim, intermediate, block_size, window, kv_format;
    double eps, scale;
    const float *embed;                              /* [vocab][hidden], or NULL: */
    const uint8_t *embed_packed;                     /* the rows of a tied head's packed weight */
    int64_t embed_kind;
    const float *norm;                               /* final RMSNorm [hidden] */
    const float *cos, *sin;                          /* [max_positions][head_dim], sin signed */
    const stack_layer_t *layers;
    int64_t act_parts;             /* the activations' parts (gguf_gemv.h); not GGUF_TWO_PARTS: every token on the GEMV */
    int64_t rotary_dim;            /* dims of each head rope turns (cos/sin rows are this wide) */
    const stack_lora_t *lora;      /* [num_layers][LORA_LINEARS][lora_slots] (lora_delta.h), or NULL */
    int64_t lora_slots;
} stack_model_t;

/* Layer l's entries of linear `which` (LORA_QKV ..) in the LoRA table, one per slot; NULL: none. */
static inline const stack_lora_t *lora_of(const stack_model_t *m, int64_t l, int which) {
    return m->lora ? m->lora + (l * LORA_LINEARS + which) * m->lora_slots : NULL;
}

#define LANES 8

static void rmsnorm(const float *h, const float *w, float eps, int64_t n, float *out) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += h[i + l] * h[i + l];
    float ss = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (; i < n; i++) ss += h[i] * h[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = h[i] * r * w[i];
}

/* x[D] rotated in place: x * cos + rotate_half(x) * sin (sin holds -sin, sin for the halves). */
static void rope(float *x, const float *cos, const float *sin, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* exp(x) for any x: 0 below -87, +inf above 88 (fixed_math.h). */
static inline float exp_f32(float x) {
    if (x < -87.f) return 0.f;
    if (x > 88.f) return INFINITY;
    return exp_in_range(x);
}

/* Store one token's K or V heads ([kv_heads][D] floats) at `slot` of a pool of format fmt
 * (kv_format.h). */
static void store_kv(void *pool, int64_t slot, const float *x, int64_t kv_heads, int64_t D, int64_t fmt) {
    if (fmt == KV_F32) {
        memcpy((float *)pool + slot * kv_heads * D, x, sizeof(float) * kv_heads * D);
        return;
    }
    if (fmt == KV_F16) {                               /* round to nearest even, as torch's .half() */
        uint16_t *row = (uint16_t *)pool + slot * kv_heads * D;
        for (int64_t i = 0; i < kv_heads * D; i++) row[i] = float_to_half(x[i]);
        return;
    }
    for (int64_t h = 0; h < kv_heads; h++) {           /* kv_int8.quantize, row by row */
        int8_t *row = (int8_t *)pool + (slot * kv_heads + h) * (D + 4);
        const float *xh = x + h * D;
        float amax = 0.f;
        for (int64_t d = 0; d < D; d++) amax = fabsf(xh[d]) > amax ? fabsf(xh[d]) : amax;
        const float scale = amax / 127.f;
        for (int64_t d = 0; d < D; d++) {
            float v = scale > 0.f ? __builtin_rintf(xh[d] / scale) : 0.f;
            row[d] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
        }
        memcpy(row + D, &scale, 4);
    }
}

/* The rows of one linear: prompt tokens through the float32 GEMM, the others (decodes; every
 * token unless the activations have two parts) through the integer GEMV (gguf_gemv.h). A token's path depends only on
 * whether it is a prompt token, never on the batch: its numbers stay independent of what else
 * shares the step. */
typedef struct {
    const int64_t *f_rows, *i_rows;
    const int64_t *i_index;        /* token t's position in i_rows; -1: t takes the float32 GEMM */
    int64_t nf, ni;
    void *ws_f, *ws_i;
    int64_t parts;
} row_split_t;

/* Whether token t's linears take the float32 GEMM: prompt tokens, when activations have two parts. */
static inline int via_f32(const stack_model_t *m, const uint8_t *prompt, int64_t t) {
    return prompt[t] && m->act_parts == GGUF_TWO_PARTS;
}

static void linear(const row_split_t *rs, const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x,
                   int64_t ldx, float *y, int64_t ldy, const float *bias, int64_t accumulate) {
    if (rs->ni) gguf_gemv_team(w, kind, N, K, x, ldx, rs->i_rows, rs->ni, y, ldy, bias, accumulate, rs->ws_i, rs->parts);
    if (rs->nf) gguf_gemm_f32_team(w, kind, N, K, x, ldx, rs->f_rows, rs->nf, y, ldy, bias, accumulate, rs->ws_f);
}

/* linear() where the phase that produced x already quantized its decode rows into ws_i
 * (quantize_row_block): one phase and one barrier fewer. */
static void linear_quantized(const row_split_t *rs, const uint8_t *w, int64_t kind, int64_t N, int64_t K,
                             const float *x, int64_t ldx, float *y, int64_t ldy, const float *bias,
                             int64_t accumulate) {
    if (rs->ni) gguf_gemv_quantized_team(w, kind, N, K, rs->i_rows, rs->ni, y, ldy, bias, accumulate, rs->ws_i,
                                         rs->parts);
    if (rs->nf) gguf_gemm_f32_team(w, kind, N, K, x, ldx, rs->f_rows, rs->nf, y, ldy, bias, accumulate, rs->ws_f);
}

/* linear_quantized() of each part of a fused linear, into its columns of y (and of the bias). */
static void linear_parts_quantized(const row_split_t *rs, const stack_part_t *parts, int64_t K, const float *x,
                                   int64_t ldx, float *y, int64_t ldy, const float *bias) {
    int64_t off = 0;
    for (int p = 0; p < STACK_MAX_PARTS && parts[p].rows; p++) {
        linear_quantized(rs, parts[p].w, parts[p].kind, parts[p].rows, K, x, ldx, y + off, ldy,
                         bias ? bias + off : NULL, 0);
        off += parts[p].rows;
    }
}

/* Whether a fused linear's parts cover exactly N rows, each of a kind the kernels run on K inputs. */
static int parts_check(const stack_part_t *parts, int64_t N, int64_t K) {
    int64_t rows = 0;
    for (int p = 0; p < STACK_MAX_PARTS && parts[p].rows; p++) {
        if (gguf_gemv_check(parts[p].kind, K) || parts[p].rows % 16) return -1;
        rows += parts[p].rows;
    }
    return rows == N ? 0 : -1;
}

/* Block b of token t's row of K floats (src), quantized for the next linear when t takes the GEMV
 * (the float32 GEMM reads x itself). */
static inline void quantize_row_block(const row_split_t *rs, int64_t t, int64_t K, int64_t b, const float *src) {
    if (rs->i_index[t] >= 0) gguf_quantize_block(rs->ws_i, rs->ni, K, rs->i_index[t], b, src, rs->parts);
}

/* A phase of the step (call it from every thread of the region): x = rmsnorm(h) * w for every
 * token, the GEMV tokens' rows quantized for the next linear (linear_quantized). */
static void norm_and_quantize(const row_split_t *rs, int64_t T, const float *h, const float *w, float eps, int64_t H,
                              float *x) {
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        rmsnorm(h + t * H, w, eps, H, x + t * H);
        for (int64_t b = 0; b < H / 32; b++) quantize_row_block(rs, t, H, b, x + t * H + 32 * b);
    }
}

/* Returns 0, -1 for a weight of a bad kind or shape (or bad act_parts), -3 when out of memory. out: [n_out][hidden],
 * the final-normed states of rows out_rows[0..n_out).
 * One OpenMP parallel region runs the whole step: each phase is an `omp for` over tokens, row
 * groups or attention tasks, with the barrier at its end (no fork/join per kernel). */
int layer_stack(const stack_model_t *m, const int64_t *ids, const float *h_in, const int64_t *positions,
                const int64_t *slots, const int64_t *seq, const uint8_t *prompt, int64_t T, const int64_t *tables,
                int64_t table_stride, const int64_t *out_rows, int64_t n_out, float *out, int64_t final_norm,
                int64_t num_threads, const int64_t *lora_slot) {
    const int64_t H = m->hidden, D = m->head_dim, qs = m->num_heads * D, kvs = m->kv_heads * D;
    const int64_t nqkv = qs + 2 * kvs, I = m->intermediate;
    const float eps = (float)m->eps;
    if (m->act_parts < GGUF_TWO_PARTS || m->act_parts > GGUF_MIXED_PARTS) return -1;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const stack_layer_t *L = &m->layers[l];
        if (parts_check(L->qkv, nqkv, H) || gguf_gemv_check(L->o.kind, qs) || L->o.rows != H ||
            parts_check(L->gate_up, 2 * I, H) || gguf_gemv_check(L->down.kind, I) || L->down.rows != H)
            return -1;
    }
    if (lora_slot && m->lora && lora_check(m->lora, m->num_layers * LORA_LINEARS, m->lora_slots,
                                           (const int64_t[]){nqkv, H, 2 * I, H}, lora_slot, T))
        return -1;
    const int64_t kmax = H > qs ? (H > I ? H : I) : (qs > I ? qs : I);
    const int64_t nmax = nqkv > 2 * I ? (nqkv > H ? nqkv : H) : (2 * I > H ? 2 * I : H);
    int64_t nf = 0;
    for (int64_t t = 0; t < T; t++) nf += via_f32(m, prompt, t);
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    const size_t ws_bytes = ((size_t)gguf_workspace_bytes(T - nf, kmax) + 63) / 64 * 64;
    const size_t wsf_bytes = nf ? ((size_t)gguf_f32_workspace_bytes(nf, nmax, kmax, threads) + 63) / 64 * 64 : 64;
    float *h = malloc(sizeof(float) * T * H), *x = malloc(sizeof(float) * T * H);
    float *qkv = malloc(sizeof(float) * T * nqkv), *q = malloc(sizeof(float) * T * qs);
    float *att = malloc(sizeof(float) * T * qs), *gu = malloc(sizeof(float) * T * 2 * I);
    float *act = malloc(sizeof(float) * T * I);
    int64_t *qrow = malloc(sizeof(int64_t) * T), *lens = malloc(sizeof(int64_t) * T);
    void *ws = aligned_alloc(64, ws_bytes), *ws_f = aligned_alloc(64, wsf_bytes);
    int64_t *f_rows = malloc(sizeof(int64_t) * (nf + 1)), *i_rows = malloc(sizeof(int64_t) * (T - nf + 1));
    int64_t *i_index = malloc(sizeof(int64_t) * T);
    lora_step_t ls = {0};
    int rc = -3;
    if (!h || !x || !qkv || !q || !att || !gu || !act || !qrow || !lens || !ws || !ws_f || !f_rows || !i_rows || !i_index) goto done;
    if (lora_slot && m->lora && lora_step_init(&ls, m->lora, m->num_layers * LORA_LINEARS, m->lora_slots, lora_slot, T))
        goto done;
    row_split_t rs = {f_rows, i_rows, i_index, 0, 0, ws_f, ws, m->act_parts};
    for (int64_t t = 0; t < T; t++) {
        if (via_f32(m, prompt, t)) {
            f_rows[rs.nf++] = t;
            i_index[t] = -1;
        } else {
            i_index[t] = rs.ni;
            i_rows[rs.ni++] = t;
        }
    }
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (h_in) memcpy(h + t * H, h_in + t * H, sizeof(float) * H);
            else if (m->embed) memcpy(h + t * H, m->embed + ids[t] * H, sizeof(float) * H);
            else gguf_dequantize_row(m->embed_packed, m->embed_kind, H, ids[t], h + t * H);
            qrow[t] = t;
            lens[t] = positions[t] + 1;
        }
        for (int64_t l = 0; l < m->num_layers; l++) {
            const stack_layer_t *L = &m->layers[l];
            norm_and_quantize(&rs, T, h, L->ln1, eps, H, x);
            linear_parts_quantized(&rs, L->qkv, H, x, H, qkv, nqkv, L->qkv_bias);
            lora_add(&ls, lora_of(m, l, LORA_QKV), H, nqkv, x, H, qkv, nqkv);
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                float *row = qkv + t * nqkv;
                const int64_t R = m->rotary_dim;
                const float *c = m->cos + positions[t] * R, *s = m->sin + positions[t] * R;
                for (int64_t hd = 0; hd < m->num_heads + m->kv_heads; hd++) {
                    const float *qk_norm = hd < m->num_heads ? L->q_norm : L->k_norm;
                    if (qk_norm) rmsnorm(row + hd * D, qk_norm, eps, D, row + hd * D);  /* in place */
                    rope(row + hd * D, c, s, R);
                }
                memcpy(q + t * qs, row, sizeof(float) * qs);
                store_kv(L->k_cache, slots[t], row + qs, m->kv_heads, D, m->kv_format);
                store_kv(L->v_cache, slots[t], row + qs + kvs, m->kv_heads, D, m->kv_format);
            }
            paged_attention_team(q, L->k_cache, L->v_cache, att, qrow, seq, tables, table_stride, lens, T,
                                 m->num_heads, m->kv_heads, D, m->block_size, (float)m->scale, m->window,
                                 m->kv_format);
            linear(&rs, L->o.w, L->o.kind, H, qs, att, qs, h, H, L->o_bias, 1);
            lora_add(&ls, lora_of(m, l, LORA_O), qs, H, att, qs, h, H);
            norm_and_quantize(&rs, T, h, L->ln2, eps, H, x);
            linear_parts_quantized(&rs, L->gate_up, H, x, H, gu, 2 * I, NULL);
            lora_add(&ls, lora_of(m, l, LORA_GATE_UP), H, 2 * I, x, H, gu, 2 * I);
            #pragma omp for schedule(static)
            for (int64_t tb = 0; tb < T * (I / 32); tb++) {   /* (token, block of 32): one token splits too */
                const int64_t t = tb / (I / 32), b = tb % (I / 32);
                const float *g = gu + t * 2 * I + 32 * b, *u = g + I;
                float *a = act + t * I + 32 * b;
                for (int i = 0; i < 32; i++) a[i] = g[i] / (1.f + exp_f32(-g[i])) * u[i];
                quantize_row_block(&rs, t, I, b, a);
            }
            linear_quantized(&rs, L->down.w, L->down.kind, H, I, act, I, h, H, NULL, 1);
            lora_add(&ls, lora_of(m, l, LORA_DOWN), I, H, act, I, h, H);
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < n_out; r++) {
            if (final_norm) rmsnorm(h + out_rows[r] * H, m->norm, eps, H, out + r * H);
            else memcpy(out + r * H, h + out_rows[r] * H, sizeof(float) * H);
        }
    }
    rc = 0;
done:
    free(h); free(x); free(qkv); free(q); free(att); free(gu); free(act); free(qrow); free(lens); free(ws); free(ws_f); free(f_rows); free(i_rows); free(i_index);
    lora_step_free(&ls);
    return rc;
}
