"""``distrain generate`` on every run whose model can be rebuilt, and the sampler under it.

The KV cache of our GPT and Llama gives the no-cache logits (fp32, within 1e-6) and the same tokens
(greedy and seeded sampling, past the block size too); top-p keeps the smallest likeliest set
reaching p; an HF-initialised run (``--init-from HF_DIR`` on shards of the folder's own tokenizer)
and a ``--model PKG.MOD:FACTORY`` run sample the same text for the same seed through the CLI, our
greedy text equals transformers' ``generate`` on the same run, and a run whose model cannot be
rebuilt (factory not importable, weights gone) is a one-line error naming the fix.
"""

from __future__ import annotations

import json
import random
import shutil
import sys

import pytest
import torch

from distrain.cli import main
from distrain.errors import ConfigError
from distrain.models import build_model, generate
from distrain.models.kv_cache import KVCache
from distrain.models.sampling import next_token, top_p_keep

TRAIN = ["--steps", "2", "--batch-size", "4", "--strategy", "single", "--nproc", "1", "--eval-every", "0",
         "--sample-chars", "0", "--no-progress", "--no-report"]


def _cli(capsys, *args) -> str:
    """stdout of ``distrain ARGS`` (exit status 0)."""
    capsys.readouterr()
    assert main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def _error(capsys, *args) -> str:
    capsys.readouterr()
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line: {err!r}"
    return err.removeprefix("distrain: error: ").rstrip("\n")


# -- the sampler ------------------------------------------------------------------------------------------
def test_top_p_keeps_the_smallest_likeliest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    assert top_p_keep(probs, 0.5).tolist() == [[False, True, False, False]]   # 0.5 alone reaches 0.5
    assert top_p_keep(probs, 0.51).tolist() == [[False, True, False, True]]   # 0.5 + 0.3
    assert top_p_keep(probs, 0.9).tolist() == [[False, True, True, True]]     # 0.5 + 0.3 + 0.15
    assert top_p_keep(probs, 1.0).tolist() == [[True, True, True, True]]
    assert top_p_keep(probs, 0.01).tolist() == [[False, True, False, False]]  # the likeliest one always
    # drawn: only the kept tokens, renormalised (0.5 / 0.8 = 0.625 of the draws are token 1)
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([next_token(probs.log(), 1.0, top_p=0.75, generator=g) for _ in range(4000)]).flatten()
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 1).float().mean().item() - 0.625) < 0.03


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_kv_cache_gives_the_no_cache_logits_and_tokens(name):
    torch.manual_seed(0)
    model = build_model(name).eval()                       # fp32
    block = model.config.block_size
    ids = torch.randint(0, 256, (2, block), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids)                                 # (2, block, V)
        cache = model.new_cache()
        # a prompt of 5, one token at a time, then a chunk of 3 (the masked path), then the rest
        cuts = [0, 5, *range(6, 12), 15, block]
        got = torch.cat([model.forward_cached(ids[:, a:b], cache) for a, b in zip(cuts, cuts[1:])], dim=1)
    assert cache.length == block
    assert (got - whole).abs().max().item() <= 1e-6
    with pytest.raises(ConfigError, match="exceed the block size"):
        model.forward_cached(ids[:, :1], cache)
    prompt, n = ids[:1, :5], block + 8                     # past the block size: the window is recomputed
    assert torch.equal(generate(model, prompt, n, temperature=0, use_cache=True),
                       generate(model, prompt, n, temperature=0))
    for seed in (0, 1):
        kw = dict(temperature=1.0, top_k=50, top_p=0.9)
        a = generate(model, prompt, n, generator=torch.Generator().manual_seed(seed), use_cache=True, **kw)
        b = generate(model, prompt, n, generator=torch.Generator().manual_seed(seed), **kw)
        assert a.shape == (1, 5 + n) and torch.equal(a, b)


def test_kv_cache_refuses_a_context_parallel_module():
    model = build_model("llama-tiny").eval()
    model.layers[1].attention.sequence = object()          # what a context-parallel plan sets
    with pytest.raises(ConfigError, match="context parallelism"):
        model.forward_cached(torch.zeros(1, 2, dtype=torch.long), KVCache(2, 32))


