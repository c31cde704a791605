"""The chat page at `/` in headless Chromium (Debian's `chromium`, driven by playwright) against a real
server and model: typed text is sent and streams in token by token, stop cancels, regenerate and new chat
work, markdown and code render, model output that tries HTML or script stays inert (through the rendering
function directly and through the page's real socket handler), the engine view follows a generation, the
key field shows only when the server needs a key, and an unfinished answer is resumed (client side) after
a dropped connection. Every page runs under the server's own Content-Security-Policy (no inline script or
style: tests/server/test_security.py checks the header) and must end without a script error, a CSP
violation or a failed load."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from playwright.async_api import Browser, ConsoleMessage, Page, async_playwright

from streamd.engine.client.async_engine import AsyncEngine
from tests.server.util import Server, gather_until_done, running_server, send, ws_connect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
TIMEOUT = 120


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        # Chromium's local-network check (private-network access prompts) is not what this test is about.
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-features=LocalNetworkAccessChecks"])
        yield browser
        await browser.close()


async def open_page(browser: Browser, url: str, problems: list[str]) -> Page:
    context = await browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
    page = await context.new_page()
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("console", lambda message: _console(message, problems))
    await page.goto(url)
    return page


def _console(message: ConsoleMessage, problems: list[str]) -> None:
    if message.type == "error":
        problems.append(f"console: {message.text}")


@pytest_asyncio.fixture(loop_scope="session")
async def page(browser: Browser, server: Server) -> AsyncIterator[Page]:
    problems: list[str] = []
    page = await open_page(browser, server.http + "/", problems)
    await evaluate(page, "window.streamdChat.connected")
    yield page
    await page.context.close()
    assert problems == []


async def evaluate(page: Page, script: str, arg: Any = None) -> Any:
    async with asyncio.timeout(TIMEOUT):
        return await page.evaluate(script, arg)


# Arms window.nextDone: the detail of the next `streamd:done` event.
ARM_DONE = """() => {
  window.nextDone = new Promise((r) => document.addEventListener('streamd:done', (e) => r(e.detail), {once: true}));
}"""

# Sends `prompt` with the page's own controls, recording the texts the answer shows while streaming.
ASK = """({prompt, maxTokens}) => {
  const $ = (id) => document.getElementById(id);
  window.shownTexts = [];
  window.textObserver = new MutationObserver(() => {
    const body = document.querySelector('#messages .assistant:last-child .body');
    if (body) window.shownTexts.push(body.textContent);
  });
  window.textObserver.observe($('messages'), {subtree: true, childList: true, characterData: true});
  $('max-tokens').value = String(maxTokens);
  $('temperature').value = '0';
  $('prompt').value = prompt;
  $('send').click();
}"""

# Resolves with the finished answer's event detail, the texts it showed, its HTML and the stats line.
ANSWER = """async () => {
  const $ = (id) => document.getElementById(id);
  const detail = await window.nextDone;
  window.textObserver.disconnect();
  const body = document.querySelector('#messages .assistant:last-child .body');
  return {detail, texts: window.shownTexts, html: body.innerHTML, ttft: $('ttft').textContent,
          tps: $('tps').textContent};
}"""

STOP_AFTER_FIRST_DELTA = """() => new Promise((r) => {
  const check = new MutationObserver(() => {
    const el = document.querySelector('#messages .assistant:last-child');
    if (el && Number(el.dataset.deltas) > 0) { check.disconnect(); document.getElementById('stop').click(); r(); }
  });
  check.observe(document.getElementById('messages'), {subtree: true, attributes: true, attributeFilter: ['data-deltas']});
})"""

RENDER = """(markdown) => {
  const div = document.createElement('div');
  window.streamdRender.into(div, markdown);
  return div.innerHTML;
}"""

# Records the frames the page sends; generate frames are swallowed (the test answers them itself)
# when `swallow` is set. Returns nothing; frames land in window.sentFrames, the socket in window.fakeWs.
SPY_SEND = """(swallow) => {
  window.sentFrames = [];
  const original = WebSocket.prototype.send;
  WebSocket.prototype.send = function (data) {
    const frame = JSON.parse(data);
    window.sentFrames.push(frame);
    window.fakeWs = this;
    if (swallow && frame.type === 'generate') return;
    return original.call(this, data);
  };
}"""

# Sends `prompt` (its generate frame swallowed) and feeds `frames` through the real socket's handler.
FEED = """async ({prompt, frames}) => {
  const $ = (id) => document.getElementById(id);
  $('prompt').value = prompt;
  $('send').click();
  const id = window.sentFrames.filter((f) => f.type === 'generate').at(-1).id;
  for (const frame of frames) {
    window.fakeWs.dispatchEvent(new MessageEvent('message', {data: JSON.stringify({...frame, id})}));
  }
  return id;
}"""

async def ask(page: Page, prompt: str, max_tokens: int, then: str | None = None) -> dict[str, Any]:
    await evaluate(page, ARM_DONE)
    await evaluate(page, ASK, {"prompt": prompt, "maxTokens": max_tokens})
    if then is not None:
        await evaluate(page, then)
    return await evaluate(page, ANSWER)


async def test_page_streams_tokens_as_they_arrive(server: Server, page: Page) -> None:
    prompt = "Say hello to the world."
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="ref", messages=[{"role": "user", "content": prompt}],
                   params={"max_tokens": 12, "temperature": 0})
        reference = (await gather_until_done(ws, {"ref"}))["ref"]
    await evaluate(page, """() => {
      const original = window.streamdRender.into;
      window.renderCalls = 0;
      window.streamdRender.into = (el, markdown) => { window.renderCalls += 1; return original(el, markdown); };
    }""")
    got = await ask(page, prompt, 12)
    detail = got["detail"]
    assert detail["reason"] == reference.done["finish_reason"] and detail["text"] == reference.text
    assert detail["deltas"] >= 2 and len(set(got["texts"])) >= 2  # the text grew while streaming
    assert 2 <= await evaluate(page, "window.renderCalls") <= detail["deltas"]  # (at most once per frame)
    assert got["html"] == await evaluate(page, RENDER, reference.text)
    assert got["ttft"].endswith(" ms") and float(got["tps"]) > 0
    assert await page.text_content("#model") == server.services.model_name
    assert await page.text_content("#status-text") == "ready"


async def test_stop_button_cancels(page: Page) -> None:
    got = await ask(page, "Write a very long story.", 2000, STOP_AFTER_FIRST_DELTA)
    assert got["detail"]["reason"] == "cancelled"
    assert 1 <= got["detail"]["tokens"] < 2000
    assert await page.is_enabled("#send") and await page.is_disabled("#stop")


async def test_markdown_and_code_render(page: Page) -> None:
    markdown = ("# Title\n\nSome **bold**, *em* and `inline()`.\n\n```python\ndef f(x):\n    return x < 1\n```\n\n"
                "| a | b |\n|---|---|\n| 1 | 2 |\n\n- one\n- two\n\n[docs](https://example.com/d)\n\n"
                "Raw <b>html</b> stays text; ![a picture](https://example.com/p.png) becomes a link.")
    html = await evaluate(page, RENDER, markdown)
    shape = await evaluate(page, """(html) => {
      const div = document.createElement('div');
      div.innerHTML = html;  // (the test's own parse of the sanitized result)
      const code = div.querySelector('pre > code.language-python');
      const link = div.querySelector('a');
      const last = div.querySelector('p:last-of-type');
      return {h1: div.querySelector('h1')?.textContent, bold: div.querySelector('strong')?.textContent,
              inline: div.querySelector('p code')?.textContent, code: code?.textContent,
              copy: div.querySelector('pre > button.copy-code')?.textContent, cells: div.querySelectorAll('td').length,
              items: div.querySelectorAll('ul > li').length, href: link?.href, target: link?.target, rel: link?.rel,
              last: last.textContent, bTags: div.querySelectorAll('b').length,
              links: [...div.querySelectorAll('a')].map((a) => a.href), images: div.querySelectorAll('img').length};
    }""", html)
    assert shape == {"h1": "Title", "bold": "bold", "inline": "inline()", "code": "def f(x):\n    return x < 1\n",
                     "copy": "Copy", "cells": 2, "items": 2, "href": "https://example.com/d", "target": "_blank",
                     "rel": "noopener noreferrer", "bTags": 0, "images": 0,
                     "last": "Raw <b>html</b> stays text; a picture becomes a link.",
                     "links": ["https://example.com/d", "https://example.com/p.png"]}


ATTACKS = ('<img src=x onerror="window.pwned=1"> <script>window.pwned=2</script>\n\n'
           '[click](javascript:window.pwned=3) ![img](x" onerror="window.pwned=4)\n\n'
           '<svg onload="window.pwned=5"></svg><iframe srcdoc="<script>parent.pwned=6</script>"></iframe>\n\n'
           '<a href="javascript:window.pwned=7">a</a> <details open ontoggle="window.pwned=8">d</details>')

INERT = """async (selector) => {
  await new Promise((r) => setTimeout(r, 50));  // let any handler that got through run
  const root = document.querySelector(selector);
  const bad = root.querySelectorAll('img, script, svg, iframe, details, object, embed, style');
  const handlers = [...root.querySelectorAll('*')].filter((el) => [...el.attributes].some((a) => a.name.startsWith('on')));
  const scripted = [...root.querySelectorAll('[href], [src], [srcdoc], [action], [formaction]')]
    .filter((el) => !el.hasAttribute('href') || /^\\s*(javascript|data|vbscript):/i.test(el.getAttribute('href')));
  return {pwned: window.pwned ?? null, bad: bad.length, handlers: handlers.length, scripted: scripted.length,
          text: root.textContent};
}"""


async def test_html_in_model_output_is_inert(page: Page) -> None:
    # The rendering function itself, on hostile markdown, attached to the live document.
    await evaluate(page, """(markdown) => {
      const div = document.createElement('div');
      div.id = 'probe';
      document.body.appendChild(div);
      window.streamdRender.into(div, markdown);
    }""", ATTACKS)
    direct = await evaluate(page, INERT, "#probe")
    assert (direct["pwned"], direct["bad"], direct["handlers"], direct["scripted"]) == (None, 0, 0, 0), direct
    assert '<img src=x onerror="window.pwned=1">' in direct["text"]  # shown as text, not interpreted
    # The same text arriving as frames on the page's real socket handler, split mid-tag.
    await evaluate(page, SPY_SEND, True)
    cut = ATTACKS.index("onerror")
    frames = [{"type": "start", "prompt_tokens": 3},
              {"type": "delta", "seq": 0, "text": ATTACKS[:cut], "token_ids": [1], "index": 0},
              {"type": "delta", "seq": 1, "text": ATTACKS[cut:], "token_ids": [2], "index": 0},
              {"type": "done", "finish_reason": "stop", "finish_reasons": ["stop"], "usage": {}}]
    await evaluate(page, ARM_DONE)
    await evaluate(page, FEED, {"prompt": "hi", "frames": frames})
    assert (await evaluate(page, "window.nextDone"))["text"] == ATTACKS
    streamed = await evaluate(page, INERT, "#messages .assistant:last-child .body")
    assert (streamed["pwned"], streamed["bad"], streamed["handlers"], streamed["scripted"]) == (None, 0, 0, 0)
    assert streamed["text"].startswith(direct["text"])


async def test_engine_view_follows_a_generation(page: Page) -> None:
    seen = await evaluate(page, """async () => {
      const $ = (id) => document.getElementById(id);
      const num = (id) => Number($(id).textContent);
      const busy = () => num('req-running') >= 1 && num('kv-used') > 0 && num('engine-tps') > 0;
      const done = new Promise((r) => document.addEventListener('streamd:done', (e) => r(e.detail), {once: true}));
      const view = new Promise((r) => {
        const observer = new MutationObserver(() => { if (busy()) { observer.disconnect(); r('busy'); } });
        observer.observe($('engine'), {subtree: true, childList: true, characterData: true});
      });
      const frames = Number($('engine').dataset.frames);
      $('max-tokens').value = '2000';
      $('temperature').value = '0';
      $('prompt').value = 'Write a very long story.';
      $('send').click();
      const first = await Promise.race([view, done.then(() => 'finished first')]);
      const shown = {running: num('req-running'), used: num('kv-used'), tps: num('engine-tps')};
      $('stop').click();
      const detail = await done;
      return {first, shown, reason: detail.reason, newFrames: Number($('engine').dataset.frames) - frames};
    }""")
    assert seen["first"] == "busy" and seen["reason"] == "cancelled", seen
    assert seen["newFrames"] >= 1
    async with asyncio.timeout(TIMEOUT):  # the next frames show the engine idle again
        await page.wait_for_function("() => document.getElementById('req-running').textContent === '0' && "
                                     "document.getElementById('kv-used').textContent === '0'")


async def test_regenerate_new_chat_settings_and_copy(page: Page, server: Server) -> None:
    await page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.http)
    await evaluate(page, SPY_SEND, False)
    await page.click("#settings summary")
    await page.fill("#system-prompt", "Answer in one word.")
    await page.fill("#seed", "7")
    first = (await ask(page, "Name a colour.", 8))["detail"]
    await evaluate(page, ARM_DONE)
    await page.click(".msg.assistant .regenerate")
    second = await evaluate(page, "window.nextDone")
    generates = await evaluate(page, "window.sentFrames.filter((f) => f.type === 'generate')")
    assert [g["messages"] for g in generates] == [[{"role": "system", "content": "Answer in one word."},
                                                   {"role": "user", "content": "Name a colour."}]] * 2
    assert generates[0]["params"] == {"max_tokens": 8, "temperature": 0, "seed": 7}
    assert second["text"] == first["text"] and second["id"] != first["id"]  # greedy: the same answer again
    assert await page.locator("#messages .msg").count() == 2  # the old answer was replaced
    await page.click(".msg.assistant .meta .copy")
    assert await evaluate(page, "navigator.clipboard.readText()") == second["text"]
    await page.click("#new-chat")
    assert await page.locator("#messages .msg").count() == 0
    third = (await ask(page, "Say hi.", 4))["detail"]
    assert await evaluate(page, "window.sentFrames.filter((f) => f.type === 'generate').at(-1).messages") == [
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Say hi."}]
    assert third["error"] is None


async def test_key_field_only_when_a_key_is_needed(browser: Browser, page: Page, async_engine: AsyncEngine) -> None:
    assert await page.is_hidden("#key-box")
    problems: list[str] = []
    async with running_server(async_engine, api_keys=["k1"]) as locked:
        keyed = await open_page(browser, locked.http + "/", problems)
        async with asyncio.timeout(TIMEOUT):
            await keyed.wait_for_function("() => document.getElementById('status-text').textContent === "
                                          "'API key required'")
        assert await keyed.is_visible("#key-box") and await keyed.text_content("#model") == "enter an API key"
        await keyed.fill("#api-key", "k1")
        await keyed.click("#key-box button")
        await evaluate(keyed, "window.streamdChat.connected")
        async with asyncio.timeout(TIMEOUT):
            await keyed.wait_for_function("(name) => document.getElementById('model').textContent === name",
                                          arg=locked.services.model_name)
        got = await ask(keyed, "Hi", 3)
        assert got["detail"]["error"] is None and got["detail"]["tokens"] >= 1
        await keyed.context.close()
    assert problems == []


RESUME_FRAMES = [{"type": "start", "prompt_tokens": 3, "resume_token": "T1"},
                 *({"type": "delta", "seq": k, "text": f"part{k} ", "token_ids": [k], "index": 0} for k in range(3))]


async def test_a_dropped_connection_resumes_the_answer(page: Page) -> None:
    """Client side of resume: after the socket drops the page shows it is reconnecting, reconnects and asks
    for the deltas after the last one it has; this server cannot resume, so its error ends the answer."""
    await evaluate(page, SPY_SEND, True)
    await evaluate(page, ARM_DONE)
    await evaluate(page, FEED, {"prompt": "hi", "frames": RESUME_FRAMES})
    await evaluate(page, """() => {
      window.statuses = [];
      const status = document.getElementById('status-text');
      new MutationObserver(() => window.statuses.push(status.textContent)).observe(status, {childList: true});
      window.fakeWs.close();
    }""")
    detail = await evaluate(page, "window.nextDone")
    assert (await evaluate(page, "window.statuses"))[0].startswith("reconnecting")
    resumes = await evaluate(page, "window.sentFrames.filter((f) => f.type === 'resume')")
    assert resumes == [{"type": "resume", "id": detail["id"], "resume_token": "T1", "after_seq": 2}]
    assert detail["reason"] == "error" and detail["error"] and detail["text"] == "part0 part1 part2 "
    await evaluate(page, "window.streamdChat.connected")
    assert await page.is_enabled("#send")


async def test_without_a_resume_token_a_drop_ends_the_answer(page: Page) -> None:
    await evaluate(page, SPY_SEND, True)
    await evaluate(page, ARM_DONE)
    frames = [{**RESUME_FRAMES[0], "resume_token": None}, *RESUME_FRAMES[1:]]
    await evaluate(page, FEED, {"prompt": "hi", "frames": frames})
    await evaluate(page, "window.fakeWs.close()")
    detail = await evaluate(page, "window.nextDone")
    assert (detail["reason"], detail["error"], detail["text"]) == ("error", "connection lost", "part0 part1 part2 ")
    assert await evaluate(page, "window.sentFrames.filter((f) => f.type === 'resume')") == []


async def test_the_page_resumes_an_answer_on_the_real_server(page: Page, server: Server) -> None:
    """End to end with the server's resume (issue 12): the page's socket closes mid-answer; the page
    reconnects, sends `resume` after the last delta it has, and the answer it ends with is exactly the one
    an uninterrupted request gives."""
    await evaluate(page, SPY_SEND, False)
    await evaluate(page, ARM_DONE)
    await evaluate(page, ASK, {"prompt": "Name three colours and say why you like them.", "maxTokens": 40})
    async with asyncio.timeout(TIMEOUT):
        await page.wait_for_function("() => Number(document.querySelector('#messages .assistant:last-child')"
                                     "?.dataset.deltas) >= 3")
    await evaluate(page, "window.fakeWs.close()")
    got = await evaluate(page, ANSWER)
    generate = await evaluate(page, "window.sentFrames.filter((f) => f.type === 'generate').at(-1)")
    (resume,) = await evaluate(page, "window.sentFrames.filter((f) => f.type === 'resume')")
    assert resume["id"] == generate["id"] and resume["after_seq"] >= 2
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="ref", messages=generate["messages"], params=generate["params"])
        expected = (await gather_until_done(ws, {"ref"}))["ref"]
    assert got["detail"]["error"] is None and got["detail"]["reason"] == expected.done["finish_reason"]
    assert got["detail"]["text"] == expected.text


async def test_progress_frames_show_queue_place_and_prompt_reading(page: Page) -> None:
    """Issue 32: before the first token the answer says where it waits and how much of the prompt is read,
    instead of a frozen spinner; the first delta replaces that note with the text."""
    await evaluate(page, SPY_SEND, True)
    progress = {"type": "progress", "prompt_tokens": 200, "cached_tokens": 0}
    note = "#messages .assistant:last-child .progress-note"
    await evaluate(page, FEED, {"prompt": "hi", "frames": [
        {"type": "start", "prompt_tokens": 200}, {**progress, "queue_position": 3, "prompt_tokens_done": 0}]})
    assert await page.text_content(note) == "queued #3"
    assert await page.text_content("#status-text") == "queued #3…"
    await evaluate(page, """(frame) => window.fakeWs.dispatchEvent(new MessageEvent('message',
      {data: JSON.stringify({...frame, id: window.sentFrames.at(-1).id})}))""",
                   {**progress, "queue_position": None, "prompt_tokens_done": 90})
    assert await page.text_content(note) == "reading the prompt 45%"
    await evaluate(page, ARM_DONE)
    await evaluate(page, """(frames) => { for (const frame of frames) window.fakeWs.dispatchEvent(new MessageEvent(
      'message', {data: JSON.stringify({...frame, id: window.sentFrames.at(-1).id})})); }""", [
        {"type": "delta", "seq": 0, "text": "Hello", "token_ids": [1], "index": 0},
        {"type": "done", "finish_reason": "stop", "finish_reasons": ["stop"], "usage": {}}])
    assert (await evaluate(page, "window.nextDone"))["text"] == "Hello"
    assert await page.query_selector(note) is None
