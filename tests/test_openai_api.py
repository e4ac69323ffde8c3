"""The backbone's user surface as users and operators meet it: the official ``openai`` client, a
Prometheus parser and headless Chromium, against real processes on 127.0.0.1 (a bootstrap node,
three workers - two of them replicas of experts 0-7 - and a `p2pswarm node --role backbone`).

One swarm for the module; the browser test kills a worker, so it runs last."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.procs import Proc, start_bootstrap, start_shard_workers
from system_tools import require

pytestmark = pytest.mark.slow

RANGES = [(0, 8), (8, 16), (0, 8)]  # tiny: 16 experts; worker 1 alone holds 8-15
BLOCK = 4  # 4 coverage units per layer
CHAT = [{"role": "system", "content": "You are a swarm."}, {"role": "user", "content": "Tell me about experts."}]


@pytest.fixture(scope="module")
def backbone(tiny_f32, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp / "home"), P2PSWARM_CACHE=str(tmp / "cache"))
    nodes: list[Proc] = []
    try:
        boot = start_bootstrap(tmp, env)
        nodes.append(boot)
        nodes += start_shard_workers(tiny_f32, tmp, env, RANGES, boot.addr, extra=["--block-size", str(BLOCK)])
        bb = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--bootstrap", boot.addr,
                   "--identity", str(tmp / "bb.key"), "--http", "127.0.0.1:0", "--block-size", str(BLOCK),
                   "--timeout", "5", "--served-model-name", "tiny"], tmp / "bb.log", env)
        nodes.append(bb)
        base = next(w for w in bb.ready if w.startswith("http="))[5:].replace("0.0.0.0", "127.0.0.1")
        with httpx.Client(base_url=base, timeout=30) as c:  # the resolver's first pass found all three
            deadline = time.time() + 60
            while len(c.get("/v1/swarm").json()["workers"]) < len(RANGES):
                assert time.time() < deadline, (tmp / "bb.log").read_text()[-3000:]
                time.sleep(0.5)
        yield {"base": base, "workers": nodes[1:1 + len(RANGES)], "log": tmp / "bb.log", "tmp": tmp}
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.fixture(scope="module")
def client(backbone):
    return openai.OpenAI(base_url=backbone["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stream_pieces(stream) -> tuple[list[str], list, object]:
    """(text pieces, finish reasons of every choice chunk, the usage chunk's usage)."""
    pieces, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
            continue
        ch = chunk.choices[0]
        text = ch.delta.content if hasattr(ch, "delta") else ch.text
        if text:
            pieces.append(text)
        finishes.append(ch.finish_reason)
    return pieces, finishes, usage


def test_models_and_chat_plain_and_streamed(client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, seed=1)
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    text = plain.choices[0].message.content
    assert text and plain.choices[0].finish_reason in ("length", "stop")
    assert plain.usage.prompt_tokens > 10 and plain.usage.completion_tokens <= 12
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finishes, usage = _stream_pieces(stream)
    assert "".join(pieces) == text
    assert finishes[-1] == plain.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert usage.model_dump() == plain.usage.model_dump()
    # without include_usage: no usage chunk, finish_reason still on the last chunk
    pieces2, finishes2, usage2 = _stream_pieces(client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True))
    assert "".join(pieces2) == text and usage2 is None and finishes2[-1] is not None


def test_stop_sequences_across_token_boundaries(client):
    for api in ("chat", "completions"):
        def call(**kw):
            if api == "chat":
                return client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, **kw)
            return client.completions.create(model="tiny", prompt="The swarm", temperature=0, **kw)

        pieces, _, _ = _stream_pieces(call(max_tokens=24, stream=True))
        full = "".join(pieces)
        # a stop string made of the end of one token's text and the start of the next one's
        i = next(i for i in range(2, len(pieces) - 1) if pieces[i] and len(pieces[i + 1]) >= 2)
        stop = pieces[i][-1] + pieces[i + 1][:2]
        want = full[:full.find(stop)]
        plain = call(max_tokens=24, stop=[stop, "\u2603never"])
        choice = plain.choices[0]
        got = choice.message.content if api == "chat" else choice.text
        assert got == want and choice.finish_reason == "stop", (api, stop, full)
        spieces, finishes, _ = _stream_pieces(call(max_tokens=24, stop=stop, stream=True))
        assert "".join(spieces) == want and finishes[-1] == "stop" and stop not in "".join(spieces)
        assert plain.usage.completion_tokens < 24


