"""The target model (HF Qwen3 or Llama) on ``torch.ops.dflash``: a causal forward of a batch of
requests' new tokens (prefill chunks, one decode token, or a verify block) through its own paged
KV cache, returning fp32 logits and, on request, the tap hidden states the DFlash drafter reads.

Per layer (the decoder layer of HF ``Qwen3DecoderLayer`` / ``LlamaDecoderLayer``):

* input RMSNorm (``rms_norm`` for the first layer, then ``fused_add_rms_norm_``, which also adds
  the previous layer's MLP output into the residual stream ``x``);
* one QKV GEMM against the fused ``[q; k; v]`` weight;
* ``qk_norm_rope_`` (Qwen3: per-head RMSNorm then RoPE on q and k) or ``rope_`` on q and k (Llama);
* ``store_kv_`` of the new K/V at the requests' slots for their positions;
* causal ``block_attention`` of the new tokens over ``[cached ; new]`` keys;
* ``o_proj``; ``fused_add_rms_norm_`` (residual add + post-attention norm); SwiGLU MLP.

Then the final norm and the LM head (the embedding when ``tie_word_embeddings``).

Taps follow the **z-lab convention** (../../shared/DFLASH.md): tap id ``i`` is the output of
decoder layer ``i`` (HF ``hidden_states[i + 1]``), the residual stream after layer ``i``'s MLP
add, before the final norm.

Rollback after a verify step needs no work: KV of positions ``>=`` a request's committed length
is stale but never visible, because ``seq_lens`` (= ``starts + q_lens`` of the next forward)
bounds what attention reads, and the next forward overwrites those slots with the new tokens'
K/V before attending. :meth:`Target.rollback` is the documented no-op.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .. import ops  # noqa: F401  (defines torch.ops.dflash.*)
from ..ops.rope import HEAD_DIMS, make_cos_sin_cache
from .cache import PagedKVCache
from .linear import linear
from .weights import load_state

__all__ = ["TargetConfig", "Target", "expected_target_shapes", "check_target_state",
           "random_state"]

OPS = torch.ops.dflash
_MODEL_TYPES = ("qwen3", "llama")
# HF config-class defaults for fields a config.json may leave out (Qwen3Config / LlamaConfig).
_HF_DEFAULTS = {
    "qwen3": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768),
    "llama": dict(num_key_value_heads=None, head_dim=None, max_position_embeddings=2048),
}


def _fail(source: str, field: str, msg: str) -> ValueError:
    return ValueError(f"{source}: {field}: {msg}")


# ---------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class TargetConfig:
    """What the target forward needs, read from an HF Qwen3 / Llama ``config.json``
    (:meth:`from_hf`); direct construction is validated too."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = True            # Qwen3: per-head q/k RMSNorm before RoPE; Llama: none
    rope_is_neox: bool = True       # HF's rotate_half: NeoX style
    source: str = "<dict>"

    def __post_init__(self):
        src = self.source
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise _fail(src, name, f"must be a positive integer, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise _fail(src, name, f"must be a positive number, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise _fail(src, "num_attention_heads/num_key_value_heads",
                        f"{self.num_heads} attention heads are not a multiple of "
                        f"{self.num_kv_heads} KV heads")
        if self.head_dim not in HEAD_DIMS:
            raise _fail(src, "head_dim", f"{self.head_dim} is not supported by the attention / "
                                         f"RoPE ops (one of {list(HEAD_DIMS)})")

    @classmethod
    def from_hf(cls, config: Union[dict, str, os.PathLike]) -> "TargetConfig":
        """From an HF ``config.json`` of model_type ``qwen3`` or ``llama``: a dict, the file, or
        the checkpoint directory holding it. Errors name the field and the file."""
        if isinstance(config, dict):
            d, source = config, "<dict>"
        else:
            source = os.fspath(config)
            if os.path.isdir(source):
                source = os.path.join(source, "config.json")
            if not os.path.isfile(source):
                raise FileNotFoundError(f"{source}: no such config file")
            with open(source, encoding="utf-8") as f:
                try:
                    d = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{source}: not valid JSON ({e})") from None
            if not isinstance(d, dict):
                raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        return cls(**_parse_hf(d, source))


def _parse_hf(d: dict, source: str) -> dict:
    mt = d.get("model_type")
    if mt not in _MODEL_TYPES:
        raise _fail(source, "model_type", f"{mt!r} is not a supported target (expected one of "
                                          f"{list(_MODEL_TYPES)})")
    defaults = _HF_DEFAULTS[mt]

    def need(name):
        if d.get(name) is None:
            raise _fail(source, name, "missing (required)")
        return d[name]

    def as_int(name, v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise _fail(source, name, f"must be an integer, got {v!r}")
        return v

    hidden = as_int("hidden_size", need("hidden_size"))
    layers = as_int("num_hidden_layers", need("num_hidden_layers"))
    heads = as_int("num_attention_heads", need("num_attention_heads"))
    if heads <= 0:
        raise _fail(source, "num_attention_heads", f"must be positive, got {heads}")
    head_dim = d.get("head_dim", defaults["head_dim"])
    if head_dim is None:    # Llama: hidden / heads
        if hidden % heads:
            raise _fail(source, "head_dim", f"absent, and hidden_size={hidden} is not divisible "
                                            f"by num_attention_heads={heads}")
        head_dim = hidden // heads
    kv_heads = d.get("num_key_value_heads", defaults["num_key_value_heads"])
    kv_heads = heads if kv_heads is None else kv_heads

    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise NotImplementedError(f"{source}: hidden_act = {act!r}: only SwiGLU (silu) MLPs are "
                                  "supported")
    if d.get("mlp_bias"):
        raise NotImplementedError(f"{source}: mlp_bias = true is not supported")

    # RoPE: rope_theta at the top level, or in rope_parameters (transformers >= 5) / rope_scaling.
    theta = d.get("rope_theta")
    for field in ("rope_parameters", "rope_scaling"):
        rp = d.get(field)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            raise _fail(source, field, f"must be an object or null, got {rp!r}")
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type not in (None, "default"):
            raise NotImplementedError(f"{source}: {field}.rope_type = {rope_type!r}: only default "
                                      "RoPE (no scaling) is supported")
        if rp.get("rope_theta") is not None:
            if theta is not None and float(theta) != float(rp["rope_theta"]):
                raise _fail(source, f"rope_theta/{field}.rope_theta",
                            f"disagree: {theta} vs {rp['rope_theta']}")
            theta = rp["rope_theta"]
        if rp.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise NotImplementedError(f"{source}: {field}.partial_rotary_factor = "
                                      f"{rp['partial_rotary_factor']}: only full-head RoPE")
    if d.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise NotImplementedError(f"{source}: partial_rotary_factor = "
                                  f"{d['partial_rotary_factor']}: only full-head RoPE")
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise _fail(source, "rope_theta", f"must be a number, got {theta!r}")

    # Qwen3 sliding-window layers (HF: only with use_sliding_window).
    if mt == "qwen3" and d.get("use_sliding_window"):
        types = d.get("layer_types")
        if types is None:
            mwl = d.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= mwl else "full_attention"
                     for i in range(layers)]
        if "sliding_attention" in types:
            raise NotImplementedError(f"{source}: use_sliding_window = true with sliding layers "
                                      f"{[i for i, t in enumerate(types) if t != 'full_attention']}"
                                      ": sliding-window target layers are not supported")

    fields = dict(
        hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=need("intermediate_size"),
        vocab_size=need("vocab_size"), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=d.get("max_position_embeddings",
                                      defaults["max_position_embeddings"]),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)), qk_norm=mt == "qwen3",
        rope_is_neox=True, source=source)
    return fields


