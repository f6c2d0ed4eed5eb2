"""Fixtures for the browser tests: a throw-away JupyterLab server and a headless Chromium.

The tests drive Debian's chromium (/usr/bin/chromium) through the Python `playwright` package
(Playwright's own browser download is not used). Without a browser they are skipped with a clear
reason, except in CI (`CI=true`), where a missing browser is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from needs import CHROMIUM, browser_missing, require
from uihelpers import NOTEBOOKS, REPO

SERVER_START_TIMEOUT_S = 90


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.ui)




def require_browser() -> None:
    """Skip (or, in CI, fail) when chromium or playwright is missing."""
    require(browser_missing(), "browser tests")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


# User settings for the test server: render every cell (no windowing, so all outputs are in the
# DOM), and no news / update pop-ups that could cover the page.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}


@dataclass
class LabServer:
    url: str  # e.g. http://127.0.0.1:PORT (no trailing slash)
    root: Path  # the server's root directory: copies of the notebooks
    log: Path

    def log_tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def shut_down_kernels(self) -> None:
        """End every session the server holds (each page that opened a notebook started one), and so
        its kernel: an idle kernel still holds its models, a GB or more, on a crowded machine."""
        with urllib.request.urlopen(f"{self.url}/api/sessions", timeout=10) as r:
            sessions = json.load(r)
        for session in sessions:
            request = urllib.request.Request(f"{self.url}/api/sessions/{session['id']}", method="DELETE")
            urllib.request.urlopen(request, timeout=30).close()


@pytest.fixture(scope="session")
def lab_server() -> Iterator[LabServer]:
    """A token-less `jupyter lab` on a free loopback port, serving copies of the notebooks."""
    require_browser()
    tmp = Path(tempfile.mkdtemp(prefix="kvlab-ui-server-"))
    root, settings, config_dir = tmp / "root", tmp / "settings", tmp / "config"
    shutil.copytree(NOTEBOOKS, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    for name, values in LAB_SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    config_dir.mkdir()
    port = _free_port()
    config = tmp / "jupyter_lab_config.py"
    config.write_text(
        "from jupyterlab.galata import configure_jupyter_server\n"
        "configure_jupyter_server(c)\n"
        "c.ServerApp.ip = '127.0.0.1'\n"
        f"c.ServerApp.port = {port}\n"
        f"c.ServerApp.root_dir = {str(root)!r}\n"
        f"c.LabApp.user_settings_dir = {str(settings)!r}\n"
        "c.JupyterNotebookApp.expose_app_in_browser = True\n"
        "c.ServerApp.open_browser = False\n"
        "c.ServerApp.allow_root = True\n"  # CI runs as root
        "c.LabApp.extension_manager = 'readonly'\n"  # no package-index look-ups
    )
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config_dir), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = tmp / "server.log"
    with log.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", f"--config={config}", "--no-browser"],
            cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    server = LabServer(url=f"http://127.0.0.1:{port}", root=root, log=log)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _answers(f"{server.url}/api/status"):
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with code {proc.returncode}:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter lab did not answer within {SERVER_START_TIMEOUT_S} s:\n"
                            f"{server.log_tail()}")
            time.sleep(0.2)  # polling interval, not a wait for something to happen
        yield server
    finally:
        _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server (it shuts its kernels down), then kill what is left of its group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
    try:  # kernels the server started live in its process group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="session")
def browser():
    """Headless Debian chromium driven by playwright."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, request):
    """A fresh page; afterwards, the kernels of the notebooks the test ran are shut down (no later
    test uses them: each opens and runs its own)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    yield page
    context.close()
    if "lab_server" in request.fixturenames:
        request.getfixturevalue("lab_server").shut_down_kernels()


@pytest.fixture(scope="session")
def screenshot_dir() -> Path:
    """Screenshots before and after each control move (kept after the run; the path is printed)."""
    path = Path(tempfile.mkdtemp(prefix="kvlab-ui-screenshots-"))
    _SCREENSHOTS.append(path)
    print(f"\nUI screenshots: {path}")
    return path


_SCREENSHOTS: list[Path] = []


def pytest_terminal_summary(terminalreporter) -> None:
    for path in _SCREENSHOTS:
        terminalreporter.write_line(f"kvlab UI screenshots (before/after each control move): {path}")
