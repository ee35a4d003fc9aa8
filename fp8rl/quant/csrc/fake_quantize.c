/* Native CPU kernels of fp8rl.quant.fake.fake_quantize (loaded by fp8rl/quant/native.py, which
   documents them): fq_amax (block maxima of |x| as bit patterns), fq_apply (round |x| * q onto
   the FP8 grid, copy the sign back, dequantize) and fq_full (both, with the scales computed here
   by quantize._qscale's formula). Plain IEEE float32 operations only; compiled with
   -ffp-contract=off and without fast-math, so they round as PyTorch's kernels do. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CLONES __attribute__((target_clones("avx2", "default")))

static inline uint32_t mag_bits(const void *x, int bf16, int64_t i) {
    if (bf16) return ((uint32_t)(((const uint16_t *)x)[i] & 0x7FFFu)) << 16;
    return ((const uint32_t *)x)[i] & 0x7FFFFFFFu;
}

/* out[gr * gc] (zeroed by the caller): the bit pattern of max |x| over each br x bc block. */
CLONES void fq_amax(const void *x, int bf16, int64_t R, int64_t C, int64_t br, int64_t bc,
                    uint32_t *out) {
    int64_t gc = (C + bc - 1) / bc;
    for (int64_t r = 0; r < R; r++) {
        uint32_t *m = out + (r / br) * gc;
        int64_t row = r * C;
        if (bc == 1) {
            for (int64_t c = 0; c < C; c++) {
                uint32_t b = mag_bits(x, bf16, row + c);
                m[c] = b > m[c] ? b : m[c];
            }
            continue;
        }
        for (int64_t g = 0; g < gc; g++) {
            int64_t c0 = g * bc, c1 = c0 + bc < C ? c0 + bc : C;
            uint32_t best = 0;
            for (int64_t c = c0; c < c1; c++) {
                uint32_t b = mag_bits(x, bf16, row + c);
                best = b > best ? b : best;
            }
            m[g] = best > m[g] ? best : m[g];
        }
    }
}

static inline float as_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* One element: |x| * q rounded onto the FP8 grid, x's sign, then * d (or / d). */
static inline float fq_one(const void *x, int bf16, int64_t i, float q, float d, int divide,
                           uint32_t min_bits, uint32_t shift) {
    uint32_t xb = bf16 ? ((uint32_t)((const uint16_t *)x)[i]) << 16 : ((const uint32_t *)x)[i];
    float a = as_float(xb & 0x7FFFFFFFu) * q;
    uint32_t e = as_bits(a) & 0x7F800000u;
    e = (e < min_bits ? min_bits : e) + shift;
    float c = as_float(e);
    float r = (a + c) - c;
    r = as_float(as_bits(r) | (xb & 0x80000000u));  /* copysign: r >= 0 */
    return divide ? r / d : r * d;
}

/* out[R * C] = the FP8 value of x (row-major, br x bc blocks), with per-block quantization
   scales q[gr * gc] and dequantization factors d (multipliers, or divisors when divide). */
CLONES void fq_apply(const void *x, int bf16, int64_t R, int64_t C, int64_t br, int64_t bc,
                     const float *q, const float *d, int divide, uint32_t min_bits,
                     uint32_t shift, float *out) {
    int64_t gc = (C + bc - 1) / bc;
    for (int64_t r = 0; r < R; r++) {
        const float *qr = q + (r / br) * gc, *dr = d + (r / br) * gc;
        int64_t row = r * C;
        if (bc == 1) {
            for (int64_t c = 0; c < C; c++)
                out[row + c] = fq_one(x, bf16, row + c, qr[c], dr[c], divide, min_bits, shift);
            continue;
        }
        for (int64_t g = 0; g < gc; g++) {
            int64_t c0 = g * bc, c1 = c0 + bc < C ? c0 + bc : C;
            float qs = qr[g], ds = dr[g];
            for (int64_t c = c0; c < c1; c++)
                out[row + c] = fq_one(x, bf16, row + c, qs, ds, divide, min_bits, shift);
        }
    }
}

/* The whole fake quantization with the scales of quantize._qscale (no power of two):
   qscale = fl32((1 / max(amax, eps)) * fmt_max) in double (PyTorch computes fmt_max / t as
   t.reciprocal() * fmt_max), the multiplier fl32(1 / qscale) (or qscale itself to divide).
   Returns the largest magnitude's bit pattern; when it is not finite (>= 0x7F800000) nothing
   is written to out. */
uint32_t fq_full(const void *x, int bf16, int64_t R, int64_t C, int64_t br, int64_t bc,
                 double fmt_max, double eps, int divide, uint32_t min_bits, uint32_t shift,
                 float *out) {
    int64_t n = ((R + br - 1) / br) * ((C + bc - 1) / bc);
    uint32_t small[2 * 64], *m = n <= 64 ? small : calloc((size_t)n, 2 * sizeof(uint32_t));
    if (!m) return 0xFFFFFFFFu;
    memset(m, 0, (size_t)n * sizeof(uint32_t));
    fq_amax(x, bf16, R, C, br, bc, m);
    uint32_t worst = 0;
    for (int64_t i = 0; i < n; i++) worst = m[i] > worst ? m[i] : worst;
    if (worst < 0x7F800000u) {
        float *q = (float *)m, *d = (float *)(m + n);
        for (int64_t i = 0; i < n; i++) {
            double a = (double)as_float(m[i]);
            float qs = (float)((1.0 / (a < eps ? eps : a)) * fmt_max);
            q[i] = qs;
            d[i] = divide ? qs : 1.0f / qs;
        }
        fq_apply(x, bf16, R, C, br, bc, q, d, divide, min_bits, shift, out);
    }
    if (m != small) free(m);
    return worst;
}
