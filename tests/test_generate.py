import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab import PRESETS, ModelConfig
from kvlab.cache import DynamicKVCache, StaticKVCache
from kvlab.generate import decode_bytes, encode_bytes, generate
from kvlab.model import Transformer


def sharp_model(config: ModelConfig, seed: int) -> Transformer:
    """A random model with weights large enough that greedy choices are not near-ties."""
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    return model


configs = st.builds(
    lambda layers, kv_heads, rep, head_dim: ModelConfig(
        n_layers=layers, d_model=kv_heads * rep * head_dim, n_heads=kv_heads * rep,
        n_kv_heads=kv_heads, d_ff=48, vocab_size=50, max_seq_len=64),
    layers=st.integers(1, 3), kv_heads=st.integers(1, 3), rep=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, prompt_len=st.integers(1, 12), batch=st.integers(1, 3),
       kind=st.sampled_from(["dynamic", "static"]), seed=st.integers(0, 10_000))
def test_cached_decoding_equals_naive_decoding(config, prompt_len, batch, kind, seed):
    model = sharp_model(config, seed)
    ids = torch.randint(0, config.vocab_size, (batch, prompt_len))
    naive = generate(model, ids, 10, cache=None)
    cached = generate(model, ids, 10, cache=kind)
    assert torch.equal(naive.tokens, cached.tokens)
    # And the logits behind them: the cached step logits equal a full pass over the same tokens.
    cache = DynamicKVCache(config) if kind == "dynamic" else StaticKVCache(config, batch, 64)
    seq = naive.tokens
    with torch.no_grad():
        steps = [model(seq[:, :prompt_len], cache=cache)]
        steps += [model(seq[:, i:i + 1], cache=cache) for i in range(prompt_len, seq.shape[1])]
        torch.testing.assert_close(torch.cat(steps, dim=1), model(seq), rtol=1e-4, atol=1e-4)


def test_work_counts_naive_quadratic_cached_linear():
    model = Transformer(PRESETS["tiny-mha"]).eval()
    prompt, n = 5, 20
    naive = generate(model, torch.zeros(1, prompt, dtype=torch.long), n, cache=None)
    cached = generate(model, torch.zeros(1, prompt, dtype=torch.long), n, cache="static")
    assert naive.kv_rows == sum(range(prompt, prompt + n))
    assert cached.kv_rows == prompt + n - 1
    assert [s.fed_tokens for s in cached.steps] == [prompt] + [1] * (n - 1)
    assert naive.tokens.shape == (1, prompt + n) and naive.new_tokens.shape == (1, n)


def test_flops_are_counted_per_step():
    model = Transformer(PRESETS["tiny-mha"]).eval()
    out = generate(model, torch.zeros(1, 4, dtype=torch.long), 6, cache=None, count_flops=True)
    flops = [s.flops for s in out.steps]
    assert all(f > 0 for f in flops) and flops == sorted(flops) and out.flops == sum(flops)
    assert generate(model, [1, 2], 3).flops is None


def test_sampling_is_seeded_and_top_k_restricts_choices():
    model = sharp_model(PRESETS["tiny-mha"], 0)
    a = generate(model, [1, 2, 3], 20, temperature=1.0, seed=7)
    b = generate(model, [1, 2, 3], 20, temperature=1.0, seed=7)
    assert torch.equal(a.tokens, b.tokens)
    greedy = generate(model, [1, 2, 3], 20)
    top1 = generate(model, [1, 2, 3], 20, temperature=1.0, top_k=1, seed=3)
    assert torch.equal(top1.tokens, greedy.tokens)


def test_stops_at_eos_and_pads_finished_rows_with_it():
    model = sharp_model(PRESETS["tiny-mha"], 1)
    free = generate(model, [[5, 6], [7, 8]], 12)
    eos = int(free.new_tokens[0, 2])
    out = generate(model, [[5, 6], [7, 8]], 12, eos_token_id=eos)
    row0 = out.new_tokens[0].tolist()
    assert row0[: row0.index(eos) + 1] == free.new_tokens[0, : row0.index(eos) + 1].tolist()
    assert all(t == eos for t in row0[row0.index(eos):])
    single = generate(model, [5, 6], 12, eos_token_id=eos)
    assert single.new_tokens[0, -1] == eos and single.new_tokens.shape[1] <= 3


def test_on_token_sees_every_step():
    model = Transformer(PRESETS["tiny-mha"]).eval()
    seen = []
    out = generate(model, [1], 5, on_token=lambda step, ids: seen.append((step, ids.tolist())))
    assert [s for s, _ in seen] == list(range(5))
    assert [ids[0] for _, ids in seen] == out.new_tokens[0].tolist()


def test_a_cache_object_can_be_passed_in():
    model = Transformer(PRESETS["tiny-gqa"]).eval()
    cache = StaticKVCache(model.config, 1, 16)
    out = generate(model, [1, 2, 3], 5, cache=cache)
    assert cache.seq_len == 3 + 5 - 1  # the last token is chosen but not yet fed back
    assert torch.equal(out.tokens, generate(model, [1, 2, 3], 5, cache=None).tokens)


