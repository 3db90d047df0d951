"""End-to-end suite: one DFlash iteration (draft step + verify step, both CUDA graphs) of a
Qwen3-8B-shaped target with a Qwen3-8B-DFlash-shaped drafter, against a plain decode step of the
same target under a CUDA graph, and against the floors (issue 6, "Benchmark").

Shapes (random bf16 weights, seeded):
* target (``TargetConfig``): Qwen3-8B, 36 layers, hidden 4096, 32 q / 8 kv heads of 128, MLP
  12288, vocabulary 151936, QK-norm, untied LM head, rope theta 1e6: 8.2 G parameters, 16.4 GB
  in bf16 (embedding and LM head 1.24 GB each).
* drafter (``DFlashConfig``): Qwen3-8B-DFlash-b16, 5 layers of the same width, block 16, taps
  from target layers 1, 9, 17, 25, 33 (fc [4096, 20480]), mask id 151669; it shares the target's
  embedding and LM head: 2.2 GB of its own.
The weights are drawn on the GPU with the distributions of ``target.random_state`` and
``drafter.random_drafter_state`` (matrices N(0, 1/fan_in), norms 1 + 0.1 N(0, 1)) and go
through the ``Target`` / ``DFlashDrafter`` constructors; built once, reused by every case
(``Target.random`` would draw 8 G numbers on the CPU first: a minute or more).

Cases: batch B = 1, 8, 32, 64 at context S = 1024 and 8192 (``--quick``: (1, 1024), (1, 8192),
(32, 8192)); ``DFLASH_OPS_BENCH_E2E_CASES`` (``BxS`` comma-separated, ``k`` = 1024: ``1x1k,64x8k``)
replaces them. Per case both models get fresh paged KV caches for B requests + the steps' scratch
slot, every cache row filled with randn, and each request is "at" position S: S tokens of context
in both caches (no prefill is run: attention only needs the cache to hold S positions). A case
whose estimated memory (weights + both caches + activations, ``case_memory_bytes``) exceeds
``DFLASH_OPS_BENCH_E2E_MEM_GB`` (default 120) or the free device memory is skipped, with a row
that says so. All 8 default cases fit: the largest, B 64 x S 8192, needs ~111 GB (target K/V
77.6 GB, drafter K/V 10.8 GB).

Timed, per case (CUDA events around graph replays queued back to back, median; each graph is
replayed >= 10 times and for ~300 ms, ``--quick`` >= 5 times and ~100 ms):
* ``draft``: ``models.draft_step.DraftStep`` (max_batch B, scratch slot B, as
  ``speculator.loop`` builds it with steps="graphs"), loaded with a whole accepted block a
  request (its 16 rows of tap hidden states -> fc -> context K/V at positions S-16..S-1) and the
  block [last, MASK x 15] at positions S..S+15, captured, replayed: context K/V + block forward +
  LM head on the 15 mask rows + argmax.
* ``verify``: ``models.verify_step.VerifyStep`` with 16 random tokens a request at positions
  S..S+15 (causal over the S cached keys), captured, replayed: the target forward + argmax + taps.
* ``draft+verify``: the two replays back to back: the time of one iteration on the GPU.
* ``decode``: ``Target.forward`` of one token a request at position S, captured in a graph.
* host loop: ``speculator.loop``'s per-iteration work for steps="graphs", greedy, time_stages=False
  (``load_next`` of the draft inputs: one copy + one ``prepare_step_``, replay, ``load_next``
  of the verify block: one ``prepare_step_``, replay the verify,
  ``accept.greedy_commit`` (match + commit + state + next context rows in one kernel), one
  ``.tolist()`` of the done flags and counts: its one host sync), repeated, timed with the host
  clock to the last sync; the starts are put back to S after each iteration (one extra small
  kernel; the real loop lets them advance). GPU idle per iteration = wall time per iteration -
  (draft + verify graph times): the time the GPU is not running the two graphs (host gaps and
  the loop's small eager kernels).
* once per batch size, ``speculative_generate(steps="graphs", time_stages=False)`` itself on
  random prompts of 32 tokens, 32 new tokens (random weights: ~1 token an iteration), for its
  ``Stats``: host syncs (1 for the first token + 1 per graph capture + 1 per iteration), iterations,
  host wall time per iteration. ``DFLASH_OPS_BENCH_E2E_LOOP=0`` skips it.

Formulas (bf16, 2 bytes an element; H = 4096, L layers, Hq / Hkv heads of D, I = 12288,
V = 151936, b = 16, T = 5 taps of Ht = 4096; ``target_step_cost``, ``drafter_step_cost``):
* verify / decode bytes (n = 16 / 1 new tokens a request) = 2 * [ L*((Hq + 2Hkv)*D*H + H*Hq*D
  + 3*I*H + 2H + 2D) + H (layers, norms) + V*H (LM head) + B*S*L*2*Hkv*D (K/V of the S cached
  keys read) + B*n*L*2*Hkv*D (new K/V written) + B*n*H (embedding rows) + B*n*T*H (verify: taps
  out) ]; FLOPs = 2*B*n*(L*((Hq + 2Hkv)*D*H + H*Hq*D + 3*I*H) + V*H) + 4*B*L*Hq*D*(n*S +
  n(n+1)/2) (causal attention).
* draft bytes = 2 * [ H*T*Ht (fc) + 2H + L*((Hq + 2Hkv)*D*H + H*Hq*D + 3*I*H + 2H + 2D)
  + L*2*Hkv*D*H (the stacked context K/V weight, read as well) + V*H (LM head) + B*S*L*2*Hkv*D
  (context K/V read) + B*b*L*2*Hkv*D (new context K/V written) + B*b*H + B*b*T*Ht (block
  embeddings, taps in) ]; FLOPs = 2*B*b*(H*T*Ht + L*2*Hkv*D*H) + 2*B*b*L*((Hq + 2Hkv)*D*H +
  H*Hq*D + 3*I*H) + 4*B*b*L*Hq*D*(S + b) + 2*B*(b-1)*V*H (the drafter suite's formula).
* floor(step) = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate), both from
  ``measure_floors`` in this run; iteration floor = floor(draft) + floor(verify). At B 1 the bytes
  dominate (verify 15.3 GB at S 1024: ~3.6 ms at 4.27 TB/s; draft 3.4 GB: ~0.8 ms); at B >= ~16
  the verify's FLOPs do (16 x 16.4 GFLOP a request).
* ratios: iteration / (draft floor + verify floor), target <= 1.1 at B 1; decode / decode floor,
  target <= 1.1.
* implied speedup(tau) = tau * t_decode / t_iteration (tau committed tokens an iteration against
  one a decode step), at tau = 6.55 (Qwen3-8B-DFlash-b16, GSM8K, published; the paper reports
  5.2x over plain decoding there, B200, batch 1) and at tau = 16 (oracle: every draft accepted).

Output (``Results``: printed, and ``e2e.md`` / ``.json`` / ``.png``; ``e2e-quick`` for
``--quick``, ``e2e-<BxS...>`` for chosen cases): a summary table per case (iteration and decode
times, their floors and ratios with the 1.1x verdicts, implied speedups next to the paper's 5.2x,
memory estimate, skip / failure notes), one step table per context (us, GB/s, % of copy, x floor
for draft, verify, draft+verify, decode), the host-loop table (wall, graphs, GPU idle per
iteration), the floor terms per step (GB by part, TFLOP, bytes / FLOP floors) and the
``speculative_generate`` table. The plot: floor / time (%) of each step against the batch, one
panel per context, and the implied speedups. One progress line per case on stderr.
``tests/test_bench_e2e.py::test_bench_tiny_on_gpu`` runs the whole suite on tiny models (GPU).

Run time on the H200 (estimated, not yet run): floors ~5 s; weights ~5-10 s; per case ~5-20 s
(caches, three captures, four timings, the host loop; B 64 x S 8192: verify ~50-100 ms a
replay), the first Triton compiles ~10-30 s once; the real loop ~5-10 s a batch size: full run
~3-4 minutes, ``--quick`` ~1.5 minutes. Peak memory ~111 GB (B 64, S 8192).
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from typing import List, Optional, Sequence, Tuple

import torch

from .. import dispatch
from .harness import Results, floor_us, measure_floors

BLOCK = 16                 # DFlash block (draft tokens + 1)
KV_BLOCK = 16              # rows of a paged KV cache block
TAU_PUBLISHED = 6.55       # Qwen3-8B-DFlash-b16, GSM8K, temperature 0
PAPER_SPEEDUP = 5.2        # the paper's speedup at that tau (B200, batch 1)
TAU_ORACLE = float(BLOCK)  # every draft accepted
TARGET_RATIO = 1.1         # the bound on iteration / floor (B 1) and decode / floor
CASES = [(b, s) for s in (1024, 8192) for b in (1, 8, 32, 64)]
QUICK_CASES = [(1, 1024), (1, 8192), (32, 8192)]
MEM_GB = 120.0
LOOP_PROMPT, LOOP_NEW = 32, 32
ENV_CASES = "DFLASH_OPS_BENCH_E2E_CASES"
ENV_MEM = "DFLASH_OPS_BENCH_E2E_MEM_GB"
ENV_LOOP = "DFLASH_OPS_BENCH_E2E_LOOP"
_SLEEP_CYCLES = 2_000_000  # ~1 ms of torch.cuda._sleep: lets the host queue replays ahead
_PREFIX = "[e2e]"


def _say(text: str) -> None:
    print(f"{_PREFIX} {text}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- shapes

def qwen3_8b_target_config():
    from ..models.target import TargetConfig

    return TargetConfig(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                        head_dim=128, intermediate_size=12288, vocab_size=151936,
                        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                        tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                        source="<Qwen3-8B shape, random weights>")


def qwen3_8b_dflash_config():
    from ..models.config import DFlashConfig
    from .drafter import QWEN3_8B_DFLASH  # the shipped config.json

    cfg = DFlashConfig.from_dict(QWEN3_8B_DFLASH, source="<Qwen3-8B-DFlash-b16, random weights>")
    return cfg if cfg.block_size == BLOCK else cfg.replace(block_size=BLOCK)


# ----------------------------------------------------------------------------- cases

def _size(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def parse_cases(text: str, what: str = ENV_CASES) -> List[Tuple[int, int]]:
    """``"1x1024,64x8k"`` -> [(1, 1024), (64, 8192)]: (batch, context) pairs, ``k`` = 1024."""
    out = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            b, s = (_size(x) for x in item.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"{what}: {item.strip()!r} is not BxS (e.g. 8x1024 or 64x8k)") \
                from None
        if b < 1 or s < BLOCK:
            raise ValueError(f"{what}: {item.strip()!r}: need batch >= 1 and context >= {BLOCK}")
        out.append((b, s))
    if not out:
        raise ValueError(f"{what}: no cases in {text!r}")
    return out


def cases_from_env(quick: bool) -> List[Tuple[int, int]]:
    env = os.environ.get(ENV_CASES, "").strip()
    if env:
        return parse_cases(env)
    return list(QUICK_CASES if quick else CASES)


def case_label(batch: int, context: int) -> str:
    return f"B={batch} S={context}"


def parse_case_label(label: str) -> Tuple[int, int]:
    """``"B=8 S=1024"`` -> (8, 1024)."""
    b, s = label.split()
    return int(b[2:]), int(s[2:])


# ----------------------------------------------------------------------------- floors

def _layer_params(hidden, heads, kv_heads, head_dim, inter, qk_norm=True, bias=False):
    """(matrix elements, vector elements) of one Qwen3-style decoder layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    mats = (q + 2 * kv) * hidden + hidden * q + 3 * inter * hidden
    vecs = 2 * hidden + (2 * head_dim if qk_norm else 0) + ((q + 2 * kv + hidden) if bias else 0)
    return mats, vecs


