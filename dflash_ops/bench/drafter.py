"""Drafter suite: one DFlash draft step (context K/V of the newly committed tokens + the block
forward + LM head + argmax) of the Qwen3-8B-DFlash-b16 drafter, our drafter eager and under its
CUDA graph against the ``dflash`` package's reference model and the floor.

Shapes: Qwen3-8B-DFlash-b16's own config.json (``QWEN3_8B_DFLASH``): 5 layers, hidden 4096, 32 / 8
heads of 128, MLP 12288, vocabulary 151936, block 16, 5 target taps x 4096 (fc [4096, 20480]),
full (non-causal) attention, rope theta 1e6; random bf16 weights (``random_drafter_state``:
matrices N(0, 1/fan_in), norms 1 + 0.1 N(0, 1)); the target's embedding and LM head [151936,
4096] random (the LM head scaled by 4096**-0.5, so logits are ~N(0, 1)). Cases (B requests, S =
each request's committed length): B 1, 8, 32, 64 at S 1024 and 8192, B 64 at S 4096 (the batch
target), B 1 at S 131072; ``--quick``: (1, 1024), (8, 8192), (64, 4096), (1, 131072).
``DFLASH_OPS_BENCH_DRAFTER_CASES`` (comma-separated ``BxS``, e.g. ``1x1024,64x4096``) replaces
the cases; ``DFLASH_OPS_BENCH_DRAFTER_REF=0`` drops the reference column. A restricted run writes
``drafter-<BxS...>`` (``drafter-quick`` for ``--quick``, ``-noref`` without the reference), so it
never overwrites a full run's files.

One step, every case: each request committed NEW = 16 tokens since the last step (a whole
block accepted; DraftStep's static context buffer is B x 16 rows, which it runs through the fc
and K/V GEMMs whether padded or not, so the eager columns get the same rows and every column
does the same work): their tap hidden states [B*16, 5*4096] (randn) go through fc and the
context K/V into positions S-16 .. S-1; the block [last token, MASK x 15] of each request
sits at positions S .. S+15 and attends to the S context keys and itself. Positions 0 .. S-17
of the cache hold random K/V (randn, as a previous step would have left them), in shuffled
16-row blocks.

Columns (tables per context length S, one row block per batch, then a summary table):
* ``reference eager (dflash DFlashDraftModel)``: the ``dflash`` package's model on the GPU in
  bf16 (built with the default dtype bf16, as from_pretrained does, so its rotary inv_freq stays
  fp32), our weights loaded with ``load_state_dict(strict=True)``, and its own protocol, as
  ``dflash_generate`` runs it: a DynamicCache (``_make_cache``) that holds the S-16 older
  context positions (copied from our cache before timing), ``model(target_hidden [B, 16, 20480],
  noise_embedding = embed(block) * scale, position_ids S-16 .. S+15, cache)``, ``_crop_to(S)``,
  ``compute_logits`` on the 15 mask rows, argmax. Each timed call first crops the cache back to
  S-16 (slicing, no copy) so every call is the same step. n/a with the reason where ``dflash``
  or ``transformers`` cannot be imported. Checked against ours eager (below) and timed whatever
  the check says (it is the baseline; the note says whether it agrees).
* ``ours eager``: ``DFlashDrafter.add_context`` of the 16 new rows a request, then ``propose``
  (what ``DraftStep._step`` runs), default backends. The oracle of the graph column.
* ``ours graph (DraftStep)``: ``speculator.draft_step.DraftStep(drafter, max_batch=B)``:
  ``load``, ``capture(bucket)`` (``dispatch.capture_graph``), ``run(bucket)`` = one replay. Timed
  only if it agrees with ours eager.
* ``floor`` = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate), both measured in this run
  (``measure_floors``); ``step_cost`` itemizes it (bf16, 2 bytes an element; b = block 16, N =
  16 new rows a request, T = 5 taps, Ht = 4096 target hidden, L = 5, I = 12288, V = 151936):
    bytes = 2 * [ H*T*Ht (fc) + 2H (final norm, hidden_norm)
                + L*((Hq + 2Hkv)*D*H + H*Hq*D + 3*I*H + 2H + 2D) (qkv, o, gate/up/down, norms)
                + V*H (LM head)
                + B*S*L*2*Hkv*D (K/V of the S context keys, read by attention)
                + B*b*H (the block's embedding rows) + B*N*T*Ht (tap hidden states in)
                + B*N*L*2*Hkv*D (the new context K/V written) ]
    FLOPs = 2*B*N*(H*T*Ht + L*2*Hkv*D*H) (fc, context K/V) + 2*B*b*L*((Hq + 2Hkv)*D*H +
            H*Hq*D + 3*I*H) (layers) + 4*B*b*L*Hq*D*(S + b) (attention) + 2*B*(b-1)*V*H (LM head)
  Not counted: the block's own K/V (kept on chip by a minimal step), norms / RoPE / softmax
  arithmetic, and our logits output (bf16 [B, 15, V]: 4.6 MB at B 1, 292 MB at B 64).
  Each weight counts once: our drafter also reads a stacked copy of the k/v weights for the
  context K/V (84 MB, hidden_norm folded in), which a floor does not count (session 42; before,
  it did, and the floors were 2.5% higher at B 1). At B 1, S 1024: 3.36 GB (weights 3.34) ->
  ~0.78 ms at ~4.3 TB/s. B 64, S 4096: 8.8 GB but 3.8 TFLOP -> ~5.4 ms at ~700 TFLOP/s
  (FLOP-bound from B ~16 at S 1024).

Checks, before timing, on the step's own inputs: ``agreement`` of a column's logits and drafts
with ours eager: max |dz| <= tol * max |z_eager| (tol 0.02 for the graph, the GPU test's bound;
0.03 for the reference, bf16 through a different op order), and the drafts identical in every
row whose top-2 logit gap (ours eager) exceeds twice that row's max |dz|: where the two logit rows
differ by at most e everywhere, a gap over 2e fixes the argmax, so a draft that differs there is
a bug, not rounding; rows within a near tie may differ and are counted in the note.

Timing: the eager columns with per-call CUDA events (``time_fn(graph=False)``, triton's
do_bench: median, a 256 MB L2 wipe before each call), host launch gaps included: an eager step
is ~100 launches (ours) or several hundred (the reference), and that host time is what an eager
server pays; the graph column with the same events around each ``run(bucket)`` (one replay).
Weights (3.4 GB) and the K/V (>= 21 MB a request) stream from HBM, so one input set; calls
repeat the same step (the same cache writes each time).

Run time on the H200 (estimate): random weights on the CPU ~10 s, floors ~5 s,
reference model build ~5 s; per case ~3-8 s (drafter + cache + inputs, the reference cache copy,
the first calls and graph capture, ~0.5-1 s of timing a column at 1-30 ms a step), plus the
first Triton compiles (the norm / RoPE kernels) ~10-30 s once: full run (10
cases) ~2-3 minutes, ``--quick`` ~1-1.5 minutes. Memory: at most ~40 GB at B 64, S 8192 (our
cache 10.8 GB, the reference's DynamicCache 10.7 GB + its per-layer concatenation, weights 3.4 GB
+ the reference's 2.1 GB + embedding 1.2 GB, logits 0.6 GB a column).
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F

from .columns import msg
from .harness import Results, floor_us, measure_floors, time_fn

# Qwen3-8B-DFlash-b16's config.json, as shipped (z-lab format; tests/test_models_config.py
# parses it, bench/e2e.py builds its drafter from it).
QWEN3_8B_DFLASH = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "block_size": 16, "bos_token_id": 151643, "eos_token_id": 151645,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960,
    "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
NEW = 16  # context rows committed per request since the last step
CASES = ((1, 1024), (8, 1024), (32, 1024), (64, 1024), (64, 4096),
         (1, 8192), (8, 8192), (32, 8192), (64, 8192), (1, 131072))
QUICK_CASES = ((1, 1024), (8, 8192), (64, 4096), (1, 131072))
ENV_CASES = "DFLASH_OPS_BENCH_DRAFTER_CASES"
ENV_REF = "DFLASH_OPS_BENCH_DRAFTER_REF"
MAX_CACHE_BYTES = 40 << 30  # one copy of a case's context K/V (ours; the reference holds another)
GRAPH_TOL = 0.02  # graph vs eager: max |dz| <= GRAPH_TOL * max |z|
REF_TOL = 0.03    # reference vs ours eager
CACHE_BLOCK = 16  # rows of a paged cache block
SEED = 0
BF16 = torch.bfloat16
OPS_USED = ("context_kv_", "rms_norm", "fused_add_rms_norm_", "qk_norm_rope_", "store_kv_",
            "block_attention", "row_argmax")

SUMMARY = "summary: us per step (graph x floor = ours graph / floor)"
REF_NAME = "reference eager (dflash DFlashDraftModel)"
EAGER_NAME = "ours eager"
GRAPH_NAME = "ours graph (DraftStep)"
# the draft context window's column (issue 18's option): attention over the first 16 and the last
# DRAFT_WINDOW context tokens, where the context is longer
DRAFT_WINDOW = 2048
WINDOW_NAME = f"ours graph, draft window {DRAFT_WINDOW}"


def drafter_config(cfg_dict: Optional[dict] = None):
    """The DFlashConfig of ``cfg_dict`` (default Qwen3-8B-DFlash-b16)."""
    from ..models.config import DFlashConfig

    if cfg_dict is None:
        return DFlashConfig.from_dict(QWEN3_8B_DFLASH, source="Qwen3-8B-DFlash-b16 (bench)")
    return DFlashConfig.from_dict(cfg_dict)


# ----------------------------------------------------------------------------- floor
def layer_params(cfg) -> int:
    """Matrix elements of one drafter layer: qkv, o, gate + up, down."""
    h, d, hq, hkv, i = (cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                        cfg.intermediate_size)
    return (hq + 2 * hkv) * d * h + h * hq * d + 3 * i * h


def kv_row_elems(cfg) -> int:
    """K and V elements of one position over all layers: L * 2 * Hkv * D."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim


