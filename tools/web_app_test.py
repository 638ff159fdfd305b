"""Drives the web app of `slotstream serve` in a real headless browser (CI runs this):
Debian's chromium and chromium-driver through Selenium (pinned in
tools/requirements-browser.txt).

Usage: python tools/web_app_test.py SLOTSTREAM_BINARY MODEL_DIR [SCREENSHOT.png]

Starts the server with an API key on a copy of the model without an end of sequence (its
replies run to their token limit) and a pool smaller than the model's records, then:
the page loads without the key and takes it from its address (`/#key=...`); the live
view connects (its heatmap shows an empty pool); a message sent greedily streams text in
(the reply is seen growing) equal to the API's own answer to the same request, and the
heatmap changes (records now resident); a long reply stopped with the Stop button ends
as stopped and the server frees its queue; the browser's console has no errors. With a
third argument it saves a screenshot of the page there. Exits non-zero on any failure.
"""

import json
import shutil
import sys
import tempfile
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from client_common import check, model_copy, start, stop

KEY = "ci-web-key"


def browser():
    """Headless chromium through chromedriver, both from the system (no downloads)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        raise SystemExit("chromium and chromedriver are needed (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,900"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def api(base, path, body=None):
    request = urllib.request.Request(
        base + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r)


def set_field(driver, field, value):
    el = driver.find_element(By.ID, field)
    el.clear()
    el.send_keys(str(value))


def send(driver, text):
    prompt = driver.find_element(By.ID, "prompt")
    prompt.send_keys(text)
    prompt.send_keys(Keys.ENTER)


def last_reply(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def main():
    binary, model = sys.argv[1], sys.argv[2]
    screenshot = sys.argv[3] if len(sys.argv) > 3 else None
    tmp = tempfile.mkdtemp()
    server, base = start(binary, model_copy(model, tmp, no_eos=True), "--api-key", KEY)
    driver = browser()
    wait = WebDriverWait(driver, 30, poll_frequency=0.02)
    try:
        driver.get(base + "/#key=" + KEY)
        check("the key left the address", driver.execute_script("return location.hash"), "")
        heatmap = driver.find_element(By.ID, "heatmap")
        wait.until(lambda d: heatmap.get_attribute("data-resident") is not None)
        check("an empty pool before any request", heatmap.get_attribute("data-resident"), "0")
        changes = int(heatmap.get_attribute("data-changes"))
        check("the key prompt stays hidden", driver.find_element(By.ID, "key-needed").is_displayed(), False)

        # A greedy reply, watched as it streams in.
        driver.find_element(By.ID, "settings-toggle").click()
        set_field(driver, "temperature", 0)
        set_field(driver, "max_tokens", 96)
        driver.execute_script("""
            window.__lengths = [];
            new MutationObserver(() => {
              const c = document.querySelector('.msg.assistant:last-of-type .content');
              if (c) window.__lengths.push(c.textContent.length);
            }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
        """)
        send(driver, "Tell me about slots.")
        wait.until(lambda d: last_reply(d).get_attribute("data-done"))
        check("the reply completed", last_reply(driver).get_attribute("data-done"), "true")
        lengths = sorted(set(n for n in driver.execute_script("return window.__lengths") if n > 0))
        if len(lengths) < 2:
            raise SystemExit(f"the reply did not stream in (content lengths seen: {lengths})")
        print(f"ok: the reply streamed in ({len(lengths)} distinct lengths)")
        shown = driver.execute_script("return history_[history_.length - 1].content")
        want = api(base, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Tell me about slots."}],
            "temperature": 0, "top_p": 0.95, "max_tokens": 96,
        })["choices"][0]["message"]["content"]
        check("the page's reply equals the API's", shown, want)
        wait.until(lambda d: int(heatmap.get_attribute("data-resident")) > 0
                   and int(heatmap.get_attribute("data-changes")) > changes)
        print(f"ok: the heatmap changed ({heatmap.get_attribute('data-resident')} records resident)")
        tiles = {t: driver.find_element(By.ID, t).text for t in ["hit-rate", "disk", "tps", "slots"]}
        check("the pool's size", tiles["slots"], "24 slots")
        if not tiles["tps"].endswith("tok/s") or not tiles["hit-rate"].endswith("%"):
            raise SystemExit(f"the tiles: {tiles}")
        print(f"ok: the tiles {tiles}")
        if screenshot:
            driver.save_screenshot(screenshot)
            print(f"ok: screenshot at {screenshot}")

        # A long reply, stopped.
        set_field(driver, "max_tokens", 3500)
        send(driver, "And a long story.")
        wait.until(lambda d: len(last_reply(d).find_element(By.CLASS_NAME, "content").text) > 0)
        driver.find_element(By.ID, "stop").click()
        wait.until(lambda d: last_reply(d).get_attribute("data-done"))
        check("the stopped reply", last_reply(driver).get_attribute("data-done"), "stopped")
        deadline = time.time() + 20
        while api(base, "/stats")["queued_or_running"] != 0:
            if time.time() > deadline:
                raise SystemExit("the server still runs the stopped reply")
            time.sleep(0.05)
        print("ok: the server freed its queue after Stop")

        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        check("console errors", errors, [])
    finally:
        driver.quit()
        stop(server)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
