"""The console in a real browser: Debian's headless Chromium driven by Selenium with
Debian's chromedriver (installed by .ci/run), against a real `proxy serve` process.
Pages render, navigation works, a purge and a mirror run started from the console take
effect, and anonymous access is refused where configured.

With ``PROXY_UPDATE_SCREENSHOTS=1`` the screenshots of the main pages are also written
to ``docs/`` (the README shows them).
"""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.admin_support import AUTH, admin_config, wait_until
from tests.processes import ProxyProcess
from tests.upstream import FakeUpstream, ProjectFile

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
DOCS = Path(__file__).resolve().parent.parent / "docs"

if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    pytest.fail(
        "the browser tests need Debian's chromium and chromium-driver (.ci/run installs them)",
        pytrace=False,
    )

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402


def browser(profile: Path, authorization: str | None) -> WebDriver:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,1000",
    ):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    if authorization is not None:
        # What a browser sends once the user answered its Basic prompt.
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd(
            "Network.setExtraHTTPHeaders", {"headers": {"Authorization": authorization}}
        )
    return driver


def arrive(driver: WebDriver, title: str) -> None:
    """Wait for the page a click or a form led to (a form's POST and redirect may still
    be on their way when the click returns)."""
    wait_until(f"the page {title!r}", lambda: driver.title.startswith(title))


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture
def fleet(tmp_path: Path, upstream: FakeUpstream) -> Iterator[ProxyProcess]:
    for name in ("alpha", "beta"):
        upstream.add_project(
            name,
            [
                ProjectFile(f"{name}-{v}.tar.gz", f"{name} {v}".encode() * 100)
                for v in ("1.0", "2.0")
            ],
        )
    proxy = ProxyProcess(admin_config(tmp_path, upstream.base_url), tmp_path, "console").start()
    try:
        yield proxy.wait_ready()
    finally:
        proxy.stop()


