/*
 * Numerics of the loopback libnccl: element sizes, float16 / bfloat16 / float8
 * conversions, and the reduction kernels.
 *
 * Semantics (tests compare against numpy / ml_dtypes):
 *  - integers wrap around (computed in the unsigned type, so no signed overflow);
 *  - half, bfloat16 and float8 are computed in float and rounded to nearest even
 *    after every step, exactly like numpy's float16 and ml_dtypes' arithmetic;
 *    float8 follows ml_dtypes: e4m3fn has no infinity (overflow and inf become NaN),
 *    e5m2 overflows to inf;
 *  - the reduction order is fixed: ((rank0 op rank1) op rank2) ...;
 *  - avg is NCCL's: integers sum then divide (truncating), floats pre-multiply by
 *    1/nranks rounded to the type (PreMulSum).
 */
#include "internal.h"

#include <math.h>
#include <string.h>

#pragma GCC optimize("O3")              /* let gcc vectorize the native-type loops */
#pragma GCC optimize("fp-contract=off") /* x*s + y stays two roundings, like numpy */

/* ---- element types ---- */

static const unsigned char k_size[12] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
static const char *const k_name[12] = {"int8",    "uint8",   "int32",   "uint32",
                                       "int64",   "uint64",  "float16", "float32",
                                       "float64", "bfloat16", "float8e4m3", "float8e5m2"};

size_t lb_type_size(int dtype) { return (dtype >= 0 && dtype < 12) ? k_size[dtype] : 0; }

const char *lb_type_name(int dtype) { return (dtype >= 0 && dtype < 12) ? k_name[dtype] : "?"; }

int lb_type_is_float(int dtype) { return dtype >= ncclFloat16; }

/* ---- conversions ---- */

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float -> a small IEEE-like binary format with MB mantissa bits and exponent bias
 * BIAS, rounding to nearest even. Returns the magnitude code (no sign); the caller
 * maps overflow (a code past the largest finite one) to inf or NaN. */
static inline uint32_t small_code(uint32_t ax, int MB, int BIAS) {
    int e = (int)(ax >> 23) - 127;
    if (ax < 0x00800000u) return 0; /* float subnormal: far below every small format */
    uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    int s;
    int normal = e >= 1 - BIAS;
    if (normal) {
        s = 23 - MB;
    } else {
        s = 23 - MB + (1 - BIAS - e);
        if (s > 25) return 0;
    }
    uint32_t q = m >> s;
    uint32_t rem = m & ((1u << s) - 1u);
    uint32_t half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    if (!normal) return q; /* q == 1<<MB is the smallest normal's code */
    if (e + BIAS > 0x3ff) return 0xffffu;
    return ((uint32_t)(e + BIAS) << MB) + q - (1u << MB);
}

static inline uint16_t f2half(float f) {
    uint32_t x = f2u(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504 */
    return (uint16_t)(sign | small_code(ax, 10, 15));
}

static inline uint16_t f2bf16(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline uint8_t f2e4m3(float f) {
    uint32_t x = f2u(f);
    uint32_t sign = (x >> 24) & 0x80u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint8_t)(sign | 0x7fu); /* inf and NaN: NaN */
    uint32_t code = small_code(ax, 3, 7);
    if (code > 0x7eu) return (uint8_t)(sign | 0x7fu); /* past 448: NaN */
    return (uint8_t)(sign | code);
}

static inline uint8_t f2e5m2(float f) {
    uint32_t x = f2u(f);
    uint32_t sign = (x >> 24) & 0x80u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint8_t)(sign | 0x7eu);
    if (ax == 0x7f800000u) return (uint8_t)(sign | 0x7cu);
    uint32_t code = small_code(ax, 2, 15);
    if (code >= 0x7cu) return (uint8_t)(sign | 0x7cu); /* past 57344: inf */
    return (uint8_t)(sign | code);
}

/* Decoding tables, filled once at load (exact: powers of two times small ints). */
static float t_half[65536];
static float t_e4m3[256];
static float t_e5m2[256];

