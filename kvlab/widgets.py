"""Interactive explorers: core ipywidgets + `interactive_output` + inline matplotlib.

Each explorer is a thin shell around an ordinary drawing function (in this module) that the
notebooks also call directly, so nbval tests what the widget shows.
"""

from __future__ import annotations

# --- Chapter 03: the memory explorer ---------------------------------------------------------

MEMORY_DTYPES = ["fp32", "fp16", "bf16", "fp8", "int8"]
MEMORY_SEQ_LENS = [2**k for k in range(7, 21)]     # 128 … 1,048,576 tokens, log-spaced
MEMORY_BATCH_SIZES = [2**k for k in range(0, 11)]  # 1 … 1,024 sequences
WEIGHT_DTYPE = "fp16"  # the explorer's weights stay fp16; its dtype control is the cache's


def memory_models() -> list[str]:
    """The explorer's model choices: every preset, then "custom" (your own L, H_kv, D)."""
    from .config import PRESETS

    return [*PRESETS, "custom"]


def memory_config(model: str = "llama-7b", layers: int | None = None, kv_heads: int | None = None,
                  head_dim: int | None = None):
    """The ModelConfig the explorer sizes: a preset by name, or a "custom" cache shape.

    A custom shape only describes the cache (L layers × H_kv heads × D dims); it has no published
    weights, so it counts one parameter (2 bytes: nothing next to gigabytes) and the explorer says
    "weights not counted".
    """
    from .config import PRESETS, ModelConfig

    if model == "custom":
        if layers is None or kv_heads is None or head_dim is None:
            raise ValueError("model='custom' needs layers, kv_heads and head_dim (positive integers)")
        return ModelConfig(n_layers=layers, d_model=kv_heads * head_dim if _posint(kv_heads)
                           and _posint(head_dim) else 1, n_heads=kv_heads, n_kv_heads=kv_heads,
                           head_dim=head_dim, d_ff=1, vocab_size=1, max_seq_len=max(MEMORY_SEQ_LENS),
                           name="custom", n_params=1)
    if model not in PRESETS:
        raise ValueError(f"model={model!r} is not a preset; allowed: {', '.join(memory_models())}")
    return PRESETS[model]


def _posint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _shape_text(config) -> str:
    if config.kv_latent_dim is not None:
        return f"{config.n_layers} layers × one {config.kv_latent_dim}-element latent"
    return f"{config.n_layers} layers × {config.n_kv_heads} KV heads × {config.head_dim} dims"


