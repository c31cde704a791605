/* streamd's CPU decode glue: the work between a decoder layer's four matmuls, in one call each.
 *
 * On the CPU a one-stream decode step is bound by operator calls, not by the weights: ~45 torch operators a
 * layer at ~3 us each cost more than the layer's int4 matmuls (benchmarks/NOTES.md, "Issue 25, one stream").
 * Here each stretch between two matmuls is one C call over raw float32 / bfloat16 rows: residual add + RMSNorm,
 * rotary + K/V store + paged attention, SiLU-and-mul; and where a layer's four matmuls all run in
 * `int4_matmul.c`, the whole layer as one call (`decode_layer`). Otherwise the matmuls are torch's, called from
 * Python between these (`engine/worker/native_decode.py`). Arithmetic follows transformers' in float32, in its
 * order, with no fused multiply-adds (built with -ffp-contract=off); sums are taken in 8 lanes, so they round
 * differently from torch's in the last bits. The exception is the attention on AVX-512 (`attend_chunked16`):
 * fused multiply-adds in 16 lanes, its own exp, the softmax taken per 64-position chunk and merged.
 * Plain C99, no torch headers: it builds in a second with the system's C compiler.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"

#define LANES 8

static inline float dot(const float *a, const float *b, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += acc[j];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* residual[r] += delta[r] (bfloat16, a row stride apart; NULL: nothing to add), then
 * out[r] = weight * (residual[r] * rsqrt(mean(residual[r]^2) + eps)), as bfloat16 (out_bf16) or float32 (out_f32). */
void add_rmsnorm(int rows, int dim, float *residual, const uint16_t *delta, int64_t delta_stride, const float *weight,
                 float eps, uint16_t *out_bf16, float *out_f32) {
    for (int r = 0; r < rows; r++) {
        float *x = residual + (int64_t)r * dim;
        if (delta != NULL) {
            const uint16_t *d = delta + (int64_t)r * delta_stride;
            for (int i = 0; i < dim; i++) x[i] = x[i] + bf16_to_f32(d[i]);
        }
        float inv = 1.0f / sqrtf(dot(x, x, dim) / (float)dim + eps);
        for (int i = 0; i < dim; i++) {
            float y = weight[i] * (x[i] * inv);
            if (out_bf16 != NULL) out_bf16[(int64_t)r * dim + i] = f32_to_bf16(y);
            if (out_f32 != NULL) out_f32[(int64_t)r * dim + i] = y;
        }
    }
}

/* out[r] = silu(gate) * up of gate_up[r] = (gate, up) [2 * inter] bfloat16, as bfloat16. */
void silu_and_mul(int rows, int inter, const uint16_t *gate_up, int64_t stride, uint16_t *out) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (int64_t)r * stride;
        for (int i = 0; i < inter; i++) {
            float x = bf16_to_f32(g[i]);
            float silu = x / (1.0f + expf(-x));
            out[(int64_t)r * inter + i] = f32_to_bf16(silu * bf16_to_f32(g[inter + i]));
        }
    }
}

/* transformers' rotary on one head: x * cos + rotate_half(x) * sin. */
static void rotate(const uint16_t *src, const float *cos, const float *sin, int head_dim, float *dst) {
    int half = head_dim / 2;
    for (int i = 0; i < head_dim; i++) {
        float x = bf16_to_f32(src[i]);
        float other = i < half ? -bf16_to_f32(src[i + half]) : bf16_to_f32(src[i - half]);
        dst[i] = x * cos[i] + other * sin[i];
    }
}

/* The pool: float32 rows, or (an 8-bit pool, `scales` set) int8 codes with one float32 scale a row, the codes
 * round(x / scale) with scale = max(absmax / 127, 1e-12), rounded half away from zero (`layout.quantize_rows`).
 * Strides in elements of (block, layer, k|v, head, offset), of the codes or floats and of the scales. */
typedef struct {
    void *base;
    int64_t block, layer, kv, head, offset;
    float *scales;
    int64_t s_block, s_layer, s_kv, s_head, s_offset;
} Pool;

static inline int64_t at(const Pool *p, int64_t block, int layer, int kv, int head, int64_t offset) {
    return block * p->block + layer * p->layer + kv * p->kv + head * p->head + offset * p->offset;
}

