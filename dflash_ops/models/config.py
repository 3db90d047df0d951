"""DFlash drafter configuration: one dataclass read from z-lab/HF or speculators checkpoints.

Both formats are normalised into :class:`DFlashConfig` (see /work/shared/DFLASH.md, "Checkpoint
formats"). Everything that would silently cost acceptance (layer-id off-by-one, RoPE style, a
missing mask token, an fc that does not match the taps) is checked here and raised with the field
name and the file it came from.

Layer ids follow the **z-lab convention**: ``target_layer_ids[j] = i`` means "the output of target
decoder layer ``i``", i.e. HF ``hidden_states[i + 1]``. speculators stores *capture ids*
(``aux_hidden_state_layer_ids`` = z-lab id + 1); they are shifted down by one on load.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["DFlashConfig", "validate_fc", "default_target_layer_ids"]

FULL = "full_attention"
SLIDING = "sliding_attention"
_LAYER_TYPES = (FULL, SLIDING)
_MODEL_TYPES = ("dflash", "dflash2")
# speculators' DFlash2SpeculatorConfig defaults for the conv / selector fields.
_DFLASH2_SPECULATORS_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16,
                                 "selector_rank": 256, "selector_top_k": 16}
_DFLASH2_FIELDS = tuple(_DFLASH2_SPECULATORS_DEFAULTS)
# HF Qwen3Config's own defaults for fields a DFlash config may leave out. Where the generic default
# (head_dim = hidden/heads, kv heads = heads) differs from these, the value is ambiguous (the
# reference loads configs through Qwen3Config) and we refuse to guess.
_QWEN3_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 32}
_ROPE_NEOX_KEYS = ("rope_is_neox_style", "is_neox_style", "rope_is_neox")   # True = NeoX
_ROPE_GPTJ_KEYS = ("rope_interleaved", "rotary_interleaved")                # True = GPT-J


def _fail(source: str, field: str, msg: str) -> ValueError:
    return ValueError(f"{source}: {field}: {msg}")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's rule when a checkpoint names no layers: ``[N//2]`` for one drafter layer,
    else ``round(1 + i*(N-4)/(L-1))`` for ``i < L`` (z-lab ids)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _as_int(value: Any, source: str, field: str, *, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or value is None:
        raise _fail(source, field, f"must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise _fail(source, field, f"must be an integer, got {value!r}")
        value = int(value)
    if not isinstance(value, int):
        try:
            value = int(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            raise _fail(source, field, f"must be an integer, got {value!r}") from None
    return value


def _as_float(value: Any, source: str, field: str) -> float:
    if isinstance(value, bool):
        raise _fail(source, field, f"must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise _fail(source, field, f"must be a number, got {value!r}") from None


@dataclass(frozen=True)
class DFlashConfig:
    """Everything the drafter needs, normalised across checkpoint formats.

    Construct through :meth:`from_dict` / :meth:`from_pretrained`; direct construction is validated
    the same way (``__post_init__``).
    """
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    rotary_dim: Optional[int] = None          # None -> head_dim
    rope_is_neox: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    layer_types: Optional[list] = None        # None -> all "full_attention"
    sliding_window: Optional[int] = None
    causal_override: Optional[bool] = None
    sliding_non_causal: bool = False
    block_size: int = 16
    num_target_layers: Optional[int] = None
    target_hidden_size: Optional[int] = None  # None -> hidden_size
    draft_vocab_size: Optional[int] = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None   # values <= 0 are normalised to None
    attention_sinks: bool = False
    model_type: str = "dflash"
    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None
    selector_rank: Optional[int] = None
    selector_top_k: Optional[int] = None
    source: str = "<dict>"

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        src = self.source
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings", "block_size",
                     "mask_token_id"):
            put(name, _as_int(getattr(self, name), src, name))
        for name in ("rotary_dim", "sliding_window", "num_target_layers", "target_hidden_size",
                     "draft_vocab_size", *_DFLASH2_FIELDS):
            put(name, _as_int(getattr(self, name), src, name, allow_none=True))
        for name in ("rms_norm_eps", "rope_theta", "input_embedding_scale", "output_multiplier"):
            put(name, _as_float(getattr(self, name), src, name))
        if self.rotary_dim is None:
            put("rotary_dim", self.head_dim)
        if self.target_hidden_size is None:
            put("target_hidden_size", self.hidden_size)
        if self.layer_types is None:
            put("layer_types", [FULL] * self.num_layers)
        put("layer_types", [str(t) for t in self.layer_types])
        if self.final_logit_softcapping is not None:
            cap = _as_float(self.final_logit_softcapping, src, "final_logit_softcapping")
            put("final_logit_softcapping", cap if cap > 0 else None)  # the reference skips <= 0
        for name in ("rope_is_neox", "attention_bias", "sliding_non_causal", "attention_sinks"):
            put(name, bool(getattr(self, name)))
        if self.causal_override is not None:
            put("causal_override", bool(self.causal_override))
        if self.rope_scaling is not None:
            put("rope_scaling", dict(self.rope_scaling))

        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings", "block_size",
                     "rotary_dim", "target_hidden_size"):
            if getattr(self, name) <= 0:
                raise _fail(src, name, f"must be positive, got {getattr(self, name)}")
        for name in ("sliding_window", "num_target_layers", "draft_vocab_size", *_DFLASH2_FIELDS):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise _fail(src, name, f"must be positive, got {v}")
        for name in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise _fail(src, name, f"must be positive, got {getattr(self, name)}")

        if self.num_heads % self.num_kv_heads:
            raise _fail(src, "num_attention_heads/num_key_value_heads",
                        f"num_heads={self.num_heads} is not a multiple of "
                        f"num_kv_heads={self.num_kv_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise _fail(src, "rotary_dim (head_dim * partial_rotary_factor)",
                        f"must be even and <= head_dim={self.head_dim}, got {self.rotary_dim}")
        _check_rope_scaling(self.rope_scaling, src, "rope_scaling")

        if len(self.layer_types) != self.num_layers:
            raise _fail(src, "layer_types",
                        f"has {len(self.layer_types)} entries but num_hidden_layers (num_layers) = "
                        f"{self.num_layers}")
        bad = sorted({t for t in self.layer_types if t not in _LAYER_TYPES})
        if bad:
            raise _fail(src, "layer_types", f"unknown layer type(s) {bad}; expected one of "
                                            f"{list(_LAYER_TYPES)}")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise _fail(src, "sliding_window",
                        f"layers {[i for i, t in enumerate(self.layer_types) if t == SLIDING]} are "
                        f"'{SLIDING}' but no sliding_window is set")

        if not 0 <= self.mask_token_id < self.vocab_size:
            raise _fail(src, "mask_token_id", f"{self.mask_token_id} is outside the vocabulary "
                                              f"[0, vocab_size={self.vocab_size})")
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise _fail(src, "draft_vocab_size", f"{self.draft_vocab_size} > vocab_size="
                                                 f"{self.vocab_size}")

        if self.target_layer_ids is None or isinstance(self.target_layer_ids, (str, bytes)):
            raise _fail(src, "target_layer_ids", f"must be a list of ints, got "
                                                 f"{self.target_layer_ids!r}")
        ids = [_as_int(i, src, "target_layer_ids") for i in self.target_layer_ids]
        if not ids:
            raise _fail(src, "target_layer_ids", "is empty")
        if min(ids) < 0:
            raise _fail(src, "target_layer_ids", f"{ids} has a negative id (z-lab ids: output of "
                                                 "target decoder layer i, 0-based)")
        if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
            raise _fail(src, "target_layer_ids", f"{ids} reaches past num_target_layers="
                                                 f"{self.num_target_layers}")
        put("target_layer_ids", ids)

        if self.model_type not in _MODEL_TYPES:
            raise _fail(src, "model_type", f"{self.model_type!r} is not one of {list(_MODEL_TYPES)}")
        if self.model_type == "dflash2":
            missing = [n for n in _DFLASH2_FIELDS if getattr(self, n) is None]
            if missing:
                raise _fail(src, "/".join(missing), "required for a DFlash 2 drafter")
            if self.hidden_size % self.conv_group_size:
                raise _fail(src, "conv_group_size", f"{self.conv_group_size} does not divide "
                                                    f"hidden_size={self.hidden_size}")

    # ------------------------------------------------------------------ per-layer rules
    def layer_causal(self, i: int) -> bool:
        """Whether the block's self-attention in drafter layer ``i`` is causal.

        Rule: ``causal_override`` when set; otherwise sliding layers are causal unless
        ``sliding_non_causal``, full layers are bidirectional.

        This is the reference's rule (``dflash.model.Qwen3DFlashAttention``: ``is_causal = None ->
        layer_type == "sliding_attention"``, else ``bool(is_causal)`` for every layer) with one
        addition: ``sliding_non_causal`` (speculators' ``sliding_window_non_causal``, DFlash 2),
        which the reference package does not read. speculators documents it as "bidirectional
        masking within draft blocks for sliding window layers; full attention layers are always
        bidirectional", so it only flips sliding layers. Note vLLM's speculators translation turns
        ``sliding_window_non_causal: false`` into a *global* ``dflash_config.causal = true`` (full
        layers causal too); we follow speculators' own semantics, not that translation.
        """
        if self.causal_override is not None:
            return self.causal_override
        if self.layer_types[i] == SLIDING:
            return not self.sliding_non_causal
        return False

    def layer_window(self, i: int) -> int:
        """The attention window of layer ``i``: ``sliding_window`` for sliding layers, -1 for full.

        Same meaning as the reference mask and ``block_attention``'s ``window``: a query at
        position p sees keys j with ``p - j < window`` (causal) or ``|p - j| < window``."""
        return self.sliding_window if self.layer_types[i] == SLIDING else -1

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING

    @property
    def kv_width(self) -> int:
        """Rows of the stacked context K/V weight: ``L * 2 * Hkv * D``."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def fc_in_features(self) -> int:
        """``n_taps * target_hidden_size``: the width of ``fc.weight``."""
        return self.n_taps * self.target_hidden_size

    @property
    def out_vocab_size(self) -> int:
        """Rows of the drafter's own LM head, if it ships one (draft vocab when reduced)."""
        return self.draft_vocab_size or self.vocab_size

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> "DFlashConfig":
        """Parse a config dict, auto-detecting speculators (``speculators_model_type``) vs z-lab/HF."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: the config must be a JSON object, got {type(d).__name__}")
        if "speculators_model_type" in d:
            return cls(**_parse_speculators(d, source))
        return cls(**_parse_zlab(d, source))

    @classmethod
    def from_pretrained(cls, path: "str | os.PathLike") -> "DFlashConfig":
        """Read ``config.json`` from a checkpoint directory (or the json file itself)."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file}: no DFlash config.json here")
        try:
            with open(file, encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=file)

    def replace(self, **changes) -> "DFlashConfig":
        return dataclasses.replace(self, **changes)


