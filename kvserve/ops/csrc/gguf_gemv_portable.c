/* The portable C reference of gguf_group_dot (gguf_gemv.h): plain loops, any CPU. Every SIMD
 * kernel must give exactly these bits. */
#include <math.h>

#include "gguf_gemv.h"

const char *gguf_kernel_isa(void) { return "portable"; }

void gguf_group_dot(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out) {
    const int64_t pb = gguf_packed_block_bytes(kind), qo = gguf_ints_offset(kind);
    const int nibbles = gguf_nibble_kind(kind);
    for (int r = 0; r < R; r++)
        for (int i = 0; i < GGUF_ROWS; i++) out[r * GGUF_ROWS + i] = 0.f;
    for (int64_t b = 0; b < nb; b++, wg += pb) {
        for (int i = 0; i < GGUF_ROWS; i++) {
            float d0, d1, m;
            gguf_row_scales(wg, kind, nb, b, i, &d0, &d1, &m);
            for (int r = 0; r < R; r++) {
                const int8_t *xa = a->xq + (r * nb + b) * 64, *xb = xa + 32;
                int32_t s[2] = {0, 0};                  /* weights 0..15, 16..31 */
                if (nibbles) {
                    for (int c = 0; c < 4; c++)
                        for (int t = 0; t < 4; t++) {
                            const int32_t v = wg[qo + 64 * c + 4 * i + t], j = 4 * c + t;
                            const int32_t lo = kind == GGUF_K5 ? gguf_k5_top(wg, c, i, t) : 0;
                            const int32_t hi = kind == GGUF_K5 ? gguf_k5_top(wg, c + 4, i, t) : 0;
                            s[0] += ((v & 15) | lo) * (256 * xa[j] + xb[j])
                                  + ((v >> 4) | hi) * (256 * xa[j + 16] + xb[j + 16]);
                        }
                } else {
                    for (int c = 0; c < 8; c++)
                        for (int t = 0; t < 4; t++) {
                            const int32_t j = 4 * c + t;
                            const int32_t q = kind == GGUF_K6   ? gguf_k6_byte(wg, c, i, t) - 32
                                            : kind == GGUF_K3   ? gguf_k3_byte(wg, c, i, t) - 4
                                            : kind == GGUF_X4   ? gguf_x4_byte(wg, c, i, t) - 128
                                                                : (int32_t)wg[qo + 64 * c + 4 * i + t] - 128;
                            s[c >> 2] += q * (256 * xa[j] + xb[j]);
                        }
                }
                const float dx = a->dx[r * nb + b];
                float acc = out[r * GGUF_ROWS + i];
                if (gguf_two_halves(kind)) {
                    acc = acc + (float)s[0] * (d0 * dx);
                    acc = acc + (float)s[1] * (d1 * dx);
                } else {
                    acc = acc + (float)(s[0] + s[1]) * (d0 * dx);
                }
                if (kind != GGUF_Q8 && !gguf_no_min_super(kind)) acc = acc + m * a->sx[r * nb + b];
                out[r * GGUF_ROWS + i] = acc;
            }
        }
    }
}

/* The float32 tile (gguf_gemv.h): fmaf rounds once, like the SIMD builds' fused multiply-add. */
#define F32_T 8

int gguf_f32_tile_rows(void) { return F32_T; }

void gguf_tile_f32(const float *wt, const float *xp, int64_t kc, int cont, float *acc) {
    for (int r = 0; r < F32_T; r++)
        for (int i = 0; i < GGUF_F32_N; i++) {
            float a = cont ? acc[r * GGUF_F32_N + i] : 0.f;
            for (int64_t k = 0; k < kc; k++) a = fmaf(wt[k * GGUF_F32_N + i], xp[k * F32_T + r], a);
            acc[r * GGUF_F32_N + i] = a;
        }
}
