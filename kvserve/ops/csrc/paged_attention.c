/* Paged attention on the CPU: each query token attends over its request's context read straight
 * from the paged KV pool (no gather into fresh tensors). A decode is one such row; a prompt
 * chunk is one row per token (its context ends at its own position), so a token's result does
 * not depend on how its prompt was chunked or what else ran in the step.
 *
 * Pool layout (one layer): k_cache, v_cache float32 [num_blocks][block_size][kv_heads][head_dim],
 * IEEE half [num_blocks][block_size][kv_heads][head_dim] (kv_format KV_F16, converted exactly to
 * float32 on read), or int8 rows (KV_INT8): each (slot, kv head) row is head_dim int8 values
 * followed by its float32 scale in 4 bytes (x ~= scale * q; kvserve/ops/kv_int8.py writes them).
 * Row i: query q[qrow[i]] (float32 [num_heads][head_dim]), context of lens[i] tokens whose slots
 * are table[p / block_size] * block_size + p % block_size with table = tables + qseq[i] *
 * table_stride (qseq NULL: row i uses table row i); keys older than `window` positions
 * (window > 0) are skipped. Output goes to out[qrow[i]] ([num_heads][head_dim]).
 *
 * One task per (row, kv head); the group of num_heads / kv_heads query heads that share a KV head
 * is computed together, so every K and V row is read once per task. Two passes: scores (kept in
 * a per-task buffer), then softmax and the weighted sum of V. Rows of one sequence at consecutive
 * positions (a prompt chunk, a speculative verification) go as runs of up to MAX_RUN rows per
 * task, each K and V row read once for all of them (attend_run), with every row's bits unchanged.
 *
 * Every sum has a fixed order (8 partial sums combined by a fixed tree) and every product added to
 * a sum is one explicit fused multiply-add (fma8, fmaf; built with -ffp-contract=off and without
 * -ffast-math, so no other operation is fused): the bits do not depend on the thread count, the
 * ISA the file was compiled for (tests/unit/csrc/attention_check.c), or the other rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fixed_math.h"
#include "half.h"
#include "kv_format.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) || defined(__FMA__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#define UNROLL _Pragma("GCC unroll 16")   /* whole: the chunk arrays stay in registers */

#define MAX_GROUP 16
#define MAX_C 16          /* 8-float chunks of the largest head_dim with a fixed-size path (128) */
#define LANES 8

/* Sum of 8 partial sums, in a fixed tree. */
static inline float tree8(const float a[LANES]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* exp(x) for x <= 0 (scores minus their max): below -87 the result is flushed to 0 (the true
 * value is under 2e-38). */
static inline float exp_nonpos(float x) {
    const float e = exp_in_range(x < -87.f ? -87.f : x);
    return x < -87.f ? 0.f : e;
}

/* Element d of a K or V row, as float32 (exact for every row format). */
static inline __attribute__((always_inline)) float elem(const uint8_t *row, int64_t d, const int fmt) {
    if (fmt == KV_INT8) return (float)((const int8_t *)row)[d];
    if (fmt == KV_F16) return half_to_float(((const uint16_t *)row)[d]);
    return ((const float *)row)[d];
}

/* One K row's dot with a query head (any head_dim): 8 partial sums, fixed tree. */
static inline __attribute__((always_inline)) float
row_dot(const float *x, const uint8_t *row, int64_t head_dim, const int fmt) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= head_dim; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(x[d + l], elem(row, d + l, fmt), acc[l]);
    float s = tree8(acc);
    for (; d < head_dim; d++) s = fmaf(x[d], elem(row, d, fmt), s);
    return s;
}

static inline __attribute__((always_inline)) void
row_axpy(float *restrict y, float w, const uint8_t *row, int64_t head_dim, const int fmt) {
    for (int64_t d = 0; d < head_dim; d++) y[d] = fmaf(w, elem(row, d, fmt), y[d]);
}

static inline __attribute__((always_inline)) float row_scale(const uint8_t *row, int64_t head_dim, const int fmt) {
    float s = 1.f;
    if (fmt == KV_INT8) memcpy(&s, row + head_dim, 4);
    return s;
}

