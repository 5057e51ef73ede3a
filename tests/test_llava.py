"""LLaVA-1.5 against Hugging Face `transformers`: a tiny random `LlavaForConditionalGeneration` (CLIP
vision tower, projector, Llama) built from `LlavaConfig` and saved with its processor (a tokenizer
with the `<image>` token, a 32x32 CLIP image processor: 16 placeholder tokens an image). Greedy
tokens and logprobs with one and two images of different sizes (batched, chunked prefill splitting
an image's placeholders, preemption), the prefix cache (the same image hits, another image with the
same text does not), and an image sent to a text-only model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from engine_utils import assert_no_leak
from family_utils import save_with_tokenizer
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

from pagellm import LLM, SamplingParams
from pagellm.config.arch import ModelArchConfig
from pagellm.core.multimodal import MultiModalItem
from pagellm.engine import wire
from pagellm.worker.encoder_cache import EncoderCache, ScheduledImage

NEW_TOKENS = 24
VOCAB = 128
IMAGE_TOKEN = VOCAB - 1
IMAGE_TOKENS = 16  # (32 / 8) ** 2 patches, the class token dropped ("default" strategy)
BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20, block_size=BLOCK)


def image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


PROMPTS = [
    {"prompt": "t5 t6 t9 <image> t7 t8 t9", "multi_modal_data": {"image": image(0, 40, 50)}},
    {"prompt": "t3 <image> t4 t5 t11 t12 <image> t6", "multi_modal_data": {"image": [image(1, 64, 48),
                                                                                     image(2, 20, 30)]}},
    {"prompt": "t20 t21 t22 t23 t24 t25 t26 t27 t28 <image> t30",
     "multi_modal_data": {"image": [image(3, 33, 33)]}},
]


def hf_llava():
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                      architectures=["LlavaForConditionalGeneration"])
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the default init, so that images and tokens move the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def hf_processor() -> transformers.LlavaProcessor:
    # Special tokens named apart from the words: an added token matches inside words ("t1" in "t12").
    vocab = ({f"t{i}": i for i in range(3, VOCAB - 1)} | {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": IMAGE_TOKEN})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<unk>", extra_special_tokens=["<image>"])
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return transformers.LlavaProcessor(image_processor=images, tokenizer=fast, patch_size=8,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(its folder, the Hugging Face model, its processor)."""
    folder = tmp_path_factory.mktemp("llava")
    model = hf_llava()
    model.save_pretrained(folder)
    processor = hf_processor()
    processor.save_pretrained(folder)
    return folder, model, processor


def assert_matches_hf(model, processor, outs, prompts) -> None:
    """Each output is HF's greedy continuation of its prompt and images: the argmax of HF's logits
    at every position (one forward pass over the prompt and the tokens before it), with HF's logprob."""
    for prompt, out in zip(prompts, outs):
        images = prompt["multi_modal_data"]["image"]
        inputs = processor(text=prompt["prompt"], images=images if isinstance(images, list) else [images],
                           return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        assert out.prompt_token_ids == ids
        seq = out.outputs[0]
        assert len(seq.token_ids) == NEW_TOKENS
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + seq.token_ids[:-1]]),
                           pixel_values=inputs["pixel_values"]).logits[0, len(ids) - 1:].float()
        assert logits.argmax(dim=-1).tolist() == seq.token_ids
        ref = logits.log_softmax(dim=-1).gather(1, torch.tensor(seq.token_ids)[:, None])[:, 0]
        got = torch.tensor([lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids)])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["batch", "chunked", "preempted"])
def test_greedy_tokens_and_logprobs_match_hf(tiny, variant):
    folder, model, processor = tiny
    kwargs = {"batch": {},
              # At most 6 tokens a step: every image's 16 placeholders span three or more steps.
              "chunked": {"max_num_batched_tokens": 6, "max_num_seqs": 3},
              # Too few blocks for three sequences decoding at once: the latest admitted is preempted.
              "preempted": {"num_gpu_blocks_override": 14, "max_model_len": 64, "max_num_batched_tokens": 64,
                            "max_num_seqs": 3, "enable_prefix_caching": False},
              }[variant]
    llm = LLM(str(folder), **{**CPU, **kwargs})
    runner = llm.llm_engine.engine_core.executor.worker.runner
    encoded = []
    encode = runner.model.encode_images
    runner.model.encode_images = lambda pixels, grids: encoded.append(len(pixels)) or encode(pixels, grids)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_matches_hf(model, processor, outs, PROMPTS)
    if variant == "preempted":
        assert llm.llm_engine.engine_core.stats().num_preemptions > 0
    else:  # each image encoded once, however many steps its placeholders took
        assert sum(encoded) == 4
    assert_no_leak(llm.llm_engine)
    assert len(runner.encoder_cache) == 0


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(tiny):
    folder, model, processor = tiny
    first = PROMPTS[2]  # its image's placeholders are positions 9 to 24: blocks 1, 2 and 3
    other = {**first, "multi_modal_data": {"image": image(4, 33, 33)}}
    longer = {**first, "prompt": first["prompt"].replace("t30", "t31 t32 t33 t34 t35 t36 t37")}
    llm = LLM(str(folder), **CPU)
    prompts = [first, first, other, longer]
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert_matches_hf(model, processor, outs, prompts)
    # The same image: every full block of the prompt (26 tokens) hits; another image: only the
    # block before its placeholders; the same image and other text after it: the blocks before the
    # one holding its last placeholder, which is computed from the image's features again.
    assert [out.num_cached_tokens for out in outs] == [0, 3 * BLOCK, BLOCK, 3 * BLOCK]
    assert outs[2].outputs[0].token_ids != outs[0].outputs[0].token_ids


