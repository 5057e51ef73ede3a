"""One launch of each kernel under study, for Nsight Compute (registers, occupancy, stall reasons).

The float8-cache decode attention (its `TUNING` entry) and the bf16 one at 256 sequences x 1,536
tokens of Llama-3.1-8B's heads, and the one-row fp8 and int4 (groups of 128) GEMVs at the gate/up
and o projections' shapes with their first tiles. On the GPU machine, from the repository root:

    ncu -k regex:"_paged_attention_kernel|_gemv_kernel" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section InstructionStats python3 -m benchmarks.kernel_probe
"""
from __future__ import annotations

import torch
import triton

from benchmarks.attention_kernel_bench import decode_batch
from benchmarks.quant_gpu import quantized_layouts
from pagellm.attention import triton_kernels as tk
from pagellm.quantization import triton_matmul

SHAPES = {"gate_up": (28672, 4096), "o": (4096, 4096)}


def attention() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        q, cache, table, seq_lens, qsl = decode_batch(256, 1536, gen, dtype)
        tk.paged_attention(torch.empty_like(q), q, *cache, table, seq_lens, qsl, 1, 128 ** -0.5, 1)


def gemv() -> None:
    for n, k in SHAPES.values():
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        layouts = quantized_layouts(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
        for method in ("fp8", "int4_g128"):
            case = layouts[method]
            weight, packed = case["weight"], case["weight"].dtype == torch.uint8
            if packed:
                weight = weight.view(torch.int32)
            zero, zero_const = triton_matmul._zero_args(case["zero"], case["scale"])
            config = triton_matmul._gemv_configs(packed)[0]
            block_n = config.kwargs["BLOCK_N"]
            triton_matmul._gemv_kernel[(triton.cdiv(n, block_n),)](
                x, weight, case["scale"], zero, case["scale"], torch.empty(1, n, device="cuda", dtype=x.dtype),
                n, k, weight.stride(0), case["scale"].stride(0), zero.stride(0), GROUP=case["group"], PACKED=packed,
                ZERO=zero_const, OFFSET=False, PER_GROUP=case["group"] > 0, **config.kwargs,
                num_warps=config.num_warps, num_stages=config.num_stages)


if __name__ == "__main__":
    attention()
    gemv()
    torch.cuda.synchronize()