def step_cost(cfg, batch: int, context: int, new: int = NEW, itemsize: int = 2) -> dict:
    """What the floor counts for one step: {"bytes": {part: bytes}, "flops": {part: FLOPs},
    "total_bytes", "total_flops"} (see the module docstring for the formula)."""
    h, d, hq, L, b = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_layers, cfg.block_size
    v, fc_in = cfg.vocab_size, cfg.fc_in_features
    by = {
        "fc": fc_in * h,
        "norms": 2 * h + L * (2 * h + 2 * d),  # final norm, hidden_norm; per layer 2 + q/k
        "layers": L * layer_params(cfg),
        "LM head": v * h,
        "K/V read": batch * context * kv_row_elems(cfg),
        "embeddings": batch * b * h,
        "tap hidden": batch * new * fc_in,
        "K/V written": batch * new * kv_row_elems(cfg),
    }
    by = {k: n * itemsize for k, n in by.items()}
    fl = {
        "context": 2.0 * batch * new * (fc_in * h + cfg.kv_width * h),
        "layers": 2.0 * batch * b * L * layer_params(cfg),
        "attention": 4.0 * batch * b * L * hq * d * (context + b),
        "LM head": 2.0 * batch * (b - 1) * v * h,
    }
    return {"bytes": by, "flops": fl, "total_bytes": sum(by.values()),
            "total_flops": sum(fl.values())}


