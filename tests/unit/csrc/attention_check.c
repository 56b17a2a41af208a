/* A self-contained check of the C paged attention (kvserve/ops/csrc/paged_attention.c): no files, no
 * Python. Built for each ISA (portable, AVX2, NEON under qemu-aarch64) it must print the same text,
 * because every sum in the kernel has one fixed order and every product-sum is one fused
 * multiply-add: tests/unit/test_arm_kernels.py and test_attention_builds.py compare the builds.
 *
 * Per case (row format float32 / int8 / half, head_dim 64, 128 or 20 (the path without 8-float
 * chunks), query heads per KV head 1 to 4, block size 4 or 16, with and without a sliding window)
 * one call over a batch of deterministic pseudo-random rows: a run of 5 rows of one sequence (a
 * verification), a run of 11 (longer than a run task), a lone decode row and a prompt chunk of 3
 * rows after a 1-token context, blocks scattered over the pool. It prints a hash of the output bits
 * and the first values' bits (all of them with --all), and exits 1 when an output is not within
 * 1e-4 of a double-precision softmax(q K^T scale) V of the same rows.
 *
 * Build, e.g.: cc -O2 -ffp-contract=off -I kvserve/ops/csrc tests/unit/csrc/attention_check.c
 *              kvserve/ops/csrc/paged_attention.c -lm -o attention_check
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "kv_format.h"

void paged_attention(const float *q, const void *k_cache, const void *v_cache, float *out, const int64_t *qrow,
                     const int64_t *qseq, const int64_t *tables, int64_t table_stride, const int64_t *lens,
                     int64_t num_rows, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                     float scale, int64_t window, int64_t num_threads, int64_t kv_format);

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 16);
}
static float uniform(float a) { return a * ((float)(next() % 65536) / 32768.f - 1.f); }   /* exact */

/* IEEE half bits of a finite value in about [-2, 2] (exponents 2^-6 .. 2^0, some subnormal). */
static uint16_t random_half(void) {
    const uint32_t r = next();
    const uint16_t mant = r & 0x3FF, sign = (r >> 10) & 1;
    const uint16_t exp = (r >> 11) % 8 == 0 ? 0 : 9 + (r >> 14) % 7;
    return (uint16_t)(sign << 15 | exp << 10 | mant);
}

/* The value stored at element d of a row (kv_format.h's formats). */
static double stored(const uint8_t *row, int64_t d, int64_t head_dim, int fmt) {
    if (fmt == KV_F32) return ((const float *)row)[d];
    if (fmt == KV_F16) return half_to_float(((const uint16_t *)row)[d]);
    float s;
    memcpy(&s, row + head_dim, 4);
    return (double)s * ((const int8_t *)row)[d];
}

