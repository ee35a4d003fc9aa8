/* Native CPU kernels of fp8rl.quant.fake.fake_quantize (loaded by fp8rl/quant/native.py, which
   documents them): fq_amax (block maxima of |x| as bit patterns), fq_apply (round |x| * q onto
   the FP8 grid, copy the sign back, dequantize) and fq_full (both, with the scales computed here
   by quantize._qscale's formula); mq_full, the same for the microscaled FP4 / FP6 operands of
   fp8rl.quant.microscale (MX and NVFP4 scales, nearest-even or stochastic elements). Plain IEEE float32 operations only; compiled with
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

/* ---- Microscaled operands (fp8rl/quant/microscale.py documents the formulas) ---- */

/* floor(log2(v)) of a positive finite float32 given by its bit pattern (subnormals included):
   what torch.frexp(v).exponent - 1 is. */
static inline int32_t floor_log2_bits(uint32_t b) {
    uint32_t e = b >> 23;
    if (e) return (int32_t)e - 127;
    return (31 - __builtin_clz(b)) - 149;  /* b > 0: the subnormal's highest set bit */
}

/* 2^e as float32 for e in [-127, 127] (2^-127 is the subnormal 0x00400000), exact. */
static inline float pow2f_exact(int32_t e) {
    return as_float(e >= -126 ? (uint32_t)(e + 127) << 23 : 1u << 22);
}

/* Nearest even onto a grid (formats.round_magnitudes_) of a float32 a >= 0. */
static inline float grid_rne(float a, uint32_t min_bits, uint32_t shift) {
    uint32_t e = as_bits(a) & 0x7F800000u;
    float c = as_float((e < min_bits ? min_bits : e) + shift);
    return (a + c) - c;
}

/* Stochastic rounding onto a grid (formats.round_magnitudes_stochastic_) of a float32 a >= 0
   with the uniform draw u: lo + step when u < p, else lo. a / step is non-negative and below
   2^(mantissa bits + 1) (a <= the format's max, step its spacing at a), so truncation to int32
   is its floor. */
static inline float grid_stochastic(float a, float u, uint32_t min_bits, uint32_t man_shift) {
    uint32_t e = as_bits(a) & 0x7F800000u;
    float step = as_float((e < min_bits ? min_bits : e) - man_shift);
    float lo = (float)(int32_t)(a / step) * step;
    float p = (a - lo) / step;
    return lo + (u < p ? step : 0.0f);
}

static inline uint32_t x_bits(const void *x, int bf16, int64_t i) {
    return bf16 ? ((uint32_t)((const uint16_t *)x)[i]) << 16 : ((const uint32_t *)x)[i];
}

/* One element of mq_full, nearest even: sat(rne(|x| / div)) with x's sign (bit pattern xb),
   times ds (|x| / div is clamped to twice the format's max first: it saturates either way). */
static inline float mq_rne(uint32_t xb, float div, float ds, uint32_t min_bits, uint32_t shift,
                           float fmt_max) {
    float a = as_float(xb & 0x7FFFFFFFu) / div;
    a = a > 2.0f * fmt_max ? 2.0f * fmt_max : a;
    a = grid_rne(a, min_bits, shift);
    a = a > fmt_max ? fmt_max : a;
    return as_float(as_bits(a) | (xb & 0x80000000u)) * ds;
}

/* One element of mq_full, stochastic with the draw u. */
static inline float mq_sr(uint32_t xb, float div, float ds, float u, uint32_t min_bits,
                          uint32_t man_shift, float fmt_max) {
    float a = as_float(xb & 0x7FFFFFFFu) / div;
    a = a > fmt_max ? fmt_max : a;
    a = grid_stochastic(a, u, min_bits, man_shift);
    a = a > fmt_max ? fmt_max : a;
    return as_float(as_bits(a) | (xb & 0x80000000u)) * ds;
}

/* The element pass of mq_full, with the decode scales d[gr * gc] and the divisors dv (d, or inf
   where d = 0) given; a loop per rounding so that each vectorises. Blocks one column wide (the
   transpose of 1 x 16 blocks) read a scale per element along the row. */
