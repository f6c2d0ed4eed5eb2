"""Execute notebooks in place, top to bottom in a fresh kernel, on the CPU, and save outputs.

Widgets are stored as static snapshots: each widget output is replaced by what the widget showed
when the cell last ran (its controls' values, its picture, its readout), and the notebook keeps no
widget state. Every front end reads that the same way before a cell runs: JupyterLab, Colab (whose
ipywidgets 7 front end does not restore saved widget state, let alone ipywidgets 8 state), GitHub
and the course website. Running the cell shows the live widget again.

    python tools/run_notebooks.py notebooks/03_cache_memory.ipynb      # execute, then snapshot
    python tools/run_notebooks.py --snapshot-only notebooks/*.ipynb     # snapshot stored outputs only
"""

from __future__ import annotations

import html
import re
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import nbformat

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
SNAPSHOT_NOTE = "Snapshot of the interactive widget as last run: run the notebook to use its controls."
HIDDEN = ({"display": "none"}, {"visibility": "hidden"})


def run(path: Path) -> float:
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    # Run from the notebooks folder so relative paths behave as in JupyterLab. The widget state is
    # stored so that snapshot_widgets can turn it into static outputs.
    ExecutePreprocessor(timeout=600, kernel_name="python3", store_widget_state=True).preprocess(
        nb, {"metadata": {"path": str(path.parent)}})
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    snapshot_widgets(nb)
    nbformat.write(nb, path)
    return time.perf_counter() - start


# --- widgets -> static outputs -------------------------------------------------------------------

def snapshot_widgets(nb) -> int:
    """Replace every widget-view output by static outputs drawn from the saved widget state, and drop
    the state. Return how many widget outputs were replaced (0 leaves the notebook unchanged)."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    replaced = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                outputs.append(out)
                continue
            replaced += 1
            outputs += _static(view.get("model_id", ""), state)
        cell.outputs = outputs
    if replaced or "widgets" in nb.metadata:
        nb.metadata.pop("widgets", None)
    return replaced


def _static(model_id: str, state: dict) -> list:
    """The static outputs for one widget: consecutive control values in one line, HTML as HTML, an
    Output widget's own outputs as they are. Hidden widgets (finished progress bars) give nothing."""
    if model_id not in state:
        return [_display(text=f"(interactive widget: {SNAPSHOT_NOTE.split(': ', 1)[1]})")]
    items: list[tuple[str, object]] = []
    _walk(model_id, state, items)
    if not items:
        return []
    outputs, controls = [], []
    for kind, value in items + [("end", None)]:
        if kind == "control":
            controls.append(value)
            continue
        if controls or not outputs:  # the note comes first, with the first controls if they lead
            outputs.append(_controls_output(controls, note=not outputs))
            controls = []
        if kind == "html":
            outputs.append(_display(html_text=value))
        elif kind == "outputs":
            outputs += [nbformat.from_dict(o) for o in value]
    return outputs


def _walk(model_id: str, state: dict, items: list) -> None:
    model = state.get(model_id)
    if model is None:
        return
    s = model.get("state", {})
    layout = state.get(_ref(s.get("layout")), {}).get("state", {})
    if any(all(layout.get(k) == v for k, v in h.items()) for h in HIDDEN):
        return
    name = model.get("model_name", "")
    if "children" in s:
        for child in s["children"]:
            _walk(_ref(child), state, items)
    elif name == "OutputModel":
        items.append(("outputs", s.get("outputs", [])))
    elif name in ("HTMLModel", "HTMLMathModel", "LabelModel"):
        text = s.get("value", "")
        if _plain(text).strip():
            items.append(("html", text if name != "LabelModel" else html.escape(text)))
    elif "ProgressModel" in name:
        items.append(("control", f"{s.get('description') or 'progress'}: {s.get('value')} of {s.get('max')}"))
    elif "_options_labels" in s or "value" in s:
        items.append(("control", _control_text(s)))


def _ref(value) -> str:
    return value[len("IPY_MODEL_"):] if isinstance(value, str) and value.startswith("IPY_MODEL_") else ""


def _control_text(s: dict) -> str:
    if "_options_labels" in s:
        labels, index = s["_options_labels"], s.get("index")
        indices = index if isinstance(index, list) else [index]
        value = ", ".join(labels[i] for i in indices if isinstance(i, int) and 0 <= i < len(labels))
    else:
        value = s["value"]
    description = s.get("description", "")
    return f"{description}: {value}" if description else str(value)


def _controls_output(controls: list[str], note: bool):
    lines = ([SNAPSHOT_NOTE] if note else []) + ([" · ".join(controls)] if controls else [])
    body = f"<p class='kvlab-snapshot-note'><em>{html.escape(SNAPSHOT_NOTE)}</em></p>" if note else ""
    if controls:
        body += "<p class='kvlab-snapshot-controls'>" + " · ".join(
            "<b>{}</b>: {}".format(*map(html.escape, c.split(": ", 1))) if ": " in c else html.escape(c)
            for c in controls) + "</p>"
    return _display(text="\n".join(lines), html_text=f"<div class='kvlab-widget-snapshot'>{body}</div>")


def _display(text: str | None = None, html_text: str | None = None):
    data = {"text/plain": text if text is not None else _plain(html_text)}
    if html_text is not None:
        data["text/html"] = html_text
    return nbformat.v4.new_output("display_data", data=data)


class _Text(HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts: list[str] = []

    def handle_data(self, data):
        self.parts.append(data)


def _plain(markup: str) -> str:
    parser = _Text()
    parser.feed(markup or "")
    return re.sub(r"[ \t]+\n", "\n", "".join(parser.parts))


def main(argv: list[str]) -> None:
    snapshot_only = "--snapshot-only" in argv
    if not snapshot_only:
        from kvlab.course_model import convert_course_model

        print("converted the course's real model into its cache (the first run only)"
              if convert_course_model() else "the course's real model is in its cache", flush=True)
    for arg in (a for a in argv if a != "--snapshot-only"):
        path = Path(arg)
        if snapshot_only:
            nb = nbformat.read(path, as_version=4)
            n = snapshot_widgets(nb)
            nbformat.write(nb, path)
            print(f"{arg}: {n} widget output(s) replaced by snapshots", flush=True)
        else:
            print(f"{arg}: executing (the stored outputs will be replaced; your edits to its cells are kept)",
                  flush=True)
            print(f"{arg}: wrote its new outputs in {run(path):.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
