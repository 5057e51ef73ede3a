"""The router's length governance: prompts counted with the model's tokenizer, rejected or
truncated exactly at max_input_tokens; output budgets capped at max_output_tokens."""
from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from pagellm.router.length import cut
from pagellm.tokenizer import load_tokenizer_at

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A word-level tokenizer: words w0..w299 and the template's role markers, one token each."""
    words = [f"w{i}" for i in range(300)] + ["[", "]", "system", "user", "assistant", "<unk>"]
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return str(tmp_path)


def _text(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def _model(fake_url: str, tokenizer_dir: str, policy: str, max_in: int = 10, **extra) -> dict:
    return {"models": [{"name": "m", "backends": [fake_url], "tokenizer": tokenizer_dir, "max_input_tokens": max_in,
                        "length_policy": policy, **extra}]}


def test_reject_exactly_over_the_limit(fakes, router, tokenizer_dir) -> None:
    a = fakes("a")
    r = router(_model(a.url, tokenizer_dir, "reject"))
    with httpx.Client(base_url=r.url) as http:
        assert http.post("/v1/completions", json={"model": "m", "prompt": _text(0, 10)}).status_code == 200
        resp = http.post("/v1/completions", json={"model": "m", "prompt": _text(0, 11)})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "prompt"
    assert "11 tokens" in error["message"] and "max_input_tokens of 10" in error["message"]
    assert len(a.bodies) == 1
    assert r.state.metrics.rejections.labels("m")._value.get() == 1


@pytest.mark.parametrize("policy", ["truncate_left", "truncate_right", "truncate_middle"])
def test_truncate_completion_prompt(fakes, router, tokenizer_dir, policy) -> None:
    a = fakes("a")
    r = router(_model(a.url, tokenizer_dir, policy))
    reference = load_tokenizer_at(tokenizer_dir)
    ids = reference.encode(_text(0, 25))
    with httpx.Client(base_url=r.url) as http:
        resp = http.post("/v1/completions", json={"model": "m", "prompt": _text(0, 25)})
        short = http.post("/v1/completions", json={"model": "m", "prompt": _text(0, 10)})
    assert resp.status_code == 200 and resp.headers["x-pagellm-truncated"] == "25->10"
    expected = {"truncate_left": ids[15:], "truncate_right": ids[:10], "truncate_middle": ids[:5] + ids[20:]}[policy]
    assert a.bodies[0]["prompt"] == expected
    assert "x-pagellm-truncated" not in short.headers and a.bodies[1]["prompt"] == _text(0, 10)
    assert r.state.metrics.truncations.labels("m", policy)._value.get() == 1


def test_truncate_chat_keeps_system_and_latest_turns(fakes, router, tokenizer_dir) -> None:
    a = fakes("a")
    r = router(_model(a.url, tokenizer_dir, "truncate_left", max_in=40))
    reference = load_tokenizer_at(tokenizer_dir)

    def count(messages: list[dict]) -> int:
        return len(reference.encode(reference.apply_chat_template(messages), False))

    system = {"role": "system", "content": _text(0, 5)}
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": _text(10 * i + 10, 6)} for i in range(8)]
    messages = [system, *turns]
    assert count(messages) > 40
    resp = httpx.post(f"{r.url}/v1/chat/completions", json={"model": "m", "messages": messages})
    assert resp.status_code == 200
    sent = a.bodies[0]["messages"]
    kept = len(sent) - 1
    assert sent == [system, *turns[len(turns) - kept:]]  # the system prompt and the most recent turns
    assert count(sent) <= 40 < count([system, *turns[len(turns) - kept - 1:]])  # as many turns as fit
    assert resp.headers["x-pagellm-truncated"] == f"{count(messages)}->{count(sent)}"


def test_truncate_chat_cuts_a_last_message_too_long_alone(fakes, router, tokenizer_dir) -> None:
    a = fakes("a")
    r = router(_model(a.url, tokenizer_dir, "truncate_left", max_in=20))
    messages = [{"role": "system", "content": _text(0, 3)}, {"role": "user", "content": _text(100, 50)}]
    assert httpx.post(f"{r.url}/v1/chat/completions", json={"model": "m", "messages": messages}).status_code == 200
    reference = load_tokenizer_at(tokenizer_dir)
    room = 20 - len(reference.encode(reference.apply_chat_template([messages[0], {"role": "user", "content": ""}]),
                                     False))
    assert a.bodies[0]["messages"] == [messages[0], {"role": "user", "content": _text(150 - room, room)}]  # its end


def test_chat_reject_counts_the_rendered_template(fakes, router, tokenizer_dir) -> None:
    a = fakes("a")
    r = router(_model(a.url, tokenizer_dir, "reject", max_in=12))
    # "[user] w0..w4 [assistant]": 3 + 5 + 3 tokens = 11 fit; 6 words make 12; 7 make 13.
    for n, ok in ((6, True), (7, False)):
        resp = httpx.post(f"{r.url}/v1/chat/completions",
                          json={"model": "m", "messages": [{"role": "user", "content": _text(0, n)}]})
        assert (resp.status_code == 200) == ok, resp.text
    assert "13 tokens" in resp.json()["error"]["message"]


def test_max_output_tokens_reject_and_cap(fakes, router, tokenizer_dir) -> None:
    a = fakes("a")
    r = router({"models": [{"name": "rej", "backends": [a.url], "max_output_tokens": 16},
                           {"name": "cap", "backends": [a.url], "max_output_tokens": 16,
                            "length_policy": "truncate_right"}]})
    with httpx.Client(base_url=r.url) as http:
        resp = http.post("/v1/completions", json={"model": "rej", "prompt": "x", "max_tokens": 17})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
        assert http.post("/v1/completions", json={"model": "rej", "prompt": "x", "max_tokens": 16}).status_code == 200
        http.post("/v1/chat/completions", json={"model": "cap", "messages": [], "max_completion_tokens": 99})
        http.post("/v1/completions", json={"model": "cap", "prompt": "x"})
    assert a.bodies[-2]["max_completion_tokens"] == 16 and a.bodies[-1]["max_tokens"] == 16


def test_key_limit_below_the_model(fakes, router, tokenizer_dir) -> None:
    a = fakes("a")
    r = router({**_model(a.url, tokenizer_dir, "reject", max_in=10),
                "keys": [{"key": "k", "name": "small", "max_input_tokens": 4}]})
    resp = httpx.post(f"{r.url}/v1/completions", json={"model": "m", "prompt": _text(0, 5)},
                      headers={"authorization": "Bearer k"})
    assert resp.status_code == 400 and "max_input_tokens of 4" in resp.json()["error"]["message"]


def test_cut_policies() -> None:
    ids = list(range(10))
    assert cut(ids, 4, "truncate_left") == [6, 7, 8, 9]
    assert cut(ids, 4, "truncate_right") == [0, 1, 2, 3]
    assert cut(ids, 5, "truncate_middle") == [0, 1, 7, 8, 9]
    assert cut(ids, 20, "truncate_left") == ids
