/* Matrix products with GGUF-quantized weights on x86-64 CPUs (AVX2, FMA, F16C), in float32.
 *
 * The weights stay in the GGUF file's own block layout, row-major: row n of W [N, K] is K/32
 * blocks of 32 values.
 *   Q4_0: {fp16 d; uint8 qs[16]}          w = d * (q - 8)
 *   Q4_1: {fp16 d; fp16 m; uint8 qs[16]}  w = d * q + m
 *   Q8_0: {fp16 d; int8 qs[32]}           w = d * q
 * A 4-bit block holds value j in the low nibble of qs[j] and value j + 16 in the high nibble.
 *
 * Each 32-value block is expanded to float32 once and multiplied with up to four activation
 * rows, so a call reads the weights once whatever the batch. Activations stay float32 (llama.cpp
 * rounds them to 8-bit blocks, which was measured to derail SmolLM2's greedy answers, its own
 * included): the result is x @ dequantize(W)^T, each output summed in the same order whatever
 * the number of rows, so a row's result never depends on its batch. ggml_dequantize gives the
 * exact float32 values. Parallel over output rows with OpenMP: loaded after torch, the library
 * shares torch's OpenMP runtime and thread pool.
 */
#include <immintrin.h>
#include <stdint.h>
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

/* y[r, n] for rows r0 .. r0+R-1 of x (R = 1, 2 or 4), one weight row. Every row sums into two
 * partial accumulators (the even and odd 8-value quarters of each block), added at the end: the
 * same order whatever R, and two independent FMA chains per row. */
static inline void dot_rows(int qtype, int R, const float *x, int64_t K, const uint8_t *row,
                            float *y, int64_t N, int64_t r0, int64_t n) {
    const int bb = block_bytes(qtype);
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / 32; g++) {
        __m256 w[4];
        expand(qtype, row + g * bb, w);
        for (int r = 0; r < R; r++) {
            const float *xr = x + (r0 + r) * K + g * 32;
            for (int i = 0; i < 4; i++) acc[r][i & 1] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i & 1]);
        }
    }
    for (int r = 0; r < R; r++) y[(r0 + r) * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* y [M, N] = x [M, K] @ W^T. Returns 0, or -1 for an unknown qtype or K not a multiple of 32. */
int ggml_gemm(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y) {
    const int bb = block_bytes(qtype);
    if (bb == 0 || K % 32) return -1;
    const int64_t row_bytes = K / 32 * bb;
    /* Rows of x in chunks that stay in the L2 cache while every weight row passes over them (a
     * prompt's whole x, re-read from L3 for each weight row, bounded large batches before). */
    const int64_t chunk = 64;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t end = M - m0 < chunk ? M : m0 + chunk;
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *row = w + n * row_bytes;
            int64_t r = m0;
            /* A constant R per call lets the compiler unroll and keep the accumulators in registers. */
            for (; r + 4 <= end; r += 4) dot_rows(qtype, 4, x, K, row, y, N, r, n);
            if (r + 2 <= end) { dot_rows(qtype, 2, x, K, row, y, N, r, n); r += 2; }
            if (r < end) dot_rows(qtype, 1, x, K, row, y, N, r, n);
        }
    }
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