static int check_case(int fmt, int64_t D, int64_t group, int64_t block_size, int64_t window, int all) {
    const int64_t kv_heads = 3, heads = kv_heads * group;
    /* sequences: (context before its rows, rows) */
    const int64_t before[4] = {37, 60, 90, 1}, nrows[4] = {5, 11, 1, 3};
    const int64_t row_bytes = fmt == KV_INT8 ? D + 4 : fmt == KV_F16 ? 2 * D : 4 * D;
    const int64_t tok_stride = kv_heads * row_bytes;
    int64_t R = 0, nblk = 0;
    for (int s = 0; s < 4; s++) {
        R += nrows[s];
        const int64_t b = (before[s] + nrows[s] + block_size - 1) / block_size;
        nblk = b > nblk ? b : nblk;
    }
    const int64_t num_blocks = 4 * nblk + 3;
    uint8_t *kc = malloc(num_blocks * block_size * tok_stride), *vc = malloc(num_blocks * block_size * tok_stride);
    float *q = malloc(sizeof(float) * R * heads * D), *out = malloc(sizeof(float) * R * heads * D);
    int64_t *tables = malloc(sizeof(int64_t) * 4 * nblk), *qrow = malloc(sizeof(int64_t) * R);
    int64_t *qseq = malloc(sizeof(int64_t) * R), *lens = malloc(sizeof(int64_t) * R);
    int64_t *perm = malloc(sizeof(int64_t) * num_blocks);
    for (int64_t b = 0; b < num_blocks; b++) perm[b] = b;
    for (int64_t b = num_blocks - 1; b > 0; b--) {       /* blocks scattered over the pool */
        const int64_t j = next() % (b + 1), t = perm[b];
        perm[b] = perm[j];
        perm[j] = t;
    }
    for (int64_t i = 0; i < 4 * nblk; i++) tables[i] = perm[i];
    for (int64_t slot = 0; slot < num_blocks * block_size * kv_heads; slot++) {
        uint8_t *k = kc + slot * row_bytes, *v = vc + slot * row_bytes;
        for (int64_t d = 0; d < D; d++) {
            if (fmt == KV_F32) {
                ((float *)k)[d] = uniform(2.f);
                ((float *)v)[d] = uniform(2.f);
            } else if (fmt == KV_F16) {
                ((uint16_t *)k)[d] = random_half();
                ((uint16_t *)v)[d] = random_half();
            } else {
                ((int8_t *)k)[d] = (int8_t)(next() % 255 - 127);
                ((int8_t *)v)[d] = (int8_t)(next() % 255 - 127);
            }
        }
        if (fmt == KV_INT8) {
            const float ks = (1 + next() % 64) / 2048.f, vs = (1 + next() % 64) / 2048.f;
            memcpy(k + D, &ks, 4);
            memcpy(v + D, &vs, 4);
        }
    }
    for (int64_t i = 0; i < R * heads * D; i++) q[i] = uniform(1.5f);
    for (int64_t s = 0, i = 0; s < 4; s++)
        for (int64_t r = 0; r < nrows[s]; r++, i++) {
            qrow[i] = R - 1 - i;                            /* rows out of order in q and out */
            qseq[i] = s;
            lens[i] = before[s] + r + 1;
        }
    const float scale = 1.f / sqrtf((float)D);
    paged_attention(q, kc, vc, out, qrow, qseq, tables, nblk, lens, R, heads, kv_heads, D, block_size, scale,
                    window, 1, fmt);

    int ok = 1;
    double worst = 0;
    double *p = malloc(sizeof(double) * 200);
    for (int64_t i = 0; i < R; i++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t kvh = h / group, len = lens[i], start = window > 0 && len > window ? len - window : 0;
            const float *qh = q + (qrow[i] * heads + h) * D;
            const int64_t *table = tables + qseq[i] * nblk;
            double mx = -INFINITY, sum = 0;
            for (int64_t t = start; t < len; t++) {
                const uint8_t *k = kc + ((table[t / block_size] * block_size + t % block_size) * kv_heads + kvh) * row_bytes;
                double s = 0;
                for (int64_t d = 0; d < D; d++) s += (double)qh[d] * stored(k, d, D, fmt);
                p[t - start] = s * scale;
                mx = p[t - start] > mx ? p[t - start] : mx;
            }
            for (int64_t t = start; t < len; t++) sum += (p[t - start] = exp(p[t - start] - mx));
            for (int64_t d = 0; d < D; d++) {
                double o = 0;
                for (int64_t t = start; t < len; t++) {
                    const uint8_t *v = vc + ((table[t / block_size] * block_size + t % block_size) * kv_heads + kvh) * row_bytes;
                    o += p[t - start] * stored(v, d, D, fmt);
                }
                const double err = fabs(o / sum - out[(qrow[i] * heads + h) * D + d]);
                worst = err > worst ? err : worst;
                if (!(err <= 1e-4)) ok = 0;
            }
        }
    uint64_t hash = 1469598103934665603ull;
    for (int64_t i = 0; i < R * heads * D; i++) {
        uint32_t u;
        memcpy(&u, &out[i], 4);
        hash = (hash ^ u) * 1099511628211ull;
    }
    printf("fmt %d head_dim %3lld group %lld block %2lld window %lld: hash %016llx first", fmt, (long long)D,
           (long long)group, (long long)block_size, (long long)window, (unsigned long long)hash);
    for (int64_t i = 0; i < (all ? R * heads * D : 4); i++) {
        uint32_t u;
        memcpy(&u, &out[i], 4);
        printf(" %08x", u);
    }
    printf("%s\n", ok ? "" : " REFERENCE MISMATCH");
    if (!ok) fprintf(stderr, "case off the reference by %g\n", worst);
    free(p); free(kc); free(vc); free(q); free(out); free(tables); free(qrow); free(qseq); free(lens); free(perm);
    return ok;
}

int main(int argc, char **argv) {
    const int all = argc > 1 && strcmp(argv[1], "--all") == 0;
    int ok = 1, cases = 0;
    const int64_t dims[3] = {64, 128, 20};
    for (int fmt = 0; fmt < 3; fmt++)
        for (int di = 0; di < 3; di++)
            for (int64_t group = 1; group <= 4; group++)
                for (int64_t bs = 4; bs <= 16; bs += 12)
                    for (int64_t window = 0; window <= 17; window += 17, cases++)
                        ok &= check_case(fmt, dims[di], group, bs, window, all);
    printf("reference check of %d cases: %s\n", cases, ok ? "passed" : "FAILED");
    return ok ? 0 : 1;
}
