/* A self-contained check of the GGUF block GEMV (kvserve/ops/csrc/gguf_gemv.c + one per-ISA
 * kernel): no files, no Python. Linked with each kernel (and built for each ISA) it must print the
 * same text, because gguf_gemv.h fixes every float operation: tests/unit/test_arm_kernels.py
 * compares the NEON kernel with the portable one under qemu-aarch64, and both with a native build.
 *
 * It packs deterministic pseudo-random weights straight into the interleaved layout of
 * gguf_gemv.h (Q4 with Q4_0-style m = -8 d and Q4_1-style m of either sign, Q8 including
 * q = -128, K4 and K8 with 6-bit sub-block scales under fp16 super-block scales (K8: Q5_K-like
 * with m, Q6_K-like with a signed scale per half and m = -0), F8 with float32 scales (Q5_1-like),
 * K3 (Q3_K's 3 bits, a signed scale per half) and X4 (IQ4_XS's table indices, a signed scale);
 * fp16 scales normal, subnormal and zero; rows past N zero), makes activations with an
 * outlier, an all-zero block and a row small enough for subnormal d dx (compared bit for bit, not
 * with the reference below: such scales keep few significant bits), runs gguf_gemv over
 * shapes with N not a multiple of 16 and M = 1..20 (every tile size R = 1..8), and prints per
 * case a hash of the output bits and the first values' bits (all of them with --all), for the
 * integer GEMV and for the float32 GEMM of prompt tokens (gguf_gemm_f32).
 * It also checks every output against a double-precision sum of the dequantized weights times x:
 * |y - ref| <= 2^-12 sum_k |w_k x_k| + 2^-14 sum_k (|d q_k| + |m|) max|x of k's block| (the
 * activations' rounding: about 2^-15 of the block's max |x| per weight piece, 2^-8 with one
 * 8-bit part (gguf-a8) or mixed parts (gguf-mixed), whose GEMVs run too; float32 GEMM:
 * K 2^-24 sum_k |w_k x_k|) (+ 2^-20 (|bias| + |y before|)); exit status 1 if not.
 *
 * Build, e.g.: cc -O2 -ffp-contract=off -I kvserve/ops/csrc tests/unit/csrc/gemv_check.c
 *              kvserve/ops/csrc/gguf_gemv.c kvserve/ops/csrc/gguf_gemv_portable.c -o gemv_check
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_gemv.h"

/* gguf_gemv.c's entry points (no header declares them). */
int gguf_gemv(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
              int64_t M, float *y, int64_t ldy, const float *bias, int64_t accumulate,
              int64_t num_threads, int64_t parts);
int gguf_gemm_f32(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
                  int64_t M, float *y, int64_t ldy, const float *bias, int64_t accumulate,
                  int64_t num_threads);
const char *gguf_gemv_isa(void);

