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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* e^x for 8 floats: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p Cephes' degree-6 polynomial
 * (about 1 ulp); below -87 (and for -inf) the result is 0, above 88 it is e^88. */
static inline __m256 exp8(__m256 x) {
    const __m256 in_range = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
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

/* out [T, d] = silu(x[:, :d]) * x[:, d:] for x [T, 2d]; silu(g) = g / (1 + e^-g). */
void silu_and_mul(const float *x, int64_t T, int64_t d, float *out) {
#pragma omp parallel for schedule(static) if (T * d >= 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * d, *u = g + d;
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(out + t * d + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < d; i++) out[t * d + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
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

enum { SPAN = 32, MAX_HEAD_DIM = 256, HEADS = 4 };

/* o[0 .. 8*NV) = o * shrink + sum_j e[j] * v_rows[j][0 .. 8*NV), the NV vectors in registers. */
static inline __attribute__((always_inline)) void accumulate(int NV, float *o, float shrink, const float *e,
                                                            const float *const *v_rows, int64_t n, int64_t off) {
    __m256 acc[8];
    for (int i = 0; i < NV; i++) acc[i] = _mm256_mul_ps(_mm256_loadu_ps(o + 8 * i), _mm256_set1_ps(shrink));
    for (int64_t j = 0; j < n; j++) {
        const __m256 w = _mm256_set1_ps(e[j]);
        for (int i = 0; i < NV; i++) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v_rows[j] + off + 8 * i), acc[i]);
    }
    for (int i = 0; i < NV; i++) _mm256_storeu_ps(o + 8 * i, acc[i]);
}

/* Query heads h0 .. h0+G-1 (G <= HEADS, one KV head) of query t over positions lo .. len-1: each
 * head on its own, online softmax over spans of SPAN positions; the heads share each K/V row read
 * (the span's rows stay in L1 while each head passes over them). soft_cap > 0: each score s
 * becomes soft_cap * tanh(s / soft_cap); sinks (NULL: none): head g's sink logit sinks[g] joins
 * its softmax's denominator (a weight without a value). */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int32_t *blocks,
                   int64_t block_size, int64_t Hkv, int64_t kvh, int64_t D, int64_t lo, int64_t len, int G,
                   float scale, float soft_cap, const float *sinks, float *out) {
    float o[HEADS][MAX_HEAD_DIM], top[HEADS], total[HEADS];
    for (int g = 0; g < G; g++) {
        for (int64_t i = 0; i < D; i++) o[g][i] = 0.0f;
        top[g] = -INFINITY, total[g] = 0.0f;
    }
    for (int64_t p0 = lo; p0 < len; p0 += SPAN) {
        const int64_t n = len - p0 < SPAN ? len - p0 : SPAN;
        const float *k_rows[SPAN], *v_rows[SPAN];
        float s[SPAN];
        int64_t block = p0 / block_size, offset = p0 % block_size; /* one division per span */
        /* The span's K and V rows are 768-byte strides apart in the cache layout, which the
         * hardware prefetcher did not follow: asking for them all first made long contexts 4x faster. */
        for (int64_t j = 0; j < n; j++) {
            const int64_t at = (((int64_t)blocks[block] * block_size + offset) * Hkv + kvh) * D;
            if (++offset == block_size) offset = 0, block++;
            k_rows[j] = k_cache + at, v_rows[j] = v_cache + at;
            for (int64_t i = 0; i < D; i += 16) {
                _mm_prefetch((const char *)(k_rows[j] + i), _MM_HINT_T0);
                _mm_prefetch((const char *)(v_rows[j] + i), _MM_HINT_T0);
            }
        }
        for (int g = 0; g < G; g++) {
            const float *qg = q + g * D;
            /* Four positions at a time: four independent FMA chains (one chain was latency-bound). */
            for (int64_t j0 = 0; j0 < n; j0 += 4) {
                __m256 dot[4];
                const float *rows[4];
                for (int r = 0; r < 4; r++) dot[r] = _mm256_setzero_ps(), rows[r] = k_rows[j0 + r < n ? j0 + r : j0];
                for (int64_t i = 0; i < D; i += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + i);
                    for (int r = 0; r < 4; r++) dot[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[r] + i), dot[r]);
                }
                for (int r = 0; r < 4 && j0 + r < n; r++) s[j0 + r] = hsum8(dot[r]) * scale;
            }
            if (soft_cap > 0.0f)
                for (int64_t j = 0; j < n; j++) s[j] = soft_cap * tanhf(s[j] / soft_cap);
            float span_top = -INFINITY;
            for (int64_t j = 0; j < n; j++) span_top = s[j] > span_top ? s[j] : span_top;
            float shrink = 1.0f;  /* rescales what was summed under a lower maximum */
            if (span_top > top[g]) shrink = expf(top[g] - span_top), total[g] *= shrink, top[g] = span_top;
            for (int64_t j = n; j < SPAN; j++) s[j] = -INFINITY;
            for (int64_t j = 0; j < SPAN; j += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top[g])));
                _mm256_storeu_ps(s + j, e);
                total[g] += hsum8(e);
            }
            for (int64_t off = 0; off < D; off += 64) {
                switch ((D - off) / 8 < 8 ? (D - off) / 8 : 8) { /* constant NV: the sums stay in registers */
                case 8: accumulate(8, o[g] + off, shrink, s, v_rows, n, off); break;
                case 7: accumulate(7, o[g] + off, shrink, s, v_rows, n, off); break;
                case 6: accumulate(6, o[g] + off, shrink, s, v_rows, n, off); break;
                case 5: accumulate(5, o[g] + off, shrink, s, v_rows, n, off); break;
                case 4: accumulate(4, o[g] + off, shrink, s, v_rows, n, off); break;
                case 3: accumulate(3, o[g] + off, shrink, s, v_rows, n, off); break;
                case 2: accumulate(2, o[g] + off, shrink, s, v_rows, n, off); break;
                default: accumulate(1, o[g] + off, shrink, s, v_rows, n, off); break;
                }
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float shrink = 1.0f; /* the sink taken as one more score: the sums rescaled if it is the largest */
        if (sinks) {
            if (sinks[g] > top[g]) shrink = expf(top[g] - sinks[g]), total[g] *= shrink, top[g] = sinks[g];
            total[g] += expf(sinks[g] - top[g]);
        }
        const __m256 inv = _mm256_set1_ps(shrink / total[g]);
        for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(out + g * D + i, _mm256_mul_ps(_mm256_loadu_ps(o[g] + i), inv));
    }
}

