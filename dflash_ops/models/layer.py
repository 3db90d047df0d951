"""One Qwen3 / Llama-style decoder layer on ``torch.ops.dflash``, the layer of both the drafter
(``models.drafter``) and the target (``models.target``).

Per layer: the input RMSNorm (``rms_norm`` for the first layer, then ``fused_add_rms_norm_``,
which also adds the previous layer's MLP output into the residual stream ``x``); one GEMM
against the fused ``[q; k; v]`` weight; ``qk_norm_rope_store_`` (per-head RMSNorm of q and k,
then RoPE, or RoPE alone without QK-norm (Llama); q in place, the new K/V written at the
tokens' cache slots, one launch); ``block_attention`` of the new tokens over the request's
cached keys (the new ones included); ``o_proj``; ``fused_add_rms_norm_`` (residual add +
post-attention norm); the SwiGLU MLP (``silu_mul`` between the fused gate/up GEMM and down;
in graphed calls where the linear table runs gate/up on the Triton GEMM, the SwiGLU is that
GEMM's epilogue: ``models.linear.linear_silu_mul``; where it runs o_proj there too, the
residual add and the post-attention norm are those GEMMs' epilogues:
``models.linear.o_proj_norm_silu_mul``).
The MLP output is returned, not added: the caller adds it (the next layer's input norm, a tap,
the final norm).

DFlash 2 layers also hold two grouped dynamic convolutions (``Conv``): ``attention_conv`` on the
normed input of the attention (``prepare``) and on its output, ``mlp_conv`` the same around the
MLP, along each block's rows (``Tokens.conv_block``). The convolution of a sublayer's output runs
fused with the residual add and the next RMSNorm (``conv_add_rms_norm_``): after the attention
inside the layer; after the MLP in the next layer's input norm (or the drafter's final norm), so
a DFlash 2 layer returns its MLP output not yet convolved, as a ``Pending``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import ops  # noqa: F401  (defines torch.ops.dflash.*)
from .linear import linear, linear_silu_mul, o_proj_norm_silu_mul

OPS = torch.ops.dflash


@dataclass
class Tokens:
    """What every layer of one forward reads besides its weights: ``cfg`` (num_heads,
    num_kv_heads, head_dim, rms_norm_eps, rope_is_neox: a DFlashConfig or TargetConfig), the
    RoPE table, and for the T new tokens their positions [T] and cache slots [T]; the attention
    metadata of their R requests: block tables [R, max_blocks], seq_lens [R] int32 (keys a
    request's queries see: cached + new), query_start_loc [R + 1] int32."""
    cfg: object
    cos_sin: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    qsl: torch.Tensor
    conv_block: int = 0  # rows per block of the DFlash 2 convolutions (0: no convolution)
    exact: bool = False  # exact mode: row-count-independent GEMMs (linear(..., exact=True))
    split_keys: int = 0  # block_attention's absolute key splits (exact mode; 0: by shape)
    # the drafter's context window (``window_table``): a table of the kept pages and their
    # key counts, for the layers without causal / window masking (whose keys' places in the
    # sequence do not matter); None: table / seq_lens
    kept_table: Optional[torch.Tensor] = None
    kept_seq_lens: Optional[torch.Tensor] = None


@dataclass
class Conv:
    """DFlash 2's grouped dynamic causal convolution around one sublayer: ``base [2, K, H]``,
    ``proj [2 * K * G, H]`` (the kernel projection, G = H / group_size)."""
    base: torch.Tensor
    proj: torch.Tensor
    group_size: int

    def prepare(self, h: torch.Tensor, block: int, exact: bool = False):
        """(the convolution of the sublayer's input h [T, H] with base[0] and the first half of
        proj(h), the second half for ``finish``)."""
        k = self.base.shape[1]
        dyn = linear(h, self.proj, None, exact).view(h.shape[0], 2, k, -1)
        return OPS.grouped_dyn_conv(h, dyn[:, 0], self.base[0], self.group_size, block), dyn[:, 1]

    def finish_add_norm(self, y: torch.Tensor, dyn: torch.Tensor, block: int, x: torch.Tensor,
                        weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += (the convolution of the sublayer's output y with base[1] and dyn, rounded to the
        dtype) in place; returns RMSNorm(x) * weight."""
        out = torch.empty_like(y)
        OPS.conv_add_rms_norm_(y, x, dyn, self.base[1], self.group_size, block, weight, eps,
                               out=out)
        return out


@dataclass
class Pending:
    """A DFlash 2 layer's MLP output ``y`` whose convolution (``conv`` with the dynamic taps
    ``dyn``, blocks of ``block`` rows) is still to run: ``add_norm_`` runs it fused with the
    residual add and the norm that follow."""
    y: torch.Tensor
    dyn: torch.Tensor
    conv: Conv
    block: int

    def add_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.conv.finish_add_norm(self.y, self.dyn, self.block, x, weight, eps)


def add_norm_(h, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += h (a layer's MLP output: a tensor, or a DFlash 2 ``Pending``) in place; returns
    RMSNorm(x) * weight (for a tensor h, h itself, overwritten)."""
    if isinstance(h, Pending):
        return h.add_norm_(x, weight, eps)
    OPS.fused_add_rms_norm_(h, x, weight, eps)
    return h


@dataclass
class DecoderLayer:
    """One layer's weights (model dtype, on the model's device) and attention flags."""
    in_ln: torch.Tensor
    post_ln: torch.Tensor
    qkv: torch.Tensor                  # [(Hq + 2 Hkv) * D, H]
    qkv_b: Optional[torch.Tensor]
    o: torch.Tensor
    o_b: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]     # None (with k_norm): no QK-norm, plain RoPE
    k_norm: Optional[torch.Tensor]
    gate_up: torch.Tensor              # [2 I, H]: gate rows, then up rows
    down: torch.Tensor
    causal: bool = True
    window: int = -1                   # block_attention's window (-1: none)
    sinks: Optional[torch.Tensor] = None  # [Hq] fp32 attention-sink logits
    attn_conv: Optional[Conv] = None   # DFlash 2
    mlp_conv: Optional[Conv] = None

    @classmethod
    def load(cls, state: dict, prefix: str, *, dtype, device, bias: bool, qk_norm: bool,
             conv_group_size: int = 0, **attention) -> "DecoderLayer":
        """From HF tensor names under ``prefix`` (``self_attn.q_proj.weight``, ``mlp.*``,
        ``input_layernorm.weight``, ...); ``attention``: causal, window, sinks;
        ``conv_group_size`` > 0: a DFlash 2 layer (``attention_conv.*``, ``mlp_conv.*``)."""
        def w(*names):  # the named tensors, concatenated along dim 0
            return torch.cat([state[prefix + n] for n in names]).to(device=device,
                                                                    dtype=dtype).contiguous()

        def conv(name):
            if not conv_group_size:
                return None
            return Conv(base=w(f"{name}.base_kernel"), proj=w(f"{name}.kernel_projection.weight"),
                        group_size=conv_group_size)

        attention.update(attn_conv=conv("attention_conv"), mlp_conv=conv("mlp_conv"))
        a = "self_attn."
        return cls(in_ln=w("input_layernorm.weight"), post_ln=w("post_attention_layernorm.weight"),
                   qkv=w(*(f"{a}{n}_proj.weight" for n in "qkv")),
                   qkv_b=w(*(f"{a}{n}_proj.bias" for n in "qkv")) if bias else None,
                   o=w(a + "o_proj.weight"), o_b=w(a + "o_proj.bias") if bias else None,
                   q_norm=w(a + "q_norm.weight") if qk_norm else None,
                   k_norm=w(a + "k_norm.weight") if qk_norm else None,
                   gate_up=w("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                   down=w("mlp.down_proj.weight"), **attention)

    def __call__(self, x: torch.Tensor, h, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 t: Tokens):
        """The layer on the residual stream ``x`` [T, H] (updated in place: ``x += h``, then
        ``+= attention output``); ``h``: the previous layer's MLP output not yet added into x
        (None for the first layer; a tensor is reused as a buffer; a ``Pending`` for a DFlash 2
        layer's). Returns this layer's MLP output (a ``Pending`` for a DFlash 2 layer):
        ``add_norm_`` adds it."""
        cfg = t.cfg
        eps = cfg.rms_norm_eps
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if h is None:
            h = OPS.rms_norm(x, self.in_ln, eps)
        else:  # x += h; h = norm(x)
            h = add_norm_(h, x, self.in_ln, eps)
        if self.attn_conv is not None:
            h, attn_dyn = self.attn_conv.prepare(h, t.conv_block, t.exact)
        ex = t.exact
        qkv = linear(h, self.qkv, self.qkv_b, ex)
        q = qkv[:, :hq * d].view(-1, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
        # q normed (QK-norm) and rotated in place; k's rows likewise and v's into the caches
        OPS.qk_norm_rope_store_(q, k, v, self.q_norm, self.k_norm, t.pos, t.cos_sin, eps,
                                cfg.rope_is_neox, k_cache, v_cache, t.slots)
        table, seq_lens = t.table, t.seq_lens
        if t.kept_table is not None and not self.causal and self.window <= 0:
            table, seq_lens = t.kept_table, t.kept_seq_lens
        attn = OPS.block_attention(q, k_cache, v_cache, table, seq_lens, t.qsl, d ** -0.5,
                                   self.causal, self.window, self.sinks, t.split_keys)
        if self.attn_conv is None and self.mlp_conv is None:  # the norm folded where it can
            act = o_proj_norm_silu_mul(attn.view(-1, hq * d), self.o, self.o_b, x, self.post_ln,
                                       eps, self.gate_up, ex)
            if act is not None:  # x += o_proj(attn); down(silu(gate) * up) of norm(x)
                return linear(act, self.down, None, ex)
        o = linear(attn.view(-1, hq * d), self.o, self.o_b, ex)
        if self.attn_conv is not None:  # x += conv(o); o = norm(x)
            o = self.attn_conv.finish_add_norm(o, attn_dyn, t.conv_block, x, self.post_ln, eps)
        else:
            OPS.fused_add_rms_norm_(o, x, self.post_ln, eps)  # x += o; o = norm(x)
        if self.mlp_conv is None:  # down(silu(gate) * up)
            return linear(linear_silu_mul(o, self.gate_up, ex), self.down, None, ex)
        o, mlp_dyn = self.mlp_conv.prepare(o, t.conv_block, ex)
        out = linear(linear_silu_mul(o, self.gate_up, ex), self.down, None, ex)
        return Pending(out, mlp_dyn, self.mlp_conv, t.conv_block)
