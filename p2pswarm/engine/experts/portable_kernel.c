/* The portable expert kernel: the same bits on every ISA (x86-64, aarch64, ...).
 *
 * Why: ggml's SIMD code sums in an order that depends on the ISA (AVX2, AVX-512, NEON), so an
 * aarch64 phone and an x86-64 backbone running ggml disagree in the last bits. Here every result
 * is defined by integer arithmetic (exact, any order) plus a fixed sequence of IEEE float32
 * operations, each rounded on its own:
 *
 *   - build with -ffp-contract=off (no fused multiply-add: GCC on aarch64 contracts by default)
 *     and never -ffast-math; vectorisation is allowed, it never reorders float operations;
 *   - activations are quantised to int8 blocks exactly as ggml's reference quantize_row_q8_K
 *     (block of 256 for K-quants, of 32 for Q8_0), scale kept in float32;
 *   - block dot products are integer (weights unpacked to int16 times their sub-block scale);
 *   - a row's result is its block results added in block order, in float32;
 *   - F32/F16 weights: 8 float32 lanes over the row, then ((0+1)+(2+3))+((4+5)+(6+7));
 *   - silu uses our own exp (double precision, fixed polynomial), not libm's.
 *
 * The numpy code in portable_kernel.py computes the same operations in the same order; the tests
 * check the two agree bit for bit, and that an aarch64 build (under qemu) agrees with both.
 * Weights are read in place (pointers into the memory-mapped GGUF): no copy.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PK_VERSION 1

enum { T_F32 = 0, T_F16 = 1, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

int pk_version(void) { return PK_VERSION; }

#if defined(__F16C__) && !defined(PK_SCALAR)
#include <immintrin.h>
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); } /* exact, like the C below */
#else
static float f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        if (m == 0) {
            bits = s;
        } else {
            int sh = 0;
            while (!(m & 0x400)) { m <<= 1; sh++; }
            bits = s | ((uint32_t)(113 - sh) << 23) | ((m & 0x3ff) << 13);
        }
    } else if (e == 31) {
        bits = s | 0x7f800000u | (m << 13);
    } else {
        bits = s | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int32_t i;
    memcpy(&i, &val, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* Bytes of the activation buffer for n rows of k values (the parts q_parts lists). */
int64_t pk_qsize(int64_t n, int64_t k, int64_t block) {
    return 3 * n * k + n * (k / block) * 4 + n * (k / 16) * 6 + n * (k / 32) * 2 + 128;
}

/* The values twice, block-major (a block of every row contiguous): int16 qs (the batched path's
 * int16 x int16 products) and int8 q8 (the row path's byte products); the scales d; the sums over
 * 16 values as int32 s16 and int16 h16, and over 32 values as int16 h32 (row-major). */
static void q_parts(void *buf, int64_t n, int64_t k, int64_t block, int16_t **qs, float **d, int32_t **s16,
                    int8_t **q8, int16_t **h16, int16_t **h32) {
    uint8_t *b = (uint8_t *)buf;
    *qs = (int16_t *)b;
    int64_t off = (2 * n * k + 15) & ~(int64_t)15;
    *d = (float *)(b + off);
    off += n * (k / block) * 4;
    *s16 = (int32_t *)(b + off);
    off += n * (k / 16) * 4;
    *h16 = (int16_t *)(b + off);
    off += n * (k / 16) * 2;
    *h32 = (int16_t *)(b + off);
    off += n * (k / 32) * 2;
    *q8 = (int8_t *)(b + ((off + 31) & ~(int64_t)31));
}

/* x (n, k) float32 -> int8-valued blocks of `block` values (ggml's quantize_row_q8_K_ref, any block). */
void pk_quantize(const float *x, int64_t n, int64_t k, int64_t block, void *buf) {
    int16_t *qs, *h16, *h32; float *d; int32_t *s16; int8_t *q8;
    q_parts(buf, n, k, block, &qs, &d, &s16, &q8, &h16, &h32);
    int64_t nb = k / block;
    for (int64_t i = 0; i < n; i++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + i * k + b * block;
            int16_t *q = qs + (b * n + i) * block; /* block-major: a block of every row is contiguous */
            float amax = 0.f, max = 0.f;
            for (int64_t j = 0; j < block; j++) {
                float ax = fabsf(xb[j]);
                if (ax > amax) { amax = ax; max = xb[j]; }
            }
            if (amax == 0.f) {
                d[i * nb + b] = 0.f;
                for (int64_t j = 0; j < block; j++) q[j] = 0;
            } else {
                const float iscale = -127.f / max;
                for (int64_t j = 0; j < block; j++) {
                    int v = nearest_int(iscale * xb[j]);
                    q[j] = (int16_t)(v < 127 ? v : 127);
                }
                d[i * nb + b] = 1.f / iscale;
            }
            for (int64_t j = 0; j < block; j++) q8[(b * n + i) * block + j] = (int8_t)q[j];
        }
        for (int64_t j = 0; j < k / 16; j++) {
            const int16_t *q = qs + ((j * 16 / block) * n + i) * block + (j * 16) % block;
            int32_t s = 0;
            for (int l = 0; l < 16; l++) s += q[l];
            s16[i * (k / 16) + j] = s;
            h16[i * (k / 16) + j] = (int16_t)s;
        }
        for (int64_t j = 0; j < k / 32; j++)
            h32[i * (k / 32) + j] = (int16_t)(h16[i * (k / 16) + 2 * j] + h16[i * (k / 16) + 2 * j + 1]);
    }
}

/* One weight block unpacked to int16 values already multiplied by their sub-block scale, so a
 * block's integer dot product is one sum over its values (exact: |w| <= 945 for Q4_K, 4096 for
 * Q6_K, 128 for Q8_0, and |sum| < 2^31). */
typedef struct {
    int16_t w[256];
    int32_t mn[8];
    float d, dmin;
} wblock;

static void unpack_q4_k(const uint8_t *blk, wblock *w) {
    w->d = f16_to_f32(rd16(blk));
    w->dmin = f16_to_f32(rd16(blk + 2));
    const uint8_t *s = blk + 4, *q = blk + 16;
    int16_t sc[8];
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = s[j] & 63;
            w->mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (int16_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
            w->mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
    for (int c = 0; c < 4; c++) {
        const int16_t lo = sc[2 * c], hi = sc[2 * c + 1];
        for (int l = 0; l < 32; l++) {
            w->w[64 * c + l] = (int16_t)((q[32 * c + l] & 0xF) * lo);
            w->w[64 * c + 32 + l] = (int16_t)((q[32 * c + l] >> 4) * hi);
        }
    }
}

static void unpack_q6_k(const uint8_t *blk, wblock *w) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *sc = (const int8_t *)(blk + 192);
    w->d = f16_to_f32(rd16(blk + 208));
    uint8_t u[256];
    for (int h = 0; h < 2; h++) {
        const uint8_t *L = ql + 64 * h, *H = qh + 32 * h;
        uint8_t *o = u + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (uint8_t)((L[l] & 0xF) | ((H[l] & 3) << 4));
            o[l + 32] = (uint8_t)((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4));
            o[l + 64] = (uint8_t)((L[l] >> 4) | (((H[l] >> 4) & 3) << 4));
            o[l + 96] = (uint8_t)((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4));
        }
    }
    for (int j = 0; j < 16; j++) { /* value k has scale sc[k / 16] */
        const int16_t s = sc[j];
        for (int l = 0; l < 16; l++) w->w[16 * j + l] = (int16_t)(((int16_t)u[16 * j + l] - 32) * s);
    }
}