/* A task's K and V rows are fetched ahead, into L2: they are strided by the slot (every KV
 * head's row sits in it) and the blocks are scattered over the pool, so the hardware prefetcher
 * alone leaves each row's load waiting on memory. Block b of the context (positions [b bs,
 * (b + 1) bs) clipped to [start, len)) is requested, K and V rows alike, when the K pass enters
 * block b - AHEAD; the V pass then finds its rows in cache. Into L2 (prefetcht1), not L1: a
 * prefetch into L1 holds one of the core's few L1 miss buffers until its line arrives, and with
 * 2 blocks of rows in flight those run out (per-row L1 prefetches make decode steps much
 * slower; timings: docs/benchmarks.md). A task's
 * first AHEAD blocks are requested by the task before it (the next (row, kv head) in the loop's
 * order), between its K and V passes, so no task starts on a cold context. */
#define AHEAD 2
static inline __attribute__((always_inline)) void
prefetch_block(const uint8_t *kh, const uint8_t *vh, const int64_t *table, int64_t b, int64_t block_size,
               int64_t start, int64_t len, int64_t tok_stride, int64_t row_bytes) {
    int64_t p0 = b * block_size, p1 = p0 + block_size;
    p0 = p0 < start ? start : p0;
    p1 = p1 > len ? len : p1;
    if (p0 >= p1) return;
    const int64_t o = (table[b] * block_size + p0 - b * block_size) * tok_stride;
    for (int64_t j = 0; j < p1 - p0; j++)
        for (int64_t c = 0; c < row_bytes; c += 64) {
            __builtin_prefetch(kh + o + j * tok_stride + c, 0, 2);
            __builtin_prefetch(vh + o + j * tok_stride + c, 0, 2);
        }
}

/* The first position of a context of len tokens that a window (> 0) lets a query see. */
static inline int64_t context_start(int64_t len, int64_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

/* The first AHEAD blocks of a context [start, len), requested before its K pass needs them. */
static inline __attribute__((always_inline)) void
prefetch_first_blocks(const uint8_t *kh, const uint8_t *vh, const int64_t *table, int64_t block_size,
                      int64_t start, int64_t len, int64_t tok_stride, int64_t row_bytes) {
    for (int64_t b = start / block_size; b < start / block_size + AHEAD; b++)
        prefetch_block(kh, vh, table, b, block_size, start, len, tok_stride, row_bytes);
}

/* Rows of 8 floats as GCC/clang vector values: element-wise IEEE operations, so the same bits as
 * the scalar loops above in every build (no contraction: -ffp-contract=off). */
typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8i8 __attribute__((vector_size(8)));

static inline __attribute__((always_inline)) v8f load8(const uint8_t *row, int64_t c, const int fmt) {
    v8f v;
    if (fmt == KV_INT8) {
        v8i8 q;
        memcpy(&q, row + 8 * c, 8);
        return __builtin_convertvector(q, v8f);
    }
    if (fmt == KV_F16) {                 /* exact conversions: the same floats on every build */
#if defined(__F16C__)
        const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 16 * c)));
        memcpy(&v, &f, 32);
#elif defined(__aarch64__)
        const uint16x8_t h = vld1q_u16((const uint16_t *)(row + 16 * c));
        const float32x4_t lo = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h)));
        const float32x4_t hi = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h)));
        memcpy(&v, &lo, 16);
        memcpy((char *)&v + 16, &hi, 16);
#else
        for (int l = 0; l < 8; l++) v[l] = half_to_float(((const uint16_t *)row)[8 * c + l]);
#endif
        return v;
    }
    memcpy(&v, row + 32 * c, 32);
    return v;
}

static inline __attribute__((always_inline)) v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* row_dot for head_dim = 8 C (C 8-float chunks, a compile-time constant), the K row already
 * converted to chunks: the same 8 partial sums and tree, with the query's chunks in registers. */
static inline __attribute__((always_inline)) float row_dot8(const v8f *x, const v8f *k, const int C) {
    v8f acc = {0};
    UNROLL for (int c = 0; c < C; c++) acc = fma8(x[c], k[c], acc);
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* row_dot8 for 8 consecutive keys at once (kb: their converted rows, C chunks each): the same
 * 8 lane partial sums per key, then the same tree, ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 +
 * a7)), taken across the 8 keys' partials by shuffles, so each score has row_dot8's bits. The 8
 * keys' sums are independent chains (row_dot8 alone is one chain of C dependent additions and
 * a horizontal tree per key). Returns the 8 scores in key order. Taken where 8-float vectors are
 * registers (x86 AVX2 and AVX-512 builds); elsewhere the shuffles cost more than they save, and
 * keys go one by one, with the same bits. */