def draw_memory(model: str = "llama-7b", seq_len: int = 4096, batch_size: int = 1,
                dtype: str = "fp16", gpu: str = "A100 80GB", layers: int | None = None,
                kv_heads: int | None = None, head_dim: int | None = None):
    """Memory against sequence length for one model, batch, cache dtype and GPU.

    Returns (Figure, readout text). The readout gives the cache size, whether it fits next to the
    fp16 weights, the longest context that fits and the most concurrent sequences that fit (from
    `kvlab.memory.plan`, no reserve for activations). Settings that do not fit (even the weights
    alone) draw the plot and say so; an invalid custom shape draws an empty plot and the reason.
    Unknown names (model, dtype, GPU) and a non-positive seq_len or batch_size raise ValueError.
    """
    import numpy as np

    from . import memory, plots

    memory.dtype_bits(dtype)            # unknown names are programming errors: raise
    g = memory.gpu(gpu)
    memory._check_count("seq_len", seq_len)
    memory._check_count("batch_size", batch_size)
    try:
        config = memory_config(model, layers, kv_heads, head_dim)
    except ValueError as err:
        if model != "custom":
            raise
        fig, ax = plots.new_figure(7.5, 4.2)
        ax.text(0.5, 0.5, f"custom shape not valid:\n{err}", ha="center", va="center", wrap=True,
                transform=ax.transAxes)
        ax.set_axis_off()
        return fig, f"✗ custom shape not valid: {err}"

    p = memory.plan(config, g, seq_len, batch_size, dtype=dtype, weight_dtype=WEIGHT_DTYPE)
    fmt = memory.format_bytes
    custom = model == "custom"
    weights = 0 if custom else p.weight_bytes
    per_token = memory.kv_bytes_per_token(config, dtype)
    label = "custom" if custom else f"{config.name} ({config.attention_kind})"
    lines = [
        f"{label}: {_shape_text(config)} = {fmt(per_token)} per token in {dtype}",
        f"KV cache for {seq_len:,} tokens × batch {batch_size}: {fmt(p.cache_bytes)} · weights "
        + ("not counted (custom shape)" if custom else f"({WEIGHT_DTYPE}): {fmt(weights)}")
        + f" · {g.name}: {fmt(g.memory_bytes)}",
    ]
    total = weights + p.cache_bytes
    if p.free_for_cache < 0:
        note = f"The weights alone ({fmt(weights)}) do not fit on {g.name} ({fmt(g.memory_bytes)})"
        lines.append(f"✗ {note}: no room for any cache.")
    elif p.fits:
        note = ""
        lines.append(f"✓ Fits: {fmt(total)} used, {fmt(g.memory_bytes - total)} to spare.")
    else:
        note = f"Does not fit: needs {fmt(total)}"
        lines.append(f"✗ Does not fit: needs {fmt(total)}, {fmt(total - g.memory_bytes)} more "
                     f"than {g.name} holds.")
    trained = "" if custom else f" (the model was trained for up to {config.max_seq_len:,})"
    lines.append(f"Longest context that fits at batch {batch_size}: "
                 + (f"{p.max_context:,} tokens{trained}." if p.max_context else "none."))
    lines.append(f"Most concurrent sequences of {seq_len:,} tokens that fit: "
                 + (f"{p.max_batch:,}." if p.max_batch else "none."))

    # Dense samples so the curve is smooth on the log axis; the cache grows linearly in tokens.
    seq_lens = np.geomspace(MEMORY_SEQ_LENS[0], MEMORY_SEQ_LENS[-1], 400)
    cache = seq_lens * batch_size * per_token
    fig = plots.memory_vs_seq_len(
        seq_lens, weights, cache, g.memory_bytes, g.name, seq_len, p.max_context,
        title=f"{label}, batch {batch_size}, {dtype} cache on {g.name}",
        cache_label=f"KV cache ({dtype}, batch {batch_size})",
        weight_label="weights: not counted" if custom else f"weights ({WEIGHT_DTYPE})", note=note)
    return fig, "\n".join(lines)


def _readout_html(text: str) -> str:
    import html

    return ("<pre style='font-size:12.5px; line-height:1.45; white-space:pre-wrap; margin:0'>"
            f"{html.escape(text)}</pre>")


def memory_explorer():
    """Model, sequence length (log scale), batch, cache dtype and GPU → memory vs sequence length,
    with readouts of the cache size, the longest context and the most sequences that fit."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from .memory import GPUS

    style, wide = {"description_width": "90px"}, w.Layout(width="420px")
    model = w.Dropdown(options=memory_models(), value="llama-7b", description="model",
                       style=style, layout=wide)
    layers = w.BoundedIntText(value=32, min=1, max=1000, description="layers", style=style)
    kv_heads = w.BoundedIntText(value=32, min=1, max=1024, description="KV heads", style=style)
    head_dim = w.BoundedIntText(value=128, min=2, max=1024, step=2, description="head dim",
                                style=style)
    custom_box = w.HBox([layers, kv_heads, head_dim], layout=w.Layout(display="none"))
    seq_len = w.SelectionSlider(options=[(f"{s:,}", s) for s in MEMORY_SEQ_LENS], value=4096,
                                description="seq len", style=style, layout=wide,
                                continuous_update=False)
    batch = w.SelectionSlider(options=[(f"{b:,}", b) for b in MEMORY_BATCH_SIZES], value=1,
                              description="batch", style=style, layout=wide,
                              continuous_update=False)
    dtype = w.Dropdown(options=MEMORY_DTYPES, value="fp16", description="cache dtype", style=style)
    gpu = w.Dropdown(options=list(GPUS), value="A100 80GB", description="GPU", style=style)
    readout = w.HTML()
    readout.add_class("kvlab-readout")

    def show_custom(change) -> None:
        custom_box.layout.display = "flex" if change["new"] == "custom" else "none"

    model.observe(show_custom, names="value")

    def update(model, seq_len, batch_size, dtype, gpu, layers, kv_heads, head_dim) -> None:
        custom = model == "custom"
        fig, text = draw_memory(model, seq_len, batch_size, dtype, gpu,
                                layers if custom else None, kv_heads if custom else None,
                                head_dim if custom else None)
        readout.value = _readout_html(text)
        display(fig)
        plt.close(fig)

    out = w.interactive_output(update, {
        "model": model, "seq_len": seq_len, "batch_size": batch, "dtype": dtype, "gpu": gpu,
        "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim})
    out.layout = w.Layout(height="450px", overflow="hidden")
    out.add_class("kvlab-plot")
    box = w.VBox([w.HBox([model, gpu]), custom_box, seq_len, batch, dtype, out, readout])
    box.add_class("kvlab-memory-explorer")
    return box


# --- Chapter 04: MHA vs GQA vs MQA (and MLA) ---------------------------------------------------

GQA_SEQ_LENS = [2**k for k in range(7, 21)]   # 128 … 1,048,576 tokens, log-spaced
GQA_CUSTOM = {"layers": 32, "n_heads": 32, "head_dim": 128}  # a custom shape starts as Llama-2-7B's


def gqa_models() -> list[str]:
    """The GQA explorer's model choices: the published presets, then "custom"."""
    from .config import PUBLISHED

    return [*PUBLISHED, "custom"]


