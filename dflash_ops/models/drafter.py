"""The DFlash drafter on ``torch.ops.dflash``: context K/V (``add_context``) and one block forward
(``propose``), as the ``dflash`` reference package computes them.

Per step, for a batch of requests:

* ``add_context(tap_hidden, requests, positions)``: the target's tap hidden states of the
  newly committed tokens -> ``fc`` -> ``context_kv_`` (hidden_norm, its weight folded into the
  stacked K/V weight: ``hidden_rms``; the stacked K/V GEMM of every layer, per-layer K RMSNorm,
  RoPE, paged write) into every layer's cache.
* ``propose(block_ids, requests, start)``: the block ``[last token, MASK x N]`` of each request
  at positions ``start .. start + B - 1`` (``start`` = the request's committed length, whose
  context K/V are all in the cache). Per layer (``models.layer.DecoderLayer``, the target's
  layer): RMSNorm, the fused QKV GEMM, ``qk_norm_rope_store_`` (q/k norm and RoPE, the
  block's K/V written at the slots after the context) (the next ``add_context`` overwrites them with the committed
  tokens' context K/V: the cache keeps context only), then ``block_attention`` over context +
  block (non-causal unless the layer is causal/sliding), ``o_proj``, residual, SwiGLU MLP; final
  norm; the LM head on the mask rows only; logits (model dtype; fp32 when the config scales or
  soft-caps them); greedy tokens. DFlash 2 (``model_type`` dflash2): each layer also convolves
  its sublayers' inputs and outputs along the block (``models.layer.Conv``), and the drafts are
  the candidate selector's greedy path over each row's top-k tokens (``select``; in graphed
  CUDA calls its hidden projection runs on a side stream beside the LM head).

Weights are the checkpoint's (names: ``models.weights``); the embedding and LM head
come from the target unless the checkpoint ships its own. Every request's block has the same
length B (the config's block_size unless given).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import ops  # noqa: F401  (defines torch.ops.dflash.*)
from ..ops.rope import make_cos_sin_cache
from .cache import PagedKVCache
from .config import DFlashConfig
from .hf_config import rope_table_len
from .layer import DecoderLayer, Pending, Tokens
from .linear import linear
from .. import dispatch
from ..streams import side_stream
from .weights import check_drafter_state, stack_kv

OPS = torch.ops.dflash


def window_table(table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, first: int,
                 last: int) -> tuple:
    """The draft context window as block-table metadata: (table [R, f + n], seq_lens [R] int32)
    of each request's first f = ceil(first / block_size) pages and its pages from the one
    holding key seq_len - last on (so at least ``last`` keys, fewer than last + block_size),
    the two runs back to back; a request with nothing between them keeps its table as it is.
    Device-side torch ops only (CUDA-graph safe: no host read). Exact for attention without
    causal or window masking: a key's RoPE is applied at its true position when it is
    written, so only which keys are visible changes, not where they sit in the table."""
    bs = int(block_size)
    f = -(-int(first) // bs)
    n = -(-int(last) // bs) + 1
    seq = seq_lens.long()
    t0 = torch.clamp((seq - int(last)) // bs, min=f)  # first kept page of the tail (>= f)
    j = torch.arange(f + n, device=table.device)[None, :]
    idx = torch.where(j < f, j, t0[:, None] + (j - f)).clamp(max=table.shape[1] - 1)
    return torch.gather(table, 1, idx), (seq - (t0 - f) * bs).to(torch.int32)


class DFlashDrafter:
    def __init__(self, cfg: DFlashConfig, state: dict, *, embed_tokens: Optional[torch.Tensor]
                 = None, lm_head: Optional[torch.Tensor] = None, dtype=torch.bfloat16,
                 device=None, num_blocks: int = 256, cache_block_size: int = 16,
                 max_requests: int = 8, max_len: int = 4096):
        self.cfg = cfg
        state = check_drafter_state(state, cfg, cfg.source)  # one error listing every bad tensor
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype, self.device = dtype, dev

        def w(name):
            return state[name].to(device=dev, dtype=dtype).contiguous()

        self.embed = state.get("embed_tokens.weight", embed_tokens)
        self.lm_head = state.get("lm_head.weight", lm_head)
        if self.embed is None or self.lm_head is None:
            missing = [n for n, t in (("embed_tokens", self.embed), ("lm_head", self.lm_head))
                       if t is None]
            raise ValueError(f"DFlashDrafter: the checkpoint {cfg.source} ships no {missing}; "
                             f"pass the target's as embed_tokens= / lm_head=")
        self.embed = self.embed.to(device=dev, dtype=dtype)
        self.lm_head = self.lm_head.to(device=dev, dtype=dtype)
        self.mask_embedding = (w("mask_embedding").reshape(-1) if "mask_embedding" in state
                               else None)
        self.d2t = state["d2t"].to(dev).long() if "d2t" in state else None

        self.fc = w("fc.weight")
        self.norm = w("norm.weight")
        w_kv, b_kv, k_weight = stack_kv(state, cfg)
        # the hidden norm's weight folded into the stacked K/V weight's columns (rounded once, in
        # fp32): context_kv_ with hidden_rms divides the GEMM's rows by rms(x) itself, so the
        # context path needs no norm pass (one launch fewer a step on the GPU)
        w_kv = w_kv.float() * state["hidden_norm.weight"].float()[None, :]
        self.w_kv = w_kv.to(device=dev, dtype=dtype).contiguous()
        self.b_kv = None if b_kv is None else b_kv.to(device=dev, dtype=dtype)
        self.k_weight = k_weight.to(device=dev, dtype=dtype).contiguous()
        v2 = cfg.model_type == "dflash2"
        self.selector = None
        if v2:  # DFlash 2: the candidate selector's codebooks [V, r] and projection [r, H]
            self.selector = tuple(w(f"candidate_selector.{n}.weight") for n in (
                "predecessor_codebook", "successor_codebook", "hidden_projection"))
            if self.d2t is not None:
                raise ValueError(f"DFlashDrafter: {cfg.source}: a DFlash 2 drafter with a reduced "
                                 f"draft vocabulary (d2t) is not supported")
        self.layers = [DecoderLayer.load(
            state, f"layers.{i}.", dtype=dtype, device=dev, bias=cfg.attention_bias,
            qk_norm=True, causal=cfg.layer_causal(i), window=cfg.layer_window(i),
            conv_group_size=cfg.conv_group_size if v2 else 0,
            sinks=(state[f"layers.{i}.self_attn.sinks"].to(device=dev, dtype=torch.float32)
                   if cfg.attention_sinks else None)) for i in range(cfg.num_layers)]
        self.cache = PagedKVCache(cfg.num_layers, num_blocks, cache_block_size, cfg.num_kv_heads,
                                  cfg.head_dim, max_requests, max_len, dtype, dev)
        # RoPE table: a huge max_position_embeddings (1e9: an 8 GB table) is capped (hf_config)
        room = self.cache.max_blocks * self.cache.block_size  # positions a request may use
        self.cos_sin = make_cos_sin_cache(rope_table_len(cfg.max_position_embeddings, room),
                                          cfg.rotary_dim, base=cfg.rope_theta, device=dev)
        self.context_window: Optional[tuple] = None  # set_context_window

    def set_context_window(self, last: Optional[int], first: int = 16) -> None:
        """The draft context window (off by default): the block attends to its context's first
        ``first`` and last ``last`` tokens only (rounded out to whole cache pages; the block's
        own keys are among the last), in the layers without causal / window masking (a sliding
        layer keeps its own window). Less to read a step at long context, at some cost in
        acceptance. ``last=None``: off. Set it before the loop's first call (captured steps
        bake it in)."""
        if last is None:
            self.context_window = None
            return
        if int(last) < self.cfg.block_size or int(first) < 0:
            raise ValueError(f"DFlashDrafter.set_context_window: last must be >= the block "
                             f"size {self.cfg.block_size} (the block's own keys) and first >= "
                             f"0, got last={last}, first={first}")
        self.context_window = (int(first), int(last))

    # ------------------------------------------------------------------------------ context
    def add_context(self, tap_hidden: torch.Tensor, requests: torch.Tensor,
                    positions: torch.Tensor) -> None:
        """K/V of newly committed tokens: tap_hidden [T, n_taps * H_target] (the target's hidden
        states at target_layer_ids, concatenated), requests [T] (request slot of each row),
        positions [T]; a row with position < 0 is padding (written nowhere)."""
        cfg = self.cfg
        c = linear(tap_hidden.to(self.dtype), self.fc)
        slots = self.cache.token_meta(requests, positions, None, positions.shape[0])[1]
        OPS.context_kv_(c, self.w_kv, self.b_kv, self.k_weight, positions.long(), self.cos_sin,
                        slots, self.cache.k, self.cache.v, cfg.rms_norm_eps, cfg.rope_is_neox,
                        None, True)

    # ------------------------------------------------------------------------------ block
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.embed)
        if self.cfg.input_embedding_scale != 1:  # (a multiply by 1 is a kernel for nothing)
            x = x * self.cfg.input_embedding_scale
        if self.mask_embedding is not None:
            x = torch.where((ids == self.cfg.mask_token_id)[:, None],
                            self.mask_embedding.to(x.dtype)[None, :], x)
        return x

    def forward_block(self, block_ids: torch.Tensor, requests: torch.Tensor,
                      start: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [R * B, H] of the blocks block_ids [R, B] of requests [R]
        whose first token sits at position start[R] (the committed length)."""
        r, b = block_ids.shape
        pos, slots, seq_lens, qsl = self.cache.token_meta(requests, start, None, r * b, b)
        table = self.cache.block_table[requests.long()]
        kept = (None, None)
        if self.context_window is not None:
            first, last = self.context_window
            kept = window_table(table, seq_lens, self.cache.block_size, first, last)
        t = Tokens(self.cfg, self.cos_sin, pos, slots, table, seq_lens, qsl,
                   conv_block=b, kept_table=kept[0], kept_seq_lens=kept[1])
        x = self._embed(block_ids.reshape(-1))
        h = None
        for i, layer in enumerate(self.layers):
            h = layer(x, h, self.cache.k[i], self.cache.v[i], t)
        if isinstance(h, Pending):  # x is this call's own: += in place
            return h.add_norm_(x, self.norm, self.cfg.rms_norm_eps)
        x = x + h
        return OPS.rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's output: in the model dtype when the config neither scales nor
        soft-caps it (the reference's logits; consumers that need fp32, e.g. the sampling
        probabilities, cast them, and a greedy argmax needs no cast: a [960, 151936] fp32 copy
        is 0.58 GB written and read at batch 64), else in fp32, scaled and soft-capped."""
        cfg = self.cfg
        z = linear(hidden, self.lm_head)
        if cfg.output_multiplier == 1 and not cfg.final_logit_softcapping:
            return z
        z = z.float()
        if cfg.output_multiplier != 1:  # in place: z is [rows, V] fp32 (0.6 GB at 1024 rows)
            z.mul_(cfg.output_multiplier)
        if cfg.final_logit_softcapping:
            cap = float(cfg.final_logit_softcapping)
            z = torch.tanh(z / cap) * cap
        return z

    def propose(self, block_ids: torch.Tensor, requests: torch.Tensor, start: torch.Tensor,
                logits: bool = True):
        """(draft tokens [R, B-1], their logits [R, B-1, V] (``logits()``: model dtype unless
        scaled or soft-capped)) for the mask rows of each block. ``logits=False`` (greedy
        drafting) returns (tokens, None) and, where the argmax of the raw LM-head output is the
        argmax of the logits (a positive scale and no soft-cap: the fp32 cast and the scale
        are exact and monotone), takes it on the model-dtype output without an fp32 copy."""
        r, b = block_ids.shape
        hidden = self.forward_block(block_ids, requests, start).view(r, b, -1)[:, 1:]
        cfg = self.cfg
        if self.selector is not None:
            hp = self._hidden_projection(hidden)
            z = self.logits(hidden)
            path = self.select(hidden, z, block_ids[:, 0], hp=hp)
            return path, (z if logits else None)
        if not logits and cfg.output_multiplier > 0 and not cfg.final_logit_softcapping:
            z = linear(hidden, self.lm_head)
        else:
            z = self.logits(hidden)
        tokens = OPS.row_argmax(z.reshape(r * (b - 1), z.shape[-1])).view(r, b - 1)  # argmax
        if self.d2t is not None:  # reduced draft vocabulary: draft id -> target id
            tokens = tokens + self.d2t[tokens]
        return tokens, (z if logits else None)


    def propose_sampled(self, block_ids: torch.Tensor, requests: torch.Tensor,
                        start: torch.Tensor, temperature: float, u: torch.Tensor) -> tuple:
        """DFlash 2 sampling: (drafts [R, B-1], q [R, B-1, k] fp32, candidates [R, B-1, k]): the
        candidate selector's walk drawing each row's token from softmax(score / temperature)
        with the uniforms u [R, B-1], and that distribution on each row's k candidates: the q
        rejection sampling must use (``sample_commit``'s sparse q; not softmax of the logits;
        the user's top_p / top_k do not apply to it, as in the reference)."""
        if self.selector is None:
            raise ValueError("DFlashDrafter.propose_sampled: only a DFlash 2 drafter has a "
                             "candidate selector; sample a DFlash drafter's logits instead")
        r, b = block_ids.shape
        hidden = self.forward_block(block_ids, requests, start).view(r, b, -1)[:, 1:]
        hp = self._hidden_projection(hidden)
        z = self.logits(hidden)
        return self.select(hidden, z, block_ids[:, 0], temperature, u, hp=hp)

    def _hidden_projection(self, hidden: torch.Tensor):
        """The selector's hidden_projection(hidden) [R, B-1, r], or in a graphed CUDA call a
        ``Branch`` computing it on ``streams.side_stream`` beside the LM head (a branch of the
        captured graph, joined where ``select`` reads it): the projection and its split-K
        reduction leave the step's chain. The same kernels either way, so the same bits."""
        proj = self.selector[2]
        if not (hidden.is_cuda and dispatch.in_graph_call()):
            return linear(hidden, proj)
        main = torch.cuda.current_stream(hidden.device)
        side = side_stream(hidden.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            hp = linear(hidden, proj)
        # hidden stays referenced by the caller until the join: not reused before the branch
        # has read it
        return Branch(hp, side)

    def select(self, hidden: torch.Tensor, z: torch.Tensor, anchor: torch.Tensor,
               temperature: float = 0.0, u: Optional[torch.Tensor] = None, hp=None):
        """DFlash 2's candidate selector, greedy: per mask row j the top-k tokens of its logits
        z [R, B-1, V] (unary scores), then walking j = 0 .. B-2 from the anchor (the block's
        first token), score = unary + <pred_codebook[previous] * hidden_projection(hidden[j]),
        succ_codebook[candidate]>, the argmax candidate becoming the previous token. Returns
        the path [R, B-1] (the drafts); with ``temperature`` > 0 each row's token is drawn from
        softmax(score / temperature) with the uniforms u [R, B-1], and the result is
        (path, q [R, B-1, k], candidates [R, B-1, k]). ``hp``: hidden_projection(hidden) if
        already computed (a tensor, or a ``Branch`` to join)."""
        pred_cb, succ_cb, proj = self.selector
        r, j, v = z.shape
        k = self.cfg.selector_top_k
        unary, cand = OPS.row_topk(z.reshape(r * j, v), k)  # ties: the lower token id first
        unary, cand = unary.view(r, j, k), cand.view(r, j, k)
        if hp is None:
            hp = linear(hidden, proj)  # [R, B-1, r]
        elif isinstance(hp, Branch):
            hp = hp.join()
        path, q = OPS.select_candidates(unary, cand, hp.contiguous(),
                                        anchor.long().contiguous(), pred_cb, succ_cb,
                                        float(temperature), u)
        return path if temperature <= 0 else (path, q, cand)


@dataclass
class Branch:
    """A result computed on ``stream`` (a side stream, a branch of a captured graph)."""
    value: torch.Tensor
    stream: "torch.cuda.Stream"

    def join(self) -> torch.Tensor:
        """The current stream waits for the branch; returns its result."""
        main = torch.cuda.current_stream(self.value.device)
        main.wait_stream(self.stream)
        self.value.record_stream(main)  # freed after its use here, not after the branch's write
        return self.value


def random_drafter_state(cfg: DFlashConfig, seed: int = 0) -> dict:
    """Seeded random weights under the checkpoint names (tests, the built-in demo pair):
    matrices ~ N(0, 1/fan_in), norm weights 1 + 0.1 N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def mat(o, i):
        return torch.randn(o, i, generator=g) * i ** -0.5

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    s = {"fc.weight": mat(h, cfg.n_taps * cfg.target_hidden_size), "hidden_norm.weight": norm(h),
         "norm.weight": norm(h)}
    for i in range(cfg.num_layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        s.update({a + "q_proj.weight": mat(hq * d, h), a + "k_proj.weight": mat(hkv * d, h),
                  a + "v_proj.weight": mat(hkv * d, h), a + "o_proj.weight": mat(h, hq * d),
                  a + "q_norm.weight": norm(d), a + "k_norm.weight": norm(d),
                  p + "mlp.gate_proj.weight": mat(cfg.intermediate_size, h),
                  p + "mlp.up_proj.weight": mat(cfg.intermediate_size, h),
                  p + "mlp.down_proj.weight": mat(h, cfg.intermediate_size),
                  p + "input_layernorm.weight": norm(h),
                  p + "post_attention_layernorm.weight": norm(h)})
        if cfg.attention_bias:
            for n, w in (("q", hq * d), ("k", hkv * d), ("v", hkv * d), ("o", h)):
                s[a + n + "_proj.bias"] = 0.1 * torch.randn(w, generator=g)
        if cfg.attention_sinks:
            s[a + "sinks"] = torch.randn(hq, generator=g)
        if cfg.model_type == "dflash2":
            k, groups = cfg.conv_kernel_size, h // cfg.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                s[f"{p}{conv}.base_kernel"] = 0.3 * torch.randn(2, k, h, generator=g)
                s[f"{p}{conv}.kernel_projection.weight"] = 0.3 * mat(2 * k * groups, h)
    if cfg.model_type == "dflash2":
        rank = cfg.selector_rank
        for n in ("predecessor_codebook", "successor_codebook"):
            s[f"candidate_selector.{n}"] = torch.randn(cfg.vocab_size, rank, generator=g)
        s["candidate_selector.hidden_projection.weight"] = mat(rank, h)
    return s
