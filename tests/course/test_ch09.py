"""Chapter 09: the measurements, the drawing functions behind the two explorers, the explorers
themselves and the two checkers."""

import html

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from answers import WRONG_VALUES, hint_test, verdict_test  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvlab import PRESETS, eviction, oracle, prefix, pretrained  # noqa: E402
from kvlab.cache import PrefixKVStore, SlidingWindowKVCache  # noqa: E402
from kvlab.course import ch09_reuse_and_evict as ch09  # noqa: E402
from kvlab.generate import encode_bytes, generate  # noqa: E402
from kvlab.memory import GiB, format_bytes, kv_bytes_per_token, kv_cache_bytes  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def small():
    """A real but small measurement: 2 streams of 80 held-out bytes, budgets 16 and 32."""
    return ch09.budget_measurements(stream_len=80, budgets=(16, 32), streams=2)


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from walk(child)


def shown(readout) -> str:
    return html.unescape(readout.value.split(">", 1)[1].rsplit("</pre>", 1)[0])


# --- measurements -------------------------------------------------------------------------------

def test_held_out_streams_are_consecutive_pieces_of_the_held_out_text():
    ids = ch09.held_out_streams(50, 3)
    text = pretrained.corpus_text("held_out").encode("utf-8")
    assert ids.shape == (3, 50)
    assert bytes(ids.flatten().tolist()) == text[:150]
    with pytest.raises(ValueError, match="longer than the held-out text"):
        ch09.held_out_streams(10**8)


def test_budget_measurements_agree_with_kvlab_window(small):
    model = pretrained.load("kvlab-tiny")
    ids = ch09.held_out_streams(80, 2)
    assert small["budgets"] == [16, 32] and small["streams"] == 2 and small["stream_len"] == 80
    assert small["bytes_per_token"] == kv_bytes_per_token(model.config, "fp32")
    full = eviction.token_losses(model, ids).mean().item()
    assert small["losses"]["full"] == pytest.approx([full, full], rel=1e-5)
    cache = eviction.bounded_cache("sinks + window", model.config, 2, 32, sinks=ch09.SINKS,
                                   positions=ch09.POSITIONS)
    losses = eviction.token_losses(model, ids, cache)
    assert small["losses"]["sinks + window"][1] == pytest.approx(losses.mean().item(), rel=1e-5)
    assert small["curves"]["window"][0].shape == (79,)
    assert small["per_stream"]["window"][0].shape == (2, 79)
    full_losses = eviction.token_losses(model, ids)
    per_stream = (losses - full_losses).mean(1)
    assert small["se"]["sinks + window"][1] == pytest.approx(per_stream.std().item() / 2 ** 0.5, rel=1e-4)
    assert small["se"]["full"] == [0.0, 0.0]


def test_budget_readout_and_curve(small):
    fig, text = ch09.plot_budget("heavy hitters", 16, small)
    assert isinstance(fig, Figure)
    first, second, third = text.split("\n")
    assert first.startswith("heavy hitters: 16 of 80 positions kept per sequence")
    assert f"kvlab-tiny {format_bytes(16 * small['bytes_per_token'])} (fp32)" in second
    assert f"Llama-3-8B would hold {format_bytes(16 * kv_bytes_per_token(PRESETS['llama-3-8b']))}" in second
    assert third.startswith(f"held-out loss {small['losses']['heavy hitters'][0]:.3f} nats/byte; "
                            f"full cache {small['losses']['full'][0]:.3f}")
    assert f"± {small['se']['heavy hitters'][0]:.3f}, paired standard error over 2 streams" in third
    ax = fig.axes[0]
    current = [ln for ln in ax.get_lines() if ln.get_label() == "current setting"][0]
    assert current.get_xdata()[0] == 16
    assert current.get_ydata()[0] == pytest.approx(small["losses"]["heavy hitters"][0])
    full_text = ch09.plot_budget("full", 32, small)[1]
    assert full_text.startswith("full: 80 of 80 positions") and "(+0.000 ± 0.000," in full_text


@pytest.mark.parametrize("kwargs, message", [({"policy": "lru"}, "policy='lru'"),
                                             ({"budget": 48}, "budget=48")])
