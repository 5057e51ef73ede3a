/* Matrix products with GGUF-quantized weights on x86-64 CPUs (AVX2, FMA, F16C), in float32.
 *
 * The weights stay in the GGUF file's own block layout, row-major: row n of W [N, K] is K/32
 * blocks of 32 values.
 *   Q4_0: {fp16 d; uint8 qs[16]}          w = d * (q - 8)
 *   Q4_1: {fp16 d; fp16 m; uint8 qs[16]}  w = d * q + m
 *   Q8_0: {fp16 d; int8 qs[32]}           w = d * q
 * A 4-bit block holds value j in the low nibble of qs[j] and value j + 16 in the high nibble.
 *
 * A call reads the weights once whatever the batch: for up to three activation rows each block
 * is expanded into registers and used at once; for more, twelve weight rows at a time are expanded to
 * float32 and every activation row is multiplied with them in 4 x 3 register tiles.
 * Activations stay float32 (llama.cpp rounds them to 8-bit blocks, which was measured to derail
 * SmolLM2's greedy answers, its own included): the result is x @ dequantize(W)^T, each output
 * summed in the same order whatever the number of rows, so a row's result never depends on its
 * batch. ggml_dequantize gives the
 * exact float32 values. Parallel over output rows with OpenMP: loaded after torch, the library
 * shares torch's OpenMP runtime and thread pool.
 */
#include <immintrin.h>
#include <stdint.h>
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

/* Every output y[r, n] is one 8-lane FMA chain over k = 0, 8, 16, ... (w * x, lane by lane),
 * then hsum: the same operations whatever the batch, so a row's result never depends on it. */

/* R <= 8 activation rows (decode batches and verification steps of speculative decoding, where
 * expanding the blocks is the cost): C <= 4 weight rows expanded block by block straight into
 * registers, R x C independent chains. */
enum { ON_THE_FLY_ROWS = 8 };

/* Weight rows per on-the-fly call for R activation rows. From 3 rows one at a time: its R chains
 * hide the FMA latency, and more weight rows' accumulators would spill (a 1 + 5-token step of
 * SmolLM2 ran 20% faster than with the panel below, 3 rows 10% faster than with 2 weight rows). */
static inline int on_the_fly_width(int64_t R) { return R == 1 ? 4 : R == 2 ? 2 : 1; }

