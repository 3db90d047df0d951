"""The target model (HF Qwen3 or Llama) on ``torch.ops.dflash``: a causal forward of a batch of
requests' new tokens (prefill chunks, one decode token, or a verify block) through its own paged
KV cache, returning fp32 logits and, on request, the tap hidden states the DFlash drafter reads.

Per layer: ``models.layer.DecoderLayer`` (the decoder layer of HF ``Qwen3DecoderLayer`` /
``LlamaDecoderLayer``: QK-norm for Qwen3, plain RoPE for Llama; causal attention over the cached
and new keys), the drafter's layer too; then the final norm and the LM head (the embedding when
``tie_word_embeddings``).

Taps follow the **z-lab convention**: tap id ``i`` is the output of decoder layer ``i`` (HF
``hidden_states[i + 1]``), the residual stream after layer ``i``'s MLP add, before the final norm.

Rejected verify tokens need no rollback: KV of positions ``>=`` a request's committed length is
stale but never visible, because ``seq_lens`` (= ``starts + q_lens`` of the next forward) bounds
what attention reads, and the next forward overwrites those slots with the new tokens' K/V
before attending.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .. import ops  # noqa: F401  (defines torch.ops.dflash.*)
from ..ops.rope import HEAD_DIMS, make_cos_sin_cache
from .cache import PagedKVCache
from .hf_config import SLIDING, fail, layer_fields, read_json, rope_table_len
from .layer import DecoderLayer, Tokens
from .linear import linear
from .weights import check_float, load_state

__all__ = ["TargetConfig", "Target", "expected_target_shapes", "check_target_state",
           "random_state"]

OPS = torch.ops.dflash
_MODEL_TYPES = ("qwen3", "llama")


# Exact mode's absolute attention splits for forwards of at most this many tokens (decode and
# verify batches: 64 requests x 16); longer forwards (prefill chunks) split by shape: their
# fp32 partial results would take up to 32 x Tq x Hq x (D + 1) x 4 bytes (4.3 GB for an 8k
# prefill of Qwen3-8B), and both loops prefill the same prompts in the same call, so their
# prefill rows agree without it.
EXACT_MAX_TOKENS = 1024


def exact_split_keys(max_keys: int) -> int:
    """Exact mode's block_attention split size, from the block table's width (max_keys =
    max_blocks * block_size) alone, so a decode and a verify of one request split alike: at
    least 128 keys, at most ~32 splits, a multiple of 64."""
    per = -(-max_keys // 32)
    return max(128, -(-per // 64) * 64)


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
                raise fail(src, name, f"must be a positive integer, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise fail(src, name, f"must be a positive number, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise fail(src, "num_attention_heads/num_key_value_heads",
                       f"{self.num_heads} attention heads are not a multiple of "
                       f"{self.num_kv_heads} KV heads")
        if self.head_dim not in HEAD_DIMS:
            raise fail(src, "head_dim", f"{self.head_dim} is not supported by the attention / "
                                        f"RoPE ops (one of {list(HEAD_DIMS)})")

    @classmethod
    def from_hf(cls, config: Union[dict, str, os.PathLike]) -> "TargetConfig":
        """From an HF ``config.json`` of model_type ``qwen3`` or ``llama``: a dict, the file, or
        the checkpoint directory holding it. Errors name the field and the file."""
        d, source = (config, "<dict>") if isinstance(config, dict) else read_json(config)
        return cls(**_parse_hf(d, source))


def _parse_hf(d: dict, source: str) -> dict:
    mt = d.get("model_type")
    if mt not in _MODEL_TYPES:
        raise fail(source, "model_type", f"{mt!r} is not a supported target (expected one of "
                                         f"{list(_MODEL_TYPES)})")
    f = layer_fields(d, source, hf_defaults=True, partial_rotary=False)
    sliding = [i for i, t in enumerate(f["layer_types"]) if t == SLIDING]
    if sliding:
        raise NotImplementedError(f"{source}: use_sliding_window / layer_types: sliding layers "
                                  f"{sliding}: sliding-window target layers are not supported")
    keep = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
            "max_position_embeddings", "attention_bias", "rope_is_neox")
    return dict({k: f[k] for k in keep}, qk_norm=mt == "qwen3", source=source,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))


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
    check_float(state, cfg.source)


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
    then holds their K/V), ``free_request`` when done."""

    def __init__(self, cfg: TargetConfig, state: dict, *, dtype=torch.bfloat16, device=None,
                 num_blocks: int = 256, block_size: int = 16, max_requests: int = 8,
                 max_len: int = 4096, exact: bool = False):
        check_target_state(state, cfg)
        self.cfg = cfg
        # exact mode: every row's logits independent of the rows sharing the forward (a 16-row
        # verify = a 1-row decode, bit for bit): the GEMMs of linear(..., exact=True) and
        # block_attention's absolute key splits; the loop also runs one backend per op in eager
        # and captured calls (speculator.loop.exact_mode)
        self.exact = exact
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype, self.device = dtype, dev

        def w(name):
            return state[name].to(device=dev, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.layers = [DecoderLayer.load(state, f"model.layers.{i}.", dtype=dtype, device=dev,
                                         bias=cfg.attention_bias, qk_norm=cfg.qk_norm)
                       for i in range(cfg.num_layers)]
        self.cache = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                  cfg.head_dim, max_requests, max_len, dtype, dev)
        # RoPE table: a huge max_position_embeddings (1e9: an 8 GB table) is capped (hf_config)
        room = self.cache.max_blocks * self.cache.block_size  # positions a request may use
        self.cos_sin = make_cos_sin_cache(rope_table_len(cfg.max_position_embeddings, room),
                                          cfg.head_dim, base=cfg.rope_theta, device=dev)

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

    # ------------------------------------------------------------------------------ forward
    def _as_index(self, v, dtype=torch.int64) -> torch.Tensor:
        return torch.as_tensor(v, dtype=dtype, device=self.device).reshape(-1)

    def forward(self, ids: torch.Tensor, requests, starts, q_lens,
                tap_layers: Optional[Sequence[int]] = None, fp32_logits: bool = True,
                logit_rows: Optional[torch.Tensor] = None):
        """Causal forward of R requests' new tokens.

        ids [T] int64: the new tokens, grouped by request in the order of ``requests``;
        requests [R]: request slots; starts [R]: position of each request's first new token
        (= tokens already in its cache); q_lens [R]: new tokens per request (sum = T);
        tap_layers: z-lab layer ids whose outputs to return.

        Returns ``(logits [T, V] fp32, taps [T, len(tap_layers) * H] or None)``; taps are in the
        model dtype, concatenated in the order of ``tap_layers``. ``fp32_logits=False`` leaves
        the logits in the model dtype (greedy steps: their argmax is the fp32 argmax, since the
        cast is exact, without writing and reading a [T, V] fp32 copy). ``logit_rows`` [N] int64:
        the token rows whose logits to compute (a prefill needs each request's last only: at
        32 x 8k tokens all rows' fp32 logits would take 148 GB); the logits are then [N, V].
        """
        cfg = self.cfg
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

        # Per-token position and cache slot; attention metadata (no host sync; one launch)
        pos, slots, seq_lens, qsl = self.cache.token_meta(requests, starts, q_lens, t)
        meta = Tokens(cfg, self.cos_sin, pos, slots, self.cache.block_table[requests], seq_lens,
                      qsl, exact=self.exact,
                      split_keys=exact_split_keys(self.cache.max_blocks * self.cache.block_size)
                      if self.exact and t <= EXACT_MAX_TOKENS else 0)

        x = F.embedding(ids, self.embed)   # the residual stream
        h = None                           # last layer output not yet added into x
        # the taps written into their columns as each tap layer ends (no concatenation after)
        hs = x.shape[-1]
        tap_out = x.new_empty(t, len(taps) * hs) if tap_layers is not None else None
        for i, layer in enumerate(self.layers):
            h = layer(x, h, self.cache.k[i], self.cache.v[i], meta)
            if i in taps:   # the layer's output: complete the residual add now
                x.add_(h)
                h = None
                for k, j in enumerate(taps):
                    if j == i:
                        tap_out[:, k * hs:(k + 1) * hs].copy_(x)

        if h is None:
            h = OPS.rms_norm(x, self.norm, cfg.rms_norm_eps)
        else:
            OPS.fused_add_rms_norm_(h, x, self.norm, cfg.rms_norm_eps)
        if logit_rows is not None:
            h = h.index_select(0, self._as_index(logit_rows))
        logits = linear(h, self.lm_head, None, self.exact)
        if fp32_logits:
            logits = logits.float()
        return logits, tap_out

    __call__ = forward
