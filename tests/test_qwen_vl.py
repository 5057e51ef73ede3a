"""Qwen2.5-VL and Qwen2-VL against Hugging Face `transformers`: tiny random models built from their
config classes (a vision transformer at the image's resolution, a Qwen2 language model with M-RoPE)
and saved with a tokenizer holding the vision tokens and a 4-pixel-patch image processor. Greedy
tokens and logprobs with one and two images of different sizes (batched, chunked prefill splitting
an image's placeholders, preemption), the prefix cache (the same image hits, another does not),
and the M-RoPE positions and rotation on their own."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from engine_utils import assert_no_leak
from PIL import Image
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from pagellm import LLM, SamplingParams
from pagellm.core.multimodal import MultiModalItem
from pagellm.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from pagellm.worker.mrope import mrope_positions

pytestmark = pytest.mark.slow  # every test builds a Hugging Face reference (importing its modules: seconds)

NEW_TOKENS = 24
VOCAB = 128
IMAGE, START, END, VIDEO = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4
BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20, block_size=BLOCK)
VISION_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"


def image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


# 40x48 pixels: a 10x12 patch grid, 5x6 = 30 placeholders; 24x16: 6x4 patches, 6; 32x32: 16.
PROMPTS = [
    {"prompt": f"t5 t6 t9 {VISION_TOKENS} t7 t8 t9", "multi_modal_data": {"image": image(0, 48, 40)}},
    {"prompt": f"t3 {VISION_TOKENS} t4 t5 t11 t12 {VISION_TOKENS} t6",
     "multi_modal_data": {"image": [image(1, 24, 16), image(2, 32, 32)]}},
    {"prompt": f"t20 t21 t22 t23 t24 t25 {VISION_TOKENS} t30", "multi_modal_data": {"image": [image(3, 16, 32)]}},
    {"prompt": "t40 t41 t42 t43"},  # text only, beside requests with images
]

VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2)


def hf_model(version: str):
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                  bos_token_id=1, eos_token_id=2)
    if version == "2.5":
        # 16-pixel windows (2x2 merged features) in block 0, full attention in block 1.
        vision = dict(VISION, window_size=16, fullatt_block_indexes=[1], out_hidden_size=64)
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens,
                                               architectures=["Qwen2_5_VLForConditionalGeneration"])
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(VISION, embed_dim=32, mlp_ratio=2, hidden_size=64)
        vision.pop("intermediate_size")
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens,
                                            architectures=["Qwen2VLForConditionalGeneration"])
        cls = transformers.Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # larger than the default init, so that images and tokens move the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def save_processor(folder) -> transformers.Qwen2VLImageProcessorPil:
    """A word-level tokenizer with the vision tokens and Qwen2-VL's image processor, saved in `folder`
    (transformers' Qwen2.5-VL processor also needs a video processor, which needs torchvision)."""
    special = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|image_pad|>": IMAGE, "<|vision_start|>": START,
               "<|vision_end|>": END, "<|video_pad|>": VIDEO}
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(3, VIDEO)} | special, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<unk>",
                                                extra_special_tokens=[t for t in special if t.startswith("<|")])
    fast.save_pretrained(folder)
    images = transformers.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                                   min_pixels=8 * 8, max_pixels=64 * 64)
    images.save_pretrained(folder)
    return images


@pytest.fixture(scope="module", params=["2.5", "2"])
def tiny(request, tmp_path_factory):
    """(its folder, the Hugging Face model, its image processor)."""
    folder = tmp_path_factory.mktemp(f"qwen{request.param}vl")
    model = hf_model(request.param)
    model.save_pretrained(folder)
    return folder, model, save_processor(folder)