static inline float *scale_at(const Pool *p, int64_t block, int layer, int kv, int head, int64_t offset) {
    return p->scales + block * p->s_block + layer * p->s_layer + kv * p->s_kv + head * p->s_head + offset * p->s_offset;
}

/* A row of the pool as float32: a float32 pool's own, or an 8-bit pool's codes times their scale in `tmp`. */
static inline const float *row(const Pool *p, int64_t block, int layer, int kv, int head, int64_t offset, int head_dim,
                               float *tmp) {
    if (p->scales == NULL) return (const float *)p->base + at(p, block, layer, kv, head, offset);
    const int8_t *codes = (const int8_t *)p->base + at(p, block, layer, kv, head, offset);
    float s = *scale_at(p, block, layer, kv, head, offset);
    for (int i = 0; i < head_dim; i++) tmp[i] = (float)codes[i] * s;
    return tmp;
}

/* Stores x [head_dim] as a row: as it is, or quantized as the 8-bit kernels' store quantizes it. */
static void store_row(const Pool *p, int64_t block, int layer, int kv, int head, int64_t offset, const float *x,
                      int head_dim) {
    if (p->scales == NULL) {
        memcpy((float *)p->base + at(p, block, layer, kv, head, offset), x, sizeof(float) * (size_t)head_dim);
        return;
    }
    float most = 0.0f;
    for (int i = 0; i < head_dim; i++) most = fabsf(x[i]) > most ? fabsf(x[i]) : most;
    float s = most / 127.0f > 1e-12f ? most / 127.0f : 1e-12f;
    int8_t *codes = (int8_t *)p->base + at(p, block, layer, kv, head, offset);
    for (int i = 0; i < head_dim; i++) {
        float y = x[i] / s;
        y = y >= 0.0f ? y + 0.5f : y - 0.5f;
        y = y > 127.0f ? 127.0f : (y < -127.0f ? -127.0f : y);
        codes[i] = (int8_t)y; /* truncates toward zero */
    }
    *scale_at(p, block, layer, kv, head, offset) = s;
}

/* The `group` query heads that share KV head `kv_head` (GQA), over positions [0, len): each K and V row is read
 * once for the group. scratch: group x (2 head_dim + len) floats. */
static void attend_group(const Pool *p, int layer, int kv_head, int group, int head_dim, const uint16_t *q_src,
                         const float *cos, const float *sin, const int32_t *table, int page, int len, float scale,
                         float *scratch, uint16_t *out) {
    float *q = scratch, *acc = scratch + group * head_dim, *scores = scratch + 2 * group * head_dim;
    float tmp[head_dim]; /* an 8-bit pool's row, dequantized */
    for (int j = 0; j < group; j++) rotate(q_src + (int64_t)j * head_dim, cos, sin, head_dim, q + j * head_dim);
    for (int t = 0; t < len; t++) {
        const float *k = row(p, table[t / page], layer, 0, kv_head, t % page, head_dim, tmp);
        for (int j = 0; j < group; j++) scores[(int64_t)j * len + t] = dot(q + j * head_dim, k, head_dim) * scale;
    }
    for (int j = 0; j < group; j++) {
        float *sc = scores + (int64_t)j * len, top = -INFINITY, total = 0.0f;
        for (int t = 0; t < len; t++) top = sc[t] > top ? sc[t] : top;
        for (int t = 0; t < len; t++) {
            sc[t] = expf(sc[t] - top);
            total += sc[t];
        }
        for (int t = 0; t < len; t++) sc[t] /= total;
    }
    memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
    for (int t = 0; t < len; t++) {
        const float *v = row(p, table[t / page], layer, 1, kv_head, t % page, head_dim, tmp);
        for (int j = 0; j < group; j++) {
            float w = scores[(int64_t)j * len + t], *a = acc + j * head_dim;
            for (int i = 0; i < head_dim; i++) a[i] += w * v[i];
        }
    }
    for (int i = 0; i < group * head_dim; i++) out[i] = f32_to_bf16(acc[i]);
}

static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))

/* e^x of 16 lanes (x <= 0 here: scores less their maximum), as Cephes' expf: x = n ln 2 + r, e^r by a degree-7
 * polynomial, then scaled by 2^n; relative error ~1.2e-7 (libm's expf: ~0.5 ulp). Below -87.3 it gives ~1e-38. */
