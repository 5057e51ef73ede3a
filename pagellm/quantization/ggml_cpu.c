/* Matrix products with GGUF-quantized weights on x86-64 CPUs (AVX2, FMA, F16C), in float32.
 *
 * The weights stay in the GGUF file's own block layout, row-major: row n of W [N, K] is K/32
 * blocks of 32 values.
 *   Q4_0: {fp16 d; uint8 qs[16]}          w = d * (q - 8)
 *   Q4_1: {fp16 d; fp16 m; uint8 qs[16]}  w = d * q + m
 *   Q8_0: {fp16 d; int8 qs[32]}           w = d * q
 * A 4-bit block holds value j in the low nibble of qs[j] and value j + 16 in the high nibble.
 *
 * ggml_gemm multiplies as llama.cpp does on the CPU: each 32-value block of an activation row
 * is quantized to int8 with its own float scale (Q8 blocks), and a weight block times an
 * activation block is an integer dot product (AVX2 multiply-add of bytes) scaled once. Reading
 * 4-bit weights costs little; expanding them to float32 first would cost about three times as
 * many instructions per weight, which is what bounds a CPU at batch 1. Each weight block is
 * loaded once per call and multiplied with up to four activation rows. ggml_dequantize gives
 * the exact float32 values (large batches multiply those with the BLAS instead).
 * Parallel over output rows with OpenMP: loaded after torch, the library shares torch's OpenMP
 * runtime and thread pool.
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

static int block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: return 0;
    }
}

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The 32 values of one block as four vectors of 8 floats. */
static inline void expand(int qtype, const uint8_t *b, __m256 w[4]) {
    if (qtype == Q8_0) {
        const __m256 d = _mm256_set1_ps(fp16(b));
        for (int i = 0; i < 4; i++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i));
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
        return;
    }
    const int has_min = qtype == Q4_1;
    const __m256 d = _mm256_set1_ps(fp16(b));
    const __m256 m = has_min ? _mm256_set1_ps(fp16(b + 2)) : _mm256_set1_ps(-8.0f * fp16(b));
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + (has_min ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(qs, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    /* Q4_0: d * (q - 8) = d * q + (-8 d), exact in float32 for |q - 8| <= 8. */
    for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(w[i], d, m);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Activations as Q8 blocks: per 32 values, int8 q = round(x * (1 / d)) with d = max|x| / 127
 * (round half to even), and d * sum(q), what a weight block's offset multiplies. The product is
 * then exactly W times the rounded activations, which the BLAS path for large batches
 * reproduces (`round_to_q8_blocks` in ggml_cpu.py). */
typedef struct {
    int8_t *q;   /* [M, K] */
    float *d;    /* [M, K / 32] */
    float *sum;  /* [M, K / 32] */
} q8_rows;

static void quantize_rows(const float *x, int64_t M, int64_t K, q8_rows *out) {
    for (int64_t b = 0; b < M * K / 32; b++) {
        const float *v = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int total = 0;
        for (int i = 0; i < 32; i++) {
            const int q = (int)lrintf(v[i] * inv);
            out->q[b * 32 + i] = (int8_t)q;
            total += q;
        }
        out->d[b] = d;
        out->sum[b] = d * (float)total;
    }
}

/* The 32 weights of a 4-bit block as unsigned bytes 0..15, in order. */
static inline __m256i nibbles(const uint8_t *qs) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* sum_i a_i * b_i of 32 bytes each (a unsigned, b signed) as 8 float partial sums. */
static inline __m256 dot_u8_i8(__m256i a, __m256i b) {
    const __m256i pairs = _mm256_maddubs_epi16(a, b);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* y[r, n] for rows r0 .. r0+R-1 (R = 1, 2 or 4) of the quantized activations, one weight row. */
static inline void dot_rows(int qtype, int R, const q8_rows *x, int64_t K, const uint8_t *row,
                            float *y, int64_t N, int64_t r0, int64_t n) {
    const int bb = block_bytes(qtype);
    const int64_t nb = K / 32;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float offset[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *b = row + g * bb;
        const float d = fp16(b);
        if (qtype == Q8_0) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2));
            const __m256i aq = _mm256_sign_epi8(q, q);
            for (int r = 0; r < R; r++) {
                const int64_t xb = (r0 + r) * nb + g;
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + xb * 32));
                const __m256 s = dot_u8_i8(aq, _mm256_sign_epi8(xq, q));
                acc[r] = _mm256_fmadd_ps(s, _mm256_set1_ps(d * x->d[xb]), acc[r]);
            }
            continue;
        }
        /* Q4_1: d q + m, the offset m times the block's sum; Q4_0: d q - 8 d. */
        const float m = qtype == Q4_1 ? fp16(b + 2) : -8.0f * d;
        const __m256i q = nibbles(b + (qtype == Q4_1 ? 4 : 2));
        for (int r = 0; r < R; r++) {
            const int64_t xb = (r0 + r) * nb + g;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + xb * 32));
            acc[r] = _mm256_fmadd_ps(dot_u8_i8(q, xq), _mm256_set1_ps(d * x->d[xb]), acc[r]);
            offset[r] += m * x->sum[xb];
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * N + n] = hsum(acc[r]) + offset[r];
}

/* y [M, N] = x [M, K] @ W^T, x quantized to Q8 blocks first. Returns 0; -1 for an unknown qtype
 * or K not a multiple of 32; -2 if scratch memory cannot be allocated. */
int ggml_gemm(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y) {
    const int bb = block_bytes(qtype);
    if (bb == 0 || K % 32) return -1;
    q8_rows xq = {malloc(M * K), malloc(M * K / 32 * sizeof(float)), malloc(M * K / 32 * sizeof(float))};
    if (!xq.q || !xq.d || !xq.sum) {
        free(xq.q), free(xq.d), free(xq.sum);
        return -2;
    }
    quantize_rows(x, M, K, &xq);
    const int64_t row_bytes = K / 32 * bb;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        int64_t r = 0;
        /* A constant R per call lets the compiler unroll and keep the accumulators in registers. */
        for (; r + 4 <= M; r += 4) dot_rows(qtype, 4, &xq, K, row, y, N, r, n);
        if (r + 2 <= M) { dot_rows(qtype, 2, &xq, K, row, y, N, r, n); r += 2; }
        if (r < M) dot_rows(qtype, 1, &xq, K, row, y, N, r, n);
    }
    free(xq.q), free(xq.d), free(xq.sum);
    return 0;
}

/* out [R, K] = the float32 values of R weight rows. Returns 0, or -1 as ggml_gemm. */
int ggml_dequantize(int qtype, const uint8_t *w, int64_t R, int64_t K, float *out) {
    const int bb = block_bytes(qtype);
    if (bb == 0 || K % 32) return -1;
    const int64_t row_bytes = K / 32 * bb;
#pragma omp parallel for schedule(static) if (R * K > 65536)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t g = 0; g < K / 32; g++) {
            __m256 v[4];
            expand(qtype, w + r * row_bytes + g * bb, v);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + r * K + g * 32 + 8 * i, v[i]);
        }
    }
    return 0;
}
