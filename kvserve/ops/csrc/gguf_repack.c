/* GGUF blocks -> the packed layout of gguf_gemv.h, in C: the same bytes as
 * kvserve/ops/gguf_blocks.py pack_gguf_parts for Q4_0 and Q4_1 (kind 4), Q8_0, Q5_0 and IQ4_NL
 * (kind 8), Q5_1 (kind 19), Q4_K (kind 14), Q5_K (kind 15), Q6_K (kind 26), Q3_K (kind 13),
 * IQ4_XS (kind 24) and Q2_K (kind 10). Loading a model repacks every weight once; this does it in
 * one pass over the file's bytes, OpenMP over groups of 16 rows (the threads also take the first
 * touch of the packed buffer's pages).
 *
 * A weight is one or more parts (fused shards, their rows one after the other). Part p's rows
 * start at row start[p] of the packed rows: each part at a group boundary, or (when a part other
 * than the last does not end a group) all parts joined row after row. Rows of a group that no
 * part holds are padding: scales 0, q = 0 (kind 8: the byte 0x80, q + 128 of q = 0).
 *
 * Every value is the file's, moved: bytes are only shuffled and split into bit fields, except
 * Q4_0's m = -8 d, rounded to fp16 as numpy rounds it (float_to_half; exact unless it overflows
 * to infinity), and Q5_1's fp16 d and m widened to float32 (half_to_float, exact). A NaN Q4_0 d or
 * Q5_1 d / m is left to the numpy path (numpy keeps a NaN's payload its own way). */
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "gguf_gemv.h"

/* GGML type codes (kvserve/ops/gguf_types.py). */
enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12,
    T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23
};

#define NIB 0x0F0F0F0Fu

static inline uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline void st32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void st16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline int half_is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }

