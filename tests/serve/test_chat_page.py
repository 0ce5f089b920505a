"""The chat page at / (serve/page.py, serve/static/) in a real headless Chromium driven by Playwright.

The server is granian serving tests/helpers/chat_page_app.py: the real engine over a runner that plays
a markdown script (one byte a step, a few ms each), with an API key required. The page is
loaded without the key, given it, and checked to: show the model, its context length and its
backend card; stream an answer (text seen while the stream is open) and render its markdown
safely (no element from the model's HTML, no javascript: link; markdown.js on small cases); send the system prompt,
temperature, max tokens and the whole conversation; show reasoning deltas (reasoning_content
and reasoning, from a stream the test scripts through Playwright's routing) collapsed; stop
a long answer, after which /metrics shows the request's sequence and KV blocks freed, long
before its max_tokens could have run, and the partial answer stays in the conversation; and
start a new chat mid-stream (aborted too, and forgotten). Every request the page makes is to the server's own
origin. A screenshot is taken; TL_SCREENSHOTS=1 (or a missing docs/chat-page.png) writes it
to docs/chat-page.png for the README.

Skips, saying how to install them, without Playwright (`pip install -e '.[test]'`) or a
Chromium (Debian's `chromium` package, which `make test` installs where it can, or
`python -m playwright install chromium`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.helpers.granian_server import ROOT, free_port, granian_argv, running

pytest.importorskip("playwright.sync_api", reason="needs Playwright: pip install -e '.[test]'")
from playwright.sync_api import Browser, Error, Page, Route, expect, sync_playwright  # noqa: E402

pytestmark = pytest.mark.serial  # timing bounds: `make test` runs it alone, after the parallel part

KEY = "sk-page"
SCRIPT = """## Fibonacci