#if defined(__AVX2__)
#define KEYS8 1
#else
#define KEYS8 0
#endif
#if KEYS8
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif
typedef int32_t v8i __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) v8f dot8_keys(const v8f *x, const v8f *kb, const int C) {
    v8f a[8];
    UNROLL for (int j = 0; j < 8; j++) a[j] = (v8f){0};
    UNROLL for (int c = 0; c < C; c++) {
        const v8f xc = x[c];
        UNROLL for (int j = 0; j < 8; j++) a[j] = fma8(xc, kb[j * C + c], a[j]);
    }
    /* B[j/2] = [a_l + a_{l+4} of key j, l < 4 | the same of key j + 1] */
    v8f B[4];
    UNROLL for (int j = 0; j < 4; j++)
        B[j] = SHUF(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + SHUF(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    /* b0 | b2 and b1 | b3 of keys 0-3 (from B[0], B[1]) and 4-7 (B[2], B[3]) */
    const v8f x02 = SHUF(B[0], B[1], 0, 4, 8, 12, 2, 6, 10, 14);
    const v8f x13 = SHUF(B[0], B[1], 1, 5, 9, 13, 3, 7, 11, 15);
    const v8f y02 = SHUF(B[2], B[3], 0, 4, 8, 12, 2, 6, 10, 14);
    const v8f y13 = SHUF(B[2], B[3], 1, 5, 9, 13, 3, 7, 11, 15);
    const v8f c = SHUF(x02, y02, 0, 1, 2, 3, 8, 9, 10, 11)
                + SHUF(x02, y02, 4, 5, 6, 7, 12, 13, 14, 15);   /* b0 + b2 */
    const v8f e = SHUF(x13, y13, 0, 1, 2, 3, 8, 9, 10, 11)
                + SHUF(x13, y13, 4, 5, 6, 7, 12, 13, 14, 15);   /* b1 + b3 */
    return c + e;
}
#endif

/* head_dim = 8 C: the weighted sum of V for G lanes (query heads: of a row's group, or of a run's
 * rows) in passes over the context's V rows, each pass taking P of the C 8-float chunks of every
 * lane (G P accumulators in registers, each V chunk read and converted once per pass for the G
 * lanes). P is the largest divisor of C with G P <= the registers set aside for it. Beside the
 * accumulators a pass holds the G weights and the V chunk (the fused multiply-add needs no
 * register for a product): with 32 vector registers (AVX-512) 24 accumulators fit (3 lanes of 64
 * in one pass), with 16 (AVX2, NEON, portable) 12 do (3 lanes of 32), for a single row's group
 * and a run's lanes alike (for runs, 12 is faster than 8: docs/benchmarks.md). The
 * K pass fetched the V rows ahead (prefetch_block), so every pass finds them in cache.
 * Every output element gets the same additions in the same order whatever the passes. */
#if defined(__AVX512F__)
#define V_ACCUMULATORS 24
#else
#define V_ACCUMULATORS 12
#endif

/* Chunks per pass for G heads and a budget of A accumulators: all C when they fit, else 8 or 4
 * (they divide 8 and 16). */
#define CHUNKS_PER_PASS(G, C, A) ((A) / (G) >= (C) ? (C) : (A) / (G) >= 8 ? 8 : 4)

/* Pass over keys [p0, p1) for G lanes (query heads, each with its own scores and output): chunks
 * c0 .. c0 + P - 1 of each lane's weighted sum of V. Lane g's weight for the key at position p is
 * sc[g][p - origin]; its sums start from 0 or, with cont, continue from o[g] (a sum kept in memory
 * keeps its value, so a pass split over key ranges adds in the same order as one pass). */
static inline __attribute__((always_inline)) void
v_pass(const uint8_t *vh, const int64_t *table, int64_t block_size, int64_t tok_stride, int64_t p0, int64_t p1,
       const float *const *sc, int64_t origin, float *const *o, int64_t head_dim, const int fmt, const int G,
       const int c0, const int P, const int cont) {
    v8f acc[V_ACCUMULATORS];            /* fixed size, not a VLA: it stays in registers */
    UNROLL for (int g = 0; g < G; g++)
        UNROLL for (int c = 0; c < P; c++) {
            if (cont) memcpy(&acc[g * P + c], o[g] + 8 * (c0 + c), 32);
            else acc[g * P + c] = (v8f){0};
        }
    for (int64_t p = p0; p < p1;) {
        const int64_t off = p % block_size, run = (block_size - off < p1 - p) ? block_size - off : p1 - p;
        const uint8_t *vr = vh + (table[p / block_size] * block_size + off) * tok_stride;
        for (int64_t j = 0; j < run; j++, p++, vr += tok_stride) {
            const float vs = row_scale(vr, head_dim, fmt);
            float w[3];
            UNROLL for (int g = 0; g < G; g++) w[g] = sc[g][p - origin] * vs;
            UNROLL for (int c = 0; c < P; c++) {     /* chunk by chunk: G P + 1 registers */
                const v8f vv = load8(vr, c0 + c, fmt);
                UNROLL for (int g = 0; g < G; g++) acc[g * P + c] = fma8(splat8(w[g]), vv, acc[g * P + c]);
            }
        }
    }
    UNROLL for (int g = 0; g < G; g++)
        UNROLL for (int c = 0; c < P; c++) memcpy(o[g] + 8 * (c0 + c), &acc[g * P + c], 32);
}

/* The weighted V sums of `lanes` lanes over keys [p0, p1) (v_pass's arguments): up to max_g lanes
 * together (1, 2 or 3), each set in passes of the chunks that A accumulators hold
 * (CHUNKS_PER_PASS; A: V_ACCUMULATORS). */
static inline __attribute__((always_inline)) void
v_sums(const uint8_t *vh, const int64_t *table, int64_t block_size, int64_t tok_stride, int64_t p0, int64_t p1,
       const float *const *sc, int64_t origin, float *const *o, int64_t lanes, const int max_g, int64_t head_dim,
       const int fmt, const int C, const int A, const int cont) {
#define PASSES(G) do { \
        const int P = CHUNKS_PER_PASS(G, C, A); \
        for (int c0 = 0; c0 < C; c0 += P) \
            v_pass(vh, table, block_size, tok_stride, p0, p1, sc + l, origin, o + l, head_dim, fmt, G, c0, P, cont); \
    } while (0)
    for (int64_t l = 0; l < lanes;) {      /* G and P compile-time constants in each branch */
        const int G = lanes - l >= max_g ? max_g : (int)(lanes - l);
        if (G == 3) PASSES(3);
        else if (G == 2) PASSES(2);
        else PASSES(1);
        l += G;
    }
#undef PASSES
}

/* exp(s - mx) in place over n scores, returning their sum (8 partial sums, fixed tree). */
static inline float softmax_numerators(float *restrict sc, int64_t n, float mx) {
    float acc[LANES] = {0};
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES)
        for (int l = 0; l < LANES; l++) {
            const float e = exp_nonpos(sc[t + l] - mx);
            sc[t + l] = e;
            acc[l] += e;
        }
    float s = tree8(acc);
    for (; t < n; t++) {
        sc[t] = exp_nonpos(sc[t] - mx);
        s += sc[t];
    }
    return s;
}

