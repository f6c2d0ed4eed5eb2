"""Chapter 10: the speculation explorer's recording and drawing against kvlab.speculative, the explorer
itself, the figures, and the three checkers (right answers accepted, the usual wrong ones hinted at,
anything else a hint and never a traceback)."""

import html

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from answers import WRONG_VALUES, hint_test, verdict_test  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvlab import pretrained  # noqa: E402
from kvlab.cache import blocks_needed  # noqa: E402
from kvlab.course import ch10_speculative_decoding as ch10  # noqa: E402
from kvlab.generate import encode_bytes, generate  # noqa: E402
from kvlab.speculative import expected_tokens_per_step  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from walk(child)


def shown(readout) -> str:
    return html.unescape(readout.value.split(">", 1)[1].rsplit("</pre>", 1)[0])


# --- the recording behind the explorer ------------------------------------------------------------

@pytest.mark.parametrize("drafter", ch10.DRAFTERS)
def test_frames_replay_plain_greedy_decoding_and_its_crops(drafter):
    frames = ch10.speculation_frames(drafter)
    assert len(frames) == ch10.EXPLORER_STEPS
    prompt = encode_bytes(ch10.EXPLORER_PROMPT)
    last = frames[-1]
    tokens = list(last.tokens) + list(last.added)
    plain = generate(pretrained.load("kvlab-tiny"), prompt, len(tokens) - len(prompt)).tokens[0].tolist()
    assert tokens == plain
    for f, after in zip(frames, frames[1:], strict=False):
        s = f.step
        assert list(f.tokens) + list(f.added) == list(after.tokens)        # each step adds its tokens
        assert s.before.seq_len == len(f.tokens) + s.proposed              # fed: last + the guesses
        assert s.after.seq_len == f.kept == len(f.tokens) + s.accepted     # crop keeps the accepted
        assert s.blocks_freed == (blocks_needed(s.before.seq_len, f.block_size)
                                  - blocks_needed(s.after.seq_len, f.block_size))
        assert list(s.guesses[:s.accepted]) == list(s.choices[:s.accepted])
    assert any(f.step.rejected for f in frames)


def test_frames_refuse_unknown_settings():
    with pytest.raises(ValueError, match="drafter"):
        ch10.speculation_frames("oracle")
    with pytest.raises(ValueError, match="k"):
        ch10.speculation_frames("prompt lookup", k=0)


def test_readout_says_what_the_step_did():
    frames = ch10.speculation_frames("prompt lookup")
    for i, f in enumerate(frames):
        s, text = f.step, ch10.speculation_readout(frames, i)
        assert text.startswith(f"step {i + 1} of {len(frames)}:")
        assert f"cropped to {s.after.seq_len}" in text and f"{s.before.seq_len} after the verify pass" in text
        assert f"({s.blocks_freed} freed)" in text
        if s.proposed and s.rejected:
            assert f"{s.accepted} accepted; first rejection at guess {s.accepted + 1}" in text
        elif s.proposed:
            assert f"all {s.proposed} accepted" in text


def test_the_step_picture_is_a_figure_and_refuses_a_step_out_of_range():
    frames = ch10.speculation_frames("prompt lookup")
    assert isinstance(ch10.plot_speculation_step(frames, 0), Figure)
    with pytest.raises(ValueError, match="step"):
        ch10.plot_speculation_step(frames, len(frames))


def test_explorer_redraws_on_a_control_change():
    box = ch10.speculation_explorer()
    assert "kvlab-speculation-explorer" in box._dom_classes
    controls = {w.description: w for w in walk(box) if getattr(w, "description", "")}
    assert {"step", "drafter", "Play"} <= set(controls)
    readout = [w for w in walk(box) if "kvlab-readout" in w._dom_classes][0]
    assert shown(readout) == ch10.speculation_readout(ch10.speculation_frames(ch10.DRAFTERS[0]), 0)
    assert (controls["step"].min, controls["step"].max) == (1, ch10.EXPLORER_STEPS)
    controls["step"].value = 6
    controls["drafter"].value = "kvlab-tiny-draft"
    assert shown(readout) == ch10.speculation_readout(ch10.speculation_frames("kvlab-tiny-draft"), 5)
    assert shown(readout).startswith("step 6 of")


# --- the figures ----------------------------------------------------------------------------------

def test_figures_draw_what_they_are_given():
    fig = ch10.plot_pass_cost([1, 2, 4], {"a": [1.0, 1.1, 1.3]}, {"b": [1.0, 1.0, 1.0]})
    assert [list(line.get_ydata()) for line in fig.axes[0].lines[:2]] == [[1.0, 1.1, 1.3], [1.0, 1.0, 1.0]]
    fig = ch10.plot_acceptance([1, 2], {"d": [0.5, 0.5]}, {"d": [1.5, 1.7]})
    assert list(fig.axes[0].lines[0].get_ydata()) == [0.5, 0.5]
    assert list(fig.axes[1].lines[1].get_ydata()) == [expected_tokens_per_step(0.5, k) for k in (1, 2)]
    fig = ch10.plot_expected_speedup(4, {"d": 0.25}, {"d": (0.8, 0.25, 1.4)}, verify_cost=1.2)
    point = [line for line in fig.axes[0].lines if line.get_marker() == "o"][0]
    assert (point.get_xdata()[0], point.get_ydata()[0]) == (0.8, 1.4)


# --- exercise 1: tokens per verify pass -----------------------------------------------------------

def test_tokens_per_step_right_and_wrong(capsys):
    assert ch10.check_tokens_per_step(expected_tokens_per_step(0.8, 4))
    assert ch10.check_tokens_per_step("3.3616")
    for wrong, hint in ((4.2, "α^i"), (2.3616, "target's own token"), (5, "best case"), (3.0, "add up"),
                        (1 + 0.8 + 0.8**2 + 0.8**3, "k + 1 terms")):
        assert not ch10.check_tokens_per_step(wrong)
        assert hint in capsys.readouterr().out