static int64_t row_bytes(int wtype, int64_t k) {
    switch (wtype) {
    case T_F32: return 4 * k;
    case T_F16: return 2 * k;
    case T_Q8_0: return k / 32 * 34;
    case T_Q4_K: return k / 256 * 144;
    case T_Q6_K: return k / 256 * 210;
    default: return -1;
    }
}

static float dot_float(const float *x, const uint8_t *wrow, int wtype, int64_t k) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (wtype == T_F32) {
        const float *w = (const float *)wrow;
        for (int64_t c = 0; c < k; c += 8)
            for (int l = 0; l < 8; l++) {
                float p = x[c + l] * w[c + l];
                lane[l] = lane[l] + p;
            }
    } else {
        for (int64_t c = 0; c < k; c += 8)
            for (int l = 0; l < 8; l++) {
                float p = x[c + l] * f16_to_f32(rd16(wrow + 2 * (c + l)));
                lane[l] = lane[l] + p;
            }
    }
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

#define RB 4 /* weight rows unpacked together: each activation load feeds RB dot products */

static inline void dot4_256(const wblock *wb, const int16_t *a, int32_t s[RB]) {
    int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int l = 0; l < 256; l++) {
        const int32_t x = a[l];
        s0 += wb[0].w[l] * x;
        s1 += wb[1].w[l] * x;
        s2 += wb[2].w[l] * x;
        s3 += wb[3].w[l] * x;
    }
    s[0] = s0; s[1] = s1; s[2] = s2; s[3] = s3;
}

