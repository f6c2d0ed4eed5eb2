"""The course's widgets, used the way a learner uses them: in JupyterLab (and Notebook 7), in Chromium.

For every notebook that calls an `…_explorer(` function: run its set-up and explorer cells in
JupyterLab (`uihelpers.explorer_copy`; nbval runs every cell), check that no cell shows an error and
every widget renders, then move each control of each explorer
(sliders by keyboard and by mouse drag, dropdowns by selection, number boxes by typing) and check
that the plot changed and the readout now says what kvlab's drawing function computes for the
settings the controls show. Screenshots before and after each move go to a temporary folder
(printed at the end of the run).
"""

from __future__ import annotations

import contextlib
import html
import io
import re
import shutil
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import uihelpers as ui
from uihelpers import NOTEBOOKS, Explorer, normalize

pytestmark = pytest.mark.ui

NOTEBOOK_PATHS = ui.explorer_notebooks(NOTEBOOKS) if NOTEBOOKS.is_dir() else []
NOTEBOOK_PARAMS = [pytest.param(p, id=p.stem) for p in NOTEBOOK_PATHS] or [pytest.param(
    None, id="none", marks=pytest.mark.skip(reason=f"no notebook in {NOTEBOOKS} calls an …_explorer( yet"))]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


# --- what each readout should say: kvlab's drawing function, called here --------------------------

def _draw_text(result) -> str:
    """The readout text of a drawing function's (Figure, text) result; the figure is closed."""
    import matplotlib.pyplot as plt

    fig, text = result
    plt.close(fig)
    return text


def _memory(s: dict) -> str:
    from kvlab.course.ch03_cache_memory import plot_memory

    custom = s["model"] == "custom"
    shape = (s["layers"], s["KV heads"], s["head dim"]) if custom else (None, None, None)
    return _draw_text(plot_memory(s["model"], s["seq len"], s["batch"], s["cache dtype"], s["GPU"], *shape))


def _gqa(s: dict) -> str:
    from kvlab.course.ch04_mha_gqa_mqa import plot_gqa

    return _draw_text(plot_gqa(s["model"], s["KV heads"], s["seq len"], s["query heads"], s["layers"],
                               s["head dim"]))


def _quant(s: dict) -> str:
    from kvlab.course.ch05_int8_kv_cache import plot_quant

    return _draw_text(plot_quant(s["cache dtype"], s["scales"], s["seq len"], s["model"]))


# explorer name -> readout for the typed settings {control description: value}
READOUTS = {"memory_explorer": _memory, "gqa_explorer": _gqa, "quant_explorer": _quant}


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def html_text(markup: str) -> str:
    parser = _Text()
    parser.feed(markup)
    return html.unescape("".join(parser.parts))


def explorer_function(name: str):
    """The explorer function `name` from the chapter module that defines it (kvlab.course.chNN_…)."""
    import importlib
    import pkgutil

    import kvlab.course

    for info in pkgutil.iter_modules(kvlab.course.__path__):
        if re.fullmatch(r"ch\d\d_\w+", info.name):
            module = importlib.import_module(f"kvlab.course.{info.name}")
            if callable(getattr(module, name, None)):
                return getattr(module, name)
    raise LookupError(f"no kvlab.course chapter module defines {name}()")


