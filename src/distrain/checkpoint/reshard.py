"""Checkpoints that change layout: any committed set <-> one consolidated form by parameter name.

A checkpoint set holds one file per shard (store.py): a replica (``tp0-pp0``), a
tensor/pipeline shard (``tp{t}-pp{p}``), a ZeRO rank's flat shards (``zero-rank{r}``,
``tp{t}-pp{p}-dp{d}``). Each file also records, for every tensor it holds, its name in the
whole model and, under tensor parallelism, where it sits in the whole tensor
(``"names"``: {local name: full name}, ``"tp"``: {local name: [dim, start, stop]}, dim None =
replicated; ``"order"``: the optimizer's parameters by local name). From that alone,
without any process group, :func:`consolidate` rebuilds the whole model and optimizer:

1. per (tp, pp) shard, ZeRO files are joined: unit u's flat tensor is the concatenation of
   the dp ranks' (S_u,) shards, cut into parameters at the unit's offsets (its padding is
   dropped); shard-shaped optimizer state (exp_avg, exp_avg_sq, momentum) is joined the same way;
2. the local tensors are renamed to full names (a pipeline stage's ``layers.i`` is the model's
   ``layers.{start + i}``) and tensor-parallel slices are concatenated along their dim in
   order of ``start`` (a replicated tensor is taken from tp rank 0).

The result is the whole-model form (checkpoint/form.py; loads with ``torch.load(weights_only=True)``)::

    {"kind": "distrain.full/1", "step": k,
     "model": {name: tensor},                           # model.load_state_dict(form["model"])
     "optimizer": {"state": {name: {key: value}}, "param_groups": [{hyperparameters}]},
     "run": {"model": preset, "strategy": ..., "layout": {...}, "config": {...}}}

:func:`local_view` cuts it for one rank of any layout (rename, ``narrow`` to the tp slice);
each engine's ``load_full`` loads that, ZeRO via ``Zero.load_full_state_dict``. Every
optimizer here is elementwise, so its state cut like the parameters continues exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from distrain.checkpoint import store
from distrain.checkpoint.form import FULL, whole
from distrain.errors import ConfigError
from distrain.parallel.pipeline_parallel import InterleavedStage


# -- what each shard file records ---------------------------------------------------------------
def shard_meta(names: dict[str, str], tp_info: dict | None = None, order: list[str] | None = None) -> dict:
    """The naming record a shard file carries: ``names`` {local: full}; ``tp_info`` {local:
    ShardInfo} (tp > 1); ``order``: the optimizer's parameters (plain optimizers)."""
    meta = {"names": dict(names)}
    if tp_info is not None:
        meta["tp"] = {n: [i.dim, i.start, i.stop] for n, i in tp_info.items() if n in names}
    if order is not None:
        meta["order"] = list(order)
    return meta


def zero_shard_state(zero, full_name=lambda n: n, tp_info: dict | None = None) -> dict:
    """A ZeRO rank's checkpoint shard: its flat shards and optimizer state (``Zero.state_dict``),
    the module's persistent buffers (ZeRO shards parameters only) and the naming record."""
    return {"zero": zero.state_dict(), "buffers": _buffers(zero.module),
            **shard_meta(zero_names(zero, full_name), tp_info)}


def zero_names(zero, full_name=lambda n: n) -> dict[str, str]:
    """{local: full} for what a ZeRO shard holds: its units' parameters and the module's buffers."""
    return {n: full_name(n) for n in [n for u in zero.units for n in u.names] + list(_buffers(zero.module))}


def load_zero_shard(zero, state: dict) -> None:
    """The inverse of :func:`zero_shard_state` (the same layout)."""
    zero.load_state_dict(state["zero"])
    saved = state.get("buffers", {})
    with torch.no_grad():
        for n, b in zero.module.named_buffers():
            if n in saved:
                b.copy_(saved[n])


