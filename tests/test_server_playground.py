"""The playground page (server/playground/index.html). Without a browser: its image picker carries the
server's own limits (clefcore.images), it is dependency-free, starts from the example the server serves
(GET /example) and keeps no copy of it, and the body it builds with a picked image (a data URL, as
readAsDataURL writes it) is answered. In headless Chromium: it shows the example, submits it, draws a block of
bars per question and writes a screenshot (to pytest's tmp dir, or $CLEF_SCREENSHOT_DIR, e.g. as a CI
artifact); images are picked, refused over the limits inline, removed and sent. The browser tests need
Chromium and its driver (Debian: `apt-get install chromium chromium-driver`) and `pip install selenium`, and
skip cleanly without any of them."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from clefcore import images
from clefcore.example_request import support_ticket

from server_harness import Server, check_client_rules

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
ACCEPT = ["image/png", "image/jpeg", "image/webp"]


@pytest.fixture(scope="module")
def server():
    with Server().wait_ready() as s:
        yield s


def png(width: int = 48, height: int = 32) -> bytes:
    from PIL import Image

    im = Image.new("RGB", (width, height))
    im.putdata([(5 * x % 256, 7 * y % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _page(server: Server) -> tuple[str, list[tuple[str, dict]]]:
    r = server.get("/")
    assert r.status == 200 and r.headers["content-type"].startswith("text/html"), r
    parser = _Tags()
    parser.feed(r.text)
    return r.text, parser.tags


def test_page_has_the_image_picker_with_the_servers_limits(server):
    html, tags = _page(server)
    pickers = [a for t, a in tags if t == "input" and a.get("type") == "file"]
    assert len(pickers) == 1
    picker = pickers[0]
    assert picker["id"] == "images" and "multiple" in picker
    assert picker["accept"].split(",") == ACCEPT
    assert set(ACCEPT) <= set(images.CONTENT_TYPES)
    assert int(picker["data-max-images"]) == images.MAX_IMAGES
    assert int(picker["data-max-image-bytes"]) == images.MAX_IMAGE_BYTES
    assert int(picker["data-max-total-bytes"]) == images.MAX_TOTAL_BYTES
    # the script reads its limits from those attributes (no second copy to drift), checks them before adding
    # an image, and sends the picked images as data URLs
    for needle in ("picker.dataset.maxImages", "picker.dataset.maxImageBytes", "picker.dataset.maxTotalBytes",
                   "file.size > MAX_IMAGE_BYTES", "readAsDataURL", "body.images = picked.map"):
        assert needle in html, needle
    ids = {a.get("id") for _, a in tags}
    assert {"thumbs", "image-error", "send", "body"} <= ids
    # dependency-free: no external script, stylesheet or font
    external = [a for t, a in tags
                if t in ("script", "link", "img", "iframe") and (a.get("src") or a.get("href"))]
    assert not external
    assert "http://" not in html and "https://" not in html


def _texts(value) -> list[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in [k, *_texts(v)]]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []


def test_page_starts_from_the_example_the_server_serves(server):
    served = server.get("/example")
    assert served.status == 200 and served.headers["content-type"].startswith("application/json"), served
    assert served.json() == support_ticket()
    html, _ = _page(server)
    # the script fetches it (relative to the page, as the decide call: they work under a mount prefix too)
    # before Decide is enabled ...
    assert 'fetch("example")' in html and 'fetch("v1/systemone"' in html
    assert '<button id="send" type="button" disabled>' in html
    # ... and keeps no copy of its own: none of the example's sentences is in the page
    sentences = [t for t in _texts(support_ticket()) if " " in t]
    assert len(sentences) >= 8
    assert [t for t in sentences if t in html] == []


def test_playground_body_with_an_image_is_answered(server):
    """Exactly the body the page sends: the served example's JSON (JSON.stringify, compact) with `images` set to
    the picked files' data URLs."""
    body = server.get("/example").json()
    text_only = server.post("/v1/systemone", json.dumps(body, separators=(",", ":")))
    assert text_only.status == 200, text_only
    body["images"] = ["data:image/png;base64," + base64.b64encode(png()).decode("ascii")]
    with_image = server.post("/v1/systemone", json.dumps(body, separators=(",", ":")))
    assert with_image.status == 200, with_image
    check_client_rules(body, with_image.json())
    assert with_image.json()["usage"]["input_tokens"] > text_only.json()["usage"]["input_tokens"]
    # as many images as the picker allows are answered; one more is the server's 422 too
    body["images"] = body["images"] * images.MAX_IMAGES
    assert server.post("/v1/systemone", json.dumps(body)).status == 200
    body["images"].append(body["images"][0])
    refused = server.post("/v1/systemone", json.dumps(body))
    assert refused.status == 422 and refused.json()["error"]["field"] == "images", refused