/* The kind a covered type packs into (0: not covered), and its bytes per block of the file. */
static int64_t repack_kind(int64_t t) {
    switch (t) {
    case T_Q4_0: case T_Q4_1: return GGUF_Q4;
    case T_Q8_0: case T_Q5_0: case T_IQ4_NL: return GGUF_Q8;
    case T_Q5_1: return GGUF_F8;
    case T_Q4_K: return GGUF_K4;
    case T_Q5_K: return GGUF_K5;
    case T_Q6_K: return GGUF_K6;
    case T_Q3_K: return GGUF_K3;
    case T_IQ4_XS: return GGUF_X4;
    case T_Q2_K: return GGUF_K2;
    default: return 0;
    }
}
static int64_t file_block_bytes(int64_t t) {
    switch (t) {
    case T_Q4_0: case T_IQ4_NL: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_IQ4_XS: return 136;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}
static int64_t file_block_weights(int64_t t) {
    return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K || t == T_Q3_K || t == T_IQ4_XS || t == T_Q2_K ? 256 : 32;
}

/* Q4_0 / Q4_1 row (nb blocks of 32) -> row i of a kind-4 group. Returns 1 on a NaN Q4_0 d. */
static int row_q4(const uint8_t *src, int64_t t, int64_t nb, uint8_t *g, int i) {
    const int64_t bs = t == T_Q4_0 ? 18 : 20;
    int nan = 0;
    for (int64_t b = 0; b < nb; b++, src += bs) {
        uint8_t *blk = g + b * 320;
        const uint16_t d = gguf_load_u16(src);
        uint16_t m;
        if (t == T_Q4_1) {
            m = gguf_load_u16(src + 2);
        } else {
            nan |= half_is_nan(d);
            m = float_to_half(half_to_float(d) * -8.0f);
        }
        st16(blk + 2 * i, d);
        st16(blk + 32 + 2 * i, m);
        const uint8_t *qs = src + bs - 16;
        for (int c = 0; c < 4; c++) memcpy(blk + 64 + 64 * c + 4 * i, qs + 4 * c, 4);
    }
    return nan;
}

/* Q8_0 row -> row i of a kind-8 group: q + 128 is the file's byte with its top bit flipped. */
static void row_q8(const uint8_t *src, int64_t nb, uint8_t *g, int i) {
    for (int64_t b = 0; b < nb; b++, src += 34) {
        uint8_t *blk = g + b * 544;
        memcpy(blk + 2 * i, src, 2);
        for (int c = 0; c < 8; c++) st32(blk + 32 + 64 * c + 4 * i, ld32(src + 2 + 4 * c) ^ 0x80808080u);
    }
}

/* The 32 weights of a Q5_0 / Q5_1 block as bytes: the low 4 bits from qs (weights w and w + 16
 * in byte w), bit 4 from qh, plus `add`. */
static inline void q5_bytes(uint32_t qh, const uint8_t *qs, uint8_t add, uint8_t v[32]) {
    for (int w = 0; w < 16; w++) {
        v[w] = (uint8_t)(((qs[w] & 15) | (((qh >> w) & 1) << 4)) + add);
        v[w + 16] = (uint8_t)(((qs[w] >> 4) | (((qh >> (w + 16)) & 1) << 4)) + add);
    }
}

/* A block's 32 bytes v as row i's share of 8 chunks of 64 bytes at ints (kinds 8, 18, 19). */
static inline void put_chunks(uint8_t *ints, const uint8_t v[32], int i) {
    for (int c = 0; c < 8; c++) memcpy(ints + 64 * c + 4 * i, v + 4 * c, 4);
}

/* Q5_0 / IQ4_NL row -> row i of a kind-8 group: the fp16 d, then each weight's q + 128 (Q5_0:
 * q = its 5 bits - 16; IQ4_NL: q = the table value of its 4-bit index). */
static void row_q8b(const uint8_t *src, int64_t t, int64_t nb, uint8_t *g, int i) {
    const int five = t == T_Q5_0;
    uint8_t v[32];
    for (int64_t b = 0; b < nb; b++, src += five ? 22 : 18) {
        uint8_t *blk = g + b * 544;
        memcpy(blk + 2 * i, src, 2);
        if (five) {
            q5_bytes(ld32(src + 2), src + 6, 112, v);
        } else {
            const uint8_t *qs = src + 2;
            for (int w = 0; w < 16; w++) {
                v[w] = (uint8_t)(gguf_iq4_values[qs[w] & 15] + 128);
                v[w + 16] = (uint8_t)(gguf_iq4_values[qs[w] >> 4] + 128);
            }
        }
        put_chunks(blk + 32, v, i);
    }
}

/* Q5_1 row -> row i of a kind-19 group: float32 d, d, m, then q + 128 (q: 5 bits). Returns 1 on
 * a NaN d or m. */
static int row_q5_1(const uint8_t *src, int64_t nb, uint8_t *g, int i) {
    int nan = 0;
    uint8_t v[32];
    for (int64_t b = 0; b < nb; b++, src += 24) {
        uint8_t *blk = g + b * 704;
        const uint16_t dh = gguf_load_u16(src), mh = gguf_load_u16(src + 2);
        nan |= half_is_nan(dh) | half_is_nan(mh);
        const float d = half_to_float(dh), m = half_to_float(mh);
        memcpy(blk + 4 * i, &d, 4);
        memcpy(blk + 64 + 4 * i, &d, 4);
        memcpy(blk + 128 + 4 * i, &m, 4);
        q5_bytes(ld32(src + 4), src + 8, 128, v);
        put_chunks(blk + 192, v, i);
    }
    return nan;
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (s: its 12 scale bytes). */
static inline void k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[4 + j] & 63;
    } else {
        *sc = (uint8_t)((s[4 + j] & 15) | ((s[j - 4] >> 2) & 0x30));
        *mn = (uint8_t)((s[4 + j] >> 4) | ((s[j] >> 2) & 0x30));
    }
}

/* Q4_K / Q5_K row (nb / 8 super-blocks) -> row i of a kind-14 / kind-15 group (pb: the kind's
 * block bytes; sup: the group's super-block scales). Sub-block j = 2 jj + h holds the nibbles h
 * of the 32 bytes qs[32 jj ..]; the packed byte t is q[t] | q[t + 16] << 4. */
