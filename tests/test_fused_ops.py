"""The fused Triton ops of `pagellm.ops` against their PyTorch implementations, and a model run both ways.

Without a GPU the kernels run under Triton's CPU interpreter at small sizes; with one, the same tests
run the compiled kernels at Llama-3.1-8B sizes.
"""
from __future__ import annotations

import subprocess
import sys
import zlib
from collections import Counter
from collections.abc import Callable

import pytest
import torch

# Without a GPU, conftest.py sets TRITON_INTERPRET before this module defines any kernel.
pytest.importorskip("triton")

from attn_utils import build_metadata  # noqa: E402
from pagellm import ops  # noqa: E402
from pagellm.attention import get_attn_backend  # noqa: E402
from pagellm.config.arch import ModelArchConfig  # noqa: E402
from pagellm.models import get_model_class  # noqa: E402
from pagellm.layers import RotaryEmbedding  # noqa: E402
from pagellm.ops.c import cpu_ops  # noqa: E402
from pagellm.ops.triton import activation as triton_activation  # noqa: E402
from pagellm.ops.triton import norm as triton_norm  # noqa: E402
from pagellm.ops.triton import rotary as triton_rotary  # noqa: E402
from pagellm.ops.dispatch import resolve_impl  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# float32: reduction order and fast rsqrt/exp only. bfloat16: an op rounds to bf16 up to twice, each
# rounding off by at most 2**-8 relative; under the interpreter, which truncates instead of rounding
# to nearest, by at most 2**-7.
BF16_RTOL = 2**-6 if ON_GPU else 2**-5
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=BF16_RTOL, atol=1e-5)}

# T = 1 (a decode), odd T, and widths that are not powers of two (SmolLM2's hidden size is 576).
NORM_SHAPES = [(1, 4096), (7, 576), (511, 4096), (512, 8192)] if ON_GPU else [(1, 64), (7, 576), (3, 100)]
# (tokens, intermediate size): x is [T, 2 * I].
SILU_SHAPES = [(1, 14336), (7, 1536), (512, 14336)] if ON_GPU else [(1, 64), (5, 1536), (2, 300)]
# (tokens, query heads, kv heads, head_dim): GQA, MHA, and a head_dim that is not a power of two.
ROPE_SHAPES = (
    [(1, 32, 8, 128), (7, 9, 3, 64), (512, 32, 8, 128), (300, 28, 4, 128)]
    if ON_GPU
    else [(1, 4, 2, 64), (5, 9, 3, 128), (3, 4, 4, 64), (2, 2, 1, 96)]
)
MAX_POSITION = 8192 if ON_GPU else 64
# (rows, vocabulary): Llama-3's and SmolLM2's vocabularies on the GPU; rows within one chunk, a
# chunk and one more, several chunks (4096 columns each).
ARGMAX_SHAPES = [(1, 128256), (256, 128256), (7, 49152)] if ON_GPU else [(1, 4200), (3, 4097), (2, 9000)]


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> torch.Generator:
    """Fresh random inputs for every case, reproducible from the test id."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every float tensor `torch.empty` returns is filled with NaN, so an output element a kernel never
    writes shows up; the tensors made are returned so a test can check an output was one of them."""
    made: list[torch.Tensor] = []
    real_empty = torch.empty

    def nan_empty(*args, **kwargs) -> torch.Tensor:
        tensor = real_empty(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        made.append(tensor)
        return tensor

    monkeypatch.setattr(torch, "empty", nan_empty)
    return made


def randn(rng: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, mean: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=rng) + mean).to(device=DEVICE, dtype=dtype)


