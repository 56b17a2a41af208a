/* The passes over a group for a kernel file whose passes take at most 2 activation rows: the
 * file defines, before including this once,
 *   static inline __attribute__((always_inline)) void
 *   rows_dot(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, const int R, const int P,
 *            float *out);
 * (R <= 2; P: activation parts, 2, or 1 when every block has one: a->parts == GGUF_ONE_PART) and
 * group_dot_in_pairs runs it over the rows in pairs, with R, P and the kind as constants in every
 * call: one specialized loop each, the sums in registers. Rows past the first pair re-read the
 * group's weights from L1 (they are a few KB). Used by the AVX2 and AVX-VNNI kernels (16 vector
 * registers), whose gguf_group_dot calls it. */
#ifndef KVSERVE_GROUP_DOT_PAIRS_H
#define KVSERVE_GROUP_DOT_PAIRS_H

#define PAIRS_R(K, P) (R == 2 ? rows_dot(wg, K, nb, a, 2, P, out) : rows_dot(wg, K, nb, a, 1, P, out))
#define PAIRS_KIND(K) (a->parts == GGUF_ONE_PART ? PAIRS_R(K, 1) : PAIRS_R(K, 2))

static void group_dot_upto2(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out) {
    switch (kind) {
        case GGUF_Q4: PAIRS_KIND(GGUF_Q4); break;
        case GGUF_K4: PAIRS_KIND(GGUF_K4); break;
        case GGUF_K5: PAIRS_KIND(GGUF_K5); break;
        case GGUF_Q8: PAIRS_KIND(GGUF_Q8); break;
        case GGUF_K8: PAIRS_KIND(GGUF_K8); break;
        case GGUF_K6: PAIRS_KIND(GGUF_K6); break;
        case GGUF_K3: PAIRS_KIND(GGUF_K3); break;
        case GGUF_X4: PAIRS_KIND(GGUF_X4); break;
        default: PAIRS_KIND(GGUF_F8); break;
    }
}

#undef PAIRS_KIND
#undef PAIRS_R

static void group_dot_in_pairs(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R,
                               float *out) {
    for (int r0 = 0; r0 < R; r0 += 2) {
        const gguf_acts_t ar = gguf_acts_from_row(a, r0, nb);
        group_dot_upto2(wg, kind, nb, &ar, R - r0 < 2 ? R - r0 : 2, out + r0 * GGUF_ROWS);
    }
}

#endif
