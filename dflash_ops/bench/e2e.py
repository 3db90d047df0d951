"""End-to-end suite: one DFlash iteration (draft step + verify step, both CUDA graphs) of a
Qwen3-8B-shaped target with a Qwen3-8B-DFlash-shaped drafter, against a plain decode step of the
same target under a CUDA graph, and against the floors (``e2e_report``: the formulas, tables and
plot).

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
* ``draft``: ``speculator.draft_step.DraftStep`` (max_batch B, scratch slot B, as
  ``speculator.loop`` builds it with steps="graphs"), loaded with a whole accepted block a
  request (its 16 rows of tap hidden states -> fc -> context K/V at positions S-16..S-1) and the
  block [last, MASK x 15] at positions S..S+15, captured, replayed: context K/V + block forward +
  LM head on the 15 mask rows + argmax.
* ``verify``: ``speculator.verify_step.VerifyStep`` with 16 random tokens a request at positions
  S..S+15 (causal over the S cached keys), captured, replayed: the target forward + argmax + taps.
* ``draft+verify``: the two replays back to back: the time of one iteration on the GPU.
* ``decode``: ``Target.forward`` of one token a request at position S, captured in a graph.
* host loop: ``speculative_generate``'s own iteration (``speculator.step.Iteration``) for
  steps="graphs", greedy, time_stages=False: the whole iteration in one graph (prepare,
  draft, prepare, verify, ``greedy_commit``, the committed rows' context, the flags) and one
  ``.tolist()`` of the done flags and counts (its one host sync); and, as "staged", the
  iteration before that graph, on the two captured steps (``load_next`` of the draft inputs:
  one copy + one ``prepare_step_``, replay, ``load_next`` of the verify block: one
  ``prepare_step_``, replay the verify, ``greedy_commit``, the read); each repeated, timed
  with the host clock to the last sync; the starts are put back to S after each iteration
  (one extra small kernel; the real loop lets them advance). GPU idle per iteration = wall
  time per iteration - (draft + verify graph times): the time the GPU is not running the two
  steps (host gaps and the loop's small kernels).
* once per batch size, ``speculative_generate(steps="graphs", time_stages=False)`` itself on
  random prompts of 32 tokens, 32 new tokens (random weights: ~1 token an iteration), for its
  ``Stats``: host syncs (1 for the first token + 1 per graph capture + 1 per iteration), iterations,
  host wall time per iteration. ``DFLASH_OPS_BENCH_E2E_LOOP=0`` skips it.

``--exact``: per case, the verify step, the iteration and the decode step again in exact mode
(``speculator.exact_mode``: row-count-independent GEMMs and attention splits, captured apart),
beside the default ones in the same run: issue 19's cost of exact mode.

Run time on the H200 (estimate): floors ~5 s; weights ~5-10 s; per case ~5-20 s
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
from typing import List, Sequence, Tuple

import torch

from .. import dispatch
from .e2e_report import (
    BLOCK, KV_BLOCK, LOOP_NEW, LOOP_PROMPT, MEM_GB, NOTES, PAPER_SPEEDUP, TAU_PUBLISHED,
    E2EResults, case_label, case_memory_bytes, progress, report, round_up, step_costs,
    step_floors, summary_row,
)
from ..models.cache import PagedKVCache
from ..ops.select import argmax_last
from .harness import Results, measure_floors

CASES = [(b, s) for s in (1024, 8192) for b in (1, 8, 32, 64)]
QUICK_CASES = [(1, 1024), (1, 8192), (32, 8192)]
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


def mem_gb_from_env() -> float:
    """The memory budget in GB: ENV_MEM, or MEM_GB when unset; anything but a finite number
    > 0 raises ValueError naming it."""
    text = os.environ.get(ENV_MEM, "").strip()
    if not text:
        return MEM_GB
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise ValueError(f"{ENV_MEM}: got {text!r}; allowed: a number of GB > 0 (default "
                         f"{MEM_GB})")
    return value


def check_options(quick: bool = False, exact: bool = False) -> None:
    """``harness.main``'s check before its GPU check: a bad ENV_CASES or ENV_MEM raises
    ValueError naming it."""
    cases_from_env(quick)
    mem_gb_from_env()


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


def build_models(tcfg, dcfg, seed: int = 0, device="cuda", dtype=torch.bfloat16,
                 edit_target=None):
    """(Target, DFlashDrafter) with random weights drawn on the device and 1-block placeholder
    caches (each case installs its own, ``install_caches``); ``edit_target(state)`` may change
    the target's weights (in place) before the model is built."""
    from ..models.drafter import DFlashDrafter
    from ..models.target import Target, expected_target_shapes
    from ..models.weights import expected_shapes

    tiny = dict(max_requests=1, max_len=KV_BLOCK)
    state = _random_state(expected_target_shapes(tcfg)[0], seed, device, dtype)
    if edit_target is not None:
        edit_target(state)
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
                   fill: bool = True, share: int = 1, shared_len: int = 0,
                   shared_slots=None) -> None:
    """Give both models a fresh paged cache: ``slots`` request slots, ``num_blocks`` blocks of
    KV_BLOCK rows, block tables for ``max_len`` positions; ``fill``: every row randn (the K/V a
    prefill would have left: attention reads them, and never zeros). ``share`` > 1: a
    ``SharedContextCache`` whose first ``shared_slots`` slots (default all) share their first
    ``shared_len`` positions' blocks in groups of ``share``."""
    for model, cfg in ((target, target.cfg), (drafter, drafter.cfg)):
        model.cache = None
        gc.collect()
        torch.cuda.empty_cache()
        args = (cfg.num_layers, num_blocks, KV_BLOCK, cfg.num_kv_heads, cfg.head_dim, slots,
                max_len, model.dtype, model.device)
        model.cache = (PagedKVCache(*args) if share == 1 else
                       SharedContextCache(*args, share=share, shared_len=shared_len,
                                          shared_slots=shared_slots))
        if fill:
            for t in model.cache.k + model.cache.v:
                t.normal_()