AVX512 static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.33654f), x); /* (a NaN score stays NaN, as with expf) */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* Lanes [t, t + 16) of a row of `len` (the tail masked). */
static inline __mmask16 lanes(int t, int len) { return len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1); }

/* Positions per attention task: a (row, KV head)'s context is split into chunks of CHUNK, so that two threads
 * share even one sequence's three KV heads (a split that depends on the length alone: a verify's rows and a
 * decode step's compute a position's attention alike). */
#define CHUNK 64

/* The pool's blocks lie a layer's worth of rows apart, and hardware prefetchers stop at a 4 KiB page: each
 * block's rows would arrive cold. A chunk's K and V rows (and an 8-bit pool's scales) are all asked for when its
 * task starts, the keys into L1 and the values, used after the scores, into L2: a row takes less work than a
 * trip to memory, most of all an 8-bit row. */
static inline void fetch(const char *at, int to_l1) {
    if (to_l1)
        _mm_prefetch(at, _MM_HINT_T0);
    else
        _mm_prefetch(at, _MM_HINT_T1);
}

static inline void fetch_chunk(const Pool *p, const int32_t *table, int page, int layer, int kv, int head, int first,
                               int count, int head_dim, int to_l1) {
    int elem = p->scales == NULL ? (int)sizeof(float) : 1;
    for (int t = 0; t < count; t++) {
        int pos = first + t;
        const char *start = (const char *)p->base + at(p, table[pos / page], layer, kv, head, pos % page) * elem;
        for (int i = 0; i < head_dim * elem; i += 64) fetch(start + i, to_l1);
        if (p->scales != NULL && (t == 0 || pos % page == 0))
            fetch((const char *)scale_at(p, table[pos / page], layer, kv, head, pos % page), to_l1);
    }
}

/* A chunk's K or V rows as float32: a float32 pool's own, or an 8-bit pool's dequantized into `tile` [count,
 * head_dim] (16 codes a vector: sign-extended, converted, times the row's scale). */
AVX512 static void chunk_rows(const Pool *p, const int32_t *table, int page, int layer, int kv, int head, int first,
                              int count, int head_dim, float *tile, const float **rows) {
    for (int t = 0; t < count; t++) {
        int pos = first + t;
        int64_t i0 = at(p, table[pos / page], layer, kv, head, pos % page);
        if (p->scales == NULL) {
            rows[t] = (const float *)p->base + i0;
            continue;
        }
        const int8_t *codes = (const int8_t *)p->base + i0;
        __m512 s = _mm512_set1_ps(*scale_at(p, table[pos / page], layer, kv, head, pos % page));
        float *dst = tile + (int64_t)t * head_dim;
        for (int d = 0; d < head_dim; d += 16) {
            __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + d)));
            _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(wide), s));
        }
        rows[t] = dst;
    }
}

/* s[j * count + t] = scale q_j . k_t for the chunk's `count` positions whose K rows are `k`, each row read once for
 * the group. Each score's products are summed in 16 lanes and then across them, the order decode steps have always
 * summed them in: the default model's greedy tokens keep breaking its head's exact bfloat16 ties as before (a
 * transposing sum of 16 scores at once was ~1.3x faster for a verify's rows and broke some the other way). */
AVX512 static void chunk_scores(const float *const *k, int count, int group, int head_dim, const float *q,
                                float scale, float *s) {
    for (int t = 0; t < count; t++)
        for (int j = 0; j < group; j++) {
            __m512 dot16 = _mm512_setzero_ps();
            for (int d = 0; d < head_dim; d += 16)
                dot16 = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * head_dim + d), _mm512_loadu_ps(k[t] + d), dot16);
            s[j * count + t] = _mm512_reduce_add_ps(dot16) * scale;
        }
}

/* One chunk [first, first + count) of a (row, KV head)'s positions for its `group` rotated query heads q: per
 * head j, part[j] = (sum over the chunk of e^(s - m) v [head_dim], m, sum of e^(s - m)) with s = scale q . k and
 * m the chunk's largest s. scores: group x count floats. The values accumulate in registers, 16 of a head's
 * dimensions at a time over the chunk's V rows (read from L1 after the first head). */