/* What every task of a call shares. */
typedef struct {
    const float *q;
    const uint8_t *kc, *vc;
    float *out;
    const int64_t *qrow, *qseq, *tables, *lens;
    int64_t table_stride, num_rows, num_heads, kv_heads, head_dim, block_size, window;
    int64_t group, row_bytes, tok_stride;
    float scale;
} attn_call_t;

/* Task (row i, KV head h): row i's group of query heads over its own context. */
static inline __attribute__((always_inline)) void
attend_row(const attn_call_t *a, int64_t i, int64_t h, const int fmt, const int C) {
    const int64_t head_dim = a->head_dim, block_size = a->block_size, group = a->group;
    const int64_t row_bytes = a->row_bytes, tok_stride = a->tok_stride, window = a->window;
    const int64_t len = a->lens[i];
    const int64_t start = context_start(len, window);
    const int64_t n = len - start;
    const int64_t *table = a->tables + (a->qseq ? a->qseq[i] : i) * a->table_stride;
    const float *qh = a->q + (a->qrow[i] * a->num_heads + h * group) * head_dim;
    float *oh = a->out + (a->qrow[i] * a->num_heads + h * group) * head_dim;
    float *scores = (float *)malloc(sizeof(float) * group * (n > 0 ? n : 1));
    float mx[MAX_GROUP], sum[MAX_GROUP];
    if (!scores) {                       /* out of memory: a visible NaN, never a crash */
        for (int64_t d = 0; d < group * head_dim; d++) oh[d] = NAN;
        return;
    }
    for (int64_t g = 0; g < group; g++) mx[g] = -INFINITY;
#if KEYS8
    v8f mx8[MAX_GROUP];                 /* the 8-key path's running maxima, lane by lane */
    for (int64_t g = 0; g < group; g++) mx8[g] = (v8f){0} - INFINITY;
#endif
    v8f qv[MAX_GROUP * MAX_C];                  /* the group's queries, as 8-float chunks */
    for (int64_t g = 0; C && g < group; g++)
        for (int c = 0; c < C; c++) memcpy(&qv[g * C + c], qh + g * head_dim + 8 * c, 32);
    /* Walk the context block by block (no division per key): positions p in [start, len),
     * slot = table[p / block_size] * block_size + p % block_size. */
    const uint8_t *kh = a->kc + h * row_bytes, *vh = a->vc + h * row_bytes;
    prefetch_first_blocks(kh, vh, table, block_size, start, len, tok_stride, row_bytes);
    for (int64_t p = start, t = 0; p < len;) {
        const int64_t off = p % block_size, run = (block_size - off < len - p) ? block_size - off : len - p;
        const uint8_t *kr = kh + (table[p / block_size] * block_size + off) * tok_stride;
        prefetch_block(kh, vh, table, p / block_size + AHEAD, block_size, start, len, tok_stride, row_bytes);
        int64_t j = 0;
#if KEYS8
        for (; C && j + 8 <= run; j += 8, t += 8, kr += 8 * tok_stride) {   /* 8 keys at once */
            v8f kb[8 * MAX_C], ks;               /* their rows, converted once for the group */
            UNROLL for (int u = 0; u < 8; u++) {
                ks[u] = a->scale * row_scale(kr + u * tok_stride, head_dim, fmt);
                UNROLL for (int c = 0; c < C; c++) kb[u * C + c] = load8(kr + u * tok_stride, c, fmt);
            }
            for (int64_t g = 0; g < group; g++) {
                const v8f sv = dot8_keys(qv + g * C, kb, C) * ks;
                memcpy(scores + g * n + t, &sv, 32);
                const v8i up = sv > mx8[g];          /* lane-wise; the lanes meet after the pass */
                mx8[g] = (v8f)(((v8i)sv & up) | ((v8i)mx8[g] & ~up));
            }
        }
#endif
        for (; j < run; j++, t++, kr += tok_stride) {
            const float ks = a->scale * row_scale(kr, head_dim, fmt);
            v8f kk[MAX_C];                       /* the K row, converted once for the group */
            UNROLL for (int c = 0; c < C; c++) kk[c] = load8(kr, c, fmt);
            for (int64_t g = 0; g < group; g++) {
                const float s = (C ? row_dot8(qv + g * C, kk, C)
                                   : row_dot(qh + g * head_dim, kr, head_dim, fmt)) * ks;
                scores[g * n + t] = s;
                if (s > mx[g]) mx[g] = s;
            }
        }
        p += run;
    }
#if KEYS8
    for (int64_t g = 0; g < group; g++)    /* a maximum does not depend on the order */
        for (int u = 0; u < 8; u++) mx[g] = mx8[g][u] > mx[g] ? mx8[g][u] : mx[g];
#endif
    {   /* the next task's first blocks, while this one's V pass runs */
        const int64_t ni = h + 1 < a->kv_heads ? i : i + 1, nh = h + 1 < a->kv_heads ? h + 1 : 0;
        if (ni < a->num_rows)
            prefetch_first_blocks(a->kc + nh * row_bytes, a->vc + nh * row_bytes,
                                  a->tables + (a->qseq ? a->qseq[ni] : ni) * a->table_stride, block_size,
                                  context_start(a->lens[ni], window), a->lens[ni], tok_stride, row_bytes);
    }
    const float *sc[MAX_GROUP];
    float *o[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        sum[g] = softmax_numerators(scores + g * n, n, mx[g]);
        sc[g] = scores + g * n;
        o[g] = oh + g * head_dim;
        if (!C) memset(o[g], 0, sizeof(float) * head_dim);   /* row_axpy adds */
    }
    /* head_dim = 8 C: v_sums, groups of 2 or 3 heads together, larger ones head by head; any
     * other head_dim: the row_axpy loop below. */
    if (C)
        v_sums(vh, table, block_size, tok_stride, start, len, sc, start, o, group, group <= 3 ? (int)group : 1,
               head_dim, fmt, C, V_ACCUMULATORS, 0);
    for (int64_t p = start, t = 0; p < len && !C;) {
        const int64_t off = p % block_size, run = (block_size - off < len - p) ? block_size - off : len - p;
        const uint8_t *vr = vh + (table[p / block_size] * block_size + off) * tok_stride;
        for (int64_t j = 0; j < run; j++, t++, vr += tok_stride) {
            const float vs = row_scale(vr, head_dim, fmt);
            for (int64_t g = 0; g < group; g++) row_axpy(o[g], scores[g * n + t] * vs, vr, head_dim, fmt);
        }
        p += run;
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.f / sum[g];
        for (int64_t d = 0; d < head_dim; d++) o[g][d] *= inv;
    }
    free(scores);
}

