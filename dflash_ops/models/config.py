"""DFlash drafter configuration: one dataclass read from z-lab/HF or speculators checkpoints.

Both formats are normalised into :class:`DFlashConfig` (the decoder fields by
``models.hf_config``, the target's parser too). Everything that would silently cost acceptance
(layer-id off-by-one, RoPE style, a missing mask token, an fc that does not match the taps) is
checked here and raised with the field name and the file it came from.

Layer ids follow the **z-lab convention**: ``target_layer_ids[j] = i`` means "the output of target
decoder layer ``i``", i.e. HF ``hidden_states[i + 1]``. speculators stores *capture ids*
(``aux_hidden_state_layer_ids`` = z-lab id + 1); they are shifted down by one on load.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from .hf_config import (
    FULL, LAYER_TYPES, SLIDING, as_float, as_int, check_rope_scaling, fail, layer_fields,
    read_json,
)

__all__ = ["DFlashConfig", "validate_fc", "default_target_layer_ids"]

_MODEL_TYPES = ("dflash", "dflash2")
# The selector's largest top-k (ops.select.TOPK_MAX: the kernels' tiles; a test checks they agree).
SELECTOR_TOP_K_MAX = 64
# speculators' DFlash2SpeculatorConfig defaults for the conv / selector fields.
_DFLASH2_SPECULATORS_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16,
                                 "selector_rank": 256, "selector_top_k": 16}
_DFLASH2_FIELDS = tuple(_DFLASH2_SPECULATORS_DEFAULTS)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's rule when a checkpoint names no layers: ``[N//2]`` for one drafter layer,
    else ``round(1 + i*(N-4)/(L-1))`` for ``i < L`` (z-lab ids)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


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
            put(name, as_int(getattr(self, name), src, name))
        for name in ("rotary_dim", "sliding_window", "num_target_layers", "target_hidden_size",
                     "draft_vocab_size", *_DFLASH2_FIELDS):
            put(name, as_int(getattr(self, name), src, name, allow_none=True))
        for name in ("rms_norm_eps", "rope_theta", "input_embedding_scale", "output_multiplier"):
            put(name, as_float(getattr(self, name), src, name))
        if self.rotary_dim is None:
            put("rotary_dim", self.head_dim)
        if self.target_hidden_size is None:
            put("target_hidden_size", self.hidden_size)
        if self.layer_types is None:
            put("layer_types", [FULL] * self.num_layers)
        put("layer_types", [str(t) for t in self.layer_types])
        if self.final_logit_softcapping is not None:
            cap = as_float(self.final_logit_softcapping, src, "final_logit_softcapping")
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
                raise fail(src, name, f"must be positive, got {getattr(self, name)}")
        for name in ("sliding_window", "num_target_layers", "draft_vocab_size", *_DFLASH2_FIELDS):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise fail(src, name, f"must be positive, got {v}")
        for name in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise fail(src, name, f"must be positive, got {getattr(self, name)}")

        if self.num_heads % self.num_kv_heads:
            raise fail(src, "num_attention_heads/num_key_value_heads",
                       f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise fail(src, "rotary_dim (head_dim * partial_rotary_factor)",
                       f"must be even and <= head_dim={self.head_dim}, got {self.rotary_dim}")
        check_rope_scaling(self.rope_scaling, src, "rope_scaling")

        if len(self.layer_types) != self.num_layers:
            raise fail(src, "layer_types",
                       f"has {len(self.layer_types)} entries but num_hidden_layers (num_layers) = "
                       f"{self.num_layers}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise fail(src, "layer_types", f"unknown layer type(s) {bad}; expected one of "
                                           f"{list(LAYER_TYPES)}")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise fail(src, "sliding_window",
                       f"layers {[i for i, t in enumerate(self.layer_types) if t == SLIDING]} are "
                       f"'{SLIDING}' but no sliding_window is set")

        if not 0 <= self.mask_token_id < self.vocab_size:
            raise fail(src, "mask_token_id", f"{self.mask_token_id} is outside the vocabulary "
                                             f"[0, vocab_size={self.vocab_size})")
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise fail(src, "draft_vocab_size", f"{self.draft_vocab_size} > vocab_size="
                                                f"{self.vocab_size}")

        if self.target_layer_ids is None or isinstance(self.target_layer_ids, (str, bytes)):
            raise fail(src, "target_layer_ids", f"must be a list of ints, got "
                                                f"{self.target_layer_ids!r}")
        ids = [as_int(i, src, "target_layer_ids") for i in self.target_layer_ids]
        if not ids:
            raise fail(src, "target_layer_ids", "is empty")
        if min(ids) < 0:
            raise fail(src, "target_layer_ids", f"{ids} has a negative id (z-lab ids: output of "
                                                "target decoder layer i, 0-based)")
        if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
            raise fail(src, "target_layer_ids", f"{ids} reaches past num_target_layers="
                                                f"{self.num_target_layers}")
        put("target_layer_ids", ids)

        if self.model_type not in _MODEL_TYPES:
            raise fail(src, "model_type", f"{self.model_type!r} is not one of {list(_MODEL_TYPES)}")
        if self.model_type == "dflash2":
            missing = [n for n in _DFLASH2_FIELDS if getattr(self, n) is None]
            if missing:
                raise fail(src, "/".join(missing), "required for a DFlash 2 drafter")
            if self.hidden_size % self.conv_group_size:
                raise fail(src, "conv_group_size", f"{self.conv_group_size} does not divide "
                                                   f"hidden_size={self.hidden_size}")
            vocab = self.draft_vocab_size or self.vocab_size  # the logits the selector reads
            top = min(SELECTOR_TOP_K_MAX, vocab)
            if self.selector_top_k > top:  # (positive: checked with the other counts)
                raise fail(src, "selector_top_k", f"{self.selector_top_k} is not in [1, {top}] "
                                                  f"(row_topk's largest k, {SELECTOR_TOP_K_MAX}, "
                                                  f"and the logits' width, {vocab})")

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
        """Parse a config dict: speculators (``speculators_model_type`` set) or z-lab/HF."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: the config must be a JSON object, got {type(d).__name__}")
        if "speculators_model_type" in d:
            return cls(**_parse_speculators(d, source))
        return cls(**_parse_zlab(d, source))

    @classmethod
    def from_pretrained(cls, path: "str | os.PathLike") -> "DFlashConfig":
        """Read ``config.json`` from a checkpoint directory (or the json file itself)."""
        d, file = read_json(path)
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