def target_step_cost(cfg, batch: int, context: int, new: int, n_taps: int = 0,
                     elt: int = 2) -> dict:
    """Bytes (by part) and FLOPs of one target forward of ``new`` tokens a request for ``batch``
    requests holding ``context`` cached positions (verify: new = 16 with taps; decode: 1).

    weights: the layers' matrices and norms + the final norm; lm_head: V*H; kv_read: K/V of the
    cached keys; kv_write: the new tokens' K/V; other: embedding rows in + tap hidden states out.
    The new tokens' own keys are not counted as read (a minimal step keeps them on chip), nor the
    logits written."""
    H, L, V = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    mats, vecs = _layer_params(H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                               cfg.intermediate_size, cfg.qk_norm, cfg.attention_bias)
    kv_row = L * 2 * cfg.num_kv_heads * cfg.head_dim  # K/V elements a token
    t = batch * new
    cost = {"weights": elt * (L * (mats + vecs) + H), "lm_head": elt * V * H,
            "kv_read": elt * batch * context * kv_row, "kv_write": elt * t * kv_row,
            "other": elt * t * H * (1 + n_taps)}
    cost["bytes"] = sum(cost.values())
    keys = new * context + new * (new + 1) // 2  # causal: query i sees context + i + 1 keys
    cost["flops"] = (2 * t * (L * mats + V * H)
                     + 4 * batch * L * cfg.num_heads * cfg.head_dim * keys)
    return cost


