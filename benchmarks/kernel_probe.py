"""One launch of each kernel under study, for Nsight Compute (registers, occupancy, stall reasons).

The float8-cache decode attention (its `TUNING` entry) and the bf16 one at 256 sequences x 1,536
tokens of Llama-3.1-8B's heads, and the one-row fp8 and int4 (groups of 128) GEMVs at the gate/up
and o projections' shapes with their first tiles. `benchmarks/results/ncu_kernel_probe_h200_*.txt`
holds a run. On the GPU machine, from the repository root:

    ncu -k regex:"_paged_attention_kernel|_gemv_kernel" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section InstructionStats python3 -m benchmarks.kernel_probe
"""
from __future__ import annotations

import torch

from benchmarks.attention_kernel_bench import decode_batch
from benchmarks.gemv_sweep import _launch
from benchmarks.quant_gpu import SHAPES, quantized_layouts
from pagellm.ops.triton import attention as tk
from pagellm.ops.triton import matmul as triton_matmul


def attention() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        q, cache, table, seq_lens, qsl = decode_batch(256, 1536, gen, dtype)
        tk.paged_attention(torch.empty_like(q), q, *cache, table, seq_lens, qsl, 1, 128 ** -0.5, 1)


def gemv() -> None:
    """The fp8 and int4 one-row kernels with their first tiles, at the gate/up and o shapes."""
    for layer in ("gate_up", "o"):
        n, k = SHAPES[layer]
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        layouts = quantized_layouts(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
        for method in ("fp8", "int4_g128"):
            config = triton_matmul._gemv_configs(method == "int4_g128")[0]
            tile = (config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"], config.num_warps, config.num_stages)
            _launch(layouts[method], x, torch.empty(1, n, device="cuda", dtype=x.dtype), n, k, tile)()


if __name__ == "__main__":
    attention()
    gemv()
    torch.cuda.synchronize()
