"""What every chapter module shares: the figure style, axis labels for tokens and bytes, the boxes and
arrows of the diagrams, the explorers' readout, and the exercise checkers' `Verdict` and answer parsing.
"""

from __future__ import annotations

import math
import reprlib

import matplotlib.pyplot as plt

from ..memory import GiB

# ---- figures --------------------------------------------------------------------------------------


def new_figure(width: float = 7.0, height: float = 4.0):
    """A figure and axes in the course's house style."""
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    ax.grid(True, alpha=0.3)
    return fig, ax


def log_log(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Log-log axes (powers of two along x) with labels, a small title, a grid and the legend: the
    step-time figures of chapters 01 and 02 all look this way."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def tokens_label(n: int) -> str:
    """128, 4K, 128K, 1M: binary K and M, as context lengths are usually quoted."""
    for unit, size in (("M", 2**20), ("K", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


BYTE_UNITS = (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024))


def bytes_unit(n: float) -> tuple[str, int]:
    """The largest binary unit not above n, e.g. ("GiB", 1024**3); ("B", 1) below a KiB."""
    return next(((unit, size) for unit, size in BYTE_UNITS if n >= size), ("B", 1))


def bytes_label(n: float) -> str:
    """An axis label for a byte count: 4 significant digits in the largest unit that fits."""
    unit, size = bytes_unit(n)
    return f"{n / size:.4g} {unit}"


# Box colours of the generation diagrams (chapters 01 and 02).
PROMPT_FACE, NEW_FACE, CACHED_FACE, MODEL_FACE = "#DDDDDD", "#F2B880", "#A8C8E8", "#FFF2CC"


def box(ax, x, y, w, h, text, face, edge="#333333", hatch=None, fontsize=9, color="black"):
    """A rounded box with centred text, for the course's diagrams."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=face, edgecolor=edge, hatch=hatch, lw=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=color)


def arrow(ax, start, end, color="#333333", style="-|>", rad=0.0, lw=1.2):
    """An arrow from start to end (curved when rad is not 0)."""
    ax.annotate("", xy=end, xytext=start,
                arrowprops=dict(arrowstyle=style, color=color, lw=lw,
                                connectionstyle=f"arc3,rad={rad}"))


# ---- explorers ------------------------------------------------------------------------------------
# Each explorer is a thin shell of core ipywidgets around an ordinary `plot_…` function that returns
# (Figure, readout text); the notebooks also call that function directly, so nbval tests what the
# widget shows.


def readout_html(text: str) -> str:
    """The readout text as preformatted HTML (columns stay aligned)."""
    import html

    return ("<pre style='font-size:12.5px; line-height:1.45; white-space:pre-wrap; margin:0'>"
            f"{html.escape(text)}</pre>")


def explorer_plot(draw, controls: dict, readout, skip=lambda: False):
    """The plot area of an explorer: `draw(**values)` -> (Figure, text) runs whenever a control in
    `controls` (argument name -> widget) changes; the figure is shown in an output area of fixed
    height (no flicker) and the text goes to the `readout` HTML widget. While `skip()` is true
    (controls being set by code) nothing is drawn."""
    import ipywidgets as w
    from IPython.display import display

    def update(**values) -> None:
        if skip():
            return
        fig, text = draw(**values)
        readout.value = readout_html(text)
        display(fig)
        plt.close(fig)

    out = w.interactive_output(update, controls)
    out.layout = w.Layout(height="400px", overflow="hidden")  # a 3.6-inch figure (371 px) and margins
    out.add_class("kvlab-plot")
    return out


def labelled_slider(name: str, options, value, fmt: str = "{:,}"):
    """A slider over the given values, each shown with fmt, updating when released (an explorer's
    redraw takes a moment)."""
    import ipywidgets as w

    return w.SelectionSlider(options=[(fmt.format(o), o) for o in options], value=value,
                             description=name, style={"description_width": "110px"},
                             layout=w.Layout(width="440px"), continuous_update=False)


def positive_int(x) -> bool:
    """Is x a whole number >= 1 (and not a bool)?"""
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


# ---- exercise checkers ------------------------------------------------------------------------------
# A checker prints ✓ or a hint and returns a Verdict. Whatever a learner types (None, a string, a
# huge integer, NaN, a tensor, a function that raises) gets a hint, never a traceback.


class Verdict:
    """A checker's result: true or false for `assert`, and silent as a cell's last value (the
    checker has already printed ✓ or its hint, so the notebook shows no stray `False`)."""

    def __init__(self, ok: bool):
        self.ok = bool(ok)

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Verdict({self.ok})"

    def _ipython_display_(self) -> None:
        pass


def report(ok: bool, success: str, hint: str) -> Verdict:
    """Print ✓ and the success text, or the hint; return the Verdict."""
    print(f"✓ {success}" if ok else f"✗ Not yet. Hint: {hint}")
    return Verdict(ok)


_short = reprlib.Repr()
_short.maxstring = _short.maxother = _short.maxlong = 60


def shown(answer) -> str:
    """repr(answer), shortened: a hint quotes what the learner typed without flooding the cell."""
    return _short.repr(answer)


# What a checker reads as a number, said in every hint that refuses one.
NUMBER_FORMS = ("a number: an int, a float, text such as '8,390,656', or a one-element NumPy array "
                "or PyTorch tensor")


def _array_size(answer) -> int | None:
    """How many elements a NumPy array, NumPy scalar or PyTorch tensor holds; None for anything else
    (an object that does not say, or that raises when asked: a learner's answer can be anything)."""
    if not (hasattr(answer, "dtype") and hasattr(answer, "shape")):
        return None
    try:
        return math.prod(int(n) for n in answer.shape)
    except Exception:  # noqa: BLE001
        return None


def _not_a_number_dtype(answer) -> bool:
    """A bool or complex array or tensor: float() would turn True into 1.0 and drop an imaginary part."""
    kind = str(getattr(answer, "dtype", ""))
    return "bool" in kind or "complex" in kind


def dense_tensor(t) -> bool:
    """Whether a learner's function returned an ordinary tensor: strided (not sparse), not nested, not
    on the meta device; a checker hints "return ordinary dense tensors" for anything else."""
    import torch

    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested
            and not t.is_meta)


def as_number(answer) -> float | None:
    """A finite number from an int, a float, a one-element tensor or array (of any shape: [15] and
    [[15]] too), or a string like '8,390,656'; None for anything else (None, a bool, bytes, a complex
    number, NaN, infinity, an int too large for a float, an array of several numbers).
    `number_hint` says why in words."""
    if isinstance(answer, (bool, bytes, bytearray)) or answer is None:
        return None
    size = _array_size(answer)
    if size is not None:
        if size != 1 or _not_a_number_dtype(answer):
            return None
        try:  # NumPy 2 refuses float() of a one-element array with ndim > 0: take the element
            answer = answer.reshape(-1)[0].item()
        except Exception:  # noqa: BLE001 - sparse, meta, nested tensors: not a number we can read
            return None
        if isinstance(answer, bool):
            return None
    if isinstance(answer, str):
        answer = answer.replace(",", "").replace("_", "").strip()
    if isinstance(answer, complex):
        return None
    try:
        value = float(answer)
    except Exception:  # noqa: BLE001 - a learner's answer can be anything: not a number is a hint
        return None
    return value if math.isfinite(value) else None


def why_not_a_number(answer) -> str:
    """Why `as_number` refuses answer, in a few words that quote it (for a hint)."""
    size = _array_size(answer)
    if answer is None:
        return "got None: put your answer in place of None"
    if isinstance(answer, bool) or (size is not None and "bool" in str(answer.dtype)):
        return f"got {shown(answer)}, yes/no values, not numbers"
    if size is not None and size != 1:
        return f"got {shown(answer)}, which holds {size:,} numbers, not one"
    if isinstance(answer, complex) or _not_a_number_dtype(answer):
        return f"got {shown(answer)}, a complex number"
    if isinstance(answer, (bytes, bytearray)):
        return f"got the bytes {shown(answer)}: write the number without b'…'"
    if isinstance(answer, str):
        return f"got the text {shown(answer)}, which does not read as a number"
    if isinstance(answer, int):
        return f"got an integer of {len(str(abs(answer))):,} digits, too large for a float"
    if size == 1:
        try:
            answer.reshape(-1)[0].item()
        except Exception:  # noqa: BLE001
            return f"got {shown(answer)}, whose value cannot be read"
    if isinstance(answer, float) or size == 1:
        return f"got {shown(answer)}, not a finite number"
    return f"got {shown(answer)}, which is not a number ({type(answer).__name__})"


def number_hint(answer) -> str:
    """The hint for an answer that is not a number: what it got and what is allowed."""
    return f"answer with {NUMBER_FORMS} ({why_not_a_number(answer)})."


def as_numbers(answer, count: int = 2) -> tuple[float, ...] | None:
    """`count` finite numbers from a tuple or list of `count` answers `as_number` reads, or from a
    NumPy array or PyTorch tensor of `count` elements (any shape, read in order); None otherwise."""
    size = _array_size(answer)
    if size is not None:
        if size != count or _not_a_number_dtype(answer):
            return None
        try:
            answer = answer.reshape(-1).tolist()
        except Exception:  # noqa: BLE001 - sparse, meta, nested tensors: not numbers we can read
            return None
    if not isinstance(answer, (tuple, list)) or len(answer) != count:
        return None
    values = tuple(as_number(a) for a in answer)
    return None if any(v is None for v in values) else values


def numbers_hint(answer, names: tuple[str, ...]) -> str:
    """The hint for an answer that `as_numbers(answer, len(names))` refuses: the form asked for,
    (name, name), what is allowed, and what was wrong with what it got."""
    count = len(names)
    allowed = (f"answer with {count} numbers, ({', '.join(names)}): a tuple or list of {count} numbers, "
               f"or an array or tensor of {count} elements")
    size = _array_size(answer)
    if size is not None and size != count:
        return f"{allowed} (got {shown(answer)}, {size:,} element{'s' * (size != 1)})."
    if size is not None:
        if _not_a_number_dtype(answer):
            kind = "yes/no values" if "bool" in str(answer.dtype) else "complex numbers"
            return f"{allowed} (got {shown(answer)}: {kind})."
        try:
            answer = answer.reshape(-1).tolist()
        except Exception:  # noqa: BLE001
            return f"{allowed} (got {shown(answer)}, whose values cannot be read)."
    if answer is None:
        return f"{allowed} (got None: put your answer in place of None)."
    if not isinstance(answer, (tuple, list)):
        return f"{allowed} (got {shown(answer)}, a {type(answer).__name__})."
    if len(answer) != count:
        return f"{allowed} (got {shown(answer)}, {len(answer)} value{'s' * (len(answer) != 1)})."
    bad = next(i for i, a in enumerate(answer) if as_number(a) is None)
    return f"{allowed}, each {NUMBER_FORMS} (its {names[bad]}: {why_not_a_number(answer[bad])})."


def close(answer, expected: float, rel: float = 1e-6) -> bool:
    """Is answer a number within rel (relative; absolute below 1) of expected?"""
    value = as_number(answer)
    return value is not None and abs(value - expected) <= rel * max(1.0, abs(expected))


def numeric(answer, expected: float, rel: float, success: str, hint: str,
            unit_hint: str | None = None) -> Verdict:
    """Check a numeric answer; `unit_hint` answers a value that is the expected GiB given in bytes."""
    value = as_number(answer)
    if value is None:
        return report(False, "", f"{number_hint(answer)} {hint}")
    ok = close(value, expected, rel)
    if not ok and unit_hint and close(value, expected * 1024**3, rel):
        return report(False, "", unit_hint)
    return report(ok, success, hint)
