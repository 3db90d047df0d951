"""DFlash drafter weights: load safetensors, check them against a :class:`DFlashConfig`, and stack
the per-layer K/V projections for the fused context path.

Names are the z-lab ones (``expected_shapes``); a leading ``model.`` (HF-style
checkpoints) is stripped from every name. ``check_drafter_state`` reports every missing, unexpected
and wrongly shaped tensor in one ValueError.
"""
from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Optional

import torch

from .config import DFlashConfig, _fc_mismatch, default_target_layer_ids
from .hf_config import _ROPE_GPTJ_KEYS, _ROPE_NEOX_KEYS

__all__ = ["load_state", "check_float", "check_drafter_state", "expected_shapes", "stack_kv",
           "save_zlab", "save_speculators", "zlab_to_speculators"]

_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


# ---------------------------------------------------------------------------------- loading
# Integer / bool maps a drafter checkpoint may ship (reduced vocabulary <-> target ids); every
# other tensor is a weight and must be floating point.
INT_MAPS = ("d2t", "t2d")


def _is_map(name: str) -> bool:
    return (name[len("model."):] if name.startswith("model.") else name) in INT_MAPS


def check_float(state: dict, source: str) -> None:
    """One-line ValueError naming every non-floating tensor (but the integer maps) of ``state``,
    its dtype and ``source``: an integer or bool weight would load and run, silently wrong."""
    bad = [f"{n} is {t.dtype}" for n, t in state.items()
           if not _is_map(n) and not t.is_floating_point()]
    if bad:
        raise ValueError(f"{source}: weights must be floating point (float32/16, bfloat16, fp8), "
                         f"got {', '.join(bad)}")


def _load_file(file: str) -> dict:
    """The tensors of one safetensors file (CPU); a corrupt file raises a ValueError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = dict(load_file(file, device="cpu"))
    except SafetensorError as e:
        raise ValueError(f"{file}: not a valid safetensors file ({e})") from None
    check_float(tensors, file)
    return tensors


def _shard_file(directory: str, index: str, name: str, shard) -> str:
    """The path of ``shard`` (a weight_map entry), which must name a file inside ``directory``:
    no absolute path, no ``..`` escape, no directory symlink leading out. A symlinked *file*
    inside the directory is followed (HF hub cache snapshots link every file to ../../blobs)."""
    if not isinstance(shard, str):
        raise ValueError(f"{index}: weight_map[{name!r}]: expected a shard file name (string), "
                         f"got {type(shard).__name__} {shard!r}")
    root = Path(directory).resolve()
    file = Path(directory, shard)
    inside = (shard and not Path(shard).is_absolute()
              and os.path.normpath(shard).split(os.sep)[0] not in ("..", "")
              and file.parent.resolve().is_relative_to(root))
    if not inside:
        raise ValueError(f"{index}: weight_map[{name!r}] = {shard!r}: expected a file inside the "
                         f"checkpoint directory {root}")
    return str(file)


def load_state(path: "str | os.PathLike") -> dict:
    """Tensors from a ``.safetensors`` file, or a directory holding ``model.safetensors`` or a
    sharded ``model.safetensors.index.json`` (its ``weight_map``). Loaded on the CPU.

    Errors (ValueError) name the file: a corrupt safetensors file, a non-floating weight, a
    malformed index or one naming a shard outside the directory."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return _load_file(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({e!r})")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map: expected a JSON object (tensor name -> shard "
                             f"file), got {type(weight_map).__name__}")
        state, by_file = {}, {}
        for name, shard in weight_map.items():
            by_file.setdefault(_shard_file(path, index, name, shard), []).append((name, shard))
        for file, entries in sorted(by_file.items()):  # every shard there before any loads
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index}: shard {entries[0][1]} (for {entries[0][0]}, "
                                        f"...) is missing")
        for file, entries in sorted(by_file.items()):
            shard, names = entries[0][1], [n for n, _ in entries]
            tensors = _load_file(file)
            absent = [n for n in names if n not in tensors]
            if absent:
                raise ValueError(f"{index}: weight_map puts {absent} in {shard}, which lacks them")
            unlisted = sorted(set(tensors) - set(names))
            if unlisted:  # the checks below see only what the map lists: do not drop them
                raise ValueError(f"{index}: {shard} holds {unlisted[:5]}"
                                 f"{f' and {len(unlisted) - 5} more' if len(unlisted) > 5 else ''}"
                                 f", which weight_map does not list (in {shard} or elsewhere)")
            for n in names:
                state[n] = tensors[n]
        return state
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return _load_file(single)
    raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")