static uint64_t rng_state;
static uint64_t next_u64(void) {              /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static uint32_t below(uint32_t n) { return (uint32_t)(next_u64() >> 32) % n; }
static float uniform(void) { return (float)(next_u64() >> 40) * (2.f / 16777216.f) - 1.f; }   /* [-1, 1), exact */

/* fp16 bits: a small positive scale (2^-12 .. 2^-3), sometimes subnormal or zero. */
static uint16_t random_scale(void) {
    const uint32_t u = below(64);
    if (u == 0) return 0;
    if (u == 1) return (uint16_t)(1 + below(0x3ff));                    /* subnormal */
    return (uint16_t)(((3 + below(10)) << 10) | below(0x400));
}

/* The value of fp16 bits, computed independently of gguf_gemv.h. */
static double half_value(uint16_t h) {
    const int e = (h >> 10) & 31, man = h & 0x3ff;
    const double v = e == 0 ? ldexp(man, -24) : ldexp(1024 + man, e - 25);
    return h & 0x8000 ? -v : v;
}

static void put_f32(uint8_t *p, float f) { memcpy(p, &f, 4); }

/* A float32 block scale of kind 19: an fp16 value times an integer below 2^6 (signed: -32..31),
 * exact in float32. */
static float sub_scale(int is_signed) {
    return (float)half_value(random_scale()) * (float)(is_signed ? (int)below(64) - 32 : (int)below(64));
}

/* Packed weights of gguf_gemv.h for N rows, K columns (K-quant kinds: K a multiple of 256). Q4
 * variant: 0 = m = -8 d, 1 = random m; kind 18 variant: 0 = random m (Q5_K-like), 1 = no m and
 * signed sub-scales per half (Q6_K-like). */
static uint8_t *make_weights(int kind, int q4_variant, int64_t N, int64_t K) {
    const int64_t nb = K / 32, groups = (N + 15) / 16, pb = gguf_packed_block_bytes(kind);
    const int64_t gbytes = gguf_group_bytes(kind, nb);
    uint8_t *w = calloc((size_t)(groups * gbytes), 1);
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *p = (uint8_t *)gguf_group_blocks(w, kind, nb, g) + b * pb;
            for (int i = 0; i < 16; i++) {
                if (g * 16 + i >= N) continue;                          /* rows past N stay zero */
                const int extreme = below(16) == 0;                     /* all q at the range's end */
                if (kind == GGUF_K3 || kind == GGUF_X4) {               /* the super-block's d, signed scales */
                    if (b % 8 == 0) {
                        uint8_t *sup = (uint8_t *)gguf_super_scales(p, kind, nb, b);
                        const uint16_t d = random_scale();
                        memcpy(sup + 2 * i, &d, 2);
                    }
                    p[i] = (uint8_t)(int8_t)((int)below(64) - 32);
                    if (kind == GGUF_K3) p[16 + i] = (uint8_t)(int8_t)((int)below(64) - 32);
                    const int at = kind == GGUF_K3 ? 32 : 16, chunks = kind == GGUF_K3 ? 3 : 4;
                    for (int c = 0; c < chunks; c++)                    /* extreme: q = 3 (K3), index 15 */
                        for (int t = 0; t < 4; t++) p[at + 64 * c + 4 * i + t] = extreme ? 0xff : (uint8_t)below(256);
                    continue;
                }
                if (kind == GGUF_K4 || kind == GGUF_K8) {
                    if (b % 8 == 0) {                                   /* the super-block's d, dmin */
                        uint8_t *sup = (uint8_t *)gguf_super_scales(p, kind, nb, b);
                        const uint16_t d = random_scale(), dmin = kind == GGUF_K8 && q4_variant ? 0 : random_scale();
                        memcpy(sup + 2 * i, &d, 2);
                        memcpy(sup + 32 + 2 * i, &dmin, 2);
                    }
                    if (kind == GGUF_K4) {
                        p[i] = (uint8_t)below(64);
                        p[16 + i] = (uint8_t)below(64);
                        for (int c = 0; c < 4; c++)
                            for (int t = 0; t < 4; t++) p[32 + 64 * c + 4 * i + t] = extreme ? 0xff : (uint8_t)below(256);
                    } else {
                        const int s0 = q4_variant ? (int)below(64) - 32 : (int)below(64);
                        const int s1 = q4_variant ? (int)below(64) - 32 : s0;
                        p[i] = (uint8_t)(int8_t)s0;
                        p[16 + i] = (uint8_t)(int8_t)s1;
                        p[32 + i] = q4_variant ? 0 : (uint8_t)below(64);
                        for (int c = 0; c < 8; c++)
                            for (int t = 0; t < 4; t++) p[48 + 64 * c + 4 * i + t] = extreme ? 0 : (uint8_t)below(256);
                    }
                    continue;
                }
                if (kind == GGUF_F8) {
                    const float d0 = sub_scale(0);
                    put_f32(p + 4 * i, d0);
                    put_f32(p + 64 + 4 * i, d0);
                    put_f32(p + 128 + 4 * i, -sub_scale(0));
                    for (int c = 0; c < 8; c++)
                        for (int t = 0; t < 4; t++) p[192 + 64 * c + 4 * i + t] = extreme ? 0 : (uint8_t)below(256);
                    continue;
                }
                uint16_t d = random_scale(), m = 0;
                if (kind == 4) {
                    if (q4_variant == 0) {                              /* -8 d, exact in fp16 */
                        const int e = (d >> 10) & 31;
                        if (e == 0 || e > 27) d = (uint16_t)(((3 + below(10)) << 10) | below(0x400));
                        m = (uint16_t)(0x8000 | (d + (3 << 10)));
                    } else {
                        m = random_scale() | (below(2) ? 0x8000 : 0);
                    }
                    memcpy(p + 32 + 2 * i, &m, 2);
                }
                memcpy(p + 2 * i, &d, 2);
                if (kind == 4)
                    for (int c = 0; c < 4; c++)
                        for (int t = 0; t < 4; t++) p[64 + 64 * c + 4 * i + t] = extreme ? 0xff : (uint8_t)below(256);
                else
                    for (int c = 0; c < 8; c++)
                        for (int t = 0; t < 4; t++) p[32 + 64 * c + 4 * i + t] = extreme ? 0 : (uint8_t)below(256);
            }
        }
    return w;
}

