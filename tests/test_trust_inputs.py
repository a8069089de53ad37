"""Inputs from disk are data: they cannot run code, crash the reader, or reach outside their folder.

* a token shard folder: only the token types ``data prepare`` writes (a ``"dtype": "O"`` meta.json made
  numpy read file bytes as object pointers: a segfault), only plain names of regular files inside the
  folder, counts checked against the files; one line naming the folder, the field and the fix;
* a checkpoint: a model factory its manifest (or a consolidated file) names is never imported; the run
  is resumed, used for ``--init-from``, imported or sampled only when ``--model`` names the factory again;
  its manifest's file names stay in the folder;
* a Hugging Face index: its file names stay in the folder, refused before any file is opened;
* the run lock: a planted ``.distrain.lock`` symlink (or hard link, FIFO) is refused and its target left
  as it was; an ``--out`` of another user, or writable by others, is refused before anything is written;
* a full disk (a real tmpfs) during a checkpoint: one line (folder, bytes needed, ENOSPC), the previous
  set intact and loadable, nothing of the failed set left behind.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distrain
from distrain import checkpoint, runlock
from distrain.checkpoint.read import load_llama
from distrain.checkpoint.reshard import consolidate
from distrain.checkpoint.write import import_file
from distrain.cli import main as cli_main
from distrain.data import prepare as prep
from distrain.data.shards import load_shard_datasets, read_meta
from distrain.errors import ConfigError
from distrain.models import build_model

from conftest import trainer_config

ROOT = os.geteuid() == 0
SRC = str(Path(distrain.__file__).resolve().parents[1])  # the distrain under test, for subprocesses


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line: {err!r}"
    return err.removeprefix("distrain: error: ").rstrip("\n")


def _refused(fn) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


# -- token shard folders ------------------------------------------------------------------------------------------
@pytest.fixture
def shards(tmp_path) -> Path:
    """A byte-token shard folder of two shard files, as `distrain data prepare` writes it."""
    (tmp_path / "c.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 100)
    out = tmp_path / "d"
    prep.prepare([str(tmp_path / "c.txt")], "byte", out, shard_tokens=3000, progress=False)
    return out


def _edit(folder: Path, **fields) -> Path:
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(fields)
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def _redo(folder) -> str:
    return f"re-create it with `distrain data prepare INPUT... --tokenizer SPEC --out {folder} --overwrite`"


def _read_a_batch(folder: str, answer) -> None:
    try:
        train, _ = load_shard_datasets(folder, 8)
        answer.send(f"{train.get_batch([0, 1])[0].sum().item()}\n")
    except ConfigError as e:
        answer.send(f"{type(e).__name__} {e}\n")


def _read_a_batch_in_a_child(folder: Path) -> tuple[int | None, str]:
    """Read a batch of ``folder`` in a forked child (so a reader that crashes takes only the child; forked, not a
    fresh interpreter: the modules are already imported): (its exit code, what it answered or "")."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    answers, answer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_read_a_batch, args=(str(folder), answer))
    child.start()
    answer.close()
    try:
        got = answers.recv() if answers.poll(60) else ""
    except EOFError:  # it died before answering
        got = ""
    child.join(60)
    if child.exitcode is None:
        child.kill()
        child.join()
    return child.exitcode, got


