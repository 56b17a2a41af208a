/* Tiles of more than 2 activation rows for the kernels whose passes take 2 (R_MAX: the AVX2 and
 * AVX-VNNI kernels, 16 vector registers). A tile of up to GGUF_TILE_M rows is then several passes
 * over the group, and unpacking a block's chunks and scales, a large share of a pass's vector
 * operations, would be repeated in each. ready_group unpacks READY_BLOCKS blocks at a time into
 * a buffer in L1 and runs every pass over it, loading what it would have unpacked. Each row's
 * sums are the same integers and its float steps run in the same order (block by block, one
 * accumulator a row and half), so the results are the unpacking passes' bit for bit.
 * The including file includes this once, after group_dot_pairs.h, and defines the three functions
 * declared below; it gets gguf_group_dot: ready_group for the kinds ready_takes at R > 2, the
 * pairs of rows of group_dot_pairs.h otherwise. */
#ifndef KVSERVE_READY_GROUP_AVX_H
#define KVSERVE_READY_GROUP_AVX_H

#define READY_BLOCKS 16

/* One block unpacked for its passes: its chunks as the passes' registers hold them, its float
 * scales (the including file's layout). */
typedef struct {
    __m256i w[16];
    __m256 s[6];
} ready_t;

/* Block b (wg: its bytes) unpacked into rb. */
static inline void ready_unpack(const uint8_t *wg, const int kind, int64_t nb, int64_t b, ready_t *rb);
/* Block b from its ready_t (rp) against R <= 2 activation rows, added to acc: the BODY of
 * GGUF_BLOCK_RUNS_IN over ready_t bytes. */
static inline void ready_block(const uint8_t *rp, const int kind, int64_t nb, int64_t b, const gguf_acts_t *a,
                               const int R, const int P, __m256 acc[R_MAX][2]);
/* Whether a kind goes through ready_group (a constant for a constant kind). */
static inline int ready_takes(const int kind);

/* Blocks b0 .. b1 - 1 (ready: their ready_t) against R <= 2 rows, added to the pass's sums acc. */
static inline __attribute__((always_inline)) void
ready_pass(const ready_t *ready, const int kind, int64_t nb, int64_t b0, int64_t b1, const gguf_acts_t *a,
           const int R, const int P, __m256 sums[R_MAX][2]) {
    __m256 acc[R_MAX][2];
    for (int r = 0; r < R; r++) acc[r][0] = sums[r][0], acc[r][1] = sums[r][1];
    GGUF_BLOCK_RUNS_IN(ready_block, one_part_block, (const uint8_t *)ready, (int64_t)sizeof(ready_t), 0, b0, b1, kind,
                       nb, a, R, P, acc);
    for (int r = 0; r < R; r++) sums[r][0] = acc[r][0], sums[r][1] = acc[r][1];
}

#define READY_PASS(RR, PP) ready_pass(ready, kind, nb, b0, b1, &ar, RR, PP, acc + r0)

/* A byte-product group against R > 2 activation rows (out: as gguf_group_dot's): READY_BLOCKS
 * blocks unpacked, then every pair of rows over them, and so on to the group's end. */
static inline __attribute__((always_inline)) void
ready_group(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, int R, float *out) {
    ready_t ready[READY_BLOCKS];
    __m256 acc[GGUF_TILE_M][2];
    const int64_t pb = gguf_packed_block_bytes(kind);
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += READY_BLOCKS) {
        const int64_t b1 = nb - b0 < READY_BLOCKS ? nb : b0 + READY_BLOCKS;
        for (int64_t b = b0; b < b1; b++) {
            gguf_prefetch_block(wg + b * pb, pb);
            ready_unpack(wg + b * pb, kind, nb, b, &ready[b - b0]);
        }
        for (int r0 = 0; r0 < R; r0 += 2) {
            const gguf_acts_t ar = gguf_acts_from_row(a, r0, nb);
            if (a->parts == GGUF_ONE_PART) R - r0 >= 2 ? READY_PASS(2, 1) : READY_PASS(1, 1);
            else R - r0 >= 2 ? READY_PASS(2, 2) : READY_PASS(1, 2);
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * GGUF_ROWS + 8 * h, acc[r][h]);
}

#undef READY_PASS

#define READY_CASE(K)                                                                              \
    case K:                                                                                        \
        if (ready_takes(K)) {                                                                      \
            ready_group(wg, K, nb, a, R, out);                                                     \
            return;                                                                                \
        }                                                                                          \
        break;

void gguf_group_dot(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out) {
    if (R > R_MAX) switch (kind) {
        READY_CASE(GGUF_Q4) READY_CASE(GGUF_K4) READY_CASE(GGUF_K5) READY_CASE(GGUF_K6) READY_CASE(GGUF_K3)
        READY_CASE(GGUF_X4)
        default: break;
    }
    group_dot_in_pairs(wg, kind, nb, a, R, out);
}

#undef READY_CASE

#endif
