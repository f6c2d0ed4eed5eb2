"""Chapter 02: the figures draw, and the two checkers (decode step, chunk positions and mask) accept a
right answer, name the usual mistakes, locate a cache bug with kvlab.oracle (the first layer and
position that differ) and give anything else (a value, a function that raises or returns the wrong
thing, a sparse, nested or meta tensor) a hint."""

import math

import matplotlib
import pytest
import torch
from answers import WRONG_FUNCTIONS, WRONG_VALUES, hint_test

from kvlab.attention import causal_mask
from kvlab.course import ch02_kv_cache as ch02
from kvlab.pretrained import load

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


def test_the_speedup_axis_labels_the_values_between_powers_of_ten():
    fig = ch02.plot_speedup_vs_tokens([16, 128], {"cache": [[1.6, 1.7], [3.2, 3.4]]}, [11.6, 69.5])
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert {"1", "2", "3", "5", "10", "20", "50"} <= set(labels) and "1000" not in labels
    matplotlib.pyplot.close(fig)


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
    assert "1/√D" in capsys.readouterr().out

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


@pytest.mark.parametrize("unusual", [lambda t: t.to_sparse(), lambda t: t.to("meta"),
                                     lambda t: torch.nested.nested_tensor([t])],
                         ids=["sparse", "meta", "nested"])
def test_a_step_that_returns_sparse_meta_or_nested_tensors_gets_a_hint(unusual, capsys):
    def step(*args):
        out, k_cache, v_cache = _decode_step(*args)
        return unusual(out), k_cache, v_cache

    assert not ch02.check_decode_step(step)  # a hint, not a traceback
    assert "ordinary dense tensors" in capsys.readouterr().out


def _one_slot_early(q, k, v, k_cache, v_cache):
    """The write-index slip: the new K, V land before the newest cached row instead of after it."""
    out, right_k, right_v = _decode_step(q, k, v, k_cache, v_cache)
    if not k_cache.shape[2]:
        return out, right_k, right_v
    k_cache = torch.cat([k_cache[:, :, :-1], k, k_cache[:, :, -1:]], dim=2)
    v_cache = torch.cat([v_cache[:, :, :-1], v, v_cache[:, :, -1:]], dim=2)
    return out, k_cache, v_cache


@pytest.mark.parametrize("step, where", [
    # the 12-token prefill is kvlab's; the learner's step writes position 12 onwards
    (lambda q, k, v, kc, vc: _decode_step(q, v, k, kc, vc), "keys of layer 0 at position 12"),
    (lambda q, k, v, kc, vc: (_decode_step(q, k, v, kc, vc)[0], torch.cat([k, kc], 2),
                              torch.cat([v, vc], 2)), "keys of layer 0 at position 0"),
    (_one_slot_early, "keys of layer 0 at position 11"),
], ids=["k-v-swapped", "prepended", "one-slot-early"])
def test_the_oracle_locates_a_decode_step_cache_bug(step, where, capsys):
    assert not ch02.check_decode_step(step)
    out = capsys.readouterr().out
    assert "kvlab.oracle ran kvlab-tiny" in out and where in out


def test_a_right_decode_step_passes_the_oracle_too(capsys):
    assert ch02.check_decode_step(_decode_step)
    assert "kvlab.oracle finds kvlab-tiny" in capsys.readouterr().out
    cache = ch02.DecodeStepCache(load("kvlab-tiny").config, _decode_step)
    assert ch02.oracle_finding(cache, ch02.DECODE_ORACLE_FEEDS) == ""
    assert cache.seq_len == sum(ch02.DECODE_ORACLE_FEEDS)  # the learner's step grew it, one a step


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


@pytest.mark.parametrize("chunk_inputs, where", [
    (lambda s, n: (torch.arange(n), causal_mask(n, s + n)), "keys of layer 0 at position 4"),
    (lambda s, n: (torch.arange(s, s + n), torch.ones(n, s + n, dtype=torch.bool)),
     "keys of layer 1 at position 0"),
    (lambda s, n: (torch.arange(s, s + n), torch.ones(n, s + n, dtype=torch.bool).tril()),
     "keys of layer 1 at position 4"),
], ids=["restart-at-0", "no-mask", "top-left"])
def test_the_oracle_locates_a_chunk_bug(chunk_inputs, where, capsys):
    # kvlab-tiny prefilled in chunks of 4, 3, 1 and 6: RoPE bugs show in layer 0's keys at the second
    # chunk's first position; mask bugs in layer 1's keys, made from layer 0's wrong outputs.
    assert not ch02.check_chunk_prefill(chunk_inputs)
    out = capsys.readouterr().out
    assert "kvlab.oracle prefilled kvlab-tiny" in out and where in out


def test_a_right_chunk_answer_passes_the_oracle_too(capsys):
    assert ch02.check_chunk_prefill(_chunk_inputs)
    assert "kvlab.oracle finds" in capsys.readouterr().out
    cache = ch02.ChunkCache(load("kvlab-tiny").config, _chunk_inputs)
    assert ch02.oracle_finding(cache, ch02.CHUNK_ORACLE_FEEDS) == ""


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