AVX512 static void attend_chunk16(const Pool *p, int layer, int kv_head, int group, int head_dim, const float *q,
                                  const int32_t *table, int page, int first, int count, float scale, float *scores,
                                  float *tile, float *part) {
    int width = head_dim + 2;
    const float *rows[CHUNK];
    fetch_chunk(p, table, page, layer, 0, kv_head, first, count, head_dim, 1);
    fetch_chunk(p, table, page, layer, 1, kv_head, first, count, head_dim, 0);
    chunk_rows(p, table, page, layer, 0, kv_head, first, count, head_dim, tile, rows);
    chunk_scores(rows, count, group, head_dim, q, scale, scores);
    for (int j = 0; j < group; j++) {
        float *sc = scores + j * count;
        __m512 top = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
        for (int t = 0; t < count; t += 16) {
            __mmask16 m = lanes(t, count);
            top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, sc + t));
        }
        float most = _mm512_reduce_max_ps(top);
        for (int t = 0; t < count; t += 16) {
            __mmask16 m = lanes(t, count);
            __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + t), _mm512_set1_ps(most)));
            total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
            _mm512_mask_storeu_ps(sc + t, m, e);
        }
        part[j * width + head_dim] = most;
        part[j * width + head_dim + 1] = _mm512_reduce_add_ps(total);
    }
    chunk_rows(p, table, page, layer, 1, kv_head, first, count, head_dim, tile, rows);
    for (int d = 0; d < head_dim; d += 16)
        for (int j = 0; j < group; j++) {
            const float *w = scores + j * count;
            __m512 acc = _mm512_setzero_ps();
            for (int t = 0; t < count; t++) acc = _mm512_fmadd_ps(_mm512_set1_ps(w[t]), _mm512_loadu_ps(rows[t] + d), acc);
            _mm512_storeu_ps(part + j * width + d, acc);
        }
}

/* A (row, KV head)'s `count` chunk parts (attend_chunk16) -> its group's attention output as bfloat16: each chunk
 * weighted by e^(m_c - M) (M: the largest m), divided by the weighted sum of the chunks' sums. sum: head_dim floats. */
AVX512 static void merge_chunks16(const float *parts, int count, int group, int head_dim, float *sum, uint16_t *out) {
    int width = head_dim + 2, stride = group * width;
    if (count == 0) { /* no position to attend over (a row of length 0): zeros, as the portable loop gives */
        memset(out, 0, sizeof(uint16_t) * (size_t)(group * head_dim));
        return;
    }
    for (int j = 0; j < group; j++) {
        const float *part = parts + j * width;
        float most = -INFINITY, total = 0.0f;
        for (int c = 0; c < count; c++) most = part[c * stride + head_dim] > most ? part[c * stride + head_dim] : most;
        memset(sum, 0, sizeof(float) * (size_t)head_dim);
        for (int c = 0; c < count; c++) {
            const float *chunk = part + c * stride;
            float w = expf(chunk[head_dim] - most);
            total += w * chunk[head_dim + 1];
            for (int d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(sum + d, _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(chunk + d),
                                                          _mm512_loadu_ps(sum + d)));
        }
        for (int d = 0; d < head_dim; d++) out[j * head_dim + d] = f32_to_bf16(sum[d] / total);
    }
}

/* The attention of every (row, KV head) on AVX-512, in chunks of CHUNK positions over `threads` threads, then
 * merged; scratch: per thread group x (head_dim + min(CHUNK, longest)) floats, which rope_store_attend's
 * `per_thread` covers. Returns -1 where memory could not be had (nothing computed). */
