from IPython.core.interactiveshell import InteractiveShell

from kvlab import check


def test_a_checker_prints_its_verdict_once_and_displays_nothing_more(capsys):
    right, wrong = check.byte_tokens(15), check.byte_tokens(14)
    assert right and not wrong
    out = capsys.readouterr().out
    assert out.startswith("✓ 'KV cache 缓存' is 15 byte tokens.") and "✗ Not yet. Hint:" in out
    # A notebook shows a cell's last value through IPython's display formatter: nothing for a
    # verdict (no stray "True"/"False" under the ✓ or hint), the usual text for a plain bool.
    formatter = InteractiveShell.instance().display_formatter
    assert formatter.format(right) == ({}, {})
    assert formatter.format(True)[0] == {"text/plain": "True"}


def test_unanswered_exercises_get_a_hint_not_an_error(capsys):
    assert not check.byte_tokens(None)
    assert "replace None" in capsys.readouterr().out