static float decode_small(uint32_t v, int EB, int MB, int BIAS, int fn) {
    uint32_t sign = (v >> (EB + MB)) & 1u;
    uint32_t e = (v >> MB) & ((1u << EB) - 1u);
    uint32_t m = v & ((1u << MB) - 1u);
    float r;
    if (e == (1u << EB) - 1u && !fn) {
        r = m ? NAN : INFINITY;
    } else if (fn && e == (1u << EB) - 1u && m == (1u << MB) - 1u) {
        r = NAN;
    } else if (e == 0) {
        r = ldexpf((float)m, 1 - BIAS - MB);
    } else {
        r = ldexpf((float)(m + (1u << MB)), (int)e - BIAS - MB);
    }
    return sign ? -r : r;
}

__attribute__((constructor)) static void lb_reduce_tables(void) {
    for (uint32_t v = 0; v < 65536; v++) t_half[v] = decode_small(v, 5, 10, 15, 0);
    for (uint32_t v = 0; v < 256; v++) {
        t_e4m3[v] = decode_small(v, 4, 3, 7, 1);
        t_e5m2[v] = decode_small(v, 5, 2, 15, 0);
    }
}

static inline float half2f(uint16_t h) { return t_half[h]; }
static inline float bf162f(uint16_t b) { return u2f((uint32_t)b << 16); }
static inline float e4m32f(uint8_t v) { return t_e4m3[v]; }
static inline float e5m22f(uint8_t v) { return t_e5m2[v]; }

uint64_t lb_scalar_from_double(int dtype, double v) {
    uint64_t out = 0;
    switch (dtype) {
    case ncclInt8: { int8_t x = (int8_t)v; memcpy(&out, &x, 1); break; }
    case ncclUint8: { uint8_t x = (uint8_t)v; memcpy(&out, &x, 1); break; }
    case ncclInt32: { int32_t x = (int32_t)v; memcpy(&out, &x, 4); break; }
    case ncclUint32: { uint32_t x = (uint32_t)v; memcpy(&out, &x, 4); break; }
    case ncclInt64: { int64_t x = (int64_t)v; memcpy(&out, &x, 8); break; }
    case ncclUint64: { uint64_t x = (uint64_t)v; memcpy(&out, &x, 8); break; }
    case ncclFloat16: { uint16_t x = f2half((float)v); memcpy(&out, &x, 2); break; }
    case ncclFloat32: { float x = (float)v; memcpy(&out, &x, 4); break; }
    case ncclFloat64: memcpy(&out, &v, 8); break;
    case ncclBfloat16: { uint16_t x = f2bf16((float)v); memcpy(&out, &x, 2); break; }
    case 10: { uint8_t x = f2e4m3((float)v); memcpy(&out, &x, 1); break; }
    case 11: { uint8_t x = f2e5m2((float)v); memcpy(&out, &x, 1); break; }
    default: break;
    }
    return out;
}

/* ---- kernels ----
 * Every kernel works in blocks: the block's result is accumulated in acc (on the
 * stack, in cache) from all sources, then stored, so a destination may alias a
 * source block (in-place collectives). */

#define LB_BLK 1024

static inline void store2(void *d1, void *d2, size_t off, const void *acc, size_t bytes) {
    if (d1) memcpy((char *)d1 + off, acc, bytes);
    if (d2) memcpy((char *)d2 + off, acc, bytes);
}

/* Integers: U is the unsigned type used for wrapping arithmetic, T the element type
 * (for comparisons and the signed average). */