def weight_bytes(cost: dict) -> int:
    return sum(cost["bytes"][k] for k in ("fc", "norms", "layers", "LM head"))


def floor_note(cost: dict, floors: dict) -> str:
    by, fl = cost["total_bytes"], cost["total_flops"]
    t_b = by / (floors["copy_GBps"] * 1e3)
    t_f = fl / (floors["gemm_TFLOPs"] * 1e6) if floors.get("gemm_TFLOPs") else 0.0
    parts = cost["bytes"]
    return (f"{'bytes' if t_b >= t_f else 'FLOP'}-bound: {by / 1e9:.3g} GB (weights "
            f"{weight_bytes(cost) / 1e9:.3g} incl. LM head {parts['LM head'] / 1e9:.3g}, K/V read "
            f"{parts['K/V read'] / 1e9:.3g}) -> {t_b:.1f} us; {fl / 1e12:.3g} TFLOP (attention "
            f"{cost['flops']['attention'] / 1e12:.3g}) -> {t_f:.1f} us")


# ----------------------------------------------------------------------------- cases
def parse_cases(text: str, cfg=None) -> list:
    """``"BxS,BxS"`` -> [(B, S)]; ValueError naming ``ENV_CASES`` on a bad item, S < NEW, or a
    context K/V over MAX_CACHE_BYTES."""
    cfg = cfg or drafter_config()
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            b, s = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"{ENV_CASES}: {item!r} is not BxS (e.g. 64x4096)") from None
        if b < 1 or s < NEW:
            raise ValueError(f"{ENV_CASES}: {item!r}: need B >= 1 and S >= {NEW} (the step's "
                             f"new context rows sit at S-{NEW} .. S-1)")
        kv = b * (s + cfg.block_size) * kv_row_elems(cfg) * 2
        if kv > MAX_CACHE_BYTES:
            raise ValueError(f"{ENV_CASES}: {item!r}: its K/V cache is {kv / 2**30:.1f} GiB, over "
                             f"{MAX_CACHE_BYTES / 2**30:.0f} GiB (the reference holds a second "
                             f"copy)")
        out.append((b, s))
    if not out:
        raise ValueError(f"{ENV_CASES}: no cases in {text!r}")
    return out