/* Weight (n, k) of the packed layout, dequantized in double: d q + m (4-bit kinds: q in 0..15;
 * 8-bit kinds: q = u - 128; kind 18: d of the weight's half). *pieces = |d q| + |m|: the integer
 * GEMV's activation rounding scales with the pieces, not with their sum. */
static double weight(const uint8_t *w, int kind, int64_t K, int64_t n, int64_t k, double *pieces) {
    const int64_t nb = K / 32, pb = gguf_packed_block_bytes(kind), b = k / 32, j = k % 32, i = n % 16;
    const uint8_t *p = gguf_group_blocks(w, kind, nb, n / 16) + b * pb;
    double d, m = 0;
    int q;
    if (kind == GGUF_K3 || kind == GGUF_X4) {                 /* D sub-scale (K3: per half), no m */
        static const int values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
        const uint8_t *sup = gguf_super_scales(p, kind, nb, b);
        const int c = (int)(j % 16) / 4, t = (int)(j % 4);
        d = half_value(gguf_load_u16(sup + 2 * i)) * (int8_t)p[kind == GGUF_K3 && j >= 16 ? 16 + i : i];
        if (kind == GGUF_K3) {                                /* 2 low bits of half j / 16, bit j / 4 */
            const int low = (p[32 + 64 * (j / 16) + 4 * i + t] >> (2 * c)) & 3;
            q = (low | (((p[32 + 128 + 4 * i + t] >> (j / 4)) & 1) << 2)) - 4;
        } else {
            const uint8_t byte = p[16 + 64 * c + 4 * i + t];
            q = values[j < 16 ? byte & 15 : byte >> 4];
        }
        *pieces = fabs(d * q);
        return d * q;
    }
    if (kind == GGUF_K4 || kind == GGUF_K8) {                 /* D sub-scale, -(DMIN mn) */
        const uint8_t *sup = gguf_super_scales(p, kind, nb, b);
        const double D = half_value(gguf_load_u16(sup + 2 * i)), DMIN = half_value(gguf_load_u16(sup + 32 + 2 * i));
        d = kind == GGUF_K4 ? D * p[i] : D * (int8_t)p[j >= 16 ? 16 + i : i];
        m = -(DMIN * p[(kind == GGUF_K4 ? 16 : 32) + i]);
    } else if (kind == GGUF_F8) {
        float df, mf;
        memcpy(&df, p + (j >= 16 ? 64 : 0) + 4 * i, 4);
        memcpy(&mf, p + 128 + 4 * i, 4);
        d = df;
        m = mf;
    } else {
        d = half_value(gguf_load_u16(p + 2 * i));
        if (kind == GGUF_Q4) m = half_value(gguf_load_u16(p + 32 + 2 * i));
    }
    if (kind == GGUF_Q4 || kind == GGUF_K4) {
        const int c = (int)(j % 16) / 4, t = (int)(j % 4);
        const uint8_t byte = p[gguf_ints_offset(kind) + 64 * c + 4 * i + t];
        q = j < 16 ? byte & 15 : byte >> 4;
    } else {
        const int c = (int)j / 4, t = (int)(j % 4);
        q = (int)p[gguf_ints_offset(kind) + 64 * c + 4 * i + t] - 128;
    }
    *pieces = fabs(d * q) + fabs(m);
    return d * q + m;
}

