"""The dashboard in a real headless browser (Chromium driven by Playwright): the page loads, asks
for the API key, draws its charts, and the charts change while a load runs; with speculative
decoding on, its panel shows up.

Runs only where Playwright (`pip install playwright`) and a Chromium executable (Debian:
`apt-get install -y chromium`; or $KVSERVE_CHROMIUM) are installed; skips otherwise. Playwright
drives the system browser: no `playwright install`, no network.

docs/dashboard.png is written by a one-off run of this test, not on every run:
    KVSERVE_DASHBOARD_SCREENSHOT=docs/dashboard.png python3 -m pytest -q -p no:cacheprovider \
        tests/server/test_dashboard_browser.py
which also runs the load for longer (KVSERVE_DASHBOARD_LOAD_S, default 60 s then) so the charts
have some history.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import openai
import pytest

from tests.server.conftest import API_KEY, SERVER_ARGS

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed (pip install playwright)"
)

SCREENSHOT = os.environ.get("KVSERVE_DASHBOARD_SCREENSHOT")
LOAD_S = float(os.environ.get("KVSERVE_DASHBOARD_LOAD_S", "60" if SCREENSHOT else "8"))
SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
# one shared opening (prefix-cache hits) and copy-heavy endings (drafts that get accepted)
PREFIX = (
    "You are a careful assistant. Copy the inventory below exactly, line by line, keeping every "
    "number and name as written, then stop.\n"
)
ITEMS = [
    "apples 12, pears 7, plums 30",
    "bolts 400, nuts 380, washers 1200",
    "red 3, green 5, blue 8",
    "Monday 9:00, Tuesday 10:30, Wednesday 14:15",
]


def chromium_path() -> str | None:
    for candidate in (
        os.environ.get("KVSERVE_CHROMIUM"),
        "chromium",
        "chromium-browser",
        "google-chrome",
    ):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


@pytest.fixture(scope="module")
def spec_server(server_factory):
    srv = server_factory([*SERVER_ARGS, "--speculative-config", SPEC])
    srv.wait_ready()
    yield srv
    srv.stop()
    os.unlink(srv.log.name)


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium executable (apt-get install -y chromium, or set KVSERVE_CHROMIUM)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def run_load(base_url: str, seconds: float, concurrency: int = 4) -> list[Exception]:
    """`concurrency` clients sending streamed completions back to back for `seconds`."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    deadline = time.monotonic() + seconds
    errors: list[Exception] = []

    def worker(w: int):
        i = 0
        while time.monotonic() < deadline and not errors:
            items = "\n".join(ITEMS[(w + i + k) % len(ITEMS)] for k in range(3))
            try:
                for _ in client.completions.create(
                    model=model,
                    prompt=f"{PREFIX}{items}\n\nCopy:\n{items}\n",
                    max_tokens=64,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    pass
            except Exception as e:  # reported by the test
                errors.append(e)
            i += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def drawn(page, panel: str) -> list[list]:
    return page.evaluate(f"window.kvserveDashboard.drawn[{panel!r}]")


def test_dashboard_charts_follow_a_load_in_chromium(browser, spec_server, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    console_errors = []
    page.on("pageerror", lambda e: console_errors.append(str(e)))
    outside = []  # works offline: any request leaving the server is refused and recorded

    def only_the_server(route):
        if route.request.url.startswith(spec_server.base_url + "/"):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_server)
    page.goto(f"{spec_server.base_url}/dashboard")
    # the data need the key: the page asks for it, then draws
    page.wait_for_selector("#auth", state="visible", timeout=15000)
    page.fill("#auth-key", API_KEY)
    page.click("#auth button")
    page.wait_for_function("window.kvserveDashboard.draws >= 2", timeout=15000)
    assert page.is_visible("#panel-spec")  # --speculative-config is on
    assert page.text_content("#model").startswith(spec_server_model(spec_server))
    canvas = "#panel-throughput canvas"
    before_png = page.eval_on_selector(canvas, "c => c.toDataURL()")
    draws_before = page.evaluate("window.kvserveDashboard.draws")
    assert not any(v for v in drawn(page, "throughput")[0] if v), (
        "output tokens/s before any request"
    )

    errors = run_load(spec_server.base_url, LOAD_S)
    assert not errors, errors

    # the page keeps polling: within a few refreshes it has drawn the load
    page.wait_for_function(
        """() => {
        const d = window.kvserveDashboard.drawn;
        const some = (cols, i) => cols && cols[i].some(v => v !== null && v > 0);
        return some(d.throughput, 0) && some(d.requests, 0) && some(d.ttft, 0) && some(d.tpot, 0)
               && some(d.kv, 0) && some(d.spec, 0);
    }""",
        timeout=30000,
    )
    assert page.evaluate("window.kvserveDashboard.draws") > draws_before
    assert page.eval_on_selector(canvas, "c => c.toDataURL()") != before_png
    assert any(
        v is not None and v > 0 for v in drawn(page, "prefix")[0]
    )  # the shared opening hit the cache
    assert not console_errors, console_errors
    assert not outside, outside
    assert page.evaluate("window.kvserveDashboard.errors") == 0

    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    if SCREENSHOT:
        page.screenshot(path=SCREENSHOT, full_page=True)
    page.close()


def spec_server_model(srv) -> str:
    client = openai.OpenAI(
        base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30
    )
    return client.models.list().data[0].id