def _buffers(module) -> dict[str, torch.Tensor]:
    keep = set(module.state_dict())  # persistent buffers only, as a state_dict holds them
    return {n: b.detach().clone() for n, b in module.named_buffers() if n in keep}


def stage_full_name(stage):
    """local name -> the model's name: a pipeline stage's ``layers.i.x`` is ``layers.{start+i}.x``; an
    interleaved stage's chunk c ``chunks.c.i.x`` is ``layers.{start_c+i}.x`` (``InterleavedStage.whole_name``)."""
    if stage is None:
        return lambda n: n
    if isinstance(stage, InterleavedStage):
        return stage.whole_name

    def full(n: str) -> str:
        head, i, rest = n.split(".", 2)
        return f"{head}.{int(i) + stage.start}.{rest}"
    return full


# -- files -> consolidated form -------------------------------------------------------------------
def _zero_local(files: list[dict]) -> tuple[dict, dict, list]:
    """The dp ranks' ZeRO states of one shard -> ({local: tensor}, {local: state}, param_groups)."""
    zs = sorted((f["zero"] for f in files), key=lambda z: z["rank"])
    world = zs[0]["layout"]["world"]
    if [z["rank"] for z in zs] != list(range(world)):
        raise ConfigError(f"checkpoint: the ZeRO shards of ranks {[z['rank'] for z in zs]} are there, but it was "
                          f"saved on {world} ranks; the set is incomplete")
    params, state = {}, {}
    opt = [z["optimizer"] for z in zs]
    for i, unit in enumerate(zs[0]["layout"]["units"]):
        sizes = [int(torch.Size(s).numel()) for s in unit["shapes"]]

        def cut(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
            flat = torch.cat(pieces)
            return [v.view(s) for v, s in zip(flat[:sum(sizes)].split(sizes), unit["shapes"])]

        for n, v in zip(unit["names"], cut([z["shards"][i] for z in zs])):
            params[n] = v
        st = opt[0]["state"].get(i, {})
        per = {n: {} for n in unit["names"]}
        for k, v0 in st.items():
            if torch.is_tensor(v0) and v0.shape == zs[0]["shards"][i].shape:
                for n, v in zip(unit["names"], cut([o["state"][i][k] for o in opt])):
                    per[n][k] = v
            else:  # e.g. Adam's step: a copy per parameter (a shared tensor would be stepped once per parameter)
                for n in unit["names"]:
                    per[n][k] = v0.clone() if torch.is_tensor(v0) else v0
        state.update({n: s for n, s in per.items() if s})
    params.update(files[0].get("buffers", {}))  # the module's buffers: the same on every dp rank
    return params, state, opt[0]["param_groups"]


def _plain_local(f: dict) -> tuple[dict, dict, list]:
    order = f["order"]
    state = {order[int(i)]: s for i, s in f["optimizer"]["state"].items()}
    return dict(f["model"]), state, f["optimizer"]["param_groups"]


def _files(out: Path, manifest: dict) -> list[dict]:
    states = []
    for name in manifest["files"]:
        s = store.load(out / name)
        if "names" not in s and s.get("kind") != FULL:
            raise ConfigError(f"checkpoint {out / name} records no parameter names (written by --strategy "
                              f"{manifest.get('strategy')}, or before distrain could reshard); it can only be "
                              f"resumed with the layout it was written with")
        states.append(s)
    return states


def consolidate(out: str | Path, manifest: dict | None = None) -> dict:
    """The committed set of run folder ``out`` as one consolidated form (no process group needed)."""
    out = Path(out)
    manifest = manifest or store.read_manifest(out)
    store.verify(out, manifest)
    files = _files(out, manifest)
    if "islands" in manifest.get("layout", {}):  # (plain DiLoCo's shards record no names: refused by _files)
        raise ConfigError(f"checkpoint {out} was written by --strategy diloco with grid islands (layout "
                          f"{manifest['layout']}): each island holds its own model and outer state, not one model; "
                          f"resume it with the layout it was written with")
    if len(files) == 1 and files[0].get("kind") == FULL:  # a set made by `distrain checkpoint import`
        return {k: v for k, v in files[0].items() if k not in ("format", "shard")}
    groups: dict[str, list[dict]] = {}
    for f in files:  # one group per (tp, pp) shard: its dp ranks' ZeRO files, or one plain file
        groups.setdefault(re.sub(r"(-dp\d+|^zero-rank\d+)$", "", f["shard"]) or "zero", []).append(f)
    pieces: dict[str, list] = {}  # full name -> [(tp info, tensor, optimizer state)]
    param_groups = None
    for fs in groups.values():
        params, state, param_groups = _zero_local(fs) if "zero" in fs[0] else _plain_local(fs[0])
        names, tp = fs[0]["names"], fs[0].get("tp", {})
        for n, t in params.items():
            pieces.setdefault(names[n], []).append((tp.get(n), t, state.get(n, {})))
    model, opt_state = {}, {}
    for full, ps in pieces.items():
        model[full], st = _join(full, ps)
        if st:
            opt_state[full] = st
    groups_out = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
    return whole(model, {"state": opt_state, "param_groups": groups_out}, step=int(manifest["step"]),
                 run={"model": manifest.get("model"), "strategy": manifest.get("strategy"),
                      "layout": manifest["layout"], "config": manifest.get("config", {})})


def consolidate_pieces(pieces: list[tuple[int, int, dict]], step: int) -> dict:
    """In-memory ZeRO pieces -> the consolidated form (an elastic job's change, no files).

    ``pieces``: (world, rank, state) with ``state`` a ZeroEngine.state_dict() of rank ``rank`` of a
    layout of ``world`` ranks (a copy may carry another rank's number: the rank given wins); the
    first layout whose ranks 0..world-1 are all there is joined (duplicates are equal copies)."""
    by_layout: dict[int, dict[int, dict]] = {}
    for world, rank, state in pieces:
        by_layout.setdefault(world, {}).setdefault(rank, state)
    world = next((w for w, got in by_layout.items() if set(got) >= set(range(w))), None)
    if world is None:
        have = {w: sorted(got) for w, got in by_layout.items()}
        raise ConfigError(f"elastic: the pieces of the sharded state do not make a whole (held, by world size: "
                          f"{have})")
    files = [dict(by_layout[world][r], zero=dict(by_layout[world][r]["zero"], rank=r)) for r in range(world)]
    params, state, groups = _zero_local(files)
    names = files[0]["names"]
    return whole({names[n]: t for n, t in params.items()},
                 {"state": {names[n]: v for n, v in state.items()},
                  "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups]}, step=int(step))


def _join(full: str, ps: list) -> tuple[torch.Tensor, dict]:
    """A whole tensor (and its optimizer state) from its tensor-parallel slices. A slice that several
    shards hold (the ep ranks of one tp coordinate each save the non-expert parameters, the same
    replicated values) counts once."""
    info, t, st = ps[0]
    if info is None or info[0] is None:  # whole, or replicated over tp: every copy is the same
        return t.clone(), {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    dim = info[0]
    once: dict = {}
    for p in ps:
        once.setdefault(tuple(p[0][1:3]), p)
    ps = sorted(once.values(), key=lambda p: p[0][1])
    if [p[0][1] for p in ps][1:] != [p[0][2] for p in ps][:-1] or ps[0][0][1] != 0:
        raise ConfigError(f"checkpoint: the tensor-parallel slices of {full} do not tile it "
                          f"({[tuple(p[0][1:]) for p in ps]}); the set is incomplete")
    state = {}
    for k, v in st.items():
        sliced = torch.is_tensor(v) and v.shape == t.shape and v.dim() > 0
        state[k] = torch.cat([p[2][k] for p in ps], dim) if sliced else _copy(v)
    return torch.cat([p[1] for p in ps], dim), state


# -- consolidated form -> one rank of a layout -----------------------------------------------------
def _copy(v):
    """A tensor's own copy: optimizers step scalar state (Adam's ``step``) in place."""
    return v.clone() if torch.is_tensor(v) else v


def local_view(full: dict, names: dict[str, str], tp_info: dict | None = None) -> dict:
    """This rank's part of a consolidated form: {"model": {local: tensor}, "optimizer": {"state":
    {local: state}, "param_groups"}}; tensors cut to this rank's tp slice (``ShardInfo.take``)."""
    model, state = {}, {}
    whole, saved = full["model"], full["optimizer"]["state"]
    for local, name in names.items():
        if name not in whole:
            raise ConfigError(f"--reshard: the checkpoint has no tensor {name!r}; it was saved from another model")
        info = (tp_info or {}).get(local)
        t = whole[name]
        model[local] = (info.take(t) if info is not None else t).clone()
        st = {}
        for k, v in saved.get(name, {}).items():
            cut = torch.is_tensor(v) and v.shape == t.shape and v.dim() > 0
            st[k] = (info.take(v) if info is not None else v).clone() if cut else _copy(v)
        if st:
            state[local] = st
    return {"model": model, "optimizer": {"state": state, "param_groups": full["optimizer"]["param_groups"]}}


def load_plain(module, optimizer, order: list[str], view: dict) -> None:
    """Load a local view into a module and a plain optimizer over ``order`` (its parameters by name)."""
    module.load_state_dict(view["model"])
    cur = optimizer.state_dict()["param_groups"]
    if len(cur) != len(view["optimizer"]["param_groups"]):
        raise ConfigError(f"--reshard: the checkpoint has {len(view['optimizer']['param_groups'])} optimizer "
                          f"parameter group(s), this optimizer has {len(cur)}")
    state = {i: view["optimizer"]["state"][n] for i, n in enumerate(order) if n in view["optimizer"]["state"]}
    groups = [dict(s, params=c["params"]) for s, c in zip(view["optimizer"]["param_groups"], cur)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- the consolidated file, and back into a run folder ----------------------------------------------
def save_consolidated(run: str | Path, path: str | Path) -> dict:
    """Write run folder ``run``'s committed set as one consolidated file (atomic); returns the form.
    Its errors name ``checkpoint consolidate``, not ``--resume`` (whose checks it shares)."""
    try:
        form = consolidate(run)
    except ConfigError as e:
        raise ConfigError(as_command(str(e), "checkpoint consolidate")) from None
    store.save(path, form)  # + "format": 1; torch.load(path, weights_only=True) reads it
    return form


# the advice of the checks --resume shares (store.read_manifest/verify/load, _files, runlock), and
# what it means when another command reads the run folder
_RESUME_ADVICE = (
    ("run without --resume to start afresh", "give the --out of a run that has saved a checkpoint"),
    ("delete the run folder or start without --resume", "the run folder holds no readable checkpoint"),
    ("the checkpoint set is incomplete; start afresh", "the checkpoint set is incomplete"),
    ("restore it or start afresh", "restore it from a copy"),
    ("delete it to start afresh", "restore it from a copy"),
    ("it can only be resumed with the layout it was written with",
     "it cannot be consolidated, only resumed with the layout it was written with"),
    ("wait for it to end, stop it, or choose another --out", "wait for it to end or stop it"),
)


def as_command(message: str, command: str) -> str:
    """A one-line error of the shared checkpoint checks, as ``command``'s: ``"{command}: ..."``
    instead of ``"--resume: ..."``, with advice for that command (idempotent)."""
    if message.startswith(f"{command}: "):
        return message
    for prefix in ("--resume: ", "--reshard: ", "checkpoint: ", "--out "):
        if message.startswith(prefix):
            message = message[len(prefix):]
            break
    for old, new in _RESUME_ADVICE:
        message = message.replace(old, new)
    return f"{command}: {message}"

