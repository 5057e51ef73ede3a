"""The fused MoE kernels (`pagellm.ops.triton.moe`) against the torch oracle of `pagellm.ops.moe`, their
on-device plan, the dispatching `fused_moe`, and the router (`select_experts`) against a per-token
reference and Hugging Face's routers.

Without a GPU the kernels run under Triton's CPU interpreter at small sizes (hidden and intermediate
sizes that no tile divides). Routings mix -1 ids (another rank's experts), uneven loads and an
expert that every token chooses; each check against the oracle is also shown to fail where the
tokens go to other experts.
"""
from __future__ import annotations

import math
import sys
import zlib
from pathlib import Path

import pytest
import torch

# Without a GPU, conftest.py sets TRITON_INTERPRET before this module defines any kernel.
pytest.importorskip("triton")

# `benchmarks` is a folder of the repository, not part of the installed package.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from benchmarks import moe_kernels as moe_benchmark  # noqa: E402
from pagellm.ops.moe import check_moe_inputs, fused_moe, fused_moe_ref, select_experts  # noqa: E402
from pagellm.ops.triton import moe as triton_moe  # noqa: E402
from pagellm.ops.triton import routing as routing_kernels  # noqa: E402
from pagellm.ops.triton.moe import _CONFIGS, MAX_EXPERTS, align_by_expert, choose_config, max_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER = 72, 40  # a whole and a partial step of every tile
# The oracle runs in float32 on the same values. 16-bit runs round silu(gate) * up and each pair's
# weighted row to their type before the sum, and the sum once (the interpreter truncates: 2**-7
# relative each); float32 runs differ only in the order of the sums.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-5, torch.float16: 2**-8}
"""Of the output's largest magnitude."""
ROUTINGS = ["random", "uneven", "one expert for all"]
# (tokens, experts, top_k): decode steps to a prefill, blocks of every size of the config table.
SHAPES = [(1, 8, 2), (1, 16, 4), (3, 4, 1), (7, 16, 2), (16, 8, 4), (33, 4, 2), (64, 4, 4), (64, 16, 1)]
# Each shape with one routing in the quick tier, with the others in the slow one (about a second a
# case under the interpreter).
SHAPE_CASES = [pytest.param(*shape, kind, marks=() if i % len(ROUTINGS) == j else pytest.mark.slow)
               for i, shape in enumerate(SHAPES) for j, kind in enumerate(ROUTINGS)]


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """Fresh random inputs for every case, reproducible from the test id."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def routing(kind: str, tokens: int, experts: int, top_k: int, gen: torch.Generator,
            drop: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) of distinct experts per token, a `drop` share of the ids -1.
    `uneven`: experts chosen with weights falling as 1 / (e + 1)^2; `one expert for all`: expert
    experts - 1 every token's first (never dropped)."""
    if kind == "uneven":
        scores = torch.rand(tokens, experts, generator=gen) * (torch.arange(experts) + 1.0) ** -2
    else:
        scores = torch.rand(tokens, experts, generator=gen)
    if kind == "one expert for all":
        scores[:, -1] = 2.0
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    dropped = torch.rand(tokens, top_k, generator=gen) < drop
    if kind == "one expert for all":
        dropped[:, 0] = False  # the expert every token chooses first
    ids[dropped] = -1
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return weights.to(DEVICE), ids.to(DEVICE)


def experts_weights(gen: torch.Generator, experts: int, dtype: torch.dtype, hidden: int = HIDDEN,
                    inter: int = INTER) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 and w2, scaled so that every product of unit inputs is about 1."""
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def oracle(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
           ids: torch.Tensor, **options) -> torch.Tensor:
    """`fused_moe_ref` in float32 on the same values (`options`: its biases and activation)."""
    options = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    return fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, **options)


def other_experts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Every chosen expert moved to the next: what a kernel reading the wrong expert computes."""
    return torch.where(ids >= 0, (ids + 1) % experts, ids)