# ---------------------------------------------------------------------------------- checking
def expected_shapes(cfg: DFlashConfig) -> tuple:
    """``(required, optional)``: dicts of normalised name -> list of acceptable shapes."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    req, opt = {}, {}
    for i in range(cfg.num_layers):
        a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        req.update({f"{a}.q_proj.weight": [(q, H)], f"{a}.k_proj.weight": [(kv, H)],
                    f"{a}.v_proj.weight": [(kv, H)], f"{a}.o_proj.weight": [(H, q)],
                    f"{a}.q_norm.weight": [(D,)], f"{a}.k_norm.weight": [(D,)],
                    f"{m}.gate_proj.weight": [(I, H)], f"{m}.up_proj.weight": [(I, H)],
                    f"{m}.down_proj.weight": [(H, I)],
                    f"layers.{i}.input_layernorm.weight": [(H,)],
                    f"layers.{i}.post_attention_layernorm.weight": [(H,)]})
        if cfg.attention_bias:
            req.update({f"{a}.q_proj.bias": [(q,)], f"{a}.k_proj.bias": [(kv,)],
                        f"{a}.v_proj.bias": [(kv,)], f"{a}.o_proj.bias": [(H,)]})
        if cfg.attention_sinks:   # per-head sink logits; without them the softmax is wrong
            req[f"{a}.sinks"] = [(cfg.num_heads,)]
        if cfg.model_type == "dflash2":
            K, G = cfg.conv_kernel_size, H // cfg.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                req[f"layers.{i}.{conv}.base_kernel"] = [(2, K, H)]
                req[f"layers.{i}.{conv}.kernel_projection.weight"] = [(2 * K * G, H)]
    req.update({"fc.weight": [(H, cfg.fc_in_features)], "hidden_norm.weight": [(H,)],
                "norm.weight": [(H,)]})
    vout = cfg.out_vocab_size
    opt.update({"embed_tokens.weight": [(cfg.vocab_size, H)], "lm_head.weight": [(vout, H)],
                "d2t": [(vout,)], "t2d": [(cfg.vocab_size,)], "mask_embedding": [(H,), (1, H)]})
    if cfg.model_type == "dflash2":  # the codebooks are nn.Embedding(vocab_size, rank)
        r = cfg.selector_rank
        req.update({f"{c}.weight": [(cfg.vocab_size, r)] for c in _CODEBOOKS})
        req["candidate_selector.hidden_projection.weight"] = [(r, H)]
    return req, opt


def _normalise(state: dict) -> tuple:
    """Strip a leading ``model.``, give the selector codebooks their ``.weight`` suffix (as the
    reference's key_mapping does), drop saved RoPE buffers. Returns (dict, duplicate notes)."""
    out, dups = {}, []
    for name, t in state.items():
        new = name[len("model."):] if name.startswith("model.") else name
        if new in _CODEBOOKS:
            new += ".weight"
        if new.endswith("rotary_emb.inv_freq"):
            continue
        if new in out:
            dups.append(f"{name} (normalised to {new}, which another tensor already has)")
            continue
        out[new] = t
    return out, dups


def check_drafter_state(state: dict, cfg: DFlashConfig, source: Optional[str] = None) -> dict:
    """Check every tensor's presence and shape against ``cfg``; return the normalised dict.

    Raises one ValueError listing all missing, unexpected and wrongly shaped tensors."""
    source = source or "<state dict>"
    norm, dups = _normalise(state)
    req, opt = expected_shapes(cfg)
    problems = [f"duplicate: {d}" for d in dups]
    for name, shapes in req.items():
        if name not in norm:
            problems.append(f"missing: {name} (expected {_fmt(shapes)})")
    for name, t in norm.items():
        shapes = req.get(name, opt.get(name))
        if shapes is None:
            problems.append(f"unexpected: {name} {list(t.shape)}")
        elif tuple(t.shape) not in shapes:
            if name == "fc.weight":
                problems.append("wrong shape: " + _fc_mismatch(cfg, t.shape))
            else:
                problems.append(f"wrong shape: {name}: expected {_fmt(shapes)}, got "
                                f"{list(t.shape)}")
        elif name in ("d2t", "t2d") and t.is_floating_point():
            problems.append(f"wrong dtype: {name}: expected an integer/bool map, got {t.dtype}")
    if problems:
        raise ValueError(f"{source}: drafter weights do not match the config ({cfg.source}); "
                         f"{len(problems)} problem(s):\n  " + "\n  ".join(problems))
    check_float(norm, source)
    if "d2t" in norm:
        _check_d2t(norm["d2t"], cfg, source)
    return norm


def _check_d2t(d2t: torch.Tensor, cfg: DFlashConfig, source: str) -> None:
    """Draft id i maps to target id ``i + d2t[i]``, which must lie in [0, vocab_size): a map
    leading out of the target vocabulary would only fail (IndexError) at the first draft."""
    target = torch.arange(d2t.numel()) + d2t.reshape(-1).long()
    bad = ((target < 0) | (target >= cfg.vocab_size)).nonzero().reshape(-1)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{source}: d2t: draft id i must map to a target id i + d2t[i] in "
                         f"[0, vocab_size={cfg.vocab_size}), got {bad.numel()} outside (first: "
                         f"d2t[{i}] = {int(d2t.reshape(-1)[i])} -> {int(target[i])})")