/* A run: rows i0 .. i0 + R - 1 of one sequence at consecutive positions (lens[i0] + r), no window
 * (a prompt chunk's tokens, or a verification's): task (run, KV head h) takes the R x group query
 * heads ("lanes", row-major) of its rows together, so each K and V row of the shared context is
 * read and converted once per task instead of once per row. Every lane gets the single-row task's
 * numbers bit for bit:
 *   scores: each key's dot product is row_dot8's (or dot8_keys', the same bits) times the same
 *       scale, whichever way a key is taken; keys past a lane's own context are scored too and
 *       never read;
 *   maximum and softmax_numerators: over the lane's own n = len scores, from the start of its
 *       buffer, as attend_row does;
 *   the V sums: each output element adds w v over its keys in key order, from 0; here the keys
 *       [0, lens[i0]) that every row sees go tile by tile (the sums continue through memory, which
 *       keeps their values), then each row's own later keys. */
#define MAX_RUN 8            /* rows per run task */
#define TASKS_PER_THREAD 4   /* runs are cut so a call has about this many tasks per thread */
#define V_TILE 64            /* keys per tile of the joint V pass: their rows stay in L1 */

/* Lanes a run's V sums take together (v_sums): 3, with 8 chunks (AVX-512) or 4 (elsewhere) each. */
#define V_LANES 3