AVX512 static int attend_chunked16(const Pool *p, int rows, int heads, int kv_heads, int head_dim, const uint16_t *qkv,
                                   int64_t stride, const float *cos, const float *sin, int layer,
                                   const int32_t *block_tables, int table_width, const int32_t *seq_lens, int page,
                                   float scale, int threads, float *scratch, int64_t per_thread, uint16_t *out) {
    int group = heads / kv_heads, pairs = rows * kv_heads, tasks = 0;
    int *first = malloc(sizeof(int) * (size_t)(pairs + 1));
    if (first == NULL) return -1;
    for (int i = 0; i < pairs; i++) {
        first[i] = tasks;
        tasks += (seq_lens[i / kv_heads] + CHUNK - 1) / CHUNK;
    }
    first[pairs] = tasks;
    int width = group * (head_dim + 2);
    float *parts = malloc(sizeof(float) * (size_t)(tasks > 0 ? tasks : 1) * (size_t)width);
    int *pair_of = malloc(sizeof(int) * (size_t)(tasks > 0 ? tasks : 1));
    /* an 8-bit pool's chunk of dequantized rows, a thread's own */
    float *tiles = p->scales == NULL ? NULL : malloc(sizeof(float) * (size_t)threads * CHUNK * (size_t)head_dim);
    if (parts == NULL || pair_of == NULL || (p->scales != NULL && tiles == NULL)) {
        free(first), free(parts), free(pair_of), free(tiles);
        return -1;
    }
    for (int i = 0; i < pairs; i++)
        for (int t = first[i]; t < first[i + 1]; t++) pair_of[t] = i;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        float *q = scratch + per_thread * thread_id(), *scores = q + group * head_dim;
        float *tile = tiles == NULL ? NULL : tiles + (int64_t)thread_id() * CHUNK * head_dim;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; t++) {
            int i = pair_of[t], r = i / kv_heads, g = i % kv_heads, chunk = t - first[i];
            const uint16_t *src = qkv + (int64_t)r * stride + (int64_t)g * group * head_dim;
            for (int j = 0; j < group; j++)
                rotate(src + (int64_t)j * head_dim, cos + (int64_t)r * head_dim, sin + (int64_t)r * head_dim,
                       head_dim, q + j * head_dim);
            int from = chunk * CHUNK, count = seq_lens[r] - from < CHUNK ? seq_lens[r] - from : CHUNK;
            attend_chunk16(p, layer, g, group, head_dim, q, block_tables + (int64_t)r * table_width, page, from,
                           count, scale, scores, tile, parts + (int64_t)t * width);
        }
#pragma omp for schedule(static)
        for (int i = 0; i < pairs; i++) {
            int64_t at = (int64_t)(i / kv_heads) * heads * head_dim + (int64_t)(i % kv_heads) * group * head_dim;
            merge_chunks16(parts + (int64_t)first[i] * width, first[i + 1] - first[i], group, head_dim, q, out + at);
        }
    }
    free(first), free(parts), free(pair_of), free(tiles);
    return 0;
}

static int portable_only; /* set by `attention_portable` (tests run both loops on one machine) */

static int avx512(void) {
    __builtin_cpu_init();
    return !portable_only && __builtin_cpu_supports("avx512f");
}
#else
static int portable_only;
static int avx512(void) { return 0; }
#endif

/* 1: every later attention takes the portable loop, even where AVX-512 would run (for tests); 0: the default.
 * Returns whether the AVX-512 loop runs from now on (for a head_dim of whole 16-lane vectors). */
int attention_portable(int on) {
    portable_only = on;
    return avx512();
}

/* One decode step's attention for `rows` sequences of one token each, in `layer`: q and k of qkv [rows, stride]
 * bfloat16 ((heads + 2 kv_heads) x head_dim: q, k, v) rotated by cos/sin [rows, head_dim]; k and v stored at
 * slots[r]; the query attends over positions [0, seq_lens[r]) through block_tables [rows, table_width]; the result
 * [rows, heads x head_dim] as bfloat16. Every row's K/V is stored first (a row's new token lives in its own
 * sequence's block, which no other row reads), then the (row, KV head) pairs attend on up to `threads` OpenMP
 * threads, each in its part of `scratch`: threads x (heads / kv_heads) x (2 head_dim + max(seq_lens)) floats. The
 * pool holds float32 rows (`pool_scales` NULL) or int8 codes with a float32 scale a row at `pool_scales`
 * (`Pool`); strides in elements, (block, layer, k|v, head, offset). */