def release_caches(target, drafter) -> None:
    install_caches(target, drafter, 1, 1, KV_BLOCK, fill=False)


class SharedContextCache(PagedKVCache):
    """A benchmark's paged cache for batches whose K/V does not fit the device: the first
    ``shared_slots`` request slots (default all) share the blocks of their first
    ``shared_len`` positions (whole blocks) in groups of ``share`` (slot r in group
    r % groups); positions past them, and every position of the other slots (the steps'
    scratch), take blocks of the slot's own, as in ``PagedKVCache``. Member k of a group
    (k = r // groups) reads the group's blocks rotated by k * 5/16 of them (at least k), so
    that members streaming their keys at once read blocks far apart. Checked where it is used
    (``bench.policy`` at B 32 x 32k: the Hopper attention splits the keys of 32 x 8 (request,
    head) pairs once, the fallbacks twice): the nearest concurrent reads of one block are
    1/16 of the context apart (2048 positions, ~270 MB streamed between them at share 4; 5/16
    at share 2), so none hits in L2 where its own blocks would not. At more splits (few
    requests, short contexts) members can meet: an offset of 5/16 is a split boundary at 16
    splits, 10/16 one at 8. Every kernel reads the bytes it reads with blocks of its own and
    its time depends on the lengths, not the values; but members overwrite each other's K/V,
    so this is only for benchmarks whose tokens do not depend on the context
    (``bench.policy``: ``fast_prefill`` on the ``counter_target``)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, max_requests: int, max_len: int, dtype: torch.dtype,
                 device=None, *, share: int, shared_len: int, shared_slots=None):
        if share < 1:
            raise ValueError(f"SharedContextCache: share must be >= 1, got {share}")
        if shared_len < 0:
            raise ValueError(f"SharedContextCache: shared_len must be >= 0, got "
                             f"{shared_len}")
        shared_slots = max_requests if shared_slots is None else shared_slots
        if not 0 <= shared_slots <= max_requests:
            raise ValueError(f"SharedContextCache: shared_slots must be in [0, "
                             f"{max_requests}] (max_requests), got {shared_slots}")
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                         max_requests, max_len, dtype, device)
        self.share = share
        self.shared = min(shared_len // block_size, self.max_blocks)
        self.shared_slots = shared_slots
        self.groups = max(1, -(-shared_slots // share))
        self._pool: dict = {}  # group -> its shared blocks
        self._members: dict = {}  # group -> the slots holding them

    @staticmethod
    def num_blocks_for(slots: int, max_len: int, block_size: int, share: int,
                       shared_len: int, extra_len: int = 0) -> int:
        """Blocks for ``slots`` sharing requests of ``max_len`` positions at once, plus
        ``extra_len`` positions of a slot of its own."""
        per = -(-max_len // block_size)
        sh = min(shared_len // block_size, per)
        return -(-slots // share) * sh + slots * (per - sh) + -(-extra_len // block_size)

    def rotation(self, r: int) -> int:
        k = r // self.groups
        return max(k * self.shared * 5 // 16, k) % max(self.shared, 1)

    def _head(self, r: int, n: int) -> int:  # how many of r's n blocks are its group's
        return min(n, self.shared) if r < self.shared_slots else 0

    def add_request(self, r: int, max_len=None) -> None:
        n = self._blocks_of(r, max_len)
        g, head = r % self.groups, self._head(r, n)
        new_group = head > 0 and g not in self._pool
        take = n - head + (self.shared if new_group else 0)
        if take > len(self._free):
            raise RuntimeError(f"SharedContextCache.add_request: {take} blocks needed, "
                               f"{len(self._free)} free")
        if new_group:
            self._pool[g] = [self._free.pop() for _ in range(self.shared)]
            self._members[g] = set()
        own = [self._free.pop() for _ in range(n - head)]
        self._owned[r] = own
        row = own
        if head:
            pool, off = self._pool[g], self.rotation(r)
            self._members[g].add(r)
            row = [pool[(j + off) % self.shared] for j in range(head)] + own
        self._set_row(r, row)

    def free_request(self, r: int) -> None:
        self._free.extend(reversed(self._owned.pop(r)))
        g = r % self.groups
        if r in self._members.get(g, ()):
            self._members[g].discard(r)
            if not self._members[g]:
                self._free.extend(reversed(self._pool.pop(g)))
                del self._members[g]
        self.block_table[r].fill_(self.num_blocks)

    def blocks_needed(self, lengths) -> int:
        need, new = 0, set()
        for r, n in enumerate(lengths):
            b = -(-n // self.block_size)
            head = self._head(r, b)
            need += b - head
            g = r % self.groups
            if head and g not in self._pool and g not in new:
                new.add(g)
                need += self.shared
        return need


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


def host_loop(target, drafter, dstep, vstep, batch: int, context: int, pending: tuple,
              stop_id: int, iters: int, warmup: int = 3, one: bool = True) -> float:
    """Seconds of host wall time per iteration of speculative_generate's own iteration
    (``speculator.step.Iteration``: greedy, time_stages=False, so one host read an iteration).
    ``one``: as the loop runs it with steps="graphs", the whole iteration one graph (captured
    in the warm-up); else staged: the steps as they are (captured: their graphs replay) with
    the loads, the commit and the context rows apart. ``pending``: the first draft step's
    context rows (taps [R * B], requests [R], positions [R, B]). One addition: the starts are
    reset to ``context`` after each iteration (one small kernel), so the caches need no room
    to grow."""
    from ..speculator.step import Iteration, State, sync_device

    dev = target.device
    long = dict(dtype=torch.long, device=dev)
    rows = torch.arange(batch, device=dev)
    # max_new: never finishes (columns past out_tokens' width are not written)
    state = State(out_tokens=torch.zeros(batch, 2 * vstep.b + 1, **long),
                  n_out=torch.zeros(batch, **long), last=torch.zeros(batch, **long),
                  start=torch.full((batch,), context, **long),
                  stop=torch.tensor([stop_id], **long), max_new=1 << 30, pending=pending)
    step = Iteration(target, drafter, vstep.b, steps=(dstep, vstep),
                     graphs=one and torch.device(dev).type == "cuda")
    step.one = step.one and one  # staged: the iteration as it ran before the one graph
    t0 = 0.0
    for it in range(warmup + iters):
        if it == warmup:
            sync_device(dev)
            t0 = time.perf_counter()
        step(state, rows)
        state.start.fill_(context)
    return (time.perf_counter() - t0) / iters


AGREE_MIN = 0.8  # a graph's tokens equal to its eager run's in at least this share of places


def _agree(step: str, got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of ``got``'s tokens equal to ``want``'s (a graph replay against the same step
    run eagerly before capture); below AGREE_MIN the graph is wrong and the case is not timed
    (bf16 near ties between the graph's and the eager backends may differ: rarely, not a
    fifth of the tokens)."""
    share = float((got == want).float().mean())
    if share < AGREE_MIN:
        raise RuntimeError(f"WRONG, not timed: the {step} graph's tokens equal its eager "
                           f"run's in {100 * share:.1f}% of places (< {100 * AGREE_MIN:.0f}%)")
    return share