static inline int32_t dot_256(const int16_t *w, const int16_t *a, int len) {
    int32_t s = 0;
    for (int l = 0; l < len; l++) s += w[l] * (int32_t)a[l];
    return s;
}

/* ---- the row path (few activation rows: decode) ---------------------------------------------------
 * Each block's integer dot products are computed straight from the packed weight bytes and the int8
 * activations (no unpacked copy), vectorised where the ISA allows: AVX2 intrinsics on x86-64, plain
 * C loops elsewhere (which the compiler vectorises: NEON on aarch64), and plain C everywhere under
 * -DPK_SCALAR. Integer sums are exact in any order and never overflow (an AVX2 int16 pair sum is at
 * most 2*63*128 < 2^15, a block's sum < 2^31), so every variant gives the batched path's integers;
 * the float32 steps (matmul_rows) are the batched path's, in the same order, one rounding each.
 *
 * q4k_block: sumi = sum_l sc[l/32] q4(l) a(l) and summ = sum_j mn[j] (a's sum over sub-block j);
 * q6k_block: sumi = sum_l sc[l/16] (u6(l) - 32) a(l); q8_dot: sum_l w(l) a(l) over 32 values.
 * a16/a32: the activation block's sums over 16 and 32 values, int16 (|sum| <= 32*127). */
#define ROW_PATH_MAX_N 8