def validate_fc(cfg: DFlashConfig, fc_shape, source: Optional[str] = None) -> None:
    """``fc.weight`` must be ``[hidden_size, n_taps * target_hidden_size]`` (fc width vs taps x
    target hidden); raises a ValueError naming the fields otherwise."""
    msg = _fc_mismatch(cfg, fc_shape)
    if msg:
        raise ValueError(f"{source or cfg.source}: {msg}")


def _fc_mismatch(cfg: DFlashConfig, fc_shape) -> Optional[str]:
    shape = tuple(int(s) for s in fc_shape)
    want = (cfg.hidden_size, cfg.fc_in_features)
    if shape == want:
        return None
    msg = (f"fc.weight: expected {list(want)} = [hidden_size, n_taps x target_hidden_size = "
           f"{cfg.n_taps} x {cfg.target_hidden_size}] (fc width vs taps x target hidden; "
           f"target_layer_ids={cfg.target_layer_ids}), got {list(shape)}")
    if len(shape) == 2 and shape[0] == cfg.hidden_size and shape[1] != want[1]:
        if shape[1] % cfg.target_hidden_size == 0:
            msg += (f"; the weight fits {shape[1] // cfg.target_hidden_size} taps of "
                    f"target_hidden_size={cfg.target_hidden_size}")
        elif shape[1] % cfg.n_taps == 0:
            msg += (f"; the weight fits {cfg.n_taps} taps of target_hidden_size="
                    f"{shape[1] // cfg.n_taps}")
    return msg