def gqa_variants(model: str = "llama-2-70b", n_kv_heads: int | None = None,
                 n_heads: int | None = None, layers: int | None = None,
                 head_dim: int | None = None) -> tuple[dict, str]:
    """The configs the GQA explorer compares, and a message ("" when the setting is allowed).

    Returns ({label: ModelConfig}, message): MHA, the chosen GQA (when 1 < n_kv_heads < n_heads),
    MQA, and MLA for a preset that uses it. A preset's shape can be overridden; None keeps it.
    An n_kv_heads that does not divide n_heads (or an invalid custom shape) is not an exception: the
    message says what is allowed and the chosen variant is left out.
    """
    from .config import PRESETS, ModelConfig, divisors

    if model not in gqa_models():
        raise ValueError(f"model={model!r} is not a choice; allowed: {', '.join(gqa_models())}")
    if model == "custom":
        base = {"n_layers": GQA_CUSTOM["layers"], "n_heads": GQA_CUSTOM["n_heads"],
                "head_dim": GQA_CUSTOM["head_dim"], "latent": None}
    else:
        p = PRESETS[model]
        base = {"n_layers": p.n_layers, "n_heads": p.n_heads, "head_dim": p.head_dim,
                "latent": p.kv_latent_dim}
    L = base["n_layers"] if layers is None else layers
    H = base["n_heads"] if n_heads is None else n_heads
    D = base["head_dim"] if head_dim is None else head_dim
    if n_kv_heads is None:
        n_kv_heads = H if model == "custom" else PRESETS[model].n_kv_heads
    try:
        mha = ModelConfig(n_layers=L, d_model=H * D if _posint(H) and _posint(D) else 1, n_heads=H,
                          n_kv_heads=H, head_dim=D, d_ff=1, vocab_size=1,
                          max_seq_len=max(GQA_SEQ_LENS), name=model, n_params=1)
    except ValueError as err:
        return {}, f"shape not valid: {err}"
    out = {f"MHA ({H} KV head{'s' * (H > 1)})": mha}
    message = ""
    if not _posint(n_kv_heads) or H % n_kv_heads:
        message = f"n_kv_heads={n_kv_heads!r} must divide n_heads={H}; allowed: {divisors(H)}"
    elif 1 < n_kv_heads < H:
        out[f"GQA ({n_kv_heads} KV heads)"] = mha.with_(n_kv_heads=n_kv_heads)
    if H > 1:
        out["MQA (1 KV head)"] = mha.with_(n_kv_heads=1)
    if base["latent"] is not None:
        out[f"MLA ({base['latent']}-element latent)"] = mha.with_(kv_latent_dim=base["latent"])
    return out, message