def assert_matches_oracle(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          weights: torch.Tensor, ids: torch.Tensor, **options) -> None:
    ref = oracle(x, w13, w2, weights, ids, **options)
    atol = TOLERANCE[x.dtype] * max(ref.abs().max().item(), 1.0)
    assert out.dtype == x.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=atol)
    if (ids >= 0).any():
        wrong = oracle(x, w13, w2, weights, other_experts(ids, w13.shape[0]), **options)
        assert not torch.allclose(out.float(), wrong, rtol=0, atol=atol), "the tolerance hides a wrong expert"


def check_plan(ids: torch.Tensor, experts: int, block_m: int, chunk: int | None = None) -> None:
    """The plan holds every pair of an expert here exactly once, in order, in blocks of its expert."""
    plan = align_by_expert(ids, experts, block_m, chunk)
    flat = ids.reshape(-1).cpu().long()
    num_blocks = max_blocks(flat.numel(), experts, block_m)
    assert plan.num_blocks == num_blocks and plan.sorted_pairs.shape == (num_blocks * block_m,)
    block_expert, block_rows = plan.block_expert.cpu(), plan.block_rows.cpu()
    sorted_pairs = plan.sorted_pairs.cpu().view(num_blocks, block_m)
    used = block_expert >= 0
    assert (block_rows[~used] == 0).all() and ((block_rows[used] >= 1) & (block_rows[used] <= block_m)).all()
    assert torch.equal(used, torch.arange(num_blocks) < used.sum()), "the spare blocks come last"
    for e in range(experts):
        mine = torch.nonzero(block_expert == e).flatten()
        pairs = torch.cat([sorted_pairs[b, :block_rows[b]] for b in mine.tolist()]) if len(mine) else torch.empty(0)
        expected = torch.nonzero(flat == e).flatten()
        assert len(mine) == -(-len(expected) // block_m), f"expert {e}: a block per {block_m} pairs"
        if len(mine):
            assert (mine.diff() == 1).all() and (block_rows[mine[:-1]] == block_m).all()
        assert torch.equal(pairs.long(), expected), f"expert {e}: its pairs, each once, in order"


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("chunk", [None, 16], ids=["one program", "chunks"])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_plan_groups_each_pair_once_by_expert(kind: str, chunk: int | None, block_m: int,
                                              gen: torch.Generator) -> None:
    _, ids = routing(kind, 45, 8, 3, gen)
    check_plan(ids, 8, block_m, chunk)


@pytest.mark.parametrize("experts", [1, 5, 60, 256])
def test_plan_for_expert_counts_that_are_not_powers_of_two(experts: int, gen: torch.Generator) -> None:
    ids = torch.randint(-1, experts, (40, 2), generator=gen, dtype=torch.int32)
    check_plan(ids.to(DEVICE), experts, 16)


def test_plan_of_more_chunks_and_blocks_than_a_tile_holds(gen: torch.Generator) -> None:
    """256 experts: tiles of 32 rows in the planning kernels, here over 38 chunks and 294 blocks."""
    ids = torch.randint(-1, 256, (300, 2), generator=gen, dtype=torch.int32)
    ids[:150, 0] = 7  # an expert of several blocks
    check_plan(ids.to(DEVICE), 256, 16, chunk=16)


def test_plan_skips_ids_of_no_expert_here(gen: torch.Generator) -> None:
    """-1 and ids past the last expert (the GPU cannot check them without a sync) are in no block."""
    ids = torch.tensor([[-1, 3], [4, 0], [-1, -1], [3, 7]], dtype=torch.int32, device=DEVICE)
    plan = align_by_expert(ids, 4, 16)
    assert plan.block_expert.tolist() == [0, 3, -1, -1, -1]  # max_blocks: 1 + 4
    assert plan.block_rows.tolist() == [1, 2, 0, 0, 0]
    assert plan.sorted_pairs[:1].tolist() == [3] and plan.sorted_pairs[16:18].tolist() == [1, 6]
    none_here = align_by_expert(torch.full((5, 2), -1, dtype=torch.int32, device=DEVICE), 4, 16)
    assert (none_here.block_expert == -1).all()


def test_plan_sizes_depend_on_the_shapes_only(gen: torch.Generator) -> None:
    """What a CUDA graph needs: the same buffers whatever the experts chosen."""
    shapes = {tuple(t.shape for t in (p.sorted_pairs, p.block_expert, p.block_rows))
              for p in (align_by_expert(routing(kind, 20, 16, 4, gen)[1], 16, 16) for kind in ROUTINGS)}
    assert len(shapes) == 1


def test_plan_refuses_what_it_cannot_hold() -> None:
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_experts"):
        align_by_expert(ids, MAX_EXPERTS + 1, 16)
    with pytest.raises(ValueError, match="block_m"):
        align_by_expert(ids, 4, 24)
    with pytest.raises(ValueError, match="chunk"):
        align_by_expert(ids, 4, 16, chunk=8)


@pytest.mark.parametrize("tokens,experts,top_k,kind", SHAPE_CASES)
def test_fused_moe_matches_the_oracle(tokens: int, experts: int, top_k: int, kind: str,
                                      gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, experts, torch.float32)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = routing(kind, tokens, experts, top_k, gen)
    assert_matches_oracle(triton_moe.fused_moe(x, w13, w2, weights, ids), x, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (12, 8, 4)])
