/* streamd's CPU decode glue: the work between a decoder layer's four matmuls, in one call each.
 *
 * On the CPU a one-stream decode step is bound by operator calls, not by the weights: ~45 torch operators a
 * layer at ~3 us each cost more than the layer's int4 matmuls (benchmarks/NOTES.md, "Issue 25, one stream").
 * Here each stretch between two matmuls is one C call over raw float32 / bfloat16 rows: residual add + RMSNorm,
 * rotary + K/V store + paged attention, SiLU-and-mul; and where a layer's four matmuls all run in
 * `int4_matmul.c`, the whole layer as one call (`decode_layer`). Otherwise the matmuls are torch's, called from
 * Python between these (`engine/worker/native_decode.py`). Arithmetic follows transformers' in float32, in its order, with no fused multiply-adds (built
 * with -ffp-contract=off); sums are taken in 8 lanes, so they round differently from torch's in the last bits.
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

/* Where a (block, layer, k|v, head, offset) row of the pool starts. */
typedef struct {
    float *base;
    int64_t block, layer, kv, head, offset;
} Pool;

static inline float *row(const Pool *p, int64_t block, int layer, int kv, int head, int64_t offset) {
    return p->base + block * p->block + layer * p->layer + kv * p->kv + head * p->head + offset * p->offset;
}

/* The `group` query heads that share KV head `kv_head` (GQA), over positions [0, len): each K and V row is read
 * once for the group. scratch: group x (2 head_dim + len) floats. */
static void attend_group(const Pool *p, int layer, int kv_head, int group, int head_dim, const uint16_t *q_src,
                         const float *cos, const float *sin, const int32_t *table, int page, int len, float scale,
                         float *scratch, uint16_t *out) {
    float *q = scratch, *acc = scratch + group * head_dim, *scores = scratch + 2 * group * head_dim;
    for (int j = 0; j < group; j++) rotate(q_src + (int64_t)j * head_dim, cos, sin, head_dim, q + j * head_dim);
    for (int t = 0; t < len; t++) {
        const float *k = row(p, table[t / page], layer, 0, kv_head, t % page);
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
        const float *v = row(p, table[t / page], layer, 1, kv_head, t % page);
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

/* One decode step's attention for `rows` sequences of one token each, in `layer`: q and k of qkv [rows, stride]
 * bfloat16 ((heads + 2 kv_heads) x head_dim: q, k, v) rotated by cos/sin [rows, head_dim]; k and v stored at
 * slots[r]; the query attends over positions [0, seq_lens[r]) through block_tables [rows, table_width]; the result
 * [rows, heads x head_dim] as bfloat16. Every row's K/V is stored first (a row's new token lives in its own
 * sequence's block, which no other row reads), then the (row, KV head) pairs attend on up to `threads` OpenMP
 * threads, each in its part of `scratch`: threads x (heads / kv_heads) x (2 head_dim + max(seq_lens)) floats. */
void rope_store_attend(int rows, int heads, int kv_heads, int head_dim, const uint16_t *qkv, int64_t stride,
                       const float *cos, const float *sin, float *pool_base, const int64_t *pool_strides, int layer,
                       const int64_t *slots, const int32_t *block_tables, int table_width, const int32_t *seq_lens,
                       int page, float scale, int threads, float *scratch, uint16_t *out) {
    Pool p = {pool_base, pool_strides[0], pool_strides[1], pool_strides[2], pool_strides[3], pool_strides[4]};
    int group = heads / kv_heads, longest = 0;
    for (int r = 0; r < rows; r++) {
        const uint16_t *src = qkv + (int64_t)r * stride;
        const float *c = cos + (int64_t)r * head_dim, *s = sin + (int64_t)r * head_dim;
        int64_t block = slots[r] / page, offset = slots[r] % page;
        for (int h = 0; h < kv_heads && slots[r] >= 0; h++) { /* slot -1: not stored (padding) */
            rotate(src + (int64_t)(heads + h) * head_dim, c, s, head_dim, row(&p, block, layer, 0, h, offset));
            float *v = row(&p, block, layer, 1, h, offset);
            for (int i = 0; i < head_dim; i++) v[i] = bf16_to_f32(src[(int64_t)(heads + kv_heads + h) * head_dim + i]);
        }
        longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    }
    int64_t per_thread = (int64_t)group * (2 * head_dim + longest);
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

/* Rows `ids` [n] of torch's packed int4 CPU layout (see `lowbit._codes_t`): codes uint8 [n, in_features]. Rows
 * come in blocks of `block`, each stored as [width, block / 2] bytes (low nibble row j, high nibble row
 * j + block / 2); a last block of fewer rows stores rows 2j (low) and 2j + 1 (high), [width, tail / 2] bytes. */
void int4_rows(const uint8_t *packed, int64_t width, int64_t rows, int block, const int64_t *ids, int n,
               int in_features, uint8_t *out) {
    int64_t full = rows / block * block, half = block / 2, tail = (rows - full) / 2;
    for (int k = 0; k < n; k++) {
        int64_t r = ids[k];
        const uint8_t *src;
        int64_t step;
        int shift;
        if (r < full) {
            src = packed + (r / block) * width * half + (r % block) % half;
            step = half;
            shift = (r % block) >= half ? 4 : 0;
        } else {
            src = packed + full * width / 2 + (r - full) / 2;
            step = tail;
            shift = ((r - full) % 2) * 4;
        }
        for (int c = 0; c < in_features; c++) out[(int64_t)k * in_features + c] = (src[c * step] >> shift) & 15;
    }
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
    float *pool;
    const int64_t *pool_strides, *slots;
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
                      s->pool_strides, l->index, s->slots, s->block_tables, s->table_width, s->seq_lens, s->page,
                      l->scale, t, s->scratch, s->attn);
    if (matmul(&l->o, s->attn, rows, s->o, t)) return -1;
    add_rmsnorm(rows, dim, s->residual, s->o, dim, l->post_norm, l->post_eps, s->x, NULL);
    if (matmul(&l->gate_up, s->x, rows, s->gate_up, t)) return -1;
    silu_and_mul(rows, l->intermediate, s->gate_up, l->gate_up.out_features, s->act);
    if (matmul(&l->down, s->act, rows, s->down, t)) return -1;
    add_rmsnorm(rows, dim, s->residual, s->down, dim, next_norm, next_eps, final_out ? NULL : s->x, final_out);
    return 0;
}
