/* y = x W^T for GGUF Q4_0 / Q4_1 / Q8_0 weights, for the few activation rows of a decode step.
 *
 * The file's blocks (32 weights: an fp16 scale d, for Q4_1 an fp16 offset m, and 4- or 8-bit
 * integers q; w = d * q + m, with m = -8 d for Q4_0 and m = 0 for Q8_0) are interleaved once at
 * load time (kvserve.model.quant.pack_gguf_rows), 16 output rows at a time, so one 512-bit VNNI instruction (vpdpbusd) multiplies 4
 * weights of 16 rows at once and no horizontal sums are needed. Values are not changed: the
 * same 4-bit / 8-bit integers and fp16 scales, about the file's size.
 *
 * Packed layout, per group of 16 rows g and block b (rows past N are zero):
 *   Q4 (kind 4):  d[16] fp16, m[16] fp16, then 4 x 64 bytes: chunk c holds, for row i, the bytes
 *                 (q[4c + t] | q[4c + 16 + t] << 4), t = 0..3, at offset 4 i + t.      320 bytes
 *   Q8 (kind 8):  d[16] fp16, then 8 x 64 bytes: chunk c holds q[4c + t] + 128 (as u8) of row i
 *                 at offset 4 i + t.                                                   544 bytes
 *
 * Activations become two 8-bit parts per block of 32 (x ~= dx (xa + xb / 256), dx = max|x| / 127,
 * xb the rounded remainder): about 15 bits, where llama.cpp's single 8-bit part (Q8 activations)
 * cost SmolLM2 2% of perplexity. A block's dot product is integer arithmetic on bytes:
 *   s = 256 sum_j q_j xa_j + sum_j q_j xb_j       (exact in int32 and in float)
 *   sum_j w_j x_j ~= d dx / 256 s + m sum_j x_j   (Q4; the m term uses the exact float x)
 *   (Q8 weights are stored as q + 128, u8 x s8 operands; 128 sum_j xa_j etc. is taken off.)
 *
 * gguf_gemv_isa() says which code was compiled: 2 for AVX-512 VNNI, 0 for the portable loops
 * (same results; the caller prefers its other kernels there, as the loops are slow; the tests
 * build them with -DKVSERVE_PORTABLE).
 * Threads: OpenMP over row groups; y may be accumulated into (y += x W^T, a fused residual add).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define ROWS 16              /* rows per interleaved group */
#define MAX_M 4              /* activation rows per pass over the weights */

static int64_t packed_block_bytes(int64_t kind) { return kind == 4 ? 320 : 544; }

/* x rows -> per block of 32: xq (64 s8: the 32 xa, then the 32 xb), dx, sx (sum of x, for Q4's m
 * term), sq (256 sum xa + sum xb, for Q8's offset). */
static void quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t nb, int8_t *xq,
                          float *dx, float *sx, int32_t *sq) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + r * ldx + b * 32;
            float amax = 0.f, sum = 0.f;
            for (int j = 0; j < 32; j++) {
                const float a = p[j] < 0 ? -p[j] : p[j];
                amax = a > amax ? a : amax;
                sum += p[j];
            }
            const float inv = amax > 0 ? 127.f / amax : 0.f;
            int8_t *qa = xq + (r * nb + b) * 64, *qb = qa + 32;
            int32_t sa = 0, sb = 0;
            for (int j = 0; j < 32; j++) {
                const float v = p[j] * inv;                       /* in [-127, 127] */
                const float a = __builtin_rintf(v);
                float rb = __builtin_rintf((v - a) * 256.f);      /* in [-128, 128] */
                rb = rb > 127.f ? 127.f : rb < -127.f ? -127.f : rb;
                qa[j] = (int8_t)a;
                qb[j] = (int8_t)rb;
                sa += qa[j];
                sb += qb[j];
            }
            dx[r * nb + b] = amax / (127.f * 256.f);
            sx[r * nb + b] = sum;
            sq[r * nb + b] = 256 * sa + sb;
        }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(KVSERVE_PORTABLE)
#define ISA 2

/* 256 sum_j q_j xa_j + sum_j q_j xb_j for 16 rows at once: q[c] holds weights 4c..4c+3 of each
 * row (u8), x the block's 32 xa then 32 xb (s8). */
static inline __m512i dot_two_parts(const __m512i q[8], const int8_t *x) {
    const int32_t *xa = (const int32_t *)x, *xb = xa + 8;
    __m512i sa = _mm512_setzero_si512(), sb = _mm512_setzero_si512();
    for (int c = 0; c < 8; c++) {
        sa = _mm512_dpbusd_epi32(sa, q[c], _mm512_set1_epi32(xa[c]));
        sb = _mm512_dpbusd_epi32(sb, q[c], _mm512_set1_epi32(xb[c]));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(sa, 8), sb);
}

