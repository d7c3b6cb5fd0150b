"""Runs inside the client namespace of tests/web/test_turns_browser.py: headless
Chromium (selenium) opens turns_page.html and runs one ``turnsCheck``; prints
its result as JSON on the last line of stdout.

Usage: turns_driver.py PROFILE_DIR URL USERNAME CREDENTIAL COUNT [CHROMIUM_FLAG...]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service as ChromeService

PAGE = Path(__file__).with_name("turns_page.html")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def main() -> None:
    profile, url, username, credential, count, *extra = sys.argv[1:]
    options = Options()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in (*FLAGS, *extra):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    service = ChromeService(shutil.which("chromedriver") or "chromedriver")
    driver = webdriver.Chrome(service=service, options=options)
    try:
        driver.set_script_timeout(120)  # page: 20 s to open + 60 s of messages
        driver.get(PAGE.as_uri())
        result = driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "turnsCheck(arguments[0], arguments[1], arguments[2], arguments[3], 20000)"
            ".then(done, (e) => done({exception: String(e)}));",
            url,
            username,
            credential,
            int(count),
        )
    finally:
        driver.quit()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