def assert_written_and_close(actual: torch.Tensor, expected: torch.Tensor, poisoned: list[torch.Tensor]) -> None:
    assert any(actual is t for t in poisoned), "the output was not allocated through the poisoned torch.empty"
    assert not actual.isnan().any(), "the kernel left output elements unwritten"
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", NORM_SHAPES)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_rms_norm_matches_torch(
    tokens: int, hidden: int, dtype: torch.dtype, strided: bool, rng: torch.Generator, poisoned: list[torch.Tensor]
) -> None:
    pad = 8 if strided else 0  # rows of a wider tensor: row stride != hidden
    x = randn(rng, tokens, hidden + pad, dtype=dtype)[:, :hidden]
    residual = randn(rng, tokens, hidden + pad, dtype=dtype)[:, pad:]
    weight = randn(rng, hidden, dtype=dtype, mean=1.0)
    x_before, residual_before = x.clone(), residual.clone()

    out = ops.rms_norm(x, weight, 1e-5, impl="triton")
    assert_written_and_close(out, ops.rms_norm(x, weight, 1e-5, impl="torch"), poisoned)

    out, new_residual = ops.fused_add_rms_norm(x, residual, weight, 1e-5, impl="triton")
    want_out, want_residual = ops.fused_add_rms_norm(x, residual, weight, 1e-5, impl="torch")
    assert_written_and_close(new_residual, want_residual, poisoned)
    assert_written_and_close(out, want_out, poisoned)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not be modified"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_over_heads_of_a_qkv_view(
    dtype: torch.dtype, rng: torch.Generator, poisoned: list[torch.Tensor]
) -> None:
    """Qwen3 normalises each query head of q = qkv.split(...)[0].view(T, H, D): rows with two strides."""
    tokens, heads, kv_heads, head_dim = (33, 32, 8, 128) if ON_GPU else (3, 4, 2, 64)
    qkv = randn(rng, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = randn(rng, head_dim, dtype=dtype, mean=1.0)
    out = ops.rms_norm(q, weight, 1e-6, impl="triton")
    assert_written_and_close(out, ops.rms_norm(q, weight, 1e-6, impl="torch"), poisoned)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,intermediate", SILU_SHAPES)
def test_silu_and_mul_matches_torch(
    tokens: int, intermediate: int, dtype: torch.dtype, rng: torch.Generator, poisoned: list[torch.Tensor]
) -> None:
    # Scaled so that the gate spans silu's negative tail, its bend and its linear part.
    x = randn(rng, tokens, 2 * intermediate, dtype=torch.float32).mul_(3).to(dtype)
    out = ops.silu_and_mul(x, impl="triton")
    assert out.shape == (tokens, intermediate)
    assert_written_and_close(out, ops.silu_and_mul(x, impl="torch"), poisoned)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=str)