/* One group of 16 rows against R activation rows: out[r * 16 + i]. */
static inline __attribute__((always_inline)) void
group_dot(const uint8_t *wg, int64_t kind, int64_t nb, const int8_t *xq, const float *dx,
          const float *sx, const int32_t *sq, const int R, float *out) {
    __m512 acc[MAX_M];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t pb = packed_block_bytes(kind);
    if (kind == 4) {
        const __m512i low4 = _mm512_set1_epi8(0x0f);
        for (int64_t b = 0; b < nb; b++, wg += pb) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)wg));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wg + 32)));
            __m512i q[8];
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(wg + 64 + 64 * c);
                q[c] = _mm512_and_si512(v, low4);                          /* q[4c .. 4c+3] */
                q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4); /* q[4c+16 .. 4c+19] */
            }
            for (int r = 0; r < R; r++) {
                const __m512i s = dot_two_parts(q, xq + (r * nb + b) * 64);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), acc[r]);
            }
        }
    } else {
        for (int64_t b = 0; b < nb; b++, wg += pb) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)wg));
            __m512i q[8];
            for (int c = 0; c < 8; c++) q[c] = _mm512_loadu_si512(wg + 32 + 64 * c);
            for (int r = 0; r < R; r++) {
                const __m512i s = _mm512_sub_epi32(dot_two_parts(q, xq + (r * nb + b) * 64),
                                                   _mm512_set1_epi32(128 * sq[r * nb + b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * ROWS, acc[r]);
}
#else
#define ISA 0

static float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {                       /* zero or subnormal: man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static uint16_t load_u16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h; }

static inline void group_dot(const uint8_t *wg, int64_t kind, int64_t nb, const int8_t *xq,
                             const float *dx, const float *sx, const int32_t *sq, const int R,
                             float *out) {
    const int64_t pb = packed_block_bytes(kind);
    for (int r = 0; r < R; r++) for (int i = 0; i < ROWS; i++) out[r * ROWS + i] = 0.f;
    for (int64_t b = 0; b < nb; b++, wg += pb) {
        for (int i = 0; i < ROWS; i++) {
            const float d = half_to_float(load_u16(wg + 2 * i));
            for (int r = 0; r < R; r++) {
                const int8_t *xa = xq + (r * nb + b) * 64, *xb = xa + 32;
                int32_t s = 0;
                if (kind == 4) {
                    for (int c = 0; c < 4; c++)
                        for (int t = 0; t < 4; t++) {
                            const int32_t v = wg[64 + 64 * c + 4 * i + t], j = 4 * c + t;
                            s += (v & 15) * (256 * xa[j] + xb[j]) + (v >> 4) * (256 * xa[j + 16] + xb[j + 16]);
                        }
                    const float m = half_to_float(load_u16(wg + 32 + 2 * i));
                    out[r * ROWS + i] += d * dx[r * nb + b] * (float)s + m * sx[r * nb + b];
                } else {
                    for (int c = 0; c < 8; c++)
                        for (int t = 0; t < 4; t++) {
                            const int32_t j = 4 * c + t;
                            s += wg[32 + 64 * c + 4 * i + t] * (256 * xa[j] + xb[j]);
                        }
                    s -= 128 * sq[r * nb + b];
                    out[r * ROWS + i] += d * dx[r * nb + b] * (float)s;
                }
            }
        }
    }
}
#endif

int64_t gguf_gemv_isa(void) { return ISA; }

/* y[r][n] (+)= sum_k x[r][k] W[n][k] (+ bias[n]) for r < M, n < N, with W packed by gguf_pack
 * (kind 4 or 8). x: M rows, leading dimension ldx; y: leading dimension ldy. Returns 0, or -1
 * for a bad kind / K, -3 when out of memory. */
int gguf_gemv(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
              int64_t M, float *y, int64_t ldy, const float *bias, int64_t accumulate,
              int64_t num_threads) {
    if ((kind != 4 && kind != 8) || K % 32 || K <= 0) return -1;
    const int64_t nb = K / 32, groups = (N + ROWS - 1) / ROWS, gbytes = nb * packed_block_bytes(kind);
    int8_t *xq = aligned_alloc(64, (size_t)(M * K * 2));
    float *dx = malloc(sizeof(float) * M * nb), *sx = malloc(sizeof(float) * M * nb);
    int32_t *sq = malloc(sizeof(int32_t) * M * nb);
    if (!xq || !dx || !sx || !sq) { free(xq); free(dx); free(sx); free(sq); return -3; }
    quantize_rows(x, ldx, M, nb, xq, dx, sx, sq);
    /* Each thread takes whole row groups and runs every activation row against a group while
     * its weights (K / 32 blocks, a few KB) are in L1: the weights stream from memory once. */
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = w + g * gbytes;
        const int64_t rows = N - g * ROWS < ROWS ? N - g * ROWS : ROWS;
        for (int64_t r0 = 0; r0 < M; r0 += MAX_M) {
            const int R = (int)(M - r0 < MAX_M ? M - r0 : MAX_M);
            const int8_t *xr = xq + r0 * K * 2;
            const float *dr = dx + r0 * nb, *sr = sx + r0 * nb;
            const int32_t *qr = sq + r0 * nb;
            float out[MAX_M * ROWS];
            switch (R) {
                case 1: group_dot(wg, kind, nb, xr, dr, sr, qr, 1, out); break;
                case 2: group_dot(wg, kind, nb, xr, dr, sr, qr, 2, out); break;
                case 3: group_dot(wg, kind, nb, xr, dr, sr, qr, 3, out); break;
                default: group_dot(wg, kind, nb, xr, dr, sr, qr, 4, out); break;
            }
            for (int r = 0; r < R; r++) {
                float *yr = y + (r0 + r) * ldy + g * ROWS;
                for (int64_t i = 0; i < rows; i++)
                    yr[i] = (accumulate ? yr[i] : 0.f) + out[r * ROWS + i] + (bias ? bias[g * ROWS + i] : 0.f);
            }
        }
    }
    free(xq); free(dx); free(sx); free(sq);
    return 0;
}
