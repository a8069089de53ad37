"""Which model a checkpoint's tensors are for, and whether they fit it.

    shapes, tied = model_state(SPEC)                   # a preset's or factory's state_dict shapes, tied names
    weights = check_weights(FILE, weights, SPEC, who)  # its names and shapes, in its order, or a ConfigError

A model from Hugging Face that is no preset is named ``hf:DIR`` ("the Llama that DIR/config.json
describes"; :func:`is_hf_name`, :func:`llama_model_name`, :func:`hf_record`). Used by ``distrain
checkpoint`` (checkpoint/write.py, checkpoint/hf.py) and ``--init-from`` (checkpoint/init_from.py).

A checkpoint never supplies code (:func:`recorded_model`): of the model name a manifest or a
consolidated file records, only what distrain builds from data alone is taken (a preset, ``hf:DIR``,
``custom``); a ``PKG.MOD:FACTORY`` is imported only when the user names it with ``--model``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from distrain.checkpoint.read import CONFIG, IMPORT, read_config
from distrain.errors import ConfigError
from distrain.factories import CUSTOM, is_spec, load_object
from distrain.models.meta import shapes_only

HF = "hf:"
# presets that train (and so export) as they are; shape-only presets are for the cost model
EXPORTABLE = ("llama-tiny", "llama-small", "llama-moe-tiny")


# -- which recorded model is taken ----------------------------------------------------------------------
def recorded_model(name, where: str, verb: str):
    """``name``, the model a checkpoint records, when it is one distrain builds from data alone: a preset, ``hf:DIR``
    (our Llama, from the config the record holds or DIR's config.json), ``custom`` (rebuilt only from the model
    passed again from Python) or None (weights alone). A ``PKG.MOD:FACTORY`` is code, which a checkpoint
    never makes distrain import: a one-line ConfigError (``where was trained with ...; pass --model ... to
    {verb} it``); anything else too (``where`` names the checkpoint)."""
    from distrain.models import list_models

    if name is None or name == CUSTOM or is_hf_name(name) or name in list_models():
        return name
    if is_spec(name):
        raise ConfigError(f"{where} was trained with the model factory {name}, which distrain does not import from "
                          f"a checkpoint; pass --model {name} to {verb} it")
    raise ConfigError(f"{where} records the model {name!r}, which is no preset, hf:DIR or PKG.MOD:FACTORY; pass "
                      f"--model to name the model to {verb} it with")


# -- checking the tensors against the model the run trains ------------------------------------------
def model_state(spec: str) -> tuple[dict[str, torch.Size], dict[str, list[str]]] | None:
    """The state_dict shapes of model ``spec`` (a preset or PKG.MOD:FACTORY) and its tied names
    ({name: the other names of the same parameter}); None for ``custom`` (a model passed from
    Python to ``distrain.train``: nothing here can build it; the resume loads it by name)."""
    from distrain.models import build_model

    if spec == CUSTOM:
        return None
    with torch.random.fork_rng(devices=[]):  # building draws initial weights: leave the caller's RNG as it was
        if is_spec(spec):
            model = load_object(spec, "--model")()
            if not isinstance(model, torch.nn.Module):
                raise ConfigError(f"--model {spec} returned a {type(model).__name__}, not an nn.Module")
        else:
            with shapes_only():  # no memory for the weights
                model = build_model(spec)
    return module_state(model)


def module_state(model: torch.nn.Module) -> tuple[dict[str, torch.Size], dict[str, list[str]]]:
    """(state_dict shapes, tied names) of a built model (see :func:`model_state`)."""
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    by_param: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(n)
    tied = {n: [m for m in names if m != n] for names in by_param.values() if len(names) > 1 for n in names}
    return shapes, tied


def check_weights(path, weights: dict[str, torch.Tensor], spec: str, who: str = IMPORT, fix: str | None = None,
                  state=None) -> dict[str, torch.Tensor]:
    """``weights`` with exactly the names and shapes of model ``spec``'s state_dict (or ``state``: what
    :func:`module_state` gives), in its order (a tied parameter saved under one of its names, as
    safetensors does, is filled in under the others), or a one-line ConfigError naming the file, the
    tensor and the fix (``who: ...``)."""
    try:
        got = state if state is not None else model_state(spec)
    except ConfigError as e:  # an unknown preset, a factory that does not import...
        raise ConfigError(f"{who}: {e}") from None
    if got is None:
        return dict(weights)
    shapes, tied = got
    weights = dict(weights)
    for n, others in tied.items():
        if n not in weights:
            twin = next((m for m in others if m in weights), None)
            if twin is not None:
                weights[n] = weights[twin]
    missing = [n for n in shapes if n not in weights]
    extra = [n for n in weights if n not in shapes]
    fix = fix or f"import the file with the --model it was saved from, or a file saved from --model {spec}"
    if extra or missing:
        hint = _prefix_hint(list(weights), list(shapes))
        if extra:
            raise ConfigError(f"{who}: {path} holds tensor {extra[0]!r}, which --model {spec} does not have "
                              f"({len(extra)} such, {len(missing)} of the model's missing); {hint or fix}")
        raise ConfigError(f"{who}: {path} has no tensor {missing[0]!r}, which --model {spec} has ({len(missing)} of "
                          f"its {len(shapes)} missing); {hint or fix}")
    for n, want in shapes.items():
        if tuple(weights[n].shape) != tuple(want):
            raise ConfigError(f"{who}: tensor {n!r} of {path} has shape {tuple(weights[n].shape)}, --model {spec} "
                              f"has {tuple(want)}; {fix}")
    return {n: weights[n] for n in shapes}  # in the model's order (a .safetensors file sorts its names)


def _prefix_hint(names: list[str], want: list[str]) -> str:
    """A wrapper's prefix (DDP's ``module.``, torch.compile's ``_orig_mod.``) on every name: the fix."""
    for prefix in ("module.", "_orig_mod.", "model."):
        if names and all(n.startswith(prefix) for n in names) and {n[len(prefix):] for n in names} == set(want):
            return (f"every name in the file starts with {prefix!r} (saved from a wrapper around the model): save "
                    f"the inner model's state_dict, e.g. torch.save(model.{prefix.rstrip('.')}.state_dict(), path)")
    return ""


