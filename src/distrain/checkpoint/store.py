"""Checkpoints: files written atomically, read without executing pickled code, and
committed as a SET by one manifest.

One file (``save``/``load``): writing goes to a temporary file in the same folder, flushed
and fsynced, then renamed over the target with ``os.replace`` (atomic on POSIX): a crash
mid-write leaves the old file intact and no half-written file under the real name.
Reading uses ``torch.load(weights_only=True)``, which only rebuilds tensors and plain
containers, so a malicious or corrupt file cannot run code; a truncated or corrupt file
gives a ConfigError naming it.

A checkpoint set (``save_set``/``read_manifest``/``load_shard``), the same layout for
every way of training:

    out/checkpoint-{step:08d}-{shard}.pt   one per shard (written by the rank that owns it)
    out/checkpoint.json                    the manifest: step, layout, files; written LAST

Every owning rank writes its shard file under a name that includes the step, so the
previous set's files are never overwritten; a barrier waits for all of them; rank 0 then
commits the manifest atomically, and only after that deletes the previous set's files. A
crash at any moment therefore leaves either the old set (manifest still names it) or the
new one, both complete. Shards are named by what they hold: ``tp{t}-pp{p}`` for a model
replica or model-parallel shard (DDP and one process write ``tp0-pp0``), ``server{s}`` for
a parameter server's shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from distrain.errors import ConfigError

FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"


def _atomic_write(path: Path, write) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def save(path: str | os.PathLike, state: dict) -> Path:
    return _atomic_write(Path(path), lambda f: torch.save({"format": FORMAT_VERSION, **state}, f))


def load(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist; run without --resume to start afresh")
    if path.stat().st_size == 0:
        raise ConfigError(f"checkpoint {path} is empty (0 bytes): it was never written completely; delete it to "
                          f"start afresh")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle opcodes, a non-weights object...
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"checkpoint {path} is corrupt or truncated and cannot be loaded ({type(e).__name__}: "
                          f"{first}); delete it to start afresh") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {path} is not a distrain checkpoint (format {FORMAT_VERSION})")
    return state


def shard_file(step: int, shard: str) -> str:
    return f"checkpoint-{step:08d}-{shard}.pt"


def sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def clean_temporaries(out: str | os.PathLike) -> list[str]:
    """Delete the temporaries a save killed mid-write left behind (call only while no run
    writes ``out``, i.e. under its run lock). Returns their names."""
    gone = []
    for tmp in Path(out).glob(".checkpoint*.tmp"):
        tmp.unlink(missing_ok=True)
        gone.append(tmp.name)
    return gone


def save_set(out: str | os.PathLike, step: int, layout: dict, shard: str | None, state: dict | None,
             meta: dict | None = None) -> None:
    """Collective over the world: every rank calls it at the same step.

    ``shard``/``state``: what this rank writes (None on ranks that hold a copy another rank
    writes, e.g. DDP replicas other than rank 0). ``meta`` (rank 0's) goes into the manifest.
    Uses torch.distributed directly, not distrain.comm, so the traffic ledger only counts training.
    """
    out = Path(out)
    mine = None
    if shard is not None:
        path = save(out / shard_file(step, shard), {"step": step, "shard": shard, **state})
        mine = (path.name, sha256(path))
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, mine)  # doubles as the barrier: every shard is on disk
    if dist.get_rank() == 0:
        sums = dict(n for n in names if n is not None)
        files = sorted(sums)
        manifest = {"format": FORMAT_VERSION, "step": step, "layout": layout, "files": files, "sha256": sums,
                    **(meta or {})}
        write_manifest(out, manifest)
        for old in out.glob("checkpoint-*.pt"):  # the previous sets, now superseded
            if old.name not in files:
                old.unlink(missing_ok=True)
    dist.barrier()  # nobody goes on (or exits) before the set is committed


def write_manifest(out: str | os.PathLike, manifest: dict) -> Path:
    """Commit a set: write ``out/checkpoint.json`` atomically (after every file it names is on disk)."""
    return _atomic_write(Path(out) / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))


def read_manifest(out: str | os.PathLike) -> dict:
    """The committed manifest of ``out``, or a one-line ConfigError saying what is wrong."""
    path = Path(out) / MANIFEST
    if not path.exists():
        raise ConfigError(f"--resume: checkpoint {path} does not exist; run without --resume to start afresh")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--resume: {path} is corrupt ({e}); delete the run folder or start without "
                          f"--resume") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION or "step" not in manifest:
        raise ConfigError(f"--resume: {path} is not a distrain checkpoint manifest (format {FORMAT_VERSION})")
    missing = [f for f in manifest.get("files", []) if not (Path(out) / f).exists()]
    if missing:
        raise ConfigError(f"--resume: {path} names {', '.join(missing)}, which do not exist; the checkpoint set is "
                          f"incomplete; start afresh")
    return manifest


def verify(out: str | os.PathLike, manifest: dict, names: list[str] | None = None) -> None:
    """Every file of the set (or ``names``) is non-empty and matches its checksum in the manifest."""
    for name in names if names is not None else manifest.get("files", []):
        path = Path(out) / name
        if path.exists() and path.stat().st_size == 0:
            raise ConfigError(f"--resume: checkpoint {path} is empty (0 bytes): it was never written completely; "
                              f"restore it or start afresh")
        want = manifest.get("sha256", {}).get(name)
        if want is not None and path.exists() and sha256(path) != want:
            raise ConfigError(f"--resume: {path} does not match the checksum in {MANIFEST} (the file was corrupted "
                              f"or changed after it was written); restore it or start afresh")


def load_shard(out: str | os.PathLike, manifest: dict, shard: str) -> dict:
    """This rank's shard of the committed set; checks it belongs to the manifest's step."""
    name = shard_file(int(manifest["step"]), shard)
    if name not in manifest["files"]:
        raise ConfigError(f"--resume: the checkpoint in {out} has no shard {shard!r} (it holds "
                          f"{', '.join(manifest['files'])}); resume with the layout it was written with")
    verify(out, manifest, [name])
    state = load(Path(out) / name)
    if int(state["step"]) != int(manifest["step"]):
        raise ConfigError(f"{name} is at step {state['step']} but {MANIFEST} at {manifest['step']}: "
                          f"the checkpoint set is inconsistent; start afresh")
    return state
