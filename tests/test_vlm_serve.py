"""Chat image_url parts, offline (`LLM.chat`) and through `pagellm serve` with the openai SDK, on the tiny
random LLaVA of test_llava.py saved with a chat template that loops over a message's content parts:
greedy tokens against Hugging Face's processor chat template and `generate`, data / http / file URLs,
the prefix cache with images, and each bad input refused by name (HTTP 400 on the server)."""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
import torch
import transformers
from family_utils import save_with_tokenizer
from PIL import Image
from server_utils import RemoteServer, metric_samples
from test_llava import BLOCK, CPU, VOCAB, hf_llava, hf_processor, image
from test_web_ui import (
    RECORD_REQUESTS,
    console_errors,
    open_chat,
    reply_state,
    send_message,
    set_field,
    start_browser,
    wait,
)

from benchmarks import vlm_models, vlm_serving
from pagellm import LLM, SamplingParams
from pagellm.cli.main import build_parser
from pagellm.config import MultiModalConfig
from pagellm.config.arch import ModelArchConfig
from pagellm.engine.multimodal import ImageProcessor
from pagellm.entrypoints.chat_images import split_images
from pagellm.entrypoints.media import MediaLimits, load, load_async
from pagellm.tokenizer.chat_template import iterates_message_content
from pagellm.tokenizer.tokenizer import load_tokenizer_at

TEMPLATE = ("{% for message in messages %}{{ 't40 ' if message['role'] == 'user' else 't42 ' }}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image> "
            "{% else %}{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}"
            "{% if add_generation_prompt %}t41{% endif %}")
"""Typed parts, as multimodal processors' templates take them (in the test tokenizer's words)."""
TEXT_TEMPLATE = "{% for message in messages %}t40 {{ message['content'] }} {% endfor %}t41"
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def png(picture: Image.Image) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(picture: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(picture)).decode()


def conversation(*urls: str, text: str = "t5 t6 t9 t10 t11 t12 t13 t14 t15") -> list[dict]:
    parts = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in urls),
             {"type": "text", "text": "t7 t8"}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(its folder, the Hugging Face model, its processor with the chat template)."""
    folder = tmp_path_factory.mktemp("llava-chat")
    model = hf_llava()
    model.save_pretrained(folder)
    processor = hf_processor()
    processor.chat_template = TEMPLATE
    processor.save_pretrained(folder)
    return folder, model, processor


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A folder of allowed images, and a file outside it."""
    allowed = tmp_path_factory.mktemp("allowed")
    (allowed / "a.png").write_bytes(png(image(11, 40, 30)))
    outside = tmp_path_factory.mktemp("outside") / "b.png"
    outside.write_bytes(png(image(12, 40, 30)))
    return allowed, outside


