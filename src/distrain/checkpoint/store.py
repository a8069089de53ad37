"""Checkpoints: files written atomically, read without executing pickled code, and
committed as a SET by one manifest.

One file (``save``/``load``): writing goes to a temporary file in the same folder, flushed
and fsynced, then renamed over the target with ``os.replace`` (atomic on POSIX) and the
folder fsynced (so the new name is on disk too): a crash mid-write leaves the old file intact
and no half-written file under the real name. A write that fails (a full disk: ENOSPC, a
quota: EDQUOT, an I/O error) removes its temporary and raises :class:`CheckpointWriteError`,
one line naming the folder, about how many bytes were needed and the errno's name.
Reading uses ``torch.load(weights_only=True)``, which only rebuilds tensors and plain
containers, so a malicious or corrupt file cannot run code; a truncated or corrupt file
gives a ConfigError naming it.

A checkpoint set (``save_set``/``read_manifest``/``load_shard``), the same layout for
every way of training:

    out/checkpoint-{step:08d}-{shard}.pt   one per shard (written by the rank that owns it)
    out/checkpoint.json                    the manifest: step, layout, files; written LAST

Every owning rank writes its shard file under a name that includes the step, so the
previous set's files are never overwritten; a barrier waits for all of them; rank 0 then
commits the manifest atomically, fsyncs the folder, and only after that deletes the previous
set's files. A crash at any moment therefore leaves either the old set (manifest still names
it) or the new one, both complete. A write that fails on any rank fails the whole save on
every rank alike (CheckpointWriteError): the files of the new set already written are
deleted, and the previous set, still committed, stays as it was. Shards are named by what
they hold: ``tp{t}-pp{p}`` for a model replica or model-parallel shard (DDP and one process
write ``tp0-pp0``), ``server{s}`` for a parameter server's shard.

A manifest is data: :func:`read_manifest` accepts only file names of the form the writer
gives (``checkpoint-STEP-SHARD.pt``: no separator, no ``..``, never absolute), checked before
any file is opened, and the fields the readers use by type.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from distrain import comm
from distrain.errors import ConfigError, DistrainError

FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"
SHARD_FILE = re.compile(r"checkpoint-\d{8,}-[A-Za-z0-9_-]+\.pt")  # what shard_file() names, and nothing else


class CheckpointWriteError(DistrainError, OSError):
    """A checkpoint file could not be written (``errno_name``: e.g. ENOSPC for a full disk): the message is one
    line naming the folder, about how many bytes were needed and the errno; nothing of the failed write is left,
    and a checkpoint set that was committed before stays committed and intact. An OSError too (what a failed
    write was before it had a message of its own)."""

    def __init__(self, message: str, errno_name: str, needed: int, placed: bool = False):
        super().__init__(message)
        self.errno_name, self.needed = errno_name, needed
        self.placed = placed  # the file was renamed into place; only the folder's fsync failed


class _Recorded:
    """A file's ``write``/``flush`` that remember the OSError under them (torch.save reports a failed write as
    a RuntimeError of its own; this says it was the file, and which errno)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = self.error or e
            raise


def nbytes(obj) -> int:
    """About how many bytes ``obj`` (tensors in dicts, lists and tuples) takes in a checkpoint file."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values()) + 64 * len(obj)
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj) + 8 * len(obj)
    return 16


def _amount(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n:,} bytes"


def _room(folder: Path, code: int | None) -> str:
    """", N MB free" after a full disk or quota (what is left for this user), else ""."""
    if code not in (errno.ENOSPC, errno.EDQUOT):
        return ""
    try:
        st = os.statvfs(folder)
    except OSError:
        return ""
    return f", {_amount(st.f_bavail * st.f_frsize)} free"


def fsync_folder(folder: str | os.PathLike) -> None:
    """Make the names just renamed into ``folder`` durable (fsync of the directory itself)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _errno_name(code: int | None) -> str:
    return errno.errorcode.get(code, f"errno {code}") if code else "EIO"


