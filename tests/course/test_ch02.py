"""Chapter 02: the figures draw, and the two checkers (decode step, chunk positions and mask) accept a
right answer, name the usual mistakes and give anything else (a value, a function that raises or
returns the wrong thing) a hint."""

import math

import matplotlib
import pytest
import torch
from answers import WRONG_FUNCTIONS, WRONG_VALUES, hint_test

from kvlab.attention import causal_mask
from kvlab.course import ch02_kv_cache as ch02

matplotlib.use("Agg")


def test_chapter_figures_draw():
    figs = [ch02.plot_prefill_decode(4, 3), ch02.plot_prefill_decode(30, 20),
            ch02.plot_speedup_vs_tokens([8, 16], {"one run": [2.0, 4.0]}, [4.5, 8.5]),
            ch02.plot_speedup_vs_tokens([8, 16], {"repeats": [[1.5, 2.0, 2.5], [3.0, 4.0, 4.4]]}),
            ch02.plot_copy_cost([1, 2], {"dynamic": [10, 30], "static": [10, 20]}, {"dynamic": [2, 4],
                                                                                    "static": [2, 2]}),
            ch02.plot_copy_cost([1, 2], {"dynamic": [10, 30]}),
            ch02.plot_cost_bars(["a", "b"], [1, 2], "rows")]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    assert [t.get_text() for t in figs[-1].axes[0].texts] == ["1", "2"]
    matplotlib.pyplot.close("all")
    with pytest.raises(ValueError, match="prompt_len=0"):
        ch02.plot_prefill_decode(0, 3)


def _decode_step(q, k, v, k_cache, v_cache):
    k_cache, v_cache = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    weights = torch.softmax(q @ k_cache.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v_cache, k_cache, v_cache


def test_decode_step_accepts_right_and_hints_wrong(capsys):
    assert ch02.check_decode_step(_decode_step)
    assert not ch02.check_decode_step(lambda q, k, v, kc, vc: (q, kc, vc))
    assert "grow by one position" in capsys.readouterr().out
    assert not ch02.check_decode_step(lambda q, k, v, kc, vc: _decode_step(q, v, k, kc, vc))
    assert "K to K" in capsys.readouterr().out

    def unscaled(q, k, v, kc, vc):
        kc, vc = torch.cat([kc, k], 2), torch.cat([vc, v], 2)
        return torch.softmax(q @ kc.transpose(-2, -1), -1) @ vc, kc, vc

    assert not ch02.check_decode_step(unscaled)
    assert "1/√d" in capsys.readouterr().out

    def top_left_causal(q, k, v, kc, vc):  # the is_causal=True slip: one query sees key 0 only
        kc, vc = torch.cat([kc, k], 2), torch.cat([vc, v], 2)
        return torch.nn.functional.scaled_dot_product_attention(q, kc, vc, is_causal=True), kc, vc

    assert not ch02.check_decode_step(top_left_causal)
    assert "is_causal=True" in capsys.readouterr().out
    assert not ch02.check_decode_step(lambda *a: 1 / 0)
    assert "ZeroDivisionError" in capsys.readouterr().out
    assert not ch02.check_decode_step("not a function")


def test_a_step_that_returns_float64_is_told_so(capsys):
    def float64(*args):
        return tuple(t.double() for t in _decode_step(*args))

    assert not ch02.check_decode_step(float64)
    assert "torch.float64" in capsys.readouterr().out


test_any_wrong_answer_gets_a_hint = hint_test([ch02.check_decode_step], WRONG_VALUES + WRONG_FUNCTIONS)


def _chunk_inputs(start, length):
    return torch.arange(start, start + length), causal_mask(length, start + length)


def test_chunk_prefill_accepts_right_and_names_the_classic_bugs(capsys):
    assert ch02.check_chunk_prefill(_chunk_inputs)
    assert "continue after the cache" in capsys.readouterr().out
    bugs = {  # what a learner gets wrong -> words the hint must contain
        lambda s, n: (torch.arange(n), causal_mask(n, s + n)): "restart at 0",
        lambda s, n: (torch.arange(s, s + n), causal_mask(n, n)): "start + length columns",
        lambda s, n: (torch.arange(s, s + n), torch.ones(n, s + n, dtype=torch.bool)): "must not see",
        lambda s, n: (torch.arange(s, s + n), ~causal_mask(n, s + n)): "inverted",
        lambda s, n: (torch.arange(s, s + n).float(), causal_mask(n, s + n)): "integers",
        lambda s, n: (torch.arange(s, s + n), causal_mask(n, s + n).int()): "bool",
        lambda s, n: (torch.arange(s, s + n), causal_mask(n, s + n, None)
                      & ~(torch.arange(n)[:, None] + s == torch.arange(s + n))): "itself",
        lambda s, n: (torch.arange(s + 1, s + n + 1), causal_mask(n, s + n)): "continues the sequence",
        lambda s, n: (torch.arange(s, s + n),
                      causal_mask(n, s + n) & (torch.arange(s + n) >= s)): "every cached",
        # what is_causal=True builds for a (length, start + length) score matrix
        lambda s, n: (torch.arange(s, s + n), torch.ones(n, s + n, dtype=torch.bool).tril()): "top left",
    }
    for wrong, words in bugs.items():
        assert not ch02.check_chunk_prefill(wrong)
        assert words in capsys.readouterr().out


def test_chunk_prefill_agrees_with_the_model_prefilling_in_chunks():
    # What the exercise teaches holds for kvlab's model: chunk by chunk == all at once.
    from kvlab.cache import DynamicKVCache
    from kvlab.config import ModelConfig
    from kvlab.model import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_ff=24,
                                    vocab_size=9, max_seq_len=32)).eval()
    ids = torch.randint(0, 9, (1, 11))
    cache = DynamicKVCache(model.config)
    with torch.inference_mode():
        whole = model(ids)
        chunks = torch.cat([model(ids[:, a:b], cache=cache) for a, b in ((0, 4), (4, 9), (9, 11))], dim=1)
    torch.testing.assert_close(chunks, whole, atol=1e-5, rtol=1e-5)


def test_new_figures_draw():
    figs = [ch02.plot_offset_mask(3, 4), ch02.plot_offset_mask(0, 2),
            ch02.plot_step_time_vs_context([64, 512], {"static": [1e-3, 2e-3], "dynamic": [1e-3, 3e-3]},
                                                [10, 80])]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    assert len(figs[-1].axes[0].lines) == 3
    matplotlib.pyplot.close("all")
    with pytest.raises(ValueError, match="length"):
        ch02.plot_offset_mask(3, 0)


test_any_wrong_chunk_answer_gets_a_hint = hint_test([ch02.check_chunk_prefill],
                                                    WRONG_VALUES + WRONG_FUNCTIONS)