def measure_case(target, drafter, batch: int, context: int, *, rep_ms: float,
                 loop_ms: float, min_reps: int = 10, exact: bool = False) -> dict:
    """Times (us) of draft, verify, draft+verify, decode and the host loop for one case (and,
    ``exact``, of verify, draft+verify and decode in exact mode)."""
    from ..speculator.draft_step import DraftStep
    from ..speculator.verify_step import VerifyStep

    dev, dcfg = target.device, drafter.cfg
    b = BLOCK
    max_len = context + 2 * b
    per_req = round_up(max_len, KV_BLOCK) // KV_BLOCK  # cache blocks a request
    scratch = round_up(b, KV_BLOCK) // KV_BLOCK        # the steps' scratch slot: one block
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
    checks = {}
    want = dstep.run(bucket)[0].clone()  # eager (not captured yet): the oracle of the graph
    dstep.capture(bucket)
    checks["draft"] = _agree("draft", dstep.run(bucket)[0], want)

    def verify_step(own_scratch=True, key="verify"):  # b random tokens a request at
        #                                               context .. context+b-1
        step = VerifyStep(target, max_batch=batch, block_size=b,
                          tap_layers=dcfg.target_layer_ids, scratch_request=batch, logits=False,
                          own_scratch=own_scratch)
        vb = step.load(torch.randint(0, vocab, (batch, b), generator=g, device=dev), ra, st)
        want = step.run(vb)[1].clone()
        step.capture(vb)
        checks[key] = _agree(key, step.run(vb)[1], want)
        return step, vb

    # plain decode: one token a request at position context
    ids = torch.randint(0, vocab, (batch,), generator=g, device=dev)
    ones = torch.ones(batch, dtype=torch.long, device=dev)

    def decode_graph(key="decode"):  # a greedy decode step: forward + argmax
        def fwd():
            return argmax_last(target.forward(ids, ra, st, ones, None, fp32_logits=False)[0])
        want = fwd().clone()
        graph, got = dispatch.capture_graph(fwd)
        graph.replay()
        checks[key] = _agree(key, got, want)
        return graph

    vstep, vbucket = verify_step()
    dgraph = decode_graph()
    torch.cuda.synchronize()

    out = {"batch": batch, "context": context, "graph = eager tokens": checks}
    timing = dict(rep_ms=rep_ms, min_reps=min_reps)
    out["draft"] = time_replays(lambda: dstep.run(bucket), **timing)
    out["verify"] = time_replays(lambda: vstep.run(vbucket), **timing)
    out["iteration"] = time_replays(lambda: (dstep.run(bucket), vstep.run(vbucket)), **timing)
    out["decode"] = time_replays(dgraph.replay, **timing)
    if exact:  # the same steps in exact mode, captured apart (the graphs bake the kernels in)
        from ..speculator.loop import exact_mode
        with exact_mode(target, True):  # the scratch slot stays vstep's (it times on)
            xstep, xb = verify_step(own_scratch=False, key="verify exact")
            xgraph = decode_graph("decode exact")
        torch.cuda.synchronize()
        out["verify exact"] = time_replays(lambda: xstep.run(xb), **timing)
        out["iteration exact"] = time_replays(lambda: (dstep.run(bucket), xstep.run(xb)),
                                              **timing)
        out["decode exact"] = time_replays(xgraph.replay, **timing)
    graphs_us = out["draft"]["us"] + out["verify"]["us"]
    iters = max(min_reps, min(100, int(loop_ms * 1e3 / max(graphs_us, 1.0))))
    for key, one in (("loop staged", False), ("loop", True)):
        try:
            wall = host_loop(target, drafter, dstep, vstep, batch, context,
                             (taps, ra, ctx_pos.view(batch, b)),
                             stop_id=target.cfg.vocab_size - 1, iters=iters, one=one)
            out[key] = {"wall_us": wall * 1e6, "graphs_us": graphs_us,
                        "idle_us": wall * 1e6 - graphs_us, "iters": iters}
        except Exception as e:  # noqa: BLE001 - a failed host loop is reported, the case goes on
            out[key] = {"error": f"{type(e).__name__}: {str(e).strip()[:160]}"}
    release_caches(target, drafter)  # the graphs' pools go when this returns
    return out