def drafter_step_cost(cfg, batch: int, context: int, block: int = BLOCK,
                      new: Optional[int] = None, elt: int = 2) -> dict:
    """Bytes (by part) and FLOPs of one draft step: the context K/V of ``new`` committed rows a
    request (default a whole block) at positions context-new .. context-1, then the block at
    context .. context+block-1 over the ``context`` cached keys, the LM head on block-1 rows.

    weights: fc, hidden_norm, the layers, the stacked context K/V weight (the k/v projections a
    second time, as the drafter reads them), the final norm; lm_head: V*H (the target's);
    kv_read: the cached context K/V; kv_write: the new context K/V; other: block embedding rows +
    tap hidden states in. Not counted: the block's own K/V (on chip in a minimal step), logits."""
    new = block if new is None else new
    H, L, D = cfg.hidden_size, cfg.num_layers, cfg.head_dim
    T, Ht, V = cfg.n_taps, cfg.target_hidden_size, cfg.out_vocab_size
    mats, vecs = _layer_params(H, cfg.num_heads, cfg.num_kv_heads, D, cfg.intermediate_size,
                               True, cfg.attention_bias)
    kv_row = L * 2 * cfg.num_kv_heads * D
    cost = {"weights": elt * (H * T * Ht + 2 * H + L * (mats + vecs) + kv_row * H),
            "lm_head": elt * V * H,
            "kv_read": elt * batch * context * kv_row,
            "kv_write": elt * batch * new * kv_row,
            "other": elt * (batch * block * H + batch * new * T * Ht)}
    cost["bytes"] = sum(cost.values())
    cost["flops"] = (2 * batch * new * (H * T * Ht + kv_row * H)
                     + 2 * batch * block * L * mats
                     + 4 * batch * block * L * cfg.num_heads * D * (context + block)
                     + 2 * batch * (block - 1) * V * H)
    return cost


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def case_memory_bytes(tcfg, dcfg, batch: int, context: int, block: int = BLOCK,
                      elt: int = 2) -> dict:
    """Device memory a case needs (estimate): both models' weights, both paged caches (B
    requests of context + 2 blocks positions, rounded up to cache blocks, + one block for the
    scratch slot), and activations (two [B*block, V] logits in fp32 + bf16, + 2 GiB)."""
    tokens = batch * _round_up(context + 2 * block, KV_BLOCK) + _round_up(block, KV_BLOCK)
    t_kv = elt * tokens * tcfg.num_layers * 2 * tcfg.num_kv_heads * tcfg.head_dim
    d_kv = elt * tokens * dcfg.num_layers * 2 * dcfg.num_kv_heads * dcfg.head_dim
    tc = target_step_cost(tcfg, 1, 0, 0, elt=elt)
    embed = 0 if tcfg.tie_word_embeddings else elt * tcfg.vocab_size * tcfg.hidden_size
    out = {"target_weights": tc["weights"] + tc["lm_head"] + embed,
           "drafter_weights": drafter_step_cost(dcfg, 1, 0, block, elt=elt)["weights"],
           "target_kv": t_kv, "drafter_kv": d_kv,
           "activations": 2 * batch * block * tcfg.vocab_size * (4 + 2) + (2 << 30)}
    out["total"] = sum(out.values())
    return out


def implied_speedup(tau: float, t_decode: float, t_iteration: float) -> float:
    """tau tokens a request per iteration against one per decode step: tau * t_decode / t_iter."""
    return tau * t_decode / t_iteration


# ----------------------------------------------------------------------------- GPU plumbing

def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"the e2e benchmark needs a CUDA GPU, and torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda}). Nothing was run.")


def _random_state(shapes: dict, seed: int, device, dtype) -> dict:
    """Tensors of the given shapes drawn on the device: matrices N(0, 1/fan_in), ``*norm.weight``
    1 + 0.1 N(0, 1), biases 0.1 N(0, 1) (the CPU random_state functions' distributions)."""
    g = torch.Generator(device=device).manual_seed(int(seed))
    state = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=dtype, device=device).normal_(generator=g)
        if name.endswith("norm.weight"):
            t.mul_(0.1).add_(1)
        elif name.endswith(".bias"):
            t.mul_(0.1)
        else:
            t.mul_(shape[-1] ** -0.5)
        state[name] = t
    return state