static uint64_t fnv(uint64_t h, uint32_t v) {
    for (int s = 0; s < 32; s += 8) h = (h ^ ((v >> s) & 0xff)) * 0x100000001b3ull;
    return h;
}
static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

typedef struct { int64_t N, K, M; int pad_x, pad_y, bias, accumulate; } shape_t;

static const shape_t SHAPES[] = {
    {16, 32, 1, 0, 0, 0, 0},   {40, 160, 3, 0, 0, 0, 0},   {3, 64, 9, 0, 0, 0, 0},
    {33, 96, 8, 0, 0, 0, 0},   {100, 256, 20, 0, 0, 1, 0}, {17, 512, 5, 32, 8, 0, 1},
    {64, 1024, 13, 0, 0, 1, 1}, {31, 128, 2, 0, 0, 0, 0},  {16, 64, 4, 0, 0, 0, 0},
    {50, 2048, 6, 0, 0, 0, 0}, {20, 96, 7, 0, 3, 0, 0},    {48, 4096, 1, 0, 0, 0, 0},
};

int main(int argc, char **argv) {
    const int all = argc > 1 && strcmp(argv[1], "--all") == 0;
    int failed = 0, ncase = 0;
    double worst = 0;
    fprintf(stderr, "gemv_check: kernel %s\n", gguf_gemv_isa());
    rng_state = 20240601;
    for (size_t s = 0; s < sizeof SHAPES / sizeof SHAPES[0]; s++)
        for (int variant = 0; variant < 9; variant++) {   /* Q4 (m = -8 d), Q4 (m), Q8, K4, K8 (m), K8 (-0), F8, K3, X4 */
            const shape_t sh = SHAPES[s];
            static const int kinds[9] = {GGUF_Q4, GGUF_Q4, GGUF_Q8, GGUF_K4, GGUF_K8, GGUF_K8, GGUF_F8, GGUF_K3, GGUF_X4};
            const int kind = kinds[variant];
            if (gguf_has_super(kind) && sh.K % 256) continue;          /* K-quants: whole super-blocks */
            if (variant >= 7 && sh.K > 1024) continue;                 /* K3, X4: the shorter shapes (qemu's time) */
            const int64_t N = sh.N, K = sh.K, M = sh.M, ldx = K + sh.pad_x, ldy = N + sh.pad_y;
            uint8_t *w = make_weights(kind, kind == GGUF_K8 ? variant == 5 : variant, N, K);
            float *x = malloc(sizeof(float) * (size_t)(M * ldx)), *y = malloc(sizeof(float) * (size_t)(M * ldy));
            float *y0 = malloc(sizeof(float) * (size_t)(M * ldy)), *bias = malloc(sizeof(float) * (size_t)N);
            for (int64_t r = 0; r < M; r++) {
                const float scale = r == 2 ? 1e-35f : 0.25f + (float)below(16);   /* row 2: subnormal dx */
                for (int64_t k = 0; k < ldx; k++) x[r * ldx + k] = uniform() * scale;
            }
            x[5] = 40.f * (1 + (float)below(4));                       /* an outlier */
            if (M > 1 && K >= 64)
                for (int k = 32; k < 64; k++) x[ldx + k] = 0.f;         /* an all-zero block */
            for (int64_t i = 0; i < M * ldy; i++) y0[i] = uniform() * 4;
            for (int64_t n = 0; n < N; n++) bias[n] = uniform();
          for (int mode = 0; mode < 4; mode++) {   /* two-part GEMV, one-part (gguf-a8), float32 GEMM, mixed parts */
            const int f32 = mode == 2, one = mode == 1 || mode == 3;
            const int parts = mode == 1 ? GGUF_ONE_PART : mode == 3 ? GGUF_MIXED_PARTS : GGUF_TWO_PARTS;
            memcpy(y, y0, sizeof(float) * (size_t)(M * ldy));
            const int rc = f32 ? gguf_gemm_f32(w, kind, N, K, x, ldx, M, y, ldy, sh.bias ? bias : NULL, sh.accumulate, 1)
                               : gguf_gemv(w, kind, N, K, x, ldx, M, y, ldy, sh.bias ? bias : NULL, sh.accumulate, 1, parts);
            if (rc != 0) { printf("case %d: %s returned %d\n", ncase, f32 ? "gguf_gemm_f32" : "gguf_gemv", rc); failed = 1; }

            uint64_t h = 0xcbf29ce484222325ull;
            int ok = 1;
            for (int64_t r = 0; r < M; r++)
                for (int64_t n = 0; n < ldy; n++) {
                    const float got = y[r * ldy + n];
                    h = fnv(h, bits(got));
                    if (n >= N) { ok &= bits(got) == bits(y0[r * ldy + n]); continue; }   /* untouched */
                    if (r == 2) continue;      /* subnormal d dx: few significant bits; compared bit for bit only */
                    double ref = 0, mag = 0, act = 0, bmax = 0;
                    for (int64_t k = 0; k < K; k++) {
                        if (k % 32 == 0) {             /* the block's max |x| */
                            bmax = 0;
                            for (int64_t j = k; j < k + 32; j++) {
                                const double v = fabs(x[r * ldx + j]);
                                if (v > bmax) bmax = v;
                            }
                        }
                        double pieces;
                        const double t = weight(w, kind, K, n, k, &pieces) * x[r * ldx + k];
                        ref += t;
                        mag += fabs(t);
                        act += pieces * bmax;
                    }
                    double extra = 0;
                    if (sh.bias) { ref += bias[n]; extra += fabs(bias[n]); }
                    if (sh.accumulate) { ref += y0[r * ldy + n]; extra += fabs(y0[r * ldy + n]); }
                    const double bound = (f32 ? ldexp(mag, -24) * (double)K
                                              : ldexp(mag, -12) + ldexp(act, one ? -7 : -14))
                                         + ldexp(extra, -20) + 1e-37;
                    const double ratio = fabs(got - ref) / bound;
                    if (!(ratio <= 1)) {
                        if (ok) printf("case %d: y[%lld][%lld] = %.9g, reference %.9g, bound %.3g\n", ncase,
                                       (long long)r, (long long)n, got, ref, bound);
                        ok = 0;
                    }
                    if (ratio > worst) worst = ratio;
                }
            failed |= !ok;
            printf("case %2d %s kind %2d%s N %3lld K %4lld M %2lld: %016llx", ncase, f32 ? "f32 " : mode == 3 ? "gemx" : one ? "gem1" : "gemv",
                   kind, kind == GGUF_Q4 || kind == GGUF_K8 ? (variant == 0 || variant == 5 ? "/0" : "/m") : "  ", (long long)N, (long long)K, (long long)M,
                   (unsigned long long)h);
            for (int64_t i = 0; i < (all ? M * ldy : 4); i++) printf(" %08x", bits(y[i]));
            printf("%s\n", ok ? "" : "  REFERENCE MISMATCH");
          }
            free(w); free(x); free(y); free(y0); free(bias);
            ncase++;
        }
    printf("reference check (|y - ref| <= 2^-12 sum|w x| + 2^-14 sum (|d q| + |m|) max|x|, float32 GEMM K 2^-24 sum|w x|): %s, worst error / bound %.3f\n",
           failed ? "FAILED" : "passed", worst);
    return failed;
}