def test_fused_moe_in_16_bits(tokens: int, experts: int, top_k: int, dtype: torch.dtype,
                              gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, experts, dtype)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    weights, ids = routing("uneven", tokens, experts, top_k, gen)
    assert_matches_oracle(triton_moe.fused_moe(x, w13, w2, weights, ids), x, w13, w2, weights, ids)


@pytest.mark.parametrize("config", [c for _, c in _CONFIGS], ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}")
def test_every_config_of_the_table(config: triton_moe.MoEConfig, gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, 4, torch.float32, hidden=136, inter=80)
    x = torch.randn(12, 136, generator=gen).to(DEVICE)
    weights, ids = routing("uneven", 12, 4, 2, gen)
    assert_matches_oracle(triton_moe.fused_moe(x, w13, w2, weights, ids, config), x, w13, w2, weights, ids)


@pytest.mark.slow  # about half a minute under the interpreter: 160 tokens over many programs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_moe_at_a_larger_size(dtype: torch.dtype, gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, 16, dtype, hidden=200, inter=144)
    x = torch.randn(160, 200, generator=gen).to(DEVICE, dtype)
    weights, ids = routing("uneven", 160, 16, 4, gen)
    assert_matches_oracle(triton_moe.fused_moe(x, w13, w2, weights, ids), x, w13, w2, weights, ids)


def test_choose_config_grows_blocks_with_pairs_per_expert() -> None:
    sizes = [choose_config(tokens * 8, 128, torch.bfloat16).block_m for tokens in (1, 64, 512, 4096)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] > 16
    assert choose_config(8, 128, torch.float32).block_k <= 32, "float32 tiles take half the depth"