def test_bytes_round_trip():
    text = "KV cache 今天天气真好"
    assert decode_bytes(encode_bytes(text)) == text
    assert len(encode_bytes("今天天气真好")) == 18


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens=0 must be an integer >= 1"),
    (dict(max_new_tokens=5, temperature=-1.0), "temperature=-1.0 must be a number >= 0"),
    (dict(max_new_tokens=5, top_k=0), "top_k=0 must be an integer >= 1"),
    (dict(max_new_tokens=5, cache="huge"), "cache='huge' is not a known cache kind"),
    (dict(max_new_tokens=5, cache=42), "cache=42 is not a cache"),
    (dict(max_new_tokens=600), "= 603 tokens exceeds the model's max_seq_len=512"),
])
def test_bad_arguments_are_refused_clearly(kwargs, message):
    model = Transformer(PRESETS["tiny-mha"]).eval()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        generate(model, [1, 2, 3], **kwargs)


def test_bad_token_ids_and_empty_prompts_are_refused():
    model = Transformer(PRESETS["tiny-mha"]).eval()
    with pytest.raises(ValueError, match="token ids must lie in 0..255; got min 0, max 300"):
        generate(model, [0, 300], 2)
    with pytest.raises(ValueError, match="an empty prompt"):
        generate(model, [], 2)


def test_a_static_cache_object_holds_the_same_keys_and_values_as_a_dynamic_one():
    # generate decodes a static cache through the fixed-shape step of kvlab.fast, writing into the
    # cache's own buffers; what it leaves there is what the model's own forward would have stored.
    model = sharp_model(PRESETS["tiny-gqa"], 2)
    static, dynamic = StaticKVCache(model.config, 2, 40), DynamicKVCache(model.config)
    ids = torch.randint(0, 256, (2, 6))
    a = generate(model, ids, 9, cache=static)
    b = generate(model, ids, 9, cache=dynamic)
    assert torch.equal(a.tokens, b.tokens)
    assert static.seq_len == dynamic.seq_len == 6 + 9 - 1
    for layer in range(model.config.n_layers):
        torch.testing.assert_close(static.k[layer, :, :, :14], dynamic.keys[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(static.v[layer, :, :, :14], dynamic.values[layer], rtol=1e-5, atol=1e-5)
    assert static.bytes_copied == 2 * static.k[:, :, :, :14].nbytes


def test_every_path_of_generate_gives_the_same_greedy_tokens():
    model = sharp_model(PRESETS["tiny-gqa"], 3)
    ids = torch.randint(0, 256, (2, 5))
    ones = torch.ones_like(ids)
    reference = generate(model, ids, 12, cache=None).tokens
    runs = {
        "static (fixed-shape step)": generate(model, ids, 12, cache="static"),
        "static, padding mask (model forward)": generate(model, ids, 12, cache="static", attention_mask=ones),
        "static, FLOPs counted (model forward)": generate(model, ids, 12, cache="static", count_flops=True),
        "dynamic": generate(model, ids, 12, cache="dynamic"),
        "a longer static cache": generate(model, ids, 12, cache=StaticKVCache(model.config, 2, 100)),
    }
    for name, run in runs.items():
        assert torch.equal(run.tokens, reference), name


def test_naive_decoding_feeds_everything_and_calls_on_token_each_step():
    model = sharp_model(PRESETS["tiny-mha"], 4)
    seen = []
    out = generate(model, [3, 1, 4], 6, cache=None, on_token=lambda step, ids: seen.append(int(ids[0])))
    assert [s.fed_tokens for s in out.steps] == [3, 4, 5, 6, 7, 8]
    assert seen == out.new_tokens[0].tolist()


def test_gpu_step_timing_waits_for_the_gpu_once_after_the_loop_not_at_every_step(monkeypatch):
    """On CUDA each step is bracketed by events; the CPU waits once, when the times are read."""
    from kvlab.generate import Step, _StepTimer

    clock, waits = iter(range(100)), []

    class Event:  # a CUDA event that records a tick of a fake GPU clock
        def __init__(self, enable_timing=False):
            assert enable_timing
        def record(self):
            self.at = next(clock)
        def synchronize(self):
            waits.append("event")
        def elapsed_time(self, end):  # milliseconds
            return (end.at - self.at) * 1000.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.append("device"))
    timer = _StepTimer(torch.device("cuda"))
    steps = []
    for _ in range(5):
        started = timer.start()
        steps.append(Step(fed_tokens=1, kv_rows=1, seconds=timer.stop(started), flops=None))
    assert waits == [] and all(step.seconds is None for step in steps)  # no wait inside the loop
    timer.fill(steps)
    assert waits == ["event"] and [step.seconds for step in steps] == [1.0] * 5