/* The 8 six-bit scales and mins of a Q4_K block (12 bytes at s). */
static inline void q4k_scales(const uint8_t *s, int16_t sc[8], int32_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (int16_t)((s[j + 8] & 0xF) | ((s[j] >> 6) << 4));
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

#if defined(__AVX2__) && !defined(PK_SCALAR)
#include <immintrin.h>
#define PK_SIMD "avx2"
static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
static inline int32_t hsum4(__m128i s) {
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
/* bytes {2j, 2j+1} repeated: broadcast int16 element j within each 128-bit lane */
static const uint8_t k_pick16[8][32] = {
#define PICK(j) {2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, \
                 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1}
    PICK(0), PICK(1), PICK(2), PICK(3), PICK(4), PICK(5), PICK(6), PICK(7)
#undef PICK
};
/* bytes 8 x g then 8 x (g+1): int8 scales g and g+1, for _mm256_cvtepi8_epi16 */
static const uint8_t k_pick8[8][16] = {
#define PICK(g) {2*g, 2*g, 2*g, 2*g, 2*g, 2*g, 2*g, 2*g, 2*g+1, 2*g+1, 2*g+1, 2*g+1, 2*g+1, 2*g+1, 2*g+1, 2*g+1}
    PICK(0), PICK(1), PICK(2), PICK(3), PICK(4), PICK(5), PICK(6), PICK(7)
#undef PICK
};
static inline void q4k_block(const uint8_t *blk, const int8_t *a, const int16_t *a16, const int16_t *a32,
                             int32_t *sumi, int32_t *summ) {
    (void)a16;
    uint32_t u[4];
    memcpy(u, blk + 4, 12);  /* the layout q4k_scales decodes, four bytes at a time (ggml's masks) */
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t mn03 = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mn03;
    u[0] &= 0x3f3f3f3fu;
    const __m256i ms = _mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));
    *summ = hsum4(_mm_madd_epi16(_mm256_extracti128_si256(ms, 1), _mm_loadu_si128((const __m128i *)a32)));
    const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(ms));
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const uint8_t *q = blk + 16;
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
        const __m256i lo = _mm256_and_si256(qv, m4), hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4);
        const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(a + 64 * c)));
        const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(a + 64 * c + 32)));
        const __m256i slo = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)k_pick16[2 * c]));
        const __m256i shi = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)k_pick16[2 * c + 1]));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(plo, slo));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(phi, shi));
    }
    *sumi = hsum8(acc);
}
static inline int32_t q6k_block(const uint8_t *blk, const int8_t *a, const int16_t *a16) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
    const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(3);
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i L0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        const __m256i L1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        const __m256i H = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m256i u[4];
        u[0] = _mm256_or_si256(_mm256_and_si256(L0, m4), _mm256_slli_epi16(_mm256_and_si256(H, m3), 4));
        u[1] = _mm256_or_si256(_mm256_and_si256(L1, m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), m3), 4));
        u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), m3), 4));
        u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), m3), 4));
        for (int t = 0; t < 4; t++) {
            const int g = 4 * h + t; /* values 32g .. 32g+31, scales 2g and 2g+1 */
            const __m256i p = _mm256_maddubs_epi16(u[t], _mm256_loadu_si256((const __m256i *)(a + 32 * g)));
            const __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, _mm_loadu_si128((const __m128i *)k_pick8[g])));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
        }
    }
    /* minus 32 * sum_j sc[j] * (a's sum over values 16j .. 16j+15) */
    const __m256i off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc8), _mm256_loadu_si256((const __m256i *)a16));
    return hsum8(acc) - 32 * hsum8(off);
}
static inline int32_t q8_dot(const int8_t *w, const int8_t *a) {
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w), av = _mm256_loadu_si256((const __m256i *)a);
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
    return hsum8(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#else
#if defined(PK_SCALAR)
#define PK_SIMD "scalar"
#else
#define PK_SIMD "c"
#endif
static inline void q4k_block(const uint8_t *blk, const int8_t *a, const int16_t *a16, const int16_t *a32,
                             int32_t *sumi, int32_t *summ) {
    (void)a16;
    int16_t sc[8];
    int32_t mn[8];
    q4k_scales(blk + 4, sc, mn);
    const uint8_t *q = blk + 16;
    int32_t si = 0, sm = 0;
    for (int c = 0; c < 4; c++) {
        int32_t lo = 0, hi = 0;
        for (int l = 0; l < 32; l++) {
            lo += (int32_t)(q[32 * c + l] & 0xF) * a[64 * c + l];
            hi += (int32_t)(q[32 * c + l] >> 4) * a[64 * c + 32 + l];
        }
        si += sc[2 * c] * lo + sc[2 * c + 1] * hi;
    }
    for (int j = 0; j < 8; j++) sm += mn[j] * a32[j];
    *sumi = si;
    *summ = sm;
}
static inline int32_t q6k_block(const uint8_t *blk, const int8_t *a, const int16_t *a16) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *sc = (const int8_t *)(blk + 192);
    int32_t sumi = 0;
    for (int h = 0; h < 2; h++) {
        const uint8_t *L = ql + 64 * h, *H = qh + 32 * h;
        const int8_t *A = a + 128 * h;
        int32_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int g = 0; g < 2; g++)
            for (int l = 16 * g; l < 16 * g + 16; l++) {
                s[0 + g] += (int32_t)((L[l] & 0xF) | ((H[l] & 3) << 4)) * A[l];
                s[2 + g] += (int32_t)((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) * A[l + 32];
                s[4 + g] += (int32_t)((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) * A[l + 64];
                s[6 + g] += (int32_t)((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) * A[l + 96];
            }
        for (int j = 0; j < 8; j++) sumi += sc[8 * h + j] * (s[j] - 32 * a16[8 * h + j]);
    }
    return sumi;
}
static inline int32_t q8_dot(const int8_t *w, const int8_t *a) {
    int32_t s = 0;
    for (int l = 0; l < 32; l++) s += (int32_t)w[l] * a[l];
    return s;
}
#endif

/* Which integer code this build runs ("avx2", "c": compiler-vectorised C, "scalar": -DPK_SCALAR). */
const char *pk_simd(void) { return PK_SIMD; }

static int matmul_rows(int wtype, const uint8_t *W, int64_t rb, int64_t r0, int64_t r1, int64_t nb,
                       const int8_t *q8, const float *ad, const int16_t *h16, const int16_t *h32, int64_t n,
                       float *out, int64_t ldo) {
    const int64_t k = nb * (wtype == T_Q8_0 ? 32 : 256);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = W + r * rb;
        float acc[ROW_PATH_MAX_N] = {0.f};
        for (int64_t b = 0; b < nb; b++) {
            if (wtype == T_Q4_K) {
                const uint8_t *blk = row + b * 144;
                const float d = f16_to_f32(rd16(blk)), dmin = f16_to_f32(rd16(blk + 2));
                for (int64_t i = 0; i < n; i++) {
                    int32_t sumi, summ;
                    q4k_block(blk, q8 + (b * n + i) * 256, h16 + i * (k / 16) + b * 16, h32 + i * (k / 32) + b * 8,
                              &sumi, &summ);
                    const float da = ad[i * nb + b];
                    const float v = (d * da) * (float)sumi;
                    const float m = (dmin * da) * (float)summ;
                    acc[i] = acc[i] + (v - m);
                }
            } else if (wtype == T_Q6_K) {
                const uint8_t *blk = row + b * 210;
                const float d = f16_to_f32(rd16(blk + 208));
                for (int64_t i = 0; i < n; i++) {
                    const int32_t sumi = q6k_block(blk, q8 + (b * n + i) * 256, h16 + i * (k / 16) + b * 16);
                    acc[i] = acc[i] + (d * ad[i * nb + b]) * (float)sumi;
                }
            } else {
                const uint8_t *blk = row + b * 34;
                const float d = f16_to_f32(rd16(blk));
                for (int64_t i = 0; i < n; i++) {
                    const int32_t sumi = q8_dot((const int8_t *)(blk + 2), q8 + (b * n + i) * 32);
                    acc[i] = acc[i] + (d * ad[i * nb + b]) * (float)sumi;
                }
            }
        }
        for (int64_t i = 0; i < n; i++) out[i * ldo + r] = acc[i];
    }
    return 0;
}

/* out[i*ldo + r] = row r of W times row i of the activations, for r in [r0, r1).
 * W: `wtype` rows of k values at `w` (row r at w + r*row_bytes). `act`: float32 x for F32/F16,
 * else the buffer pk_quantize filled (block 256 for K-quants, 32 for Q8_0). Returns 0 or -1.
 * Each output is its blocks' results added in block order, whatever r0, r1 and RB. */
int pk_matmul(int wtype, const void *w, int64_t r0, int64_t r1, int64_t k, const void *act, int64_t n,
              float *out, int64_t ldo) {
    const int64_t rb = row_bytes(wtype, k);
    if (rb < 0) return -1;
    const uint8_t *W = (const uint8_t *)w;
    if (wtype == T_F32 || wtype == T_F16) {
        if (k % 8) return -1;
        const float *x = (const float *)act;
        for (int64_t r = r0; r < r1; r++)
            for (int64_t i = 0; i < n; i++) out[i * ldo + r] = dot_float(x + i * k, W + r * rb, wtype, k);
        return 0;
    }
    const int64_t block = wtype == T_Q8_0 ? 32 : 256;
    if (k % block) return -1;
    const int64_t nb = k / block;
    int16_t *qs, *h16, *h32; float *ad; int32_t *s16; int8_t *q8;
    q_parts((void *)act, n, k, block, &qs, &ad, &s16, &q8, &h16, &h32);
    if (n <= ROW_PATH_MAX_N) return matmul_rows(wtype, W, rb, r0, r1, nb, q8, ad, h16, h32, n, out, ldo);
    float *acc = (float *)malloc(sizeof(float) * (size_t)(RB * (n > 0 ? n : 1)));
    if (!acc) return -1;
    wblock wb[RB];
    for (int64_t r = r0; r < r1; r += RB) {
        const int nr = (int)(r1 - r < RB ? r1 - r : RB);
        for (int64_t j = 0; j < RB * n; j++) acc[j] = 0.f;
        if (wtype == T_Q8_0) {
            for (int t = nr; t < RB; t++) memset(&wb[t], 0, sizeof(wblock));
            for (int64_t b = 0; b < nb; b++) {
                for (int t = 0; t < nr; t++) {
                    const uint8_t *blk = W + (r + t) * rb + b * 34;
                    wb[t].d = f16_to_f32(rd16(blk));
                    for (int l = 0; l < 32; l++) wb[t].w[l] = (int8_t)blk[2 + l];
                }
                for (int64_t i = 0; i < n; i++) {
                    const int16_t *a = qs + (b * n + i) * 32;
                    const float da = ad[i * nb + b];
                    for (int t = 0; t < nr; t++) {
                        const int32_t sumi = dot_256(wb[t].w, a, 32);
                        acc[t * n + i] = acc[t * n + i] + (wb[t].d * da) * (float)sumi;
                    }
                }
            }
        } else {
            for (int t = nr; t < RB; t++) memset(&wb[t], 0, sizeof(wblock));
            for (int64_t b = 0; b < nb; b++) {
                for (int t = 0; t < nr; t++) {
                    const uint8_t *row = W + (r + t) * rb;
                    if (wtype == T_Q4_K) unpack_q4_k(row + b * 144, &wb[t]);
                    else unpack_q6_k(row + b * 210, &wb[t]);
                }
                for (int64_t i = 0; i < n; i++) {
                    const int16_t *a = qs + (b * n + i) * 256;
                    const int32_t *s = s16 + i * (k / 16) + b * 16;
                    const float da = ad[i * nb + b];
                    int32_t sumi[RB];
                    dot4_256(wb, a, sumi);
                    for (int t = 0; t < nr; t++) {
                        if (wtype == T_Q4_K) {
                            int32_t summ = 0;
                            for (int j = 0; j < 8; j++) summ += wb[t].mn[j] * (s[2 * j] + s[2 * j + 1]);
                            const float v = (wb[t].d * da) * (float)sumi[t];
                            const float m = (wb[t].dmin * da) * (float)summ;
                            acc[t * n + i] = acc[t * n + i] + (v - m);
                        } else {
                            acc[t * n + i] = acc[t * n + i] + (wb[t].d * da) * (float)sumi[t];
                        }
                    }
                }
            }
        }
        for (int t = 0; t < nr; t++)
            for (int64_t i = 0; i < n; i++) out[i * ldo + r + t] = acc[t * n + i];
    }
    free(acc);
    return 0;
}

/* exp(y) for the silu, in double precision with one fixed sequence of operations (so the same on
 * every IEEE machine): y = k ln2 + r, |r| <= ln2/2, Taylor polynomial of degree 13 by Horner. */
static double pk_exp(double y) {
    if (y > 88.0) y = 88.0;
    if (y < -104.0) y = -104.0;
    const double kf = floor(y * 1.4426950408889634 + 0.5);
    double r = y - kf * 0.693145751953125;  /* ln2 high part: 16 significant bits, kf*hi exact */
    r = r - kf * 1.4286068203094173e-06;    /* ln2 - high part */
    double p = 1.0 / 6227020800.0;
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    return ldexp(p, (int)kf);
}

/* h = silu(g) * u, elementwise, float32: s = g / (1 + (float)exp(-g)); h = s * u. */
void pk_swiglu(const float *g, const float *u, float *h, int64_t count) {
    for (int64_t j = 0; j < count; j++) {
        const float e = (float)pk_exp(-(double)g[j]);
        const float s = g[j] / (1.0f + e);
        h[j] = s * u[j];
    }
}

static int64_t act_block(int wtype) { return wtype == T_Q8_0 ? 32 : (wtype == T_Q4_K || wtype == T_Q6_K) ? 256 : 0; }

/* The activations of x (n, k) for weights of `wtype`: x itself for F32/F16, else a pk_quantize
 * buffer in *buf (malloc'ed; the caller frees it). NULL when out of memory. */
static const void *activations(int wtype, const float *x, int64_t n, int64_t k, void **buf) {
    const int64_t block = act_block(wtype);
    *buf = NULL;
    if (block == 0) return x;
    if (k % block) return NULL;
    *buf = malloc((size_t)pk_qsize(n, k, block));
    if (*buf) pk_quantize(x, n, k, block, *buf);
    return *buf;
}

/* One whole expert in one call: out (n, e) = down(silu(gate x) * (up x)) for x (n, e), gate/up
 * (ff, e) and down (e, ff) of types tg/tu/td. Exactly the steps the Python bank runs one call at a
 * time (pk_quantize, pk_matmul, pk_swiglu, in that order), so the same bits; one call saves the
 * per-call overhead that matters at decode (one row). Returns 0, or -1 (bad shape, no memory). */
int pk_expert(int tg, const void *wg, int tu, const void *wu, int td, const void *wd, int64_t ff, int64_t e,
              const float *x, int64_t n, float *out) {
    int rc = -1;
    void *bg = NULL, *bu = NULL, *bh = NULL;
    float *g = (float *)malloc(sizeof(float) * (size_t)(n * ff * 2 + 1));
    float *u = g + n * ff, *h = g;  /* h overwrites g elementwise (pk_swiglu reads g[j] first) */
    if (!g) return -1;
    const void *ag = activations(tg, x, n, e, &bg);
    const void *au = tu == tg ? ag : activations(tu, x, n, e, &bu);
    if (ag && au && pk_matmul(tg, wg, 0, ff, e, ag, n, g, ff) == 0 && pk_matmul(tu, wu, 0, ff, e, au, n, u, ff) == 0) {
        pk_swiglu(g, u, h, n * ff);
        const void *ah = activations(td, h, n, ff, &bh);
        if (ah) rc = pk_matmul(td, wd, 0, e, ff, ah, n, out, e);
    }
    free(bg);
    free(bu);
    free(bh);
    free(g);
    return rc;
}
