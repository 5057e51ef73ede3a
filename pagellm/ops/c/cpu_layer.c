/* A whole Llama-family decoder layer (Llama, Mistral, Qwen2) in one call, on the CPU, float32,
 * its four projections GGUF blocks.
 *
 * The same kernels, in the same order, as the layer's PyTorch modules call one by one
 * (pagellm/models/llama.py), so the result is bit for bit theirs; what goes away is the Python
 * between them (module calls, dispatch, allocation, ctypes: about 12 ms of a 42 ms SmolLM2 token
 * in 30 layers, measured). The layout of both structs is mirrored by ctypes in
 * pagellm/models/cpu_layer.py. */
#include <string.h>

#include "cpu_kernels.h"

/* A projection's LoRA adapter slots (pagellm/ops/lora.py's layout), float32: a [slots, parts x rank, in],
 * b [slots, out, rank] with the scaling folded in; part p's outputs are rows part_offsets[p] ..
 * part_offsets[p + 1] of b and read columns p x rank .. (p + 1) x rank of x a^T. a NULL: not adapted. */
typedef struct {
    const float *a, *b;
    int64_t rank, num_parts;
    int64_t part_offsets[4];
} LoRASlots;

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_PROJECTIONS };

typedef struct {
    int64_t hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, block_size;
    int64_t sliding_window;                          /* keys a query sees, itself included; 0: all */
    float eps, scale;
    const float *input_norm, *post_norm, *qkv_bias; /* qkv_bias: NULL for none */
    const float *cos_sin;                            /* [max_position, head_dim]: cos | sin */
    const uint8_t *qkv, *o, *gate_up, *down;         /* GGUF blocks, rows = output features */
    int32_t qkv_type, o_type, gate_up_type, down_type;
    float *k_cache, *v_cache;                        /* [num_blocks, block_size, Hkv, D] */
    LoRASlots lora[LORA_PROJECTIONS];
} DecoderLayer;

typedef struct {
    int64_t num_tokens, num_seqs, block_table_stride;
    const int64_t *positions, *slots;                /* [T]; slot < 0: not written */
    const int32_t *query_start, *seq_lens, *block_table;
    float *scratch;                                  /* decoder_layer_scratch() floats per token */
    const int32_t *lora_slots;                       /* [T] each token's adapter slot, < 0: none; NULL: no adapter */
} LayerStep;

/* y [T, N] (rows y_stride apart) += each token's adapter applied to x [T, K]: (x a_s^T) b_s^T. */
static void add_lora(const LoRASlots *l, const int32_t *slots, const float *x, int64_t T, int64_t K, float *y,
                     int64_t y_stride) {
    if (!l->a || !slots) return;
    const int64_t R = l->rank, PR = l->num_parts * R, N = l->part_offsets[l->num_parts];
    float h[PR];
    for (int64_t t = 0; t < T; t++) {
        const int32_t s = slots[t];
        if (s < 0) continue;
        const float *xt = x + t * K, *a = l->a + (int64_t)s * PR * K, *b = l->b + (int64_t)s * N * R;
        for (int64_t j = 0; j < PR; j++) {
            const float *aj = a + j * K;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += xt[k] * aj[k];
            h[j] = acc;
        }
        for (int64_t p = 0; p < l->num_parts; p++) {
            const float *hp = h + p * R;
            for (int64_t n = l->part_offsets[p]; n < l->part_offsets[p + 1]; n++) {
                const float *bn = b + n * R;
                float acc = 0.0f;
                for (int64_t r = 0; r < R; r++) acc += hp[r] * bn[r];
                y[t * y_stride + n] += acc;
            }
        }
    }
}

static int64_t qkv_width(const DecoderLayer *L) { return (L->num_heads + 2 * L->num_kv_heads) * L->head_dim; }

/* Floats of scratch one token of a step needs. */
int64_t decoder_layer_scratch(const DecoderLayer *L) {
    const int64_t E = L->hidden_size, HD = L->num_heads * L->head_dim;
    return E + qkv_width(L) + HD + L->num_kv_heads * L->head_dim + HD + E + 3 * L->intermediate_size;
}

/* out [T, E] = the layer's output for hidden [T, E]; residual [T, E] is the stream before this
 * layer (first: not read, set to hidden) and leaves as the stream after its attention, which the
 * next layer's input norm adds to out. Returns 0, or the first failing GEMM's status. */
int decoder_layer(const DecoderLayer *L, const LayerStep *s, const float *hidden, float *residual, int first,
                  float *out) {
    const int64_t T = s->num_tokens, E = L->hidden_size, H = L->num_heads, Hkv = L->num_kv_heads;
    const int64_t D = L->head_dim, I = L->intermediate_size, W = qkv_width(L);
    float *normed = s->scratch, *qkv = normed + T * E, *q = qkv + T * W, *k = q + T * H * D;
    float *attn = k + T * Hkv * D, *proj = attn + T * H * D, *gate_up = proj + T * E, *act = gate_up + T * 2 * I;
    int status;

    if (first) {
        memcpy(residual, hidden, T * E * sizeof(float));
        rms_norm(hidden, NULL, L->input_norm, T, E, L->eps, normed, NULL);
    } else {
        rms_norm(hidden, residual, L->input_norm, T, E, L->eps, normed, residual);
    }
    if ((status = ggml_gemm(L->qkv_type, normed, T, E, L->qkv, W, qkv))) return status;
    add_lora(&L->lora[LORA_QKV], s->lora_slots, normed, T, E, qkv, W);
    if (L->qkv_bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < W; i++) qkv[t * W + i] += L->qkv_bias[i];
    rotary(qkv, T, H, D, W, s->positions, L->cos_sin, q);
    rotary(qkv + H * D, T, Hkv, D, W, s->positions, L->cos_sin, k);
    write_rows(k, T, Hkv * D, Hkv * D, s->slots, L->k_cache);
    write_rows(qkv + (H + Hkv) * D, T, Hkv * D, W, s->slots, L->v_cache);
    paged_attention(q, H * D, L->k_cache, L->v_cache, s->block_table, s->block_table_stride, s->query_start,
                    s->seq_lens, s->num_seqs, H, Hkv, D, L->block_size, L->scale, L->sliding_window, 0.0f, NULL,
                    attn);
    if ((status = ggml_gemm(L->o_type, attn, T, H * D, L->o, E, proj))) return status;
    add_lora(&L->lora[LORA_O], s->lora_slots, attn, T, H * D, proj, E);
    rms_norm(proj, residual, L->post_norm, T, E, L->eps, normed, residual);
    if ((status = ggml_gemm(L->gate_up_type, normed, T, E, L->gate_up, 2 * I, gate_up))) return status;
    add_lora(&L->lora[LORA_GATE_UP], s->lora_slots, normed, T, E, gate_up, 2 * I);
    silu_and_mul(gate_up, T, I, act);
    if ((status = ggml_gemm(L->down_type, act, T, I, L->down, E, out))) return status;
    add_lora(&L->lora[LORA_DOWN], s->lora_slots, act, T, I, out, E);
    return 0;
}
