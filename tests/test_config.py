import pytest

import kvlab
from kvlab.config import PUBLISHED, ModelConfig, divisors

BASE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256, max_seq_len=64)


def test_head_dim_defaults_to_d_model_over_heads():
    assert ModelConfig(**BASE).head_dim == 16
    assert ModelConfig(**{**BASE, "head_dim": 32}).head_dim == 32


def test_kinds_of_attention():
    assert ModelConfig(**{**BASE, "n_kv_heads": 4}).attention_kind == "MHA"
    assert ModelConfig(**BASE).attention_kind == "GQA"
    assert ModelConfig(**{**BASE, "n_kv_heads": 1}).attention_kind == "MQA"
    assert kvlab.PRESETS["deepseek-v2"].attention_kind == "MLA"
    assert ModelConfig(**BASE).n_rep == 2


@pytest.mark.parametrize("changes, message", [
    ({"n_heads": 12, "n_kv_heads": 5, "d_model": 96},
     "n_heads=12 is not divisible by n_kv_heads=5; allowed n_kv_heads: [1, 2, 3, 4, 6, 12]"),
    ({"head_dim": 15}, "head_dim=15 is odd; RoPE"),
    ({"n_layers": 0}, "n_layers=0 must be an integer >= 1"),
    ({"d_model": -64}, "d_model=-64 must be an integer >= 1"),
    ({"vocab_size": 2.5}, "vocab_size=2.5 must be an integer >= 1"),
    ({"d_model": 66}, "d_model=66 is not divisible by n_heads=4"),
    ({"rope_theta": 0.0}, "rope_theta=0.0 must be a number > 0"),
    ({"norm_eps": -1e-5}, "norm_eps=-1e-05 must be a number > 0"),
])
def test_bad_configs_name_the_value(changes, message):
    with pytest.raises(ValueError) as err:
        ModelConfig(**{**BASE, **changes})
    assert message in str(err.value)


def test_with_revalidates():
    cfg = ModelConfig(**BASE)
    assert cfg.with_(n_kv_heads=1).n_kv_heads == 1
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        cfg.with_(n_kv_heads=3)


def test_divisors():
    assert divisors(64) == [1, 2, 4, 8, 16, 32, 64]


# (L, H, H_kv, D) from REFERENCE.md's table of published shapes.
SHAPES = {
    "llama-7b": (32, 32, 32, 128), "llama-13b": (40, 40, 40, 128), "llama-65b": (80, 64, 64, 128),
    "llama-2-7b": (32, 32, 32, 128), "llama-2-13b": (40, 40, 40, 128),
    "llama-2-70b": (80, 64, 8, 128), "llama-3-8b": (32, 32, 8, 128), "llama-3-70b": (80, 64, 8, 128),
    "llama-3.1-405b": (126, 128, 8, 128), "mistral-7b": (32, 32, 8, 128),
    "qwen2.5-7b": (28, 28, 4, 128), "qwen2.5-72b": (80, 64, 8, 128), "gpt2": (12, 12, 12, 64),
    "tinyllama-1.1b": (22, 32, 4, 64), "smollm2-135m": (30, 9, 3, 64),
    "deepseek-v2": (60, 128, 128, 128),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_presets_match_reference_shapes(name):
    c = kvlab.PRESETS[name]
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == SHAPES[name]
    assert c.source.startswith("http")
    assert c.name == name == name.lower()


def test_every_published_model_is_listed():
    assert set(PUBLISHED) == set(SHAPES)
    teaching = set(kvlab.PRESETS) - set(PUBLISHED)
    assert teaching and all(kvlab.PRESETS[n].d_model <= 256 for n in teaching)
