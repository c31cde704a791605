"""Retakes docs/chat-page.png: the chat page of a running server (desktop, light), with one finished answer
and a second one streaming, so the engine view shows a request at work.

    python docs/chat_page_screenshot.py http://127.0.0.1:8000/

Needs playwright (a test dependency) and Debian's chromium.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

from playwright.async_api import async_playwright

OUT = Path(__file__).parent / "chat-page.png"
FIRST = "Write a Python function that returns the squares of a list of numbers. Use a code block."
SECOND = "Now explain what a list comprehension is."
ARM_DONE = """() => { window.nextDone = new Promise((r) =>
  document.addEventListener('streamd:done', (e) => r(e.detail), {once: true})); }"""
BUSY = """() => Number(document.getElementById('req-running').textContent) >= 1
  && Number(document.getElementById('engine-tps').textContent) > 0
  && Number(document.querySelector('#messages .assistant:last-child').dataset.deltas) >= 24"""


async def main(url: str) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = await browser.new_page(viewport={"width": 1280, "height": 800}, color_scheme="light",
                                      device_scale_factor=1)
        await page.goto(url)
        await page.evaluate("window.streamdChat.connected")
        await page.click("#settings summary")  # the screenshot shows the settings panel open
        await page.fill("#temperature", "0")
        await page.evaluate(ARM_DONE)
        await page.fill("#prompt", FIRST)
        await page.click("#send")
        await page.evaluate("window.nextDone")
        await page.fill("#prompt", SECOND)
        await page.click("#send")
        await page.wait_for_function(BUSY, timeout=120_000)
        await page.screenshot(path=str(OUT))
        await page.click("#stop")
        await browser.close()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/"))