# --- exercise 2: positions kept after a rejection -------------------------------------------------

def test_positions_kept_right_and_wrong(capsys):
    assert ch10.check_positions_kept(list(range(23)))
    assert ch10.check_positions_kept(range(23))
    assert ch10.check_positions_kept(tuple(range(23)))
    assert ch10.check_positions_kept(np.arange(23))                    # NumPy, as the other checkers take
    assert ch10.check_positions_kept([np.int64(p) for p in range(23)])
    assert ch10.check_positions_kept(torch.arange(23))
    for wrong, hint in ((range(25), "keeps the rejected"), (range(24), "third guess"),
                        (range(22), "position 20"), (range(20), "accepted guesses stay"),
                        ([0, 1, 5], "a prefix"), (23, "list or range"), ([0.0, 1.0], "list or range"),
                        (np.arange(23.0), "integer array"), (np.arange(25), "keeps the rejected"),
                        (np.arange(23).reshape(1, 23), "integer array"), (torch.ones(23, dtype=torch.bool),
                                                                          "integer array")):
        assert not ch10.check_positions_kept(wrong)
        assert hint in capsys.readouterr().out


# --- exercise 3: crop, checked by the oracle ------------------------------------------------------

def right_crop(cache, n):
    for layer in range(len(cache.keys)):
        cache.keys[layer] = cache.keys[layer][:, :, :n]
        cache.values[layer] = cache.values[layer][:, :, :n]
    cache.lengths = [n] * len(cache.keys)


def keys_only(cache, n):
    for layer in range(len(cache.keys)):
        cache.keys[layer] = cache.keys[layer][:, :, :n]
    cache.lengths = [n] * len(cache.keys)


def wrong_axis(cache, n):
    for layer in range(len(cache.keys)):
        cache.keys[layer] = cache.keys[layer][:, :n]
        cache.values[layer] = cache.values[layer][:, :n]
    cache.lengths = [n] * len(cache.keys)


def off_by_one(cache, n):
    right_crop(cache, n + 1)


def lengths_only(cache, n):
    cache.lengths = [n] * len(cache.keys)


def first_layer_only(cache, n):
    for side in (cache.keys, cache.values):
        side[0] = side[0][:, :, :n]
    cache.lengths = [n] * len(cache.keys)


def head_dim_sliced(cache, n):
    for layer in range(len(cache.keys)):
        cache.keys[layer] = cache.keys[layer][..., :n]
        cache.values[layer] = cache.values[layer][..., :n]
    cache.lengths = [n] * len(cache.keys)


def new_lists(cache, n):
    return [k[:, :, :n] for k in cache.keys], [v[:, :, :n] for v in cache.values]


def no_lengths(cache, n):
    for layer in range(len(cache.keys)):
        cache.keys[layer] = cache.keys[layer][:, :, :n]
        cache.values[layer] = cache.values[layer][:, :, :n]


def raises(cache, n):
    raise IndexError("my bug")


def stale_rows(cache, n):
    """Keeps the right number of rows, but the wrong ones (the newest instead of the first)."""
    for layer in range(len(cache.keys)):
        cache.keys[layer] = cache.keys[layer][:, :, -n:]
        cache.values[layer] = cache.values[layer][:, :, -n:]
    cache.lengths = [n] * len(cache.keys)


def test_the_right_crop_passes_the_oracle():
    assert ch10.check_crop(right_crop)


# Each usual mistake, and the words of the hint that names it (never a raw error without advice).
CROP_MISTAKES = [
    (lengths_only, "not just shortening a length"),
    (wrong_axis, "[:, :n] slices dim 1, the heads"),   # kvlab-tiny has 4 KV heads: [:, :n] changes nothing
    (keys_only, "slice the values too"),
    (first_layer_only, "crop every layer"),
    (head_dim_sliced, "another axis than the positions"),
    (new_lists, "change the cache in place"),
    (lambda c, n: None, "left the cache as it was"),
    (no_lengths, "set cache.lengths"),
    (off_by_one, "set cache.lengths"),
    (stale_rows, "Keep the *first* n positions"),
    (raises, "raised IndexError: my bug"),
]


@pytest.mark.parametrize(("crop", "hint"), CROP_MISTAKES, ids=[f.__name__ for f, _ in CROP_MISTAKES])
def test_a_wrong_crop_gets_a_hint_that_names_the_mistake(crop, hint, capsys):
    assert not ch10.check_crop(crop)
    out = capsys.readouterr().out
    assert out.startswith("✗ Not yet. Hint:") and hint in out
    assert "[:, :, :n]" in out or "Keep the *first*" in out or "cache.lengths = [n]" in out


def test_the_exercise_cache_calls_the_learners_crop():
    calls = []
    config = pretrained.load("kvlab-tiny").config
    cache = ch10.ExerciseKVCache(config, lambda c, n: calls.append(n))
    for layer in range(config.n_layers):
        cache.update(layer, torch.zeros(1, 4, 3, 32), torch.zeros(1, 4, 3, 32))
    cache.crop(2)
    assert calls == [2]
    with pytest.raises(ValueError, match="n=4"):   # kvlab's range check comes first
        cache.crop(4)


CHECKERS = [ch10.check_tokens_per_step, ch10.check_positions_kept, ch10.check_crop]
test_any_wrong_answer_gets_a_hint = hint_test(CHECKERS, WRONG_VALUES)
test_whatever_is_typed_the_checkers_answer_with_a_verdict = verdict_test(CHECKERS)