def _fmt(shapes) -> str:
    return " or ".join(str(list(s)) for s in shapes)


# ---------------------------------------------------------------------------------- stacking
def _get(state: dict, name: str) -> torch.Tensor:
    for key in (name, "model." + name):
        if key in state:
            return state[key]
    raise KeyError(f"{name}: not in the state dict (run check_drafter_state first)")


def stack_kv(state: dict, cfg: DFlashConfig, dtype: Optional[torch.dtype] = None) -> tuple:
    """``(w_kv [L*2*Hkv*D, H], b_kv [L*2*Hkv*D] or None, k_weight [L, D])``.

    Rows are layer-major and, inside a layer, the K rows then the V rows, so
    ``(x @ w_kv.T).view(T, L, 2, Hkv, D)`` gives ``[:, l, 0]`` = K and ``[:, l, 1]`` = V of layer l.
    ``b_kv`` is None unless ``cfg.attention_bias``. ``k_weight`` stacks the per-layer k_norm
    weights."""
    kvd, H = cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    ws, bs, kn = [], [], []
    for i in range(cfg.num_layers):
        a = f"layers.{i}.self_attn"
        for proj in ("k_proj", "v_proj"):
            w = _get(state, f"{a}.{proj}.weight")
            if tuple(w.shape) != (kvd, H):
                raise ValueError(f"{a}.{proj}.weight: expected {[kvd, H]}, got {list(w.shape)}")
            ws.append(w)
            if cfg.attention_bias:
                bs.append(_get(state, f"{a}.{proj}.bias"))
        kn.append(_get(state, f"{a}.k_norm.weight"))
    dtype = dtype or ws[0].dtype
    w_kv = torch.cat([w.to(dtype) for w in ws], 0).contiguous()
    b_kv = torch.cat([b.to(dtype) for b in bs], 0).contiguous() if bs else None
    k_weight = torch.stack([w.to(dtype) for w in kn], 0).contiguous()
    return w_kv, b_kv, k_weight