/* Task (run of R rows from i0, KV head h), head_dim = 8 C (C > 0). Returns 0, or -1 when out of
 * memory (the caller then runs the rows one by one). */
static inline __attribute__((always_inline)) int
attend_run(const attn_call_t *a, int64_t i0, int64_t R, int64_t h, const int fmt, const int C) {
    const int64_t group = a->group, head_dim = a->head_dim, block_size = a->block_size, tok_stride = a->tok_stride;
    const int64_t lanes = R * group, len0 = a->lens[i0], n_all = len0 + R - 1;
    const int64_t *table = a->tables + a->qseq[i0] * a->table_stride;
    const uint8_t *kh = a->kc + h * a->row_bytes, *vh = a->vc + h * a->row_bytes;
    /* One allocation, carved: the queries and 8-key maxima (v8f), the lanes' score and output
     * pointers, then the scores and each lane's maximum and sum (floats). */
    const size_t vec_bytes = sizeof(v8f) * lanes * (C + 1), ptr_bytes = 2 * sizeof(void *) * lanes;
    const size_t bytes = (vec_bytes + ptr_bytes + sizeof(float) * lanes * (n_all + 2) + 31) / 32 * 32;
    char *mem = aligned_alloc(32, bytes);
    if (!mem) return -1;
    v8f *qv = (v8f *)mem, *mx8 = qv + lanes * C;   /* mx8: lane-wise maxima over keys every lane sees */
    const float **sc = (const float **)(mem + vec_bytes);
    float **o = (float **)(sc + lanes);
    float *scores = (float *)(mem + vec_bytes + ptr_bytes), *mx = scores + lanes * n_all, *sum = mx + lanes;
    for (int64_t l = 0; l < lanes; l++) {
        mx[l] = -INFINITY;
        mx8[l] = (v8f){0} - INFINITY;
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < group; g++) {
            const int64_t l = r * group + g, head = h * group + g;
            memcpy(qv + l * C, a->q + (a->qrow[i0 + r] * a->num_heads + head) * head_dim, 32 * C);
            sc[l] = scores + l * n_all;
            o[l] = a->out + (a->qrow[i0 + r] * a->num_heads + head) * head_dim;
        }
    /* K: every lane's scores over the run's keys [0, n_all), each K row converted once. */
    prefetch_first_blocks(kh, vh, table, block_size, 0, n_all, tok_stride, a->row_bytes);
    for (int64_t p = 0, t = 0; p < n_all;) {
        const int64_t off = p % block_size, run = (block_size - off < n_all - p) ? block_size - off : n_all - p;
        const uint8_t *kr = kh + (table[p / block_size] * block_size + off) * tok_stride;
        prefetch_block(kh, vh, table, p / block_size + AHEAD, block_size, 0, n_all, tok_stride, a->row_bytes);
        int64_t j = 0;
#if KEYS8
        for (; j + 8 <= run; j += 8, t += 8, kr += 8 * tok_stride) {
            v8f kb[8 * MAX_C], ks;
            UNROLL for (int u = 0; u < 8; u++) {
                ks[u] = a->scale * row_scale(kr + u * tok_stride, head_dim, fmt);
                UNROLL for (int c = 0; c < C; c++) kb[u * C + c] = load8(kr + u * tok_stride, c, fmt);
            }
            for (int64_t l = 0; l < lanes; l++) {
                const v8f sv = dot8_keys(qv + l * C, kb, C) * ks;
                memcpy(scores + l * n_all + t, &sv, 32);
                if (t + 8 <= len0) {                /* keys every lane sees: lane-wise maxima */
                    const v8i up = sv > mx8[l];
                    mx8[l] = (v8f)(((v8i)sv & up) | ((v8i)mx8[l] & ~up));
                } else {                            /* each lane's own keys only */
                    for (int u = 0; u < 8 && t + u < len0 + l / group; u++) mx[l] = sv[u] > mx[l] ? sv[u] : mx[l];
                }
            }
        }
#endif
        for (; j < run; j++, t++, kr += tok_stride) {
            const float ks = a->scale * row_scale(kr, head_dim, fmt);
            v8f kk[MAX_C];
            UNROLL for (int c = 0; c < C; c++) kk[c] = load8(kr, c, fmt);
            for (int64_t l = 0; l < lanes; l++) {
                const float sv = row_dot8(qv + l * C, kk, C) * ks;
                scores[l * n_all + t] = sv;
                if (t < len0 + l / group && sv > mx[l]) mx[l] = sv;
            }
        }
        p += run;
    }
    for (int64_t l = 0; l < lanes; l++) {        /* each lane over its own context: len0 + its row */
#if KEYS8
        for (int u = 0; u < 8; u++) mx[l] = mx8[l][u] > mx[l] ? mx8[l][u] : mx[l];   /* a maximum: any order */
#endif
        sum[l] = softmax_numerators(scores + l * n_all, len0 + l / group, mx[l]);
    }
    /* V: the keys every row sees, tile by tile for all lanes; then each row's own later keys. */
    for (int64_t p = 0; p < len0; p += V_TILE)
        v_sums(vh, table, block_size, tok_stride, p, p + V_TILE < len0 ? p + V_TILE : len0, sc, 0, o, lanes,
               V_LANES, head_dim, fmt, C, V_ACCUMULATORS, p > 0);
    for (int64_t r = 1; r < R; r++)
        v_sums(vh, table, block_size, tok_stride, len0, len0 + r, sc + r * group, 0, o + r * group, group, V_LANES,
               head_dim, fmt, C, V_ACCUMULATORS, len0 > 0);
    for (int64_t l = 0; l < lanes; l++) {
        const float inv = 1.f / sum[l];
        for (int64_t d = 0; d < head_dim; d++) o[l][d] *= inv;
    }
    free(mem);
    return 0;
}