def _atomic_write(path: Path, write, needed: int = 0) -> Path:
    """``write(f)`` into a temporary beside ``path``, fsynced, renamed to ``path``, the folder fsynced; a failed
    write (the file's OSError, however the writer reported it) leaves nothing and raises CheckpointWriteError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    f, placed = _Recorded(None), False
    try:
        with os.fdopen(fd, "wb") as raw:
            f.f = raw
            write(f)
            f.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
        placed = True
        fsync_folder(path.parent)
    except BaseException as e:
        failed = e if isinstance(e, OSError) else f.error
        if not placed:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if failed is None:
            raise
        name = _errno_name(failed.errno)
        kept = "it was renamed into place but may not be on disk" if placed else "nothing of it was kept"
        raise CheckpointWriteError(f"checkpoint: writing {path.name} into {path.parent} failed with {name} "
                                   f"({failed.strerror or failed}): it needs about {_amount(needed)}"
                                   f"{_room(path.parent, failed.errno)}; {kept}: free some space there or write "
                                   f"elsewhere", name, needed, placed) from None
    return path


def save(path: str | os.PathLike, state: dict) -> Path:
    """``state`` (plus the format number) into ``path``, atomically (module docstring); CheckpointWriteError
    when the file cannot be written."""
    return _atomic_write(Path(path), lambda f: torch.save({"format": FORMAT_VERSION, **state}, f), nbytes(state))


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
    Uses torch.distributed's own collectives (``comm.all_gather_data(..., algorithm=None)``: data only, no
    pickle), so the traffic ledger only counts training.
    """
    out = Path(out)
    mine, path, fresh = None, None, False
    if shard is not None:
        need, path = nbytes(state), out / shard_file(step, shard)
        fresh = not path.exists()  # (not: the committed set's own file, when a resume saves its step again)
        try:
            save(path, {"step": step, "shard": shard, **state})
            mine = ("ok", need, path.name, sha256(path), fresh)
        except OSError as e:  # (a CheckpointWriteError, or any other) every rank learns of it below, and fails alike
            mine = ("failed", need, _errno_of(e), dist.get_rank())
    # doubles as the barrier: every shard is on disk (or failed)
    written = [n for n in comm.all_gather_data(mine, algorithm=None) if n is not None]
    need = sum(n[1] for n in written)
    failed = next((n for n in written if n[0] == "failed"), None)
    if failed is not None:
        if fresh:
            path.unlink(missing_ok=True)  # no file of a set that is never committed
        with comm.transport_errors("checkpoint: the failed set's barrier"):
            dist.barrier()  # every rank's file of the failed set is gone
        raise _set_failed(out, step, failed[2], need, f"rank {failed[3]}" if dist.get_world_size() > 1 else "")
    outcome = None
    if dist.get_rank() == 0:
        sums = {n[2]: n[3] for n in written}
        files = sorted(sums)
        manifest = {"format": FORMAT_VERSION, "step": step, "layout": layout, "files": files, "sha256": sums,
                    **(meta or {})}
        try:
            write_manifest(out, manifest)  # (it fsyncs the folder: the new set is committed on disk)
        except OSError as e:
            if not getattr(e, "placed", False):  # (placed: the new manifest names them, only the folder's fsync failed)
                for n in written:
                    if n[4]:
                        (out / n[2]).unlink(missing_ok=True)
            outcome = (_errno_of(e), getattr(e, "needed", 0))
        else:
            for old in out.glob("checkpoint-*.pt"):  # the previous sets, now superseded
                if old.name not in files:
                    old.unlink(missing_ok=True)
    # nobody goes on (or exits) before the set is committed (or given up); rank 0's outcome to all
    outcome = comm.all_gather_data(outcome, algorithm=None)[0]
    if outcome is not None:
        raise _set_failed(out, step, outcome[0], need + outcome[1], "rank 0" if dist.get_world_size() > 1 else "")


def _errno_of(e: OSError) -> str:
    """The errno's name of a failed write (a CheckpointWriteError's, or the OSError's; EIO when none)."""
    return getattr(e, "errno_name", None) or _errno_name(e.errno)


def _set_failed(out: Path, step: int, errno_name: str, needed: int, rank: str) -> CheckpointWriteError:
    """Every rank's error when the set of ``step`` could not be written (``rank``: where it failed)."""
    code = getattr(errno, errno_name, None)
    why = os.strerror(code) if isinstance(code, int) else errno_name
    return CheckpointWriteError(f"checkpoint of step {step} into {out} failed with {errno_name} "
                                f"({f'{rank}: ' if rank else ''}{why}): the set needs about {_amount(needed)}"
                                f"{_room(out, code)}; nothing of it was kept and the previous checkpoint there is "
                                f"intact: free some space or choose another --out", errno_name, needed)