def measure_real_loop(target, drafter, batch: int, prompt_len: int = LOOP_PROMPT,
                      new_tokens: int = LOOP_NEW, seed: int = 0) -> dict:
    """``speculative_generate(steps="graphs", time_stages=False)`` on random prompts: its Stats."""
    from ..speculator.loop import speculative_generate

    max_len = prompt_len + new_tokens + 2 * BLOCK + KV_BLOCK
    per_req = round_up(max_len, KV_BLOCK) // KV_BLOCK
    install_caches(target, drafter, batch + 1, (batch + 1) * per_req, max_len, fill=False)
    try:
        gen = torch.Generator().manual_seed(seed)
        vocab = min(target.cfg.vocab_size, drafter.cfg.mask_token_id)
        prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
                   for _ in range(batch)]
        t0 = time.perf_counter()
        # policy off: this measures the drafting loop itself (the policy would decode here:
        # random weights accept nothing)
        _, st = speculative_generate(target, drafter, prompts, new_tokens, block_size=BLOCK,
                                     steps="graphs", time_stages=False, policy=False)
        total = time.perf_counter() - t0
        loop_s = st.seconds["draft"] + st.seconds["verify"] + st.seconds["accept"]
        it = max(1, st.iterations)
        return {"iterations": st.iterations, "host syncs": st.host_syncs,
                "syncs/iter": st.host_syncs / it, "acceptance": st.mean_acceptance,
                "loop ms/iter": loop_s * 1e3 / it, "prefill s": st.seconds["prefill"],
                "capture s": st.seconds["capture"], "total s": total}
    finally:
        release_caches(target, drafter)