def build_models(tcfg, dcfg, seed: int = 0, device="cuda", dtype=torch.bfloat16):
    """(Target, DFlashDrafter) with random weights drawn on the device and 1-block placeholder
    caches (each case installs its own, ``install_caches``)."""
    from ..models.drafter import DFlashDrafter
    from ..models.target import Target, expected_target_shapes
    from ..models.weights import expected_shapes

    tiny = dict(max_requests=1, max_len=KV_BLOCK)
    state = _random_state(expected_target_shapes(tcfg)[0], seed, device, dtype)
    target = Target(tcfg, state, dtype=dtype, device=device, num_blocks=1,
                    block_size=KV_BLOCK, **tiny)
    del state
    dshapes = {n: s[0] for n, s in expected_shapes(dcfg)[0].items()}
    state = _random_state(dshapes, seed + 1, device, dtype)
    drafter = DFlashDrafter(dcfg, state, embed_tokens=target.embed, lm_head=target.lm_head,
                            dtype=dtype, device=device, num_blocks=1,
                            cache_block_size=KV_BLOCK, **tiny)
    del state
    gc.collect()
    torch.cuda.empty_cache()
    return target, drafter


def install_caches(target, drafter, slots: int, num_blocks: int, max_len: int,
                   fill: bool = True) -> None:
    """Give both models a fresh paged cache: ``slots`` request slots, ``num_blocks`` blocks of
    KV_BLOCK rows, block tables for ``max_len`` positions; ``fill``: every row randn (the K/V a
    prefill would have left: attention reads them, and never zeros)."""
    from ..models.cache import PagedKVCache

    for model, cfg in ((target, target.cfg), (drafter, drafter.cfg)):
        model.cache = None
        gc.collect()
        torch.cuda.empty_cache()
        model.cache = PagedKVCache(cfg.num_layers, num_blocks, KV_BLOCK, cfg.num_kv_heads,
                                   cfg.head_dim, slots, max_len, model.dtype, model.device)
        if fill:
            for t in model.cache.k + model.cache.v:
                t.normal_()


def release_caches(target, drafter) -> None:
    install_caches(target, drafter, 1, 1, KV_BLOCK, fill=False)


