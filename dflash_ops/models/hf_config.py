"""The decoder-layer fields of an HF Qwen3 / Llama ``config.json``, parsed once for both models:
the drafter's :class:`~dflash_ops.models.config.DFlashConfig` (its top level, or speculators'
``transformer_layer_config``) and the target's :class:`~dflash_ops.models.target.TargetConfig`.

Errors name the field (with its key path in the file) and the file: ``ValueError`` for a value
that is missing or wrong, ``NotImplementedError`` for a valid setting the models do not run.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Optional

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
# HF config-class defaults (Qwen3Config / LlamaConfig) for fields a config.json may leave out;
# None: the generic rule (head_dim = hidden / heads, KV heads = heads). Other model types: the
# generic rules and 32768 positions.
HF_DEFAULTS = {
    # qwen3: Qwen3Config's defaults (use_sliding_window False, sliding_window 4096: it keeps
    # the window only where use_sliding_window is true)
    "qwen3": dict(head_dim=128, num_key_value_heads=32, max_position_embeddings=32768,
                  use_sliding_window=False, sliding_window=4096),
    "llama": dict(head_dim=None, num_key_value_heads=None, max_position_embeddings=2048),
}
# other model types: no default for the sliding flags (an absent flag is not read as false)
_GENERIC = dict(head_dim=None, num_key_value_heads=None, max_position_embeddings=32768)
_ROPE_NEOX_KEYS = ("rope_is_neox_style", "is_neox_style", "rope_is_neox")   # True = NeoX
_ROPE_GPTJ_KEYS = ("rope_interleaved", "rotary_interleaved")                # True = GPT-J


def fail(source: str, field: str, msg: str) -> ValueError:
    return ValueError(f"{source}: {field}: {msg}")


def as_int(value: Any, source: str, field: str, *, allow_none: bool = False) -> Optional[int]:
    """``value`` as an int: ints, integral floats and numpy / torch integer scalars; not bools or
    strings."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise fail(source, field, f"must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise fail(source, field, f"must be an integer, got {value!r}")
        value = int(value)
    if not isinstance(value, int):
        try:
            value = int(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            raise fail(source, field, f"must be an integer, got {value!r}") from None
    return value


def as_float(value: Any, source: str, field: str) -> float:
    if isinstance(value, (bool, str, bytes)):
        raise fail(source, field, f"must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise fail(source, field, f"must be a number, got {value!r}") from None


# The cos/sin table keeps rows past the caches' max_len up to this many positions (the largest
# max_position_embeddings of the supported models): a larger cache swapped in later (the e2e
# bench builds with a one-block cache) still finds its positions rotated.
ROPE_TABLE_MIN_CAP = 1 << 20  # 1M positions: every published context length keeps its table


def rope_table_len(max_position_embeddings: int, max_len: int) -> int:
    """Rows of the cos/sin table of a model whose KV cache holds ``max_len`` positions per
    request (its whole blocks): ``max(max_position_embeddings, max_len)``, but no more than
    ``max(max_len, ROPE_TABLE_MIN_CAP)``: positions past the cache have no slot, and a huge
    max_position_embeddings (1e9: an 8 GB table) must allocate nothing big."""
    return min(max(max_position_embeddings, max_len), max(max_len, ROPE_TABLE_MIN_CAP))


def read_json(path: "str | os.PathLike") -> tuple:
    """(the JSON object, its file name) of ``path``: a config.json or the directory holding it."""
    source = os.fspath(path)
    want = "a checkpoint directory holding config.json (or the config.json file)"
    if os.path.isdir(source):
        source = os.path.join(source, "config.json")
    elif source.endswith(".safetensors") and os.path.isfile(source):
        raise ValueError(f"{source}: expected {want}, got a safetensors weights file")
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{source}: no such config file")
    try:
        with open(source, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{source}: expected {want}; config.json must be UTF-8 JSON, got "
                         f"non-UTF-8 bytes ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
    return d, source


def check_rope_scaling(rs: Optional[dict], source: str, field: str) -> None:
    """Only default RoPE: ``rs`` (rope_scaling / rope_parameters) is null or of rope_type
    default, with no per-layer-type entries."""
    if rs is None:
        return
    if not isinstance(rs, dict):
        raise fail(source, field, f"must be a dict or null, got {rs!r}")
    if any(isinstance(v, dict) for v in rs.values()):
        raise NotImplementedError(f"{source}: {field}: per-layer-type RoPE parameters are not "
                                  f"supported ({sorted(rs)})")
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type not in (None, "default"):
        raise NotImplementedError(f"{source}: {field}.rope_type = {rope_type!r}: only default RoPE "
                                  "(no scaling) is supported")


def _agreed(source: str, prefix: str, name: str, places: tuple) -> Optional[float]:
    """A number that may be set in several places (``(label, value)``, None: unset): the one
    value all set places agree on, or None."""
    found = {prefix + label: as_float(v, source, prefix + label) for label, v in places
             if v is not None}
    if len(set(found.values())) > 1:
        raise fail(source, "/".join(found), f"disagree on {name}: {found}")
    return next(iter(found.values())) if found else None


def layer_fields(lc: dict, source: str, prefix: str = "", *, extra: tuple = (),
                 hf_defaults: bool = False, partial_rotary: bool = True) -> dict:
    """The decoder fields of ``lc`` under ``DFlashConfig``'s names (hidden_size, num_layers,
    num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size, rms_norm_eps, rope_theta,
    rope_scaling, rotary_dim, rope_is_neox, attention_bias, max_position_embeddings, layer_types,
    sliding_window). ``prefix``: lc's key path in the file, for messages; ``extra``: further
    ``(label, dict)`` searched for RoPE-style flags.

    head_dim / num_key_value_heads left out: with ``hf_defaults`` (an HF model's own config)
    HF's config-class default for the model_type; otherwise the generic rule, refused where
    HF's default differs (how HF would load the file is then ambiguous). ``partial_rotary=False``
    refuses a partial_rotary_factor below 1 (the target rotates whole heads)."""
    def need(name):
        if lc.get(name) is None:
            raise fail(source, prefix + name, "missing (required)")
        return lc[name]

    model_type = lc.get("model_type")
    defaults = HF_DEFAULTS.get(model_type, _GENERIC)
    hidden = as_int(need("hidden_size"), source, prefix + "hidden_size")
    layers = as_int(need("num_hidden_layers"), source, prefix + "num_hidden_layers")
    heads = as_int(need("num_attention_heads"), source, prefix + "num_attention_heads")
    if heads <= 0:
        raise fail(source, prefix + "num_attention_heads", f"must be positive, got {heads}")

    head_dim = as_int(lc.get("head_dim"), source, prefix + "head_dim", allow_none=True)
    if head_dim is None:
        hf = defaults["head_dim"]
        if hf_defaults and hf is not None:
            head_dim = hf
        else:
            if hidden % heads:
                raise fail(source, prefix + "head_dim",
                           f"absent, and hidden_size={hidden} is not divisible by "
                           f"num_attention_heads={heads} (head_dim defaults to hidden/heads)")
            head_dim = hidden // heads
            if hf is not None and head_dim != hf:
                raise fail(source, prefix + "head_dim",
                           f"absent: hidden_size/num_attention_heads = {head_dim} but HF's "
                           f"{model_type} config defaults to {hf}; set head_dim explicitly")
    kv_heads = lc.get("num_key_value_heads")
    if kv_heads is None:
        hf = defaults["num_key_value_heads"]
        if hf_defaults and hf is not None:
            kv_heads = hf
        else:
            kv_heads = heads
            if hf is not None and heads != hf:
                raise fail(source, prefix + "num_key_value_heads",
                           f"absent: num_attention_heads={heads} but HF's {model_type} config "
                           f"defaults to {hf}; set it explicitly")
    act = lc.get("hidden_act")
    if act not in (None, "silu", "swish"):
        raise NotImplementedError(f"{source}: {prefix}hidden_act = {act!r}: only SwiGLU (silu) "
                                  "MLPs are supported")
    if lc.get("mlp_bias"):
        raise NotImplementedError(f"{source}: {prefix}mlp_bias = true: MLP biases are not "
                                  "supported")

    # RoPE: rope_theta at the top level or in rope_parameters (transformers >= 5) / rope_scaling.
    rp = lc.get("rope_parameters")
    rs = lc.get("rope_scaling")
    for name, val in (("rope_parameters", rp), ("rope_scaling", rs)):
        check_rope_scaling(val, source, prefix + name)
    nested = (("rope_parameters.", rp or {}), ("rope_scaling.", rs or {}))
    theta = _agreed(source, prefix, "rope_theta", (("rope_theta", lc.get("rope_theta")),) + tuple(
        (where + "rope_theta", d.get("rope_theta")) for where, d in nested))
    theta = 10000.0 if theta is None else theta
    prf = _agreed(source, prefix, "partial_rotary_factor",
                  (("partial_rotary_factor", lc.get("partial_rotary_factor")),) + tuple(
                      (where + "partial_rotary_factor", d.get("partial_rotary_factor"))
                      for where, d in nested))
    prf = 1.0 if prf is None else prf
    if not 0 < prf <= 1:
        raise fail(source, prefix + "partial_rotary_factor", f"must be in (0, 1], got {prf}")
    rotary_dim = int(head_dim * prf)
    if prf != 1.0:
        if not partial_rotary:
            raise NotImplementedError(f"{source}: {prefix}partial_rotary_factor = {prf}: only "
                                      "full-head RoPE is supported")
        # HF Qwen3's default RoPE (what the dflash reference instantiates) ignores
        # partial_rotary_factor and rotates the whole head; we honour the field. Say so.
        warnings.warn(f"{source}: {prefix}partial_rotary_factor={prf}: rotating {rotary_dim} of "
                      f"{head_dim} dims per head; note HF Qwen3's default RoPE (used by the dflash "
                      "reference) ignores this field and rotates the full head_dim", stacklevel=3)

    # RoPE style flags (NeoX vs GPT-J); any disagreement is an error.
    styles = {}
    for where, dct in ((prefix.rstrip(".") or "top level", lc),
                       *((n, x) for n, x in extra if isinstance(x, dict)),
                       (prefix + "rope_parameters", rp if isinstance(rp, dict) else {})):
        for k in _ROPE_NEOX_KEYS:
            if dct.get(k) is not None:
                styles[f"{where}:{k}"] = bool(dct[k])
        for k in _ROPE_GPTJ_KEYS:
            if dct.get(k) is not None:
                styles[f"{where}:{k}"] = not bool(dct[k])
    if len(set(styles.values())) > 1:
        raise fail(source, "/".join(sorted(styles)), f"disagree on the RoPE style (NeoX vs GPT-J):"
                                                     f" {styles}")
    rope_is_neox = next(iter(styles.values())) if styles else True

    # Layer types / sliding window, as HF Qwen3Config derives them.
    layer_types = lc.get("layer_types")
    use_sw = lc.get("use_sliding_window", defaults.get("use_sliding_window"))
    window = lc["sliding_window"] if "sliding_window" in lc else (
        defaults.get("sliding_window") if use_sw else None)
    flag = "use_sliding_window" + ("" if "use_sliding_window" in lc else
                                   f" (absent: {model_type}'s default, false)")
    if layer_types is None:
        # HF: sliding for i >= max_window_layers, only when use_sliding_window and a window is set.
        mwl = as_int(lc.get("max_window_layers", 28), source, prefix + "max_window_layers")
        layer_types = [SLIDING if (use_sw and window is not None and i >= mwl) else FULL
                       for i in range(layers)]
    elif not isinstance(layer_types, (list, tuple)):
        raise fail(source, prefix + "layer_types", f"must be a list, got {layer_types!r}")
    if use_sw is False and window is not None and SLIDING in layer_types:
        # HF Qwen3Config nulls sliding_window when use_sliding_window is false (so the torch
        # reference would run these layers unwindowed) while the MLX reference windows them.
        raise fail(source, prefix + "use_sliding_window/sliding_window",
                   f"{flag} is false but sliding_window={window} and layer_types has "
                   f"'{SLIDING}' layers: ambiguous (HF drops the window, MLX keeps it); fix the "
                   "config")

    # Structural checks here too, so messages carry the config's own key path (the config
    # dataclasses re-check everything under their own field names).
    kv_heads = as_int(kv_heads, source, prefix + "num_key_value_heads")
    inter = as_int(need("intermediate_size"), source, prefix + "intermediate_size")
    vocab = as_int(need("vocab_size"), source, prefix + "vocab_size")
    for name, v in (("hidden_size", hidden), ("num_hidden_layers", layers),
                    ("num_key_value_heads", kv_heads), ("head_dim", head_dim),
                    ("intermediate_size", inter), ("vocab_size", vocab)):
        if v <= 0:
            raise fail(source, prefix + name, f"must be positive, got {v}")
    if heads % kv_heads:
        raise fail(source, prefix + "num_attention_heads/" + prefix + "num_key_value_heads",
                   f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    if len(layer_types) != layers:
        raise fail(source, prefix + "layer_types", f"has {len(layer_types)} entries but "
                                                   f"num_hidden_layers = {layers}")
    if SLIDING in layer_types and window is None:
        raise fail(source, prefix + "sliding_window",
                   f"layers {[i for i, t in enumerate(layer_types) if t == SLIDING]} are "
                   f"'{SLIDING}' but no sliding_window is set")

    return dict(
        hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
        rms_norm_eps=lc.get("rms_norm_eps", 1e-6), rope_theta=theta,
        rope_scaling=rp if rp is not None else rs, rotary_dim=rotary_dim,
        rope_is_neox=rope_is_neox, attention_bias=bool(lc.get("attention_bias", False)),
        max_position_embeddings=as_int(lc.get("max_position_embeddings",
                                              defaults["max_position_embeddings"]),
                                       source, prefix + "max_position_embeddings"),
        layer_types=list(layer_types), sliding_window=window,
    )
