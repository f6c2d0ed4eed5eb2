"""The README's "Errors you may meet" quotes messages kvlab really gives, word for word."""

import re
from pathlib import Path

import pytest
import torch

import kvlab
from kvlab.cache import StaticKVCache
from kvlab.model import Transformer

README = Path(__file__).resolve().parents[1] / "README.md"


def _quoted_messages() -> list[str]:
    section = README.read_text().split("## Errors you may meet", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    return [line.removeprefix("ValueError: ") for line in block.splitlines() if line.strip()]


def _raised(call) -> str:
    with pytest.raises(ValueError) as err:
        call()
    return str(err.value)


def test_the_readme_quotes_real_messages():
    model = Transformer(kvlab.PRESETS["tiny-mha"]).eval()
    raised = [
        _raised(lambda: model(torch.tensor([[1, 2]]), cache=StaticKVCache(model.config, 2, 16))),
        _raised(lambda: model(torch.tensor([1, 2, 3]))),
        _raised(lambda: model(torch.tensor([[256]]))),
    ]
    assert _quoted_messages() == raised
