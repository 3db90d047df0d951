"""A hand-built pair whose drafts are accepted: the "counter" pair.

Random weights accept nothing, so they cannot tell a drafter that reads the wrong context
positions, layer caches or heads from a right one. This pair can:

- **Target**: a Qwen3 whose next token is ``(token + 1) % V``. Embedding row t is ``e_t + u``
  (one-hot code ``e_t`` in dims [0, V), a constant dim ``u`` = V); the LM head row s reads
  code ``s - 1``; every layer is random with its ``o_proj`` / ``down_proj`` scaled by ``noise``,
  so the attention and MLP kernels run but the residual stays ``e_t + u`` up to noise.
- **Drafter** (z-lab DFlash): the context is the first tap (``fc`` = [I, 0]); in each layer
  every query and key is a constant vector built from ``u`` (``k0 = RoPE(q0, delta)``), so after
  RoPE the scores peak at the key exactly ``delta = V + 1`` positions before the query; the
  values are a per-layer permutation of the context token's code and ``o_proj`` undoes it (a
  layer that reads another layer's cache, or swapped heads, copies the wrong token). A block
  row at position m so copies token ``x[m - V - 1] = x[m] - 1`` on a counting sequence, and the
  LM head turns that into ``x[m]``: every draft is right once the context holds V + 1 tokens.

Prompts are counting sequences (``counter_prompts``) longer than V. The margins (score gap
>= 20 nats to the next key, logit gap ~1 vs noise ~0.05) make the drafts robust to bf16
rounding, so the pair tests wiring (positions, caches, layers, heads), not numerics.
"""
from __future__ import annotations

import torch

from ..ops.rope import make_cos_sin_cache, rope_values

__all__ = ["counter_pair", "counter_prompts"]


def _mat(g, o, i):
    return torch.randn(o, i, generator=g) * i ** -0.5


