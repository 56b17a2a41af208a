/* The contract between the GGUF block GEMV driver (gguf_gemv.c) and its per-ISA kernels
 * (gguf_gemv_avx512vnni.c, gguf_gemv_avx2.c, gguf_gemv_neon.c, gguf_gemv_portable.c).
 *
 * Weights: the file's Q4_0 / Q4_1 / Q8_0 blocks (32 weights: an fp16 scale d, for Q4_1 an fp16
 * offset m, and 4- or 8-bit integers q; w = d q + m, with m = -8 d for Q4_0 and m = 0 for Q8_0)
 * interleaved at load time 16 output rows at a time (kvserve/ops/gguf_blocks.py). Values are not
 * changed. Per group of 16 rows and block of 32 weights (rows past N are zero):
 *   Q4 (kind 4):  d[16] fp16, m[16] fp16, then 4 chunks of 64 bytes: chunk c holds, for row i, the
 *                 bytes (q[4c + t] | q[4c + 16 + t] << 4), t = 0..3, at offset 4 i + t.   320 bytes
 *   Q8 (kind 8):  d[16] fp16, then 8 chunks of 64 bytes: chunk c holds q[4c + t] + 128 (as u8)
 *                 of row i at offset 4 i + t.                                              544 bytes
 *
 * Activations: each row, per block of 32, becomes two signed 8-bit parts (gguf_gemv.c,
 * quantize_rows): v = x 127 / max|x|, xa = rint(v), xb = rint((v - xa) 256) clamped to +-127, so
 * x ~= dx (256 xa + xb) with dx = max|x| / (127 256): about 15 bits, where llama.cpp's single
 * 8-bit part costs SmolLM2 2% of perplexity.
 *
 * What every kernel computes, exactly (the same bits on every ISA; tests compare them):
 *   for each of the 16 rows i and each activation row r < R:
 *     acc = 0
 *     for each block b, in order:
 *       s   = sum_j q_ij (256 xa_rj + xb_rj)            integers, exact in int32; q signed for Q8
 *             (Q4: q in 0..15, the m term below carries the offset)
 *       acc = acc + (float)s * (d_i * dx_rb)             float32, rounded after each operation
 *       Q4 only: acc = acc + m_i * sx_rb                 sx: the float sum of the block's x
 *     out[r * 16 + i] = acc
 * No fused multiply-add: a separate multiply and add round the same way in SIMD lanes and in
 * scalar code, so builds are bit-identical (they are compiled with -ffp-contract=off).
 *
 * The float32 GEMM (prompt tokens, gguf_gemm_f32_team in gguf_gemv.c): compute-bound work, where
 * the two-part integer dot products above run at about half the rate of float32 fused
 * multiply-adds on the same cores. Two groups' weights (32 rows) are dequantized slice by slice
 * into wt[k][32] (float32, w = d q + m: the product is exact, so one rounding, as gguf's own
 * dequantization), activation rows are packed in tiles xp[k][T] (T = gguf_f32_tile_rows(),
 * rows past the end zero), and
 *   for each of the 32 rows i and tile row r:
 *     acc = 0;  for k = 0 .. K-1 in order:  acc = fma(wt[k][i], xp[k][r], acc)
 *     out[r][i] = acc
 * with an explicit fused multiply-add (one rounding) in every build: the same bits on every ISA.
 */
#ifndef KVSERVE_GGUF_GEMV_H
#define KVSERVE_GGUF_GEMV_H

#include <stdint.h>
#include <string.h>

#include "half.h"

#define GGUF_ROWS 16         /* output rows per interleaved group */
#define GGUF_TILE_M 8        /* activation rows per pass over a group's weights */
#define GGUF_F32_N 32        /* weight rows per float32 tile: two groups */
#define GGUF_F32_KC 128      /* k per slice of the float32 GEMM (16 KB of two groups' weights) */
#define GGUF_F32_MC 192      /* activation rows per chunk of the float32 GEMM */

static inline int64_t gguf_packed_block_bytes(int64_t kind) { return kind == 4 ? 320 : 544; }

/* Every kernel prefetches the block GGUF_PREFETCH blocks ahead of the one it multiplies (all its
 * cache lines; a prefetch past the end of the weights never faults). Batch-1 decode streams each
 * matrix once from memory, and the hardware prefetcher alone ramps up too slowly on these short
 * streams (docs/benchmarks-notes.md: 12-20% faster decode with it). */
#define GGUF_PREFETCH 16
static inline __attribute__((always_inline)) void gguf_prefetch_block(const uint8_t *wg, int64_t pb) {
    const uint8_t *p = wg + GGUF_PREFETCH * pb;
    for (int64_t o = 0; o < pb; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* Activations of one pass: R rows of nb blocks each. xq holds, per (row, block), 64 s8 values:
 * the 32 xa, then the 32 xb. dx: scale; sx: sum of the block's float x (Q4's m term); sq:
 * 256 sum xa + sum xb (for kernels that store Q8 weights offset by 128). */
typedef struct {
    const int8_t *xq;
    const float *dx, *sx;
    const int32_t *sq;
} gguf_acts_t;

/* The activations of rows r0.. of `a` (nb blocks a row): kernels that take fewer than
 * GGUF_TILE_M rows per pass over a group's weights run the rest from here. */
static inline gguf_acts_t gguf_acts_from_row(const gguf_acts_t *a, int64_t r0, int64_t nb) {
    const gguf_acts_t ar = {a->xq + r0 * nb * 64, a->dx + r0 * nb, a->sx + r0 * nb, a->sq + r0 * nb};
    return ar;
}

/* The per-ISA kernel: one group of 16 rows (wg: its nb packed blocks) against R <= GGUF_TILE_M
 * activation rows; out[r * 16 + i]. kind: 4 or 8. */
void gguf_group_dot(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out);

/* The per-ISA float32 tile: acc[r * 32 + i] for r < gguf_f32_tile_rows(), continued over kc
 * more k (wt: kc rows of two groups' dequantized weights [k][32], xp: the tile's kc rows [k][T]),
 * from 0 (cont = 0) or from the values in acc (cont = 1). */
void gguf_tile_f32(const float *wt, const float *xp, int64_t kc, int cont, float *acc);
int gguf_f32_tile_rows(void);

/* The name of the instruction set the kernel was written for ("avx512vnni", "avx2", "neon",
 * "portable"). */
const char *gguf_kernel_isa(void);

static inline uint16_t gguf_load_u16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h; }

#endif