/* Causal attention of every query of a flat batch over its sequence's paged context: out [T, H, D]
 * for q [T, H, D] (rows `q_stride` floats apart); sequence b owns queries query_start[b] ..
 * query_start[b+1]-1, the last of its seq_lens[b] positions; caches [num_blocks, block_size, Hkv,
 * D]; block_table [B, bt_stride] int32. Query head h reads KV head h / (H / Hkv); D is a multiple
 * of 8, at most 256. window > 0: the query at position p sees positions p - window + 1 .. p only
 * (the blocks before are not read); soft_cap > 0: scores are capped, sinks [H] (NULL: none) join
 * each head's softmax (see attend). Work items are a query's heads that share a KV head (up to HEADS of them),
 * or single heads when there are too few items for the threads; either way each head is
 * computed alone, in the same order whatever else is in the batch or the step: a token's result
 * is the same in a prompt, a decode, a recompute after preemption or any batch. */
void paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int32_t *block_table, int64_t bt_stride, const int32_t *query_start,
                     const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                     float scale, int64_t window, float soft_cap, const float *sinks, float *out) {
    const int64_t group = H / Hkv, T = query_start[B];
    const int64_t per_item = T * Hkv >= 4 * omp_get_max_threads() ? (group < HEADS ? group : HEADS) : 1;
    const int64_t items_per_kv = (group + per_item - 1) / per_item;
#pragma omp parallel for schedule(dynamic) if (T * H > 8)
    for (int64_t item = 0; item < T * Hkv * items_per_kv; item++) {
        const int64_t t = item / (Hkv * items_per_kv), kvh = item / items_per_kv % Hkv;
        const int64_t h0 = kvh * group + item % items_per_kv * per_item;
        const int G = (int)(kvh * group + group - h0 < per_item ? kvh * group + group - h0 : per_item);
        int64_t b = 0;
        while (query_start[b + 1] <= t) b++;
        const int64_t len = seq_lens[b] - (query_start[b + 1] - 1 - t); /* positions 0 .. this one */
        const int64_t lo = window > 0 && len > window ? len - window : 0;
        attend(q + t * q_stride + h0 * D, k_cache, v_cache, block_table + b * bt_stride, block_size, Hkv, kvh, D,
               lo, len, G, scale, soft_cap, sinks ? sinks + h0 : NULL, out + (t * H + h0) * D);
    }
}
