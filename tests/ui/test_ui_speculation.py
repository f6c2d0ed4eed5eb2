"""Chapter 10's speculation explorer in JupyterLab (Chromium): pressing Play advances the step and the
picture changes; the step slider scrubs back and forth, the drafter dropdown switches the recording,
and the readout is kvlab's for each setting.

The explorer runs in a small notebook written into the test server's folder, so this test does not
wait for chapter 10 to run top to bottom.
"""

from __future__ import annotations

import json

import pytest
from uihelpers import (
    cells,
    error_report,
    explorers,
    normalize,
    open_notebook,
    run_all,
    wait_widgets_rendered,
)

pytestmark = pytest.mark.ui

SOURCE = ("from kvlab.course import ch10_speculative_decoding as ch10\n"
          "ch10.speculation_explorer()")


def _notebook(folder) -> str:
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                     "source": SOURCE}],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                      "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = folder / "ui_speculation_explorer.ipynb"
    path.write_text(json.dumps(nb))
    return path.name


def _expected(settings: dict[str, str]) -> str:
    from kvlab.course import ch10_speculative_decoding as ch10

    drafter = settings.get("drafter", ch10.DRAFTERS[0])
    return ch10.speculation_readout(ch10.speculation_frames(drafter), int(settings["step"]) - 1)


def test_play_advances_the_slider_scrubs_and_the_drafter_switches(lab_server, page, screenshot_dir):
    from kvlab.course import ch10_speculative_decoding as ch10

    last = ch10.EXPLORER_STEPS   # the slider counts steps from 1
    name = _notebook(lab_server.root)
    open_notebook(page, f"{lab_server.url}/lab/tree/{name}?reset")
    run_all(page)
    all_cells = cells(page)
    errors = error_report(all_cells)
    assert not errors, "\n".join(errors)
    assert not wait_widgets_rendered(page, 1)
    (explorer,) = explorers(page, all_cells)
    explorer.wait_ready()
    assert int(explorer.settings()["step"]) == 1
    assert explorer.readout() == normalize(_expected(explorer.settings()))
    explorer.root.screenshot(path=screenshot_dir / "speculation-0-start.png")

    # Play: the step moves on by itself to the last one (no repeat), and the picture follows.
    settings, readout = explorer.play_to_end(_expected)
    assert int(settings["step"]) == last
    explorer.root.screenshot(path=screenshot_dir / "speculation-1-played.png")

    # Scrub with the slider: back to the first step, one on, then to the last.
    for key, want in (("Home", 1), ("ArrowRight", 2), ("End", last)):
        before = explorer.snapshot()
        explorer.press("step", key)
        settings, readout = explorer.wait_redrawn(before, _expected,
                                                  settled=lambda s, want=want: int(s["step"]) == want)
    assert f"step {last} of {last}" in readout

    # The other drafter: another recording, the same step.
    before = explorer.snapshot()
    explorer.select("drafter", 1)
    settings, readout = explorer.wait_redrawn(before, _expected)
    assert normalize(settings["drafter"]) == ch10.DRAFTERS[1]
    explorer.root.screenshot(path=screenshot_dir / "speculation-2-drafter.png")