def time_replays(fn, rep_ms: float, min_reps: int = 10, max_reps: int = 200) -> dict:
    """Median device time of ``fn()`` (graph replays), CUDA events around each call; the calls
    are queued back to back behind a short sleep kernel, so host launch time is hidden."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
    reps = max(min_reps, min(max_reps, int(rep_ms / est_ms)))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    torch.cuda._sleep(_SLEEP_CYCLES)
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in ev)
    q = statistics.quantiles(ms, n=5, method="inclusive") if len(ms) > 1 else ms * 4
    return {"us": statistics.median(ms) * 1e3, "p20": q[0] * 1e3, "p80": q[3] * 1e3,
            "samples": reps, "mode": "graph replay"}


def host_loop(dstep, vstep, batch: int, context: int, pending: tuple, stop_id: int,
              iters: int, warmup: int = 3) -> float:
    """Seconds of host wall time per iteration of speculator.loop's greedy steps="graphs" path
    with time_stages=False (its one host sync an iteration). ``pending``: the first draft step's
    context rows (taps [R * B], requests [R], positions [R, B]). One addition: the starts are reset to
    ``context`` after each iteration (one small kernel), so the caches need no room to grow."""
    from ..speculator.accept import greedy_commit

    dev = vstep.ids.device
    bsz = vstep.b
    ra = torch.arange(batch, device=dev)
    start_t = torch.full((batch,), context, dtype=torch.long, device=dev)
    last = torch.zeros(batch, dtype=torch.long, device=dev)
    n_out = torch.zeros(batch, dtype=torch.long, device=dev)
    out_tokens = torch.zeros(batch, 2 * bsz + 1, dtype=torch.long, device=dev)
    stop_t = torch.tensor([stop_id], dtype=torch.long, device=dev)
    max_new = 1 << 30  # never finishes (columns past out_tokens' width are not written)
    t0, committed, finished = 0.0, 0, 0
    for it in range(warmup + iters):
        if it == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        bucket = dstep.load_next(ra, last, start_t, *pending)
        drafts, _ = dstep.run(bucket)
        bucket = vstep.load_next(ra, last, start_t, drafts[:batch])
        _, vpost, taps = vstep.run(bucket)
        block = vstep.ids[:batch]
        post, taps = vpost[:batch], taps[:batch * bsz]
        kept, fin, ctx_pos = greedy_commit(block, post, ra, n_out, start_t, last, out_tokens,
                                           stop_t, max_new)
        pending = (taps, ra, ctx_pos)
        flags = torch.stack([fin.long(), kept]).tolist()  # the iteration's one host sync
        finished += sum(1 for x in flags[0] if x)  # the loop's bookkeeping (none finish here)
        committed += sum(flags[1])
        start_t.fill_(context)
    return (time.perf_counter() - t0) / iters


def measure_case(target, drafter, batch: int, context: int, *, rep_ms: float,
                 loop_ms: float, min_reps: int = 10) -> dict:
    """Times (us) of draft, verify, draft+verify, decode and the host loop for one case."""
    from ..models.draft_step import DraftStep
    from ..models.verify_step import VerifyStep

    dev, dcfg = target.device, drafter.cfg
    b = BLOCK
    max_len = context + 2 * b
    per_req = _round_up(max_len, KV_BLOCK) // KV_BLOCK  # cache blocks a request
    scratch = _round_up(b, KV_BLOCK) // KV_BLOCK        # the steps' scratch slot: one block
    install_caches(target, drafter, batch + 1, batch * per_req + scratch, max_len)
    for r in range(batch):
        target.add_request(r, max_len)
        drafter.cache.add_request(r, max_len)
    g = torch.Generator(device=dev).manual_seed(batch * 100003 + context)
    vocab = min(target.cfg.vocab_size, dcfg.mask_token_id)
    ra = torch.arange(batch, device=dev)
    st = torch.full((batch,), context, dtype=torch.long, device=dev)
    # the draft step: a whole block committed a request (positions context-b .. context-1)
    taps = torch.randn(batch * b, dcfg.n_taps * dcfg.target_hidden_size, generator=g,
                       device=dev, dtype=drafter.dtype)
    ctx_req = ra.repeat_interleave(b)
    ctx_pos = (context - b + torch.arange(b, device=dev)).repeat(batch)
    block = torch.full((batch, b), dcfg.mask_token_id, dtype=torch.long, device=dev)
    block[:, 0] = torch.randint(0, vocab, (batch,), generator=g, device=dev)
    dstep = DraftStep(drafter, max_batch=batch, scratch_request=batch, block_size=b,
                      logits=False)  # greedy: argmax on the bf16 LM-head output
    bucket = dstep.load(taps, ctx_req, ctx_pos, block, ra, st)
    dstep.capture(bucket)
    # the verify step: b random tokens a request at positions context .. context+b-1
    vstep = VerifyStep(target, max_batch=batch, block_size=b,
                       tap_layers=dcfg.target_layer_ids, scratch_request=batch,
                       logits=False)
    vbucket = vstep.load(torch.randint(0, vocab, (batch, b), generator=g, device=dev), ra, st)
    vstep.capture(vbucket)
    # plain decode: one token a request at position context
    ids = torch.randint(0, vocab, (batch,), generator=g, device=dev)
    ones = torch.ones(batch, dtype=torch.long, device=dev)
    dgraph = dispatch.capture_graph(  # a greedy decode step: forward + argmax
        lambda: target.forward(ids, ra, st, ones, None, fp32_logits=False)[0].argmax(-1))[0]
    torch.cuda.synchronize()

    out = {"batch": batch, "context": context}
    timing = dict(rep_ms=rep_ms, min_reps=min_reps)
    out["draft"] = time_replays(lambda: dstep.run(bucket), **timing)
    out["verify"] = time_replays(lambda: vstep.run(vbucket), **timing)
    out["iteration"] = time_replays(lambda: (dstep.run(bucket), vstep.run(vbucket)), **timing)
    out["decode"] = time_replays(dgraph.replay, **timing)
    graphs_us = out["draft"]["us"] + out["verify"]["us"]
    iters = max(min_reps, min(100, int(loop_ms * 1e3 / max(graphs_us, 1.0))))
    try:
        wall = host_loop(dstep, vstep, batch, context, (taps, ra, ctx_pos.view(batch, b)),
                         stop_id=target.cfg.vocab_size - 1, iters=iters)
        out["loop"] = {"wall_us": wall * 1e6, "graphs_us": graphs_us,
                       "idle_us": wall * 1e6 - graphs_us, "iters": iters}
    except Exception as e:  # noqa: BLE001 - e.g. greedy_commit changed: report it, go on
        out["loop"] = {"error": f"{type(e).__name__}: {str(e).strip()[:160]}"}
    release_caches(target, drafter)  # the graphs' pools go when this returns
    return out


def measure_real_loop(target, drafter, batch: int, prompt_len: int = LOOP_PROMPT,
                      new_tokens: int = LOOP_NEW, seed: int = 0) -> dict:
    """``speculative_generate(steps="graphs", time_stages=False)`` on random prompts: its Stats."""
    from ..speculator.loop import speculative_generate

    max_len = prompt_len + new_tokens + 2 * BLOCK + KV_BLOCK
    per_req = _round_up(max_len, KV_BLOCK) // KV_BLOCK
    install_caches(target, drafter, batch + 1, (batch + 1) * per_req, max_len, fill=False)
    try:
        gen = torch.Generator().manual_seed(seed)
        vocab = min(target.cfg.vocab_size, drafter.cfg.mask_token_id)
        prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
                   for _ in range(batch)]
        t0 = time.perf_counter()
        _, st = speculative_generate(target, drafter, prompts, new_tokens, block_size=BLOCK,
                                     steps="graphs", time_stages=False)
        total = time.perf_counter() - t0
        loop_s = st.seconds["draft"] + st.seconds["verify"] + st.seconds["accept"]
        it = max(1, st.iterations)
        return {"iterations": st.iterations, "host syncs": st.host_syncs,
                "syncs/iter": st.host_syncs / it, "acceptance": st.mean_acceptance,
                "loop ms/iter": loop_s * 1e3 / it, "prefill s": st.seconds["prefill"],
                "capture s": st.seconds["capture"], "total s": total}
    finally:
        release_caches(target, drafter)


# ----------------------------------------------------------------------------- report

NOTES = [
    "shapes: target Qwen3-8B (36 layers, H 4096, 32/8 heads x 128, MLP 12288, V 151936, "
    "QK-norm, untied LM head), drafter Qwen3-8B-DFlash-b16 (5 layers, block 16, taps 1,9,17,25,33,"
    " the target's embedding and LM head); random bf16 weights (N(0, 1/fan_in), norms 1 + 0.1 N)",
    "case: B requests each holding S positions in both paged caches (random K/V, no prefill "
    "run); draft = DraftStep graph (16 committed rows a request -> context K/V at S-16..S-1, "
    "the block at S..S+15, LM head on 15 rows, argmax); verify = VerifyStep graph (16 tokens a "
    "request at S..S+15, causal); draft+verify = the two replays back to back (t_iteration); "
    "decode = Target.forward of 1 token a request at S in a graph",
    "timing: CUDA events around each graph replay, replays queued back to back (host launch "
    "hidden), median (>= 10 replays, ~300 ms; --quick >= 5, ~100 ms)",
    "floor(step) = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate) of this run; bytes = "
    "weights + LM head + K/V of the S cached keys read + new K/V written + embedding rows and "
    "taps (table 'floor terms'); x floor = time / floor; iteration floor = draft floor + "
    "verify floor; the issue's targets: iteration <= 1.1x its floor at B 1, decode <= 1.1x",
    "verify / decode bytes = 2*[L*((Hq+2Hkv)*D*H + H*Hq*D + 3*I*H + 2H + 2D) + H + V*H + "
    "B*S*L*2*Hkv*D + B*n*L*2*Hkv*D + B*n*H (+ B*n*5*H taps out, verify)], n = 16 / 1; FLOPs = "
    "2*B*n*(L*((Hq+2Hkv)*D*H + H*Hq*D + 3*I*H) + V*H) + 4*B*L*Hq*D*(n*S + n(n+1)/2)",
    "draft bytes = 2*[H*5*Ht + 2H + L*((Hq+2Hkv)*D*H + H*Hq*D + 3*I*H + 2H + 2D) + "
    "L*2*Hkv*D*H (stacked context K/V weight) + V*H + B*S*L*2*Hkv*D + B*16*L*2*Hkv*D + B*16*H "
    "+ B*16*5*Ht]; FLOPs = 2*B*16*(H*5*Ht + L*2*Hkv*D*H) + 2*B*16*L*((Hq+2Hkv)*D*H + H*Hq*D + "
    "3*I*H) + 4*B*16*L*Hq*D*(S+16) + 2*B*15*V*H",
    f"implied speedup(tau) = tau * t_decode / t_iteration at tau {TAU_PUBLISHED} (GSM8K, "
    f"published for Qwen3-8B-DFlash-b16; the paper's speedup there: {PAPER_SPEEDUP}x, B200, "
    f"batch 1) and tau {TAU_ORACLE:g} (oracle: all 15 drafts + the bonus accepted)",
    "host loop: speculator.loop's per-iteration work (steps='graphs', greedy, "
    "time_stages=False: loads, both replays, accept.greedy_commit, next context rows, one "
    ".tolist() sync) repeated, starts reset to S each time; wall = host clock per iteration to the "
    "last sync; GPU idle = wall - (draft + verify graph times): host gaps plus the loop's small "
    "eager kernels; syncs/iter = 1 by construction",
    "speculative_generate table: the real loop (steps='graphs', time_stages=False) on random "
    f"{LOOP_PROMPT}-token prompts, {LOOP_NEW} new tokens; host syncs = 1 (first token) + 1 per "
    "graph capture + 1 per iteration; loop ms/iter = host time in draft + verify + accept per "
    "iteration (short context, random drafter: ~1 token an iteration)",
]


def _ms(us: Optional[float]) -> Optional[float]:
    return None if us is None else us / 1e3


def step_costs(tcfg, dcfg, batch: int, context: int) -> dict:
    """Cost dicts of the case's draft, verify (with the drafter's taps) and decode steps."""
    return {"draft": drafter_step_cost(dcfg, batch, context, BLOCK),
            "verify": target_step_cost(tcfg, batch, context, BLOCK, n_taps=dcfg.n_taps),
            "decode": target_step_cost(tcfg, batch, context, 1)}


def step_floors(floors: dict, costs: dict) -> dict:
    """us per step: max(bytes / copy, FLOPs / GEMM rate); 'draft+verify' = their sum."""
    fl = {k: floor_us(floors, c["bytes"], c["flops"]) for k, c in costs.items()}
    fl["draft+verify"] = fl["draft"] + fl["verify"]
    return fl


def summary_row(batch: int, t_iteration: float, t_decode: float, fl: dict) -> dict:
    """The summary table's fields from the iteration and decode times and the floors (us)."""
    r_it, r_dec = t_iteration / fl["draft+verify"], t_decode / fl["decode"]
    return {"iter ms": _ms(t_iteration), "iter floor ms": _ms(fl["draft+verify"]),
            "iter/floor": r_it,
            "<=1.1 (B=1)": ("yes" if r_it <= TARGET_RATIO else "NO") if batch == 1 else "-",
            "decode ms": _ms(t_decode), "decode floor ms": _ms(fl["decode"]),
            "decode/floor": r_dec, "<=1.1": "yes" if r_dec <= TARGET_RATIO else "NO",
            f"speedup @{TAU_PUBLISHED}": implied_speedup(TAU_PUBLISHED, t_decode, t_iteration),
            "paper (B200, B=1)": PAPER_SPEEDUP if batch == 1 else None,
            f"speedup @{TAU_ORACLE:g}": implied_speedup(TAU_ORACLE, t_decode, t_iteration)}


