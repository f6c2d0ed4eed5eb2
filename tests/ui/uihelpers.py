"""Helpers the browser tests share: open a notebook, run it, find and move an explorer's controls.

Everything waits on conditions (kernel idle, DOM state), never on fixed sleeps. The JupyterLab
application object is `window.jupyterapp` (exposed by galata's server configuration), in JupyterLab
and in Notebook 7 alike.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # playwright may be missing: conftest then skips (or fails in CI) with a reason
    from playwright.sync_api import Locator, Page

REPO = Path(__file__).resolve().parents[2]
# The notebooks under test; KVLAB_UI_NOTEBOOKS points elsewhere (for developing these tests).
NOTEBOOKS = Path(os.environ.get("KVLAB_UI_NOTEBOOKS", REPO / "notebooks"))

EXPLORER_CALL = re.compile(r"\b(\w+_explorer)\s*\(")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
OPEN_TIMEOUT_MS = 120_000  # page load + kernel start on a busy 2-core machine
RUN_TIMEOUT_MS = 420_000  # one notebook run top to bottom (a busy machine runs them slowly)
MOVE_TIMEOUT_S = 120.0  # one redraw after a control moved (05 measures errors: slow when busy)


def explorer_notebooks(folder: Path) -> list[Path]:
    """Notebooks with a code cell that calls an `…_explorer(` function, sorted by name."""
    found = []
    for path in sorted(folder.glob("*.ipynb")):
        try:
            nb = json.loads(path.read_text())
        except (OSError, ValueError):  # a broken notebook: nbval's run of it reports that
            continue
        for cell in nb.get("cells", []):
            source = "".join(cell.get("source", ""))
            if cell.get("cell_type") == "code" and EXPLORER_CALL.search(source):
                found.append(path)
                break
    return found


SETUP_CALL = "kvlab.env.setup("


def explorer_copy(notebook: Path, folder: Path) -> str:
    """Write into `folder` the part of `notebook` a learner runs to use its explorers, and return
    the copy's file name: the set-up cells (up to the one that calls kvlab.env.setup) and each
    explorer cell with the markdown cell just above it. nbval runs every cell of every notebook (and
    the slides test runs a chapter top to bottom in JupyterLab); running each whole chapter again
    here would double the test time and add nothing the browser shows about the widgets."""
    nb = json.loads(notebook.read_text())
    cells = nb["cells"]
    setup_end = next((i for i, c in enumerate(cells)
                      if c["cell_type"] == "code" and SETUP_CALL in "".join(c["source"])), None)
    if setup_end is None:
        raise AssertionError(f"{notebook.name}: no set-up cell (one that calls {SETUP_CALL}…)")
    keep = [c for c in cells[:setup_end + 1] if c["cell_type"] == "code"]
    for i, cell in enumerate(cells[setup_end + 1:], start=setup_end + 1):
        if cell["cell_type"] == "code" and EXPLORER_CALL.search("".join(cell["source"])):
            if cells[i - 1]["cell_type"] == "markdown":
                keep.append(cells[i - 1])
            keep.append(cell)
    for cell in keep:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    name = f"{notebook.stem}-explorers.ipynb"
    (folder / name).write_text(json.dumps({**nb, "cells": keep}))
    return name


def normalize(text: str | None) -> str:
    """Whitespace-insensitive text (the browser turns spaces into NBSPs in places)."""
    return " ".join((text or "").replace("\u00a0", " ").split())


# --- the notebook as a whole ---------------------------------------------------------------------

_PANEL = "window.jupyterapp && window.jupyterapp.shell && window.jupyterapp.shell.currentWidget"

_KERNEL_READY = f"""(path) => {{
  const panel = {_PANEL};
  if (!panel || !panel.context || panel.context.path !== path || !panel.context.isReady) return false;
  const kernel = panel.sessionContext && panel.sessionContext.session
                 && panel.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle';
}}"""


def open_notebook(page: Page, url: str) -> None:
    """Open a notebook page and wait until its kernel is started and idle."""
    path = url.split("?")[0]
    path = path.split("/tree/", 1)[-1] if "/tree/" in path else path.split("/notebooks/", 1)[-1]
    page.goto(url)
    page.wait_for_function(_KERNEL_READY, arg=path, timeout=OPEN_TIMEOUT_MS, polling=250)


def run_all(page: Page) -> None:
    """Clear all outputs, run all cells, and wait until the run finished and the kernel is idle.

    The run-all promise resolves when every cell ran or one failed (which stops the run).
    """
    page.evaluate("""async () => {
      const app = window.jupyterapp;
      await app.commands.execute('notebook:clear-all-cell-outputs');
      window.__kvlabRun = 'running';
      app.commands.execute('notebook:run-all-cells').then(
        () => { window.__kvlabRun = 'done'; },
        (err) => { window.__kvlabRun = 'failed: ' + err; });
    }""")
    try:
        page.wait_for_function(f"""() => {{
          const panel = {_PANEL};
          const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
          return window.__kvlabRun !== 'running' && kernel && kernel.status === 'idle'
            && !panel.content.widgets.some(c => c.model.type === 'code'
                                           && (c.promptNode && c.promptNode.textContent || '').includes('*'));
        }}""", timeout=RUN_TIMEOUT_MS, polling=500)
    except Exception as err:  # say where it got stuck
        busy = page.evaluate(f"""() => {{
          const panel = {_PANEL};
          const i = panel.content.widgets.findIndex(c => c.model.type === 'code'
            && (c.promptNode && c.promptNode.textContent || '').includes('*'));
          return i < 0 ? 'no cell is running' : `cell ${{i}} is still running: `
            + panel.content.widgets[i].model.sharedModel.getSource().slice(0, 300);
        }}""")
        raise AssertionError(f"run all cells did not finish within {RUN_TIMEOUT_MS // 1000} s; "
                             f"{busy}") from err


def cells(page: Page) -> list[dict]:
    """Every cell: index, type, source, execution count and a summary of its outputs.

    Also tags each cell's DOM node with data-kvlab-cell=<index>, so tests can locate it.
    """
    return page.evaluate(f"""() => {{
      const panel = {_PANEL};
      return panel.content.widgets.map((cell, index) => {{
        cell.node.setAttribute('data-kvlab-cell', String(index));
        const m = cell.model;
        // Widget views carry no data-mime-type on the page: tag their output nodes.
        if (m.type === 'code' && cell.outputArea) {{
          cell.outputArea.widgets.forEach((child, k) => {{
            const node = child.node.querySelector('.jp-OutputArea-output');
            const output = k < m.outputs.length ? m.outputs.get(k).toJSON() : {{}};
            if (node && output.data && output.data['{WIDGET_MIME}']) {{
              node.setAttribute('data-kvlab-widget', '1');
            }}
          }});
        }}
        const outputs = m.type === 'code' ? m.outputs.toJSON().map(o => ({{
          output_type: o.output_type, name: o.name || null, ename: o.ename || null,
          evalue: o.evalue || null, traceback: (o.traceback || []).join('\\n'),
          text: o.output_type === 'stream' ? String(o.text).slice(0, 2000) : null,
          mimes: Object.keys(o.data || {{}})}})) : [];
        return {{index, type: m.type, source: m.sharedModel.getSource(),
                 count: m.type === 'code' ? m.executionCount : null, outputs}};
      }});
    }}""")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def error_report(all_cells: list[dict]) -> list[str]:
    """Errors the run left: error outputs, tracebacks on stderr, code cells that never ran."""
    problems = []
    stopped = False
    for cell in all_cells:
        if cell["type"] != "code":
            continue
        for out in cell["outputs"]:
            if out["output_type"] == "error":
                tb = _ANSI.sub("", out["traceback"])[-1500:]
                problems.append(f"cell {cell['index']}: {out['ename']}: {out['evalue']}\n{tb}")
                stopped = True
            elif out["output_type"] == "stream" and out["name"] == "stderr" and "Traceback" in (
                    out["text"] or ""):
                problems.append(f"cell {cell['index']}: traceback on stderr:\n{out['text'][-1500:]}")
        if cell["source"].strip() and cell["count"] is None and not stopped:
            problems.append(f"cell {cell['index']} did not run:\n{cell['source'][:200]}")
    return problems


def dom_error_report(page: Page) -> list[str]:
    """Error outputs as the page shows them (rendered tracebacks)."""
    return page.evaluate("""() => [...document.querySelectorAll(
        '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"], '
        + '.jp-RenderedText[data-mime-type*="error"]')]
      .map(e => e.textContent).filter(t => /Traceback|^\\s*\\w+(Error|Exception)\\b/m.test(t))
      .map(t => t.slice(-800))""")


def wait_widgets_rendered(page: Page, expected_views: int, timeout_ms: int = 60_000) -> list[str]:
    """Wait until every widget view is rendered; return the views that failed or still load."""
    js = """() => [...document.querySelectorAll('.jp-OutputArea-output[data-kvlab-widget]')]"""
    try:
        page.wait_for_function(f"""(n) => {{
          const views = ({js})();
          return views.length >= n && views.every(v =>
            /Error displaying widget/.test(v.textContent) || (!/Loading widget/.test(v.textContent)
              && v.querySelector('.jupyter-widgets')));
        }}""", arg=expected_views, timeout=timeout_ms, polling=250)
    except Exception:  # report below what is wrong instead of a bare timeout
        pass
    return page.evaluate(f"""() => {{
      const views = ({js})();
      const bad = views.filter(v => /Error displaying widget|Loading widget/.test(v.textContent)
                                  || !v.querySelector('.jupyter-widgets'))
                       .map(v => v.textContent.trim().slice(0, 300) || '(empty widget view)');
      const n = {expected_views};
      if (views.length < n) bad.push(`only ${{views.length}} of ${{n}} widget views are on the page`);
      return bad;
    }}""")


# --- one explorer ----------------------------------------------------------------------------------

_CONTROL_SELECTOR = ".widget-dropdown, .widget-slider, .widget-text, .widget-inttext, .widget-floattext"

# One snapshot of an explorer: its controls (tagged with data-kvlab-control=<description> so they
# can be located), readout, plot image and the kernel status, read in one go.
_SNAPSHOT = """(root, peek) => {
  const controls = [];
  const els = [];
  for (const el of root.querySelectorAll('__CONTROLS__')) {
    if (els.some(o => o.contains(el))) continue;
    els.push(el);
    const label = el.querySelector(':scope > .widget-label');
    const c = {description: label ? label.textContent.trim() : '', visible: el.checkVisibility()};
    el.setAttribute('data-kvlab-control', c.description);
    if (el.matches('.widget-dropdown')) {
      const s = el.querySelector('select');
      c.kind = 'dropdown';
      c.options = [...s.options].map(o => o.textContent);
      c.index = s.selectedIndex;
      c.value = s.selectedIndex >= 0 ? s.options[s.selectedIndex].textContent : null;
    } else if (el.matches('.widget-slider')) {
      const h = el.querySelector('.noUi-handle');
      c.kind = 'slider';
      c.value = (el.querySelector('.widget-readout') || {}).textContent;
      c.at_max = h.getAttribute('aria-valuenow') === h.getAttribute('aria-valuemax');
      c.at_min = h.getAttribute('aria-valuenow') === h.getAttribute('aria-valuemin');
      const [now, lo, hi] = ['now', 'min', 'max'].map(k => Number(h.getAttribute('aria-value' + k)));
      c.fraction = hi > lo ? (now - lo) / (hi - lo) : 0;
    } else {
      const i = el.querySelector('input');
      c.kind = 'number';
      c.value = i ? i.value : null;
    }
    controls.push(c);
  }
  const r = root.querySelector('.kvlab-readout');
  const img = root.querySelector('.widget-output img');
  const panel = window.jupyterapp.shell.currentWidget;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  // the image as a short fingerprint (length and a 32-bit FNV-1a hash of its data: URL)
  let image = '';
  if (img) {
    const src = img.getAttribute('src') || '';
    let h = 0x811c9dc5;
    for (let i = 0; i < src.length; i++) h = Math.imul(h ^ src.charCodeAt(i), 16777619);
    image = src.length + ':' + (h >>> 0).toString(16);
  }
  const snap = {controls, readout: r ? r.innerText : '', image,
                idle: !!kernel && kernel.status === 'idle'};
  if (!peek) window.__kvlabSnapshot = JSON.stringify(snap);
  return snap;
}""".replace("__CONTROLS__", _CONTROL_SELECTOR)


@dataclass
class Explorer:
    """One explorer as shown on the page: the widget view of the cell that calls it."""

    page: Page
    name: str  # e.g. "memory_explorer"
    root: Locator

    def snapshot(self) -> dict:
        """controls (description, kind, value as shown, visible, …), readout, image (a fingerprint
        of the plot's src, "" when none), idle (the kernel)."""
        return self.root.evaluate(_SNAPSHOT)

    def controls(self) -> list[dict]:
        return self.snapshot()["controls"]

    @staticmethod
    def settings_of(snapshot: dict) -> dict[str, str]:
        """description -> value as the UI shows it (hidden controls too: they still count)."""
        return {c["description"]: normalize(c["value"]) for c in snapshot["controls"]}

    def settings(self) -> dict[str, str]:
        return self.settings_of(self.snapshot())

    def control(self, description: str) -> Locator:
        self.snapshot()  # (re)tags the controls
        return self.root.locator(f"[data-kvlab-control={json.dumps(description)}]").first

    def readout(self) -> str:
        return normalize(self.snapshot()["readout"])

    def image(self) -> str:
        """A fingerprint of the plot image's src (a data: URL), or "" when no image is shown."""
        return self.snapshot()["image"]

    def wait_ready(self, timeout_ms: int = 60_000) -> None:
        """Wait until the explorer shows a readout and a plot."""
        self.page.wait_for_function("""(root) => {
          const r = root.querySelector('.kvlab-readout');
          return !!(r && r.textContent.trim() && root.querySelector('.widget-output img'));
        }""", arg=self.root.element_handle(), timeout=timeout_ms, polling=250)

    def play_to_end(self, expected: Callable[[dict], str]) -> tuple[dict, str]:
        """Press the explorer's Play button and wait until its step slider reached the last step, the
        plot and readout follow (`wait_redrawn`) and Play has stopped again; returns (settings,
        readout). Play stops on its first tick after the last step: a scrub before that restarts it."""
        before = self.snapshot()
        self.root.locator(".widget-play button").first.click()
        self.page.wait_for_function("""(root) => {
            const h = root.querySelector('.widget-slider .noUi-handle');
            return h && h.getAttribute('aria-valuenow') === h.getAttribute('aria-valuemax'); }""",
                                    arg=self.root.element_handle(), timeout=120_000, polling=200)
        settings, readout = self.wait_redrawn(before, expected)
        self.page.wait_for_function("""(root) => {
            const icon = root.querySelector('.widget-play button i');
            return icon && icon.className.includes('fa-play'); }""",
                                    arg=self.root.element_handle(), timeout=60_000, polling=200)
        return settings, readout

    # --- moving controls ---

    def press(self, description: str, key: str) -> None:
        handle = self.control(description).locator(".noUi-handle")
        handle.focus()
        handle.press(key)

    def drag(self, description: str, fraction: float) -> None:
        """Drag the slider's handle with the mouse to `fraction` of the track's width."""
        box = self.control(description)
        box.scroll_into_view_if_needed()
        h = box.locator(".noUi-handle").bounding_box()
        track = box.locator(".noUi-base").bounding_box()
        x0, y0 = h["x"] + h["width"] / 2, h["y"] + h["height"] / 2
        mouse = self.page.mouse
        mouse.move(x0, y0)
        mouse.down()
        mouse.move(track["x"] + fraction * track["width"], y0, steps=10)
        mouse.up()

    def select(self, description: str, index: int) -> None:
        self.control(description).locator("select").select_option(index=index)

    def type_number(self, description: str, value: int | float) -> None:
        box = self.control(description).locator("input")
        box.fill(str(value))
        box.press("Enter")

    def wait_redrawn(self, before: dict, expected: Callable[[dict], str],
                     timeout_s: float = MOVE_TIMEOUT_S,
                     settled: Callable[[dict], bool] = lambda settings: True) -> tuple[dict, str]:
        """Wait until the plot changed and the readout equals expected(settings read from the UI).

        `settled(settings)` must hold too: a test that knows where a move lands (a key press on a
        slider) passes it, so a redraw still coming from the move before cannot pass for this one.

        `before` is the snapshot taken before the move. The settings are read again on every
        change of the page (a control can move others, via the kernel), so the readout is compared
        with the settings the UI ends up showing, once the kernel is idle. The readout must change
        too, unless kvlab's readout is the same for the old and the new settings. Returns
        (settings, readout); raises AssertionError on timeout.
        """
        deadline = time.monotonic() + timeout_s
        cache: dict[str, str] = {}
        image_before, readout_before = before["image"], normalize(before["readout"])
        key_before = json.dumps(self.settings_of(before), sort_keys=True)
        cache[key_before] = normalize(expected(self.settings_of(before)))
        while True:
            snap = self.snapshot()
            settings, readout = self.settings_of(snap), normalize(snap["readout"])
            key = json.dumps(settings, sort_keys=True)
            if key not in cache:
                cache[key] = normalize(expected(settings))
            want = cache[key]
            if (snap["idle"] and snap["image"] and snap["image"] != image_before and readout == want
                    and (readout != readout_before or want == cache[key_before]) and settled(settings)):
                return settings, readout
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                raise AssertionError(
                    f"{self.name}: after moving a control the UI did not settle on the expected "
                    f"readout within {timeout_s:.0f} s\n settings shown: {settings}\n"
                    f" kernel idle: {snap['idle']}, image changed: {snap['image'] != image_before}\n"
                    f" readout shown:    {readout!r}\n expected readout: {want!r}\n"
                    f" readout before:   {readout_before!r}\n settings before: {self.settings_of(before)}")
            self._wait_change(snap, left_ms)

    def _wait_change(self, snap: dict, timeout_ms: float) -> None:
        """Block until the snapshot differs from `snap` (readout, image, a control, kernel status)."""
        try:
            self.page.wait_for_function(
                f"(root) => JSON.stringify(({_SNAPSHOT})(root, true)) !== window.__kvlabSnapshot",
                arg=self.root.element_handle(),
                timeout=max(timeout_ms, 1), polling=200)
        except Exception:  # the caller's deadline check reports the state
            pass


def explorers(page: Page, all_cells: list[dict]) -> list[Explorer]:
    """The explorers on the page: for each cell calling `…_explorer(`, the first widget view it
    shows (or, if it shows none, the next cell's), in notebook order."""
    found = []
    for cell in all_cells:
        match = EXPLORER_CALL.search(cell["source"]) if cell["type"] == "code" else None
        if not match:
            continue
        for later in all_cells[cell["index"]:]:
            if any(WIDGET_MIME in o["mimes"] for o in later["outputs"]):
                root = page.locator(f'[data-kvlab-cell="{later["index"]}"] '
                                    '.jp-OutputArea-output[data-kvlab-widget]').first
                found.append(Explorer(page, match.group(1), root))
                break
    return found
