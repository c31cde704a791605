/* A few rows of bfloat16 activations times a packed int4 weight in torch's CPU layout, on AVX-512 BF16.
 *
 * Why: a one-stream decode step of the default model spends two thirds of its time in torch's int4 kernel
 * (`_weight_int4pack_mm_for_cpu`), which turns every code into a float32 through a lookup and a multiply-add
 * before the multiply-add that uses it (~4 weights a vector instruction). Here a code becomes a bfloat16 with one
 * bit operation: the bfloat16 whose bits are 0x4300 | q is exactly 128 + q, so a pair of codes along the input
 * is a pair of bfloat16 that `vdpbf16ps` multiplies by a pair of activations and adds into float32 (~7 weights
 * a vector instruction), reading the same packed bytes and scales as torch's kernel (benchmarks/NOTES.md,
 * "Issue 25, the int4 matmul in C").
 *
 * Arithmetic: per row r and group g, with D = sum_k x_k (128 + q_rk) and S = sum_k x_k over the group (float32),
 * out_r += s * D + (z - 136 s) * S, which is sum_k x_k ((q_rk - 8) s + z): torch's dequantization
 * w = (q - 8) * scale + zero. The products of bfloat16 are exact in float32; sums round in a different order
 * from torch's, so outputs (rounded to bfloat16, to nearest even) may differ from its kernel's in the last bit.
 *
 * Layout (lowbit._codes_t): rows in blocks of 64, each [in_features, 32] bytes, byte j of input k holding row j
 * in its low nibble and row j + 32 in its high nibble; scales_and_zeros [groups, rows, 2] bfloat16. Only whole
 * blocks of 64 rows are taken (the caller checks); rows split over OpenMP threads by blocks.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TILE 4 /* activation rows that share one unpacking of the weight */

#define TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define INLINE static inline __attribute__((always_inline))

/* One group's codes [k0, k0 + group) of a 64-row block against `tile` rows of x: acc[m][v] += pairs . x. */
TARGET INLINE void group_dots(const uint8_t *codes, const uint32_t *xpairs, int64_t xstride, int tile, int k0, int group,
                              __m512 acc[TILE][4]) {
    const __m512i low = _mm512_set1_epi16(0x000f), magic = _mm512_set1_epi16(0x4300);
    for (int k = k0; k < k0 + group; k += 2) {
        __m512i w0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + (int64_t)k * 32)));
        __m512i w1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + (int64_t)k * 32 + 32)));
        __m512i l0 = _mm512_ternarylogic_epi32(w0, low, magic, 0xea), l1 = _mm512_ternarylogic_epi32(w1, low, magic, 0xea);
        __m512i h0 = _mm512_or_si512(_mm512_srli_epi16(w0, 4), magic);
        __m512i h1 = _mm512_or_si512(_mm512_srli_epi16(w1, 4), magic);
        __m512bh p[4] = {(__m512bh)_mm512_unpacklo_epi16(l0, l1), (__m512bh)_mm512_unpackhi_epi16(l0, l1),
                         (__m512bh)_mm512_unpacklo_epi16(h0, h1), (__m512bh)_mm512_unpackhi_epi16(h0, h1)};
        for (int m = 0; m < tile; m++) {
            __m512bh x = (__m512bh)_mm512_set1_epi32((int)xpairs[m * xstride + k / 2]);
            for (int v = 0; v < 4; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], p[v], x);
        }
    }
}

/* Lane t of accumulator v holds row ROW(v, t): unpacklo takes words 0-3 of each 128-bit lane, unpackhi 4-7. */
#define ROW(v, t) ((((t) >> 2) << 3) + ((v) & 1) * 4 + ((t) & 3) + ((v) >> 1) * 32)

/* The scale s and c = z - 136 s of the block's 64 rows in accumulator order (sz: the group's [rows, 2]): each
 * 32-bit lane of sz holds a row's (scale, zero) as two bfloat16, low half first. */
TARGET static inline void group_scales(const uint16_t *sz, __m512 s[4], __m512 c[4]) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    __m512 sn[4], cn[4];
    for (int i = 0; i < 4; i++) {
        __m512i pairs = _mm512_loadu_si512((const void *)(sz + 32 * i));
        sn[i] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        cn[i] = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), sn[i], _mm512_castsi512_ps(_mm512_and_si512(pairs, top)));
    }
    for (int v = 0; v < 4; v++) {
        int half = (v >> 1) * 2;
        s[v] = _mm512_permutex2var_ps(sn[half], (v & 1) ? hi : lo, sn[half + 1]);
        c[v] = _mm512_permutex2var_ps(cn[half], (v & 1) ? hi : lo, cn[half + 1]);
    }
}