# ---------------------------------------------------------------------------------- writing
def _save_state(directory: str, state: dict, shards: int) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    # a checkpoint written here before (another shard count) must not outlive this one: the
    # loader prefers an index to model.safetensors and would read the old shards
    for old in os.listdir(directory):
        if old in ("model.safetensors", "model.safetensors.index.json") or \
                re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", old):
            os.remove(os.path.join(directory, old))
    if shards <= 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(directory, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def save_zlab(directory: "str | os.PathLike", cfg_dict: dict, state: dict, shards: int = 1) -> str:
    """Write a z-lab-format checkpoint (config.json + model.safetensors, or ``shards`` files with
    an index). Returns the directory."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=1)
    _save_state(directory, state, shards)
    return directory


def save_target(directory: "str | os.PathLike", cfg_dict: dict, state: dict,
                shards: int = 1) -> str:
    """Write an HF-format target checkpoint (config.json of a Qwen3ForCausalLM /
    LlamaForCausalLM + safetensors under the HF names, e.g. ``target.random_state``'s), which
    transformers and vLLM load. Returns the directory."""
    return save_zlab(directory, cfg_dict, state, shards)


# z-lab top-level / dflash_config keys that are not layer config in speculators format.
_DRAFT_KEYS = ("architectures", "auto_map", "dflash_config", "block_size", "num_target_layers",
               "target_hidden_size", "draft_vocab_size", "is_causal", "causal",
               "sliding_window_non_causal", "mask_token_id", "target_layer_ids",
               "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
               "attention_sink_bias", "conv_kernel_size", "conv_group_size", "selector_rank",
               "selector_top_k")


def zlab_to_speculators(cfg_dict: dict) -> dict:
    """The speculators-format config for a z-lab config dict (aux ids = z-lab ids + 1)."""
    d = copy.deepcopy(cfg_dict)
    dc = d.get("dflash_config") or {}

    def get(name, default=None):
        return dc.get(name, d.get(name, default))

    v2 = ("DFlash2DraftModel" in (d.get("architectures") or [])
          or any(get(n) is not None for n in ("conv_kernel_size", "conv_group_size",
                                              "selector_rank", "selector_top_k")))
    ids = get("target_layer_ids")
    if ids is None:
        ids = default_target_layer_ids(int(get("num_target_layers")), int(d["num_hidden_layers"]))
    layer = {k: v for k, v in d.items() if k not in _DRAFT_KEYS}
    layer.setdefault("model_type", "qwen3")
    for k in (*_ROPE_NEOX_KEYS, *_ROPE_GPTJ_KEYS):  # dflash_config's RoPE style (the z-lab
        if dc.get(k) is not None:                    # parser reads it there too)
            layer.setdefault(k, dc[k])
    mt = "dflash2" if v2 else "dflash"
    out = {
        "speculators_model_type": mt,
        "architectures": ["DFlash2DraftModel" if v2 else "DFlashDraftModel"],
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in ids],
        "mask_token_id": get("mask_token_id"),
        "block_size": get("block_size", 16),
        "draft_vocab_size": get("draft_vocab_size"),
        "target_hidden_size": get("target_hidden_size"),
        "sliding_window_non_causal": bool(get("sliding_window_non_causal", False)),
        "speculators_config": {"algorithm": mt},
    }
    causal = [v for v in (d.get("is_causal"), d.get("causal"), dc.get("is_causal"),
                          dc.get("causal")) if v is not None]
    if causal:
        out["is_causal"] = bool(causal[0])
    for name in ("num_target_layers", "input_embedding_scale", "output_multiplier",
                 "final_logit_softcapping", "attention_sink_bias", "conv_kernel_size",
                 "conv_group_size", "selector_rank", "selector_top_k"):
        if get(name) is not None:
            out[name] = get(name)
    return out


def save_speculators(directory: "str | os.PathLike", cfg_dict: dict, state: dict,
                     shards: int = 1) -> str:
    """Write a speculators-format checkpoint from a **z-lab** config dict (see
    :func:`zlab_to_speculators`). Returns the directory."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(zlab_to_speculators(cfg_dict), f, indent=1)
    _save_state(directory, state, shards)
    return directory
