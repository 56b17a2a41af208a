/* float_to_half and half_to_float (kvserve/ops/csrc/half.h) against the x86 F16C instructions
 * (vcvtps2ph with round to nearest even, vcvtph2ps): every half converts back exactly, and
 * float -> half agrees on every float from the subnormal range to the overflow boundary, both
 * signs (each float bit pattern there, 2 x 2^30), and on a stride through all the others.
 * NaN inputs only need to give a NaN. Prints "half_check: passed" or the first mismatches;
 * exit status 1 if any.
 * Build: cc -O2 -mf16c -I kvserve/ops/csrc tests/unit/csrc/half_check.c -o half_check */
#include <immintrin.h>
#include <stdio.h>
#include <string.h>

#include "half.h"

static int bad = 0;

static void check(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    const uint16_t got = float_to_half(f), want = (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
    const int nan = (u & 0x7fffffff) > 0x7f800000u;
    if (nan ? (got & 0x7fff) <= 0x7c00 || (got & 0x7c00) != 0x7c00 : got != want) {
        if (bad++ < 10) printf("float %08x: float_to_half %04x, vcvtps2ph %04x\n", u, got, want);
    }
}

int main(void) {
    for (uint32_t h = 0; h < 0x10000; h++) {             /* half -> float: exact, every half */
        const float want = _cvtsh_ss((unsigned short)h), got = half_to_float((uint16_t)h);
        if (memcmp(&want, &got, 4) != 0 && want == want) {
            if (bad++ < 10) printf("half %04x: half_to_float %a, vcvtph2ps %a\n", h, got, want);
        }
    }
    for (uint32_t s = 0; s < 2; s++)                        /* |x| in [2^-33, 2^17): every pattern */
        for (uint32_t u = 0x2f000000u; u < 0x48000000u; u++) check(u | s << 31);
    for (uint64_t u = 0; u < 0x100000000ull; u += 997) check((uint32_t)u);    /* the rest, strided */
    printf("half_check: %s\n", bad ? "FAILED" : "passed");
    return bad != 0;
}
