"""kvlab.gqa.uptrain: continued training of a copy, deterministic, seeded windows, validated input."""

import pytest
import torch

from kvlab import PRESETS, gqa
from kvlab.model import Transformer

TEXT = "The cache holds the keys and values of every token seen so far. " * 12


def _model():
    torch.manual_seed(0)
    return Transformer(PRESETS["tiny-mha"].with_(max_seq_len=64)).eval()


def test_uptrain_trains_a_copy_and_leaves_the_input_alone():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trained = gqa.uptrain(model, 3, TEXT, lr=1e-2, batch_size=2, context=32)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not trained.training and trained.config == model.config
    assert any(not torch.equal(v, trained.state_dict()[k]) for k, v in before.items())


def test_uptrain_is_deterministic_and_zero_steps_is_a_copy():
    model = _model()
    a = gqa.uptrain(model, 2, TEXT, batch_size=2, context=32, seed=3)
    b = gqa.uptrain(model, 2, TEXT, batch_size=2, context=32, seed=3)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    same = gqa.uptrain(model, 0, TEXT, batch_size=2, context=32)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in same.state_dict().items())


def test_uptrain_lowers_the_training_loss_of_a_pooled_model():
    pooled = gqa.mha_to_gqa(_model(), 1)
    ids = torch.tensor([list(TEXT.encode()[:33])])
    loss = lambda m: torch.nn.functional.cross_entropy(m(ids[:, :-1])[0], ids[0, 1:]).item()  # noqa: E731
    assert loss(gqa.uptrain(pooled, 20, TEXT, lr=3e-3, batch_size=4, context=32)) < loss(pooled)


def test_uptrain_refuses_bad_input():
    model = _model()
    with pytest.raises(ValueError, match="steps"):
        gqa.uptrain(model, -1, TEXT)
    with pytest.raises(ValueError, match="context=32 needs at least 34"):
        gqa.uptrain(model, 1, "too short", context=32)