static inline __attribute__((always_inline)) void on_the_fly(int qtype, int R, int C, const float *x, int64_t K,
                                                            const uint8_t *w, int64_t row_bytes, float *y,
                                                            int64_t N) {
    const int bb = block_bytes(qtype);
    __m256 acc[ON_THE_FLY_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / 32; g++) {
        for (int c = 0; c < C; c++) {
            __m256 v[4];
            /* The next rows' block: with several rows read at once the hardware prefetcher alone
             * fell behind on weights streamed from memory (the 30 MB head: 2.5x slower). */
            _mm_prefetch((const char *)(w + (c + C) * row_bytes + g * bb), _MM_HINT_T0);
            expand(qtype, w + c * row_bytes + g * bb, v);
            for (int r = 0; r < R; r++)
                for (int i = 0; i < 4; i++)
                    acc[r][c] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(x + r * K + g * 32 + 8 * i), acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * N + c] = hsum(acc[r][c]);
}

/* Rows n .. n+C-1 (C = min(N - n, width)) for all R rows of x. */
static inline __attribute__((always_inline)) void on_the_fly_rows(int qtype, int R, int width, const float *x,
                                                                 int64_t K, const uint8_t *w, int64_t row_bytes,
                                                                 float *y, int64_t N, int64_t n) {
    const uint8_t *rows = w + n * row_bytes;
    switch (N - n < width ? N - n : width) {  /* constant C per call: the accumulators stay in registers */
    case 4: on_the_fly(qtype, R, 4, x, K, rows, row_bytes, y + n, N); break;
    case 3: on_the_fly(qtype, R, 3, x, K, rows, row_bytes, y + n, N); break;
    case 2: on_the_fly(qtype, R, 2, x, K, rows, row_bytes, y + n, N); break;
    default: on_the_fly(qtype, R, 1, x, K, rows, row_bytes, y + n, N); break;
    }
}

/* R activation rows x C expanded weight rows (float32, K apart), R * C <= 12: the register tile.
 * Four rows take three weight rows (12 sums, 3 weight vectors, one activation vector: the 16
 * AVX2 registers; 4 x 2 was load-bound); fewer rows take more weight rows, so that there are
 * always about 12 independent FMA chains (1 x 3 was bound by the FMA latency). */
static inline __attribute__((always_inline)) void tile(int R, int C, const float *x, int64_t K, const float *w,
                                                      float *y, int64_t N) {
    __m256 acc[12];
    for (int i = 0; i < R * C; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        if (R == 4) {
            __m256 wv[3];
            for (int c = 0; c < C; c++) wv[c] = _mm256_loadu_ps(w + c * K + k);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_loadu_ps(x + r * K + k);
                for (int c = 0; c < C; c++) acc[r * C + c] = _mm256_fmadd_ps(wv[c], xv, acc[r * C + c]);
            }
        } else {  /* the activation vectors in registers, the weights straight from L1 */
            __m256 xv[3];
            for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * K + k);
            for (int c = 0; c < C; c++) {
                const __m256 wv = _mm256_loadu_ps(w + c * K + k);
                for (int r = 0; r < R; r++) acc[r * C + c] = _mm256_fmadd_ps(wv, xv[r], acc[r * C + c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * N + c] = hsum(acc[r * C + c]);
}

/* Weight rows c0 .. height-1 of the panel, C at a time (then fewer), for R activation rows. */
static inline __attribute__((always_inline)) void tile_row(int R, int C, const float *x, int64_t K,
                                                          const float *panel, int64_t height, float *y, int64_t N) {
    int64_t c = 0;
    for (; c + C <= height; c += C) tile(R, C, x, K, panel + c * K, y + c, N);
    for (; c < height; c++) tile(R, 1, x, K, panel + c * K, y + c, N);
}

/* y rows of x [M, K] times the `height` expanded weight rows of the panel. */
static void panel_product(const float *x, int64_t M, int64_t K, const float *panel, int64_t height, float *y,
                          int64_t N) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) tile_row(4, 3, x + r * K, K, panel, height, y + r * N, N);
    switch (M - r) {  /* constant R and C per call: the accumulators stay in registers */
    case 3: tile_row(3, 4, x + r * K, K, panel, height, y + r * N, N); break;
    case 2: tile_row(2, 6, x + r * K, K, panel, height, y + r * N, N); break;
    case 1: tile_row(1, 12, x + r * K, K, panel, height, y + r * N, N); break;
    }
}

enum { PANEL = 12,  /* weight rows expanded to float32 together, reused by every activation row */
       CHUNK = 64  /* activation rows per pass over the weights: they stay in L2 while it passes */ };

/* y [M, N] = x [M, K] @ W^T. Returns 0, -1 for an unknown qtype or K not a multiple of 32, -2
 * when scratch memory cannot be allocated. */
int ggml_gemm(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y) {
    const int bb = block_bytes(qtype);
    if (bb == 0 || K % 32) return -1;
    const int64_t row_bytes = K / 32 * bb;
    if (M <= 0) return 0;
    if (M <= ON_THE_FLY_ROWS) {
        const int width = on_the_fly_width(M);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n += width) {
            switch (M) {  /* constant R and C per call: the accumulators stay in registers */
            case 1: on_the_fly_rows(qtype, 1, on_the_fly_width(1), x, K, w, row_bytes, y, N, n); break;
            case 2: on_the_fly_rows(qtype, 2, on_the_fly_width(2), x, K, w, row_bytes, y, N, n); break;
            case 3: on_the_fly_rows(qtype, 3, on_the_fly_width(3), x, K, w, row_bytes, y, N, n); break;
            case 4: on_the_fly_rows(qtype, 4, on_the_fly_width(4), x, K, w, row_bytes, y, N, n); break;
            case 5: on_the_fly_rows(qtype, 5, on_the_fly_width(5), x, K, w, row_bytes, y, N, n); break;
            case 6: on_the_fly_rows(qtype, 6, on_the_fly_width(6), x, K, w, row_bytes, y, N, n); break;
            case 7: on_the_fly_rows(qtype, 7, on_the_fly_width(7), x, K, w, row_bytes, y, N, n); break;
            default: on_the_fly_rows(qtype, 8, on_the_fly_width(8), x, K, w, row_bytes, y, N, n); break;
            }
        }
        return 0;
    }
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *panel = aligned_alloc(32, PANEL * K * sizeof(float));
        failed = panel == NULL;
        for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
            const int64_t rows = M - m0 < CHUNK ? M - m0 : CHUNK;
#pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
                if (panel == NULL) continue;
                const int64_t height = N - n0 < PANEL ? N - n0 : PANEL;
                for (int64_t c = 0; c < height; c++)
                    for (int64_t g = 0; g < K / 32; g++) {
                        __m256 v[4];
                        expand(qtype, w + (n0 + c) * row_bytes + g * bb, v);
                        for (int i = 0; i < 4; i++) _mm256_store_ps(panel + c * K + g * 32 + 8 * i, v[i]);
                    }
                panel_product(x + m0 * K, rows, K, panel, height, y + m0 * N + n0, N);
            }
        }
        free(panel);
    }
    return failed ? -2 : 0;
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