static void row_k45(const uint8_t *src, int64_t t, int64_t nb, uint8_t *g, uint8_t *sup, int i) {
    const int five = t == T_Q5_K;
    const int64_t bs = five ? 176 : 144, pb = five ? 352 : 288, ns = nb / 8;
    for (int64_t s = 0; s < ns; s++, src += bs) {
        memcpy(sup + s * 64 + 2 * i, src, 2);
        memcpy(sup + s * 64 + 32 + 2 * i, src + 2, 2);
        const uint8_t *qs = src + bs - 128, *qh = src + 16;
        for (int j = 0; j < 8; j++) {
            uint8_t *blk = g + (8 * s + j) * pb;
            k_scale_min(src + 4, j, blk + i, blk + 16 + i);
            const uint8_t *q = qs + 32 * (j >> 1);
            for (int c = 0; c < 4; c++) {
                const uint32_t a = ld32(q + 4 * c), b = ld32(q + 16 + 4 * c);
                const uint32_t v = j & 1 ? ((a >> 4) & NIB) | (b & ~NIB) : (a & NIB) | ((b & NIB) << 4);
                st32(blk + 32 + 64 * c + 4 * i, v);
            }
            if (five) { /* byte t, bit c: the top bit (bit j of qh) of weight 4c + t */
                uint32_t top = 0;
                for (int c = 0; c < 8; c++) top |= ((ld32(qh + 4 * c) >> j) & 0x01010101u) << c;
                st32(blk + 288 + 4 * i, top);
            }
        }
    }
}

/* Q6_K row -> row i of a kind-26 group. Sub-block j (32 weights) of a super-block: half
 * j >> 2, its low nibbles from ql[64 half + 32 (j & 1) ..] shifted by 4 ((j >> 1) & 1), its top
 * 2 bits from qh[32 half ..] shifted by 2 (j & 3). */
static void row_k6(const uint8_t *src, int64_t nb, uint8_t *g, uint8_t *sup, int i) {
    const int64_t ns = nb / 8;
    for (int64_t s = 0; s < ns; s++, src += 210) {
        memcpy(sup + s * 32 + 2 * i, src + 208, 2);
        for (int j = 0; j < 8; j++) {
            uint8_t *blk = g + (8 * s + j) * 416;
            blk[i] = src[192 + 2 * j];
            blk[16 + i] = src[192 + 2 * j + 1];
            const int half = j >> 2, ls = 4 * ((j >> 1) & 1), hs = 2 * (j & 3);
            const uint8_t *ql = src + 64 * half + 32 * (j & 1), *qh = src + 128 + 32 * half;
            for (int c = 0; c < 4; c++) {
                const uint32_t lo = (ld32(ql + 4 * c) >> ls) & NIB, hi = (ld32(ql + 16 + 4 * c) >> ls) & NIB;
                st32(blk + 32 + 64 * c + 4 * i, lo | (hi << 4));
            }
            for (int h = 0; h < 2; h++) { /* byte t, bits 2c, 2c + 1: the top bits of weight 16 h + 4c + t */
                uint32_t top = 0;
                for (int c = 0; c < 4; c++) top |= ((ld32(qh + 16 * h + 4 * c) >> hs) & 0x03030303u) << (2 * c);
                st32(blk + 288 + 64 * h + 4 * i, top);
            }
        }
    }
}

/* Q3_K row -> row i of a kind-13 group. Sub-block j (32 weights): scales s0, s1 (the 6-bit
 * scales 2j, 2j + 1, less 32); u = q + 4, its low 2 bits from qs[32 (j >> 2) ..] shifted by
 * 2 (j & 3), its bit 2 bit j of hmask. */