void rope_store_attend(int rows, int heads, int kv_heads, int head_dim, const uint16_t *qkv, int64_t stride,
                       const float *cos, const float *sin, void *pool_base, const int64_t *pool_strides,
                       float *pool_scales, const int64_t *scale_strides, int layer, const int64_t *slots,
                       const int32_t *block_tables, int table_width, const int32_t *seq_lens, int page, float scale,
                       int threads, float *scratch, uint16_t *out) {
    const int64_t *ss = pool_scales == NULL ? pool_strides : scale_strides;
    Pool p = {pool_base,   pool_strides[0], pool_strides[1], pool_strides[2], pool_strides[3], pool_strides[4],
              pool_scales, ss[0],           ss[1],           ss[2],           ss[3],           ss[4]};
    int group = heads / kv_heads, longest = 0;
    float x[head_dim];
    for (int r = 0; r < rows; r++) {
        const uint16_t *src = qkv + (int64_t)r * stride;
        const float *c = cos + (int64_t)r * head_dim, *s = sin + (int64_t)r * head_dim;
        int64_t block = slots[r] / page, offset = slots[r] % page;
        for (int h = 0; h < kv_heads && slots[r] >= 0; h++) { /* slot -1: not stored (padding) */
            rotate(src + (int64_t)(heads + h) * head_dim, c, s, head_dim, x);
            store_row(&p, block, layer, 0, h, offset, x, head_dim);
            for (int i = 0; i < head_dim; i++) x[i] = bf16_to_f32(src[(int64_t)(heads + kv_heads + h) * head_dim + i]);
            store_row(&p, block, layer, 1, h, offset, x, head_dim);
        }
        longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    }
    int64_t per_thread = (int64_t)group * (2 * head_dim + longest);
#if defined(__x86_64__) && defined(__GNUC__)
    if (head_dim % 16 == 0 && avx512() &&
        attend_chunked16(&p, rows, heads, kv_heads, head_dim, qkv, stride, cos, sin, layer, block_tables, table_width,
                         seq_lens, page, scale, threads, scratch, per_thread, out) == 0)
        return;
#endif
    int tasks = rows * kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
    for (int task = 0; task < tasks; task++) {
        int r = task / kv_heads, g = task % kv_heads;
        const uint16_t *src = qkv + (int64_t)r * stride;
        const float *c = cos + (int64_t)r * head_dim, *s = sin + (int64_t)r * head_dim;
        attend_group(&p, layer, g, group, head_dim, src + (int64_t)g * group * head_dim, c, s,
                     block_tables + (int64_t)r * table_width, page, seq_lens[r], scale,
                     scratch + per_thread * thread_id(),
                     out + (int64_t)r * heads * head_dim + (int64_t)g * group * head_dim);
    }
}

/* Where row r's codes start in torch's packed int4 CPU layout (see `lowbit._codes_t`), their byte stride and
 * nibble. Rows come in blocks of `block`, each stored as [width, block / 2] bytes (low nibble row j, high nibble
 * row j + block / 2); a last block of fewer rows stores rows 2j (low) and 2j + 1 (high), [width, tail / 2] bytes. */
static const uint8_t *codes_of(const uint8_t *packed, int64_t width, int64_t rows, int block, int64_t r, int64_t *step,
                               int *shift) {
    int64_t full = rows / block * block, half = block / 2;
    if (r < full) {
        *step = half;
        *shift = (r % block) >= half ? 4 : 0;
        return packed + (r / block) * width * half + (r % block) % half;
    }
    *step = (rows - full) / 2;
    *shift = ((r - full) % 2) * 4;
    return packed + full * width / 2 + (r - full) / 2;
}

/* Rows `ids` [n] of a packed int4 weight: codes uint8 [n, in_features]. */
void int4_rows(const uint8_t *packed, int64_t width, int64_t rows, int block, const int64_t *ids, int n,
               int in_features, uint8_t *out) {
    for (int k = 0; k < n; k++) {
        int64_t step;
        int shift;
        const uint8_t *src = codes_of(packed, width, rows, block, ids[k], &step, &shift);
        for (int c = 0; c < in_features; c++) out[(int64_t)k * in_features + c] = (src[c * step] >> shift) & 15;
    }
}

/* Rows `ids` [n] of a tied embedding table whose codes are its head's packed int4 weight (`quantized.PackedTable`),
 * dequantized to float32 [n, in_features] as the file's table gives them: one part (4-bit), w = (q - 8) s + z;
 * two parts (a Q8_0 weight's high and low halves), q = 16 (hi - 8) + lo and w = q s. scales and zeros: float32
 * [rows, in_features / group]. Returns -1 (nothing written) where an id is outside [0, valid) (`rows` counts the
 * packing's padding rows too). */
