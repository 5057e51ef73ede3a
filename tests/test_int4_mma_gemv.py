"""The tensor-core one-row int4 product (`int4_mma_gemv`): every tile kind against float32 (under
Triton's interpreter on the CPU, whose planes are float32; on a GPU, the bfloat16 planes built by
its inline assembly)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagellm.quantization import int4_mma_gemv, triton_matmul  # noqa: E402
from pagellm.quantization.int4 import dequantize, pack_pairs, quantize_rtn  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("n,k,group,zero_point,block_n,split_k", [
    (96, 512, 128, None, 64, 1),  # two tiles of rows, the last partial
    (96, 512, 128, None, 64, 4),  # K split four ways: the last program of each tile sums the parts
    (70, 1024, 256, None, 128, 2),  # groups of two chunks
    (64, 512, 512, 8, 64, 2),  # one group a row, one zero point for every code (symmetric)
])
def test_tensor_core_one_row_product_matches_float32(n, k, group, zero_point, block_n, split_k) -> None:
    gen = torch.Generator().manual_seed(n + k + split_k)
    q, scale, zero = quantize_rtn(torch.randn(n, k, generator=gen) * 0.02, group)
    packed, scale = pack_pairs(q.to(torch.uint8)), scale.half()
    zero = zero.to(torch.uint8) if zero_point is None else torch.full_like(zero, zero_point, dtype=torch.uint8)
    x = torch.randn(1, k, generator=gen).bfloat16()
    expected = x.float() @ dequantize(packed, scale, zero, group).t()
    words, scale_d = packed.to(DEVICE).view(torch.int32), scale.to(DEVICE)
    zero_arg = zero.to(DEVICE) if zero_point is None else scale_d
    config = triton_matmul.triton.Config({"MMA": True, "BLOCK_N": block_n, "SPLIT_K": split_k}, num_warps=2)
    assert int4_mma_gemv.fits(n, k, group, block_n, split_k)
    for _ in range(2):  # the second call finds the counters the first left zeroed
        out = torch.full((1, n), float("nan"), device=DEVICE)
        int4_mma_gemv.launch(config, x.to(DEVICE), words, scale_d, zero_arg, out, n, k, words.stride(0),
                             scale_d.stride(0), zero_arg.stride(0), group, -1 if zero_point is None else zero_point)
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)
    assert not int4_mma_gemv.counters(DEVICE).any()


def test_tensor_core_tiles_are_offered_only_for_layouts_they_take() -> None:
    """bf16 activations, 4-bit codes in groups of whole chunks without GGUF offsets, K split into
    whole chunks: the tensor-core tiles join the CUDA-core ones; elsewhere only the latter."""
    def mma_splits(x_dtype=torch.bfloat16, k=4096, **layout):
        constants = dict(GROUP=128, PACKED=True, ZERO=-1, OFFSET=False, PER_GROUP=True) | layout
        return {c.kwargs["SPLIT_K"] for c in triton_matmul.one_row_tiles(constants, 4096, k, x_dtype)
                if c.kwargs.get("MMA")}

    assert mma_splits() == {1, 2, 4, 8, 16}
    assert mma_splits(k=384) == {1}  # three chunks split no way
    assert mma_splits(GROUP=4096, PER_GROUP=False) == {1, 2, 4, 8, 16}  # one group a row
    assert not mma_splits(GROUP=64)
    assert not mma_splits(GROUP=32, OFFSET=True)  # GGUF's 4-bit blocks
    assert not mma_splits(x_dtype=torch.float16)
    assert not mma_splits(GROUP=0, PACKED=False, ZERO=0, PER_GROUP=False)  # 8-bit codes
