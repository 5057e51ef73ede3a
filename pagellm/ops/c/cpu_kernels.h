/* The CPU kernels one decoder-layer call strings together (cpu_layer.c); each is documented where
 * it is defined (cpu_kernels.c, ../quantization/ggml_cpu.c). */
#pragma once
#include <stdint.h>

void rms_norm(const float *x, const float *residual, const float *w, int64_t T, int64_t N, float eps, float *out,
              float *sum);
void silu_and_mul(const float *x, int64_t T, int64_t d, float *out);
void rotary(const float *x, int64_t T, int64_t H, int64_t D, int64_t stride, const int64_t *positions,
            const float *cos_sin, float *out);
void write_rows(const float *new_rows, int64_t T, int64_t width, int64_t stride, const int64_t *slots, float *cache);
void paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int32_t *block_table, int64_t bt_stride, const int32_t *query_start,
                     const int32_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                     float scale, int64_t window, float soft_cap, const float *sinks, float *out);
int ggml_gemm(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y);