def _progress(m: dict, row: dict) -> str:
    lp = m.get("loop", {})
    idle = f"GPU idle {_ms(lp['idle_us']):.3f} ms/iter" if "idle_us" in lp else \
        f"host loop {lp.get('error', 'not run')}"
    return (f"{case_label(m['batch'], m['context'])}: draft {_ms(m['draft']['us']):.3f} ms, "
            f"verify {_ms(m['verify']['us']):.3f} ms, iteration {row['iter ms']:.3f} ms "
            f"({row['iter/floor']:.2f}x floor), decode {row['decode ms']:.3f} ms "
            f"({row['decode/floor']:.2f}x floor), speedup @{TAU_PUBLISHED} "
            f"{row[f'speedup @{TAU_PUBLISHED}']:.2f}x, @{TAU_ORACLE:g} "
            f"{row[f'speedup @{TAU_ORACLE:g}']:.2f}x, {idle}")


SUMMARY = "summary: iteration (draft + verify graphs) vs decode graph, floors, implied speedup"
HOST = "host loop around the two graphs (speculator.loop's work, one sync an iteration)"
TERMS = "floor terms (GB, TFLOP, us)"
REAL = "speculative_generate (steps='graphs', time_stages=False), short run"


def _steps_title(context: int) -> str:
    return f"steps at S={context} (CUDA-graph replay)"


