"""The web page of `pagellm serve`: the `/stats` route, the static files, and the chat page and dashboard
driven in headless Chromium (Selenium) against a live server of the embedded model.

The browser tests need Debian's `chromium` and `chromium-driver` (scripts/setup.sh installs them) and skip,
saying so, where they are missing. Screenshots go to $PAGELLM_SCREENSHOTS_DIR (docs/images for the docs'
own) or a temporary folder.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import urllib.request
from pathlib import Path

import openai
import pytest
from conftest import SHARED_SERVER_FLAGS, SHARED_SERVER_NAME
from engine_utils import TINY_LLAMA
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from server_utils import RemoteServer
from starlette.testclient import TestClient

from pagellm.cli.main import build_parser
from pagellm.core.outputs import SchedulerStats
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.entrypoints.openai.errors import install_error_handlers
from pagellm.entrypoints.openai.web_pages import MEDIA_TYPES, PAGES, STATIC_PREFIX, WEB_DIR, add_web_ui_routes
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.snapshot import metrics_snapshot
from pagellm.metrics.stats import FinishedRequestStats, IterationStats

API_KEY = "web-ui-test-key"
WAIT_S = 60.0
PAGE_BUDGET_BYTES = 500_000

# -- the stats route and the static files (quick) ------------------------------------------------


def test_the_stats_snapshot_holds_the_metrics_values():
    """Against an independent reading: the /metrics text of the same logger, parsed by prometheus_client."""
    metrics = PrometheusStatLogger("m", num_engines=2)
    metrics.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5, prefix_cache_queries=40,
                                  prefix_cache_hits=16, num_preemptions=2),
                   IterationStats(num_prompt_tokens=40, num_generation_tokens=7, time_to_first_tokens=[0.02, 0.3],
                                  inter_token_latencies=[0.04],
                                  finished_requests=[FinishedRequestStats("length", 1.0, 0.1, 20, 7)]), 0)
    metrics.record(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25),
                   IterationStats(num_generation_tokens=5, time_to_first_tokens=[3.0]), 1)
    metrics.record_turned_away("at_capacity")
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            key = sample.name + "".join(f"|{sample.labels[k]}" for k in ("finished_reason", "reason", "le")
                                        if k in sample.labels)
            totals[key] = totals.get(key, 0.0) + sample.value

    snapshot = metrics_snapshot(metrics)
    json.dumps(snapshot)  # JSON-ready
    assert snapshot["requests"]["running"] == totals["pagellm:num_requests_running"] == 5
    assert snapshot["requests"]["waiting"] == totals["pagellm:num_requests_waiting"]
    assert snapshot["requests"]["finished"]["length"] == totals["pagellm:request_success_total|length"] == 1
    assert snapshot["requests"]["turned_away"]["at_capacity"] == \
        totals["pagellm:http_requests_turned_away_total|at_capacity"] == 1
    assert snapshot["kv_cache_usage"] == pytest.approx(totals["pagellm:kv_cache_usage_perc"] / 2)
    assert snapshot["tokens"] == {"prompt": totals["pagellm:prompt_tokens_total"],
                                  "generation": totals["pagellm:generation_tokens_total"]}
    assert snapshot["tokens"]["generation"] == 12
    assert snapshot["prefix_cache"] == {"queries": 40, "hits": 16} and snapshot["preemptions"] == 2
    ttft = snapshot["latency"]["ttft"]
    assert ttft["count"] == totals["pagellm:time_to_first_token_seconds_count"] == 3
    assert ttft["sum"] == pytest.approx(3.32)
    for bound, cumulative in zip(ttft["le"], ttft["cumulative"]):
        assert cumulative == totals[f"pagellm:time_to_first_token_seconds_bucket|{bound}"]
    assert ttft["cumulative"][-1] == 3 and len(ttft["cumulative"]) == len(ttft["le"]) + 1


def test_the_pages_and_their_files_are_served_with_their_content_types():
    app = FastAPI()
    install_error_handlers(app)  # as build_app does: a 404 in OpenAI's error shape
    add_web_ui_routes(app)
    with TestClient(app) as http:
        for path in PAGES:
            response = http.get(path)
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        files = sorted(p for p in WEB_DIR.iterdir() if p.suffix in MEDIA_TYPES)
        assert {".html", ".js", ".css"} <= {p.suffix for p in files}
        for path in files:
            response = http.get(STATIC_PREFIX + path.name)
            assert response.status_code == 200
            assert response.headers["content-type"] == MEDIA_TYPES[path.suffix]
            assert response.content == path.read_bytes()
        missing = http.get(STATIC_PREFIX + "missing.js")
        assert missing.status_code == 404 and "missing.js" in missing.json()["error"]["message"]
        assert http.get(STATIC_PREFIX + "..%2Fweb_ui.py").status_code == 404


def test_the_pages_are_small_and_load_nothing_from_elsewhere():
    """Offline: every script, style and image the pages name is one of the package's files."""
    files = {p.name: p for p in WEB_DIR.iterdir()}
    total = sum(p.stat().st_size for p in files.values())
    print(f"web page: {len(files)} files, {total / 1000:.1f} KB uncompressed")
    assert total < PAGE_BUDGET_BYTES
    for path in files.values():
        text = path.read_text()
        named = re.findall(r'(?:src|href)="([^"]+)"', text) if path.suffix == ".html" else []
        for url in named + re.findall(r'^import .* from "([^"]+)";$', text, re.M):
            if url.startswith(STATIC_PREFIX):
                assert url.removeprefix(STATIC_PREFIX) in files, f"{path.name} names a missing {url}"
            elif url.startswith("./"):
                assert url[2:] in files, f"{path.name} imports a missing {url}"
            else:
                assert url.startswith("/") and not url.startswith("//"), f"{path.name} loads {url} from elsewhere"