class Twin:
    """The same explorer built in this process: it types the UI's settings (labels -> values) and,
    for an explorer READOUTS does not know yet, computes the readout through its own controls."""

    def __init__(self, name: str) -> None:
        import ipywidgets as w

        self.name = name
        with contextlib.redirect_stdout(io.StringIO()):  # its first draw, outside a notebook
            self.root = explorer_function(name)()
        # every control with a description, by description (the readout HTML has none)
        self.controls = {x.description: x for x in _walk(self.root)
                         if isinstance(x, w.ValueWidget) and getattr(x, "description", "")}

    def typed(self, shown: dict[str, str]) -> dict:
        """The UI's settings (text as shown) as the values the drawing function takes."""
        return {d: self._value(d, text) for d, text in shown.items()}

    def _value(self, description: str, text: str):
        control = self.controls.get(description)
        labels = getattr(control, "_options_labels", None)
        if labels:
            for label, value in zip(labels, control._options_values, strict=True):
                if normalize(label) == text:
                    return value
        current = getattr(control, "value", None)
        plain = text.replace(",", "")
        if isinstance(current, bool):
            return text.lower() == "true"
        if re.fullmatch(r"-?\d+", plain) and not isinstance(current, float):
            return int(plain)
        if re.fullmatch(r"-?\d+(\.\d*)?(e[-+]?\d+)?", plain):
            return float(plain)
        return text

    def readout(self, typed: dict) -> str:
        """Fallback: set this twin's controls to the settings and read its readout."""
        import ipywidgets as w

        with contextlib.redirect_stdout(io.StringIO()):
            for _ in range(2):  # a second pass undoes what observers changed during the first
                for d, v in typed.items():
                    if d in self.controls:
                        self.controls[d].value = v
        readouts = [x for x in _walk(self.root)
                    if isinstance(x, w.HTML) and "kvlab-readout" in x._dom_classes]
        return html_text(readouts[0].value)


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


def expected_readout(twin: Twin, shown: dict[str, str]) -> str:
    typed = twin.typed(shown)
    if twin.name in READOUTS:
        return READOUTS[twin.name](typed)
    return twin.readout(typed)


# --- moving the controls -------------------------------------------------------------------------

def _moves(control: dict):
    """The moves to make on one control: (label, action) with action(explorer, fresh control)."""
    if control["kind"] == "slider":
        yield "key", lambda e, c: e.press(c["description"], "ArrowLeft" if c["at_max"] else "ArrowRight")
        yield "end", lambda e, c: e.press(c["description"], "Home" if c["at_max"] else "End")
        yield "drag", lambda e, c: e.drag(c["description"], 0.3 if c["fraction"] > 0.5 else 0.75)
    elif control["kind"] == "dropdown":
        def select(e: Explorer, c: dict) -> None:
            # "custom" where there is one (it reveals more controls), else the next option
            options = [normalize(o) for o in c["options"]]
            custom = options.index("custom") if "custom" in options else c["index"]
            e.select(c["description"], custom if custom != c["index"] else (c["index"] + 1) % len(options))
        yield "select", select
    else:
        def type_number(e: Explorer, c: dict) -> None:
            value = float(c["value"])
            new = value / 2 if value >= 4 else value + 1
            e.type_number(c["description"], int(new) if new == int(new) else new)
        yield "type", type_number


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "control"


def exercise(explorer: Explorer, twin: Twin, shots: Path, prefix: str) -> list[str]:
    """Move every control of one explorer; check plot and readout after each move.

    Controls are taken in page order; one that a move reveals (e.g. a custom shape's inputs) is
    exercised too. Returns what was moved, for the test log.
    """
    explorer.wait_ready()
    start = explorer.settings()
    first = normalize(expected_readout(twin, start))
    assert explorer.readout() == first, (
        f"{explorer.name}: initial readout differs from kvlab's\n shown:    {explorer.readout()!r}\n"
        f" expected: {first!r}\n settings: {start}")
    done: set[str] = set()
    log, step, last_shot = [], 0, ""
    while True:
        todo = [c for c in explorer.controls() if c["visible"] and c["description"] not in done]
        if not todo:
            break
        control = todo[0]
        name = control["description"]
        assert name, f"{explorer.name}: a control without a description: {control}"
        done.add(name)
        for label, action in _moves(control):
            step += 1
            snap = explorer.snapshot()
            fresh = next(c for c in snap["controls"] if c["description"] == name)
            before = Explorer.settings_of(snap)
            base = shots / f"{prefix}-{step:02d}-{_slug(name)}-{label}"
            if last_shot:  # the page has not changed since the previous move's "after"
                shutil.copyfile(last_shot, f"{base}-before.png")
            else:
                explorer.root.screenshot(path=f"{base}-before.png")
            action(explorer, fresh)
            settings, readout = explorer.wait_redrawn(snap, lambda s: expected_readout(twin, s))
            last_shot = f"{base}-after.png"
            explorer.root.screenshot(path=last_shot)
            assert settings[name] != before[name], (
                f"{explorer.name}: {label} on {name!r} did not change its value ({before[name]!r})")
            log.append(f"{name} {label}: {before[name]} -> {settings[name]}")
    assert done, f"{explorer.name}: no controls found"
    return log