class E2EResults(Results):
    """Results whose plot shows, per context, floor / time (%) of each step against the batch,
    and the implied speedups (a step that is FLOP-bound has a low % of copy bandwidth, so the
    harness's %copy plot would mislead here)."""

    def plot(self, path):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        tabs = {k: v for k, v in self.tables().items() if k.startswith("steps at")}
        summ = [dict(r, batch=b, context=c) for r in self.tables().get(SUMMARY, [])
                if r.get("iter ms") for b, c in [parse_case_label(r["case"])]]
        if not tabs:
            return None
        fig, axes = plt.subplots(1, len(tabs) + 1, figsize=(5.5 * (len(tabs) + 1), 4.5),
                                 squeeze=False)
        for ax, (title, rows) in zip(axes[0], tabs.items()):
            top = 110.0
            for impl in dict.fromkeys(r["impl"] for r in rows):
                pts = sorted((r["x"], 100 / r["x floor"]) for r in rows
                             if r["impl"] == impl and r.get("x floor"))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
                    top = max(top, 5 + max(y for _, y in pts))
            ax.axhline(100, color="k", linestyle="--", linewidth=1, label="floor")
            ax.axhline(100 / TARGET_RATIO, color="gray", linestyle=":", linewidth=1,
                       label=f"1/{TARGET_RATIO}x floor")
            ax.set(xscale="log", ylim=(0, top), xlabel="batch (requests)",
                   ylabel="floor / time (%)", title=title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        ax = axes[0][-1]
        for s in sorted({r["context"] for r in summ}):
            for key, style in ((f"speedup @{TAU_PUBLISHED}", "-"),
                               (f"speedup @{TAU_ORACLE:g}", "--")):
                pts = sorted((r["batch"], r[key]) for r in summ if r["context"] == s)
                ax.plot(*zip(*pts), marker="o", linestyle=style, label=f"S={s}, {key}")
        ax.axhline(PAPER_SPEEDUP, color="k", linestyle=":", linewidth=1,
                   label=f"paper {PAPER_SPEEDUP}x (tau {TAU_PUBLISHED}, B200, B=1)")
        ax.set(xscale="log", xlabel="batch (requests)", ylabel="tau * t_decode / t_iteration",
               title="implied speedup over plain decoding")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        return self._save_figure(fig, path)


def report(res: Results, tcfg, dcfg, entries: list, loops: list) -> None:
    """Add the tables. entries: per case in order, dict(batch, context, mem, m or None, note);
    loops: per batch, dict(batch, new, stats or {}, note)."""
    done = [e for e in entries if e["m"] is not None]
    for e in entries:  # summary: every case, skipped and failed ones with their reason
        b, s = e["batch"], e["context"]
        fields = {}
        if e["m"] is not None:
            fl = step_floors(res.floors, step_costs(tcfg, dcfg, b, s))
            fields = summary_row(b, e["m"]["iteration"]["us"], e["m"]["decode"]["us"], fl)
        res.add(SUMMARY, case=case_label(b, s), **fields,
                **{"mem GB (est.)": e["mem"] / 1e9}, note=e["note"])
    for s in dict.fromkeys(e["context"] for e in done):  # one step table per context
        for e in (e for e in done if e["context"] == s):
            b, m = e["batch"], e["m"]
            costs = step_costs(tcfg, dcfg, b, s)
            fl = step_floors(res.floors, costs)
            moved = {k: c["bytes"] for k, c in costs.items()}
            moved["draft+verify"] = moved["draft"] + moved["verify"]
            for name, key in (("draft", "draft"), ("verify", "verify"),
                              ("draft+verify", "iteration"), ("decode", "decode")):
                res.add_time(_steps_title(s), f"B={b}", name, m[key], bytes_moved=moved[name],
                             floor=fl[name], x=b, **{"floor us": fl[name],
                                                     "reps": m[key]["samples"]})
    for e in done:
        lp, label = e["m"]["loop"], case_label(e["batch"], e["context"])
        if "error" in lp:
            res.add(HOST, case=label, note=f"failed: {lp['error']}")
            continue
        res.add(HOST, case=label, **{"wall ms/iter": _ms(lp["wall_us"]),
                                     "graphs ms/iter": _ms(lp["graphs_us"]),
                                     "GPU idle ms/iter": _ms(lp["idle_us"]),
                                     "idle %": 100 * lp["idle_us"] / lp["wall_us"],
                                     "iters": lp["iters"], "syncs/iter": 1}, note="")
    for e in done:
        b, s = e["batch"], e["context"]
        costs = step_costs(tcfg, dcfg, b, s)
        fl = step_floors(res.floors, costs)
        for name, c in costs.items():
            res.add(TERMS, case=case_label(b, s), step=name,
                    **{"weights": c["weights"] / 1e9, "LM head": c["lm_head"] / 1e9,
                       "KV read": c["kv_read"] / 1e9, "KV write": c["kv_write"] / 1e9,
                       "other": c["other"] / 1e9, "total GB": c["bytes"] / 1e9,
                       "TFLOP": c["flops"] / 1e12, "bytes us": floor_us(res.floors, c["bytes"]),
                       "FLOP us": floor_us(res.floors, 0, c["flops"]), "floor us": fl[name]})
    for lp in loops:
        res.add(REAL, case=f"B={lp['batch']}", prompt=LOOP_PROMPT,
                **{"new tokens": lp["new"]}, **lp["stats"], note=lp["note"])


def bench(tcfg, dcfg, cases: Sequence[Tuple[int, int]], *, quick: bool = False,
          mem_gb: float = MEM_GB, real_loop: bool = True, name: str = "e2e",
          seed: int = 0) -> Results:
    """Every case on one pair of models built here; returns the Results."""
    require_cuda()
    import dflash_ops  # defines the ops, loads the CUDA extension

    t_start = time.perf_counter()
    _say(f"dflash_ops {dflash_ops.__version__}, CUDA extension: "
         f"{dflash_ops._ext.STATUS.get('how')}; {len(cases)} cases")
    floors = measure_floors()
    _say(f"floors: copy {floors['copy_GBps']:.0f} GB/s, bf16 GEMM "
         f"{floors['gemm_TFLOPs']:.0f} TFLOP/s")
    rep_ms, loop_ms, min_reps = (100.0, 100.0, 5) if quick else (300.0, 400.0, 10)
    res = E2EResults(name, floors=floors, xlabel="batch (requests)",
                     meta={"target": tcfg.source, "drafter": dcfg.source, "block": BLOCK,
                           "tau_published": TAU_PUBLISHED, "paper_speedup": PAPER_SPEEDUP,
                           "cases": [list(c) for c in cases], "mem_budget_GB": mem_gb})
    total_mem = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    budget = min(mem_gb * 1e9, total_mem)
    entries, loops = [], []
    with torch.no_grad():
        t0 = time.perf_counter()
        target, drafter = build_models(tcfg, dcfg, seed)
        w = case_memory_bytes(tcfg, dcfg, 1, 0)
        _say(f"models built in {time.perf_counter() - t0:.1f} s: target "
             f"{w['target_weights'] / 1e9:.1f} GB, drafter {w['drafter_weights'] / 1e9:.2f} GB "
             f"(+ the target's embedding and LM head)")
        for b, s in cases:
            label = case_label(b, s)
            need = case_memory_bytes(tcfg, dcfg, b, s)
            entry = {"batch": b, "context": s, "mem": need["total"], "m": None, "note": ""}
            entries.append(entry)
            free = torch.cuda.mem_get_info()[0]
            case_only = need["target_kv"] + need["drafter_kv"] + need["activations"]
            if need["total"] > budget or case_only > free:
                entry["note"] = (f"skipped: needs ~{need['total'] / 1e9:.0f} GB (K/V "
                                 f"{(need['target_kv'] + need['drafter_kv']) / 1e9:.0f} GB), "
                                 f"budget {budget / 1e9:.0f} GB, free {free / 1e9:.0f} GB")
                _say(f"{label}: {entry['note']}")
                continue
            t0 = time.perf_counter()
            try:
                m = measure_case(target, drafter, b, s, rep_ms=rep_ms, loop_ms=loop_ms,
                                 min_reps=min_reps)
            except Exception as e:  # noqa: BLE001 - one failed case (OOM...) is reported
                m = None
                entry["note"] = (f"failed: {type(e).__name__}: "
                                 f"{(str(e).strip().splitlines() or [''])[0][:160]}")
            if m is None:  # out of the except block: its frames (graphs, buffers) are gone
                _say(f"{label}: {entry['note']}")
                release_caches(target, drafter)
                continue
            entry["m"] = m
            row = summary_row(b, m["iteration"]["us"], m["decode"]["us"],
                              step_floors(floors, step_costs(tcfg, dcfg, b, s)))
            _say(f"{_progress(m, row)} ({time.perf_counter() - t0:.1f} s)")
        for b in sorted({b for b, _ in cases}) if real_loop else []:
            new = LOOP_NEW // 2 if quick else LOOP_NEW
            t0 = time.perf_counter()
            try:
                st, note = measure_real_loop(target, drafter, b, LOOP_PROMPT, new), ""
            except Exception as e:  # noqa: BLE001 - the graphed loop is new on the GPU
                st = {}
                note = f"failed: {type(e).__name__}: {(str(e).strip() or '-')[:160]}"
            loops.append({"batch": b, "new": new, "stats": st, "note": note})
            _say(f"speculative_generate B={b}: " + (note or (
                f"{st['iterations']} iterations, {st['host syncs']} host syncs "
                f"({st['syncs/iter']:.2f}/iter), host {st['loop ms/iter']:.2f} ms/iter, "
                f"acceptance {st['acceptance']:.2f}")) + f" ({time.perf_counter() - t0:.1f} s)")
        del target, drafter
        gc.collect()
        torch.cuda.empty_cache()
    report(res, tcfg, dcfg, entries, loops)
    res.notes += NOTES
    res.notes.append(f"run time {time.perf_counter() - t_start:.0f} s (weights built once)")
    return res


def run(quick: bool = False) -> Results:
    """The suite behind ``dflash-ops bench e2e``: Qwen3-8B shapes, cases from
    DFLASH_OPS_BENCH_E2E_CASES or the defaults, memory budget DFLASH_OPS_BENCH_E2E_MEM_GB,
    DFLASH_OPS_BENCH_E2E_LOOP=0 skips the real-loop table. Writes ``e2e`` (``e2e-quick``,
    ``e2e-<BxS...>`` for restricted runs, so they never overwrite a full run's files)."""
    require_cuda()
    cases = cases_from_env(quick)
    mem_gb = float(os.environ.get(ENV_MEM, "").strip() or MEM_GB)
    real_loop = os.environ.get(ENV_LOOP, "").strip() != "0"
    name = "e2e"
    if os.environ.get(ENV_CASES, "").strip():
        name += "-" + "-".join(f"{b}x{s}" for b, s in cases)
    elif quick:
        name += "-quick"
    return bench(qwen3_8b_target_config(), qwen3_8b_dflash_config(), cases, quick=quick,
                 mem_gb=mem_gb, real_loop=real_loop, name=name)