/* Whether row b continues the run of row b - 1: the same sequence, the next position, no window. */
static inline int continues_run(const attn_call_t *a, int64_t b) {
    return a->window <= 0 && a->qseq && a->qseq[b] == a->qseq[b - 1] && a->lens[b] == a->lens[b - 1] + 1;
}

/* The tasks of a call: rows in order, each run cut into pieces of ceil(len / want) rows (at most
 * MAX_RUN; want 0: every row alone). Returns their number; first (when not NULL): with k < 0,
 * every task's first row and then num_rows; with k >= 0, task k's first row and its end. */
static int64_t split_runs(const attn_call_t *a, int64_t want, int64_t k, int64_t *first) {
    int64_t n = 0;
    for (int64_t i = 0; i < a->num_rows;) {
        int64_t e = i + 1;
        while (want && e < a->num_rows && continues_run(a, e)) e++;
        int64_t per = want ? (e - i + want - 1) / want : 1;
        per = per > MAX_RUN ? MAX_RUN : per;
        for (int64_t s = i; s < e; s += per, n++) {      /* pieces [s, min(s + per, e)) */
            if (first && k < 0) first[n] = s;
            if (first && k == n) {
                first[0] = s;
                first[1] = s + per < e ? s + per : e;
                return n + 1;
            }
        }
        i = e;
    }
    if (first && k < 0) first[n] = a->num_rows;
    return n;
}