def _causal_override(candidates: list, source: str) -> Optional[bool]:
    """``candidates``: (field label, value) pairs; None values are ignored; all set ones must
    agree."""
    found = {label: bool(v) for label, v in candidates if v is not None}
    if len(set(found.values())) > 1:
        raise fail(source, "/".join(found), f"disagree on causality: {found}")
    return next(iter(found.values())) if found else None


def _parse_zlab(d: dict, source: str) -> dict:
    try:
        dc, get = _draft_getter(d)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    fields = layer_fields(d, source, "", extra=(("dflash_config", dc),))

    if get("use_swa"):
        raise NotImplementedError(f"{source}: {_where(d, dc, 'use_swa')} (DSpark-style SWA) is not "
                                  "supported; describe the window with layer_types/sliding_window")

    mask = get("mask_token_id")
    if mask is None:
        raise fail(source, "dflash_config.mask_token_id", "missing (required: the token id of the "
                                                          "block's mask slots)")
    n_target = get("num_target_layers")
    ids = get("target_layer_ids")
    if ids is None:
        if n_target is None:
            raise fail(source, "dflash_config.target_layer_ids",
                       "missing, and num_target_layers is not set either: cannot derive the "
                       "target layer ids")
        ids = default_target_layer_ids(as_int(n_target, source, "num_target_layers"),
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
        raise fail(source, "speculators_model_type", f"{smt!r} is not a DFlash speculator "
                                                     f"(expected one of {list(_MODEL_TYPES)})")
    for name, ok in _SPECULATORS_UNSUPPORTED.items():
        if d.get(name) not in ok:
            raise NotImplementedError(f"{source}: {name} = {d[name]!r} is not supported "
                                      f"(only {ok[0]!r})")
    lc = d.get("transformer_layer_config")
    if not isinstance(lc, dict):
        raise fail(source, "transformer_layer_config", "missing or not an object (it holds the "
                                                       "drafter's layer config)")
    fields = layer_fields(lc, source, "transformer_layer_config.", extra=(("top level", d),))

    mask = d.get("mask_token_id")
    if mask is None:
        raise fail(source, "mask_token_id", "missing (required: the token id of the block's mask "
                                            "slots)")
    n_target = d.get("num_target_layers")
    aux = d.get("aux_hidden_state_layer_ids")
    if aux is None:
        if n_target is None:
            raise fail(source, "aux_hidden_state_layer_ids",
                       "missing, and num_target_layers is not set either: cannot derive the "
                       "target layer ids")
        ids = default_target_layer_ids(as_int(n_target, source, "num_target_layers"),
                                       fields["num_layers"])
    else:
        if not isinstance(aux, (list, tuple)) or not aux:
            raise fail(source, "aux_hidden_state_layer_ids", f"must be a non-empty list, got "
                                                             f"{aux!r}")
        aux = [as_int(i, source, "aux_hidden_state_layer_ids") for i in aux]
        if min(aux) < 1:
            raise fail(source, "aux_hidden_state_layer_ids",
                       f"{aux}: capture ids start at 1 (id k = the hidden state after k target "
                       "layers = z-lab id k-1)")
        ids = [i - 1 for i in aux]   # capture id -> z-lab id

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
