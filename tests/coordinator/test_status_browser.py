"""The status page in a real browser: Debian's headless Chromium driven by Selenium (chromium-driver),
against a real coordinator with a run in progress.

Shown: a wrong token is refused at sign-in; the page lists the run and the provider; the job's progress
advances without a reload (a marker set on `window` survives, and the page's own refresh counter moves);
when the job finishes, the evaluation table and the per-position plot appear. A screenshot is saved
(its path is printed; under `$DFLASH_TEST_ARTIFACTS` too when that is set).

Chromium comes from Debian: `scripts/ensure-chromium.sh` installs `chromium` and `chromium-driver` with
apt-get when they are missing and this runs as root; otherwise the test is skipped, saying why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from coordinator_helpers import REPO, Provider, run_spec
from test_publish import BETTER, report, spec_json

from dflash_worker.coordinator.artifacts.publish import PLOT_NAME, REPORT_NAME
from dflash_worker.proto.dflash.v1 import provider_pb2


@pytest.fixture(scope="module")
def chromium() -> tuple[str, str]:
    p = subprocess.run(["bash", str(REPO / "scripts" / "ensure-chromium.sh")], capture_output=True, text=True, timeout=900)
    if p.returncode == 3:
        pytest.skip(p.stderr.strip().splitlines()[-1])
    assert p.returncode == 0, p.stderr[-3000:]
    return shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def browser(chromium, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = chromium
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1600", f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(arg)
    b = webdriver.Chrome(service=Service(executable_path=driver, log_output=str(tmp_path / "chromedriver.log")), options=opts)
    b.set_page_load_timeout(30)
    yield b
    b.quit()


# The page replaces its DOM on every refresh, so an element found by Selenium can be stale by the time
# its text is read. Reads after sign-in go through one synchronous script each: the page's own refresh
# cannot run in the middle of it, so what it returns is one consistent view of the page.
_READ = """
const nodes = Array.from(document.querySelectorAll(arguments[0]));
return nodes.map(n => arguments[1] ? n.getAttribute(arguments[1]) : n.innerText.trim());
"""


def read(browser, css: str, attr: str | None = None) -> list[str]:
    return browser.execute_script(_READ, css, attr)


def one(browser, css: str, attr: str | None = None) -> str | None:
    found = read(browser, css, attr)
    return found[0] if found else None


def test_the_page_updates_live_and_shows_the_evaluation(start_coordinator, browser, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    coord = start_coordinator("--http-listen", "127.0.0.1:0", "--page-refresh", "0.5", warm=True)
    base = coord.info["http_address"]
    viewer = Path(coord.info["viewer_token_file"]).read_text().strip()
    with coord.admin() as admin:
        p = Provider(coord.address, admin.create_provider("gpu-box-1"))
        run = admin.create_run(run_spec("browser-run", spec_json=spec_json()))
    p.register(name="rig-7")
    lease = p.acquire().lease
    hb = p.heartbeats()
    hb.send(lease.lease_id, phase=provider_pb2.PHASE_TRAIN, step=1, metrics={"loss": 2.5, "tokens_per_s": 900.0})
    wait = WebDriverWait(browser, 20, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException])

    # A wrong token is refused: the form says so and nothing of the status is shown.
    browser.get(base + "/")
    assert browser.current_url.endswith("/login")
    browser.find_element(By.ID, "token").send_keys("not-the-token-" * 3)
    browser.find_element(By.ID, "sign-in").click()
    assert "token refused" in wait.until(lambda b: b.find_element(By.ID, "login-error")).text
    assert run.run_id not in browser.page_source

    # The viewer token signs in; the run, its job's progress and the provider are listed.
    browser.find_element(By.ID, "token").send_keys(viewer)
    browser.find_element(By.ID, "sign-in").click()
    wait.until(lambda b: read(b, f'section.run[data-run-id="{run.run_id}"]'))
    job_row = f'tr.job[data-job-id="{lease.job_id}"]'
    assert one(browser, f"{job_row} td.step") == "1/10"
    assert one(browser, f"{job_row} td.phase") == "train"
    provider_row = one(browser, "#providers tr.provider")
    assert "gpu-box-1" in provider_row and "rig-7" in provider_row and lease.job_id in provider_row
    browser.execute_script("window.__not_reloaded = 42;")

    # Progress advances without a reload.
    refreshes = int(one(browser, "body", "data-refreshes"))
    hb.send(lease.lease_id, phase=provider_pb2.PHASE_TRAIN, step=6, metrics={"loss": 1.25, "tokens_per_s": 1500.0})
    wait.until(lambda b: one(b, f"{job_row} td.step") == "6/10")
    assert one(browser, f"{job_row} td.loss") == "1.2500"
    assert one(browser, f"{job_row} td.tps") == "1500.0"
    assert browser.execute_script("return window.__not_reloaded") == 42
    assert int(one(browser, "body", "data-refreshes")) > refreshes

    # The job finishes with an export and its evaluation: table, counts and plot appear, still no reload.
    p.upload(lease.lease_id, "run/export/model.safetensors", b"weights" * 100, kind="export")
    p.upload(lease.lease_id, REPORT_NAME, report(BETTER), kind="report")
    p.upload(lease.lease_id, PLOT_NAME, b"\x89PNG not really", kind="report")
    hb.close()
    p.finish(lease.lease_id)
    wait.until(lambda b: read(b, f'section.run[data-run-id="{run.run_id}"][data-state="finished"]'))
    table = wait.until(lambda b: one(b, "table.evaluation"))
    assert "acceptance length (pooled)" in table
    counts = one(browser, "table.counts")
    assert "improved" in counts and "3" in counts
    plot = browser.execute_script(
        "const s = document.querySelector('svg.plot');"
        "return s ? [s.querySelectorAll('polyline').length, s.getBoundingClientRect().width] : null;"
    )
    assert plot is not None and plot[0] == 2 and plot[1] > 100, plot
    assert one(browser, ".publication", "data-published") == "true"
    links = browser.execute_script("return Array.from(document.querySelectorAll('a.download')).map(a => a.href);")
    assert any(h.endswith("/run/export/model.safetensors") for h in links), links
    assert browser.execute_script("return window.__not_reloaded") == 42

    shot = tmp_path / "status-page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get("DFLASH_TEST_ARTIFACTS"):
        dest = Path(os.environ["DFLASH_TEST_ARTIFACTS"])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, dest / shot.name)
    print(f"status page screenshot: {shot}")
    p.close()
