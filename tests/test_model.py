import pytest
import torch

from kvlab import PRESETS
from kvlab.cache import CACHE_KINDS, make_cache
from kvlab.memory import param_count
from kvlab.model import Transformer


@pytest.fixture
def model():
    return Transformer(PRESETS["tiny-gqa"]).eval()


def test_logits_shape_and_parameter_count(model):
    ids = torch.randint(0, 256, (3, 10))
    assert model(ids).shape == (3, 10, 256)
    assert model.num_params() == param_count(model.config)


def test_tied_embeddings_share_one_matrix():
    m = Transformer(PRESETS["tiny-mha"].with_(tie_embeddings=True))
    assert m.lm_head.weight is m.embed.weight
    assert m.num_params() == param_count(m.config)


@pytest.mark.parametrize("tied", [False, True])
def test_weights_stored_input_major_keep_their_shapes_values_and_logits(tied):
    m = Transformer(PRESETS["tiny-gqa"].with_(tie_embeddings=tied)).eval()
    ids = torch.randint(0, 256, (2, 9))
    before = {name: p.clone() for name, p in m.named_parameters()}
    with torch.no_grad():
        expected = m(ids)
        m.store_weights_input_major()
        assert torch.equal(m(ids), expected)
    for name, p in m.named_parameters():
        assert torch.equal(p, before[name]), name
        if p.dim() == 2:  # stored as (in, out) rows: the transpose is the contiguous one
            assert p.t().is_contiguous() and not p.is_contiguous(), name
    assert (m.lm_head.weight is m.embed.weight) == tied


def test_rope_tables_are_not_weights(model):
    assert not any("rope" in k for k in model.state_dict())


def test_batch_rows_are_independent(model):
    ids = torch.randint(0, 256, (2, 12))
    both = model(ids)
    torch.testing.assert_close(both[1:], model(ids[1:]))


def test_future_tokens_do_not_change_earlier_logits(model):
    ids = torch.randint(0, 256, (1, 12))
    torch.testing.assert_close(model(ids)[:, :7], model(ids[:, :7]))


@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_prefill_then_decode_equals_one_full_pass(model, kind):
    ids = torch.randint(0, 256, (2, 15))
    full = model(ids)
    cache = make_cache(kind, model.config, 2, 32)
    parts = [model(ids[:, :9], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(9, 15)]
    tolerance = {"int8": 0.05, "int4": 0.2}.get(kind, 1e-5)  # quantized K, V: close, not equal
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=tolerance, atol=tolerance)
    assert cache.seq_len == 15


def test_left_padding_with_mask_equals_unpadded(model):
    ids = torch.randint(1, 256, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    out = model(padded, attention_mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 3:], model(ids), rtol=1e-5, atol=1e-5)


def test_too_long_input_and_bad_mask_are_refused(model):
    with pytest.raises(ValueError, match="sequence of 513 tokens exceeds max_seq_len=512"):
        model(torch.zeros(1, 513, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 4\); expected"):
        model(torch.zeros(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 4))
