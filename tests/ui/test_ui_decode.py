"""Chapter 02's decode explorer in JupyterLab (Chromium): pressing Play advances the step and the
picture changes; the step slider scrubs back and forth, and the readout is kvlab's for each step.

The explorer runs in a small notebook written into the test server's folder, so this test does not
wait for chapter 02 to run top to bottom.
"""

from __future__ import annotations

import json

import pytest
from uihelpers import (
    Explorer,
    cells,
    error_report,
    explorers,
    normalize,
    open_notebook,
    run_all,
    wait_widgets_rendered,
)

pytestmark = pytest.mark.ui

PROMPT, STEPS = "KV 缓存", 8
SOURCE = ("from kvlab.course import ch02_kv_cache as ch02\n"
          f"ch02.decode_explorer({PROMPT!r}, max_new_tokens={STEPS})")


def _notebook(folder) -> str:
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                     "source": SOURCE}],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                      "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = folder / "ui_decode_explorer.ipynb"
    path.write_text(json.dumps(nb))
    return path.name


def _expected(settings: dict[str, str]) -> str:
    from kvlab.course import ch02_kv_cache as ch02

    return ch02.decode_readout(ch02.decode_frames(PROMPT, STEPS), int(settings["step"]))


def _step(explorer: Explorer) -> int:
    return int(explorer.settings()["step"])


def test_play_advances_and_the_slider_scrubs(lab_server, page, screenshot_dir):
    name = _notebook(lab_server.root)
    open_notebook(page, f"{lab_server.url}/lab/tree/{name}?reset")
    run_all(page)
    all_cells = cells(page)
    errors = error_report(all_cells)
    assert not errors, "\n".join(errors)
    assert not wait_widgets_rendered(page, 1)
    (explorer,) = explorers(page, all_cells)
    explorer.wait_ready()
    assert _step(explorer) == 0
    assert explorer.readout() == normalize(_expected({"step": "0"}))
    explorer.root.screenshot(path=screenshot_dir / "decode-0-start.png")

    # Play: the step moves on by itself to the last one (no repeat), and the picture follows.
    settings, readout = explorer.play_to_end(_expected)
    assert int(settings["step"]) == STEPS - 1
    explorer.root.screenshot(path=screenshot_dir / "decode-1-played.png")

    # Scrub with the slider: back to the prefill, then to the last step.
    for key, want in (("Home", 0), ("ArrowRight", 1), ("End", STEPS - 1)):
        before = explorer.snapshot()
        explorer.press("step", key)
        settings, readout = explorer.wait_redrawn(before, _expected,
                                                  settled=lambda s, want=want: int(s["step"]) == want)
        explorer.root.screenshot(path=screenshot_dir / f"decode-2-{key.lower()}.png")
    assert f"step {STEPS - 1} of {STEPS - 1}" in readout
