"""RoPE settings put where the family's mlx-lm model reads them. transformers 5 saves them under `rope_parameters`
only (gemma3's per attention type), while mlx-lm's llama and others read a top-level `rope_theta` and `rope_scaling`
and fall back to a default without a word: the model would run, with wrong positions."""

from dataclasses import fields

from spill.errors import SpillError

from .mlx_lm_parts import get_classes

# models that keep a scaling of these types only and drop any other (mlx-lm's phi3 prints a warning)
_KEPT = {"phi3": {"longrope", "su", "linear"}}
_LOCAL = {"sliding_attention": "rope_local_base_freq"}   # a per-type theta -> the field mlx-lm's gemma3 reads


def rope_config(config: dict, folder) -> dict:
    """config.json with its RoPE settings also where the family's mlx-lm ModelArgs reads them; one sentence for a
    scaling that model would drop."""
    _, args_class = get_classes(config)
    reads, out = {f.name for f in fields(args_class)}, dict(config)
    model = config.get("model_type")
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and "rope_parameters" not in reads:   # qwen3 reads it itself
        main = params
        if all(isinstance(p, dict) for p in params.values()):   # per attention type
            main = params.get("full_attention", {})
            for kind, p in params.items():
                if kind != "full_attention" and (_LOCAL.get(kind) not in reads or _type(p) != "default"):
                    _refuse(folder, model, _type(p), f"rope_parameters.{kind}")
                if kind != "full_attention" and out.get(_LOCAL[kind]) is None and "rope_theta" in p:
                    out[_LOCAL[kind]] = p["rope_theta"]
        for key, value in main.items():   # rope_theta, partial_rotary_factor, ...
            if key in reads and out.get(key) is None:
                out[key] = value
        if _type(main) != "default" and out.get("rope_scaling") is None:
            out["rope_scaling"] = {**main, "type": _type(main), "rope_type": _type(main)}
    scaling = out.get("rope_scaling")
    if isinstance(scaling, dict) and _type(scaling) != "default" and (
            "rope_scaling" not in reads or _type(scaling) not in _KEPT.get(model, {_type(scaling)})):
        _refuse(folder, model, _type(scaling), "rope_scaling" if config.get("rope_scaling") else "rope_parameters")
    return out


def _type(p: dict) -> str:
    return p.get("rope_type") or p.get("type") or "default"


def _refuse(folder, model: str, kind: str, where: str) -> None:
    raise SpillError(f"model folder {folder}: config.json asks for {kind} RoPE scaling ({where}), and mlx-lm's "
                     f"{model} model would run without it, with wrong positions; remove the scaling from config.json "
                     "if the model was trained without it, or use a model or mlx-lm release that supports it")
