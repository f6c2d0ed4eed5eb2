"""For tests that need something outside Python (a browser, a C++ compiler): skip with the reason
when it is missing, except in CI (`CI=true`), where .ci/run installs it and its absence is a failure."""

from __future__ import annotations

import os

import pytest


def require(missing: str | None, what: str) -> None:
    """Return when `missing` is None; otherwise skip the test, or fail it in CI, saying why."""
    if missing is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{what} cannot run, and in CI (CI=true) that is a failure: {missing}", pytrace=False)
    pytest.skip(f"{what} skipped: {missing}")