def test_seed_absent_is_random_given_is_repeatable(client):
    texts = [client.completions.create(model="tiny", prompt="The swarm", max_tokens=10, temperature=1.0).choices[0].text
             for _ in range(2)]
    assert texts[0] != texts[1]
    seeded = [client.completions.create(model="tiny", prompt="The swarm", max_tokens=10, temperature=1.0,
                                        seed=42).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_errors_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.code == "model_not_found" and "tiny" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    refused = [dict(n=2), dict(logprobs=True), dict(logprobs=True, top_logprobs=2), dict(stop=["a", "b", "c", "d", "e"]),
               dict(max_tokens=0), dict(temperature=5), dict(tools=[{"type": "function", "function": {"name": "f"}}])]
    for kw in refused:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=CHAT, **kw)
        assert e.value.body["param"] and e.value.message, kw
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.completions.create(model="tiny", prompt="x", echo=True)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": 5}])
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"content": "no role"}])


def test_metrics_parse_with_prometheus_client(backbone, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="unknown", messages=CHAT)
    assert httpx.get(backbone["base"] + "/no/such/path").status_code == 404
    text = httpx.get(backbone["base"] + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("p2pswarm_http_requests", "p2pswarm_tokens_generated", "p2pswarm_active_sequences",
                 "p2pswarm_owner_request_seconds", "p2pswarm_expert_requests", "p2pswarm_expert_fallbacks",
                 "p2pswarm_coverage_units", "p2pswarm_workers"):
        assert name in fams, name
    reqs = {(s.labels["endpoint"], s.labels["status"]): s.value for s in fams["p2pswarm_http_requests"].samples
            if s.name.endswith("_total")}
    assert reqs[("/v1/completions", "200")] >= 1 and reqs[("/v1/chat/completions", "404")] >= 1
    assert reqs[("other", "404")] >= 1  # unknown paths share one label value
    tokens = next(s.value for s in fams["p2pswarm_tokens_generated"].samples if s.name.endswith("_total"))
    swarm = httpx.get(backbone["base"] + "/v1/swarm").json()
    assert tokens == swarm["tokens_generated"] >= 4
    # the module's requests all fall in the page's 5-minute window of 5 s bins
    assert sum(rate for _, rate in swarm["tokens_per_s"]) * 5 == pytest.approx(tokens)
    assert next(s.value for s in fams["p2pswarm_active_sequences"].samples) == swarm["active_sequences"] == 0
    owners = {s.labels["owner"] for s in fams["p2pswarm_owner_request_seconds"].samples if s.name.endswith("_count")
              and s.value > 0}
    assert owners and owners <= {w["name"] for w in swarm["workers"]}
    assert next(s.value for s in fams["p2pswarm_workers"].samples) == len(RANGES)
    units = {s.labels["state"]: s.value for s in fams["p2pswarm_coverage_units"].samples}
    assert units == {"remote": len(swarm["units"]), "local_only": 0}


def test_status_page_in_headless_chromium(backbone, client):
    """The page draws one cell per unit; after worker 1 (sole owner of experts 8-15) is killed and
    a request hits it, exactly its cells drop to 0 live replicas."""
    require("chromium", "chromedriver")
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(driver_bin), options=opts)
    try:
        drv.get(backbone["base"] + "/")
        wait = WebDriverWait(drv, 30, poll_frequency=0.25)
        swarm = httpx.get(backbone["base"] + "/v1/swarm").json()
        n_units = len(swarm["layers"]) * swarm["blocks_per_layer"]
        assert len(swarm["units"]) == n_units == 4 * 16 // BLOCK
        wait.until(lambda d: d.execute_script("return document.querySelectorAll('#heatmap .cell').length") == n_units)

        def live():  # read in one script: the page redraws its cells every 2 s
            cells = drv.execute_script("return [...document.querySelectorAll('#heatmap .cell')].map("
                                       "c => [+c.dataset.layer, +c.dataset.block, +c.dataset.live]);")
            return {(layer, block): n for layer, block, n in cells}

        before = live()
        assert set(before.values()) == {1, 2}  # blocks 0-1 (experts 0-7) twice, blocks 2-3 once
        assert drv.execute_script("return document.querySelectorAll('#workers tr').length") == len(RANGES)
        # a cell's tooltip names its owners (computed on hover from the workers' ranges)
        title = drv.execute_script("const c = document.querySelector('#heatmap .cell[data-block=\"3\"]');"
                                   "c.dispatchEvent(new MouseEvent('mouseover', {bubbles: true})); return c.title;")
        w1 = next(w for w in swarm["workers"] if w["experts"] == [8, 16])
        assert "experts 12-15: 1 live replica" in title and w1["short_id"] in title, title
        backbone["workers"][1].stop(signal.SIGKILL)
        client.completions.create(model="tiny", prompt="after the kill", max_tokens=3, temperature=0)
        wait.until(lambda d: live() != before)
        after = live()
        changed = {k for k in before if before[k] != after[k]}
        assert changed == {k for k in before if k[1] >= 2} and all(after[k] == 0 for k in changed)
        assert drv.execute_script("return document.querySelectorAll('#heatmap .cell.stale').length") == len(changed)
        shot = Path(os.environ.get("P2PSWARM_SCREENSHOT") or backbone["tmp"] / "status.png")
        assert drv.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        drv.quit()
