"""Model shapes: `ModelConfig` (validated) and `PRESETS` of published models, each with its source."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import validate


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-style decoder: everything the KV cache size depends on, and more.

    `head_dim` defaults to d_model // n_heads. `n_params` overrides the parameter count computed
    from the shape (for models that are not Llama-shaped, e.g. GPT-2 or a mixture of experts).
    `kv_latent_dim` marks an MLA model (DeepSeek-V2): each layer caches one latent vector of that
    many elements per token instead of K and V per head.
    """

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    max_seq_len: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    name: str = ""
    source: str = field(default="", compare=False)
    n_params: int | None = None
    kv_latent_dim: int | None = None

    def __post_init__(self) -> None:
        for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                    "max_seq_len"):
            object.__setattr__(self, key, validate.integer(key, getattr(self, key)))
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "pass head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        object.__setattr__(self, "head_dim", validate.integer("head_dim", self.head_dim))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                f"allowed n_kv_heads: {divisors(self.n_heads)}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim={self.head_dim} is odd; RoPE rotates pairs of channels, so it must be even"
            )
        for key in ("rope_theta", "norm_eps"):
            object.__setattr__(self, key, validate.number(key, getattr(self, key), low=0,
                                                          low_inclusive=False))
        for key in ("tie_embeddings", "qkv_bias"):  # "no" or 2 would silently mean True
            object.__setattr__(self, key, validate.boolean(key, getattr(self, key)))
        for key in ("n_params", "kv_latent_dim"):
            if getattr(self, key) is not None:
                validate.integer(key, getattr(self, key))

    @property
    def n_rep(self) -> int:
        """How many query heads share one KV head (1 = MHA, n_heads = MQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def attention_kind(self) -> str:
        if self.kv_latent_dim is not None:
            return "MLA"
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def divisors(n: int) -> list[int]:
    """The allowed KV-head counts for `n` query heads."""
    return [d for d in range(1, n + 1) if n % d == 0]


_HF = "https://huggingface.co/{}/blob/main/config.json"
_LLAMA1 = "https://github.com/meta-llama/llama/blob/llama_v1/MODEL_CARD.md (shapes: llama/model.py)"


def _preset(name: str, source: str, **kw) -> ModelConfig:
    return ModelConfig(name=name, source=source, **kw)


# Published shapes (see REFERENCE.md). d_ff and vocab_size come from the same configs and only
# matter for the weight-memory estimate; the KV cache depends on n_layers, n_kv_heads, head_dim.
PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        _preset("llama-7b", _LLAMA1, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32,
                d_ff=11008, vocab_size=32000, max_seq_len=2048, norm_eps=1e-6),
        _preset("llama-13b", _LLAMA1, n_layers=40, d_model=5120, n_heads=40, n_kv_heads=40,
                d_ff=13824, vocab_size=32000, max_seq_len=2048, norm_eps=1e-6),
        _preset("llama-65b", _LLAMA1, n_layers=80, d_model=8192, n_heads=64, n_kv_heads=64,
                d_ff=22016, vocab_size=32000, max_seq_len=2048, norm_eps=1e-5),
        _preset("llama-2-7b", _HF.format("meta-llama/Llama-2-7b-hf"), n_layers=32, d_model=4096,
                n_heads=32, n_kv_heads=32, d_ff=11008, vocab_size=32000, max_seq_len=4096),
        _preset("llama-2-13b", _HF.format("meta-llama/Llama-2-13b-hf"), n_layers=40,
                d_model=5120, n_heads=40, n_kv_heads=40, d_ff=13824, vocab_size=32000,
                max_seq_len=4096),
        _preset("llama-2-70b", _HF.format("meta-llama/Llama-2-70b-hf"), n_layers=80,
                d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=32000,
                max_seq_len=4096),
        _preset("llama-3-8b", _HF.format("meta-llama/Meta-Llama-3-8B"), n_layers=32,
                d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=128256,
                max_seq_len=8192, rope_theta=500000.0),
        _preset("llama-3-70b", _HF.format("meta-llama/Meta-Llama-3-70B"), n_layers=80,
                d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=128256,
                max_seq_len=8192, rope_theta=500000.0),
        _preset("llama-3.1-405b", _HF.format("meta-llama/Llama-3.1-405B"), n_layers=126,
                d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248, vocab_size=128256,
                max_seq_len=131072, rope_theta=500000.0),
        # Mistral attends within a 4,096-token sliding window; the sizes here are for full attention.
        _preset("mistral-7b", _HF.format("mistralai/Mistral-7B-v0.1"), n_layers=32, d_model=4096,
                n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=32000, max_seq_len=32768),
        _preset("qwen2.5-7b", _HF.format("Qwen/Qwen2.5-7B"), n_layers=28, d_model=3584,
                n_heads=28, n_kv_heads=4, d_ff=18944, vocab_size=152064, max_seq_len=131072,
                rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True),
        _preset("qwen2.5-72b", _HF.format("Qwen/Qwen2.5-72B"), n_layers=80, d_model=8192,
                n_heads=64, n_kv_heads=8, d_ff=29568, vocab_size=152064, max_seq_len=131072,
                rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True),
        # GPT-2 is not Llama-shaped (LayerNorm, GELU, learned positions): its count is the published one.
        _preset("gpt2", _HF.format("openai-community/gpt2"), n_layers=12, d_model=768,
                n_heads=12, n_kv_heads=12, d_ff=3072, vocab_size=50257, max_seq_len=1024,
                n_params=124_000_000),
        _preset("tinyllama-1.1b", _HF.format("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"),
                n_layers=22, d_model=2048, n_heads=32, n_kv_heads=4, d_ff=5632, vocab_size=32000,
                max_seq_len=2048),
        _preset("smollm2-135m", _HF.format("HuggingFaceTB/SmolLM2-135M"), n_layers=30,
                d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536, vocab_size=49152,
                max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True),
        # DeepSeek-V2 (MLA): one latent of kv_lora_rank 512 + RoPE key 64 = 576 elements per token
        # per layer; 236 B parameters in all (a mixture of experts), 21 B active per token. Its
        # config declares max_position_embeddings 163,840 (YaRN factor 40 × 4,096; the report's
        # section 3.1.4 "target maximum context length 160K"); it was trained to 32K, evaluated at 128K.
        _preset("deepseek-v2", "https://arxiv.org/abs/2405.04434 (Table 1); "
                + _HF.format("deepseek-ai/DeepSeek-V2"), n_layers=60, d_model=5120, n_heads=128,
                n_kv_heads=128, head_dim=128, d_ff=12288, vocab_size=102400, max_seq_len=163840,
                n_params=236_000_000_000, kv_latent_dim=576),
        # Teaching configs: small enough to run every notebook on two CPU cores.
        _preset("tiny-mha", "kvlab teaching config", n_layers=2, d_model=64, n_heads=4,
                n_kv_heads=4, d_ff=172, vocab_size=256, max_seq_len=512),
        _preset("tiny-gqa", "kvlab teaching config", n_layers=2, d_model=64, n_heads=4,
                n_kv_heads=2, d_ff=172, vocab_size=256, max_seq_len=512),
        _preset("tiny-mqa", "kvlab teaching config", n_layers=2, d_model=64, n_heads=4,
                n_kv_heads=1, d_ff=172, vocab_size=256, max_seq_len=512),
    ]
}

PUBLISHED = [name for name, c in PRESETS.items() if c.source.startswith("http")]


def resolve(config_or_name: ModelConfig | str) -> ModelConfig:
    """A ModelConfig, given one or the name of a preset ("llama-2-7b", "tiny-mha", …)."""
    if isinstance(config_or_name, ModelConfig):
        return config_or_name
    if isinstance(config_or_name, str):
        return PRESETS[validate.choice("config", config_or_name.lower(), PRESETS)]
    raise ValueError(f"config={config_or_name!r:.80} is not a ModelConfig; pass one, or the name of "
                     f"a preset in kvlab.PRESETS (e.g. 'llama-2-7b')")
