"""Renders an HTML file in headless chromium: console errors, the DOM after load, a screenshot.

Two chromium runs (``--dump-dom`` and ``--screenshot`` cannot share one) on a copy of the page that
first installs a tiny console hook, because chromium's stderr log prints every console message at the
same INFO level: the hook prefixes ``console.error`` text with ``[console.error]`` so it can be told
from ``console.log``. Uncaught exceptions and unhandled rejections are logged by chromium itself as
``Uncaught ...``. Reuse it for any page: ``render(page, png)``.
"""

from __future__ import annotations

import re
import struct
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--enable-logging=stderr", "--v=0",
)
CONSOLE_HOOK = """<script>(function () {
  var error = console.error.bind(console);
  console.error = function () {
    var args = Array.prototype.slice.call(arguments);
    error.apply(console, ["[console.error]"].concat(args));
  };
  window.addEventListener("error", function (e) {
    if (e.target && e.target !== window) {
      error("[console.error] failed to load " + (e.target.src || e.target.href || e.target.tagName));
    }
  }, true);
})();</script>"""
CONSOLE_LINE = re.compile(r':CONSOLE(?:\(\d+\))?:?\d*\] "(?P<msg>.*)", source: (?P<src>.*)$')
ERROR_MARKERS = ("Uncaught", "[console.error]")


@dataclass(frozen=True, slots=True)
class Rendering:
    console_messages: list[str]   # every console line chromium logged (once, in order)
    console_errors: list[str]     # the ones that are errors (uncaught exceptions, console.error)
    dom: str                      # the DOM after load (``--dump-dom``)
    screenshot: Path


def available() -> bool:
    return CHROMIUM.is_file()


def render(page: Path, screenshot: Path, width: int = 1400, height: int = 3000,
           virtual_time_ms: int = 10_000, timeout_s: float = 120.0) -> Rendering:
    """Loads ``page`` (with the console hook) twice: once for the DOM, once for the screenshot."""
    page, screenshot = Path(page).resolve(), Path(screenshot).resolve()
    hooked = page.with_name(f".{page.stem}.browsercheck.html")
    hooked.write_text(_with_hook(page.read_text(encoding="utf-8")), encoding="utf-8")
    try:
        with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
            common = [*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                      f"--virtual-time-budget={virtual_time_ms}"]
            dom_run = _chromium([*common, "--dump-dom", hooked.as_uri()], timeout_s)
            shot_run = _chromium([*common, f"--screenshot={screenshot}", hooked.as_uri()], timeout_s)
    finally:
        hooked.unlink(missing_ok=True)
    messages = list(dict.fromkeys(console_messages(dom_run.stderr) + console_messages(shot_run.stderr)))
    return Rendering(
        console_messages=messages,
        console_errors=[m for m in messages if any(k in m for k in ERROR_MARKERS)],
        dom=dom_run.stdout, screenshot=screenshot)


def _with_hook(text: str) -> str:
    match = re.search(r"<head[^>]*>", text, flags=re.IGNORECASE)
    at = match.end() if match else 0
    return text[:at] + CONSOLE_HOOK + text[at:]


def _chromium(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([str(CHROMIUM), *args], capture_output=True, text=True, timeout=timeout_s)
    if run.returncode != 0:
        raise RuntimeError(f"chromium exited {run.returncode}: {run.stderr[-2000:]}")
    return run


def console_messages(stderr: str) -> list[str]:
    """The console lines of chromium's stderr log, as ``message (source)``."""
    out = []
    for line in stderr.splitlines():
        m = CONSOLE_LINE.search(line)
        if m:
            out.append(f"{m.group('msg')} ({m.group('src')})")
    return out


def body_attribute(dom: str, name: str) -> str | None:
    """The value of an attribute of <body> in a dumped DOM."""
    body = re.search(r"<body\b[^>]*>", dom)
    if not body:
        return None
    m = re.search(rf'\b{re.escape(name)}="([^"]*)"', body.group(0))
    return m.group(1) if m else None


@dataclass(frozen=True, slots=True)
class PngInfo:
    width: int
    height: int
    distinct_rows: int     # distinct filtered scanlines: 1-2 for a single-colour image
    distinct_bytes: int


def png_info(path: Path) -> PngInfo:
    """Size and a cheap measure of variety of a PNG, decoded with zlib only (no PIL)."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    pos, idat, width, height, depth, ctype = 8, bytearray(), 0, 0, 8, 6
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", chunk[:10])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(bytes(idat))
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[ctype]
    stride = 1 + (width * channels * depth + 7) // 8
    rows = {raw[i:i + stride] for i in range(0, len(raw), stride)}
    return PngInfo(width, height, len(rows), len(set(raw)))