def test_an_image_for_a_text_only_model_is_refused(tmp_path):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, architectures=["LlamaForCausalLM"])
    save_with_tokenizer(transformers.LlamaForCausalLM(config), tmp_path)
    llm = LLM(str(tmp_path), **CPU)
    with pytest.raises(ValueError, match=r"multi_modal_data: this model takes text only.*\(LlamaForCausalLM\)"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_a_text_config_that_lists_only_its_differences_takes_transformers_defaults():
    # llava-hf/llava-1.5-7b-hf's config.json, its vision_config shortened.
    arch = ModelArchConfig.from_hf_dict({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
        "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                        "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "model_type": "clip_vision_model"}})
    assert (arch.architecture, arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers,
            arch.num_key_value_heads, arch.head_dim, arch.max_position_embeddings, arch.rms_norm_eps) == (
        "LlavaForConditionalGeneration", 32064, 4096, 11008, 32, 32, 128, 4096, 1e-05)
    assert arch.hf_config["image_token_index"] == 32000 and arch.hf_config["model_type"] == "llama"


def test_a_record_with_images_crosses_the_wire(tiny):
    folder, _, _ = tiny
    llm = LLM(str(folder), **CPU)
    record, _ = llm.llm_engine.processor.process("r", PROMPTS[1], GREEDY)
    assert wire.input_decoder.decode(wire.encoder.encode(record)).multi_modal == record.multi_modal


def test_adjacent_images_get_one_run_each_and_a_count_mismatch_is_refused(tiny):
    folder, model, processor = tiny
    prompt = {"prompt": "t5 <image><image> t6", "multi_modal_data": {"image": [image(5, 32, 40), image(6, 50, 32)]}}
    llm = LLM(str(folder), **CPU)
    record, _ = llm.llm_engine.processor.process("r", prompt, GREEDY)
    assert [(item.offset, item.length) for item in record.multi_modal] == [(1, IMAGE_TOKENS), (17, IMAGE_TOKENS)]
    assert len({item.content_hash for item in record.multi_modal}) == 2
    assert_matches_hf(model, processor, llm.generate([prompt], GREEDY, use_tqdm=False), [prompt])
    with pytest.raises(ValueError, match=r"the prompt has 1 image tokens \('<image>'\) for 2 images"):
        llm.generate([{**prompt, "prompt": "t5 <image> t6"}], GREEDY, use_tqdm=False)
    for no_image in ("t5 <image> t6", [5, IMAGE_TOKEN, 6]):
        with pytest.raises(ValueError, match=r"the prompt holds the image token \(id 127\) but no image"):
            llm.generate([no_image], GREEDY, use_tqdm=False)


def test_the_encoder_cache_keeps_features_while_a_request_needs_them():
    item = MultiModalItem(modality="image", content_hash="h", offset=2, length=4,
                          data=np.arange(6, dtype=np.float32).tobytes(), shape=(1, 2, 3))
    encoded = []

    def encode(pixels, grids):  # features row j of an image: j + its pixels' sum
        encoded.append(len(pixels))
        return pixels.flatten(1).sum(1)[:, None, None] + torch.arange(4.0)[None, :, None]

    cache = EncoderCache()
    # Request a computes placeholders 0-1 at rows 5-6, b all four at rows 0-3; then a the rest.
    rows, features = cache.embeds([ScheduledImage("a", item, 5, 0, 2, False), ScheduledImage("b", item, 0, 0, 4, True)],
                                  encode, torch.device("cpu"))
    assert rows.tolist() == [5, 6, 0, 1, 2, 3] and features[:, 0].tolist() == [15, 16, 15, 16, 17, 18]
    assert len(cache) == 1  # a still needs it
    rows, features = cache.embeds([ScheduledImage("a", item, 0, 2, 2, True)], encode, torch.device("cpu"))
    assert features[:, 0].tolist() == [17, 18] and encoded == [1] and len(cache) == 0
    cache.embeds([ScheduledImage("c", item, 0, 0, 1, False)], encode, torch.device("cpu"))
    cache.release({"c"})  # freed (preempted) before its image was done
    assert len(cache) == 0 and encoded == [1, 1]