def cases(quick: bool = False) -> list:
    env = os.environ.get(ENV_CASES, "").strip()
    if env:
        return parse_cases(env)
    return list(QUICK_CASES if quick else CASES)


def check_options(quick: bool = False) -> None:
    """``harness.main``'s check before its GPU check: a bad ``ENV_CASES`` raises ValueError
    naming it."""
    cases(quick)


def reference_missing() -> Optional[str]:
    """Why the reference column is n/a (None: it runs)."""
    if os.environ.get(ENV_REF, "1").strip() == "0":
        return f"{ENV_REF}=0"
    try:
        for name in ("dflash.model", "transformers"):
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - not installed, or an import-time failure
        return (f"dflash / transformers not importable ({msg(e)}); pip install transformers "
                f"&& pip install --no-deps dflash")
    return None


# ----------------------------------------------------------------------------- setup
def random_weights(cfg, device, dtype=BF16, seed: int = SEED) -> tuple:
    """(drafter state on ``device``, embedding [V, H], LM head [V, H] * H**-0.5)."""
    from ..models.drafter import random_drafter_state

    state = {k: t.to(device=device, dtype=dtype)
             for k, t in random_drafter_state(cfg, seed).items()}
    g = torch.Generator(device=device).manual_seed(seed + 1)
    v, h = cfg.vocab_size, cfg.hidden_size
    embed = torch.randn(v, h, generator=g, device=device).to(dtype)
    head = (torch.randn(v, h, generator=g, device=device) * h ** -0.5).to(dtype)
    return state, embed, head