def screenshot(driver: WebDriver, folder: Path, name: str) -> None:
    """The whole page (not only the window), as a PNG."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 3000), "scale": 1}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    path = folder / f"console-{name}.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    assert path.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("PROXY_UPDATE_SCREENSHOTS") == "1":
        shutil.copy(path, DOCS / path.name)


def test_the_console_in_a_real_browser(
    fleet: ProxyProcess, upstream: FakeUpstream, tmp_path: Path
) -> None:
    url = fleet.url
    for name in ("alpha", "beta"):
        httpx.get(f"{url}/pypi/simple/{name}/").raise_for_status()
        for version in ("1.0", "2.0"):
            httpx.get(f"{url}/pypi/files/{name}/{name}-{version}.tar.gz").raise_for_status()
    httpx.get(f"{url}/pypi/files/alpha/alpha-1.0.tar.gz").raise_for_status()  # a hit
    shots = tmp_path / "shots"
    shots.mkdir()
    driver = browser(tmp_path / "profile", basic(*AUTH))
    try:
        driver.get(f"{url}/ui/")
        assert driver.title.startswith("Dashboard")
        assert "Healthy" in driver.find_element(By.ID, "health").text
        rows = driver.find_elements(By.CSS_SELECTOR, "#repositories tr")
        pypi = next(r.text for r in rows if r.text.startswith("pypi "))
        assert " 6 " in f" {pypi} " and "%" in pypi  # entries, and a hit ratio
        assert "alive" in driver.find_element(By.ID, "replicas").text
        screenshot(driver, shots, "dashboard")

        # Browse by package, down to one entry.
        driver.find_element(By.LINK_TEXT, "Browse").click()
        arrive(driver, "Browse")
        packages = driver.find_element(By.ID, "packages").text
        assert "alpha" in packages and "beta" in packages
        screenshot(driver, shots, "browse")
        driver.find_element(By.LINK_TEXT, "alpha").click()
        arrive(driver, "alpha")
        driver.find_element(By.PARTIAL_LINK_TEXT, "alpha-1.0.tar.gz").click()
        arrive(driver, "files/alpha/alpha-1.0.tar.gz")
        entry = driver.find_element(By.ID, "entry").text
        assert "sha256" in entry and "/packages/alpha-1.0.tar.gz" in entry
        assert "no policy applies" in entry
        screenshot(driver, shots, "entry")

        # Purge a package from the console: the next request goes upstream.
        driver.find_element(By.LINK_TEXT, "Browse").click()
        arrive(driver, "Browse")
        before = upstream.count("/packages/alpha-1.0.tar.gz")
        purge = next(
            form for form in driver.find_elements(By.CSS_SELECTOR, "form.purge-package")
            if form.find_element(By.NAME, "package").get_attribute("value") == "alpha"
        )  # fmt: skip
        purge.find_element(By.TAG_NAME, "button").click()
        wait_until("the purge's notice", lambda: driver.find_elements(By.CLASS_NAME, "notice"))
        assert "purged alpha: 3 entries" in driver.find_element(By.CLASS_NAME, "notice").text
        assert "alpha" not in driver.find_element(By.ID, "packages").text
        httpx.get(f"{url}/pypi/files/alpha/alpha-1.0.tar.gz").raise_for_status()
        assert upstream.count("/packages/alpha-1.0.tar.gz") == before + 1

        # Start a mirror run from the console and watch it finish.
        driver.find_element(By.LINK_TEXT, "Jobs & mirrors").click()
        arrive(driver, "Jobs & mirrors")
        assert "reclaim" in driver.find_element(By.ID, "jobs").text
        driver.find_element(By.ID, "purls").send_keys("pkg:pypi/beta@1.0\npkg:pypi/alpha@2.0")
        driver.find_element(By.CSS_SELECTOR, "#mirror-form button").click()
        arrive(driver, "Mirror run")

        def finished() -> bool:
            driver.refresh()
            return driver.find_element(By.ID, "run-state").text == "ok"

        wait_until("the run to finish", finished)
        counts = driver.find_element(By.ID, "run-counts").text
        assert "1 fetched" in counts and "1 already cached" in counts  # alpha-2.0 was purged
        screenshot(driver, shots, "mirror-run")
        driver.find_element(By.LINK_TEXT, "Jobs & mirrors").click()
        arrive(driver, "Jobs & mirrors")
        screenshot(driver, shots, "jobs")

        driver.find_element(By.LINK_TEXT, "In flight").click()
        arrive(driver, "In flight")
        assert "Nothing is downloading" in driver.page_source
        driver.find_element(By.LINK_TEXT, "Install guide").click()
        arrive(driver, "Install guide")
        guide = driver.find_element(By.TAG_NAME, "main").text
        assert f"{url}/pypi/simple/" in guide and "default = true" in guide
        assert "allowInsecureProtocol = true" in guide and f"{url}/maven/" in guide
        screenshot(driver, shots, "install")
    finally:
        driver.quit()

    # Anonymous: refused. The browser stops at its Basic prompt (headless: an empty
    # page); nothing of the console is shown.
    anonymous = browser(tmp_path / "profile-anonymous", None)
    try:
        for path in ("/ui/", "/ui/browse?repository=pypi", "/ui/jobs"):
            anonymous.get(url + path)
            assert anonymous.find_elements(By.TAG_NAME, "table") == []
            assert "beta" not in anonymous.page_source and "Dashboard" not in anonymous.page_source
    finally:
        anonymous.quit()
    refused = httpx.get(f"{url}/ui/")
    assert refused.status_code == 401 and "log in as an admin user" in refused.text


def test_a_console_without_users_is_refused_in_the_browser(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    proxy = ProxyProcess(admin_config(tmp_path, upstream.base_url, admin=""), tmp_path, "closed")
    proxy.start().wait_ready()
    driver = browser(tmp_path / "profile", basic(*AUTH))
    try:
        driver.get(f"{proxy.url}/ui/")
        assert driver.title.startswith("403")
        assert "admin.users" in driver.find_element(By.ID, "error").text
    finally:
        driver.quit()
        proxy.stop()