def test_the_pages_package_data_is_declared():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    for suffix in MEDIA_TYPES:
        assert f"entrypoints/openai/web/*{suffix}" in pyproject


@pytest.mark.slow  # an engine process
def test_the_server_serves_the_pages_unless_disabled_and_stats_as_metrics(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    engine = AsyncLLM.from_engine_args(EngineArgs(str(tmp_path), load_format="dummy", device="cpu", dtype="float32",
                                                  max_model_len=128, max_num_seqs=5))
    try:
        metrics = PrometheusStatLogger("tiny")
        with TestClient(build_app(engine, "tiny", metrics=metrics, api_key=API_KEY)) as http:
            for path in (*PAGES, STATIC_PREFIX + "chat.js"):
                assert http.get(path).status_code == 200, f"{path} must be open: the page asks for the key"
            assert http.get("/v1/models").status_code == 401
            stats = http.get("/stats").json()  # open, as /metrics is
            config = stats["engine"]
            assert config["served_model_names"] == ["tiny"] and config["max_num_seqs"] == 5
            assert config["num_kv_blocks"] == engine.num_blocks
            assert config["num_kv_tokens"] == engine.num_blocks * engine.config.cache.block_size
            assert config["dtype"] == "float32" and config["max_model_len"] == 128
            assert stats["requests"]["running"] == 0 and stats["tokens"]["generation"] == 0
        with TestClient(build_app(engine, "tiny", metrics=metrics, api_key=API_KEY, protect_metrics=True)) as http:
            assert http.get("/stats").status_code == 401 and http.get("/").status_code == 200
        with TestClient(build_app(engine, "tiny", metrics=metrics, web_ui=False)) as http:
            for path in (*PAGES, STATIC_PREFIX + "chat.js"):
                assert http.get(path).status_code == 404
            assert http.get("/stats").status_code == 200
    finally:
        engine.shutdown()


def test_disable_web_ui_is_a_serve_flag():
    ns = build_parser().parse_args(["serve", "--disable-web-ui"])
    assert ns.disable_web_ui is True
    assert build_parser().parse_args(["serve"]).disable_web_ui is False


# -- in a real browser (slow) ---------------------------------------------------------------------

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the quick tests above run without it
    webdriver = None

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
CHROMEDRIVER = shutil.which("chromedriver")
NO_BROWSER = ("no headless Chromium: the browser tests need Debian's `chromium` and `chromium-driver` packages and "
              "the `selenium` package (scripts/setup.sh installs them)")
# Keeps the body of each /v1/chat/completions request the page sends, for the test to read.
RECORD_REQUESTS = """
window.sentBodies = [];
const send = window.fetch;
window.fetch = (url, options) => {
  if (String(url).endsWith("/v1/chat/completions")) window.sentBodies.push(JSON.parse(options.body));
  return send(url, options);
};"""


def screenshot_dir(tmp_path_factory) -> Path:
    folder = os.environ.get("PAGELLM_SCREENSHOTS_DIR")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_browser(width: int = 1280, height: int = 860) -> webdriver.Chrome:
    if webdriver is None or CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(NO_BROWSER)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def console_errors(driver, allowed: str | None = None) -> list[str]:
    """The browser console's errors since the last call (`allowed`: a pattern of expected ones)."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE" and not (allowed and re.search(allowed, entry["message"]))]


def stats(server: RemoteServer) -> dict:
    with urllib.request.urlopen(f"{server.url}/stats", timeout=10.0) as response:
        return json.loads(response.read())


def wait(driver, condition, what: str, timeout_s: float = WAIT_S):
    return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(lambda d: condition(d), what)


def last_reply(driver):
    replies = driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")
    return replies[-1] if replies else None


def reply_state(driver) -> tuple[str | None, str]:
    """The last reply's state (streaming, done, stopped, error) and text, read at one instant: the page
    re-renders its messages, so an element found in one call may be gone by the next."""
    state, text = driver.execute_script(
        "const replies = document.querySelectorAll('#messages .msg.assistant');"
        "const last = replies[replies.length - 1];"
        "return last ? [last.dataset.state, last.querySelector('.content').innerText] : [null, ''];")
    return state, text


def set_field(driver, element_id: str, value: str) -> None:
    """As a user does: the value changes, and the page hears an `input` event."""
    driver.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                          "e.dispatchEvent(new Event('input', {bubbles: true}));", element_id, value)


def send_message(driver, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def open_chat(driver, server: RemoteServer) -> None:
    driver.get(f"{server.url}/")
    wait(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true", "page ready")


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def browser():
    """Requested before the server by each test, so that a machine without a browser skips before starting it."""
    driver = start_browser()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    return screenshot_dir(tmp_path_factory)


@pytest.mark.slow
def test_a_reply_streams_into_the_page_with_the_chosen_temperature_and_survives_a_reload(browser, server,
                                                                                       screenshots):
    open_chat(browser, server)
    assert browser.find_element(By.ID, "model").get_attribute("value") == SHARED_SERVER_NAME
    browser.execute_script(RECORD_REQUESTS)
    set_field(browser, "temperature", "0.35")
    set_field(browser, "max-tokens", "120")
    set_field(browser, "seed", "7")
    send_message(browser, "Write a short poem about the sea, with a code block of Python that prints it.")

    lengths = []  # the reply's text as the page shows it, each time it changed while streaming

    def grew_then_ended(driver) -> bool:
        state, text = reply_state(driver)
        if state == "streaming" and text and (not lengths or len(text) != lengths[-1]):
            lengths.append(len(text))
        return state == "done"
    wait(browser, grew_then_ended, "the reply streams and ends")
    state, text = reply_state(browser)
    assert len(lengths) >= 2 and lengths == sorted(lengths), f"not seen growing: {lengths}"
    assert len(text) >= lengths[-1] > 0
    meta = last_reply(browser).find_element(By.CSS_SELECTOR, ".stats").text
    assert re.search(r"\d+ prompt \+ \d+ tokens · [\d.]+ tokens/s", meta), meta

    sent = browser.execute_script("return window.sentBodies")
    assert len(sent) == 1 and sent[0]["temperature"] == 0.35 and sent[0]["max_tokens"] == 120 and sent[0]["seed"] == 7
    assert sent[0]["stream"] is True and sent[0]["model"] == SHARED_SERVER_NAME
    browser.save_screenshot(str(screenshots / "web-ui-chat.png"))

    browser.refresh()  # the conversation is kept in the browser
    open_chat(browser, server)
    titles = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#conversations li .title")]
    assert titles and titles[0].startswith("Write a short poem")
    assert reply_state(browser) == ("done", text)
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0.35"
    assert console_errors(browser) == []


@pytest.mark.slow
def test_the_stop_button_aborts_the_request_on_the_server(browser, server):
    open_chat(browser, server)
    browser.find_element(By.ID, "new-chat").click()
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "900")
    aborted_before = stats(server)["requests"]["finished"]["abort"]
    send_message(browser, "Count from 1 to 400, one number per line.")
    wait(browser, lambda d: reply_state(d)[0] == "streaming" and len(reply_state(d)[1]) > 10, "the reply streams")
    assert stats(server)["requests"]["running"] == 1
    browser.find_element(By.ID, "stop").click()
    wait(browser, lambda d: reply_state(d)[0] == "stopped", "the reply marked stopped")
    wait(browser, lambda d: re.fullmatch(r"stopped · ~\d+ tokens · [\d.]+ tokens/s · first token \d+ ms",
                                          d.execute_script("return document.querySelector("
                                                           "'#messages .msg.assistant:last-child .stats')"
                                                           ".textContent")), "the stopped reply's counts")
    wait(browser, lambda d: stats(server)["requests"]["running"] == 0, "the server stops running it")
    after = stats(server)
    assert after["requests"]["finished"]["abort"] == aborted_before + 1
    assert browser.find_element(By.ID, "send").is_displayed()
    assert console_errors(browser) == []


@pytest.mark.slow
def test_edit_and_resend_regenerate_and_json_schema_mode(browser, server):
    open_chat(browser, server)
    browser.find_element(By.ID, "new-chat").click()
    browser.execute_script(RECORD_REQUESTS)
    set_field(browser, "max-tokens", "16")
    send_message(browser, "Name a colour.")
    wait(browser, lambda d: reply_state(d)[0] == "done", "the first reply")

    browser.find_element(By.CSS_SELECTOR, "#messages .msg.user .edit").click()
    editor = browser.find_element(By.CSS_SELECTOR, "#messages .msg.user .editor")
    editor.clear()
    editor.send_keys("Name a fruit.")
    browser.find_element(By.XPATH, "//button[text()='Save & send']").click()
    wait(browser, lambda d: reply_state(d)[0] == "done" and len(d.execute_script("return window.sentBodies")) == 2,
         "the edited message's reply")
    browser.find_element(By.CSS_SELECTOR, "#messages .msg.assistant .regenerate").click()
    wait(browser, lambda d: reply_state(d)[0] == "done" and len(d.execute_script("return window.sentBodies")) == 3,
         "the regenerated reply")
    sent = browser.execute_script("return window.sentBodies")
    assert [body["messages"] for body in sent[1:]] == [[{"role": "user", "content": "Name a fruit."}]] * 2
    assert len(browser.find_elements(By.CSS_SELECTOR, "#messages .msg")) == 2

    browser.find_element(By.ID, "json-mode").click()
    set_field(browser, "max-tokens", "200")
    send_message(browser, "Answer in JSON: what is the capital of France?")
    wait(browser, lambda d: reply_state(d)[0] == "done", "the JSON reply")
    body = browser.execute_script("return window.sentBodies")[-1]
    assert body["response_format"]["type"] == "json_schema"
    schema = body["response_format"]["json_schema"]["schema"]
    reply = json.loads(reply_state(browser)[1])
    assert set(schema["required"]) <= set(reply) and isinstance(reply["answer"], str)
    browser.find_element(By.ID, "json-mode").click()  # off again for the tests after
    assert console_errors(browser) == []


@pytest.mark.slow
def test_the_markdown_renderer_escapes_html_and_renders_code(browser, server):
    open_chat(browser, server)
    html = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import('/ui/markdown.js').then((m) => done(m.renderMarkdown(arguments[0])));",
        "<img src=x onerror=alert(1)> **bold** [link](javascript:alert(1))\n\n```python\nprint('<b>')\n```")
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<strong>bold</strong>" in html and "javascript:" in html and "href=\"javascript" not in html
    assert '<div class="code-head"><span>python</span>' in html
    assert "print" in html and "&lt;b&gt;" in html and "<b>" not in html


@pytest.mark.slow
def test_the_dashboard_charts_a_load_and_the_cache_emptying_after(browser, server, screenshots):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    stop = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            while not stop.is_set():
                client.chat.completions.create(model=SHARED_SERVER_NAME, max_tokens=48,
                                               messages=[{"role": "user", "content": "Tell me about rivers."}])
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(3)]
    browser.get(f"{server.url}/dashboard")
    for thread in threads:
        thread.start()
    try:
        def output_rate(driver) -> float:
            text = driver.find_element(By.ID, "tile-output").text
            return float(text) if re.fullmatch(r"[\d.]+", text) else 0.0
        wait(browser, lambda d: output_rate(d) > 0, "non-zero output tokens/s during the load")
        wait(browser, lambda d: d.find_element(By.ID, "tile-requests").text not in ("–", "0 / 0"), "running requests")
        legend = browser.find_element(By.CSS_SELECTOR, ".chart .legend").text
        assert re.search(r"output: [\d.]+", legend) and "output: 0" not in legend, legend
        # More requests (about 10 s of them), for a screenshot with lines to see (in the dark theme).
        finished = int(browser.find_element(By.ID, "tile-finished").text.replace(",", ""))
        wait(browser, lambda d: int(d.find_element(By.ID, "tile-finished").text.replace(",", "")) >= finished + 18,
             "18 more requests finished")
        browser.find_element(By.ID, "theme").click()
        browser.save_screenshot(str(screenshots / "web-ui-dashboard.png"))
        browser.find_element(By.ID, "theme").click()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    wait(browser, lambda d: d.find_element(By.ID, "tile-kv").text == "0.0%", "the KV usage back to 0")
    wait(browser, lambda d: d.find_element(By.ID, "tile-requests").text == "0 / 0", "no requests")
    config = {row.get_attribute("data-key"): row.find_element(By.TAG_NAME, "dd").text
              for row in browser.find_elements(By.CSS_SELECTOR, "#config > div")}
    engine = stats(server)["engine"]
    assert config["max_num_seqs"] == f"{engine['max_num_seqs']:,}" and config["dtype"] == "float32"
    assert config["num_kv_blocks"] == f"{engine['num_kv_blocks']:,}"
    assert console_errors(browser) == []


@pytest.mark.slow
def test_the_page_asks_for_the_api_key_once_and_then_works_and_folds_the_reasoning(smollm2_path, screenshots):
    """With deepseek_r1's parser (its reasoning opens in the prompt), SmolLM2's whole reply, which never closes
    a </think>, is reasoning: the page shows it folded, with no answer."""
    driver = start_browser(390, 800)  # a phone-sized screen (first: it skips where there is no browser)
    remote = RemoteServer(smollm2_path, *SHARED_SERVER_FLAGS, "--api-key", API_KEY, "--reasoning-parser", "deepseek_r1")
    try:
        driver.get(f"{remote.url}/")
        dialog = wait(driver, lambda d: d.find_element(By.ID, "key-dialog").is_displayed()
                      and d.find_element(By.ID, "key-dialog"), "the key asked for")
        dialog.find_element(By.TAG_NAME, "input").send_keys(API_KEY)
        dialog.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true", "page ready")
        set_field(driver, "max-tokens", "24")
        send_message(driver, "Say hello.")
        wait(driver, lambda d: reply_state(d)[0] == "done", "a reply")
        assert not driver.find_element(By.ID, "key-dialog").is_displayed(), "asked once"
        assert driver.execute_script("return sessionStorage.getItem('pagellm.apiKey')") == API_KEY

        reasoning = last_reply(driver).find_element(By.CSS_SELECTOR, ".reasoning")
        assert reasoning.is_displayed() and reasoning.get_attribute("open") is None, "shown, folded"
        assert reply_state(driver)[1] == ""
        reasoning.find_element(By.TAG_NAME, "summary").click()
        text = reasoning.find_element(By.CSS_SELECTOR, ".reasoning-text").text
        assert len(text) > 10, text
        driver.save_screenshot(str(screenshots / "web-ui-phone.png"))
        # The 401 that made the page ask is the one error the console may show.
        assert console_errors(driver, allowed=r"status of 401") == []
    finally:
        driver.quit()
        assert remote.stop() == 0