def test_an_object_dtype_shard_folder_is_refused_in_one_line_without_a_crash(shards):
    # 8-byte "objects": the file sizes fit the counts, so only the dtype rule stops numpy from reading pointers
    m = json.loads((shards / "meta.json").read_text())
    total = sum(s["tokens"] for s in m["shards"]) // 4
    _edit(shards, dtype="O", tokens=total,
          shards=[{"file": s["file"], "tokens": s["tokens"] // 4} for s in m["shards"]],
          splits={"train": {"start": 0, "tokens": total - 100}, "val": {"start": total - 100, "tokens": 100}})
    code, got = _read_a_batch_in_a_child(shards)
    assert code == 0, f"the reader died ({code})"
    assert got == (f"ConfigError shard folder {shards}: meta.json field dtype is 'O'; `distrain data prepare` "
                          f"writes token files of uint16 or uint32 only; {_redo(shards)}\n")


def test_the_token_types_read_are_those_prepare_writes():
    from distrain.data.shards import DTYPES

    written = {prep.token_dtype(v) for v in (2, 256, 65536, 65537, 1 << 20, 1 << 32)}
    assert written == set(DTYPES.values()) and {d.name for d in written} == set(DTYPES)


@pytest.mark.parametrize("name", ["../outside.bin", "/abs/outside.bin", "sub/tokens.bin", "..", ""])
def test_a_shard_file_name_outside_the_folder_is_refused(shards, name):
    (shards.parent / "outside.bin").write_bytes((shards / "tokens-00000.bin").read_bytes())  # the right size
    m = json.loads((shards / "meta.json").read_text())
    _edit(shards, shards=[dict(m["shards"][0], file=name), *m["shards"][1:]])
    assert _refused(lambda: read_meta(shards)) == (
        f"shard folder {shards}: meta.json field shards[0].file is {name!r}, not a plain file name inside the folder "
        f"(no '/', '..' or absolute path); {_redo(shards)}")


def test_a_symlinked_shard_or_tokenizer_file_is_refused(shards):
    outside = shards.parent / "outside.bin"
    shutil.move(shards / "tokens-00001.bin", outside)
    (shards / "tokens-00001.bin").symlink_to(outside)
    assert _refused(lambda: read_meta(shards)) == (
        f"shard folder {shards}: {shards / 'tokens-00001.bin'} (its meta.json field shards[1].file) is a symlink; a "
        f"shard folder holds its own regular files: copy the file in instead of linking it, or {_redo(shards)}")
    shutil.move(outside, shards / "tokens-00001.bin")
    _edit(shards, tokenizer={"spec": "byte", "file": "../c.txt"})
    assert _refused(lambda: read_meta(shards, check_files=False)) == (
        f"shard folder {shards}: meta.json field tokenizer.file is '../c.txt', not a plain file name inside the "
        f"folder (no '/', '..' or absolute path); {_redo(shards)}")


@pytest.mark.parametrize("fields, field, why", [
    (dict(tokens=10 ** 12), "tokens", "is 1000000000000 but its shards hold 4,400 tokens"),
    (dict(splits={"train": {"start": -5, "tokens": 100}, "val": {"start": 0, "tokens": 0}}), "splits.train",
     "is {'start': -5, 'tokens': 100}, not {\"start\": INDEX, \"tokens\": COUNT}"),
    (dict(splits={"train": {"start": 4000, "tokens": 4000}, "val": {"start": 0, "tokens": 0}}), "splits.train",
     "ends at token 8,000 but the shards hold 4,400"),
    (dict(vocab_size=70000), "vocab_size", "is 70000, not a positive integer that uint16 holds (at most 65,536)"),
    (dict(shards=[{"file": "tokens-00000.bin", "tokens": "3000"}]), "shards[0]",
     "is {'file': 'tokens-00000.bin', 'tokens': '3000'}, not {\"file\": NAME, \"tokens\": COUNT}"),
])
def test_counts_in_meta_json_are_checked_before_use(shards, fields, field, why):
    _edit(shards, **fields)
    assert _refused(lambda: load_shard_datasets(shards, 8)) == (
        f"shard folder {shards}: meta.json field {field} {why}; {_redo(shards)}")


# -- checkpoints never supply code -------------------------------------------------------------------------------
NETS = '''
from pathlib import Path
(Path(__file__).parent / "imported.marker").write_text("imported")  # what any code run on import could do
from distrain.models import GPT, GPTConfig

def make():
    return GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16))
'''
TRAIN = ["--data", "shakespeare", "--steps", "2", "--batch-size", "4", "--strategy", "single", "--nproc", "1",
         "--eval-every", "0", "--sample-chars", "0", "--no-progress", "--no-report"]


@pytest.fixture
def factory_run(tmp_path, monkeypatch):
    """A run folder (and a consolidated file) whose model is the factory trust_nets:make, a module that leaves
    a marker file when imported; the marker is gone and the module unloaded when the test starts."""
    (tmp_path / "trust_nets.py").write_text(NETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{SRC}")
    sys.modules.pop("trust_nets", None)  # (another test's)
    import trust_nets

    run = tmp_path / "run"
    import_file(_saved(tmp_path, trust_nets.make()), run, model="trust_nets:make")  # the user named it: imported
    checkpoint.save(tmp_path / "whole.pt", consolidate(run))  # `checkpoint consolidate RUN -o whole.pt`
    del sys.modules["trust_nets"]
    (tmp_path / "imported.marker").unlink()
    yield run
    sys.modules.pop("trust_nets", None)


def _saved(folder: Path, model) -> Path:
    torch.save(model.state_dict(), folder / "w.pt")
    return folder / "w.pt"


def test_a_factory_named_by_a_checkpoint_is_never_imported(factory_run, tmp_path, capsys):
    run, marker = factory_run, tmp_path / "imported.marker"
    assert json.loads((run / "checkpoint.json").read_text())["model"] == "trust_nets:make"
    assert cli_main(["train", "--out", str(run), "--resume", "--reshard", *TRAIN]) == 2
    assert _error(capsys) == (f"--resume: {run} was trained with the model factory trust_nets:make, which distrain "
                              f"does not import from a checkpoint; pass --model trust_nets:make to resume it")
    assert cli_main(["train", "--init-from", str(run), "--out", str(tmp_path / "b"), *TRAIN]) == 2
    assert _error(capsys) == (f"--init-from {run} was trained with the model factory trust_nets:make, which distrain "
                              f"does not import from a checkpoint; pass --model trust_nets:make to start from it")
    whole = tmp_path / "whole.pt"
    assert cli_main(["train", "--init-from", str(whole), "--out", str(tmp_path / "b"), *TRAIN]) == 2
    assert _error(capsys) == (f"--init-from {whole} was trained with the model factory trust_nets:make, which "
                              f"distrain does not import from a checkpoint; pass --model trust_nets:make to start "
                              f"from it")
    assert cli_main(["checkpoint", "import", str(whole), "--out", str(tmp_path / "c")]) == 2
    assert _error(capsys) == (f"checkpoint import: {whole} was trained with the model factory trust_nets:make, which "
                              f"distrain does not import from a checkpoint; pass --model trust_nets:make to import it")
    assert cli_main(["generate", str(run), "--max-new-tokens", "2"]) == 2
    assert _error(capsys) == (f"distrain generate: the run {run} was trained with the model factory trust_nets:make, "
                              f"which distrain does not import from a checkpoint; pass --model trust_nets:make to "
                              f"generate from it")
    assert cli_main(["generate", str(run), "--model", "gpt-tiny"]) == 2
    assert _error(capsys) == (f"distrain generate: the run {run} trained --model trust_nets:make, not --model "
                              f"gpt-tiny; give --model trust_nets:make (or leave --model out for a preset or hf:DIR "
                              f"run)")
    assert not marker.exists() and "trust_nets" not in sys.modules  # never imported
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_a_manifest_naming_library_code_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    import_file(_saved(tmp_path, build_model("gpt-tiny")), run, model="gpt-tiny")
    manifest = json.loads((run / "checkpoint.json").read_text())
    (run / "checkpoint.json").write_text(json.dumps(dict(manifest, model="platform:uname")))
    for args, verb in ((["--out", str(run), "--resume", "--reshard"], "resume"),
                       (["--init-from", str(run), "--out", str(tmp_path / "b")], "start from")):
        assert cli_main(["train", *args, *TRAIN]) == 2
        where = f"--resume: {run}" if verb == "resume" else f"--init-from {run}"
        assert _error(capsys) == (f"{where} was trained with the model factory platform:uname, which distrain does "
                                  f"not import from a checkpoint; pass --model platform:uname to {verb} it")


@pytest.mark.slow
@pytest.mark.timeout(110)
def test_a_factory_run_resumes_and_starts_others_when_model_names_it(factory_run, tmp_path, capsys):
    run = factory_run
    assert cli_main(["train", "--out", str(run), "--resume", "--reshard", "--model", "trust_nets:make", *TRAIN]) == 0
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 2
    b = tmp_path / "b"
    assert cli_main(["train", "--init-from", str(run), "--out", str(b), "--model", "trust_nets:make", *TRAIN]) == 0
    assert json.loads((b / "checkpoint.json").read_text())["model"] == "trust_nets:make"
    # another factory than the run's: what --resume says of any changed --model
    assert cli_main(["train", "--out", str(run), "--resume", "--model", "gpt-tiny", *TRAIN, "--steps", "3"]) == 2
    assert _error(capsys).startswith(f"--resume: checkpoint {run / 'checkpoint.json'} holds model 'trust_nets:make', "
                                     f"this run trains --model gpt-tiny; resume with the same --model")


@pytest.mark.parametrize("name", ["../outside.pt", "/tmp/outside.pt", "sub/checkpoint-00000000-full.pt"])
def test_a_manifest_file_name_outside_the_run_folder_is_refused(tmp_path, capsys, name):
    run = tmp_path / "run"
    import_file(_saved(tmp_path, build_model("gpt-tiny")), run, model="gpt-tiny")
    shutil.copy(run / "checkpoint-00000000-full.pt", tmp_path / "outside.pt")
    manifest = json.loads((run / "checkpoint.json").read_text())
    (run / "checkpoint.json").write_text(json.dumps(dict(manifest, files=[name])))
    want = (f"{run / 'checkpoint.json'} field files names {name!r}, not a checkpoint file of this folder "
            f"(checkpoint-STEP-SHARD.pt: no '/', no '..', never an absolute path); the manifest was not written by "
            f"distrain (or was edited): restore it or start afresh")
    assert _refused(lambda: checkpoint.read_manifest(run)) == "--resume: " + want
    assert cli_main(["checkpoint", "consolidate", str(run), "-o", str(tmp_path / "x.pt")]) == 2
    assert _error(capsys) == "checkpoint consolidate: " + want.replace("restore it or start afresh",
                                                                       "restore it from a copy")
    assert not (tmp_path / "x.pt").exists()


# -- Hugging Face indexes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["../outside.safetensors", "ABS", "sub/model.safetensors"])
def test_an_hf_index_naming_a_file_outside_the_folder_is_refused(tmp_path, capsys, where):
    from distrain.checkpoint.hf import write_hf
    from distrain.models import preset_config
    from distrain.models.llama import LlamaConfig, to_hf

    cfg = LlamaConfig(**preset_config("llama-tiny"))
    hf_sd, hf_cfg = to_hf(build_model("llama-tiny").state_dict(), cfg)
    folder = tmp_path / "hf"
    write_hf(folder, hf_sd, hf_cfg, {})
    (folder / "sub").mkdir()
    name = str(tmp_path / "outside.safetensors") if where == "ABS" else where
    shutil.move(folder / "model.safetensors", folder / name)  # a complete, valid set of weights: only the name is bad
    index = {"metadata": {}, "weight_map": {n: name for n in hf_sd}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    first = next(iter(hf_sd))
    want = (f"{folder / 'model.safetensors.index.json'} puts tensor {first!r} in {name!r}, which is not a file name "
            f"inside {folder} (no '/', no '..', never an absolute path); download the model again")
    assert _refused(lambda: load_llama(folder, "checkpoint import")) == "checkpoint import: " + want
    assert cli_main(["checkpoint", "import", "--hf", str(folder), "-o", str(tmp_path / "run")]) == 2
    assert _error(capsys) == "checkpoint import: " + want
    assert not (tmp_path / "run").exists()


# -- the run lock and whose --out ------------------------------------------------------------------------------------
@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo"])
def test_a_planted_lock_file_is_refused_and_its_target_untouched(tmp_path, plant):
    out, target = tmp_path / "run", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("keep me\n")
    lock = out / runlock.LOCK_NAME
    if plant == "fifo":
        os.mkfifo(lock)  # (opening it must not block)
    else:
        (lock.symlink_to if plant == "symlink" else lock.hardlink_to)(target)

    def take():
        with runlock.hold(out):
            pass

    what = {"symlink": "a symlink, which a run never follows",
            "hardlink": "a file with 2 hard links, not one this user's runs made",
            "fifo": "not a regular file, not one this user's runs made"}[plant]
    assert _refused(take) == f"--out {out}: its lock file {lock} is {what}; remove it (rm {lock}) and run again"
    assert target.read_text() == "keep me\n"
    lock.unlink()
    take()  # once removed, the folder is usable
    assert target.read_text() == "keep me\n"


def _hold(out):
    with runlock.hold(out):
        pass


@pytest.mark.skipif(not ROOT, reason="giving a folder to another user (os.chown) needs root")
def test_an_out_of_another_user_or_writable_by_others_is_refused_before_anything_is_written(tmp_path, capsys):
    nobody = pwd.getpwnam("nobody")
    out = tmp_path / "theirs"
    out.mkdir()
    os.chown(out, nobody.pw_uid, nobody.pw_gid)
    assert cli_main(["train", "--out", str(out), "--model", "gpt-tiny", *TRAIN]) == 2
    assert _error(capsys) == (f"--out {out} belongs to nobody (uid {nobody.pw_uid}), not to this user "
                              f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()}); a run writes only into its "
                              f"own user's folders: choose another --out (or run as its owner)")
    assert list(out.iterdir()) == []  # no lock, no file
    mine = tmp_path / "mine"
    mine.mkdir()
    for mode in (0o777, 0o1777, 0o703):
        os.chmod(mine, mode)
        assert _refused(lambda: _hold(mine)) == (
            f"--out {mine} is writable by every user (mode {mode:o}), so another user could plant or replace its "
            f"checkpoint files; `chmod o-w {mine}`, or choose another --out")
    os.chown(mine, os.geteuid(), nobody.pw_gid)  # a group that is not this user's own
    os.chmod(mine, 0o775)
    group = grp.getgrgid(nobody.pw_gid).gr_name
    assert _refused(lambda: _hold(mine)) == (
        f"--out {mine} is writable by the group {group} (mode 775), so another user could plant or replace its "
        f"checkpoint files; `chmod g-w {mine}`, or choose another --out")
    assert list(mine.iterdir()) == []
    os.chmod(mine, 0o755)
    _hold(mine)
    assert [p.name for p in mine.iterdir()] == [runlock.LOCK_NAME]
    me, own = pwd.getpwuid(os.geteuid()), grp.getgrgid(os.getegid())
    if own.gr_name == me.pw_name and set(own.gr_mem) <= {me.pw_name}:  # a user-private group (umask 002 systems)
        os.chown(mine, os.geteuid(), os.getegid())
        os.chmod(mine, 0o775)
        _hold(mine)


# -- a full disk during a checkpoint -----------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs (root only: mount(8)); unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({got.stderr.strip() or got.returncode}): needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _used(disk: Path) -> int:
    st = os.statvfs(disk)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.slow
@pytest.mark.timeout(110)
def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_previous_set(small_disk, capsys):
    run = small_disk / "run"
    import_file(_saved(small_disk.parent, build_model("gpt-small")), run, model="gpt-small")  # 3.5 MB: step 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.name != runlock.LOCK_NAME}
    # room for the run's small files, not for the 10 MB set of step 2 (weights and AdamW's two moments)
    room = _used(small_disk) + (1 << 20)
    subprocess.run(["mount", "-o", f"remount,size={room}", str(small_disk)], check=True)
    args = ["train", "--out", str(run), "--resume", "--reshard", "--model", "gpt-small", *TRAIN, "--batch-size", "2"]
    assert cli_main(args) == 2
    err = _error(capsys)
    # the rank's own line (the trainer runs rank 0 in a process of its own)
    assert err.startswith("rank 0 failed: CheckpointWriteError: "), err
    line = err.removeprefix("rank 0 failed: CheckpointWriteError: ")
    assert line.startswith(f"checkpoint of step 2 into {run} failed with ENOSPC (No space left on device): the set "
                           f"needs about "), err
    needed = float(line.split("needs about ")[1].split(" MB")[0])
    assert 9.5 < needed < 11.5, line  # 867,072 float32 parameters x 3 (weights, exp_avg, exp_avg_sq) = 10.4 MB
    assert line.endswith("free; nothing of it was kept and the previous checkpoint there is intact: free some space "
                         "or choose another --out"), line
    # the previous set: committed, byte for byte, loadable; nothing of step 2, no temporary
    assert {p.name for p in run.iterdir()} >= set(before)
    assert not [p.name for p in run.iterdir() if p.name.startswith(".checkpoint") or "00000002" in p.name]
    for name, data in before.items():
        if name.startswith("checkpoint"):
            assert (run / name).read_bytes() == data, name
    manifest = checkpoint.read_manifest(run)
    assert manifest["step"] == 0
    assert set(consolidate(run, manifest)["model"]) == set(build_model("gpt-small").state_dict())


class _FullDisk:
    """A file that takes ``room`` bytes and then fails as a full disk does (ENOSPC from the write)."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(28, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _save_on_a_full_disk(rank: int, out: str, fail: str) -> list:
    """Rank ``rank`` of 2: commits the set of step 1, then saves step 2 with the disk full under rank 1's shard
    (``fail="shard"``) or under rank 0's manifest (``"manifest"``: rank 0 writes no shard at step 2)."""
    from distrain.checkpoint import store

    store.save_set(out, 1, {"dp": 2}, f"s{rank}", {"w": torch.full((1000,), float(rank))}, meta={"model": "gpt-tiny"})
    full = rank == (1 if fail == "shard" else 0)
    real = os.fdopen
    if full:  # every file this rank opens from now on: the lowest write store.py makes fails
        store.os.fdopen = lambda fd, mode: _FullDisk(real(fd, mode), 64)
    try:
        shard = None if (fail == "manifest" and rank == 0) else f"s{rank}"
        store.save_set(out, 2, {"dp": 2}, shard, {"w": torch.full((1000,), 2.0)}, meta={"model": "gpt-tiny"})
    except store.CheckpointWriteError as e:
        return [(str(e), e.errno_name)]
    finally:
        store.os.fdopen = real
    return [("saved", "")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fail", ["shard", "manifest"])
def test_a_write_failing_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_previous_set(tmp_path, fail):
    out = tmp_path / "run"
    got = distrain.spawn(_save_on_a_full_disk, 2, args=(str(out), fail), timeout=80)
    rank = 1 if fail == "shard" else 0
    want = (f"checkpoint of step 2 into {out} failed with ENOSPC (rank {rank}: No space left on device): the set "
            f"needs about ")
    for [(line, name)] in got:  # the same one line on both ranks
        assert name == "ENOSPC" and line.startswith(want) and line == got[0][0][0], line
        assert line.endswith(" free; nothing of it was kept and the previous checkpoint there is intact: free some "
                             "space or choose another --out"), line
    needed = int(line.removeprefix(want).split(" bytes, ")[0].replace(",", ""))
    shard = 1000 * 4 + 64  # a shard's tensor bytes, and a little for its dict
    if fail == "shard":
        assert needed == 2 * shard  # both ranks' shards
    else:
        assert shard + 200 < needed < shard + 600  # rank 1's shard and the manifest
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-00000001-s0.pt", "checkpoint-00000001-s1.pt",
                                                     "checkpoint.json"]
    manifest = checkpoint.read_manifest(out)
    assert manifest["step"] == 1
    for r in range(2):
        assert torch.equal(checkpoint.load_shard(out, manifest, f"s{r}")["w"], torch.full((1000,), float(r)))