# ---------------------------------------------------------------------------------- weights
def expected_target_shapes(cfg: TargetConfig) -> tuple:
    """``(required, optional)``: dicts of HF tensor name -> shape."""
    H, D, I, V = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    req = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        req.update({a + "q_proj.weight": (q, H), a + "k_proj.weight": (kv, H),
                    a + "v_proj.weight": (kv, H), a + "o_proj.weight": (H, q)})
        if cfg.attention_bias:
            req.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,),
                        a + "v_proj.bias": (kv,), a + "o_proj.bias": (H,)})
        if cfg.qk_norm:
            req.update({a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)})
        req.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,)})
    req["model.norm.weight"] = (H,)
    opt = {}
    if cfg.tie_word_embeddings:
        opt["lm_head.weight"] = (V, H)   # some tied checkpoints store it anyway
    else:
        req["lm_head.weight"] = (V, H)
    return req, opt


def check_target_state(state: dict, cfg: TargetConfig) -> None:
    """One ValueError listing every missing, unexpected and wrongly shaped tensor. RoPE
    ``inv_freq`` buffers (old HF checkpoints) are ignored."""
    req, opt = expected_target_shapes(cfg)
    missing = [n for n in req if n not in state]
    unexpected = [n for n in state if n not in req and n not in opt
                  and not n.endswith("rotary_emb.inv_freq")]
    wrong = [f"{n}: {list(state[n].shape)}, expected {list(s)}"
             for n, s in {**req, **opt}.items() if n in state and tuple(state[n].shape) != s]
    problems = []
    if missing:
        problems.append(f"missing {missing}")
    if unexpected:
        problems.append(f"unexpected {unexpected}")
    if wrong:
        problems.append(f"wrong shapes [{'; '.join(wrong)}]")
    if (cfg.tie_word_embeddings and not problems and "lm_head.weight" in state
            and not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])):
        problems.append("lm_head.weight differs from model.embed_tokens.weight although "
                        "tie_word_embeddings is true")
    if problems:
        raise ValueError(f"Target weights for {cfg.source}: " + "; ".join(problems))