Here is **bold**, *italic*, ~~struck~~ and `inline code`; see [the docs](https://example.com/docs).

- first item
- second item
  - nested item

1. one
2. two

```python
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)
```

> Escaped: <img src=x onerror=alert(1)> and [bad](javascript:evil).
"""
INSTALL = (
    "needs a Chromium for Playwright: Debian's package (`apt-get install chromium`; `make test` "
    "installs it where it can) or Playwright's own (`python -m playwright install chromium`)"
)
SCREENSHOT = ROOT / "docs" / "chat-page.png"


@contextmanager
def server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(API origin, health origin) of a granian serving tests/helpers/chat_page_app.py with an API key."""
    port, hport = free_port(), free_port()
    cfg = tmp_path / "runtime.toml"
    cfg.write_text(
        f'[engine]\nmodel_dir = "models/tiny-chat"\nblock_size = 4\nnum_kv_blocks = 2048\n'
        f'http_listen = "127.0.0.1:{port}"\nhealth_listen = "127.0.0.1:{hport}"\napi_keys = ["{KEY}"]\n'
    )
    env = {
        **os.environ,
        "TL_CONFIG": str(cfg),
        "PYTHONPATH": str(ROOT),
        "CHAT_PAGE_SCRIPT": SCRIPT,
        "CHAT_PAGE_STEP_DELAY_S": "0.004",
    }
    api = f"http://127.0.0.1:{port}"
    with running(granian_argv(port, "tests.helpers.chat_page_app:app"), env, f"{api}/healthz", timeout_s=20):
        yield api, f"http://127.0.0.1:{hport}"


@contextmanager
def chromium() -> Iterator[Browser]:
    """A headless Chromium: the system's (Debian's package), else Playwright's own; skip if neither."""
    with sync_playwright() as p:
        path = shutil.which("chromium") or shutil.which("chromium-browser")
        try:
            browser = p.chromium.launch(executable_path=path) if path else p.chromium.launch()
        except Error as e:
            pytest.skip(f"{INSTALL} ({str(e).splitlines()[0]})")
        try:
            yield browser
        finally:
            browser.close()


def metric(health: str, name: str) -> float:
    for line in httpx.get(f"{health}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def check_static_answers(api: str) -> None:
    """Content types, validators, caching, methods; the page needs no key, the API still does."""
    r = httpx.get(f"{api}/")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["cache-control"] == "no-cache" and "connect-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff" and "<title>tl chat</title>" in r.text
    assert httpx.get(f"{api}/", headers={"if-none-match": r.headers["etag"]}).status_code == 304
    head = httpx.head(f"{api}/")
    assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == str(len(r.content))
    post = httpx.post(f"{api}/", content=b"x")
    assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
    for name, ctype in (("chat.js", "text/javascript"), ("chat.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        assert httpx.get(f"{api}/static/{name}").headers["content-type"].startswith(ctype)
    assert httpx.get(f"{api}/static/nope.js").status_code == 404
    assert httpx.get(f"{api}/v1/models").status_code == 401


LINK_ATTRS = 'rel="noopener noreferrer" target="_blank"'
MARKDOWN = {
    "snake_case_word and 2*3*4": "<p>snake_case_word and 2<em>3</em>4</p>",
    "<script>alert(1)</script> & **unclosed": "<p>&lt;script&gt;alert(1)&lt;/script&gt; &amp; **unclosed</p>",
    "a\\*b\\* `` x ` y ``": "<p>a*b* <code>x ` y</code></p>",
    "[x](data:text/html,hi) [y](mailto:a@b.c)": f'<p>x <a href="mailto:a@b.c" {LINK_ATTRS}>y</a></p>',
    "see https://example.com/a_b.": f'<p>see <a href="https://example.com/a_b" {LINK_ATTRS}>https://example.com/a_b</a>.</p>',
    "1. a\n\n3. b\n   more\n\n---\n# H *i*": "<ol><li>a</li><li>b<br>more</li></ol><hr><h1>H <em>i</em></h1>",
    "```js\nlet a = 1;": '<pre><code class="language-js">let a = 1;</code></pre>',  # unclosed: mid-stream
}


def check_markdown(page: Page) -> None:
    """markdown.js on small cases: what it builds, as HTML (a code block's header left out)."""
    got = page.evaluate(
        """cases => cases.map(text => {
            const div = document.createElement('div');
            div.appendChild(window.tlMarkdown.render(text));
            div.querySelectorAll('.code-head').forEach(h => h.remove());
            div.querySelectorAll('.code').forEach(c => c.replaceWith(...c.childNodes));
            return div.innerHTML;
        })""",
        list(MARKDOWN),
    )
    assert dict(zip(MARKDOWN, got, strict=True)) == MARKDOWN


def scripted_reasoning_stream(route: Route) -> None:
    """A chat stream whose reasoning comes first, as a thinking model's does: in reasoning_content,
    in both names at once (tl's chunks, read once), and in reasoning."""

    def chunk(delta: dict[str, str], finish: str | None = None) -> str:
        doc = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "tiny-chat"}
        return "data: " + json.dumps({**doc, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    events = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "The user wants "}),
        chunk({"reasoning_content": "a short answer, ", "reasoning": "a short answer, "}),  # as tl sends it
        chunk({"reasoning": "so one line."}),
        chunk({"content": "Sure: **done**."}, "stop"),
        ": ping",
        "data: [DONE]",
    ]
    route.fulfill(status=200, content_type="text/event-stream", body="\n\n".join(events) + "\n\n")


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_chat_page_streams_renders_reasons_stops_and_stays_offline(tmp_path: Path) -> None:
    with chromium() as browser, server(tmp_path) as (api, health):
        check_static_answers(api)
        page = browser.new_page(viewport={"width": 1200, "height": 860}, color_scheme="light")
        urls: list[str] = []
        page.on("request", lambda r: urls.append(r.url))
        problems: list[str] = []
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)
        page.on("dialog", lambda d: problems.append(f"dialog: {d.message}"))
        page.goto(f"{api}/")

        expect(page.locator("#model-id")).to_have_text("API key needed")
        page.fill("#api-key", KEY)
        page.click("#save-key")
        expect(page.locator("#model-id")).to_have_text("tiny-chat")
        expect(page.locator("#model-ctx")).to_have_text("context 4,096 tokens")
        expect(page.locator("#backend summary")).to_have_text("Backend: cpu test runner \u00d71")
        expect(page.locator("#backend-list")).to_contain_text("reference (scripted)")
        assert page.evaluate("localStorage.getItem('tl.api-key')") == KEY
        check_markdown(page)

        # turn 1: the script exactly (max tokens = its length), streamed, rendered as markdown
        page.fill("#system", "Answer in markdown.")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", str(len(SCRIPT)))
        send(page, "Show me some markdown")
        first = page.locator(".msg.assistant").nth(0)
        page.wait_for_function(
            "() => { const m = document.querySelector('.msg.assistant.streaming .content');"
            " return m && m.textContent.length > 0; }"
        )  # text on the page while the stream is still open
        expect(first).to_have_attribute("data-state", "done", timeout=15_000)
        md = first.locator(".content")
        expect(md.locator("h2")).to_have_text("Fibonacci")
        expect(md.locator("strong")).to_have_text("bold")
        expect(md.locator("em")).to_have_text("italic")
        expect(md.locator("del")).to_have_text("struck")
        expect(md.locator("p code")).to_have_text("inline code")
        expect(md.locator("a")).to_have_attribute("href", "https://example.com/docs")
        expect(md.locator(":scope > ul > li")).to_have_count(2)
        expect(md.locator("ul ul > li")).to_have_text("nested item")
        expect(md.locator(":scope > ol > li")).to_have_count(2)
        expect(md.locator("pre code.language-python")).to_contain_text("return n if n < 2 else fib(n - 1)")
        expect(md.locator("blockquote")).to_contain_text("<img src=x onerror=alert(1)> and bad.")
        assert md.locator("img").count() == 0 and page.locator("a[href^='javascript']").count() == 0
        expect(first.locator(".meta")).to_contain_text(f"{len(SCRIPT)} completion tokens of 4,096")
        expect(first.locator(".meta")).to_contain_text("finish: length")

        # turn 2: reasoning first, shown collapsed; the request carried the settings and both turns
        sent: list[dict[str, object]] = []

        def reasoning(route: Route) -> None:
            sent.append(route.request.post_data_json)
            scripted_reasoning_stream(route)

        page.route("**/v1/chat/completions", reasoning)
        send(page, "Now be brief")
        second = page.locator(".msg.assistant").nth(1)
        expect(second).to_have_attribute("data-state", "done")
        page.unroute("**/v1/chat/completions")
        details = second.locator("details.reasoning")
        expect(details).to_be_visible()
        expect(details).not_to_have_attribute("open", "")
        expect(details.locator("summary")).to_have_text("Reasoning")
        expect(details.locator(".reasoning-text")).to_have_text("The user wants a short answer, so one line.")
        expect(second.locator(".content strong")).to_have_text("done")
        body = sent[0]
        assert (body["temperature"], body["max_tokens"], body["stream"], body["model"]) == (
            0,
            len(SCRIPT),
            True,
            "tiny-chat",
        )
        assert body["messages"] == [
            {"role": "system", "content": "Answer in markdown."},
            {"role": "user", "content": "Show me some markdown"},
            {"role": "assistant", "content": SCRIPT},
            {"role": "user", "content": "Now be brief"},
        ]
        page.screenshot(path=str(tmp_path / "chat-page.png"))
        if os.environ.get("TL_SCREENSHOTS") == "1" or not SCREENSHOT.exists():
            shutil.copyfile(tmp_path / "chat-page.png", SCREENSHOT)

        # turn 3: a long answer stopped mid-stream; the server frees its sequence and blocks
        page.fill("#max-tokens", "3000")
        send(page, "Again, at length")
        third = page.locator(".msg.assistant").nth(2)
        page.wait_for_function(
            "() => { const m = document.querySelectorAll('.msg.assistant')[2];"
            " return m && m.classList.contains('streaming') && m.textContent.length > 80; }"
        )
        assert metric(health, "tl_engine_active_sequences") == 1
        expect(page.locator("#stop")).to_be_enabled()
        page.click("#stop")
        t0 = time.monotonic()
        expect(third).to_have_attribute("data-state", "stopped")
        expect(page.locator("#stop")).to_be_disabled()
        expect(page.locator("#send")).to_be_enabled()
        while metric(health, "tl_engine_active_sequences") or metric(health, 'tl_engine_kv_blocks{state="used"}'):
            assert time.monotonic() - t0 < 2.0, "the stopped request still holds its sequence or blocks"
            time.sleep(0.02)
        assert len(third.locator(".content").inner_text()) < 1000  # of the 3000 tokens asked for
        assert metric(health, "tl_engine_aborted_sequences_total") == 1  # the engine saw the abort
        assert metric(health, 'tl_http_requests_total{endpoint="/v1/chat/completions",status="200"}') == 2
        assert metric(health, 'tl_http_requests_total{endpoint="/",status="200"}') >= 1

        # the stopped answer stays in the conversation; "New chat" mid-stream aborts and forgets it all
        page.route("**/v1/chat/completions", reasoning)
        send(page, "Continue")
        expect(page.locator(".msg.assistant").nth(3)).to_have_attribute("data-state", "done")
        partial = sent[1]["messages"][-2]  # type: ignore[index]
        assert partial["role"] == "assistant" and len(partial["content"]) > 60
        assert (SCRIPT * 3).startswith(partial["content"])
        page.unroute("**/v1/chat/completions")
        send(page, "Long again")
        page.wait_for_function("() => document.querySelector('.msg.assistant.streaming')?.textContent.length > 40")
        page.click("#new-chat")
        expect(page.locator(".msg")).to_have_count(0)
        t0 = time.monotonic()
        while metric(health, "tl_engine_active_sequences"):
            assert time.monotonic() - t0 < 2.0, "New chat left its stream running"
            time.sleep(0.02)
        page.route("**/v1/chat/completions", reasoning)
        send(page, "Fresh start")
        expect(page.locator(".msg.assistant")).to_have_attribute("data-state", "done")
        assert sent[2]["messages"] == [
            {"role": "system", "content": "Answer in markdown."},
            {"role": "user", "content": "Fresh start"},
        ]

        assert problems == []
        assert urls and all(u.startswith(f"{api}/") for u in urls), [u for u in urls if not u.startswith(api)]
