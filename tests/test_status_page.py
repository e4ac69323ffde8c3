"""The status page tells the truth at a glance, in headless Chromium at 1280x800 and 1920x1080:
each worker's state comes first and stays on screen (a dead worker must not look live because a
100-character kernel id pushed its state cell off), the kernel id is shortened with the full id on
hover, and the worker count is the same on the page, /metrics and /v1/swarm (peers, and shards
separately). Its layout, measured in the browser: every column header is aligned the way its
values are (numbers right), the chart's labels are the body text's size at both widths, and the
panels fill the window (no empty lower half). Real processes on the default kernel (ggml, whose
id is the long one).

`P2PSWARM_SCREENSHOT_DIR=docs` writes docs/status-page-1280.png and docs/status-page-1920.png."""
from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.procs import Proc, start_bootstrap, start_shard_workers, stop_all, wait_until
from system_tools import require

pytestmark = pytest.mark.slow


def _browser(width: int, height: int):
    require("chromium", "chromedriver")
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              f"--window-size={width},{height}"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(driver_bin), options=opts)
    # the viewport itself at width x height (a headless window's size includes its frame)
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
    return drv


ROWS = """return [...document.querySelectorAll('#workers tr')].map(tr => {
  const s = tr.children[0].getBoundingClientRect(), k = tr.children[9];
  return {state: tr.children[0].textContent, left: s.left, right: s.right, width: window.innerWidth,
          kernel: k.textContent, kernel_title: k.title, path: tr.children[2].textContent, name: tr.dataset.name};
});"""


# Where things are drawn: each column's header text and its first value (a Range around the text,
# not the cell), the chart labels' size on screen (font size x the SVG's scale), the panels' bottom.
LAYOUT = """const text = (el) => { const r = document.createRange(); r.selectNodeContents(el); return r.getBoundingClientRect(); };
const row = document.querySelector('#workers tr');
const cols = [...document.querySelectorAll('thead th')].map((th, i) => {
  const h = text(th), c = text(row.children[i]);
  return {head: th.textContent, numeric: row.children[i].classList.contains('num'),
          head_left: h.left, head_right: h.right, cell_left: c.left, cell_right: c.right};
});
const labels = [...document.querySelectorAll('#rate text')].map((t) => {
  const m = t.getScreenCTM(), size = parseFloat(getComputedStyle(t).fontSize);
  return {text: t.textContent, x: size * m.a, y: size * m.d};
});
return {cols, labels, body: parseFloat(getComputedStyle(document.body).fontSize),
        bottom: Math.max(...[...document.querySelectorAll('main section')].map((s) => s.getBoundingClientRect().bottom)),
        height: window.innerHeight, scroll: document.documentElement.scrollHeight,
        requests: document.getElementById('requests')?.textContent, groups: document.getElementById('groups')?.textContent};"""


def _check_layout(drv, width: int) -> None:
    lay = drv.execute_script(LAYOUT)
    numeric = [c for c in lay["cols"] if c["numeric"]]
    assert len(numeric) == 5 and len(lay["cols"]) == 10, lay["cols"]
    for c in lay["cols"]:  # a header sits over its values: right edges for numbers, left edges for text
        edge = ("head_right", "cell_right") if c["numeric"] else ("head_left", "cell_left")
        assert abs(c[edge[0]] - c[edge[1]]) <= 1.5, (width, c)
    assert {t["text"] for t in lay["labels"]} >= {"0", "-5 min", "now"}, lay["labels"]
    for t in lay["labels"]:  # drawn at the body's size, not scaled with the panel (nor squashed)
        assert abs(t["x"] - lay["body"]) < 0.5 and abs(t["y"] - lay["body"]) < 0.5, (width, lay["body"], t)
    # the panels reach the window's bottom (less main's padding) and nothing is below it
    assert lay["height"] - 24 <= lay["bottom"] <= lay["height"] and lay["scroll"] <= lay["height"], (width, lay)
    assert int(lay["requests"]) > 0 and re.fullmatch(r"\d+ / \d+", lay["groups"]), lay


def _metric(base: str, name: str) -> float:
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text)}
    return fams[name].samples[0].value