static inline __attribute__((always_inline)) void
attend(const float *q, const void *k_cache, const void *v_cache, float *out, const int64_t *qrow,
       const int64_t *qseq, const int64_t *tables, int64_t table_stride, const int64_t *lens,
       int64_t num_rows, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
       float scale, int64_t window, const int fmt, const int C) {
    const int64_t row_bytes = fmt == KV_INT8 ? head_dim + 4 : fmt == KV_F16 ? head_dim * 2 : head_dim * 4;
    const attn_call_t a = {q, (const uint8_t *)k_cache, (const uint8_t *)v_cache, out, qrow, qseq, tables, lens,
                           table_stride, num_rows, num_heads, kv_heads, head_dim, block_size, window,
                           num_heads / kv_heads, row_bytes, kv_heads * row_bytes, scale};
    /* Tasks: (task, KV head), a task being one row or a run of up to MAX_RUN rows (head_dim = 8 C;
     * runs are cut so a call has about 4 tasks per thread where its rows allow). Which rows share
     * a task changes no bit, only the speed. Every thread derives the same list (split_runs), from
     * its own copy, or by a scan per task when that copy could not be allocated. */
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t want = C ? (TASKS_PER_THREAD * threads + kv_heads - 1) / kv_heads : 0;
    const int64_t ntask = split_runs(&a, want, -1, NULL);
    int64_t *first = malloc(sizeof(int64_t) * (ntask + 1));
    if (first) split_runs(&a, want, -1, first);
    #pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t k = 0; k < ntask; k++)
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t bounds[2];
            if (!first) split_runs(&a, want, k, bounds);
            const int64_t i0 = first ? first[k] : bounds[0], R = (first ? first[k + 1] : bounds[1]) - i0;
            if (C && R > 1 && attend_run(&a, i0, R, h, fmt, C) == 0) continue;
            for (int64_t i = i0; i < i0 + R; i++) attend_row(&a, i, h, fmt, C);
        }
    free(first);
}

/* The work of one call shared by the threads of an enclosing OpenMP parallel region (layer_stack.c):
 * kv_format: KV_F32, KV_INT8 (rows with a scale) or KV_F16. Each branch is an instantiation with
 * its row format fixed at compile time. */
void paged_attention_team(const float *q, const void *k_cache, const void *v_cache, float *out,
                          const int64_t *qrow, const int64_t *qseq, const int64_t *tables, int64_t table_stride,
                          const int64_t *lens, int64_t num_rows, int64_t num_heads, int64_t kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, int64_t window, int64_t kv_format) {
    /* Instantiations with the row format and, for the usual head sizes, head_dim / 8 fixed at
     * compile time (C = 0: any head_dim). */
#define ATTEND(FMT, C) attend(q, k_cache, v_cache, out, qrow, qseq, tables, table_stride, lens, num_rows, \
                              num_heads, kv_heads, head_dim, block_size, scale, window, FMT, C)
#define BY_SIZE(FMT) do { if (C == 8) ATTEND(FMT, 8); else if (C == 16) ATTEND(FMT, 16); else ATTEND(FMT, 0); } while (0)
    const int C = head_dim == 64 ? 8 : head_dim == 128 ? 16 : 0;
    if (kv_format == KV_INT8) BY_SIZE(KV_INT8);
    else if (kv_format == KV_F16) BY_SIZE(KV_F16);
    else BY_SIZE(KV_F32);
#undef BY_SIZE
#undef ATTEND
}

/* The exported entry: its own parallel region over num_threads threads. */
void paged_attention(const float *q, const void *k_cache, const void *v_cache, float *out,
                     const int64_t *qrow, const int64_t *qseq, const int64_t *tables, int64_t table_stride,
                     const int64_t *lens, int64_t num_rows, int64_t num_heads, int64_t kv_heads,
                     int64_t head_dim, int64_t block_size, float scale, int64_t window,
                     int64_t num_threads, int64_t kv_format) {
    (void)num_threads;
    #pragma omp parallel num_threads(num_threads)
    paged_attention_team(q, k_cache, v_cache, out, qrow, qseq, tables, table_stride, lens, num_rows, num_heads,
                         kv_heads, head_dim, block_size, scale, window, kv_format);
}
