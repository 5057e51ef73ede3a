/* The small ops of a decoder layer on the CPU, float32, each one pass over its data.
 *
 * On a CPU decode step the matrix products are a few milliseconds and PyTorch's per-op cost
 * (dispatch, allocation, iterator set-up: 10-40 us for tensors of a few hundred values) was the
 * rest: about 20 ms of a SmolLM2 token in 30 layers. Each function here replaces several ATen
 * ops; PyTorch's versions (pagellm/ops/torch_ops.py) stay the reference they are tested against.
 * Parallel loops use OpenMP, which after torch resolves to torch's own runtime and pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* out[t] = rms_norm(x[t] + residual[t]) * w and sum[t] = x[t] + residual[t]; without residual
 * (NULL), out[t] = rms_norm(x[t]) * w and sum is not written. */
void rms_norm(const float *x, const float *residual, const float *w, int64_t T, int64_t N, float eps, float *out,
              float *sum) {
    for (int64_t t = 0; t < T; t++) {
        const float *src = x + t * N;
        if (residual) {
            for (int64_t i = 0; i < N; i++) sum[t * N + i] = src[i] + residual[t * N + i];
            src = sum + t * N;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < N; i++) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)N + eps);
        for (int64_t i = 0; i < N; i++) out[t * N + i] = src[i] * inv * w[i];
    }
}

/* out [T, d] = silu(x[:, :d]) * x[:, d:] for x [T, 2d]. */
void silu_and_mul(const float *x, int64_t T, int64_t d, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * d, *u = g + d;
        for (int64_t i = 0; i < d; i++) out[t * d + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* out [T, H, D] = the rotate-half rotary embedding of heads x [T, H, D] (rows `stride` floats
 * apart) at positions [T]; cos_sin [max_position, D]: cos in the first half of a row, sin in
 * the second. */
void rotary(const float *x, int64_t T, int64_t H, int64_t D, int64_t stride, const int64_t *positions,
            const float *cos_sin, float *out) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_sin + positions[t] * D, *s = c + half;
        for (int64_t h = 0; h < H; h++) {
            const float *v = x + t * stride + h * D;
            float *o = out + (t * H + h) * D;
            for (int64_t i = 0; i < half; i++) {
                o[i] = v[i] * c[i] - v[i + half] * s[i];
                o[i + half] = v[i + half] * c[i] + v[i] * s[i];
            }
        }
    }
}

/* cache [num_slots, width] row slots[t] = new [t] for t < T (rows `stride` floats apart); a
 * negative slot is not written. */
void write_rows(const float *new_rows, int64_t T, int64_t width, int64_t stride, const int64_t *slots, float *cache) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= 0)
            for (int64_t i = 0; i < width; i++) cache[slots[t] * width + i] = new_rows[t * stride + i];
}

/* Causal attention of every query of a flat batch over its sequence's paged context: out [T, H, D]
 * for q [T, H, D] (rows `q_stride` floats apart); sequence b owns queries query_start[b] ..
 * query_start[b+1]-1, the last of its seq_lens[b] positions; caches [num_blocks, block_size, Hkv,
 * D]; block_table [B, bt_stride] int32. Query head h reads KV head h / (H / Hkv). Each query is
 * computed alone, in the same order whatever else is in the batch or the step: a token's result
 * is the same in a prompt, a decode, a recompute after preemption or any batch. */
void paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int32_t *block_table, int64_t bt_stride, const int32_t *query_start,
                     const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                     float scale, float *out) {
    const int64_t group = H / Hkv, T = query_start[B];
#pragma omp parallel for schedule(dynamic) if (T * H > 8)
    for (int64_t th = 0; th < T * H; th++) {
        const int64_t t = th / H, h = th % H, kvh = h / group;
        int64_t b = 0;
        while (query_start[b + 1] <= t) b++;
        const int64_t len = seq_lens[b] - (query_start[b + 1] - 1 - t);  /* positions 0 .. this one */
        const int32_t *blocks = block_table + b * bt_stride;
        const float *qv = q + t * q_stride + h * D;
        float *scores = malloc(len * sizeof(float));
        float *o = out + (t * H + h) * D;
        float top = -INFINITY;
        for (int64_t p = 0; p < len; p++) {
            const int64_t slot = (int64_t)blocks[p / block_size] * block_size + p % block_size;
            const float *kv = k_cache + (slot * Hkv + kvh) * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < D; i++) dot += qv[i] * kv[i];
            scores[p] = dot * scale;
            top = fmaxf(top, scores[p]);
        }
        float total = 0.0f;
        for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
        for (int64_t p = 0; p < len; p++) {
            const float e = expf(scores[p] - top);
            total += e;
            const int64_t slot = (int64_t)blocks[p / block_size] * block_size + p % block_size;
            const float *vv = v_cache + (slot * Hkv + kvh) * D;
            for (int64_t i = 0; i < D; i++) o[i] += e * vv[i];
        }
        for (int64_t i = 0; i < D; i++) o[i] /= total;
        free(scores);
    }
}