/* One 64-row block (`b`) for rows [m0, m0 + tile) of x, summed over the `parts` weights (one rounding). Inlined
 * into one copy per tile size (`block_tile`), so that each copy's accumulators stay in registers. */
TARGET INLINE void block_tile_of(const uint8_t *const *packed, const uint16_t *const *sz, int parts, int group,
                                 int64_t in_features, int64_t rows, const uint16_t *x, const float *xsums, int m0,
                                 int tile, int64_t b, uint16_t *out) {
    const uint32_t *xpairs = (const uint32_t *)(x + (int64_t)m0 * in_features);
    int64_t groups = in_features / group;
    __m512 total[TILE][4];
    for (int m = 0; m < TILE; m++)
        for (int v = 0; v < 4; v++) total[m][v] = _mm512_setzero_ps();
    for (int p = 0; p < parts; p++)
        for (int64_t g = 0; g < groups; g++) {
            __m512 acc[TILE][4], s[4], c[4];
            for (int m = 0; m < TILE; m++)
                for (int v = 0; v < 4; v++) acc[m][v] = _mm512_setzero_ps();
            group_dots(packed[p] + b * in_features * 32, xpairs, in_features / 2, tile, (int)(g * group), group, acc);
            group_scales(sz[p] + (g * rows + b * 64) * 2, s, c);
            for (int m = 0; m < tile; m++) {
                __m512 sum = _mm512_set1_ps(xsums[(int64_t)(m0 + m) * groups + g]);
                for (int v = 0; v < 4; v++)
                    total[m][v] = _mm512_fmadd_ps(c[v], sum, _mm512_fmadd_ps(s[v], acc[m][v], total[m][v]));
            }
        }
    for (int m = 0; m < tile; m++) {
        float lanes[16];
        for (int v = 0; v < 4; v++) {
            _mm512_storeu_ps(lanes, total[m][v]);
            for (int t = 0; t < 16; t++) out[(int64_t)(m0 + m) * rows + b * 64 + ROW(v, t)] = f32_to_bf16(lanes[t]);
        }
    }
}

TARGET static void block_tile(const uint8_t *const *packed, const uint16_t *const *sz, int parts, int group,
                              int64_t in_features, int64_t rows, const uint16_t *x, const float *xsums, int m0,
                              int tile, int64_t b, uint16_t *out) {
    switch (tile) {
    case 1: block_tile_of(packed, sz, parts, group, in_features, rows, x, xsums, m0, 1, b, out); break;
    case 2: block_tile_of(packed, sz, parts, group, in_features, rows, x, xsums, m0, 2, b, out); break;
    case 3: block_tile_of(packed, sz, parts, group, in_features, rows, x, xsums, m0, 3, b, out); break;
    default: block_tile_of(packed, sz, parts, group, in_features, rows, x, xsums, m0, TILE, b, out); break;
    }
}

/* out [n, rows] bfloat16 = x [n, in_features] bfloat16 @ (the sum of `parts` weights).T, each of whole 64-row
 * blocks with its own codes and scales (`packed[p]`, `sz[p]`: a Q8_0 weight's two int4 halves), summed in float32
 * and rounded once, on up to `threads` OpenMP threads. Returns 0, or -1 where scratch memory could not be had
 * (nothing written). */
TARGET int int4_matmul(const uint8_t *const *packed, const uint16_t *const *sz, int parts, int group,
                       int64_t in_features, int64_t rows, const uint16_t *x, int n, uint16_t *out, int threads) {
    int64_t groups = in_features / group;
    float *xsums = malloc(sizeof(float) * (size_t)(n * groups)); /* each group's sum of x */
    if (xsums == NULL) return -1;
    for (int m = 0; m < n; m++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int k = 0; k < group; k++) sum += bf16_to_f32(x[(int64_t)m * in_features + g * group + k]);
            xsums[(int64_t)m * groups + g] = sum;
        }
    int64_t blocks = rows / 64;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++)
        for (int m0 = 0; m0 < n; m0 += TILE)
            block_tile(packed, sz, parts, group, in_features, rows, x, xsums, m0, n - m0 < TILE ? n - m0 : TILE, b,
                       out);
    free(xsums);
    return 0;
}

int int4_matmul_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

#else
int int4_matmul(const uint8_t *const *packed, const uint16_t *const *sz, int parts, int group, int64_t in_features,
                int64_t rows, const uint16_t *x, int n, uint16_t *out, int threads) {
    (void)packed, (void)sz, (void)parts, (void)group, (void)in_features, (void)rows, (void)x, (void)n, (void)out;
    (void)threads;
    return -1;
}

int int4_matmul_available(void) { return 0; }
#endif
