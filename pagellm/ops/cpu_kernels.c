/* The small ops of a decoder layer on the CPU, float32, each one pass over its data.
 *
 * On a CPU decode step the matrix products are a few milliseconds and PyTorch's per-op cost
 * (dispatch, allocation, iterator set-up: 10-40 us for tensors of a few hundred values) was the
 * rest: about 20 ms of a SmolLM2 token in 30 layers. Each function here replaces several ATen
 * ops; PyTorch's versions (pagellm/ops/torch_ops.py) stay the reference they are tested against.
 * Parallel loops use OpenMP, which after torch resolves to torch's own runtime and pool.
 */
#include <immintrin.h>
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

/* e^x for 8 floats (x <= 0 here): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p Cephes' degree-6
 * polynomial (about 1 ulp); below -87 (and for -inf) the result is 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 in_range = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), in_range);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

enum { SPAN = 32, MAX_HEAD_DIM = 256 };

/* Causal attention of every query of a flat batch over its sequence's paged context: out [T, H, D]
 * for q [T, H, D] (rows `q_stride` floats apart); sequence b owns queries query_start[b] ..
 * query_start[b+1]-1, the last of its seq_lens[b] positions; caches [num_blocks, block_size, Hkv,
 * D]; block_table [B, bt_stride] int32. Query head h reads KV head h / (H / Hkv); D is a multiple
 * of 8, at most 256. Online softmax over spans of 32 positions (no scratch memory). Each query is
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
        __m256 o[MAX_HEAD_DIM / 8];
        for (int64_t i = 0; i < D / 8; i++) o[i] = _mm256_setzero_ps();
        float top = -INFINITY, total = 0.0f;
        for (int64_t p0 = 0; p0 < len; p0 += SPAN) {
            const int64_t n = len - p0 < SPAN ? len - p0 : SPAN;
            const float *rows[SPAN];
            float s[SPAN];
            float span_top = -INFINITY;
            int64_t block = p0 / block_size, offset = p0 % block_size;  /* one division per span */
            for (int64_t j = 0; j < n; j++) {
                rows[j] = k_cache + (((int64_t)blocks[block] * block_size + offset) * Hkv + kvh) * D;
                if (++offset == block_size) offset = 0, block++;
                __m256 dot = _mm256_setzero_ps();
                for (int64_t i = 0; i < D; i += 8)
                    dot = _mm256_fmadd_ps(_mm256_loadu_ps(qv + i), _mm256_loadu_ps(rows[j] + i), dot);
                s[j] = hsum8(dot) * scale;
                span_top = fmaxf(span_top, s[j]);
            }
            if (span_top > top) {  /* rescale what was summed under the old maximum */
                const float shrink = expf(top - span_top);
                for (int64_t i = 0; i < D / 8; i++) o[i] = _mm256_mul_ps(o[i], _mm256_set1_ps(shrink));
                total *= shrink;
                top = span_top;
            }
            for (int64_t j = n; j < SPAN; j++) s[j] = -INFINITY;
            for (int64_t j = 0; j < SPAN; j += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
                _mm256_storeu_ps(s + j, e);
                total += hsum8(e);
            }
            for (int64_t j = 0; j < n; j++) {
                const float *vv = v_cache + (rows[j] - k_cache);
                const __m256 e = _mm256_set1_ps(s[j]);
                for (int64_t i = 0; i < D / 8; i++) o[i] = _mm256_fmadd_ps(e, _mm256_loadu_ps(vv + 8 * i), o[i]);
            }
        }
        const __m256 inv = _mm256_set1_ps(1.0f / total);
        float *dst = out + (t * H + h) * D;
        for (int64_t i = 0; i < D / 8; i++) _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(o[i], inv));
    }
}