#define LB_DEF_INT(NAME, T, U)                                                                \
    static void red_##NAME(const struct lb_redop *op, const uint64_t *scalars, void *d1, void *d2,\
                           const void *const *srcs, int nsrc, size_t n) {                     \
        T acc[LB_BLK];                                                                        \
        T sc = 0;                                                                             \
        for (size_t b = 0; b < n; b += LB_BLK) {                                              \
            size_t m = n - b < LB_BLK ? n - b : LB_BLK;                                       \
            const T *s0 = (const T *)srcs[0] + b;                                             \
            if (op->kind == LB_R_PREMULSUM) {                                                 \
                memcpy(&sc, &scalars[0], sizeof(T));                                          \
                for (size_t i = 0; i < m; i++) acc[i] = (T)((U)s0[i] * (U)sc);                \
            } else {                                                                          \
                memcpy(acc, s0, m * sizeof(T));                                               \
            }                                                                                 \
            for (int r = 1; r < nsrc; r++) {                                                  \
                const T *s = (const T *)srcs[r] + b;                                          \
                switch (op->kind) {                                                           \
                case LB_R_SUM:                                                                \
                case LB_R_SUMPOSTDIV:                                                         \
                    for (size_t i = 0; i < m; i++) acc[i] = (T)((U)acc[i] + (U)s[i]);         \
                    break;                                                                    \
                case LB_R_PROD:                                                               \
                    for (size_t i = 0; i < m; i++) acc[i] = (T)((U)acc[i] * (U)s[i]);         \
                    break;                                                                    \
                case LB_R_MAX:                                                                \
                    for (size_t i = 0; i < m; i++) acc[i] = s[i] > acc[i] ? s[i] : acc[i];    \
                    break;                                                                    \
                case LB_R_MIN:                                                                \
                    for (size_t i = 0; i < m; i++) acc[i] = s[i] < acc[i] ? s[i] : acc[i];    \
                    break;                                                                    \
                case LB_R_PREMULSUM:                                                          \
                    memcpy(&sc, &scalars[r], sizeof(T));                                      \
                    for (size_t i = 0; i < m; i++)                                            \
                        acc[i] = (T)((U)acc[i] + (U)s[i] * (U)sc);                            \
                    break;                                                                    \
                default:                                                                      \
                    break;                                                                    \
                }                                                                             \
            }                                                                                 \
            if (op->kind == LB_R_SUMPOSTDIV) {                                                \
                T dv = (T)op->divisor;                                                        \
                for (size_t i = 0; i < m; i++) acc[i] = (T)(acc[i] / dv);                     \
            }                                                                                 \
            store2(d1, d2, b * sizeof(T), acc, m * sizeof(T));                                \
        }                                                                                     \
    }

LB_DEF_INT(i8, int8_t, uint8_t)
LB_DEF_INT(u8, uint8_t, uint8_t)
LB_DEF_INT(i32, int32_t, uint32_t)
LB_DEF_INT(u32, uint32_t, uint32_t)
LB_DEF_INT(i64, int64_t, uint64_t)
LB_DEF_INT(u64, uint64_t, uint64_t)

/* Native floats: NaN-propagating max/min like numpy.maximum / numpy.minimum. */
#define LB_DEF_FLOAT(NAME, T)                                                                 \
    static void red_##NAME(const struct lb_redop *op, const uint64_t *scalars, void *d1, void *d2,\
                           const void *const *srcs, int nsrc, size_t n) {                     \
        T acc[LB_BLK];                                                                        \
        T sc = 0;                                                                             \
        for (size_t b = 0; b < n; b += LB_BLK) {                                              \
            size_t m = n - b < LB_BLK ? n - b : LB_BLK;                                       \
            const T *s0 = (const T *)srcs[0] + b;                                             \
            if (op->kind == LB_R_PREMULSUM) {                                                 \
                memcpy(&sc, &scalars[0], sizeof(T));                                          \
                for (size_t i = 0; i < m; i++) acc[i] = s0[i] * sc;                           \
            } else {                                                                          \
                memcpy(acc, s0, m * sizeof(T));                                               \
            }                                                                                 \
            for (int r = 1; r < nsrc; r++) {                                                  \
                const T *s = (const T *)srcs[r] + b;                                          \
                switch (op->kind) {                                                           \
                case LB_R_SUM:                                                                \
                    for (size_t i = 0; i < m; i++) acc[i] = acc[i] + s[i];                    \
                    break;                                                                    \
                case LB_R_PROD:                                                               \
                    for (size_t i = 0; i < m; i++) acc[i] = acc[i] * s[i];                    \
                    break;                                                                    \
                case LB_R_MAX:                                                                \
                    for (size_t i = 0; i < m; i++)                                            \
                        acc[i] = (s[i] > acc[i] || s[i] != s[i]) ? s[i] : acc[i];             \
                    break;                                                                    \
                case LB_R_MIN:                                                                \
                    for (size_t i = 0; i < m; i++)                                            \
                        acc[i] = (s[i] < acc[i] || s[i] != s[i]) ? s[i] : acc[i];             \
                    break;                                                                    \
                case LB_R_PREMULSUM:                                                          \
                    memcpy(&sc, &scalars[r], sizeof(T));                                      \
                    for (size_t i = 0; i < m; i++) acc[i] = acc[i] + s[i] * sc;               \
                    break;                                                                    \
                default:                                                                      \
                    break;                                                                    \
                }                                                                             \
            }                                                                                 \
            store2(d1, d2, b * sizeof(T), acc, m * sizeof(T));                                \
        }                                                                                     \
    }