int table_rows(const uint8_t *const *packed, int parts, int64_t width, int64_t rows, int block, const int64_t *ids,
               int n, int64_t valid, int in_features, const float *scales, const float *zeros, int group, float *out) {
    if (parts != 1 && parts != 2) return -1;
    if (parts == 1 && zeros == NULL) return -1;
    for (int k = 0; k < n; k++)
        if (ids[k] < 0 || ids[k] >= valid) return -1;
    int64_t groups = in_features / group;
    for (int k = 0; k < n; k++) {
        int64_t step[2], r = ids[k];
        int shift[2];
        const uint8_t *src[2];
        for (int p = 0; p < parts; p++) src[p] = codes_of(packed[p], width, rows, block, r, &step[p], &shift[p]);
        for (int c = 0; c < in_features; c++) {
            int q = (src[0][c * step[0]] >> shift[0]) & 15;
            float s = scales[r * groups + c / group];
            float w;
            if (parts == 2)
                w = (float)(16 * (q - 8) + ((src[1][c * step[1]] >> shift[1]) & 15)) * s;
            else
                w = ((float)q - 8.0f) * s + zeros[r * groups + c / group];
            out[(int64_t)k * in_features + c] = w;
        }
    }
    return 0;
}

/* One whole decoder layer of a decode step, for a model whose four matmuls all run in `int4_matmul.c`: the
 * Python loop's seven calls a layer (`native_decode.NativeDecode.run`) as one, with the same arithmetic in the
 * same order. The structs mirror `native_decode`'s ctypes Structures field for field. */
typedef struct {
    const uint8_t *const *packed;
    const uint16_t *const *scales;
    int parts, group;
    int64_t in_features, out_features;
} Int4Args;

typedef struct {
    Int4Args qkv, o, gate_up, down;
    const float *post_norm;
    float post_eps, scale;
    int heads, kv_heads, head_dim, index, intermediate;
} LayerArgs;

typedef struct {
    int rows, dim, threads, table_width, page;
    const float *cos, *sin;
    void *pool;
    const int64_t *pool_strides;
    float *pool_scales;
    const int64_t *scale_strides, *slots;
    const int32_t *block_tables, *seq_lens;
    float *scratch, *residual;
    uint16_t *x, *qkv, *attn, *o, *gate_up, *act, *down;
} StepArgs;

int int4_matmul(const uint8_t *const *packed, const uint16_t *const *sz, int parts, int group, int64_t in_features,
                int64_t rows, const uint16_t *x, int n, uint16_t *out, int threads);

static int matmul(const Int4Args *w, const uint16_t *x, int rows, uint16_t *out, int threads) {
    return int4_matmul(w->packed, w->scales, w->parts, w->group, w->in_features, w->out_features, x, rows, out,
                       threads);
}

/* x (the layer's normed input, bfloat16) -> the residual stream updated by attention and MLP, and x the next
 * norm's output (`next_norm`; the last layer writes the final norm's float32 output to `final_out` instead).
 * Returns 0, or -1 where a matmul found no memory for its scratch. */
int decode_layer(const LayerArgs *l, const StepArgs *s, const float *next_norm, float next_eps, float *final_out) {
    int rows = s->rows, dim = s->dim, t = s->threads;
    if (matmul(&l->qkv, s->x, rows, s->qkv, t)) return -1;
    rope_store_attend(rows, l->heads, l->kv_heads, l->head_dim, s->qkv, l->qkv.out_features, s->cos, s->sin, s->pool,
                      s->pool_strides, s->pool_scales, s->scale_strides, l->index, s->slots, s->block_tables,
                      s->table_width, s->seq_lens, s->page, l->scale, t, s->scratch, s->attn);
    if (matmul(&l->o, s->attn, rows, s->o, t)) return -1;
    add_rmsnorm(rows, dim, s->residual, s->o, dim, l->post_norm, l->post_eps, s->x, NULL);
    if (matmul(&l->gate_up, s->x, rows, s->gate_up, t)) return -1;
    silu_and_mul(rows, l->intermediate, s->gate_up, l->gate_up.out_features, s->act);
    if (matmul(&l->down, s->act, rows, s->down, t)) return -1;
    add_rmsnorm(rows, dim, s->residual, s->down, dim, next_norm, next_eps, final_out ? NULL : s->x, final_out);
    return 0;
}