# -- runs through the CLI ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny random LlamaForCausalLM (vocabulary 320) with a BPE tokenizer.json of 300, and a corpus."""
    transformers = pytest.importorskip("transformers")
    from distrain.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("hf")
    rng = random.Random(0)
    words = "the king queen and of to a is my lord good sir what thou art".split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(600))
    (root / "corpus.txt").write_text(text)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "model")
    train_bpe([text], 300).save(root / "model")
    return root


@pytest.mark.timeout(100)
def test_generate_on_an_hf_initialised_run(hf_folder, tmp_path, capsys):
    shards, run = tmp_path / "shards", tmp_path / "run"
    _cli(capsys, "data", "prepare", hf_folder / "corpus.txt", "--tokenizer", hf_folder / "model", "--out", shards,
         "--no-progress")
    _cli(capsys, "train", "--init-from", hf_folder / "model", "--data", shards, "--out", run, *TRAIN)
    manifest = json.loads((run / "checkpoint.json").read_text())
    assert manifest["model"] == f"hf:{(hf_folder / 'model').resolve()}" and manifest["step"] == 2  # no preset
    gen = ["generate", run, "--prompt", "the king", "--max-new-tokens", "24", "--seed", "0"]
    text = _cli(capsys, *gen)
    assert text.startswith("the king") and len(text) > len("the king\n")
    assert _cli(capsys, *gen) == text                                     # the seed fixes the text
    assert _cli(capsys, *gen, "--no-cache") == text                       # the cache changes nothing
    assert _cli(capsys, *gen, "--seed", "1") != text
    assert _cli(capsys, *gen, "--top-p", "0.5") != text
    greedy = _cli(capsys, *gen, "--temperature", "0")
    assert _cli(capsys, *gen, "--temperature", "0", "--use-transformers") == greedy  # transformers' argmax too
    sampled = _cli(capsys, *gen, "--use-transformers", "--top-p", "0.9")
    assert sampled.startswith("the king") and _cli(capsys, *gen, "--use-transformers", "--top-p", "0.9") == sampled
    shutil.rmtree(shards)                 # the run's copy of the tokenizer decodes the same way
    assert _cli(capsys, *gen) == text
    for p in run.glob("checkpoint-*.pt"):  # the weights gone: one line, the file and what to do
        p.unlink()
    err = _error(capsys, *gen)
    assert err.startswith(f"distrain generate: {run / 'checkpoint.json'} names checkpoint-") and \
        "the checkpoint set is incomplete" in err


FACTORY = '''
from distrain.models import GPT, GPTConfig

def make_gpt():
    return GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16))
'''


@pytest.mark.timeout(100)
def test_generate_on_a_factory_run(tmp_path, monkeypatch, capsys):
    (tmp_path / "gen_nets.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    run = tmp_path / "run"
    _cli(capsys, "train", "--model", "gen_nets:make_gpt", "--data", "shakespeare", "--out", run, *TRAIN)
    gen = ["generate", run, "--model", "gen_nets:make_gpt", "--prompt", "KING", "--max-new-tokens", "30", "--seed",
           "3", "--top-p", "0.95"]  # (a factory is imported only when named: tests/test_trust_inputs.py)
    text = _cli(capsys, *gen)
    assert text.startswith("KING") and len(text.encode()) >= len("KING") + 30  # 30 bytes (some not UTF-8)
    assert _cli(capsys, *gen) == text and _cli(capsys, *gen, "--no-cache") == text
    err = _error(capsys, *gen, "--use-transformers")
    assert err.startswith("distrain generate --use-transformers: the run") and "trained a GPT" in err
    monkeypatch.delitem(sys.modules, "gen_nets")           # the factory no longer importable here
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    assert _error(capsys, *gen) == (f"distrain generate: the run {run} trained --model gen_nets:make_gpt, which "
                                    f"cannot be rebuilt here: cannot import gen_nets (No module named 'gen_nets'); "
                                    f"install the factory's package or add its folder to PYTHONPATH, and run again")