def hf_logits(model, pixels, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """HF's logits at every position of the prompt and `token_ids` (one forward pass): the prompt's
    image tokens embedded as HF's features, its M-RoPE positions HF's `get_rope_index` and the
    tokens after it its delta on (as HF's generation does; a generated image token stays a token)."""
    inner = model.model
    full = torch.tensor([prompt_ids + token_ids])
    prompt = torch.tensor([prompt_ids])
    embeds = inner.get_input_embeddings()(full)
    features = inner.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"]).pooler_output
    is_image = torch.zeros_like(full, dtype=torch.bool)
    is_image[0, :len(prompt_ids)] = prompt[0] == IMAGE
    embeds[is_image] = torch.cat(features)
    positions, delta = inner.get_rope_index(prompt, (prompt == IMAGE).int(), pixels["image_grid_thw"])
    after = (torch.arange(len(prompt_ids), full.shape[1]) + delta).view(1, 1, -1).expand(3, 1, -1)
    return model(inputs_embeds=embeds, position_ids=torch.cat([positions, after], dim=-1)).logits[0].float()


def assert_matches_hf(model, images_processor, outs, prompts) -> None:
    """Each output is HF's greedy continuation of its prompt and images: the argmax of HF's logits
    at every position, with HF's logprob."""
    for prompt, out in zip(prompts, outs):
        if "multi_modal_data" not in prompt:
            seq = out.outputs[0]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([out.prompt_token_ids + seq.token_ids[:-1]])).logits[0]
            assert logits[len(out.prompt_token_ids) - 1:].argmax(dim=-1).tolist() == seq.token_ids
            continue
        images = prompt["multi_modal_data"]["image"]
        pixels = images_processor(images=images if isinstance(images, list) else [images], return_tensors="pt")
        ids = out.prompt_token_ids
        per_image = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
        assert ids.count(IMAGE) == sum(per_image) and ids.count(START) == len(per_image)
        seq = out.outputs[0]
        assert len(seq.token_ids) == NEW_TOKENS
        with torch.no_grad():
            logits = hf_logits(model, pixels, ids, seq.token_ids[:-1])[len(ids) - 1:]
        assert logits.argmax(dim=-1).tolist() == seq.token_ids
        ref = logits.log_softmax(dim=-1).gather(1, torch.tensor(seq.token_ids)[:, None])[:, 0]
        got = torch.tensor([lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids)])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["batch", "chunked", "preempted"])
def test_greedy_tokens_and_logprobs_match_hf(tiny, variant):
    folder, model, images_processor = tiny
    kwargs = {"batch": {},
              # At most 5 tokens a step: the images' 30, 6, 16 and 8 placeholders span two or more steps.
              "chunked": {"max_num_batched_tokens": 5, "max_num_seqs": 3},
              # Too few blocks for three sequences decoding at once: the latest admitted is preempted.
              "preempted": {"num_gpu_blocks_override": 14, "max_model_len": 80, "max_num_batched_tokens": 80,
                            "max_num_seqs": 3, "enable_prefix_caching": False},
              }[variant]
    llm = LLM(str(folder), **{**CPU, **kwargs})
    runner = llm.llm_engine.engine_core.executor.worker.runner
    encoded = []
    encode = runner.model.encode_images
    runner.model.encode_images = lambda pixels, grids: encoded.append(len(pixels)) or encode(pixels, grids)
    steps = []  # (rotary positions' dims, longest query) of each step
    forward = runner.model.forward
    runner.model.forward = lambda ids, positions, md, *args, **kwargs: steps.append(
        (positions.dim(), md.max_query_len)) or forward(ids, positions, md, *args, **kwargs)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_matches_hf(model, images_processor, outs, PROMPTS)
    if variant == "batch":  # three positions a token for the prompts; decode steps one (the decode graphs')
        assert steps[0] == (2, max(len(out.prompt_token_ids) for out in outs))
        assert {dims for dims, _ in steps[1:]} == {1}
    if variant == "preempted":
        assert llm.llm_engine.engine_core.stats().num_preemptions > 0
    else:  # each image encoded once, however many steps its placeholders took
        assert sum(encoded) == 4
    assert_no_leak(llm.llm_engine)
    assert len(runner.encoder_cache) == 0


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(tiny):
    folder, model, images_processor = tiny
    first = PROMPTS[2]  # t20..t25 <|vision_start|> at positions 0-6, its 8 placeholders 7-14, then 15-16
    other = {**first, "multi_modal_data": {"image": image(4, 16, 32)}}
    llm = LLM(str(folder), **CPU)
    prompts = [first, first, other]
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert_matches_hf(model, images_processor, outs, prompts)
    # The same image: both full blocks of the 17-token prompt hit; another image: none (its
    # placeholders begin in block 0).
    assert [out.num_cached_tokens for out in outs] == [0, 2 * BLOCK, 0]
    assert outs[2].outputs[0].token_ids != outs[0].outputs[0].token_ids


