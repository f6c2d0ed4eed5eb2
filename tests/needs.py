"""For tests that need something outside Python (a browser, a C++ compiler): skip with the reason
when it is missing, except in CI (`CI=true`), where .ci/run installs it and its absence is a failure.
Also loads the repository's tools/*.py scripts, which are not a package, for their tests."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("KVLAB_CHROMIUM", "/usr/bin/chromium")


def require(missing: str | None, what: str) -> None:
    """Return when `missing` is None; otherwise skip the test, or fail it in CI, saying why."""
    if missing is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{what} cannot run, and in CI (CI=true) that is a failure: {missing}", pytrace=False)
    pytest.skip(f"{what} skipped: {missing}")


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python package playwright not installed — pip install -e '.[ui]'"
    if not Path(CHROMIUM).is_file():
        return f"{CHROMIUM} not found — apt-get install chromium"
    return None


def load_tool(name: str):
    """tools/<name>.py loaded as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"kvlab_tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
