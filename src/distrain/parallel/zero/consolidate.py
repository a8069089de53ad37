"""A live ZeRO engine's state as the whole-model form, and back: shards <-> whole tensors by name.

The form is the one of every checkpoint (distrain.checkpoint.form: ``{"kind": "distrain.full/1",
"model": {name: tensor}, "optimizer": {"state": {name: {key: value}}, "param_groups": [...]}}``;
``torch.save``-able, loads with ``weights_only=True``), so what ``Zero.full_state_dict()`` gives is
what ``distrain checkpoint consolidate`` writes, and what a resharded resume or an elastic job's
joined pieces load.

This is the layout-free form: each shard-shaped optimizer tensor is all-gathered exactly like
the parameters and cut along the same offsets, so a run saved with stage s on P ranks loads
into stage s' on P' ranks (each rank cuts its new shard out of the whole tensors), and the
``"model"`` part loads into a plain module. It holds whole tensors, so every rank needs
memory for the full model and optimizer state while saving or loading.
"""

from __future__ import annotations

import torch

from distrain import comm
from distrain.checkpoint.form import check, whole
from distrain.errors import ConfigError


def _index_of(opt: torch.optim.Optimizer) -> dict[int, int]:
    """id(param) -> its index in the optimizer's state_dict."""
    flat = [p for g in opt.param_groups for p in g["params"]]
    return {id(p): k for k, p in enumerate(flat)}


def _gather_shard(engine, u, t: torch.Tensor) -> torch.Tensor:
    """An (S,) shard-shaped tensor of unit u -> the whole padded (P*S,) tensor, on every rank."""
    full = torch.empty(u.padded, dtype=t.dtype)
    comm.all_gather(list(full.view(engine.world, u.shard)), t.detach().contiguous(), group=engine.group,
                    algorithm=engine.algorithm)
    return full


def full_state(engine) -> dict:
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict] = {}
    opt = engine.optimizer
    for i, u in enumerate(engine.units):
        shard = engine.impl.shards[i]
        for n, v in zip(u.names, u.views(engine.impl.full_flat(i))):
            model[n] = v.detach().clone()
        st = opt.state.get(shard, {})
        per: dict[str, dict] = {n: {} for n in u.names}
        for k in sorted(st):  # sorted: every rank gathers the same keys in the same order
            v = st[k]
            if torch.is_tensor(v) and v.shape == shard.shape:
                for n, view in zip(u.names, u.views(_gather_shard(engine, u, v))):
                    per[n][k] = view.clone()
            else:
                for n in u.names:
                    per[n][k] = v.clone() if torch.is_tensor(v) else v
        state.update({n: s for n, s in per.items() if s})
    for n, p in engine.module.named_parameters():  # parameters outside ZeRO (frozen, stages 1-2)
        model.setdefault(n, p.detach().clone())
    for n, b in engine.module.named_buffers():
        model[n] = b.detach().clone()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]
    return whole(model, {"state": state, "param_groups": groups})


def load_full_state(engine, full: dict) -> None:
    check(full, "Zero.load_full_state_dict", "make one with Zero.full_state_dict() or `distrain checkpoint "
                                              "consolidate`")
    model, saved = full["model"], full["optimizer"]
    want = [n for u in engine.units for n in u.names]
    missing = [n for n in want if n not in model]
    if missing:
        raise ConfigError(f"Zero.load_full_state_dict: the checkpoint has no tensor for parameter(s) {missing[:5]}; "
                          f"it was saved from a different model")
    opt = engine.optimizer
    cur = opt.state_dict()["param_groups"]
    if len(saved["param_groups"]) != len(cur):
        raise ConfigError(f"Zero.load_full_state_dict: the checkpoint has {len(saved['param_groups'])} optimizer "
                          f"parameter group(s), this optimizer has {len(cur)}")
    index = _index_of(opt)
    states: dict[int, dict] = {}
    with torch.no_grad():
        for i, u in enumerate(engine.units):
            shard = engine.impl.shards[i]
            bad = [n for n, s in zip(u.names, u.shapes) if tuple(model[n].shape) != tuple(s)]
            if bad:
                raise ConfigError(f"Zero.load_full_state_dict: parameter {bad[0]} has shape "
                                  f"{tuple(model[bad[0]].shape)} in the checkpoint but {tuple(u.shapes[u.names.index(bad[0])])} here")
            lo, hi = u.shard_range(engine.rank)
            flat = u.flatten([model[n] for n in u.names], shard)
            if engine.stage < 3:
                engine.impl.flats[i].copy_(flat)  # the parameters and the shard are views of it
            else:
                shard.copy_(flat[lo:hi])
            per = [saved["state"].get(n, {}) for n in u.names]
            st = {}
            for k in sorted(set().union(*per)):
                vals = [s.get(k) for s in per]
                if all(torch.is_tensor(v) and tuple(v.shape) == tuple(sh) for v, sh in zip(vals, u.shapes)) \
                        and len(u.shapes[0]) > 0:
                    st[k] = u.flatten(vals, vals[0])[lo:hi].clone()
                else:
                    st[k] = vals[0]
            if st:
                states[index[id(shard)]] = st
        for n, p in engine.module.named_parameters():
            if n in model:
                p.copy_(model[n])
        for n, b in engine.module.named_buffers():
            if n in model:
                b.copy_(model[n])
    groups = [dict(s, params=c["params"]) for s, c in zip(saved["param_groups"], cur)]
    opt.load_state_dict({"state": states, "param_groups": groups})
