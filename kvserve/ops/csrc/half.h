/* IEEE binary16 <-> float32, exact and the same bits in every build: half -> float is exact
 * (every half is a float); float -> half rounds to nearest even (overflow to infinity, NaN to
 * the quiet NaN 0x7e00), the rounding F16C's vcvtps2ph and Arm's fcvt apply, done here with
 * integer steps and one float addition so no build depends on those instructions. */
#ifndef KVSERVE_HALF_H
#define KVSERVE_HALF_H

#include <stdint.h>
#include <string.h>

/* IEEE half -> float, exact, without F16C or Arm fp16 instructions (the portable reference). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    float f;
    if (exp == 0) {                       /* zero or subnormal: man * 2^-24, exact */
        f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* float -> half, round to nearest even. Subnormal halves come from one float addition of a
 * magic constant (its rounding is the IEEE one); normal ones from the mantissa's top bits plus a
 * rounding bias that carries into the exponent (up to infinity) when it must. */
static inline uint16_t float_to_half(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000;
    u &= 0x7fffffff;
    if (u >= 0x47800000u)                              /* >= 2^16: infinity, or NaN */
        return (uint16_t)(sign | (u > 0x7f800000u ? 0x7e00 : 0x7c00));
    if (u < 0x38800000u) {                             /* below 2^-14: a subnormal half or zero */
        const uint32_t magic_bits = 126u << 23;       /* 0.5: the sum's low mantissa bits are the half's */
        float a, magic;
        memcpy(&a, &u, 4);
        memcpy(&magic, &magic_bits, 4);
        a += magic;
        memcpy(&u, &a, 4);
        return (uint16_t)(sign | (u - magic_bits));
    }
    u += 0xc8000fffu + ((u >> 13) & 1);                /* exponent rebias (-112 << 23), round to even */
    return (uint16_t)(sign | (u >> 13));
}

#endif
