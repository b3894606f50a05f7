"""The playground page in headless Chromium: it loads, submits the example request, shows one block of
bars per question, and a screenshot is written to pytest's tmp dir (or to $CLEF_SCREENSHOT_DIR when set,
e.g. to keep it as a CI artifact).

Needs Chromium and its driver (Debian: `apt-get install chromium chromium-driver`) and `pip install
selenium`; skipped cleanly when any is missing."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_harness import Server  # noqa: E402

webdriver = pytest.importorskip("selenium.webdriver")

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(CHROMIUM is None or DRIVER is None, reason="no Chromium / chromedriver installed")
def test_playground_shows_bars_in_headless_chromium(tmp_path):
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1200,800"):
        options.add_argument(flag)
    with Server() as server:
        server.wait_ready()
        browser = webdriver.Chrome(service=Service(DRIVER), options=options)
        try:
            browser.get(server.base + "/")
            assert "clefcore" in browser.title
            browser.find_element(By.ID, "send").click()
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
        finally:
            browser.quit()
