"""The chat page at `/` in headless Chromium (Debian's `chromium`), driven over the DevTools protocol:
typed text is sent, streamed text appears token by token, the stop button cancels."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
from typing import Any, AsyncIterator

import pytest
import pytest_asyncio
from websockets.asyncio.client import ClientConnection, connect

from tests.server.util import Server, gather_until_done, send, ws_connect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0", "--remote-allow-origins=*"]


class Page:
    """A page target over a flat DevTools session on the browser's socket."""

    def __init__(self, ws: ClientConnection, session: str) -> None:
        self.ws, self.session, self._ids = ws, session, itertools.count(1000)

    async def evaluate(self, expression: str, timeout: float = 120) -> Any:
        result = await cdp(self.ws, "Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                         "returnByValue": True}, self.session, timeout)
        if "exceptionDetails" in result:
            raise AssertionError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")


_ids = itertools.count(1)


async def cdp(ws: ClientConnection, method: str, params: dict[str, Any] | None = None,
              session: str | None = None, timeout: float = 60) -> dict[str, Any]:
    message_id = next(_ids)
    message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
    if session:
        message["sessionId"] = session
    await ws.send(json.dumps(message))
    async with asyncio.timeout(timeout):
        while True:
            reply = json.loads(await ws.recv())
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply["result"]


@pytest_asyncio.fixture(loop_scope="session")
async def page(server: Server) -> AsyncIterator[Page]:
    with tempfile.TemporaryDirectory(prefix="streamd-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank",
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            url = await asyncio.wait_for(_devtools_url(proc.stderr), 60)
            async with connect(url, max_size=None) as ws:
                target = await cdp(ws, "Target.createTarget", {"url": "about:blank"})
                attached = await cdp(ws, "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
                session = attached["sessionId"]
                await cdp(ws, "Page.enable", session=session)
                await cdp(ws, "Page.navigate", {"url": server.http + "/"}, session)
                page = Page(ws, session)
                await page.evaluate("new Promise(r => document.readyState === 'complete' ? r() : "
                                    "addEventListener('load', () => r()))")
                await page.evaluate("window.streamdChat.connected")
                yield page
        finally:
            proc.kill()
            await proc.wait()


async def _devtools_url(stderr: asyncio.StreamReader) -> str:
    while line := (await stderr.readline()).decode(errors="replace"):
        if "DevTools listening on " in line:
            return line.split("DevTools listening on ", 1)[1].strip()
    raise AssertionError("chromium exited without opening DevTools")


ASK = """(async () => {
  const $ = (id) => document.getElementById(id);
  const texts = [];
  const observer = new MutationObserver(() => {
    const el = document.querySelector('#messages .assistant:last-child');
    if (el && el.firstChild) texts.push(el.firstChild.textContent);
  });
  observer.observe($('messages'), {subtree: true, childList: true, characterData: true});
  const done = new Promise(r => document.addEventListener('streamd:done', e => r(e.detail), {once: true}));
  $('max-tokens').value = '%(max_tokens)d';
  $('temperature').value = '0';
  $('prompt').value = %(prompt)s;
  $('send').click();
  %(then)s
  const detail = await done;
  observer.disconnect();
  const el = document.querySelector('#messages .assistant:last-child');
  return {detail, texts, shown: el.firstChild ? el.firstChild.textContent : '',
          ttft: $('ttft').textContent, tps: $('tps').textContent};
})()"""

STOP_AFTER_FIRST_DELTA = """await new Promise(r => {
    const check = new MutationObserver(() => {
      const el = document.querySelector('#messages .assistant:last-child');
      if (el && Number(el.dataset.deltas) > 0) { check.disconnect(); r(); }
    });
    check.observe($('messages'), {subtree: true, attributes: true, attributeFilter: ['data-deltas']});
  });
  $('stop').click();"""


async def test_page_streams_tokens_as_they_arrive(server: Server, page: Page) -> None:
    prompt = "Say hello to the world."
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="ref", messages=[{"role": "user", "content": prompt}],
                   params={"max_tokens": 12, "temperature": 0})
        reference = (await gather_until_done(ws, {"ref"}))["ref"]
    got = await page.evaluate(ASK % {"max_tokens": 12, "prompt": json.dumps(prompt), "then": ""})
    detail = got["detail"]
    assert detail["reason"] == reference.done["finish_reason"]
    assert detail["text"] == reference.text and got["shown"] == reference.text
    assert detail["deltas"] >= 2 and len(set(got["texts"])) >= 2  # the text grew while streaming
    assert got["ttft"].endswith(" ms") and float(got["tps"]) > 0


async def test_stop_button_cancels(server: Server, page: Page) -> None:
    got = await page.evaluate(ASK % {"max_tokens": 2000, "prompt": json.dumps("Write a very long story."),
                                     "then": STOP_AFTER_FIRST_DELTA})
    assert got["detail"]["reason"] == "cancelled"
    assert 1 <= got["detail"]["tokens"] < 2000
