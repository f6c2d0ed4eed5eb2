"""The training script: its first steps are reproducible, dropout acts only in training, and the
corpus generator is deterministic and computes its figures right."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from kvlab import pretrained, train
from kvlab.model import Transformer

ROOT = Path(__file__).resolve().parent.parent
TEXT = pretrained.corpus_text("train")[:6000]
VALIDATION = pretrained.corpus_text("validation")[:1500]


def short_run(seed: int = 0) -> dict:
    return train.train("kvlab-tiny-gqa", steps=5, seed=seed, batch_size=2, context=64, eval_every=5,
                       train_text=TEXT, validation_text=VALIDATION, save_files=False)


def test_first_steps_are_deterministic_and_depend_on_the_seed():
    first, again, other = short_run(0), short_run(0), short_run(1)
    weights = [dict(r["model"].state_dict()) for r in (first, again, other)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert first["losses"] == again["losses"] and first["validation_curve"] == again["validation_curve"]
    assert first["samples"] == again["samples"]
    assert any(not torch.equal(weights[0][k], weights[2][k]) for k in weights[0])
    # Five steps of learning already beat the untrained model on the validation text.
    untrained = pretrained.loss(Transformer(train.CONFIGS["kvlab-tiny-gqa"]).eval(), VALIDATION, 64)
    assert first["losses"]["validation"]["loss"] < untrained
    assert first["steps_run"] == 5 and first["best_step"] == 5


def test_dropout_hooks_act_in_training_only_and_come_off():
    torch.manual_seed(0)
    model = Transformer(train.CONFIGS["kvlab-tiny"])
    ids = torch.randint(0, 256, (1, 16))
    plain = model.eval()(ids)
    hooks = train.add_dropout(model, 0.5)
    assert torch.equal(model.eval()(ids), plain)
    assert not torch.equal(model.train()(ids), model.train()(ids))
    for h in hooks:
        h.remove()
    assert torch.equal(model.train()(ids), plain)


def test_the_two_configs_share_a_budget_and_differ_in_kv_heads():
    mha, gqa = (Transformer(train.CONFIGS[n]).num_params() for n in ("kvlab-tiny", "kvlab-tiny-gqa"))
    assert abs(mha - gqa) <= 1e-3 * mha
    assert train.CONFIGS["kvlab-tiny-gqa"].n_kv_heads * 2 == train.CONFIGS["kvlab-tiny"].n_kv_heads


def test_cosine_schedule_warms_up_then_decays_to_a_tenth():
    lrs = [train.cosine_lr(s, 100, 1.0, warmup=10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "kvlab-big"}, "name='kvlab-big'"), ({"steps": 0}, "steps=0"),
    ({"context": 4096}, "context=4096"), ({"dropout": 1.5}, "dropout=1.5"),
    ({"train_text": "too short"}, "the training text has 9 bytes"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        train.train(**{"save_files": False, **kwargs})


def _make_corpus():
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "tools" / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_generator_is_seeded():
    make = _make_corpus()
    assert make.generate(0) == make.generate(0)
    assert make.generate(0) != make.generate(1)


def test_generated_per_token_figures_are_right():
    """Every 'Per token: 2 × L layers × H KV heads × D × b bytes = N bytes' line of the stored
    generated corpus multiplies out."""
    lines = 0
    pattern = re.compile(r"2 × (\d+) (?:layers|层) × (\d+) (?:KV heads?|个键值头) × (\d+) × (\d) "
                         r"(?:bytes?|字节) = ([\d,]+)")
    for path in (pretrained.CORPUS_DIR / "generated").glob("*.txt"):
        for m in pattern.finditer(path.read_text(encoding="utf-8")):
            layers, heads, dim, nbytes, total = m.groups()
            assert 2 * int(layers) * int(heads) * int(dim) * int(nbytes) == int(total.replace(",", "")), m[0]
            lines += 1
    assert lines >= 100