def draw_gqa(model: str = "llama-2-70b", n_kv_heads: int | None = None, seq_len: int = 131072,
             n_heads: int | None = None, layers: int | None = None, head_dim: int | None = None,
             dtype: str = "fp16", batch_size: int = 1):
    """KV-cache memory against sequence length for MHA, the chosen GQA, MQA (and MLA).

    Returns (Figure, readout text). The readout gives each variant's cache at seq_len and how many
    times smaller than MHA it is. A KV-head count that does not divide the query heads, or an
    invalid shape, draws what it can and says what is allowed. Unknown model or dtype names and a
    non-positive seq_len or batch_size raise ValueError (they are programming errors).
    """
    import numpy as np

    from . import memory, plots
    from .gqa import gqa_equivalent_kv_heads

    memory.dtype_bits(dtype)
    memory._check_count("seq_len", seq_len)
    memory._check_count("batch_size", batch_size)
    configs, message = gqa_variants(model, n_kv_heads, n_heads, layers, head_dim)
    seq_lens = [s for s in GQA_SEQ_LENS if s >= min(seq_len, 128)]
    seq_lens += [2**k for k in range(21, 64) if 2 ** (k - 1) < seq_len]
    lens = np.array(seq_lens, dtype=float)
    curves, lines = {}, []
    for label, cfg in configs.items():
        per_token = memory.kv_bytes_per_token(cfg, dtype) * batch_size
        curves[label] = (lens * per_token, per_token * seq_len)
    if configs:
        mha = next(iter(configs.values()))
        name = "custom shape" if model == "custom" else model
        lines.append(f"{name}: {mha.n_layers} layers × {mha.n_heads} query heads × head dim "
                     f"{mha.head_dim}; KV cache for {seq_len:,} tokens, {dtype}, batch {batch_size}:")
        mha_bytes = curves[next(iter(curves))][1]
        for label, (_, at) in curves.items():
            cfg = configs[label]
            ratio = f"{mha_bytes / at:.3g}× smaller than MHA" if at < mha_bytes else "the baseline"
            lines.append(f"  {label:<28} {memory.format_bytes(at):>11}   {ratio}")
            if cfg.kv_latent_dim is not None:
                lines.append(f"  (MLA caches {cfg.kv_latent_dim} elements per token per layer: as "
                             f"much as GQA with {gqa_equivalent_kv_heads(cfg):.3g} KV heads of dim "
                             f"{cfg.head_dim})")
        if model != "custom" and _same_shape(model, n_heads, layers, head_dim):
            lines.append(_published_line(model))
    if message:
        lines.append(f"✗ {message}")
    title = ("custom shape" if model == "custom" else model) + f": KV cache ({dtype}, batch {batch_size})"
    fig = plots.gqa_memory(lens, curves, seq_len, title=title, message=message)
    return fig, "\n".join(lines)


def _same_shape(model: str, n_heads, layers, head_dim) -> bool:
    from .config import PRESETS

    p = PRESETS[model]
    return all(v is None or v == getattr(p, k) for k, v in
               (("n_heads", n_heads), ("n_layers", layers), ("head_dim", head_dim)))


def _published_line(model: str) -> str:
    from .config import PRESETS

    p = PRESETS[model]
    if p.kv_latent_dim is not None:
        return f"Published: {model} uses MLA."
    return f"Published: {model} uses {p.attention_kind} with {p.n_kv_heads} KV heads."