# --- in a browser ------------------------------------------------------------------------------------------

@pytest.fixture()
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("no Chromium / chromedriver installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1200,800"):
        options.add_argument(flag)
    b = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield b
    finally:
        b.quit()


def test_playground_shows_bars_in_headless_chromium(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    with Server().wait_ready() as server:
        browser.get(server.base + "/")
        assert "clefcore" in browser.title
        send = browser.find_element(By.ID, "send")
        WebDriverWait(browser, 10).until(lambda _: send.is_enabled())      # the example has arrived
        editor = browser.find_element(By.ID, "body").get_attribute("value")
        assert json.loads(editor) == server.get("/example").json()
        assert browser.find_element(By.ID, "state").get_attribute("value") == support_ticket()["state"]
        send.click()
        WebDriverWait(browser, 30).until(
            ec.presence_of_element_located((By.CSS_SELECTOR, "body[data-answered='1']")))
        questions = browser.find_elements(By.CSS_SELECTOR, "#answers .question")
        assert [q.get_attribute("data-id") for q in questions] == ["urgent", "team", "severity"]
        bars = {q.get_attribute("data-id"): len(q.find_elements(By.CSS_SELECTOR, ".bar"))
                for q in questions}
        assert bars == {"urgent": 2, "team": 3, "severity": 4}
        widths = [b.size["width"] for b in browser.find_elements(By.CSS_SELECTOR, ".bar .fill")]
        assert any(w > 0 for w in widths)
        assert browser.find_element(By.ID, "error").text == ""
        out = Path(os.environ.get("CLEF_SCREENSHOT_DIR") or tmp_path)
        out.mkdir(parents=True, exist_ok=True)
        shot = out / "playground.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        print(f"\nplayground screenshot: {shot}")


def test_playground_picks_checks_removes_and_sends_images(browser, server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    small = [tmp_path / f"shot{i}.png" for i in range(images.MAX_IMAGES + 1)]
    for i, path in enumerate(small):
        path.write_bytes(png(32 + i, 24))
    big = tmp_path / "huge.png"
    big.write_bytes(png(8, 8) + b"\0" * images.MAX_IMAGE_BYTES)   # over the limit by its size alone

    browser.get(server.base + "/")
    thumbs = lambda: browser.find_elements(By.CSS_SELECTOR, "#thumbs .thumb")  # noqa: E731
    error = lambda: browser.find_element(By.ID, "image-error").text  # noqa: E731
    picker = browser.find_element(By.ID, "images")

    picker.send_keys(str(big))
    WebDriverWait(browser, 10).until(lambda _: error())
    assert "huge.png" in error() and "4 MiB" in error(), error()
    assert thumbs() == []

    picker.send_keys("\n".join(map(str, small)))   # one more than allowed
    WebDriverWait(browser, 10).until(lambda _: len(thumbs()) == images.MAX_IMAGES)
    assert small[-1].name in error() and f"at most {images.MAX_IMAGES} images" in error(), error()
    assert [t.find_element(By.TAG_NAME, "img").get_attribute("src")[:22] for t in thumbs()] == \
        ["data:image/png;base64,"] * images.MAX_IMAGES
    assert not picker.is_enabled()
    for _ in range(images.MAX_IMAGES - 1):
        thumbs()[0].find_element(By.CSS_SELECTOR, "button.remove").click()
    assert len(thumbs()) == 1 and picker.is_enabled() and error() == ""

    send = browser.find_element(By.ID, "send")
    WebDriverWait(browser, 10).until(lambda _: send.is_enabled())
    send.click()
    WebDriverWait(browser, 30).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, "body[data-answered='1']")))
    assert browser.find_element(By.ID, "error").text == ""
    assert "with 1 image" in browser.find_element(By.ID, "usage").text