LB_DEF_FLOAT(f32, float)
LB_DEF_FLOAT(f64, double)

/* Small floats: S is the storage type, DEC/ENC convert through float. */
#define LB_DEF_SMALL(NAME, S, DEC, ENC)                                                       \
    static void red_##NAME(const struct lb_redop *op, const uint64_t *scalars, void *d1, void *d2,\
                           const void *const *srcs, int nsrc, size_t n) {                     \
        S acc[LB_BLK];                                                                        \
        S scs;                                                                                \
        float sc = 0;                                                                         \
        for (size_t b = 0; b < n; b += LB_BLK) {                                              \
            size_t m = n - b < LB_BLK ? n - b : LB_BLK;                                       \
            const S *s0 = (const S *)srcs[0] + b;                                             \
            if (op->kind == LB_R_PREMULSUM) {                                                 \
                memcpy(&scs, &scalars[0], sizeof(S));                                         \
                sc = DEC(scs);                                                                \
                for (size_t i = 0; i < m; i++) acc[i] = ENC(DEC(s0[i]) * sc);                 \
            } else {                                                                          \
                memcpy(acc, s0, m * sizeof(S));                                               \
            }                                                                                 \
            for (int r = 1; r < nsrc; r++) {                                                  \
                const S *s = (const S *)srcs[r] + b;                                          \
                switch (op->kind) {                                                           \
                case LB_R_SUM:                                                                \
                    for (size_t i = 0; i < m; i++) acc[i] = ENC(DEC(acc[i]) + DEC(s[i]));     \
                    break;                                                                    \
                case LB_R_PROD:                                                               \
                    for (size_t i = 0; i < m; i++) acc[i] = ENC(DEC(acc[i]) * DEC(s[i]));     \
                    break;                                                                    \
                case LB_R_MAX:                                                                \
                    for (size_t i = 0; i < m; i++) {                                          \
                        float a = DEC(acc[i]), x = DEC(s[i]);                                 \
                        if (x > a || x != x) acc[i] = s[i];                                   \
                    }                                                                         \
                    break;                                                                    \
                case LB_R_MIN:                                                                \
                    for (size_t i = 0; i < m; i++) {                                          \
                        float a = DEC(acc[i]), x = DEC(s[i]);                                 \
                        if (x < a || x != x) acc[i] = s[i];                                   \
                    }                                                                         \
                    break;                                                                    \
                case LB_R_PREMULSUM:                                                          \
                    memcpy(&scs, &scalars[r], sizeof(S));                                     \
                    sc = DEC(scs);                                                            \
                    for (size_t i = 0; i < m; i++)                                            \
                        acc[i] = ENC(DEC(acc[i]) + DEC(ENC(DEC(s[i]) * sc)));                 \
                    break;                                                                    \
                default:                                                                      \
                    break;                                                                    \
                }                                                                             \
            }                                                                                 \
            store2(d1, d2, b * sizeof(S), acc, m * sizeof(S));                                \
        }                                                                                     \
    }

LB_DEF_SMALL(f16, uint16_t, half2f, f2half)
LB_DEF_SMALL(bf16, uint16_t, bf162f, f2bf16)
LB_DEF_SMALL(e4m3, uint8_t, e4m32f, f2e4m3)
LB_DEF_SMALL(e5m2, uint8_t, e5m22f, f2e5m2)

typedef void (*red_fn)(const struct lb_redop *, const uint64_t *, void *, void *,
                       const void *const *, int, size_t);

static const red_fn k_red[12] = {red_i8,  red_u8,  red_i32, red_u32,  red_i64,  red_u64,
                                 red_f16, red_f32, red_f64, red_bf16, red_e4m3, red_e5m2};

void lb_reduce(int dtype, const struct lb_redop *op, const uint64_t *scalars, void *dst1,
               void *dst2, const void *const *srcs, int nsrc, size_t n) {
    if (n == 0 || (!dst1 && !dst2)) return;
    k_red[dtype](op, scalars, dst1, dst2, srcs, nsrc, n);
}