def random_state(cfg: TargetConfig, seed: int = 0) -> dict:
    """Seeded random fp32 weights under the HF names: matrices ~ N(0, 1/sqrt(fan_in)), norms
    1 + 0.1 N(0, 1), biases 0.1 N(0, 1). Loadable into transformers' Qwen3/LlamaForCausalLM."""
    g = torch.Generator().manual_seed(int(seed))
    state = {}
    for name, shape in expected_target_shapes(cfg)[0].items():
        t = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * t
        elif name.endswith(".bias"):
            t = 0.1 * t
        else:
            t = t * shape[-1] ** -0.5
        state[name] = t
    return state


# ---------------------------------------------------------------------------------- model
class Target:
    """A Qwen3 / Llama target over ``torch.ops.dflash`` with its own :class:`PagedKVCache`
    (``self.cache``): ``add_request`` a slot, run :meth:`forward` on its new tokens (the cache
    then holds their K/V), ``free_request`` when done. See the module docstring for the layer
    and for why :meth:`rollback` is a no-op."""

    def __init__(self, cfg: TargetConfig, state: dict, *, dtype=torch.bfloat16, device=None,
                 num_blocks: int = 256, block_size: int = 16, max_requests: int = 8,
                 max_len: int = 4096):
        check_target_state(state, cfg)
        self.cfg = cfg
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype, self.device = dtype, dev

        def w(*names):   # the named tensors, concatenated along dim 0, on dev in dtype
            return torch.cat([state[n] for n in names]).to(device=dev, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(dict(
                in_ln=w(p + "input_layernorm.weight"),
                post_ln=w(p + "post_attention_layernorm.weight"),
                qkv=w(*(a + n + "_proj.weight" for n in "qkv")),
                qkv_b=w(*(a + n + "_proj.bias" for n in "qkv")) if cfg.attention_bias else None,
                o=w(a + "o_proj.weight"),
                o_b=w(a + "o_proj.bias") if cfg.attention_bias else None,
                q_norm=w(a + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=w(a + "k_norm.weight") if cfg.qk_norm else None,
                gate_up=w(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=w(p + "mlp.down_proj.weight")))
        self.cos_sin = make_cos_sin_cache(max(cfg.max_position_embeddings, max_len),
                                          cfg.head_dim, base=cfg.rope_theta, device=dev)
        self.cache = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                  cfg.head_dim, max_requests, max_len, dtype, dev)
        self.scale = cfg.head_dim ** -0.5

    # ------------------------------------------------------------------------------ building
    @classmethod
    def from_pretrained(cls, path, dtype=torch.bfloat16, device=None, **cache_kw) -> "Target":
        """From an HF checkpoint directory: ``config.json`` and safetensors (single or sharded).
        ``cache_kw``: num_blocks, block_size, max_requests, max_len."""
        cfg = TargetConfig.from_hf(path)
        return cls(cfg, load_state(path), dtype=dtype, device=device, **cache_kw)

    @classmethod
    def random(cls, cfg: TargetConfig, seed: int = 0, dtype=torch.bfloat16, device=None,
               **cache_kw) -> "Target":
        """Seeded random weights (:func:`random_state`), for tests and demos."""
        return cls(cfg, random_state(cfg, seed), dtype=dtype, device=device, **cache_kw)

    # ------------------------------------------------------------------------------ requests
    def add_request(self, r: int, max_len: Optional[int] = None) -> None:
        self.cache.add_request(r, max_len)

    def free_request(self, r: int) -> None:
        self.cache.free_request(r)

    def rollback(self, requests, new_lengths) -> None:
        """Drop the KV of positions ``>= new_lengths[i]`` of ``requests[i]`` (rejected draft
        tokens). Nothing to do with paged slots: that KV is stale but never visible, since the
        next forward passes ``starts = new_lengths``, so attention reads only ``seq_lens = starts
        + q_lens`` keys, and it overwrites those slots with its own tokens' K/V first."""

    # ------------------------------------------------------------------------------ forward
    def _as_index(self, v, dtype=torch.int64) -> torch.Tensor:
        return torch.as_tensor(v, dtype=dtype, device=self.device).reshape(-1)

    def forward(self, ids: torch.Tensor, requests, starts, q_lens,
                tap_layers: Optional[Sequence[int]] = None, fp32_logits: bool = True):
        """Causal forward of R requests' new tokens.

        ids [T] int64: the new tokens, grouped by request in the order of ``requests``;
        requests [R]: request slots; starts [R]: position of each request's first new token
        (= tokens already in its cache); q_lens [R]: new tokens per request (sum = T);
        tap_layers: z-lab layer ids whose outputs to return.

        Returns ``(logits [T, V] fp32, taps [T, len(tap_layers) * H] or None)``; taps are in the
        model dtype, concatenated in the order of ``tap_layers``. ``fp32_logits=False`` leaves
        the logits in the model dtype (greedy steps: their argmax is the fp32 argmax, since the
        cast is exact, without writing and reading a [T, V] fp32 copy).
        """
        cfg = self.cfg
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ids = ids.to(self.device).reshape(-1)
        t = ids.shape[0]
        requests, starts, q_lens = (self._as_index(v) for v in (requests, starts, q_lens))
        if not requests.shape == starts.shape == q_lens.shape:
            raise ValueError(f"Target.forward: requests, starts and q_lens must have one entry "
                             f"per request, got {requests.numel()}, {starts.numel()}, "
                             f"{q_lens.numel()}")
        if q_lens.device.type == "cpu" and int(q_lens.sum()) != t:
            raise ValueError(f"Target.forward: q_lens {q_lens.tolist()} sum to "
                             f"{int(q_lens.sum())}, but ids has {t} tokens")
        taps = list(tap_layers) if tap_layers is not None else []
        bad = [i for i in taps if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(f"Target.forward: tap_layers {bad} outside [0, {cfg.num_layers})")

        # Per-token request and position; attention metadata (no host sync).
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        qsl = torch.cat([zero, q_lens.cumsum(0)])
        tok_req = torch.repeat_interleave(torch.arange(len(q_lens), device=self.device), q_lens,
                                          output_size=t)
        pos = starts[tok_req] + torch.arange(t, device=self.device) - qsl[tok_req]
        slots = self.cache.slots(requests[tok_req], pos)
        table = self.cache.block_table[requests]
        seq_lens = (starts + q_lens).to(torch.int32)
        qsl = qsl.to(torch.int32)

        x = F.embedding(ids, self.embed)   # the residual stream
        h = None                           # last sublayer output not yet added into x
        tapped = {}
        for i, lw in enumerate(self.layers):
            if h is None:
                h = OPS.rms_norm(x, lw["in_ln"], cfg.rms_norm_eps)
            else:  # x += h (the previous MLP output); h = norm(x)
                OPS.fused_add_rms_norm_(h, x, lw["in_ln"], cfg.rms_norm_eps)
            qkv = linear(h, lw["qkv"], lw["qkv_b"])
            q = qkv[:, :hq * d].view(t, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
            if cfg.qk_norm:
                OPS.qk_norm_rope_(q, k, lw["q_norm"], lw["k_norm"], pos, self.cos_sin,
                                  cfg.rms_norm_eps, cfg.rope_is_neox)
            else:
                OPS.rope_(q, pos, self.cos_sin, cfg.rope_is_neox)
                OPS.rope_(k, pos, self.cos_sin, cfg.rope_is_neox)
            OPS.store_kv_(k[:, None], v[:, None], [self.cache.k[i]], [self.cache.v[i]], slots)
            attn = OPS.block_attention(q, self.cache.k[i], self.cache.v[i], table,
                                       seq_lens, qsl, self.scale, True)
            o = linear(attn.view(t, hq * d), lw["o"], lw["o_b"])
            OPS.fused_add_rms_norm_(o, x, lw["post_ln"], cfg.rms_norm_eps)  # x += o; o = norm(x)
            h = linear(OPS.silu_mul(linear(o, lw["gate_up"])), lw["down"])  # silu(g) * u
            if i in taps:   # the layer's output: complete the residual add now
                x.add_(h)
                h = None
                tapped[i] = x.clone()

        if h is None:
            h = OPS.rms_norm(x, self.norm, cfg.rms_norm_eps)
        else:
            OPS.fused_add_rms_norm_(h, x, self.norm, cfg.rms_norm_eps)
        logits = linear(h, self.lm_head)
        if fp32_logits:
            logits = logits.float()
        tap_out = None
        if tap_layers is not None:
            tap_out = torch.cat([tapped[i] for i in taps], dim=-1) if taps else x.new_zeros(t, 0)
        return logits, tap_out

    __call__ = forward
