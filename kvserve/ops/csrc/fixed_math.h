/* Elementary functions with one fixed sequence of float operations (no libm, whose expf differs
 * between its variants and CPUs), and an 8-lane fused multiply-add: the same bits on every ISA
 * when built with -ffp-contract=off. */
#ifndef KVSERVE_FIXED_MATH_H
#define KVSERVE_FIXED_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__FMA__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

typedef float fixed_v8f __attribute__((vector_size(32)));

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

/* a b + c lane by lane, each rounded once (a fused multiply-add on every build: FMA3, NEON's
 * vfmaq, or C's fmaf), so the bits are the same everywhere. */
static inline __attribute__((always_inline)) fixed_v8f fma8(fixed_v8f a, fixed_v8f b, fixed_v8f c) {
#if defined(__FMA__)
    return (fixed_v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__)
    float32x4_t r[2];
    for (int h = 0; h < 2; h++) {
        float32x4_t x, y, z;
        memcpy(&x, (const char *)&a + 16 * h, 16);
        memcpy(&y, (const char *)&b + 16 * h, 16);
        memcpy(&z, (const char *)&c + 16 * h, 16);
        r[h] = vfmaq_f32(z, x, y);
    }
    fixed_v8f out;
    memcpy(&out, r, 32);
    return out;
#else
    fixed_v8f out;
    for (int l = 0; l < 8; l++) out[l] = fmaf(a[l], b[l], c[l]);
    return out;
#endif
}

#endif