def bench(tcfg, dcfg, cases: Sequence[Tuple[int, int]], *, quick: bool = False,
          mem_gb: float = MEM_GB, real_loop: bool = True, name: str = "e2e",
          seed: int = 0, exact: bool = False) -> Results:
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
                                 min_reps=min_reps, exact=exact)
            except Exception as e:  # noqa: BLE001 - one failed case (OOM...) is reported
                m = None
                first = (str(e).strip().splitlines() or [""])[0]
                entry["note"] = (first[:200] if first.startswith("WRONG, not timed")  # _agree
                                 else f"failed: {type(e).__name__}: {first[:160]}")
            if m is None:  # out of the except block: its frames (graphs, buffers) are gone
                _say(f"{label}: {entry['note']}")
                release_caches(target, drafter)
                continue
            entry["m"] = m
            row = summary_row(b, m["iteration"]["us"], m["decode"]["us"],
                              step_floors(floors, step_costs(tcfg, dcfg, b, s)))
            _say(f"{progress(m, row)} ({time.perf_counter() - t0:.1f} s)")
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


def add_options(p) -> None:
    p.add_argument("--exact", action="store_true",
                   help="also time verify, iteration and decode in exact mode (default: off)")


def run(quick: bool = False, exact: bool = False) -> Results:
    """The suite behind ``dflash-ops bench e2e``: Qwen3-8B shapes, cases from
    DFLASH_OPS_BENCH_E2E_CASES or the defaults, memory budget DFLASH_OPS_BENCH_E2E_MEM_GB,
    DFLASH_OPS_BENCH_E2E_LOOP=0 skips the real-loop table. Writes ``e2e`` (``e2e-quick``,
    ``e2e-<BxS...>`` for restricted runs, so they never overwrite a full run's files;
    ``-exact`` appended with --exact)."""
    require_cuda()
    cases = cases_from_env(quick)
    mem_gb = mem_gb_from_env()
    real_loop = os.environ.get(ENV_LOOP, "").strip() != "0"
    name = "e2e"
    if os.environ.get(ENV_CASES, "").strip():
        name += "-" + "-".join(f"{b}x{s}" for b, s in cases)
    elif quick:
        name += "-quick"
    if exact:
        name += "-exact"
    return bench(qwen3_8b_target_config(), qwen3_8b_dflash_config(), cases, quick=quick,
                 mem_gb=mem_gb, real_loop=real_loop, name=name, exact=exact)
