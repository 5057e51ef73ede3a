"""The server most of the adversarial suite shares (tests/adversarial/__init__.py says what runs where)."""
from __future__ import annotations

import pytest
from server_utils import RemoteServer

from adversarial.probes import ADMISSION_FLAGS, API_KEY, CHAT_TEMPLATE, ENGINE_FLAGS, LORA_FLAGS


@pytest.fixture(scope="package")
def adversary(smollm2_path, tmp_path_factory):
    """`pagellm serve` as an exposed deployment runs it: an API key, runtime LoRA updating (the admin
    routes), a small capacity (probes.ADMISSION_FLAGS) and a chat template that uses two template
    variables a request may set (probes.CHAT_TEMPLATE)."""
    template = tmp_path_factory.mktemp("adversary") / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    remote = RemoteServer(smollm2_path, *ENGINE_FLAGS, *ADMISSION_FLAGS, *LORA_FLAGS, "--chat-template", str(template),
                          env={"PAGELLM_API_KEY": API_KEY})
    yield remote
    assert remote.stop() == 0, "the server did not shut down cleanly"
