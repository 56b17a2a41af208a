/* Paged decode attention on the CPU: one query token per row, read over its request's context
 * straight from the paged KV pool (no gather into fresh tensors).
 *
 * Pool layout (one layer): k_cache, v_cache float32 [num_blocks][block_size][kv_heads][head_dim].
 * Row i: query q[qrow[i]] (float32 [num_heads][head_dim]), context lens[i] tokens whose slots are
 * tables[i][p / block_size] * block_size + p % block_size; keys older than `window` positions
 * (window > 0) are skipped. Output goes to out[qrow[i]] ([num_heads][head_dim]).
 *
 * One task per (row, kv head); the group of num_heads / kv_heads query heads that share a KV head
 * is computed together, so every K and V row is read once. Two passes: scores (kept in a per-task
 * buffer), then softmax and the weighted sum of V. Build: cc -O3 -march=native -fopenmp -shared.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16

/* exp(x) for x <= 0 (scores minus their max), vectorizable (Cephes' expf scheme, about 1 ulp):
 * x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for an exact reduction), exp(r) by a
 * degree-7 polynomial, 2^n added to the float's exponent bits. Below -87 the result is flushed
 * to 0 (the true value is under 2e-38). */
static inline float exp_nonpos(float x) {
    const float xc = x < -87.f ? -87.f : x;
    const float n = rintf(xc * 1.44269504088896341f);
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } u = {p};
    u.i += (int32_t)n << 23;
    return x < -87.f ? 0.f : u.f;
}

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                      const int64_t *qrow, const int64_t *tables, int64_t table_stride,
                      const int64_t *lens, int64_t num_rows, int64_t num_heads, int64_t kv_heads,
                      int64_t head_dim, int64_t block_size, float scale, int64_t window,
                      int64_t num_threads) {
    const int64_t group = num_heads / kv_heads;
    const int64_t tok_stride = kv_heads * head_dim;        /* floats between slots */
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < num_rows; i++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t len = lens[i];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t n = len - start;
            const int64_t *table = tables + i * table_stride;
            const float *qh = q + qrow[i] * num_heads * head_dim + h * group * head_dim;
            float *oh = out + qrow[i] * num_heads * head_dim + h * group * head_dim;
            float *scores = (float *)malloc(sizeof(float) * group * (n > 0 ? n : 1));
            float mx[MAX_GROUP], sum[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) mx[g] = -INFINITY;
            /* Walk the context block by block (no division per key): positions p in
             * [start, len), slot = table[p / block_size] * block_size + p % block_size. */
            for (int64_t p = start, t = 0; p < len;) {
                const int64_t off = p % block_size, run = (block_size - off < len - p) ? block_size - off : len - p;
                const float *kr = k_cache + (table[p / block_size] * block_size + off) * tok_stride + h * head_dim;
                for (int64_t j = 0; j < run; j++, t++, kr += tok_stride) {
                    for (int64_t g = 0; g < group; g++) {
                        const float *qg = qh + g * head_dim;
                        float s = 0.f;
                        for (int64_t d = 0; d < head_dim; d++) s += qg[d] * kr[d];
                        s *= scale;
                        scores[g * n + t] = s;
                        if (s > mx[g]) mx[g] = s;
                    }
                }
                p += run;
            }
            for (int64_t g = 0; g < group; g++) {
                float acc = 0.f;
                float *restrict sc = scores + g * n;
                const float m = mx[g];
                #pragma omp simd reduction(+:acc)
                for (int64_t t = 0; t < n; t++) {
                    const float e = exp_nonpos(sc[t] - m);
                    sc[t] = e;
                    acc += e;
                }
                sum[g] = acc;
                memset(oh + g * head_dim, 0, sizeof(float) * head_dim);
            }
            for (int64_t p = start, t = 0; p < len;) {
                const int64_t off = p % block_size, run = (block_size - off < len - p) ? block_size - off : len - p;
                const float *vr = v_cache + (table[p / block_size] * block_size + off) * tok_stride + h * head_dim;
                for (int64_t j = 0; j < run; j++, t++, vr += tok_stride) {
                    for (int64_t g = 0; g < group; g++) {
                        const float w = scores[g * n + t];
                        float *restrict og = oh + g * head_dim;
                        for (int64_t d = 0; d < head_dim; d++) og[d] += w * vr[d];
                    }
                }
                p += run;
            }
            for (int64_t g = 0; g < group; g++) {
                const float inv = 1.f / sum[g];
                float *og = oh + g * head_dim;
                for (int64_t d = 0; d < head_dim; d++) og[d] *= inv;
            }
            free(scores);
        }
    }
}