# -- hf:DIR, the Llama that DIR/config.json describes -----------------------------------------------
def is_hf_name(name) -> bool:
    """``hf:DIR``: the Llama that DIR/config.json describes."""
    return isinstance(name, str) and name.startswith(HF)


def llama_model_name(cfg, folder) -> str:
    """The trainer's name for Llama config ``cfg`` read from HF folder ``folder``: the trainable preset it
    equals, else ``hf:`` + the folder's absolute path."""
    from distrain.models import preset_config
    from distrain.models.llama import LlamaConfig

    for name in EXPORTABLE:
        if LlamaConfig(**preset_config(name)) == cfg:
            return name
    return HF + str(Path(folder).resolve())


def hf_record(name: str, who: str) -> dict:
    """{"model_config": our LlamaConfig fields, "hf_config": config.json} of model ``hf:DIR``, from DIR."""
    from distrain.models.llama import config_from_hf

    folder = Path(name[len(HF):])
    config = read_config(folder, who)
    try:
        cfg = config_from_hf(config)
    except ConfigError as e:
        raise ConfigError(f"{who}: {folder / CONFIG}: {str(e).removeprefix('from_hf: ')}") from None
    return {"model_config": dataclasses.asdict(cfg), "hf_config": config}


def hf_state(name: str, who: str):
    """(shapes, tied names) of model ``hf:DIR``, built on the meta device (:func:`check_weights`)."""
    from distrain.models.llama import Llama

    with shapes_only():
        return module_state(Llama(hf_llama_config(name, who)))


def hf_llama_config(name: str, who: str):
    from distrain.models.llama import LlamaConfig

    return LlamaConfig(**hf_record(name, who)["model_config"])