def counter_pair(hidden: int = 512, vocab: int = 256, target_layers: int = 4,
                 draft_layers: int = 2, heads: int = 8, kv_heads: int = 4, head_dim: int = 64,
                 intermediate: int = 1024, block_size: int = 16, rope_theta: float = 10.0,
                 qk_gain: float = 5.0, copy_gain: float = 4.0, noise: float = 0.02,
                 delta: int = None, seed: int = 0):
    """(target HF config dict, target state, drafter z-lab config dict, drafter state), fp32
    weights under the checkpoint names (``save_target`` / ``save_zlab`` write them).

    ``delta``: the copy offset (default ``vocab + 1``: the right one; another value gives a
    drafter that copies the wrong position, for negative controls). Needs
    ``vocab <= kv_heads * head_dim`` and ``vocab < hidden``."""
    if vocab > kv_heads * head_dim or vocab >= hidden:
        raise ValueError(f"counter_pair: vocab must be <= kv_heads * head_dim = "
                         f"{kv_heads * head_dim} and < hidden = {hidden}, got {vocab}")
    if heads % kv_heads:
        raise ValueError(f"counter_pair: heads ({heads}) must be a multiple of kv_heads "
                         f"({kv_heads})")
    delta = vocab + 1 if delta is None else int(delta)
    g = torch.Generator().manual_seed(seed)
    h, d, v, u = hidden, head_dim, vocab, vocab  # u: the constant dim
    max_pos = 40960
    taps = [1, target_layers - 2] if target_layers >= 3 else [0]

    # ---- target
    tcfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=h,
                num_hidden_layers=target_layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=d, intermediate_size=intermediate,
                vocab_size=v, hidden_act="silu", max_position_embeddings=max_pos,
                rms_norm_eps=1e-6, rope_theta=rope_theta, tie_word_embeddings=False,
                attention_bias=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)
    embed = torch.zeros(v, h)
    embed[torch.arange(v), torch.arange(v)] = 1.0
    embed[:, u] = 1.0
    head = torch.zeros(v, h)
    head[torch.arange(v), (torch.arange(v) - 1) % v] = 1.0
    ts = {"model.embed_tokens.weight": embed, "lm_head.weight": head,
          "model.norm.weight": torch.ones(h)}
    for i in range(target_layers):
        a, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}."
        ts.update({a + "q_proj.weight": _mat(g, heads * d, h),
                   a + "k_proj.weight": _mat(g, kv_heads * d, h),
                   a + "v_proj.weight": _mat(g, kv_heads * d, h),
                   a + "o_proj.weight": noise * _mat(g, h, heads * d),
                   a + "q_norm.weight": torch.ones(d), a + "k_norm.weight": torch.ones(d),
                   p + "mlp.gate_proj.weight": _mat(g, intermediate, h),
                   p + "mlp.up_proj.weight": _mat(g, intermediate, h),
                   p + "mlp.down_proj.weight": noise * _mat(g, h, intermediate),
                   p + "input_layernorm.weight": torch.ones(h),
                   p + "post_attention_layernorm.weight": torch.ones(h)})

    # ---- drafter
    dcfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=h,
                num_hidden_layers=draft_layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=d, intermediate_size=intermediate,
                vocab_size=v, hidden_act="silu", max_position_embeddings=max_pos,
                rms_norm_eps=1e-6, rope_theta=rope_theta, attention_bias=False,
                tie_word_embeddings=False, torch_dtype="bfloat16",
                num_target_layers=target_layers, block_size=block_size,
                dflash_config={"target_layer_ids": taps, "mask_token_id": v - 1})
    dn = noise / 2
    fc = dn * _mat(g, h, len(taps) * h)
    fc[:, :h] += torch.eye(h)
    ds = {"fc.weight": fc, "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h)}
    # normed rows are ~ (e_t + u) * sqrt(h / 2): undo that scale in the projections
    s = (2.0 / h) ** 0.5
    cos_sin = make_cos_sin_cache(delta + 1, d, rope_theta)
    group = heads // kv_heads
    for i in range(draft_layers):
        a, p = f"layers.{i}.self_attn.", f"layers.{i}."
        phi = torch.rand(d // 2, generator=g) * 6.283185307179586
        q0 = torch.cat([phi.cos(), phi.sin()])  # NeoX pairs (j, j + d/2), each of norm 1
        k0 = rope_values(q0.view(1, 1, d), torch.tensor([delta]), cos_sin, True).view(d)
        perm = torch.randperm(kv_heads * d, generator=g)  # value row r reads code perm[r]
        q = dn * _mat(g, heads * d, h)
        q[:, u] += (s * q0).repeat(heads)
        k = dn * _mat(g, kv_heads * d, h)
        k[:, u] += (s * k0).repeat(kv_heads)
        vv = dn * _mat(g, kv_heads * d, h)
        code = perm < v
        vv[torch.arange(kv_heads * d)[code], perm[code]] += s
        o = dn * _mat(g, h, heads * d)
        for kv in range(kv_heads):  # the group's first query head carries the copy
            rows = torch.arange(kv * d, (kv + 1) * d)
            keep = perm[rows] < v
            o[perm[rows][keep], (kv * group) * d + torch.arange(d)[keep]] += copy_gain
        ds.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": vv,
                   a + "o_proj.weight": o,
                   a + "q_norm.weight": torch.full((d,), qk_gain),
                   a + "k_norm.weight": torch.full((d,), qk_gain),
                   p + "mlp.gate_proj.weight": _mat(g, intermediate, h),
                   p + "mlp.up_proj.weight": _mat(g, intermediate, h),
                   p + "mlp.down_proj.weight": dn * _mat(g, h, intermediate),
                   p + "input_layernorm.weight": torch.ones(h),
                   p + "post_attention_layernorm.weight": torch.ones(h)})
    return tcfg, ts, dcfg, ds


def counter_prompts(n: int, vocab: int = 256, lengths=(300, 345, 261, 400), seed: int = 0):
    """``n`` counting sequences ``(c0 + j) % vocab`` of the given lengths (each > vocab + 1)
    from seeded random starts c0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        if length <= vocab + 1:
            raise ValueError(f"counter_prompts: lengths must be > vocab + 1 = {vocab + 1}, "
                             f"got {length}")
        c0 = int(torch.randint(0, vocab, (1,), generator=g))
        out.append([(c0 + j) % vocab for j in range(length)])
    return out