def hf_greedy(model, processor, messages) -> list[int]:
    """HF's greedy continuation of the conversation, its images given as PIL images."""
    hf_messages = []
    for message in messages:
        parts = [{"type": "image", "image": _decoded(p["image_url"]["url"])} if p["type"] == "image_url" else p
                 for p in message["content"]]
        hf_messages.append({**message, "content": parts})
    inputs = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _decoded(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_a_template_that_loops_over_content_gets_typed_parts_and_a_text_template_the_image_token():
    assert iterates_message_content(TEMPLATE) and not iterates_message_content(TEXT_TEMPLATE)
    messages = conversation("data:image/png;base64,AAAA")
    assert split_images(messages, TEMPLATE, "<image>").messages[0]["content"] == [
        {"type": "text", "text": "t5 t6 t9 t10 t11 t12 t13 t14 t15"}, {"type": "image"},
        {"type": "text", "text": "t7 t8"}]
    text = split_images(messages, TEXT_TEMPLATE, "<image>")
    assert text.messages[0]["content"] == "<image>\nt5 t6 t9 t10 t11 t12 t13 t14 t15\nt7 t8"
    assert text.image_urls == [("data:image/png;base64,AAAA", "messages[0].content[1]")]
    # Without images, text parts are joined as before.
    assert split_images([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                        TEMPLATE, "<image>").messages[0]["content"] == "a\nb"


def test_a_processors_chat_template_json_is_read_when_there_is_no_jinja_file(tiny, tmp_path):
    folder, _, _ = tiny
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert load_tokenizer_at(str(tmp_path)).chat_template == TEMPLATE


def test_offline_chat_with_images_matches_hf(tiny, media):
    folder, model, processor = tiny
    allowed, _ = media
    llm = LLM(str(folder), **CPU, allowed_local_media_path=str(allowed))
    conversations = [conversation(data_url(image(0, 40, 50))),
                     conversation(data_url(image(1, 64, 48)), data_url(image(2, 20, 30)), text="t3 t4")]
    outs = llm.chat(conversations, GREEDY, use_tqdm=False)
    for messages, out in zip(conversations, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, processor, messages)
    stats = llm.llm_engine.engine_core.stats()
    assert stats.mm_encoder_images == 3 and stats.mm_encoder_seconds > 0  # three distinct images, each once
    # A file under the allowed folder is the same image as its data URL.
    by_file = llm.chat(conversation((allowed / "a.png").as_uri()), GREEDY, use_tqdm=False)[0]
    by_data = llm.chat(conversation(data_url(image(11, 40, 30))), GREEDY, use_tqdm=False)[0]
    assert by_file.outputs[0].token_ids == by_data.outputs[0].token_ids
    assert by_file.prompt_token_ids == by_data.prompt_token_ids


@pytest.mark.parametrize("url, message", [
    ("ftp://example.com/a.png", r"messages\[0\].content\[1\]: unsupported image URL scheme 'ftp'"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), r"could not be decoded"),
    ("data:image/png;base64,@@@", r"not valid base64"),
    ("file:///etc/hostname", r"is outside --allowed-local-media-path"),
])
def test_offline_bad_images_are_refused_by_part(tiny, media, url, message):
    folder, _, _ = tiny
    allowed, _ = media
    llm = LLM(str(folder), **CPU, allowed_local_media_path=str(allowed))
    with pytest.raises(ValueError, match=message):
        llm.chat(conversation(url), GREEDY, use_tqdm=False)


def test_offline_limits_file_urls_and_text_only_models(tiny, media, tmp_path):
    folder, _, _ = tiny
    allowed, outside = media
    llm = LLM(str(folder), **CPU, limit_mm_per_prompt={"image": 1})
    two = [image(1, 64, 48), image(2, 20, 30)]
    with pytest.raises(ValueError, match=r"carries 2 images, more than the 1 allowed per prompt"):
        llm.chat(conversation(*map(data_url, two)), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"carries 2 images, more than the 1 allowed per prompt"):
        llm.generate({"prompt": "t3 <image> t4 <image>", "multi_modal_data": {"image": two}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"file:// URLs are refused unless .* --allowed-local-media-path"):
        llm.chat(conversation(outside.as_uri()), GREEDY, use_tqdm=False)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, architectures=["LlamaForCausalLM"])
    save_with_tokenizer(transformers.LlamaForCausalLM(config), tmp_path)
    text_only = LLM(str(tmp_path), **CPU)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[1\]: this model takes text only"):
        text_only.chat(conversation(data_url(two[0])), GREEDY, use_tqdm=False, chat_template=TEXT_TEMPLATE)


# -- the server --------------------------------------------------------------------------------------


class _ImageHandler(BaseHTTPRequestHandler):
    body = png(image(21, 36, 28))

    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    """An HTTP server of one PNG at any path."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def silent_host():
    """A socket that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/never.png"
    listener.close()


def test_http_images_are_capped_in_size_time_and_host(image_host, silent_host):
    body = _ImageHandler.body
    anywhere = MultiModalConfig.parse(None, None, None)
    url = f"{image_host}/a.png"
    with ThreadPoolExecutor(1) as pool:
        def both(limits: MediaLimits, target: str) -> list:
            return [load(target, limits, "p"), asyncio.run(load_async(target, limits, "p", pool))]
        assert [i.size for i in both(MediaLimits(anywhere), url)] == [(36, 28)] * 2
        for target, limits, message in [
                (url, MediaLimits(anywhere, max_bytes=len(body) - 1), f"larger than {len(body) - 1} bytes"),
                (silent_host, MediaLimits(anywhere, fetch_timeout_s=0.5), "timed out after 0.5 s"),
                (url, MediaLimits(MultiModalConfig.parse(None, None, "example.com")), "not among"),
                (f"{image_host}/a.png".replace("http", "gopher"), MediaLimits(anywhere), "unsupported image URL")]:
            with pytest.raises(ValueError, match=message):
                load(target, limits, "p")
            with pytest.raises(ValueError, match=message):
                asyncio.run(load_async(target, limits, "p", pool))


def test_the_media_flags_parse_as_vllms(tmp_path):
    ns = build_parser().parse_args(["serve", "m", "--allowed-media-domains", "a.com", "B.org,c.net",
                                    "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path",
                                    str(tmp_path)])
    config = MultiModalConfig.parse(ns.limit_mm_per_prompt, ns.allowed_local_media_path, ns.allowed_media_domains)
    assert config.allowed_media_domains == ("a.com", "b.org", "c.net") and config.limit_per_prompt == {"image": 2}
    for bad, message in [({"video": 1}, r"--limit-mm-per-prompt\) has unknown key\(s\) video"),
                         ({"image": -1}, "image must be a non-negative integer"), ("{", "is not valid JSON")]:
        with pytest.raises(ValueError, match=message):
            MultiModalConfig.parse(bad, None, None)
    with pytest.raises(ValueError, match=r"--allowed-local-media-path\) must be an existing folder"):
        MultiModalConfig.parse(None, str(tmp_path / "missing"), None)


@pytest.fixture(scope="module")
def server(tiny, media):
    folder, _, _ = tiny
    allowed, _ = media
    remote = RemoteServer(str(folder), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
                          "--kv-cache-memory-bytes", str(4 << 20), "--block-size", str(BLOCK),
                          "--allowed-local-media-path", str(allowed), "--limit-mm-per-prompt", '{"image": 2}',
                          env={"PAGELLM_IMAGE_FETCH_TIMEOUT": "10"})
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict]):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          max_tokens=NEW_TOKENS, temperature=0.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.mark.slow
def test_server_matches_offline_for_data_http_and_file_urls(tiny, media, client, image_host):
    folder, model, processor = tiny
    allowed, _ = media
    llm = LLM(str(folder), **CPU)
    for picture, url in [(image(0, 40, 50), None), (_ImageHandler.body, f"{image_host}/x.png"),
                         (png(image(11, 40, 30)), (allowed / "a.png").as_uri())]:
        as_data = data_url(picture) if isinstance(picture, Image.Image) else (
            "data:image/png;base64," + base64.b64encode(picture).decode())
        offline = llm.chat(conversation(as_data), GREEDY, use_tqdm=False)[0].outputs[0]
        served = chat(client, conversation(url or as_data))
        assert served.choices[0].message.content == offline.text
        assert served.choices[0].token_ids == offline.token_ids