def build_drafter(cfg, state, embed, head, batch: int, context: int, device, dtype=BF16,
                  seed: int = SEED):
    """Our drafter with request slots 0..B-1 holding ``context + block`` positions each (slot B
    free for DraftStep's scratch request), blocks shuffled across the cache, every block filled
    with randn K/V."""
    from ..models.drafter import DFlashDrafter

    per_req = -(-(context + cfg.block_size) // CACHE_BLOCK)
    scratch = -(-cfg.block_size // CACHE_BLOCK)
    drafter = DFlashDrafter(cfg, state, embed_tokens=embed, lm_head=head, dtype=dtype,
                            device=device, num_blocks=batch * per_req + scratch,
                            cache_block_size=CACHE_BLOCK, max_requests=batch + 1,
                            max_len=context + cfg.block_size)
    cache = drafter.cache
    for r in range(batch):
        cache.add_request(r, context + cfg.block_size)
    # a server's cache is fragmented: permute the requests' blocks among themselves (the tables
    # are what every op reads; the cache's own free-list bookkeeping is not used again here)
    g = torch.Generator(device="cpu").manual_seed(seed + 2)
    perm = torch.randperm(batch * per_req, generator=g).view(batch, per_req)
    cache.block_table[:batch, :per_req] = perm.to(device=device, dtype=cache.block_table.dtype)
    for t in (*cache.k, *cache.v):
        t.normal_()
    return drafter


def step_inputs(cfg, batch: int, context: int, device, dtype=BF16, new: int = NEW,
                seed: int = SEED) -> dict:
    """One step's inputs: ``ctx_hidden`` [B*new, T*Ht], ``ctx_req`` / ``ctx_pos`` [B*new]
    (positions S-new .. S-1 of each request), ``block_ids`` [B, b] (a random last token, then
    the mask), ``requests`` [B] and ``start`` [B] (= S)."""
    g = torch.Generator(device="cpu").manual_seed(seed + 3)
    b = cfg.block_size
    ids = torch.full((batch, b), cfg.mask_token_id, dtype=torch.long)
    ids[:, 0] = torch.randint(0, cfg.mask_token_id, (batch,), generator=g)
    pos = torch.arange(context - new, context).repeat(batch)
    return {
        "ctx_hidden": torch.randn(batch * new, cfg.fc_in_features, generator=g).to(device, dtype),
        "ctx_req": torch.arange(batch).repeat_interleave(new).to(device),
        "ctx_pos": pos.to(device),
        "block_ids": ids.to(device),
        "requests": torch.arange(batch, device=device),
        "start": torch.full((batch,), context, dtype=torch.long, device=device),
    }


def eager_step(drafter, inp: dict) -> tuple:
    """(tokens [B, b-1], logits [B, b-1, V]): what DraftStep._step runs, on the step's rows."""
    drafter.add_context(inp["ctx_hidden"], inp["ctx_req"], inp["ctx_pos"])
    return drafter.propose(inp["block_ids"], inp["requests"], inp["start"])


def graph_step(drafter, inp: dict, batch: int, capture: bool = True):
    """(DraftStep, bucket) loaded with the step's inputs and, with ``capture``, its graph
    recorded (the capture's warm-up runs the step once for real); ``step.run(bucket)`` runs it."""
    from ..speculator.draft_step import DraftStep

    step = DraftStep(drafter, max_batch=batch, scratch_request=batch)
    bucket = step.load(inp["ctx_hidden"], inp["ctx_req"], inp["ctx_pos"], inp["block_ids"],
                       inp["requests"], inp["start"])
    if capture:
        step.capture(bucket)
    return step, bucket


class RefHead(torch.nn.Module):
    """The target's LM head as the reference calls it (``output_head(hidden)``)."""

    def __init__(self, w):
        super().__init__()
        self.weight = w

    def forward(self, x):
        return F.linear(x, self.weight)


def reference_model(cfg_dict: dict, state: dict, device, dtype=BF16):
    """The ``dflash`` package's DFlashDraftModel built with the default dtype ``dtype`` on
    ``device`` (parameters in ``dtype``, the rotary inv_freq fp32, as from_pretrained leaves
    them), our weights loaded strictly."""
    import transformers
    from dflash.model import DFlashDraftModel

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DFlashDraftModel(transformers.Qwen3Config(**cfg_dict))
    finally:
        torch.set_default_dtype(old)
    model.load_state_dict(state, strict=True)
    return model.eval()


def reference_step(model, drafter, inp: dict, embed, head, batch: int, context: int,
                   new: int = NEW):
    """A function running the reference's step (``dflash_generate``'s drafter half) for the
    step's inputs; its DynamicCache starts with our cache's first S-new positions of every
    request. Each call crops the cache back to S-new first, so calls repeat the same step."""
    import dflash.model as dm

    b = drafter.cfg.block_size
    past = context - new
    cache = dm._make_cache(model.config)
    m = -(-past // CACHE_BLOCK)
    table = drafter.cache.block_table[:batch, :m].long()
    for i in range(drafter.cfg.num_layers):
        k, v = (c[i][table].flatten(1, 2)[:, :past].transpose(1, 2).contiguous()
                for c in (drafter.cache.k, drafter.cache.v))  # [B, Hkv, past, D]
        cache.update(k, v, i)
        del k, v
    target_hidden = inp["ctx_hidden"].view(batch, new, -1)
    ids = inp["block_ids"]
    pos = torch.arange(past, context + b, device=ids.device)[None].expand(batch, -1)
    scale = float(dm._draft_value(model.config, "input_embedding_scale", 1.0))
    output_head = RefHead(head)

    def step():
        dm._crop_to(cache, past)  # back to the context before this step (slicing)
        noise = F.embedding(ids, embed) * scale
        hidden = model(target_hidden=target_hidden, noise_embedding=noise, position_ids=pos,
                       past_key_values=cache, use_cache=True)[:, 1 - b:, :]
        dm._crop_to(cache, context)
        logits = model.compute_logits(hidden, output_head)
        return torch.argmax(logits, dim=-1), logits

    return step


# ----------------------------------------------------------------------------- checks
def agreement(tokens, logits, want_tokens, want_logits, tol: float) -> tuple:
    """(ok, max |dz|, note): logits within ``tol`` x max |want|, and the drafts identical in
    every row whose top-2 gap in ``want_logits`` exceeds twice the row's max |dz| (elsewhere a
    near tie: may differ, counted)."""
    z, w = logits.float(), want_logits.float()
    diff = (z - w).abs()
    err = diff.max().item()
    limit = tol * w.abs().max().item()
    top2 = w.topk(2, dim=-1).values
    tie = (top2[..., 0] - top2[..., 1]) <= 2 * diff.amax(-1)
    differ = tokens.reshape(want_tokens.shape) != want_tokens
    bad = int((differ & ~tie).sum())
    ok = err <= limit and bad == 0  # a NaN err fails
    note = (f"max |dz| {err:.3g} (tol {limit:.3g}); drafts: {int(differ.sum())} of "
            f"{differ.numel()} differ, {bad} outside near ties ({int(tie.sum())} near-tie rows)")
    return ok, err, note


# ----------------------------------------------------------------------------- one case
def _progress(label: str, name: str, t: Optional[dict], note: str) -> None:
    us = f"{t['us']:.1f} us ({t['mode']})" if t else "n/a"
    print(f"[drafter] {label} {name}: {us} {note}", file=sys.stderr, flush=True)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run_case(res: Results, cfg, weights: tuple, ref_model, ref_why: Optional[str],
             batch: int, context: int, timing: dict, device="cuda",
             draft_window: int = DRAFT_WINDOW) -> dict:
    """Rows of one (B, S): reference, ours eager, ours graph, (where S > draft_window + 16) ours
    graph with the draft context window, floor; returns the case's summary row (``run`` adds
    them after all cases). Every request committed a whole block (new = block size). Its
    tensors (drafter, caches, the graphs) die on return; the caller frees memory."""
    state, embed, head = weights
    new = cfg.block_size
    label = f"B={batch} S={context}"
    title = (f"drafter step, context S={context}: L {cfg.num_layers}, H {cfg.hidden_size}, "
             f"V {cfg.vocab_size}, block {cfg.block_size}, {cfg.n_taps} taps x "
             f"{cfg.target_hidden_size}, {str(embed.dtype).replace('torch.', '')}, {new} new "
             f"context rows a request")
    cost = step_cost(cfg, batch, context, new)
    floor = floor_us(res.floors, cost["total_bytes"], cost["total_flops"])
    moved = cost["total_bytes"]
    t0 = time.perf_counter()
    drafter = build_drafter(cfg, state, embed, head, batch, context, device, embed.dtype)
    inp = step_inputs(cfg, batch, context, device, drafter.dtype, new)
    want_t, want_z = (x.clone() for x in eager_step(drafter, inp))  # the oracle
    _sync(device)
    cache_gb = sum(t.nbytes for t in (*drafter.cache.k, *drafter.cache.v)) / 1e9
    print(f"[drafter] {label}: drafter + cache ({cache_gb:.3g} GB) + inputs + first eager step "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    times = {}

    def row(name, t, note, err=None, cost_of=None):
        """``cost_of``: the (bytes, floor) of a row whose step reads less than the case's (the
        draft window's: 16 + W context keys)."""
        times[name] = t["us"] if t else None
        ref_us = times.get(REF_NAME)
        speedup = ref_us / t["us"] if t and ref_us and name != REF_NAME else None
        by, fl = cost_of or (moved, floor)
        res.add_time(title, label, name, t, bytes_moved=by, floor=fl, err=err, note=note,
                     x=batch, **{"ref / us": speedup})
        _progress(label, name, t, note)

    # reference
    if ref_model is None:
        row(REF_NAME, None, ref_why or "n/a")
    else:
        try:
            ref = reference_step(ref_model, drafter, inp, embed, head, batch, context, new)
            got_t, got_z = ref()
            ok, err, note = agreement(got_t, got_z, want_t, want_z, REF_TOL)
            del got_t, got_z
            note = ("agrees with ours eager: " if ok else "DISAGREES with ours eager (timed "
                    "anyway): ") + note
            row(REF_NAME, time_fn(ref, graph=False, **timing), note, err)
            del ref
        except Exception as e:  # noqa: BLE001 - a broken column is reported, not fatal
            row(REF_NAME, None, f"failed: {msg(e)}")
        _free(device)  # the reference's DynamicCache

    # ours eager
    try:
        row(EAGER_NAME, time_fn(lambda: eager_step(drafter, inp), graph=False, **timing),
            "the oracle of the graph column")
    except Exception as e:  # noqa: BLE001
        row(EAGER_NAME, None, f"failed: {msg(e)}")

    # ours graph
    step = None
    try:
        step, bucket = graph_step(drafter, inp, batch)
        got_t, got_z = step.run(bucket)
        ok, err, note = agreement(got_t, got_z, want_t, want_z, GRAPH_TOL)
        if ok:
            row(GRAPH_NAME, time_fn(lambda: step.run(bucket), graph=False, **timing),
                f"vs eager: {note}", err)
        else:
            row(GRAPH_NAME, None, f"WRONG vs eager, not timed: {note}", err)
    except Exception as e:  # noqa: BLE001
        row(GRAPH_NAME, None, f"failed: {msg(e)}")

    # ours graph with the draft context window: its own eager step is its oracle
    if step is not None:
        step.close()  # its scratch request slot, for the next step's
        step = None
    if context > draft_window + 16:
        name = WINDOW_NAME if draft_window == DRAFT_WINDOW else \
            f"ours graph, draft window {draft_window}"
        try:
            drafter.set_context_window(draft_window)
            w_t, w_z = (x.clone() for x in eager_step(drafter, inp))
            wstep, wbucket = graph_step(drafter, inp, batch)
            got_t, got_z = wstep.run(wbucket)
            ok, err, note = agreement(got_t, got_z, w_t, w_z, GRAPH_TOL)
            same = float((w_t == want_t).float().mean())
            note = (f"vs its eager step: {note}; drafts equal to the full context's: "
                    f"{100 * same:.1f}%")
            w_cost = step_cost(cfg, batch, min(context, 16 + draft_window), new)
            w_of = (w_cost["total_bytes"],
                    floor_us(res.floors, w_cost["total_bytes"], w_cost["total_flops"]))
            note += (f"; its floor is its own step's ({16 + draft_window} context keys): "
                     f"{w_of[1]:.1f} us")
            if ok:
                row(name, time_fn(lambda: wstep.run(wbucket), graph=False, **timing), note, err,
                    cost_of=w_of)
            else:
                row(name, None, f"WRONG vs its eager step, not timed: {note}", err, cost_of=w_of)
            wstep.close()
        except Exception as e:  # noqa: BLE001
            row(name, None, f"failed: {msg(e)}")
        finally:
            drafter.set_context_window(None)

    res.add_time(title, label, "floor", {"us": floor, "mode": "max(bytes/copy, FLOPs/GEMM)"},
                 bytes_moved=moved, floor=floor, x=batch, note=floor_note(cost, res.floors))
    print(f"[drafter] {label}: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
          flush=True)
    g, ref_us = times.get(GRAPH_NAME), times.get(REF_NAME)
    bytes_bound = cost["total_bytes"] / (res.floors["copy_GBps"] * 1e3) >= floor
    return {"case": label, "reference": ref_us, "ours eager": times.get(EAGER_NAME),
            "ours graph": g, "floor": floor, "graph x floor": g / floor if g else None,
            "ref / graph": ref_us / g if g and ref_us else None,
            "bound": "bytes" if bytes_bound else "FLOPs"}


# ----------------------------------------------------------------------------- run
NOTES = [
    "one step = context K/V of 16 newly committed rows a request (fc + context_kv_) + the block "
    "forward of [last token, MASK x 15] at positions S .. S+15 over S context keys + LM head on "
    "the 15 mask rows + argmax; Qwen3-8B-DFlash-b16 config, random bf16 weights (matrices "
    "N(0, 1/fan_in), norms 1 + 0.1 N(0, 1)), target embedding and LM head random [151936, 4096]",
    "reference eager: the dflash package's DFlashDraftModel (bf16, GPU) with its own protocol "
    "(DynamicCache holding the S-16 older positions, copied from our cache; forward over 16 "
    "context rows + the block; _crop_to; compute_logits; argmax); each call crops back to S-16 "
    "first; timed whatever its check says",
    "ours eager: DFlashDrafter.add_context + propose, default backends; ours graph: "
    "DraftStep load + capture(B) (dispatch.capture_graph), then run(B) = one replay",
    "timing: per-call CUDA events (do_bench: median, 256 MB L2 wipe before each call); eager "
    "columns include their host launch gaps (what an eager server pays); graph: events around "
    "each replay; one input set (weights 3.4 GB and the K/V stream from HBM)",
    "checks before timing (ours eager is the oracle): max |dz| <= tol x max |z| (graph 0.02, "
    "reference 0.03) and identical drafts in every row whose top-2 logit gap exceeds twice the "
    "row's max |dz| (a near tie elsewhere: may differ, counted in the note); a failing graph "
    "column is not timed; err = max |dz|",
    "floor = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate), both measured in this run; "
    "bytes = 2 x [fc H*T*Ht + norms + L*((Hq+2Hkv)*D*H + H*Hq*D + 3*I*H) + LM head V*H (each "
    "weight once: our stacked copy of the k/v weights for the context is not counted) + K/V "
    "read B*S*L*2*Hkv*D + block embeddings B*b*H + tap hidden B*N*T*Ht + new K/V written "
    "B*N*L*2*Hkv*D] (b 16, N 16, T 5 taps, Ht 4096); FLOPs = "
    "2*B*N*(H*T*Ht + L*2*Hkv*D*H) + 2*B*b*L*((Hq+2Hkv)*D*H + H*Hq*D + 3*I*H) + "
    "4*B*b*L*Hq*D*(S+b) + 2*B*(b-1)*V*H; not counted: the block's own K/V, elementwise math, "
    "our logits output (bf16); the floor row's note itemizes",
    "ref / us = reference time / this column's time (speed-up over the reference)",
    f"{WINDOW_NAME} (where S > {DRAFT_WINDOW + 16}): DFlashDrafter.set_context_window("
    f"{DRAFT_WINDOW}), the block attending to its context's first 16 and last {DRAFT_WINDOW} "
    "tokens (issue 18's option, off by default); checked against its own eager step; the note "
    "gives the share of drafts equal to the full context's (random weights: not an acceptance "
    "cost); its bytes and x floor are its own step's (16 + W context keys), the floor row "
    "is the full step's",
]


def run(quick: bool = False) -> Results:
    """Measure floors, build the weights once, then every case; returns the Results."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"drafter suite: needs a CUDA GPU, and torch.cuda.is_available() is "
                           f"False (torch {torch.__version__}). Nothing was run.")
    from .. import dispatch  # the package is imported: the ops are defined, _C loaded

    todo = cases(quick)
    ref_why = reference_missing()
    suffix = ""
    if os.environ.get(ENV_CASES, "").strip():
        suffix = "-" + "-".join(f"{b}x{s}" for b, s in todo)
    elif quick:
        suffix = "-quick"
    if os.environ.get(ENV_REF, "1").strip() == "0":
        suffix += "-noref"
    floors = measure_floors()
    res = Results("drafter" + suffix, floors=floors, xlabel="B (requests)",
                  meta={"config": "Qwen3-8B-DFlash-b16", "new_rows_per_request": NEW,
                        "cases": [f"{b}x{s}" for b, s in todo],
                        "backends": {op: dispatch.resolve(op) for op in OPS_USED}})
    timing = dict(warmup_ms=25, rep_ms=150) if quick else dict(warmup_ms=50, rep_ms=500)
    cfg = drafter_config()
    with torch.no_grad():
        t0 = time.perf_counter()
        weights = random_weights(cfg, "cuda")
        print(f"[drafter] random weights {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
        ref_model = None
        if ref_why is None:
            try:
                t0 = time.perf_counter()
                with contextlib.redirect_stdout(sys.stderr):
                    ref_model = reference_model(QWEN3_8B_DFLASH, weights[0], "cuda")
                print(f"[drafter] reference model {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001
                ref_why = f"reference model failed: {msg(e)}"
        summary = []
        for b, s in todo:
            summary.append(run_case(res, cfg, weights, ref_model, ref_why, b, s, timing))
            _free("cuda")
    for row in summary:
        res.add(SUMMARY, **row)
    res.notes += NOTES
    return res