def run_and_check(page, url: str) -> list[dict]:
    """Open a notebook, run all cells, and check there is no error and every widget renders."""
    ui.open_notebook(page, url)
    ui.run_all(page)
    all_cells = ui.cells(page)
    errors = ui.error_report(all_cells) or ui.dom_error_report(page)
    if errors:
        pytest.fail("cells show errors:\n" + "\n\n".join(errors), pytrace=False)
    views = sum(WIDGET_MIME in o["mimes"] for c in all_cells for o in c["outputs"])
    assert views, "the notebook calls an explorer but shows no widget"
    bad = ui.wait_widgets_rendered(page, views)
    if bad:
        pytest.fail("widgets not displayed:\n" + "\n".join(bad), pytrace=False)
    return all_cells


@pytest.mark.parametrize("notebook", NOTEBOOK_PARAMS)
def test_explorers_in_jupyterlab(lab_server, page, screenshot_dir, notebook):
    # ?reset: a fresh workspace, so tabs of earlier tests are not reopened
    start = time.monotonic()
    name = ui.explorer_copy(notebook, lab_server.root)
    all_cells = run_and_check(page, f"{lab_server.url}/lab/tree/{name}?reset")
    print(f"{notebook.name}: opened and ran in {time.monotonic() - start:.0f} s")
    page.screenshot(path=screenshot_dir / f"{notebook.stem}-lab.png", full_page=True)
    found = ui.explorers(page, all_cells)
    assert found, f"{notebook.name}: no explorer output found"
    for i, explorer in enumerate(found):
        start = time.monotonic()
        log = exercise(explorer, Twin(explorer.name), screenshot_dir, f"{notebook.stem}-{i}-{explorer.name}")
        print(f"{notebook.name} {explorer.name}: {len(log)} moves in {time.monotonic() - start:.0f} s",
              *log, sep="\n  ")


def test_explorer_in_notebook7(lab_server, page, screenshot_dir):
    """One notebook in Notebook 7 (/notebooks/…): its explorer renders and answers a control."""
    if not NOTEBOOK_PATHS:
        pytest.skip(f"no notebook in {NOTEBOOKS} calls an …_explorer( yet")
    notebook = next((p for p in NOTEBOOK_PATHS if p.name.startswith("03_")), NOTEBOOK_PATHS[0])
    name = ui.explorer_copy(notebook, lab_server.root)
    all_cells = run_and_check(page, f"{lab_server.url}/notebooks/{name}")
    explorer = ui.explorers(page, all_cells)[0]
    explorer.wait_ready()
    twin = Twin(explorer.name)
    shown = explorer.settings()
    assert explorer.readout() == normalize(expected_readout(twin, shown))
    dropdown = next(c for c in explorer.controls() if c["visible"] and c["kind"] == "dropdown")
    snap = explorer.snapshot()
    explorer.root.screenshot(path=screenshot_dir / f"{notebook.stem}-notebook7-before.png")
    explorer.select(dropdown["description"], len(dropdown["options"]) - 1 if dropdown["index"] == 0 else 0)
    explorer.wait_redrawn(snap, lambda s: expected_readout(twin, s))
    explorer.root.screenshot(path=screenshot_dir / f"{notebook.stem}-notebook7-after.png")