@pytest.mark.slow
def test_responses_input_image_parts_answer_as_chat_does(client):
    url = data_url(image(5, 44, 36))
    model = client.models.list().data[0].id
    chat_reply = client.chat.completions.create(model=model, messages=conversation(url), max_tokens=NEW_TOKENS,
                                                temperature=0.0)
    response = client.responses.create(model=model, max_output_tokens=NEW_TOKENS, temperature=0.0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "t5 t6 t9 t10 t11 t12 t13 t14 t15"},
                                     {"type": "input_image", "image_url": url, "detail": "auto"},
                                     {"type": "input_text", "text": "t7 t8"}]}])
    assert response.output_text == chat_reply.choices[0].message.content
    assert response.usage.input_tokens == chat_reply.usage.prompt_tokens


@pytest.mark.slow
def test_server_prefix_cache_tells_images_apart(client, server):
    first, other = data_url(image(30, 33, 33)), data_url(image(31, 33, 33))
    text = "t50 t51 t52 t53 t54 t55 t56 t57 t58"  # no other test's prompt starts so
    before = metric_samples(server.url)
    a = chat(client, conversation(first, text=text))
    hits_after_a = metric_samples(server.url)["pagellm:prefix_cache_hits_total"]
    b = chat(client, conversation(other, text=text))
    hits_after_b = metric_samples(server.url)["pagellm:prefix_cache_hits_total"]
    again = chat(client, conversation(first, text=text))
    after = metric_samples(server.url)
    # The prompt: 't40' and 9 words, then the image's 16 placeholders at positions 10-25: block 0
    # holds only text, blocks 1-3 an image.
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens == BLOCK  # the text block only
    assert again.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK  # every full block
    assert b.choices[0].message.content != a.choices[0].message.content
    assert again.choices[0].message.content == a.choices[0].message.content
    assert hits_after_b - hits_after_a == BLOCK
    assert after["pagellm:prefix_cache_hits_total"] - hits_after_b == 3 * BLOCK
    assert after["pagellm:mm_images_total"] - before["pagellm:mm_images_total"] == 3
    # Each prompt's image ran through the encoder (the third's too: its cached blocks end inside the image).
    assert after["pagellm:mm_encoder_images_total"] - before["pagellm:mm_encoder_images_total"] == 3
    assert after["pagellm:mm_encoder_seconds_total"] > before["pagellm:mm_encoder_seconds_total"]


@pytest.mark.slow
@pytest.mark.parametrize("url, message", [
    ("ftp://example.com/a.png", "unsupported image URL scheme 'ftp'"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "could not be decoded"),
    ("file:///etc/hostname", "is outside --allowed-local-media-path"),
])
def test_server_refuses_bad_images_with_400(client, url, message):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, conversation(url))
    assert message in caught.value.message and "messages[0].content[1]" in caught.value.message


@pytest.mark.slow
def test_server_refuses_more_images_than_the_limit(client):
    with pytest.raises(openai.BadRequestError, match=r"carries 3 images, more than the 2 allowed per prompt"):
        chat(client, conversation(*(data_url(image(i, 20, 20)) for i in range(3))))


