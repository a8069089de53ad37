"""What a new user meets with their own model, folder and terminal (issue 42): every model name the
unknown-model error offers trains or is refused in one line; a factory importable from the current
folder; nothing half-written after a failure; logs without a terminal; one step numbering."""

from __future__ import annotations

import re

import pytest

from distrain.errors import ConfigError
from distrain.models import list_models
from distrain.models.registry import SHAPE_ONLY_PRESETS
from distrain.trainer import TrainConfig
from distrain.trainer.choices import MODEL_DATA


def _offered_models() -> list[str]:
    """The model names the unknown-model error offers, read from its message."""
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="no-such-model").validate()
    msg = str(e.value)
    assert "\n" not in msg
    # each name of a list: after "of ", ", " or ": ", before "," or ")"
    offered = re.findall(r"(?:(?<=of )|(?<=, )|(?<=: ))[\w.-]+(?=[,)])", msg.split("unknown; ", 1)[1])
    assert set(offered) == set(list_models()), msg  # every name offered, and only names
    return offered


def test_every_model_the_error_offers_trains_or_is_refused_in_one_line(tmp_path):
    for name in _offered_models():
        cfg = TrainConfig(model=name, data={"text": "shakespeare"}.get(MODEL_DATA.get(name, "text"), MODEL_DATA.get(name)), steps=2, batch_size=4,
                          out=str(tmp_path / "run"))
        if name in SHAPE_ONLY_PRESETS:
            with pytest.raises(ConfigError) as e:
                cfg.validate(fashion_mnist_root=str(tmp_path))
            assert str(e.value) == (
                f"--model {name} is a shape-only preset: its published sizes, for `distrain plan` and the cost model "
                f"(no weights, and too large to train from scratch here); to train the real model, download its "
                f"Hugging Face folder and give --init-from DIR (docs/llama.md)")
        else:  # a trainable preset with its kind of data: valid (fashion-mnist's folder: tmp_path stands in)
            assert cfg.validate(fashion_mnist_root=str(tmp_path)) is cfg
