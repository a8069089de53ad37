"""--activation-checkpointing: bitwise the same losses on every layout, and fewer bytes kept
for backward (counted exactly with saved-tensor hooks)."""

from __future__ import annotations

import pytest
import torch

from conftest import train_losses, trainer_config
from distrain.errors import ConfigError
from distrain.models import build_model
from distrain.models.activation_checkpointing import checkpoint_blocks


def _saved_bytes(model, x) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward (what activation
    memory is), counted as they are packed."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.sum().backward()
    return total


def test_checkpointing_keeps_only_block_inputs_and_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = build_model("gpt-small", dropout=0.1)
    ckpt = build_model("gpt-small", dropout=0.1)
    ckpt.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(ckpt) == 4
    x = torch.randint(0, 256, (8, 64))
    torch.manual_seed(1)  # the same dropout masks: the re-run forward restores the RNG state
    before = _saved_bytes(plain, x)
    torch.manual_seed(1)
    after = _saved_bytes(ckpt, x)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # gpt-small, B=8, T=64, C=128: each of the 4 blocks now keeps its input (8*64*128 fp32 = 256 KiB)
    # instead of its attention and MLP intermediates; the embedding and head keep theirs
    assert after < before / 3, (before, after)
    assert list(dict(ckpt.named_parameters())) == list(dict(plain.named_parameters()))  # names unchanged


def test_llama_blocks_are_checkpointed_with_the_same_gradients():
    torch.manual_seed(0)
    plain = build_model("llama-tiny")
    ckpt = build_model("llama-tiny")
    ckpt.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(ckpt) == plain.config.n_layer
    x = torch.randint(0, 256, (4, 32))
    before, after = _saved_bytes(plain, x), _saved_bytes(ckpt, x)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert after < before / 2, (before, after)


def test_a_model_without_blocks_and_zero3_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="has no blocks to checkpoint: it needs model.layers"):
        checkpoint_blocks(build_model("mlp-tiny"))
    with pytest.raises(ConfigError, match="--activation-checkpointing does not combine with --strategy zero3"):
        trainer_config(tmp_path, strategy="zero3", activation_checkpointing=True).validate()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", [dict(strategy="single", nproc=1), dict(strategy="ddp", nproc=2),
                                    dict(strategy="zero2", nproc=2), dict(strategy="ddp", nproc=2, tp=2),
                                    dict(strategy="ddp", nproc=2, pp=2, microbatches=2)],
                         ids=["single", "ddp", "zero2", "tp2", "pp2"])
def test_losses_bitwise_unchanged(tmp_path, layout):
    runs = {on: train_losses(trainer_config(tmp_path / str(on), dtype="float32", activation_checkpointing=on,
                                            **layout)) for on in (False, True)}
    assert runs[True] == runs[False]