@pytest.mark.parametrize("rows,vocab", ARGMAX_SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "wider_rows", "column_major"])
def test_argmax_matches_torch_with_ties_across_chunks(rows: int, vocab: int, dtype: torch.dtype, layout: str,
                                                       rng: torch.Generator) -> None:
    if layout == "contiguous":
        x = randn(rng, rows, vocab, dtype=dtype)
    elif layout == "wider_rows":  # rows strided past their length (a slice of wider logits)
        x = randn(rng, rows, vocab + 44, dtype=dtype)[:, :vocab]
    else:
        x = randn(rng, vocab, rows, dtype=dtype).t()
    x[0, vocab - 1] = x[0, vocab // 2] = x[0].max() + 1  # a tie: the first index wins, in another chunk
    if rows > 1:
        x[-1, 0] = x[-1].max()  # a tie with the first column
    got = ops.argmax(x, impl="triton")
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[0] == vocab // 2


def test_argmax_leaves_float64_to_torch() -> None:
    x = torch.tensor([[1.0, 1.0 + 1e-12, 0.5]], dtype=torch.float64, device=DEVICE)  # equal in float32
    assert ops.argmax(x, impl="triton").tolist() == [1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_orders_nan_infinities_and_signed_zeros_as_torch(dtype: torch.dtype) -> None:
    vocab = 5000  # two chunks
    x = torch.full((5, vocab), float("-inf"), device=DEVICE, dtype=dtype)  # row 0: all -inf
    x[1, 4500] = x[1, 10] = float("nan")  # NaN is the largest; the first of two
    x[1, 20] = float("inf")
    x[2] = -0.0
    x[2, 4200] = 0.0  # -0 and +0 are equal: the first stays
    x[3] = -3.0
    x[3, vocab - 1] = -2.0  # negatives ordered by value, not by their bits
    x[4, 4100] = float("inf")
    got = ops.argmax(x, impl="triton")
    assert torch.equal(got, x.argmax(dim=-1))
    assert got.tolist() == [0, 10, 0, vocab - 1, 4100]
    assert ops.argmax(x[:0], impl="triton").shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", ROPE_SHAPES)
def test_rotary_embedding_matches_torch_on_qkv_views(
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    rng: torch.Generator,
    poisoned: list[torch.Tensor],
) -> None:
    # q and k as the model makes them: views into one fused qkv projection output.
    qkv = randn(rng, tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    qkv_before = qkv.clone()
    cache = RotaryEmbedding(head_dim, MAX_POSITION, 10000.0).cos_sin_cache.to(DEVICE)
    # Unsorted, repeated, and the last position of the table.
    positions = torch.randint(MAX_POSITION, (tokens,), generator=rng).to(DEVICE)
    positions[-1] = MAX_POSITION - 1

    q_out, k_out = ops.rotary_embedding(positions, q, k, cache, impl="triton")
    q_want, k_want = ops.rotary_embedding(positions, q, k, cache, impl="torch")
    assert_written_and_close(q_out, q_want, poisoned)
    assert_written_and_close(k_out, k_want, poisoned)
    assert torch.equal(qkv, qkv_before), "q and k must not be rotated in place"


def test_dispatch_rule() -> None:
    x = torch.zeros(2, device=DEVICE)
    # The default: Triton for GPU tensors, the C kernels for float32 CPU tensors (tests/test_cpu_kernels.py).
    cpu_default = "cpu" if cpu_ops.available() else "torch"
    assert resolve_impl(x, None) == ("triton" if ON_GPU else cpu_default)
    assert resolve_impl(x.bfloat16(), None) == ("triton" if ON_GPU else "torch")
    assert resolve_impl(x, "torch") == "torch"
    with ops.use_impl("triton"):
        assert resolve_impl(x, None) == "triton"
        assert resolve_impl(x, "torch") == "torch"
    assert resolve_impl(x, None) == ("triton" if ON_GPU else cpu_default)
    with pytest.raises(ValueError, match="impl must be one of torch, triton, cpu"):
        ops.silu_and_mul(x, impl="cuda")  # type: ignore[arg-type]


def test_triton_ops_reject_shapes_they_would_read_out_of_bounds() -> None:
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual must match x"):
        ops.fused_add_rms_norm(x, x[:1], torch.ones(8, device=DEVICE), 1e-6, impl="triton")
    with pytest.raises(ValueError, match="even last dimension"):
        ops.silu_and_mul(x[:, :7], impl="triton")
    q, k = torch.zeros(3, 2, 8, device=DEVICE), torch.zeros(3, 1, 6, device=DEVICE)
    with pytest.raises(ValueError, match=r"argmax takes \[rows, columns\]"):
        ops.argmax(x[0], impl="triton")
    with pytest.raises(ValueError, match="one even head_dim"):
        ops.rotary_embedding(torch.zeros(3, dtype=torch.int64, device=DEVICE), q, k, torch.zeros(4, 8), impl="triton")


@pytest.mark.slow  # a Python process of its own (imports torch): seconds
def test_pagellm_runs_without_triton() -> None:
    """triton is optional: with it unimportable, pagellm imports and a model layer runs on the CPU."""
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, pagellm\n"
        "from pagellm import ops\n"
        "from pagellm.layers import RMSNorm\n"
        "assert not ops.triton_available()\n"
        "print(RMSNorm(8)(torch.ones(2, 8), torch.ones(2, 8))[1].sum().item())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "32.0"


MODEL_CASES = {
    "llama-gqa": ("LlamaForCausalLM", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)),
    # Per-head q/k norms over views of the qkv output.
    "qwen3": ("Qwen3ForCausalLM", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}


def _tiny_model(case: str) -> torch.nn.Module:
    arch, shape = MODEL_CASES[case]
    config = ModelArchConfig.from_hf_dict(
        dict(architectures=[arch], vocab_size=211, intermediate_size=160, num_hidden_layers=2,
             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, **shape)
    )
    with torch.device(DEVICE):
        model = get_model_class(arch)(config, get_attn_backend("torch"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Non-trivial norm weights, and weights large enough that every op moves the logits.
            mean, std = (1.0, 0.2) if "norm" in name else (0.0, 0.1)
            p.copy_(torch.randn(p.shape, generator=gen) * std + mean)
    return model


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts, by name, the calls of each Triton op wrapper from now on."""
    calls: Counter = Counter()

    def counting(fn: Callable, name: str) -> Callable:
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    for module, name in ((triton_norm, "rms_norm"), (triton_norm, "fused_add_rms_norm"),
                         (triton_activation, "silu_and_mul"), (triton_rotary, "rotary_embedding")):
        monkeypatch.setattr(module, name, counting(getattr(module, name), name))
    return calls


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_model_logits_with_fused_ops_match_torch(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_model(case)
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 1, 9]  # a flat batch of three prompts
    input_ids = torch.randint(model.config.vocab_size, (sum(lengths),), generator=gen).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)
    md = build_metadata([(0, n, [i]) for i, n in enumerate(lengths)], block_size=16, device=DEVICE)

    calls = _count_calls(monkeypatch)
    with torch.no_grad():
        with ops.use_impl("torch"):
            want = model.compute_logits(model(input_ids, positions, md))
        assert not calls
        with ops.use_impl("triton"):
            got = model.compute_logits(model(input_ids, positions, md))

    layers = model.config.num_hidden_layers
    per_head_norms = 2 * layers if case == "qwen3" else 0
    # First input norm alone; every later norm adds the residual (the final norm too).
    assert calls == Counter(rms_norm=1 + per_head_norms, fused_add_rms_norm=2 * layers,
                            silu_and_mul=layers, rotary_embedding=layers)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_kernels_replay_in_a_cuda_graph(rng: torch.Generator) -> None:
    """Captured once, replayed on new inputs copied into the same buffers: no host sync, no data-dependent shapes."""
    tokens, hidden, heads, kv_heads, head_dim = 4, 4096, 32, 8, 128
    x, residual = randn(rng, tokens, hidden), randn(rng, tokens, hidden)
    weight = randn(rng, hidden, mean=1.0)
    gate_up = randn(rng, tokens, 2 * 1024)
    q, k = randn(rng, tokens, heads, head_dim), randn(rng, tokens, kv_heads, head_dim)
    positions = torch.zeros(tokens, dtype=torch.int64, device=DEVICE)
    cache = RotaryEmbedding(head_dim, MAX_POSITION, 10000.0).cos_sin_cache.to(DEVICE)

    def step(impl: str) -> list[torch.Tensor]:
        return [*ops.fused_add_rms_norm(x, residual, weight, 1e-5, impl=impl), ops.rms_norm(x, weight, 1e-5, impl=impl),
                ops.silu_and_mul(gate_up, impl=impl), *ops.rotary_embedding(positions, q, k, cache, impl=impl)]

    step("triton")  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step("triton")
    for buf in (x, residual, weight, gate_up, q, k):
        buf.copy_(torch.randn(buf.shape, generator=rng))
    positions.copy_(torch.randint(MAX_POSITION, (tokens,), generator=rng))
    graph.replay()
    for got, want in zip(outs, step("torch")):
        torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_programmatic_dependent_launch_only_on_hopper_and_later(monkeypatch) -> None:
    """`pdl` asks for programmatic dependent launch on a CUDA GPU of compute capability 9 or more,
    and nothing elsewhere: CPU tensors, Triton's interpreter (even with CUDA tensors, and before
    any CUDA call), AMD GPUs, a Triton without grid dependency control."""
    from pagellm.ops.triton import utils as triton_utils

    assert triton_utils.pdl(torch.device("cpu")) == {}
    try:
        triton_utils._pdl_options.cache_clear()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert triton_utils.pdl(torch.device("cuda")) == {}
        if ON_GPU:
            triton_utils._pdl_options.cache_clear()
            monkeypatch.delenv("TRITON_INTERPRET")
            able = (torch.cuda.get_device_capability()[0] >= 9 and not torch.version.hip
                    and triton_utils.gdc_wait is not None)
            assert triton_utils.pdl(torch.device("cuda")) == ({"PDL": True, "launch_pdl": True} if able else {})
    finally:
        triton_utils._pdl_options.cache_clear()


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_a_chain_of_dependent_kernels_replays_in_a_cuda_graph(rng: torch.Generator) -> None:
    """A decode MLP's chain at one row, each kernel reading the one before's output (under PDL on
    Hopper, each waits for it): add + RMSNorm, the one-row product, SiLU, the one-row product, add +
    RMSNorm, replayed in a graph on new inputs, equals the torch ops each time."""
    from pagellm.ops.triton.dense_one_row import dense_gemv

    hidden, inter = 4096, 14336
    x, residual, norm_w = randn(rng, 1, hidden), randn(rng, 1, hidden), randn(rng, hidden, mean=1.0)
    w_gate_up, w_down = randn(rng, 2 * inter, hidden) / hidden**0.5, randn(rng, hidden, inter) / inter**0.5

    def chain(impl: str) -> list[torch.Tensor]:
        normed, res = ops.fused_add_rms_norm(x, residual, norm_w, 1e-5, impl=impl)
        gemv = dense_gemv if impl == "triton" else lambda a, w: a @ w.t()
        act = ops.silu_and_mul(gemv(normed, w_gate_up), impl=impl)
        return [res, *ops.fused_add_rms_norm(gemv(act, w_down), res, norm_w, 1e-5, impl=impl)]

    chain("triton")  # compile and autotune before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain("triton")
    for _ in range(3):
        for buf in (x, residual):
            buf.copy_(torch.randn(buf.shape, generator=rng))
        graph.replay()
        for got, want in zip(outs, chain("torch")):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