def test_fused_moe_is_deterministic_and_leaves_its_inputs(gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, 4, torch.bfloat16)
    x = torch.randn(12, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    weights, ids = routing("one expert for all", 12, 4, 2, gen)
    before = [t.clone() for t in (x, w13, w2, weights, ids)]
    first = triton_moe.fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(first, triton_moe.fused_moe(x, w13, w2, weights, ids))
    assert all(torch.equal(a, b) for a, b in zip(before, (x, w13, w2, weights, ids)))


def test_tokens_without_an_expert_here_get_zero(gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, 4, torch.float32)
    x = torch.randn(6, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = routing("random", 6, 4, 2, gen, drop=0.0)
    ids[2] = -1
    ids[4, 1] = 4  # past the last expert: skipped on the GPU path (checked on the CPU's)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids)
    assert (out[2] == 0).all()
    ids[4, 1] = -1
    assert_matches_oracle(out, x, w13, w2, weights, ids)
    assert triton_moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, HIDDEN)


def test_strided_activations(gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, 4, torch.float32)
    wide = torch.randn(9, 2 * HIDDEN, generator=gen).to(DEVICE)
    x = wide[:, HIDDEN:]  # rows with a stride of their own
    weights, ids = routing("random", 9, 4, 2, gen)
    assert_matches_oracle(triton_moe.fused_moe(x, w13, w2, weights, ids), x, w13, w2, weights, ids)


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton", None])
def test_fused_moe_dispatch(impl: str | None, gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, 8, torch.float32)
    x = torch.randn(10, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = routing("uneven", 10, 8, 2, gen)
    assert_matches_oracle(fused_moe(x, w13, w2, weights, ids, impl=impl), x, w13, w2, weights, ids)


def test_fused_moe_refuses_ids_past_the_experts_on_the_cpu(gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, 4, torch.float32)
    x = torch.randn(3, HIDDEN, generator=gen)
    weights = torch.ones(3, 2)
    for bad in (4, -2):
        ids = torch.tensor([[0, 1], [2, bad], [3, -1]], dtype=torch.int32)
        with pytest.raises(ValueError, match="topk_ids must be -1 or an expert of 0 to 3"):
            fused_moe(x.cpu(), w13.cpu(), w2.cpu(), weights, ids, impl="torch")


@pytest.mark.parametrize("change,field", [
    (lambda a: {**a, "x": a["x"][0]}, "x must be"),
    (lambda a: {**a, "x": a["x"].to(torch.int32)}, "x must be"),
    (lambda a: {**a, "w13": a["w13"][:, :-1]}, "w13 must be"),
    (lambda a: {**a, "w13": a["w13"][..., :-1]}, "w13 must be"),
    (lambda a: {**a, "w2": a["w2"][..., :-1]}, "w2 must be"),
    (lambda a: {**a, "w2": a["w2"].half()}, "w2 must be x's dtype"),
    (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "topk_ids must be"),
    (lambda a: {**a, "topk_ids": a["topk_ids"][:1]}, "topk_ids must be"),
    (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, "topk_weights must be"),
    (lambda a: {**a, "topk_weights": a["topk_weights"].int()}, "topk_weights must be"),
    (lambda a: {**a, "topk_weights": a["topk_weights"].to("meta")}, "one device"),
    (lambda a: {**a, "w13_bias": torch.zeros(4, 2 * INTER - 1, device=DEVICE)}, "w13_bias must be"),
    (lambda a: {**a, "w2_bias": torch.zeros(3, HIDDEN, device=DEVICE)}, "w2_bias must be"),
    (lambda a: {**a, "w2_bias": torch.zeros(4, HIDDEN, device=DEVICE, dtype=torch.float16)}, "w2_bias must be x's"),
    (lambda a: {**a, "w13_bias": torch.zeros(4, 2 * INTER, device="meta")}, "one device"),
    (lambda a: {**a, "activation": "gelu"}, "activation must be one of silu, swigluoai"),
])
def test_bad_inputs_name_the_argument(change, field: str, gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, 4, torch.float32)
    weights, ids = routing("random", 3, 4, 2, gen)
    args = change({"x": torch.randn(3, HIDDEN, generator=gen).to(DEVICE), "w13": w13, "w2": w2,
                   "topk_weights": weights, "topk_ids": ids})
    with pytest.raises(ValueError, match=field):
        check_moe_inputs(**args)
    with pytest.raises(ValueError, match=field):
        fused_moe(**args)


def test_matches_hugging_faces_mixtral_experts(gen: torch.Generator) -> None:
    """The layout is Hugging Face's: its experts module with our weights gives our output."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8,
                                        num_experts_per_tok=2)
    hf = MixtralExperts(config)
    w13, w2 = experts_weights(gen, 8, torch.float32)
    hf.gate_up_proj.data.copy_(w13.cpu())
    hf.down_proj.data.copy_(w2.cpu())
    x = torch.randn(11, HIDDEN, generator=gen)
    weights, ids = routing("uneven", 11, 8, 2, gen, drop=0.0)
    with torch.no_grad():
        expected = hf(x, ids.cpu().long(), weights.cpu())
    for impl in ("torch", "triton"):
        out = fused_moe(x.to(DEVICE), w13, w2, weights, ids, impl=impl)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the benchmark's CPU path: some seconds under the interpreter
def test_benchmark_smoke_checks_and_records_each_case(tmp_path: Path) -> None:
    payload = moe_benchmark.main(["--smoke", "--tokens", "1", "4", "--out-dir", str(tmp_path),
                                  "--sweep", "--sweep-configs", "16,16,64,4,3"])
    records = payload["results"]
    assert all([s["config"] for s in r["sweep"]] == ["16,16,64,4,3"] and r["sweep"][0]["us"] > 0 for r in records)
    assert [(r["model"], r["tokens"]) for r in records] == [(m, t) for m in moe_benchmark.MODELS for t in (1, 4)]
    assert all(r["max_abs_error"] <= moe_benchmark.TOLERANCE * r["max_abs_output"] for r in records)
    assert all(0 < r["experts_read"] <= r["experts"] and r["weight_bytes"] > 0 for r in records)
    assert payload["ceilings"]["copy_bytes_per_s"] > 0 and len(list(tmp_path.glob("moe_kernels*.json"))) == 1


# Experts with biases and GPT-OSS's clamped SwiGLU.

def expert_biases(gen: torch.Generator, experts: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"w13_bias": (torch.randn(experts, 2 * INTER, generator=gen) * 0.5).to(DEVICE, dtype),
            "w2_bias": (torch.randn(experts, HIDDEN, generator=gen) * 0.5).to(DEVICE, dtype)}


OPTIONS = {"silu+biases": ("silu", True), "swigluoai": ("swigluoai", False), "swigluoai+biases": ("swigluoai", True)}


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (16, 8, 4), (33, 4, 2)])
def test_fused_moe_with_biases_and_swigluoai_matches_the_oracle(tokens: int, experts: int, top_k: int, options: str,
                                                                gen: torch.Generator) -> None:
    activation, biased = OPTIONS[options]
    w13, w2 = experts_weights(gen, experts, torch.float32)
    w13 = w13 * 4  # gate and up values past the SwiGLU's clamp at 7
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = routing("uneven", tokens, experts, top_k, gen)
    extra = {"activation": activation, **(expert_biases(gen, experts, torch.float32) if biased else {})}
    out = triton_moe.fused_moe(x, w13, w2, weights, ids, **extra)
    assert_matches_oracle(out, x, w13, w2, weights, ids, **extra)
    # What the check tells apart: the biases and the activation each change the output.
    assert (torch.einsum("th,eih->tei", x.cpu(), w13.cpu()).abs() > 7).any()
    others = [{**extra, "activation": "silu" if activation == "swigluoai" else "swigluoai"}]
    if biased:
        others.append({"activation": activation})
    for other in others:
        assert not torch.allclose(out.float(), oracle(x, w13, w2, weights, ids, **other), rtol=0, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_moe_with_biases_and_swigluoai_in_16_bits(dtype: torch.dtype, gen: torch.Generator) -> None:
    w13, w2 = experts_weights(gen, 8, dtype)
    x = torch.randn(12, HIDDEN, generator=gen).to(DEVICE, dtype)
    weights, ids = routing("uneven", 12, 8, 4, gen)
    extra = {"activation": "swigluoai", **expert_biases(gen, 8, dtype)}
    assert_matches_oracle(triton_moe.fused_moe(x, w13, w2, weights, ids, **extra), x, w13, w2, weights, ids, **extra)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_pairs_of_no_expert_here_add_no_bias(impl: str, gen: torch.Generator) -> None:
    """Another rank's expert (-1) adds neither its product nor its biases: that rank adds them."""
    w13, w2 = experts_weights(gen, 4, torch.float32)
    biases = expert_biases(gen, 4, torch.float32)
    x = torch.randn(5, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = routing("random", 5, 4, 2, gen, drop=0.0)
    ids[1] = -1
    ids[3, 0] = -1
    out = fused_moe(x, w13, w2, weights, ids, impl=impl, activation="swigluoai", **biases)
    assert (out[1] == 0).all()
    alone = fused_moe(x[3:4], w13, w2, weights[3:4, 1:], ids[3:4, 1:], impl=impl, activation="swigluoai", **biases)
    torch.testing.assert_close(out[3:4], alone, rtol=1e-5, atol=1e-5)


def gpt_oss_experts(gen: torch.Generator, experts: int):
    """transformers' GptOssExperts with random weights (gate/up columns interleaved, transposed)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=experts,
                                       num_experts_per_tok=2)
    config._experts_implementation = "eager"
    hf = GptOssExperts(config)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(hf.gate_up_proj.shape, generator=gen) * HIDDEN**-0.5 * 4)
        hf.down_proj.copy_(torch.randn(hf.down_proj.shape, generator=gen) * INTER**-0.5)
        hf.gate_up_proj_bias.copy_(torch.randn(hf.gate_up_proj_bias.shape, generator=gen) * 0.5)
        hf.down_proj_bias.copy_(torch.randn(hf.down_proj_bias.shape, generator=gen) * 0.5)
    return hf


def test_matches_hugging_faces_gpt_oss_experts(gen: torch.Generator) -> None:
    """GPT-OSS's experts in the engine's layout (gate/up de-interleaved, untransposed): its
    experts module gives our output, with its biases, clamps and (up + 1)."""
    hf = gpt_oss_experts(gen, 8)
    gate_up, bias = hf.gate_up_proj.detach().transpose(1, 2), hf.gate_up_proj_bias.detach()
    w13 = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).contiguous()
    w13_bias = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
    w2 = hf.down_proj.detach().transpose(1, 2).contiguous()
    x = torch.randn(11, HIDDEN, generator=gen)
    weights, ids = routing("uneven", 11, 8, 2, gen, drop=0.0)
    with torch.no_grad():
        expected = hf(x, ids.cpu().long(), weights.cpu())
    assert (torch.einsum("th,ehi->tei", x, hf.gate_up_proj.detach()).abs() > 7).any(), "the clamps apply"
    for impl in ("torch", "triton"):
        out = fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights, ids, impl=impl, activation="swigluoai",
                        w13_bias=w13_bias.to(DEVICE), w2_bias=hf.down_proj_bias.detach().to(DEVICE))
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


# The router.

def select_experts_per_token(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str,
                             bias: torch.Tensor | None, num_groups: int | None,
                             topk_groups: int | None) -> tuple[list[list[int]], list[list[float]]]:
    """The router's definition, one token at a time in plain Python: (ids, weights) per token."""
    all_ids, all_weights = [], []
    for row in logits.double().tolist():
        if scoring == "topk_softmax":  # the k largest logits, a softmax over them alone
            ids = sorted(range(len(row)), key=lambda e: -row[e])[:top_k]
            exps = [math.exp(row[e] - row[ids[0]]) for e in ids]
            all_ids.append(ids)
            all_weights.append([v / sum(exps) for v in exps])
            continue
        if scoring == "softmax":
            exps = [math.exp(v - max(row)) for v in row]
            scores = [e / sum(exps) for e in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
        allowed = range(len(row))
        if num_groups is not None and topk_groups is not None and topk_groups < num_groups:
            size = len(row) // num_groups
            group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(num_groups)]
            groups = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
            allowed = [e for e in allowed if e // size in groups]
        ids = sorted(allowed, key=lambda e: -choice[e])[:top_k]
        weights = [scores[e] for e in ids]
        if renormalize:
            weights = [w / sum(weights) for w in weights]
        all_ids.append(ids)
        all_weights.append(weights)
    return all_ids, all_weights


@pytest.mark.parametrize("scoring,renormalize,biased,groups", [
    ("softmax", True, False, None),  # Mixtral, Qwen3-MoE
    ("softmax", False, False, None),  # Qwen2-MoE
    ("sigmoid", True, True, (4, 2)),  # DeepSeek-V3
    ("sigmoid", False, False, (4, 1)),
    ("sigmoid", True, True, None),
    ("softmax", True, False, (4, 4)),  # as many groups kept as there are: no grouping
    ("topk_softmax", False, False, None),  # GPT-OSS
])
def test_select_experts_matches_its_definition(scoring: str, renormalize: bool, biased: bool,
                                               groups: tuple[int, int] | None, gen: torch.Generator) -> None:
    logits = torch.randn(9, 16, generator=gen) * 2
    bias = torch.randn(16, generator=gen) * 0.5 if biased else None
    num_groups, topk_groups = groups or (None, None)
    weights, ids = select_experts(logits, 4, renormalize, scoring, bias, num_groups, topk_groups)
    expected_ids, expected_weights = select_experts_per_token(logits, 4, renormalize, scoring, bias, num_groups,
                                                              topk_groups)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.tolist() == expected_ids
    torch.testing.assert_close(weights, torch.tensor(expected_weights, dtype=torch.float32), rtol=1e-6, atol=1e-6)


def test_select_experts_grouping_changes_the_choice(gen: torch.Generator) -> None:
    """A case where the best experts sit in one group: with one group kept, only its experts are chosen."""
    logits = torch.full((1, 8), -4.0)
    logits[0, [0, 1, 4]] = torch.tensor([3.0, 2.9, 3.5])
    _, free = select_experts(logits, 2, True, "sigmoid")
    _, grouped = select_experts(logits, 2, True, "sigmoid", num_groups=2, topk_groups=1)
    assert sorted(free[0].tolist()) == [0, 4] and sorted(grouped[0].tolist()) == [0, 1]


def hf_router(family: str, experts: int, top_k: int, **config):
    """Hugging Face's router of `family` at a tiny hidden size, with random weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    classes = {
        "mixtral": (transformers.MixtralConfig, MixtralTopKRouter, {"num_local_experts": experts}),
        "qwen2_moe": (transformers.Qwen2MoeConfig, Qwen2MoeTopKRouter, {"num_experts": experts}),
        "qwen3_moe": (transformers.Qwen3MoeConfig, Qwen3MoeTopKRouter, {"num_experts": experts}),
        "deepseek_v3": (transformers.DeepseekV3Config, DeepseekV3TopkRouter, {"n_routed_experts": experts}),
        "gpt_oss": (transformers.GptOssConfig, GptOssTopKRouter, {"num_local_experts": experts}),
    }
    config_class, router_class, experts_field = classes[family]
    router = router_class(config_class(hidden_size=32, num_experts_per_tok=top_k, **experts_field, **config))
    with torch.no_grad():
        for p in router.parameters():
            p.normal_(generator=torch.Generator().manual_seed(len(family)))
    return router


@pytest.mark.parametrize("family,config,renormalize", [
    ("mixtral", {}, True),
    ("qwen2_moe", {"norm_topk_prob": False}, False),
    ("qwen2_moe", {"norm_topk_prob": True}, True),
    ("qwen3_moe", {"norm_topk_prob": True}, True),
    ("gpt_oss", {}, True),  # softmax over the top-k logits (with the router's bias): renormalised softmax
])
def test_select_experts_matches_hugging_faces_softmax_routers(family: str, config: dict, renormalize: bool,
                                                              gen: torch.Generator) -> None:
    router = hf_router(family, 16, 4, **config)
    hidden = torch.randn(13, 32, generator=gen)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(logits, 4, renormalize)
    assert ids.long().tolist() == hf_ids.tolist()
    torch.testing.assert_close(weights, hf_weights.float(), rtol=1e-5, atol=1e-6)


def test_select_experts_matches_deepseek_v3s_grouped_sigmoid_router(gen: torch.Generator) -> None:
    router = hf_router("deepseek_v3", 16, 4, n_group=4, topk_group=2, norm_topk_prob=True,
                       routed_scaling_factor=1.0)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(generator=gen)
        logits, hf_weights, hf_ids = router(torch.randn(13, 32, generator=gen))
    weights, ids = select_experts(logits, 4, True, "sigmoid", router.e_score_correction_bias, 4, 2)
    # DeepSeek's top-k is unsorted: compare each token's (id, weight) pairs as sets.
    order, hf_order = ids.argsort(dim=1), hf_ids.argsort(dim=1)
    assert ids.gather(1, order).long().tolist() == hf_ids.gather(1, hf_order).tolist()
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-5, atol=1e-6)


def test_gpt_oss_router_topk_softmax(gen: torch.Generator) -> None:
    """GPT-OSS's router (its bias included in the logits): top-k of the logits, a softmax over those;
    the same weights as the renormalized softmax over every expert."""
    router = hf_router("gpt_oss", 16, 4)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(torch.randn(13, 32, generator=gen))
    weights, ids = select_experts(logits, 4, False, "topk_softmax")
    assert ids.long().tolist() == hf_ids.tolist()
    torch.testing.assert_close(weights, hf_weights.float(), rtol=1e-6, atol=1e-7)
    renormalized, same_ids = select_experts(logits, 4, True)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(weights, renormalized, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="topk_softmax takes no correction_bias"):
        select_experts(logits, 4, False, "topk_softmax", correction_bias=torch.zeros(16))


# The routing kernel (`pagellm.ops.triton.routing`): select_experts' softmax scorings in one launch.

@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 60, 4), (33, 128, 8), (3, 16, 1)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("topk_softmax", False)])
def test_routing_kernel_matches_the_definition(tokens: int, experts: int, top_k: int, scoring: str,
                                               renormalize: bool, gen: torch.Generator) -> None:
    logits = torch.randn(tokens, experts, generator=gen) * 2
    weights, ids = routing_kernels.select_experts(logits.to(DEVICE), top_k, renormalize, scoring)
    expected_ids, expected_weights = select_experts_per_token(logits, top_k, renormalize, scoring, None, None, None)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.cpu().tolist() == expected_ids
    torch.testing.assert_close(weights.cpu(), torch.tensor(expected_weights, dtype=torch.float32), rtol=1e-5,
                               atol=1e-6)


def test_routing_kernel_reads_16_bit_strided_logits_and_breaks_ties_to_the_lower_id(gen: torch.Generator) -> None:
    wide = (torch.randn(6, 40, generator=gen) * 2).to(torch.bfloat16)
    logits = wide[:, :32]  # rows 40 apart
    logits[0, [3, 9, 20]] = 8.0  # three-way tie at the top of row 0
    weights, ids = routing_kernels.select_experts(logits.to(DEVICE), 4, True)
    expected_ids, expected_weights = select_experts_per_token(logits.float(), 4, True, "softmax", None, None, None)
    assert ids[0, :3].tolist() == [3, 9, 20]
    assert [sorted(row) for row in ids.cpu().tolist()] == [sorted(row) for row in expected_ids]
    torch.testing.assert_close(weights.cpu().sort(dim=1).values,
                               torch.tensor(expected_weights).sort(dim=1).values, rtol=1e-5, atol=1e-6)


def test_select_experts_takes_the_kernel_where_it_applies(gen: torch.Generator) -> None:
    """impl="triton": the kernel for the softmax scorings at a power-of-two top_k; the torch path
    (the same answer) for the others."""
    logits = torch.randn(7, 16, generator=gen).to(DEVICE)
    assert all(torch.equal(a, b) for a, b in zip(select_experts(logits, 4, True, impl="triton"),
                                                  routing_kernels.select_experts(logits, 4, True)))
    bias = torch.randn(16, generator=gen).to(DEVICE)
    for args in ((3, True, "softmax"), (4, True, "sigmoid", bias)):
        assert not routing_kernels.supports(args[0], 16, args[2], args[3] if len(args) > 3 else None, None)
        for a, b in zip(select_experts(logits, *args, impl="triton"), select_experts(logits, *args, impl="torch")):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="power-of-two top_k"):
        routing_kernels.select_experts(logits, 3, True)