CLONES static void mq_apply(const void *x, int bf16, int64_t R, int64_t C, int64_t br, int64_t bc,
                            const float *d, const float *dv, uint32_t min_bits, uint32_t shift,
                            uint32_t man_shift, float fmt_max, const float *u, int64_t su_r,
                            int64_t su_c, float *out) {
    int64_t gc = (C + bc - 1) / bc;
    for (int64_t r = 0; r < R; r++) {
        const float *dr = d + (r / br) * gc, *vr = dv + (r / br) * gc;
        int64_t row = r * C;
        float *o = out + row;
        if (bc == 1 && !u) {
            if (bf16)
                for (int64_t c = 0; c < C; c++)
                    o[c] = mq_rne(x_bits(x, 1, row + c), vr[c], dr[c], min_bits, shift, fmt_max);
            else
                for (int64_t c = 0; c < C; c++)
                    o[c] = mq_rne(x_bits(x, 0, row + c), vr[c], dr[c], min_bits, shift, fmt_max);
        } else if (bc == 1 && su_c == 1) {
            const float *ur = u + r * su_r;
            for (int64_t c = 0; c < C; c++)
                o[c] = mq_sr(x_bits(x, bf16, row + c), vr[c], dr[c], ur[c], min_bits, man_shift, fmt_max);
        } else if (bc == 1) {
            for (int64_t c = 0; c < C; c++)
                o[c] = mq_sr(x_bits(x, bf16, row + c), vr[c], dr[c], u[r * su_r + c * su_c], min_bits,
                             man_shift, fmt_max);
        } else {
            for (int64_t g = 0; g < gc; g++) {
                int64_t c0 = g * bc, c1 = c0 + bc < C ? c0 + bc : C;
                float ds = dr[g], div = vr[g];
                if (u && su_c == 1)
                    for (int64_t c = c0; c < c1; c++)
                        o[c] = mq_sr(x_bits(x, bf16, row + c), div, ds, u[r * su_r + c], min_bits, man_shift,
                                     fmt_max);
                else if (u)
                    for (int64_t c = c0; c < c1; c++)
                        o[c] = mq_sr(x_bits(x, bf16, row + c), div, ds, u[r * su_r + c * su_c], min_bits,
                                     man_shift, fmt_max);
                else if (bf16)
                    for (int64_t c = c0; c < c1; c++)
                        o[c] = mq_rne(x_bits(x, 1, row + c), div, ds, min_bits, shift, fmt_max);
                else
                    for (int64_t c = c0; c < c1; c++)
                        o[c] = mq_rne(x_bits(x, 0, row + c), div, ds, min_bits, shift, fmt_max);
            }
        }
    }
}

/* The whole fake quantization of a microscaled operand x (row-major [R, C], br x bc blocks):
   the block maxima, the decode scales d (nv = 0: MX, d = 2^e with e = floor(log2 amax) - emax,
   clamped to E8M0's [-127, 127], -127 for an all-zero block; nv = 1: NVFP4, the per-tensor
   s_t = fl32(max(amax, eps) / tensor_range) and E4M3 block scales s_b = e4m3(fl32(amax / (6 s_t)))
   in double inside, d = fl32(s_b * s_t)), then per element q = sat(round(|x| / d)) (a block
   with d = 0 divides by inf), x's sign, times d. Rounding: nearest even on the element grid
   (min_bits, shift), or stochastic when u is given, the draw of element (r, c) at
   u[r * su_r + c * su_c]. Returns the largest magnitude's bit pattern; when it is not finite
   (>= 0x7F800000) nothing is written to out, and 0xFFFFFFFF when no memory was found. */
uint32_t mq_full(const void *x, int bf16, int64_t R, int64_t C, int64_t br, int64_t bc,
                 int nv, int32_t emax, double eps, double tensor_range, uint32_t min_bits,
                 uint32_t shift, uint32_t man_shift, float fmt_max, const float *u, int64_t su_r,
                 int64_t su_c, float *out) {
    int64_t gc = (C + bc - 1) / bc, n = ((R + br - 1) / br) * gc;
    uint32_t *m = calloc((size_t)n, 3 * sizeof(uint32_t));
    if (!m) return 0xFFFFFFFFu;
    fq_amax(x, bf16, R, C, br, bc, m);
    uint32_t worst = 0;
    for (int64_t i = 0; i < n; i++) worst = m[i] > worst ? m[i] : worst;
    if (worst >= 0x7F800000u) { free(m); return worst; }
    float *d = (float *)(m + n), *dv = (float *)(m + 2 * n);
    if (nv) {
        double amax_t = (double)as_float(worst);
        float s_t = (float)((amax_t < eps ? eps : amax_t) / tensor_range);
        const uint32_t e4m3_min = (uint32_t)(-6 + 127) << 23, e4m3_shift = (uint32_t)(23 - 3) << 23;
        for (int64_t i = 0; i < n; i++) {
            float s_b = (float)((double)as_float(m[i]) / (6.0 * (double)s_t));
            s_b = s_b > 896.0f ? 896.0f : s_b;
            s_b = grid_rne(s_b, e4m3_min, e4m3_shift);
            s_b = s_b > 448.0f ? 448.0f : s_b;
            d[i] = s_b * s_t;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            int32_t e = m[i] ? floor_log2_bits(m[i]) - emax : -127;
            e = e < -127 ? -127 : (e > 127 ? 127 : e);
            d[i] = pow2f_exact(e);
        }
    }
    const float inf = as_float(0x7F800000u);
    for (int64_t i = 0; i < n; i++) dv[i] = d[i] == 0.0f ? inf : d[i];
    mq_apply(x, bf16, R, C, br, bc, d, dv, min_bits, shift, man_shift, fmt_max, u, su_r, su_c, out);
    free(m);
    return worst;
}