# ---------------------------------------------------------------------------------- parsing
def _check_rope_scaling(rs: Optional[dict], source: str, field: str) -> None:
    if rs is None:
        return
    if not isinstance(rs, dict):
        raise _fail(source, field, f"must be a dict or null, got {rs!r}")
    if any(isinstance(v, dict) for v in rs.values()):
        raise NotImplementedError(f"{source}: {field}: per-layer-type RoPE parameters are not "
                                  f"supported ({sorted(rs)})")
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type not in (None, "default"):
        raise NotImplementedError(f"{source}: {field}.rope_type = {rope_type!r}: only default RoPE "
                                  "(no scaling) is supported")


def _draft_getter(d: dict):
    """The reference's ``_draft_value``: ``dflash_config`` wins over the top level."""
    dc = d.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise ValueError("dflash_config must be a JSON object")

    def get(name, default=None):
        if name in dc:
            return dc[name]
        return d.get(name, default)
    return dc, get


def _where(d: dict, dc: dict, name: str) -> str:
    return f"dflash_config.{name}" if name in dc else name


def _layer_fields(lc: dict, source: str, prefix: str, extra: tuple = ()) -> dict:
    """Qwen3-style layer fields from ``lc`` (the top level, or speculators'
    ``transformer_layer_config``); ``extra`` are further dicts searched for RoPE-style flags."""
    def need(name):
        if lc.get(name) is None:
            raise _fail(source, prefix + name, "missing (required)")
        return lc[name]

    hf_model_type = lc.get("model_type")
    hidden = _as_int(need("hidden_size"), source, prefix + "hidden_size")
    layers = _as_int(need("num_hidden_layers"), source, prefix + "num_hidden_layers")
    heads = _as_int(need("num_attention_heads"), source, prefix + "num_attention_heads")
    if heads <= 0:
        raise _fail(source, prefix + "num_attention_heads", f"must be positive, got {heads}")

    head_dim = _as_int(lc.get("head_dim"), source, prefix + "head_dim", allow_none=True)
    if head_dim is None:
        if hidden % heads:
            raise _fail(source, prefix + "head_dim",
                        f"absent, and hidden_size={hidden} is not divisible by "
                        f"num_attention_heads={heads} (head_dim defaults to hidden/heads)")
        head_dim = hidden // heads
        if hf_model_type == "qwen3" and head_dim != _QWEN3_DEFAULTS["head_dim"]:
            raise _fail(source, prefix + "head_dim",
                        f"absent: hidden_size/num_attention_heads = {head_dim} but HF Qwen3Config "
                        f"(how the reference loads this model_type) defaults to "
                        f"{_QWEN3_DEFAULTS['head_dim']}; set head_dim explicitly")
    kv_heads = lc.get("num_key_value_heads")
    if kv_heads is None:
        kv_heads = heads
        if hf_model_type == "qwen3" and heads != _QWEN3_DEFAULTS["num_key_value_heads"]:
            raise _fail(source, prefix + "num_key_value_heads",
                        f"absent: num_attention_heads={heads} but HF Qwen3Config defaults to "
                        f"{_QWEN3_DEFAULTS['num_key_value_heads']}; set it explicitly")
    act = lc.get("hidden_act")
    if act not in (None, "silu", "swish"):
        raise NotImplementedError(f"{source}: {prefix}hidden_act = {act!r}: the drafter MLP is "
                                  "SwiGLU (silu) only")

    # RoPE: rope_theta at the top level or in rope_parameters (transformers >= 5) / rope_scaling.
    rp = lc.get("rope_parameters")
    rs = lc.get("rope_scaling")
    for name, val in (("rope_parameters", rp), ("rope_scaling", rs)):
        _check_rope_scaling(val, source, prefix + name)
    theta = lc.get("rope_theta")
    rp_theta = (rp or {}).get("rope_theta")
    if theta is not None and rp_theta is not None and float(theta) != float(rp_theta):
        raise _fail(source, prefix + "rope_theta/rope_parameters.rope_theta",
                    f"disagree: {theta} vs {rp_theta}")
    theta = theta if theta is not None else rp_theta
    theta = 10000.0 if theta is None else _as_float(theta, source, prefix + "rope_theta")
    prf = lc.get("partial_rotary_factor")
    rp_prf = (rp or {}).get("partial_rotary_factor")
    if prf is not None and rp_prf is not None and float(prf) != float(rp_prf):
        raise _fail(source, prefix + "partial_rotary_factor",
                    f"disagrees with rope_parameters.partial_rotary_factor: {prf} vs {rp_prf}")
    prf = prf if prf is not None else rp_prf
    prf = 1.0 if prf is None else _as_float(prf, source, prefix + "partial_rotary_factor")
    if not 0 < prf <= 1:
        raise _fail(source, prefix + "partial_rotary_factor", f"must be in (0, 1], got {prf}")
    rotary_dim = int(head_dim * prf)
    if prf != 1.0:
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
        raise _fail(source, "/".join(sorted(styles)), f"disagree on the RoPE style (NeoX vs GPT-J):"
                                                      f" {styles}")
    rope_is_neox = next(iter(styles.values())) if styles else True

    # Layer types / sliding window, as HF Qwen3Config derives them.
    layer_types = lc.get("layer_types")
    window = lc.get("sliding_window")
    use_sw = lc.get("use_sliding_window")
    if layer_types is None:
        # HF: sliding for i >= max_window_layers, only when use_sliding_window and a window is set.
        mwl = _as_int(lc.get("max_window_layers", 28), source, prefix + "max_window_layers")
        layer_types = [SLIDING if (use_sw and window is not None and i >= mwl) else FULL
                       for i in range(layers)]
    elif not isinstance(layer_types, (list, tuple)):
        raise _fail(source, prefix + "layer_types", f"must be a list, got {layer_types!r}")
    if use_sw is False and window is not None and SLIDING in layer_types:
        # HF Qwen3Config nulls sliding_window when use_sliding_window is false (so the torch
        # reference would run these layers unwindowed) while the MLX reference windows them.
        raise _fail(source, prefix + "use_sliding_window/sliding_window",
                    f"use_sliding_window is false but sliding_window={window} and layer_types has "
                    f"'{SLIDING}' layers: ambiguous (HF drops the window, MLX keeps it); fix the "
                    "config")

    # Structural checks here too, so messages carry the config's own key path (the dataclass
    # re-checks everything under its own field names).
    kv_heads = _as_int(kv_heads, source, prefix + "num_key_value_heads")
    inter = _as_int(need("intermediate_size"), source, prefix + "intermediate_size")
    vocab = _as_int(need("vocab_size"), source, prefix + "vocab_size")
    for name, v in (("hidden_size", hidden), ("num_hidden_layers", layers),
                    ("num_key_value_heads", kv_heads), ("head_dim", head_dim),
                    ("intermediate_size", inter), ("vocab_size", vocab)):
        if v <= 0:
            raise _fail(source, prefix + name, f"must be positive, got {v}")
    if heads % kv_heads:
        raise _fail(source, prefix + "num_attention_heads/" + prefix + "num_key_value_heads",
                    f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    if len(layer_types) != layers:
        raise _fail(source, prefix + "layer_types", f"has {len(layer_types)} entries but "
                                                    f"num_hidden_layers = {layers}")
    if SLIDING in layer_types and window is None:
        raise _fail(source, prefix + "sliding_window",
                    f"layers {[i for i, t in enumerate(layer_types) if t == SLIDING]} are "
                    f"'{SLIDING}' but no sliding_window is set")

    return dict(
        hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, rms_norm_eps=lc.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=rp if rp is not None else rs, rotary_dim=rotary_dim,
        rope_is_neox=rope_is_neox, attention_bias=bool(lc.get("attention_bias", False)),
        max_position_embeddings=lc.get("max_position_embeddings", 32768),
        layer_types=list(layer_types), sliding_window=window,
    )


def _causal_override(candidates: list, source: str) -> Optional[bool]:
    """``candidates``: (field label, value) pairs; None values are ignored; all set ones must
    agree."""
    found = {label: bool(v) for label, v in candidates if v is not None}
    if len(set(found.values())) > 1:
        raise _fail(source, "/".join(found), f"disagree on causality: {found}")
    return next(iter(found.values())) if found else None


def _parse_zlab(d: dict, source: str) -> dict:
    try:
        dc, get = _draft_getter(d)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    fields = _layer_fields(d, source, "", extra=(("dflash_config", dc),))

    if get("use_swa"):
        raise NotImplementedError(f"{source}: {_where(d, dc, 'use_swa')} (DSpark-style SWA) is not "
                                  "supported; describe the window with layer_types/sliding_window")

    mask = get("mask_token_id")
    if mask is None:
        raise _fail(source, "dflash_config.mask_token_id", "missing (required: the token id of the "
                                                           "block's mask slots)")
    n_target = get("num_target_layers")
    ids = get("target_layer_ids")
    if ids is None:
        if n_target is None:
            raise _fail(source, "dflash_config.target_layer_ids",
                        "missing, and num_target_layers is not set either: cannot derive the "
                        "target layer ids")
        ids = default_target_layer_ids(_as_int(n_target, source, "num_target_layers"),
                                       fields["num_layers"])

    archs = d.get("architectures") or []
    is_v2 = "DFlash2DraftModel" in archs or any(get(n) is not None for n in _DFLASH2_FIELDS)
    model_type = "dflash2" if is_v2 else "dflash"

    causal = _causal_override([("is_causal", d.get("is_causal")),
                               ("dflash_config.is_causal", dc.get("is_causal")),
                               ("dflash_config.causal", dc.get("causal")),
                               ("causal", d.get("causal"))], source)
    fields.update(
        mask_token_id=mask, target_layer_ids=list(ids), num_target_layers=n_target,
        block_size=get("block_size", 16), target_hidden_size=get("target_hidden_size"),
        draft_vocab_size=get("draft_vocab_size"), causal_override=causal,
        sliding_non_causal=bool(get("sliding_window_non_causal", False)),
        input_embedding_scale=get("input_embedding_scale", 1.0),
        output_multiplier=get("output_multiplier", 1.0),
        final_logit_softcapping=get("final_logit_softcapping"),
        attention_sinks=bool(get("attention_sink_bias", False)), model_type=model_type,
        source=source,
    )
    if is_v2:
        fields.update({n: get(n) for n in _DFLASH2_FIELDS})
    return fields


# speculators fields the drafter here cannot honour: fail loudly rather than draft garbage.
_SPECULATORS_UNSUPPORTED = {
    "sample_from_anchor": (False, None),
    "shift_label": (False, None),
    "projector_type": ("dflash", None),
    "draft_ffn_type": ("dense", None),
    "target_hidden_state_format": ("standard", None),
}


def _parse_speculators(d: dict, source: str) -> dict:
    smt = d.get("speculators_model_type")
    if smt not in _MODEL_TYPES:
        raise _fail(source, "speculators_model_type", f"{smt!r} is not a DFlash speculator "
                                                      f"(expected one of {list(_MODEL_TYPES)})")
    for name, ok in _SPECULATORS_UNSUPPORTED.items():
        if d.get(name) not in ok:
            raise NotImplementedError(f"{source}: {name} = {d[name]!r} is not supported "
                                      f"(only {ok[0]!r})")
    lc = d.get("transformer_layer_config")
    if not isinstance(lc, dict):
        raise _fail(source, "transformer_layer_config", "missing or not an object (it holds the "
                                                        "drafter's layer config)")
    fields = _layer_fields(lc, source, "transformer_layer_config.", extra=(("top level", d),))

    mask = d.get("mask_token_id")
    if mask is None:
        raise _fail(source, "mask_token_id", "missing (required: the token id of the block's mask "
                                             "slots)")
    n_target = d.get("num_target_layers")
    aux = d.get("aux_hidden_state_layer_ids")
    if aux is None:
        if n_target is None:
            raise _fail(source, "aux_hidden_state_layer_ids",
                        "missing, and num_target_layers is not set either: cannot derive the "
                        "target layer ids")
        ids = default_target_layer_ids(_as_int(n_target, source, "num_target_layers"),
                                       fields["num_layers"])
    else:
        if not isinstance(aux, (list, tuple)) or not aux:
            raise _fail(source, "aux_hidden_state_layer_ids", f"must be a non-empty list, got "
                                                              f"{aux!r}")
        aux = [_as_int(i, source, "aux_hidden_state_layer_ids") for i in aux]
        if min(aux) < 1:
            raise _fail(source, "aux_hidden_state_layer_ids",
                        f"{aux}: capture ids start at 1 (id k = the hidden state after k target "
                        "layers = z-lab id k-1)")
        ids = [i - 1 for i in aux]   # capture id -> z-lab id (vLLM PR #40727)

    causal = _causal_override([("is_causal", d.get("is_causal")),
                               ("transformer_layer_config.is_causal", lc.get("is_causal"))], source)
    non_causal = d.get("sliding_window_non_causal")
    if non_causal is None:   # speculators' own defaults: False for dflash, True for dflash2
        non_causal = smt == "dflash2"
    fields.update(
        mask_token_id=mask, target_layer_ids=ids, num_target_layers=n_target,
        block_size=d.get("block_size", 8), target_hidden_size=d.get("target_hidden_size"),
        draft_vocab_size=d.get("draft_vocab_size"), causal_override=causal,
        sliding_non_causal=bool(non_causal),
        input_embedding_scale=d.get("input_embedding_scale", 1.0),
        output_multiplier=d.get("output_multiplier", 1.0),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        attention_sinks=bool(d.get("attention_sink_bias", False)), model_type=smt, source=source,
    )
    if smt == "dflash2":
        fields.update({n: d.get(n, _DFLASH2_SPECULATORS_DEFAULTS[n]) for n in _DFLASH2_FIELDS})
    return fields
