"""Chapter 09's two explorers in JupyterLab, in Chromium: run the notebook's set-up and explorer
cells, then move a control of each explorer and check that the plot changes and the readout says
what the chapter's drawing function computes for the settings the controls show."""

from __future__ import annotations

import pytest
import uihelpers as ui

pytestmark = pytest.mark.ui

NOTEBOOK = ui.NOTEBOOKS / "09_reuse_and_evict.ipynb"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def sharing_readout(settings: dict) -> str:
    import matplotlib.pyplot as plt

    from kvlab.course.ch09_reuse_and_evict import plot_sharing

    fig, text = plot_sharing(_number(settings["users"]), _number(settings["shared prefix"]),
                             _number(settings["own suffix"]))
    plt.close(fig)
    return text


def budget_readout(settings: dict) -> str:
    import matplotlib.pyplot as plt
    import torch

    from kvlab.course.ch09_reuse_and_evict import plot_budget

    torch.set_num_threads(1)  # as the notebook's kernel (kvlab.env.setup): the same float sums
    fig, text = plot_budget(settings["policy"], _number(settings["budget"]))
    plt.close(fig)
    return text


def test_chapter_09_explorers_answer_their_controls(lab_server, page, screenshot_dir):
    name = ui.explorer_copy(NOTEBOOK, lab_server.root)   # its set-up and explorer cells
    ui.open_notebook(page, f"{lab_server.url}/lab/tree/{name}?reset")
    ui.run_all(page)
    all_cells = ui.cells(page)
    errors = ui.error_report(all_cells) or ui.dom_error_report(page)
    assert not errors, "cells show errors:\n" + "\n\n".join(errors)
    views = sum(WIDGET_MIME in o["mimes"] for c in all_cells for o in c["outputs"])
    assert not ui.wait_widgets_rendered(page, views)
    found = {e.name: e for e in ui.explorers(page, all_cells)}
    assert set(found) == {"prefix_sharing_explorer", "cache_budget_explorer"}

    sharing = found["prefix_sharing_explorer"]
    sharing.wait_ready()
    assert sharing.readout() == ui.normalize(sharing_readout(sharing.settings()))
    before = sharing.snapshot()
    sharing.root.screenshot(path=screenshot_dir / "09-sharing-before.png")
    sharing.press("users", "End")                        # the most users
    settings, _ = sharing.wait_redrawn(before, sharing_readout)
    sharing.root.screenshot(path=screenshot_dir / "09-sharing-after.png")
    assert settings["users"] == "128" and settings["users"] != sharing.settings_of(before)["users"]

    budget = found["cache_budget_explorer"]
    budget.wait_ready()
    assert budget.readout() == ui.normalize(budget_readout(budget.settings()))
    before = budget.snapshot()
    budget.select("policy", 3)                           # heavy hitters
    settings, _ = budget.wait_redrawn(before, budget_readout)
    assert settings["policy"] == "heavy hitters"
    before = budget.snapshot()
    budget.press("budget", "Home")                       # the smallest budget
    settings, _ = budget.wait_redrawn(before, budget_readout)
    budget.root.screenshot(path=screenshot_dir / "09-budget-after.png")
    assert settings["budget"] == "16"