def gqa_explorer():
    """Model (preset or custom), query heads, KV heads (divisors only), layers, head dim and
    sequence length → KV-cache memory against sequence length for MHA, GQA, MQA (and MLA), with
    readouts of each variant's size and its ratio to MHA.

    Controls (by description) map to `draw_gqa` arguments: "model" → model, "KV heads" →
    n_kv_heads, "seq len" → seq_len, "query heads" → n_heads, "layers" → layers, "head dim" →
    head_dim. Choosing a preset loads its shape; changing a preset's shape switches to "custom".
    """
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from .config import PRESETS, divisors

    style, wide = {"description_width": "100px"}, w.Layout(width="420px")
    start = PRESETS["llama-2-70b"]
    model = w.Dropdown(options=gqa_models(), value="llama-2-70b", description="model", style=style,
                       layout=wide)
    n_heads = w.BoundedIntText(value=start.n_heads, min=1, max=256, description="query heads",
                               style=style)
    n_kv = w.Dropdown(options=divisors(start.n_heads), value=start.n_kv_heads,
                      description="KV heads", style=style)
    layers = w.BoundedIntText(value=start.n_layers, min=1, max=1000, description="layers",
                              style=style)
    head_dim = w.BoundedIntText(value=start.head_dim, min=2, max=1024, step=2,
                                description="head dim", style=style)
    seq_len = w.SelectionSlider(options=[(f"{s:,}", s) for s in GQA_SEQ_LENS], value=131072,
                                description="seq len", style=style, layout=wide,
                                continuous_update=False)
    readout = w.HTML()
    readout.add_class("kvlab-readout")
    syncing = [False]  # True while controls are set by code, so only one redraw happens

    def set_kv_options(h: int, keep: int) -> None:
        options = divisors(h)
        n_kv.options = options
        n_kv.value = keep if keep in options else max(d for d in options if d <= max(keep, 1))

    def on_model(change) -> None:
        if change["new"] == "custom":
            return
        p = PRESETS[change["new"]]
        syncing[0] = True
        try:
            layers.value, head_dim.value, n_heads.value = p.n_layers, p.head_dim, p.n_heads
            set_kv_options(p.n_heads, p.n_kv_heads)
        finally:
            syncing[0] = False

    def on_shape(change) -> None:
        if syncing[0]:
            return
        syncing[0] = True
        try:
            if change["owner"] is n_heads:
                set_kv_options(n_heads.value, n_kv.value)
            if model.value != "custom" and not _same_shape(model.value, n_heads.value,
                                                           layers.value, head_dim.value):
                model.value = "custom"
        finally:
            syncing[0] = False

    # Registered before interactive_output, so the controls are in sync when it redraws.
    model.observe(on_model, names="value")
    for control in (n_heads, layers, head_dim):
        control.observe(on_shape, names="value")

    def update(model, n_kv_heads, seq_len, n_heads, layers, head_dim) -> None:
        if syncing[0]:
            return
        fig, text = draw_gqa(model, n_kv_heads, seq_len, n_heads, layers, head_dim)
        readout.value = _readout_html(text)
        display(fig)
        plt.close(fig)

    out = w.interactive_output(update, {"model": model, "n_kv_heads": n_kv, "seq_len": seq_len,
                                        "n_heads": n_heads, "layers": layers, "head_dim": head_dim})
    out.layout = w.Layout(height="450px", overflow="hidden")
    out.add_class("kvlab-plot")
    box = w.VBox([w.HBox([model, seq_len]), w.HBox([n_heads, n_kv]), w.HBox([layers, head_dim]),
                  out, readout])
    box.add_class("kvlab-gqa-explorer")
    return box


# --- Chapter 05: FP16 vs INT8 (and int4) ---------------------------------------------------------

QUANT_DTYPES = ["fp32", "fp16", "int8", "int4"]
# label -> (key granularity, value granularity)
QUANT_SCALES = {"kivi": ("channel", "token"), "token": ("token", "token"),
                "channel": ("channel", "channel"), "tensor": ("tensor", "tensor")}
QUANT_SCALE_LABELS = {"kivi": "K per channel, V per token (KIVI)", "token": "per token (K and V)",
                      "channel": "per channel (K and V)", "tensor": "per tensor (K and V)"}
QUANT_SEQ_LENS = [2**k for k in range(9, 18)]  # 512 … 131,072 tokens
QUANT_GROUP_SIZE = 32                          # tokens sharing a per-channel (or per-tensor) scale
QUANT_RUN = {"batch": 2, "tokens": 96, "prompt_len": 32}  # the small measured run


def quant_models() -> list[str]:
    """The explorer's model choices (for the memory chart): the published presets."""
    from .config import PUBLISHED

    return list(PUBLISHED)