@pytest.mark.slow
def test_a_url_that_never_answers_times_out_without_blocking_others(client, server, silent_host):
    with ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(lambda: httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": conversation(silent_host), "max_tokens": 2}))
        # Meanwhile another request, with an image, is answered in full.
        done = chat(client, conversation(data_url(image(40, 30, 30))))
        assert not stuck.done() and done.choices[0].finish_reason == "length"
        response = stuck.result()
    assert response.status_code == 400
    assert "timed out after 10 s" in response.json()["error"]["message"]


@pytest.mark.slow  # two spawned processes, about 30 s on 2 cores
@pytest.mark.parametrize("shape", [None, "tiny-qwen2.5-vl"])
def test_the_vlm_benchmark_runs_its_smoke_sizes_on_the_cpu(shape):
    payload = vlm_serving.main(["--smoke", *(["--model-shape", shape] if shape else [])])
    ours, hf = payload["results"]["pagellm"], payload["results"]["hf"]
    assert ours["num_requests"] == 8 and ours["output_tokens"] == 8 * 8 and ours["ttft_s"]["count"] == 8
    assert hf["num_requests"] == 4 and hf["output_tokens_per_s"] > 0
    assert payload["git"]["commit"] and payload["parameters"]["model_shape"] == (shape or "tiny")


def test_the_qwen_benchmark_prompt_of_a_336_pixel_image_is_the_same_144_features_for_both_engines(tmp_path):
    """Qwen2.5-VL-7B's processor, as the benchmark saves it: pagellm's preparation and the one Hugging
    Face's `generate` gets (left padded, the image's features marked) agree on the prompt's tokens."""
    spec = vlm_models.SHAPES["qwen2.5-vl-7b"]
    qwen = vlm_models.family("qwen2.5-vl-7b")
    qwen.save_processor(spec, tmp_path)  # the processor only: the weights are not needed
    args = argparse.Namespace(model_shape="qwen2.5-vl-7b", seed=0, num_requests=2, image_size=336, text_words=32)
    prompts = vlm_serving.requests(args)
    prompts[1]["prompt"] = qwen.prompt(["t5", "t6"])  # shorter: padded on the left
    arch = ModelArchConfig.from_hf_dict(qwen.config(spec).to_dict())
    ours = [ImageProcessor(str(tmp_path), arch).process(p["prompt"], p["multi_modal_data"]) for p in prompts]
    texts, images = [p["prompt"] for p in prompts], [p["multi_modal_data"]["image"] for p in prompts]
    hf = qwen.hf_inputs(str(tmp_path))(texts, images)
    image = spec["special_tokens"]["<|image_pad|>"]
    masks = hf["attention_mask"].tolist()
    assert masks[0][0] == 1 and masks[1][:30] == [0] * 30
    for (ids, items), row, mask in zip(ours, hf["input_ids"].tolist(), masks):
        assert [t for t, keep in zip(row, mask) if keep] == ids
        assert ids.count(image) == 144 and [item.length for item in items] == [144]
    if "mm_token_type_ids" in hf:  # transformers whose M-RoPE positions follow it
        assert hf["mm_token_type_ids"].sum().item() == 2 * 144


def test_the_vlm_benchmark_smoke_refuses_a_full_size_shape():
    with pytest.raises(ValueError, match="--model-shape: --smoke takes one of"):
        vlm_serving.main(["--smoke", "--model-shape", "qwen2.5-vl-7b"])


@pytest.mark.slow
def test_the_chat_page_attaches_an_image_as_a_data_url_part(tiny, media, server):
    driver = start_browser()  # skips without a headless Chromium
    try:
        open_chat(driver, server)
        driver.execute_script(RECORD_REQUESTS)
        set_field(driver, "temperature", "0")
        set_field(driver, "max-tokens", str(NEW_TOKENS))
        allowed, _ = media
        driver.find_element("id", "attach-input").send_keys(str(allowed / "a.png"))
        wait(driver, lambda d: d.find_element("id", "attached").text.startswith("1 image"), "the image attached")
        send_message(driver, "t5 t6 t7")
        wait(driver, lambda d: reply_state(d)[0] == "done", "the reply ends")
        [body] = driver.execute_script("return window.sentBodies")
        image_part, text_part = body["messages"][0]["content"]
        assert text_part == {"type": "text", "text": "t5 t6 t7"}
        assert image_part["image_url"]["url"] == data_url_of_file(allowed / "a.png")
        # The page's reply is the offline answer to the same conversation.
        folder, _, _ = tiny
        offline = LLM(str(folder), **CPU).chat(body["messages"], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
                                               use_tqdm=False)[0]
        assert reply_state(driver)[1].strip() == offline.outputs[0].text.strip()
        assert driver.find_elements("css selector", "#messages .msg.user img.thumb")
        assert console_errors(driver) == []
    finally:
        driver.quit()


def data_url_of_file(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