def test_status_page_state_first_short_kernel_one_worker_count(tiny_f32, tmp_path):
    env = dict(os.environ, P2PSWARM_HOME=str(tmp_path / "home"))
    env.pop("P2PSWARM_KERNEL", None)  # the default kernel: ggml, with its long id
    nodes: list[Proc] = []
    shots = Path(os.environ.get("P2PSWARM_SCREENSHOT_DIR") or tmp_path)
    try:
        boot = start_bootstrap(tmp_path, env)
        nodes.append(boot)
        workers = start_shard_workers(tiny_f32, tmp_path, env, [(0, 8), (8, 16)], boot.addr,
                                      extra=["--block-size", "4"])
        nodes += workers
        bb = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--bootstrap", boot.addr, "--identity",
                   str(tmp_path / "bb.key"), "--http", "127.0.0.1:0", "--block-size", "4", "--timeout", "5"],
                  tmp_path / "bb.log", env)
        nodes.append(bb)
        base = next(w for w in bb.ready if w.startswith("http="))[5:]
        wait_until(lambda: len(httpx.get(base + "/v1/swarm", timeout=10).json()["workers"]) == 2, timeout=60,
                   what="both workers")
        httpx.post(base + "/v1/completions", json={"prompt": "The swarm", "max_tokens": 4}, timeout=60)
        swarm = httpx.get(base + "/v1/swarm", timeout=10).json()
        kernel = swarm["workers"][0]["kernel"]
        # the build and every CPU feature: 70 characters on an AVX2 machine, 100+ with AVX-512
        assert len(kernel) > 60 and kernel.startswith("ggml-") and "/" in kernel, kernel
        # one count of workers: /v1/swarm, /metrics (and the page, below)
        assert swarm["worker_peers"] == swarm["worker_shards"] == 2
        assert _metric(base, "p2pswarm_workers") == 2 and _metric(base, "p2pswarm_worker_shards") == 2
        assert not any(w["relayed"] for w in swarm["workers"])  # loopback, no relay: never "relayed"

        killed = next(w["name"] for w in swarm["workers"] if w["experts"] == [8, 16])
        for width, height in ((1280, 800), (1920, 1080)):
            drv = _browser(width, height)
            try:
                drv.get(base + "/")
                from selenium.webdriver.support.ui import WebDriverWait

                wait = WebDriverWait(drv, 30, poll_frequency=0.25)
                wait.until(lambda d: len(d.execute_script(ROWS)) == 2)
                rows = drv.execute_script(ROWS)
                for r in rows:
                    assert 0 <= r["left"] and r["right"] <= r["width"], (width, r)  # the state cell is on screen
                    assert r["kernel"] == "ggml-0.25.3-0c1e570/…" or r["kernel"].endswith("/…"), r
                    assert r["kernel_title"] == kernel, r
                    assert r["path"] == "libp2p", r
                assert drv.execute_script("return document.getElementById('workercount').textContent") == \
                    "2 peers, 2 shards"
                _check_layout(drv, width)
                if width == 1280:
                    assert {r["state"] for r in rows} == {"live"}, rows
                    workers[1].stop(signal.SIGKILL)  # the only owner of experts 8-15
                    httpx.post(base + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=60)
                wait.until(lambda d: {r["name"]: r["state"] for r in d.execute_script(ROWS)}.get(killed) == "back-off")
                rows = drv.execute_script(ROWS)
                dead = next(r for r in rows if r["name"] == killed)
                assert dead["right"] <= dead["width"], dead  # the dead worker's state is visible
                shot = shots / f"status-page-{width}.png"
                assert drv.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            finally:
                drv.quit()
    finally:
        stop_all([n.proc for n in nodes])


def test_relayed_only_where_traffic_goes_through_the_relay(tiny_f32, tmp_path):
    """A worker behind a relay (no port of its own): /v1/swarm says "relayed", and the relay's own
    counter shows the bytes (the loopback workers above are never "relayed")."""
    from helpers.procs import get_health, start_relay, worker_args, worker_identity
    from p2pswarm.model.slicer import slice_experts
    from p2pswarm.net.signed.identity import load_or_create_identity
    from p2pswarm.net.signed.tokens import issue_token

    env = dict(os.environ, P2PSWARM_KERNEL="numpy", P2PSWARM_HOME=str(tmp_path / "home"))
    issuer = load_or_create_identity(tmp_path / "issuer.key")
    nodes: list[Proc] = []
    try:
        relay = start_relay(tmp_path, env, issuer=issuer)
        nodes.append(relay)
        slice_experts(tiny_f32, tmp_path / "s.gguf", None, (0, 16))
        token = issue_token(issuer, worker_identity(tmp_path, "w").peer_id_str, ["relay"], 3600).encode()
        nodes.append(Proc(worker_args(tmp_path, tmp_path / "s.gguf", relay.addr, "w", token), tmp_path / "w.log", env))
        bb = Proc(["node", "--role", "backbone", "--model", str(tiny_f32), "--bootstrap", relay.addr, "--identity",
                   str(tmp_path / "bb.key"), "--http", "127.0.0.1:0", "--timeout", "10"], tmp_path / "bb.log", env)
        nodes.append(bb)
        base = next(w for w in bb.ready if w.startswith("http="))[5:]
        wait_until(lambda: httpx.get(base + "/v1/swarm", timeout=10).json()["workers"], timeout=60, what="worker")
        before = get_health(relay.health)["bytes_relayed"]
        r = httpx.post(base + "/v1/completions", json={"prompt": "The swarm", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        (w,) = httpx.get(base + "/v1/swarm", timeout=10).json()["workers"]
        assert w["relayed"] is True and w["lane"] == "libp2p" and w["requests"] > 0, w
        assert get_health(relay.health)["bytes_relayed"] > before
    finally:
        stop_all([n.proc for n in nodes])