static void row_k3(const uint8_t *src, int64_t nb, uint8_t *g, uint8_t *sup, int i) {
    const int64_t ns = nb / 8;
    for (int64_t s = 0; s < ns; s++, src += 110) {
        memcpy(sup + s * 32 + 2 * i, src + 108, 2);
        const uint8_t *hm = src, *qs = src + 32, *sc = src + 96;
        for (int j = 0; j < 8; j++) {
            uint8_t *blk = g + (8 * s + j) * 224;
            for (int h = 0; h < 2; h++) { /* 16-weight scale k = 2j + h: low 4 bits, then top 2 */
                const int k = 2 * j + h;
                const int lo = k < 8 ? sc[k] & 15 : sc[k - 8] >> 4, hi = (sc[8 + (k & 3)] >> (2 * (k >> 2))) & 3;
                blk[16 * h + i] = (uint8_t)((lo | (hi << 4)) - 32);
            }
            const int shift = 2 * (j & 3);
            const uint8_t *q = qs + 32 * (j >> 2);
            for (int h = 0; h < 2; h++) { /* byte t, bits 2c, 2c + 1: the low bits of weight 16 h + 4c + t */
                uint32_t low = 0;
                for (int c = 0; c < 4; c++) low |= ((ld32(q + 16 * h + 4 * c) >> shift) & 0x03030303u) << (2 * c);
                st32(blk + 32 + 64 * h + 4 * i, low);
            }
            uint32_t top = 0; /* byte t, bit c: bit 2 (bit j of hmask) of weight 4c + t */
            for (int c = 0; c < 8; c++) top |= ((ld32(hm + 4 * c) >> j) & 0x01010101u) << c;
            st32(blk + 160 + 4 * i, top);
        }
    }
}

/* IQ4_XS row -> row i of a kind-24 group: s = the 6-bit sub-scale - 32, and the file's index
 * bytes as they are (byte t of sub-block j holds indices t and t + 16, the nibble order of
 * kind 24). */
static void row_x4(const uint8_t *src, int64_t nb, uint8_t *g, uint8_t *sup, int i) {
    const int64_t ns = nb / 8;
    for (int64_t s = 0; s < ns; s++, src += 136) {
        memcpy(sup + s * 32 + 2 * i, src, 2);
        const uint16_t sh = gguf_load_u16(src + 2);
        for (int j = 0; j < 8; j++) {
            uint8_t *blk = g + (8 * s + j) * 272;
            const int ls = ((src[4 + j / 2] >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4);
            blk[i] = (uint8_t)(ls - 32);
            for (int c = 0; c < 4; c++) memcpy(blk + 16 + 64 * c + 4 * i, src + 8 + 16 * j + 4 * c, 4);
        }
    }
}

/* Q2_K row -> row i of a kind-10 group: per sub-block j the 4-bit scales and mins of its halves
 * (bytes 2j, 2j + 1 of the file's scales), then the 2-bit q as kind 4's nibbles (q[t] | q[t + 16] << 4),
 * q from qs[32 (j >> 2) ..] shifted by 2 (j & 3). */
static void row_k2(const uint8_t *src, int64_t nb, uint8_t *g, uint8_t *sup, int i) {
    const int64_t ns = nb / 8;
    for (int64_t s = 0; s < ns; s++, src += 84) {
        memcpy(sup + s * 64 + 2 * i, src + 80, 2);
        memcpy(sup + s * 64 + 32 + 2 * i, src + 82, 2);
        for (int j = 0; j < 8; j++) {
            uint8_t *blk = g + (8 * s + j) * 320;
            const uint8_t a = src[2 * j], b = src[2 * j + 1];
            blk[i] = a & 15;
            blk[16 + i] = b & 15;
            blk[32 + i] = a >> 4;
            blk[48 + i] = b >> 4;
            const int shift = 2 * (j & 3);
            const uint8_t *q = src + 16 + 32 * (j >> 2);
            for (int c = 0; c < 4; c++) {
                const uint32_t lo = (ld32(q + 4 * c) >> shift) & 0x03030303u, hi = (ld32(q + 16 + 4 * c) >> shift) & 0x03030303u;
                st32(blk + 64 + 64 * c + 4 * i, lo | (hi << 4));
            }
        }
    }
}

/* Row i of a group as padding: every scale 0, q = 0 (kinds 8 and 19 store q + 128). */
static void row_pad(int64_t kind, int64_t nb, uint8_t *g, uint8_t *sup, int i) {
    const int64_t pb = gguf_packed_block_bytes(kind), qo = gguf_ints_offset(kind);
    const int ssize = kind == GGUF_Q4 || kind == GGUF_Q8 ? 2 : kind == GGUF_F8 ? 4 : 1; /* bytes per row of a scale */
    const int nscales = (int)(qo / (16 * ssize));
    const uint8_t fill = kind == GGUF_Q8 || kind == GGUF_F8 ? 0x80 : 0;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = g + b * pb;
        for (int k = 0; k < nscales; k++) memset(blk + 16 * ssize * k + ssize * i, 0, ssize);
        for (int64_t c = 0; c < (pb - qo) / 64; c++) memset(blk + qo + 64 * c + 4 * i, fill, 4);
    }
    const int64_t sb = gguf_super_bytes(kind);
    for (int64_t s = 0; sup && s < nb / 8; s++)
        for (int64_t o = 0; o < sb; o += 32) memset(sup + s * sb + o + 2 * i, 0, 2);
}

