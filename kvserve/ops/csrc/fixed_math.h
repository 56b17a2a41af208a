/* Elementary functions with one fixed sequence of float operations (no libm, whose expf differs
 * between its variants and CPUs): the same bits on every ISA when built with -ffp-contract=off. */
#ifndef KVSERVE_FIXED_MATH_H
#define KVSERVE_FIXED_MATH_H

#include <stdint.h>

/* exp(x) for -87 <= x <= 88 (Cephes' expf scheme, about 1 ulp): x = n ln2 + r with
 * |r| <= ln2/2 (ln2 split in two for an exact reduction), exp(r) by a degree-7 polynomial, 2^n
 * added to the float's exponent bits. Branch-free, so loops over it vectorize. */
static inline float exp_in_range(float x) {
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } u = {p};
    u.i += (int32_t)n << 23;
    return u.f;
}

#endif