def quant_measurement_model():
    """(model, tokens, name) of the small measured run: kvlab-tiny on held-out text when its
    checkpoint is there, otherwise a random tiny-mha model (seed 0) on random bytes."""
    import torch

    from . import pretrained
    from .config import PRESETS
    from .generate import encode_bytes
    from .model import Transformer

    b, t = QUANT_RUN["batch"], QUANT_RUN["tokens"]
    try:
        model = pretrained.load("kvlab-tiny")
        ids = encode_bytes(pretrained.corpus_text("held_out"))[: b * t]
        return model, torch.tensor(ids).view(b, t), "kvlab-tiny on held-out text"
    except (FileNotFoundError, OSError):
        torch.manual_seed(0)
        model = Transformer(PRESETS["tiny-mha"]).eval()
        ids = torch.randint(0, model.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))
        return model, ids, "a random tiny-mha model (kvlab-tiny not built) on random bytes"


_QUANT_MEASURED: dict = {}


def quant_measurement(dtype: str = "int8", scales: str = "kivi") -> dict:
    """The measured errors of one setting (kvlab.quant.measure_cache_error on the small run),
    computed once per setting and remembered. Adds "run" (what was measured)."""
    from . import quant

    _check_quant_choice(dtype, scales)
    key = (dtype, scales if dtype in ("int8", "int4") else None)
    if key not in _QUANT_MEASURED:
        model, tokens, name = quant_measurement_model()
        options = {}
        if dtype in ("int8", "int4"):
            k_g, v_g = QUANT_SCALES[scales]
            options = {"key_granularity": k_g, "value_granularity": v_g, "group_size": QUANT_GROUP_SIZE}
        result = quant.measure_cache_error(model, tokens, QUANT_RUN["prompt_len"], storage=dtype,
                                           **options)
        result["run"] = (f"{name}: {tokens.shape[0]} × {tokens.shape[1]} tokens, prefill "
                         f"{QUANT_RUN['prompt_len']}, then one token a step")
        _QUANT_MEASURED[key] = result
    return _QUANT_MEASURED[key]


def _check_quant_choice(dtype: str, scales: str) -> None:
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not a choice; allowed: {', '.join(QUANT_DTYPES)}")
    if scales not in QUANT_SCALES:
        raise ValueError(f"scales={scales!r} is not a choice; allowed: {', '.join(QUANT_SCALES)}")


def quant_cache_bytes(config, seq_len: int, dtype: str = "int8", scales: str = "kivi",
                      batch_size: int = 1) -> int:
    """Cache bytes of one setting: fp32/fp16 from kvlab.memory, int8/int4 with their fp16 scales
    and the fp16 window of unfinished blocks (kvlab.quant.quantized_cache_bytes)."""
    from . import memory, quant

    _check_quant_choice(dtype, scales)
    if dtype in ("fp32", "fp16"):
        return memory.kv_cache_bytes(config, seq_len, batch_size, dtype)
    k_g, v_g = QUANT_SCALES[scales]
    return quant.quantized_cache_bytes(config, seq_len, batch_size, bits=8 if dtype == "int8" else 4,
                                       key_granularity=k_g, value_granularity=v_g,
                                       group_size=QUANT_GROUP_SIZE)