/* Asks Linux to back the whole 2 MB pages inside [p, p + n) with transparent huge pages (where
 * the system leaves that to madvise): the packed weights are written once, front to back, and
 * one fault then maps 2 MB instead of 4 KB. */
static void advise_huge(uint8_t *p, int64_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21, a = ((uintptr_t)p + huge - 1) & ~(huge - 1),
                    e = ((uintptr_t)p + (uintptr_t)n) & ~(huge - 1);
    if (e > a) (void)madvise((void *)a, e - a, MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}

/* Packs `nparts` parts of one weight of K columns into `groups` groups of 16 rows at dst (kind:
 * what every part's type packs into). Part p: rows[p] rows of qtype[p] blocks at src[p] (rows
 * contiguous, each K / weights-per-block blocks), its first row at packed row start[p].
 * Returns 0, 1 when a Q4_0 d or a Q5_1 d / m is NaN (nothing is wrong, but the caller repacks with numpy), or -1
 * for arguments this packer does not take. */
int gguf_repack(int64_t nparts, const uint8_t *const *src, const int64_t *qtype, const int64_t *rows,
                const int64_t *start, int64_t K, int64_t kind, uint8_t *dst, int64_t groups, int64_t num_threads) {
    if (nparts <= 0 || K <= 0 || K % 32 || groups < 0) return -1;
    for (int64_t p = 0; p < nparts; p++) {
        if (repack_kind(qtype[p]) != kind || K % file_block_weights(qtype[p]) || rows[p] < 0 || start[p] < 0
            || start[p] + rows[p] > 16 * groups)
            return -1;
    }
    const int64_t nb = K / 32, gb = gguf_group_bytes(kind, nb), bb = nb * gguf_packed_block_bytes(kind);
    int nan = 0;
    advise_huge(dst, groups * gb);
    (void)num_threads;
    #pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads) reduction(|: nan)
    for (int64_t gi = 0; gi < groups; gi++) {
        uint8_t *sup = gguf_has_super(kind) ? dst + gi * gb : NULL, *g = dst + gi * gb + (gb - bb);
        for (int i = 0; i < GGUF_ROWS; i++) {
            const int64_t r = 16 * gi + i;
            int64_t p = 0;
            while (p < nparts && !(r >= start[p] && r < start[p] + rows[p])) p++;
            if (p == nparts) {
                row_pad(kind, nb, g, sup, i);
                continue;
            }
            const int64_t t = qtype[p];
            const uint8_t *row = src[p] + (r - start[p]) * (K / file_block_weights(t)) * file_block_bytes(t);
            switch (kind) {
            case GGUF_Q4: nan |= row_q4(row, t, nb, g, i); break;
            case GGUF_Q8:
                if (t == T_Q8_0) row_q8(row, nb, g, i);
                else row_q8b(row, t, nb, g, i);
                break;
            case GGUF_F8: nan |= row_q5_1(row, nb, g, i); break;
            case GGUF_K6: row_k6(row, nb, g, sup, i); break;
            case GGUF_K3: row_k3(row, nb, g, sup, i); break;
            case GGUF_X4: row_x4(row, nb, g, sup, i); break;
            case GGUF_K2: row_k2(row, nb, g, sup, i); break;
            default: row_k45(row, t, nb, g, sup, i); break;
            }
        }
    }
    return nan ? 1 : 0;
}