def test_budget_readout_refuses_unknown_settings(small, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ch09.plot_budget(**{"policy": "window", "budget": 16, **kwargs}, measurements=small)


def test_cache_budget_explorer_redraws_on_a_control_change(small, monkeypatch):
    monkeypatch.setattr(ch09, "budget_measurements", lambda: small)
    box = ch09.cache_budget_explorer()
    assert "kvlab-cache-budget-explorer" in box._dom_classes
    controls = {w.description: w for w in walk(box) if getattr(w, "description", "")}
    assert set(controls) == {"policy", "budget"}
    readout = [w for w in walk(box) if "kvlab-readout" in w._dom_classes][0]
    controls["budget"].value = 16
    assert shown(readout) == ch09.plot_budget("sinks + window", 16, small)[1]
    controls["policy"].value = "heavy hitters"
    assert shown(readout) == ch09.plot_budget("heavy hitters", 16, small)[1]


# --- prefix sharing -------------------------------------------------------------------------------

def test_sharing_readout_agrees_with_kvlab_prefix():
    fig, text = ch09.plot_sharing(users=8, prefix_len=1000, suffix_len=64)
    s = prefix.sharing(8, 1000, 64, 16, PRESETS["llama-3-8b"])
    blocks, memory, work = text.split("\n")
    assert blocks == f"blocks: {s.blocks_alone:,} without sharing, {s.blocks_shared:,} with " \
                     f"({s.saved_fraction:.0%} fewer)"
    assert f"{format_bytes(s.bytes_alone)} → {format_bytes(s.bytes_shared)}" in memory
    saved = s.prefill_tokens_alone - s.prefill_tokens_shared
    assert work.startswith(f"prefill: {saved:,} of {s.prefill_tokens_alone:,} prompt tokens not recomputed")
    heights = [round(p.get_height()) for p in fig.axes[0].patches]
    assert heights == [s.blocks_alone, s.blocks_shared]


def test_one_user_or_no_prefix_shares_nothing():
    for users, prefix_len in ((1, 1024), (16, 0)):
        text = ch09.plot_sharing(users, prefix_len, 64)[1]
        assert "(0% fewer)" in text and "prefill: 0 of" in text


def test_prefix_sharing_explorer_redraws_on_a_control_change():
    box = ch09.prefix_sharing_explorer()
    controls = {w.description: w for w in walk(box) if getattr(w, "description", "")}
    assert set(controls) == {"users", "shared prefix", "own suffix"}
    readout = [w for w in walk(box) if "kvlab-readout" in w._dom_classes][0]
    assert shown(readout) == ch09.plot_sharing()[1]
    controls["users"].value = 128
    controls["shared prefix"].value = 4096
    assert shown(readout) == ch09.plot_sharing(128, 4096, 64)[1]


# --- the other figures ----------------------------------------------------------------------------

def test_figures_draw_what_they_are_given():
    maps = [torch.full((1, 2, 8, 8), 1 / 8).tril() for _ in range(2)]
    fig = ch09.plot_first_positions_attention(maps, first=4, skip=4)
    assert len([ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("layer")]) == 2
    fig = ch09.plot_loss_along_stream({"window (8 positions)": [1.0] * 40}, window=8, trained=30)
    assert fig.axes[0].get_lines()[0].get_ydata()[0] == pytest.approx(1.0)
    fig = ch09.plot_hit_rate([1, 2], {"a": [0.1, 0.5]}, best=0.9)
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [10, 50]
    fig = ch09.plot_offload([1, 2], {"x": [1e-3, 2e-3]}, "t")
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [1, 2]


# --- the real model's measurements (run here on kvlab-tiny: the same code, any model) ---------------

def test_sink_mass_is_the_attention_on_token_0_per_layer_and_head():
    maps = [torch.full((1, 2, 8, 8), 1 / 8).tril() for _ in range(3)]
    maps[1][0, 1, :, 0] = 0.5
    mass = ch09.sink_mass(maps, skip=4)
    assert mass.shape == (3, 2)
    assert mass[1, 1] == pytest.approx(0.5) and mass[0, 0] == pytest.approx(1 / 8)
    fig = ch09.plot_sink_heatmap(mass, 0.1)
    assert fig.axes[0].images[0].get_array().shape == (3, 2)
    with pytest.raises(ValueError, match="skip=8"):
        ch09.sink_mass(maps, skip=8)


def test_streaming_measurements_pair_every_policy_with_the_full_cache():
    model = pretrained.load("kvlab-tiny")
    ids = ch09.held_out_streams(41, 2)
    r = ch09.streaming_measurements(model, ids, budget=8, block=8)
    assert set(r["rows"]) == set(eviction.POLICIES) and r["start"] == 8
    full = eviction.token_losses(model, ids)
    assert r["per_position"]["full"] == pytest.approx(full, abs=1e-5)
    window = eviction.token_losses(model, ids, eviction.bounded_cache("window", model.config, 2, 8,
                                                                      positions="original"))
    # the measured positions start at the first query that misses an evicted key: index 8 (it sees
    # 9 keys, one more than the budget); the query at index 7 still sees all 8
    assert (window - full)[:, :8].abs().max() < 1e-5 and (window - full)[:, 8].abs().min() > 1e-4
    d = (window - full)[:, 8:8 + 32].reshape(-1, 8).mean(1)
    row = r["rows"]["window"]
    assert row["units"] == 8 and row["minus full"] == pytest.approx(d.mean().item(), abs=1e-5)
    assert row["se"] == pytest.approx(d.std().item() / 8 ** 0.5, rel=1e-3)
    assert row["perplexity"] == pytest.approx(float(torch.exp(window[:, 8:].mean())), rel=1e-5)
    fig = ch09.plot_streaming(r)
    assert [round(p.get_height(), 6) for p in fig.axes[0].patches] == [
        round(r["rows"][p]["minus full"], 6) for p in eviction.POLICIES[1:]]


class ChatML:
    """A stand-in tokenizer: renders messages as ChatML text and 'tokenizes' it into characters."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return [ord(c) for c in text + ("<assistant>" if add_generation_prompt else "")]


def test_chat_prompts_render_the_history_and_chat_hits_count_whole_blocks():
    tok = ChatML()
    prompts = ch09.chat_prompts(tok, "be brief", ["q1", "q2"], ["a1", "a2"])
    text = ["".join(map(chr, p)) for p in prompts]
    assert text == ["<system>be brief</><user>q1</><assistant>",
                    "<system>be brief</><user>q1</><assistant>a1</><user>q2</><assistant>"]
    generated = [[ord(c) for c in "a1</>"], [ord(c) for c in "a2"]]
    hits = ch09.chat_hits(prompts, generated, block_size=4)
    # turn 2 shares turn 1's prompt (41 characters) + the answer's 4 fed tokens (the last of its 5 is
    # sampled, never fed: no K/V), in whole blocks of 4
    assert len(prompts[0]) == 41 and hits == [0, 44]
    clock = ch09.chat_prompts(tok, lambda t: f"t{t}", ["q1", "q2"], ["a1", "a2"])
    assert ch09.chat_hits(clock, generated, block_size=4) == [0, 8]   # "<system>t" differs at 9


def test_chat_hits_count_what_a_prefix_store_finds():
    """A 20-token prompt + 12 new tokens: 32, two blocks of 16, but the last new token has no K/V, so
    the store indexes one block; chat_hits must say the same."""
    model = pretrained.load("kvlab-tiny")
    store = PrefixKVStore(model.config, num_blocks=16, block_size=16)
    first = encode_bytes("Turn one: a question")
    assert len(first) == 20
    one = prefix.run_request(model, store, first, 12)
    second = first + one.new_tokens + encode_bytes(" and turn two.")
    two = prefix.run_request(model, store, second, 4)
    assert two.cached_tokens == 16
    assert ch09.chat_hits([first, second], [one.new_tokens, two.new_tokens]) == [0, 16]


# --- the oracle: shared prefix and window caches checked against a recomputation --------------------

def test_a_request_served_from_the_prefix_index_passes_the_oracle():
    model = pretrained.load("kvlab-tiny")
    store = PrefixKVStore(model.config, num_blocks=32, block_size=16)
    system = encode_bytes("A shared system prompt of more than two blocks of tokens. ")
    prefix.run_request(model, store, system + encode_bytes("First?"), 4)
    prompt = system + encode_bytes("Second?")
    cont = generate(model, torch.tensor([prompt]), 6, cache="static").new_tokens[0].tolist()
    cache = store.cache_for(prompt)
    assert cache.seq_len == 48
    report = oracle.check(model, cache, [prompt + cont], prompt_len=len(prompt), cached=48)
    assert report.ok and report.passes == 7, report
    # a stale block (another request's K/V left in it) is located at its first position
    cache.release()
    stale = store.cache_for(prompt)
    block = stale.seq.table[1]
    store.k[0, block] += 1.0
    report = oracle.check(model, stale, [prompt + cont], prompt_len=len(prompt), cached=48)
    assert (report.first.what, report.first.layer, report.first.position) == ("keys", 0, 16)


class _ForgetsItsBand(SlidingWindowKVCache):
    def visible(self, query_positions, key_positions, layer=None):
        return key_positions[None, :] <= query_positions[:, None]


def test_the_window_cache_passes_the_banded_oracle_and_a_wrong_band_is_located():
    model = pretrained.load("kvlab-tiny")
    ids = ch09.held_out_streams(120, 1)
    good = oracle.check(model, SlidingWindowKVCache(model.config, 1, window=16, sinks=4), ids,
                        prompt_len=80)
    assert good.ok and good.passes == 41, good
    bad = oracle.check(model, _ForgetsItsBand(model.config, 1, window=16, sinks=4), ids, prompt_len=80)
    assert (bad.first.what, bad.first.layer, bad.first.position) == ("keys", 1, 80)


# --- the exercises --------------------------------------------------------------------------------

def test_shared_prefix_blocks_checker(capsys):
    ex = ch09.SHARED_BLOCKS_EXERCISE
    right = prefix.sharing(ex["users"], ex["prefix_len"], ex["suffix_len"], ex["block_size"]).blocks_shared
    assert right == 62 + 20 * 13
    assert ch09.check_shared_prefix_blocks(right) and ch09.check_shared_prefix_blocks(f"{right:,}")
    assert "✓" in capsys.readouterr().out
    for wrong, hint in [(20 * 75, "without sharing"), (63 + 20 * 12, "only partly full"),
                        (63 + 20 * 13, "private copy"), (right + 2, "only the prefix's full blocks"),
                        ("many", "whole number"), (75, "one user's blocks"),
                        (62, "only the shared prefix blocks"), (63, "only the prefix's blocks"),
                        (1000 + 20 * 200, "counts tokens"), (62 + 20 * 200 / 16, "blocks are whole"),
                        (313, "not shared between users' own tokens"),
                        (260, "add the 62 shared prefix blocks")]:
        assert not ch09.check_shared_prefix_blocks(wrong)
        assert hint in capsys.readouterr().out, wrong
    assert ch09.check_shared_prefix_blocks(2 + 3 * 1, users=3, prefix_len=32, suffix_len=16)


def test_window_cache_checker(capsys):
    expected = kv_cache_bytes(PRESETS["mistral-7b"], 4096, 8) / GiB
    assert expected == 4
    assert ch09.check_window_cache_gib(4) and ch09.check_window_cache_gib("4.0")
    mistral = PRESETS["mistral-7b"]
    for wrong, hint in [(32, "full 32,768-token context"), (4 * GiB, "looks like bytes"),
                        (kv_cache_bytes(mistral, 100_000, 8) / GiB, "whole 100,000-token stream"),
                        (0.5, "one stream"), (2, "factor 2"), (8, "fp32's 4"),
                        (16, "not the 32 query heads"), (4 * GiB / 1e9, "that is GB"),
                        (3, "the window, not the stream"), (4096, "that is MiB")]:
        assert not ch09.check_window_cache_gib(wrong)
        assert hint in capsys.readouterr().out, wrong


test_any_wrong_answer_gets_a_hint = hint_test([ch09.check_shared_prefix_blocks, ch09.check_window_cache_gib],
                                              WRONG_VALUES)
test_whatever_is_typed_the_checkers_answer_with_a_verdict = verdict_test(
    [ch09.check_shared_prefix_blocks, ch09.check_window_cache_gib])