@pytest.mark.parametrize("layout", ["transformers-4.52", "qwen-release"])
def test_other_checkpoint_layouts_load(tiny, tmp_path, layout):
    """transformers 4.52 to 4.57 name the tensors model.visual.* and model.language_model.* (5.x
    saves visual.* and model.*, as the fixture); Qwen's releases keep the language model's fields at
    the top of config.json, M-RoPE in rope_scaling {"type": "mrope"}."""
    folder, model, images_processor = tiny
    for path in folder.iterdir():
        shutil.copy(path, tmp_path / path.name)
    if layout == "transformers-4.52":
        tensors = load_file(folder / "model.safetensors")
        assert any(name.startswith("visual.") for name in tensors)
        renamed = {("model." + name if name.startswith("visual.") else
                    name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name):
                   tensor for name, tensor in tensors.items()}
        save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    else:
        config = json.loads((folder / "config.json").read_text())
        text = config.pop("text_config")
        rope = text.pop("rope_parameters")
        config.update(text, model_type=config["model_type"], rope_theta=rope["rope_theta"],
                      rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
        config["vision_config"]["in_chans"] = 3
        (tmp_path / "config.json").write_text(json.dumps(config))
    outs = LLM(str(tmp_path), **CPU).generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert_matches_hf(model, images_processor, outs, PROMPTS[:2])


def test_bad_images_are_refused(tiny):
    folder, _, _ = tiny
    llm = LLM(str(folder), **CPU)
    with pytest.raises(ValueError, match=r"the prompt has 1 image tokens \('<\|image_pad\|>'\) for 2 images"):
        llm.generate([{**PROMPTS[0], "multi_modal_data": {"image": [image(0, 8, 8), image(1, 8, 8)]}}], GREEDY,
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"multi_modal_data: absolute aspect ratio must be smaller than 200"):
        llm.generate([{**PROMPTS[0], "multi_modal_data": {"image": image(0, 900, 2)}}], GREEDY, use_tqdm=False)
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # the engine still serves


def test_mrope_positions_follow_transformers_get_rope_index():
    config = transformers.Qwen2_5_VLConfig(text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=8,
                                                                    num_hidden_layers=1, num_attention_heads=4),
                                           vision_config=VISION, image_token_id=IMAGE)
    with torch.device("meta"):  # its weights are not needed
        reference = transformers.Qwen2_5_VLModel(config)
    grids = [(1, 4, 6), (1, 6, 2)]  # 6 and 3 placeholders
    ids = [5, START, *[IMAGE] * 6, END, 7, 8, START, *[IMAGE] * 3, END, 9]
    items = []
    for grid in grids:
        offset = ids.index(IMAGE, items[-1].end if items else 0)
        items.append(MultiModalItem(modality="image", content_hash="h", offset=offset, length=grid[1] * grid[2] // 4,
                                    data=b"", shape=(0,), grid_thw=grid))
    ours = mrope_positions(len(ids), items, 2)
    input_ids = torch.tensor([ids])
    positions, delta = reference.get_rope_index(input_ids, (input_ids == IMAGE).int(), torch.tensor(grids))
    assert ours.prompt.tolist() == positions[:, 0].tolist() and ours.delta == int(delta)
    assert (ours.start, ours.end) == (2, 15)


def test_mrope_rotation_is_transformers_and_plain_rope_for_text():
    head_dim, section = 16, [2, 3, 3]
    ours = MRotaryEmbedding(head_dim, 64, 10000.0, section)
    q, k = torch.randn(5, 4, head_dim), torch.randn(5, 2, head_dim)
    positions = torch.tensor([[0, 1, 1, 1, 7], [0, 1, 2, 3, 7], [0, 5, 1, 4, 7]])
    got_q, got_k = ours(positions, q.clone(), k.clone())
    config = transformers.Qwen2_5_VLTextConfig(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    rotary = transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding(config)
    cos, sin = rotary(q, positions[:, None])
    apply = transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.apply_rotary_pos_emb
    want_q, want_k = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=0)
    # Equal positions on all axes (text): the plain rotation, [T] positions taken as such.
    same = torch.tensor([3, 9, 0])
    plain = RotaryEmbedding(head_dim, 64, 10000.0)(same, q[:3].clone(), k[:3].clone())
    for a, b, c in zip(ours(same.expand(3, -1), q[:3].clone(), k[:3].clone()), ours(same, q[:3].clone(),
                                                                                       k[:3].clone()), plain):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=0)
        torch.testing.assert_close(b, c, atol=1e-6, rtol=0)