def write_manifest(out: str | os.PathLike, manifest: dict) -> Path:
    """Commit a set: write ``out/checkpoint.json`` atomically (after every file it names is on disk)."""
    data = json.dumps(manifest, indent=2).encode()
    return _atomic_write(Path(out) / MANIFEST, lambda f: f.write(data), len(data))


def read_manifest(out: str | os.PathLike) -> dict:
    """The committed manifest of ``out``, or a one-line ConfigError saying what is wrong."""
    path = Path(out) / MANIFEST
    if not path.exists():
        raise ConfigError(f"--resume: checkpoint {path} does not exist; run without --resume to start afresh")
    try:
        if not path.is_file():  # a FIFO would block the read
            raise ValueError("not a regular file")
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"--resume: {path} is corrupt ({e}); delete the run folder or start without "
                          f"--resume") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION or "step" not in manifest:
        raise ConfigError(f"--resume: {path} is not a distrain checkpoint manifest (format {FORMAT_VERSION})")
    _check_fields(path, manifest)
    manifest["layout"] = grid_layout(manifest.get("layout"))
    missing = [f for f in manifest.get("files", []) if not (Path(out) / f).exists()]
    if missing:
        raise ConfigError(f"--resume: {path} names {', '.join(missing)}, which do not exist; the checkpoint set is "
                          f"incomplete; start afresh")
    return manifest


def _check_fields(path: Path, manifest: dict) -> None:
    """The fields the readers use, by type; the file names as the writer gives them, before any is opened."""
    def bad(field: str, why: str) -> ConfigError:
        return ConfigError(f"--resume: {path} field {field} {why}; the manifest was not written by distrain (or was "
                           f"edited): restore it or start afresh")

    step = manifest["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise bad("step", f"is {step!r}, not a step number")
    files = manifest.get("files", [])
    if not isinstance(files, list):
        raise bad("files", f"is {type(files).__name__}, not a list of file names")
    for name in files:
        if not (isinstance(name, str) and SHARD_FILE.fullmatch(name)):
            raise bad("files", f"names {name!r}, not a checkpoint file of this folder (checkpoint-STEP-SHARD.pt: no "
                               f"'/', no '..', never an absolute path)")
    sums = manifest.get("sha256", {})
    if not (isinstance(sums, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items())):
        raise bad("sha256", "is not {file name: hex digest}")
    for field in ("model", "strategy"):
        if not isinstance(manifest.get(field), (str, type(None))):
            raise bad(field, f"is {manifest[field]!r}, not a name")
    for field in ("config", "model_config", "hf_config", "layout"):
        if not isinstance(manifest.get(field), (dict, type(None))):
            raise bad(field, f"is {type(manifest[field]).__name__}, not a JSON object")


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


def grid_layout(layout: dict | None) -> dict | None:
    """A manifest's layout as the grid engine records it: a set written by the ZeRO engine of before
    (``{"zero": N, "dp": P}``) is the grid's ``{"dp": P, "tp": 1, "pp": 1, "zero": N}``."""
    if isinstance(layout, dict) and "zero" in layout and "tp" not in layout:
        return {"dp": layout.get("dp"), "tp": 1, "pp": 1, "zero": layout["zero"]}
    return layout


def _written_as(manifest: dict, shard: str) -> str:
    """The file of ``shard`` in the committed set: its own name, or the name a set written before the grid
    engine gave it (ZeRO's ``tp0-pp0-dp{d}`` was ``zero-rank{d}``)."""
    name = shard_file(int(manifest["step"]), shard)
    old = re.fullmatch(r"tp0-pp0-dp(\d+)", shard)
    if name not in manifest["files"] and old:
        legacy = shard_file(int(manifest["step"]), f"zero-rank{old.group(1)}")
        if legacy in manifest["files"]:
            return legacy
    return name


def load_shard(out: str | os.PathLike, manifest: dict, shard: str) -> dict:
    """This rank's shard of the committed set; checks it belongs to the manifest's step."""
    name = _written_as(manifest, shard)
    if name not in manifest["files"]:
        raise ConfigError(f"--resume: the checkpoint in {out} has no shard {shard!r} (it holds "
                          f"{', '.join(manifest['files'])}); resume with the layout it was written with")
    verify(out, manifest, [name])
    state = load(Path(out) / name)
    if int(state["step"]) != int(manifest["step"]):
        raise ConfigError(f"{name} is at step {state['step']} but {MANIFEST} at {manifest['step']}: "
                          f"the checkpoint set is inconsistent; start afresh")
    return state