def draw_quant(dtype: str = "int8", scales: str = "kivi", seq_len: int = 4096,
               model: str = "llama-2-7b"):
    """Cache memory of `model` against sequence length for fp32 / fp16 / int8 / int4 (the chosen
    storage in bold), and the errors measured for the chosen dtype and scale granularity on a small
    cached run (`quant_measurement`). Returns (Figure, readout text). An MLA model (one latent per
    token, no K/V heads to scale per channel) draws the fp formats only and says so. Unknown names
    or a non-positive seq_len raise ValueError."""
    import numpy as np

    from . import memory, plots
    from .config import PRESETS

    _check_quant_choice(dtype, scales)
    memory._check_count("seq_len", seq_len)
    if model not in quant_models():
        raise ValueError(f"model={model!r} is not a choice; allowed: {', '.join(quant_models())}")
    config = PRESETS[model]
    lens = np.array(sorted({*[2**k for k in range(7, 21)], seq_len}), dtype=float)
    fmt = memory.format_bytes
    message, lines = "", []
    formats = QUANT_DTYPES if config.kv_latent_dim is None else ["fp32", "fp16"]
    curves = {}
    for d in formats:
        label = d if d in ("fp32", "fp16") else f"{d} + scales"
        curves[label] = np.array([quant_cache_bytes(config, int(s), d, scales) for s in lens], dtype=float)
    chosen = dtype if dtype in ("fp32", "fp16") else f"{dtype} + scales"
    fp16 = memory.kv_cache_bytes(config, seq_len, 1, "fp16")
    if chosen in curves:
        size = quant_cache_bytes(config, seq_len, dtype, scales)
        lines.append(f"{model}: KV cache for {seq_len:,} tokens in {dtype}"
                     + (f" ({QUANT_SCALE_LABELS[scales]}, groups of {QUANT_GROUP_SIZE} tokens)"
                        if dtype in ("int8", "int4") else "")
                     + f": {fmt(size)} = {size / fp16:.3f}× FP16 ({fmt(fp16)})")
    else:
        message = "MLA latent: no int8 / int4 curve (errors: small MHA run)"
        lines.append(f"✗ {model} caches an MLA latent, not K and V heads: kvlab's int8 / int4 K/V "
                     "layout does not apply, so the chart shows fp32 and fp16 only.")
    m = quant_measurement(dtype, scales)
    errors = {"K": m["k_relative_rms_error"], "V": m["v_relative_rms_error"],
              "attention output": m["attention_relative_rms_error"],
              "logits": m["logits_relative_rms_error"]}
    lines.append(f"Measured on {m['run']}:")
    lines.append("  relative RMS error: " + ", ".join(f"{k} {v:.3%}" for k, v in errors.items()))
    lines.append(f"  greedy (arg-max) agreement with the exact cache: {m['top1_agreement']:.1%} of "
                 f"{m['tokens']} positions; loss {m['loss_exact']:.4f} → {m['loss_quant']:.4f} nats/token")
    if dtype == "fp32":
        lines.append("  fp32 is the reference here: nothing is rounded.")
    elif dtype == "fp16":
        lines.append("  fp16 keeps every value to about 3 significant digits; scales only apply to "
                     "int8 / int4.")
    elif scales != "kivi":
        lines.append("  compare with 'K per channel, V per token (KIVI)' on the same dtype.")
    title = f"{model}: KV cache, batch 1"
    fig = plots.quant_memory_and_error(lens, curves, chosen if chosen in curves else "fp16", seq_len,
                                       errors, title=title, message=message or
                                       f"{dtype}" + (f", {QUANT_SCALE_LABELS[scales]}"
                                                     if dtype in ("int8", "int4") else "")
                                       + ": measured error")
    return fig, "\n".join(lines)


def quant_explorer():
    """Cache dtype (fp32 / fp16 / int8 / int4), scale granularity, sequence length and model →
    cache memory against sequence length, with the errors measured for the chosen setting."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    style, wide = {"description_width": "90px"}, w.Layout(width="420px")
    dtype = w.Dropdown(options=QUANT_DTYPES, value="int8", description="cache dtype", style=style)
    scales = w.Dropdown(options=[(label, key) for key, label in QUANT_SCALE_LABELS.items()],
                        value="kivi", description="scales", style=style, layout=wide)
    seq_len = w.SelectionSlider(options=[(f"{s:,}", s) for s in QUANT_SEQ_LENS], value=4096,
                                description="seq len", style=style, layout=wide,
                                continuous_update=False)
    model = w.Dropdown(options=quant_models(), value="llama-2-7b", description="model", style=style,
                       layout=wide)
    readout = w.HTML()
    readout.add_class("kvlab-readout")

    def update(dtype, scales, seq_len, model) -> None:
        fig, text = draw_quant(dtype, scales, seq_len, model)
        readout.value = _readout_html(text)
        display(fig)
        plt.close(fig)

    out = w.interactive_output(update, {"dtype": dtype, "scales": scales, "seq_len": seq_len,
                                        "model": model})
    out.layout = w.Layout(height="450px", overflow="hidden")
    out.add_class("kvlab-plot")
    box = w.VBox([w.HBox([dtype, scales]), w.HBox([model, seq_len]), out, readout])
    box.add_class("kvlab-quant-explorer")
    return box
