"""Chapters 01–02 helpers: the diagrams draw, the checkers accept right answers and reject wrong
ones with a hint."""

import math

import matplotlib
import pytest
import torch

from kvlab import check, plots
from kvlab.config import ModelConfig
from kvlab.generate import generate
from kvlab.model import Transformer

matplotlib.use("Agg")


@pytest.mark.parametrize("cached", [False, True])
def test_generation_loop_counts_rows(cached):
    fig = plots.generation_loop(("a", "b", "c", "d", "e"), prompt_len=2, cached=cached)
    texts = [t.get_text() for t in fig.axes[0].texts]
    # naive: 2 + 3 + 4 rows; cached: prefill 2, then 1 + 1
    assert f"total: {4 if cached else 9}" in texts


def test_generation_loop_rejects_bad_prompt_len():
    with pytest.raises(ValueError, match="prompt_len=5"):
        plots.generation_loop(("a", "b"), prompt_len=5)


def test_chapter_figures_draw():
    figs = [plots.prefill_decode(4, 3), plots.prefill_decode(30, 20),
            plots.cost_per_step([1, 2, 3], {"rows": [1, 2, 3]}, {"theory": [1, 2, 3]}, "rows"),
            plots.growth_fit([8, 16, 32], {"rows": [36, 136, 528]}, {"rows": (2.0, -0.5)}),
            plots.step_times([0.1, 0.2], [0.1, 0.1]),
            plots.speedup_vs_tokens([8, 16], [2.0, 4.0], [4.5, 8.5]),
            plots.copy_cost([1, 2], {"dynamic": [10, 30], "static": [10, 20]}, {"dynamic": [2, 4],
                                                                               "static": [2, 2]}),
            plots.cost_bars(["a", "b"], [1, 2], "rows")]
    assert all(isinstance(f, matplotlib.figure.Figure) for f in figs)


def test_kv_work_matches_generate_and_hints(capsys):
    p, n = 7, 5
    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, n_kv_heads=2, d_ff=8, vocab_size=5,
                      max_seq_len=32)
    model = Transformer(cfg).eval()
    naive = generate(model, [1] * p, n, cache=None).kv_rows
    cached = generate(model, [1] * p, n, cache="dynamic").kv_rows
    assert naive == sum(p + i for i in range(n)) and cached == p + n - 1
    assert check.kv_work((naive, cached), prompt_len=p, new_tokens=n)
    assert not check.kv_work(None, prompt_len=p, new_tokens=n)
    assert not check.kv_work((n * (n + 1) // 2, cached), prompt_len=p, new_tokens=n)
    assert "prompt" in capsys.readouterr().out.splitlines()[-1]
    assert not check.kv_work((naive, p + n), prompt_len=p, new_tokens=n)
    assert "never fed back" in capsys.readouterr().out
    assert not check.kv_work((f"{naive:,}", cached))  # the default exercise has other numbers


def _decode_step(q, k, v, k_cache, v_cache):
    k_cache, v_cache = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    weights = torch.softmax(q @ k_cache.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v_cache, k_cache, v_cache


def test_decode_step_accepts_right_and_hints_wrong(capsys):
    assert check.decode_step(_decode_step)
    assert not check.decode_step(lambda q, k, v, kc, vc: (q, kc, vc))
    assert "grow by one position" in capsys.readouterr().out
    assert not check.decode_step(lambda q, k, v, kc, vc: _decode_step(q, v, k, kc, vc))
    assert "K to K" in capsys.readouterr().out

    def unscaled(q, k, v, kc, vc):
        kc, vc = torch.cat([kc, k], 2), torch.cat([vc, v], 2)
        return torch.softmax(q @ kc.transpose(-2, -1), -1) @ vc, kc, vc

    assert not check.decode_step(unscaled)
    assert "1/√d" in capsys.readouterr().out
    assert not check.decode_step(lambda *a: 1 / 0)
    assert "ZeroDivisionError" in capsys.readouterr().out
    assert not check.decode_step("not a function")
