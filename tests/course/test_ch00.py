"""Chapter 00: the roadmap draws every chapter and says truly which have an explorer; the warm-up
checker prints its verdict once, names the usual miscounts and takes any answer."""

import json
from pathlib import Path

import matplotlib
import pytest
from answers import WRONG_VALUES, hint_test, verdict_test
from IPython.core.interactiveshell import InteractiveShell

from kvlab.course import ch00_welcome as ch00

matplotlib.use("Agg")


def test_roadmap_has_a_box_per_chapter():
    fig = ch00.plot_roadmap()
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert all(num in texts for num, *_ in ch00.ROADMAP)
    matplotlib.pyplot.close(fig)


NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def test_roadmap_lists_the_twelve_chapters_in_order():
    assert [num for num, *_ in ch00.ROADMAP] == [f"{i:02d}" for i in range(12)]
    assert set(ch00.chapters_with_explorers()) >= {"02", "03", "04", "05", "09"}


@pytest.mark.parametrize("num", [num for num, *_ in ch00.ROADMAP])
def test_roadmap_says_truly_whether_a_chapter_has_an_explorer(num):
    found = sorted(NOTEBOOKS.glob(f"{num}_*.ipynb"))
    assert found, f"the road map lists chapter {num}, but notebooks/ has no {num}_*.ipynb"
    cells = json.loads(found[0].read_text(encoding="utf-8"))["cells"]
    has_explorer = any(cell["cell_type"] == "code" and "_explorer(" in "".join(cell["source"])
                       for cell in cells)
    assert (num in ch00.chapters_with_explorers()) == has_explorer, found[0].name


def test_a_checker_prints_its_verdict_once_and_displays_nothing_more(capsys):
    right, wrong = ch00.check_byte_tokens(15), ch00.check_byte_tokens(14)
    assert right and not wrong
    out = capsys.readouterr().out
    assert out.startswith("✓ 'KV cache 缓存' is 15 byte tokens.") and "✗ Not yet. Hint:" in out
    # A notebook shows a cell's last value through IPython's display formatter: nothing for a
    # verdict (no stray "True"/"False" under the ✓ or hint), the usual text for a plain bool.
    formatter = InteractiveShell.instance().display_formatter
    assert formatter.format(right) == ({}, {})
    assert formatter.format(True)[0] == {"text/plain": "True"}


def test_unanswered_exercises_get_a_hint_not_an_error(capsys):
    assert not ch00.check_byte_tokens(None)
    assert "replace None" in capsys.readouterr().out
    assert ch00.check_byte_tokens("15") and ch00.check_byte_tokens(15.0)


@pytest.mark.parametrize("answer, words", [
    (11, "you counted characters"),           # 11 characters, not 15 bytes
    (13, "GBK or UTF-16"),                     # 2 bytes a Chinese character
    ("abc", "answer with a number"),           # not a number at all: said so
    (10, "a Chinese character takes 3"),       # any other count: the general hint
])
def test_the_usual_miscounts_get_their_own_hint(answer, words, capsys):
    assert not ch00.check_byte_tokens(answer)
    assert words in capsys.readouterr().out


def test_the_legend_says_has_an_explorer_not_ends_in_one():
    fig = ch00.plot_roadmap()
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "◆ has an explorer" in labels
    matplotlib.pyplot.close(fig)


test_any_wrong_answer_gets_a_hint = hint_test([ch00.check_byte_tokens], WRONG_VALUES)
test_whatever_is_typed_the_checker_answers_with_a_verdict = verdict_test([ch00.check_byte_tokens])
