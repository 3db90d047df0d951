"""``dflash-ops bench policy``: does speculation pay, and does the loop's policy know when?

Issue 18's grid: an oracle drafter whose drafts are right with probability p, at Qwen3-8B shapes
(random bf16 weights: ``bench.e2e``'s target and Qwen3-8B-DFlash-b16 drafter), for p in
``P_GRID`` x batch x context, tokens a second of four strategies on the same prompts:

* ``plain decode``: the target's decode step as one CUDA graph replayed a token (the demo's
  baseline, ``speculator.demo._decode_graphed``), no loop;
* ``never``: our loop decoding only (``policy_blocks=(1,)``: the policy's decode iteration);
* ``always``: our loop drafting a block of 16 every iteration (``policy=False``);
* ``policy``: our loop with the policy (blocks 1 and 16), its per-block iteration counts noted.

The oracle (``OracleDrafter``) runs the real drafter's step, so its cost is the drafter's, then
replaces each draft with the token the target will produce there with probability p (a wrong
token otherwise), each position by a uniform fixed per position (the same for every
strategy): acceptance is geometric in p. The target's tokens the oracle follows are the
``never`` run's output: the target is random except that its greedy next token is the
successor of the last with a wide margin (``counter_target``), so every strategy commits the
same tokens (with random weights alone a 16-row verify and a 1-row decode round differently
in bf16 and part at near ties, and the oracle turns wrong after a part; parts are counted in
the notes). Each rate is the median of REPEATS timed runs; at each p the three loop strategies
run interleaved (never, always, policy; each repeat in a rotated order), so drift between
runs falls on all three alike, and the notes give every run's iteration counts. Tokens a second count the new
tokens over the time after the prefill (the loop's ``Stats.seconds['prefill']``,
synchronised; plain decode's own prefill, synchronised, in each of its runs), capture
excluded. The prefills run only each prompt's last token (``fast_prefill``: the same steps and
tokens after it; ``--real-prefill`` computes every prompt token), so a run at 32 x 8k costs its
decode, not ~7 s of prompt FLOPs. A warm-up run of each strategy first in each case (compiles, autotuning, the
policy's cost table, which it keeps per drafter across calls as a server would); each p is a new workload: the policy forgets the pair's acceptance (keeps
the costs) and gets one warm-up run on it before the timed ones.

Cases: B 1 / 8 / 32 x S 1k / 8k / 32k (``--quick``: 1 x 1k, 8 x 1k, 1 x 8k), or
``DFLASH_OPS_BENCH_POLICY_CASES`` (``BxS`` comma-separated, ``k`` = 1024). A case whose caches do
not fit in memory runs with its requests sharing their prompts' K/V blocks in pairs (up to
``MAX_SHARE``; ``--share N`` forces N): ``e2e.SharedContextCache``, each member reading the
blocks rotated, so every kernel reads the bytes it would read with its own blocks (the values
do not matter here: ``fast_prefill`` on the counter target); the notes say so. B 32 x 32k
needs it on a 141 GB H200 (177 GB of K/V with blocks of their own, 89 GB in pairs; an 80 GB
H100: 45 GB in fours). A case that does not fit even so is skipped with a line saying so. ``DFLASH_OPS_BENCH_POLICY_TRACE=PATH`` appends
every choice of the timed policy runs to PATH (JSON lines: ``_traced``);
``DFLASH_OPS_BENCH_POLICY_PS`` (e.g. ``0,0.2``) runs only those p. A run of chosen cases or p
writes ``policy-<cases>[-p<ps>].{md,json,png}``. The whole grid does not fit one device call
(~68 runs a case, each decoding 128 tokens a request: ~2-4 s a run at 32 x 8k), so
``python -m dflash_ops.bench.policy merge policy-*.json`` joins runs into ``policy.*`` with the
verdict below and the grid points still missing (on any machine).

Target (issue 18): the policy never more than 3% slower than the better of ``always`` and
``never`` (the issue's "always draft" and "never draft") at any grid point, and faster than both
somewhere; the summary also gives the ratio to the better of ``always`` and ``plain decode``
(stricter: the loop's decode iteration also keeps the drafter's context current and reads its
flags every few tokens, which plain decoding does not).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from .harness import Results, measure_floors

P_GRID = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95)
CASES = [(b, s) for s in (1024, 8192, 32768) for b in (1, 8, 32)]
QUICK_CASES = [(1, 1024), (8, 1024), (1, 8192)]
NEW_TOKENS = 128
REPEATS = 3  # timed runs a strategy and point: the median (one run drifted +-5%)
STRATEGIES = ("plain decode", "never", "always", "policy")
TABLE = "tokens a second after the prefill, oracle drafter right with probability p"
SUMMARY = "policy vs the better of always and never drafting (and of always and plain decode)"


class OracleDrafter:
    """A drafter (wrapping ``inner``, a DFlashDrafter: every attribute but ``propose`` is its)
    whose greedy drafts are the target's tokens with probability ``p``: ``reference`` [N, L]
    int64 on the device holds the token the target commits at each absolute position of each
    request slot (``set_reference``), with a fixed uniform per position deciding right or wrong
    (the same for every strategy). Graph-safe: table lookups on the device."""

    def __init__(self, inner, p: float = 0.0):
        self.inner, self.p = inner, float(p)
        self.reference: Optional[torch.Tensor] = None
        self.uniforms: Optional[torch.Tensor] = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def set_reference(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                      slots: int) -> None:
        """The tokens of request r at positions 0.. (its prompt, then its output); other slots
        (the steps' scratch) read row 0."""
        length = max(len(p) + len(o) for p, o in zip(prompts, outputs)) + 1
        ref = torch.zeros(slots, length, dtype=torch.long)
        for r, (p, o) in enumerate(zip(prompts, outputs)):
            ref[r, :len(p) + len(o)] = torch.tensor(list(p) + list(o))
        self.reference = ref.to(self.inner.device)
        # one uniform per (slot, position), drawn once: a draft at a position is right when
        # its uniform is below p, so every strategy meets the same right and wrong positions
        # (independent draws per call made two runs' acceptance differ by ~15% at 64 tokens)
        g = torch.Generator().manual_seed(1234)
        self.uniforms = torch.rand(slots, length, generator=g).to(self.inner.device)

    def propose(self, block_ids, requests, start, logits: bool = True):
        drafts, z = self.inner.propose(block_ids, requests, start, logits=logits)
        ref = self.reference
        pos = start[:, None] + 1 + torch.arange(drafts.shape[1], device=drafts.device)
        rows = requests.clamp(0, ref.shape[0] - 1)[:, None]
        cols = pos.clamp(0, ref.shape[1] - 1)
        want = ref[rows, cols]
        hit = self.uniforms[rows, cols] < self.p
        wrong = (want + 1) % self.inner.cfg.vocab_size
        return torch.where(hit, want, wrong), z


def counter_target(state: dict, successor_of: int, seed: int = 7, residual: float = 1e-3) -> None:
    """Make a random-weight target's greedy next token ``t + 1`` (mod ``successor_of``) with a
    wide margin, in place, keeping every shape (so every cost) of the random model: embedding
    rows e_t ~ N(0, 1/H), LM head row of t + 1 = 16 e_t, the layers' output projections
    (o_proj, down_proj) scaled by ``residual`` so the hidden state stays near e_t: after the
    final norm the logit of t + 1 is ~16 sqrt(H) (1024 at H 4096), the others ~N(0, 16^2)
    (their largest of 150k ~80). Tokens >= successor_of keep random rows and never follow.
    With the margin no rounding difference between a 16-row verify and a 1-row decode flips a
    token (random weights' flat logits part them at near ties, after which an oracle that
    follows one strategy's tokens is wrong for another's), so every strategy commits the same
    tokens and the oracle's right-with-probability-p holds for all of them."""
    emb, head = state["model.embed_tokens.weight"], state.get("lm_head.weight")
    if head is None:
        raise ValueError("counter_target: needs an untied LM head (lm_head.weight)")
    v, h = emb.shape
    m = int(successor_of)
    g = torch.Generator(device=emb.device).manual_seed(seed)
    e = torch.randn(m, h, generator=g, device=emb.device) * h ** -0.5
    emb[:m].copy_(e)
    nxt = (torch.arange(m, device=emb.device) + 1) % m
    head[:m].zero_()
    head[nxt] = (16.0 * e).to(head.dtype)
    for name, t in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.mul_(residual)


ENV_TRACE = "DFLASH_OPS_BENCH_POLICY_TRACE"  # a path: the policy's choices, JSON lines


@contextlib.contextmanager
def _traced(path: Optional[str], **tag):
    """With ``path``: every ``Policy.choose`` inside the block appended to it as a JSON line
    (``tag``, the choice, whether it was a probe, the batch bucket, the longest request, the
    tokens left (min / max), each option's estimated tokens a second, each request's
    acceptance estimate, the consecutive decode iterations before it) with the iteration's
    measured seconds from the ``observe`` after it (absent for a cut decode iteration, which
    the loop does not observe). Without: nothing is patched."""
    if not path:
        yield
        return
    from ..speculator import policy as pm
    choose, observe, rows = pm.Policy.choose, pm.Policy.observe, []

    def traced_choose(self, requests, bucket, longest, left=None):
        decoding = self._decoding
        b = choose(self, requests, bucket, longest, left)
        rates = self.rates(requests, bucket, pm.context_bucket(longest), left)
        rows.append(dict(tag, choice=b, probe=b != self._last, bucket=bucket, longest=longest,
                         left=[min(left), max(left)] if left else None, decoding=decoding,
                         rates={k: round(v, 1) for k, v in rates.items()},
                         estimate=[round(self.rate(r), 3) for r in requests]))
        return b

    def traced_observe(self, b, bucket, longest, seconds, *args, **kw):
        if rows:
            rows[-1]["seconds"] = round(seconds, 6)
        return observe(self, b, bucket, longest, seconds, *args, **kw)

    pm.Policy.choose, pm.Policy.observe = traced_choose, traced_observe
    try:
        yield
    finally:
        pm.Policy.choose, pm.Policy.observe = choose, observe
        with open(path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


@contextlib.contextmanager
def fast_prefill(target):
    """Within the block, a prefill (a ``target.forward`` call with ``logit_rows``: the loop's and
    plain decode's) runs only each prompt's last token, at its position, over the K/V already
    in the cache (zeros, or an earlier run's); its taps are zeros but for those rows. The
    decode, draft and verify steps that follow are the same kernels over the same lengths,
    whose time does not depend on the cached values, and the counter target's next token is
    the last token's successor whatever the context holds (``counter_target``'s margin), so
    the tokens are those of a real prefill. Tokens a second leave the prefill out either way;
    this only spares the device the prompts' FLOPs (at 32 x 8k ~7 s a run, ~68 runs a case)."""
    inner = target.forward

    def forward(ids, requests, starts, q_lens, tap_layers=None, fp32_logits=True,
                logit_rows=None):
        if logit_rows is None:  # a step (eager or under capture): untouched
            return inner(ids, requests, starts, q_lens, tap_layers, fp32_logits)
        rows = target._as_index(logit_rows)
        q = target._as_index(q_lens)
        logits, taps = inner(ids.reshape(-1)[rows], requests, target._as_index(starts) + q - 1,
                             torch.ones_like(q), tap_layers, fp32_logits)
        if taps is not None:
            full = taps.new_zeros(ids.numel(), taps.shape[-1])
            full[rows] = taps
            taps = full
        return logits, taps

    prev = vars(target).get("forward")
    target.forward = forward
    try:
        yield
    finally:
        if prev is None:
            del target.forward  # the class's method again
        else:
            target.forward = prev


def _say(text: str) -> None:
    print(f"[policy] {text}", file=sys.stderr, flush=True)


def _loop_rate(target, drafter, prompts, n_new, **kw) -> tuple:
    """(outputs, tokens a second after the prefill, Stats) of one speculative_generate run."""
    from ..speculator.loop import speculative_generate
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, st = speculative_generate(target, drafter, prompts, n_new, time_stages=False, **kw)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0 - st.seconds["capture"] - st.seconds["prefill"]
    new = sum(len(o) for o in out)
    return out, new / wall, st, st.seconds["prefill"]


def plain_rates(target, prompts, n_new: int, repeats: int = REPEATS) -> tuple:
    """(tokens, [tokens a second] of ``repeats`` runs): plain graphed decoding
    (``speculator.demo._decode_graphed``) after a warm-up run, each run's own prefill left out
    (not the loop's, which also adds the drafter's context for every prompt row: ~0.1 s at
    32 x 8k)."""
    from ..speculator.demo import _decode_graphed
    _decode_graphed(target, prompts, n_new)  # warm-up
    out, rates = None, []
    for _ in range(repeats):
        tm = {}
        out, s = _decode_graphed(target, prompts, n_new, timings=tm)
        rates.append(len(prompts) * n_new / max(1e-9, s - tm["prefill"]))
    return out, rates


def case_cache(batch: int, context: int, n_new: int = NEW_TOKENS, share: int = 1) -> tuple:
    """(max_len, num_blocks) of a case's caches: room for the prompt, the new tokens and two
    blocks of 16 a request, for ``batch`` requests, and SCRATCH_LEN positions for the steps'
    scratch slot (slot ``batch``); ``share`` > 1: the requests' prompt blocks shared in groups
    of ``share`` (``e2e.SharedContextCache``)."""
    from .e2e import KV_BLOCK, SharedContextCache, round_up
    max_len = round_up(context + n_new + 2 * 16 + 2, KV_BLOCK)
    return max_len, SharedContextCache.num_blocks_for(batch, max_len, KV_BLOCK, share, context,
                                                      extra_len=SCRATCH_LEN)


def run_case(res: Results, target, drafter, batch: int, context: int, ps=P_GRID,
             n_new: int = NEW_TOKENS, seed: int = 0, repeats: int = REPEATS,
             real_prefill: bool = False) -> None:
    """One (batch, context) case of the grid over ``ps``: rates in ``TABLE``, ratios in
    ``SUMMARY``; the prefills under ``fast_prefill`` unless ``real_prefill``."""
    with contextlib.nullcontext() if real_prefill else fast_prefill(target):
        _run_case(res, target, drafter, batch, context, ps, n_new, seed, repeats)


def _run_case(res, target, drafter, batch, context, ps, n_new, seed, repeats):
    label = f"B={batch} S={context}"
    g = torch.Generator().manual_seed(seed)
    vocab = min(target.cfg.vocab_size, drafter.cfg.mask_token_id)
    prompts = [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]
    oracle = OracleDrafter(drafter)
    # never: the reference tokens (and its warm-up run compiles the decode path)
    _loop_rate(target, oracle, prompts, n_new, policy_blocks=(1,))
    runs = [_loop_rate(target, oracle, prompts, n_new, policy_blocks=(1,))
            for _ in range(repeats)]
    want = runs[0][0]
    plain_out, plains = plain_rates(target, prompts, n_new, repeats)
    plain = statistics.median(plains)
    if plain_out != want:
        _say(f"{label}: plain decode and the loop's tokens differ")
    from ..speculator.loop import policy_memory
    oracle.set_reference(prompts, want, drafter.cache.block_table.shape[0])
    # per p the three loop strategies are timed interleaved, each repeat in a rotated order
    # (never, always and policy timed in separate batches, and never once a case, left a ~1%
    # gap where the policy chose exactly what always did: drift between batches, session 23)
    loops = (("never", dict(policy_blocks=(1,))), ("always", dict(policy=False)),
             ("policy", {}))
    for i, p in enumerate(ps):
        oracle.p = p
        for mem in policy_memory(oracle).values():  # a new workload: keep only the costs
            mem.forget_acceptance()
        for name, kw in loops[1:]:
            if i == 0 or name == "policy":  # warm-up: compiles and captures (first p); the
                _loop_rate(target, oracle, prompts, n_new, **kw)  # policy learns this p
        runs = {name: [] for name, _ in loops}
        trace = os.environ.get(ENV_TRACE, "").strip() or None
        for k in range(repeats):
            for name, kw in loops[k % len(loops):] + loops[:k % len(loops)]:
                with _traced(trace if name == "policy" else None, case=label, p=p, run=k):
                    runs[name].append(_loop_rate(target, oracle, prompts, n_new, **kw))
        rates = {"plain decode": plain}
        notes = {}
        for name, _ in loops:
            rates[name] = statistics.median(r[1] for r in runs[name])
            # the counter target's margin: every strategy commits never's first tokens (a
            # request that parts would make the oracle wrong for it from there: counted)
            differ = sum(sum(a != b for a, b in zip(r[0], want)) for r in runs[name])
            st = runs[name][0][2]
            counts = " | ".join(", ".join(f"{'decode' if b == 1 else f'block {b}'} {c}"
                                          for b, c in sorted(r[2].blocks.items(), reverse=True))
                                for r in runs[name])
            notes[name] = ((f"{differ} outputs of {repeats} x {batch} differ from never's; "
                            if differ else "")
                           + (f"acceptance {st.mean_acceptance:.2f}; " if name != "never" else "")
                           + f"runs: {counts}")
        for name in STRATEGIES:
            res.add(TABLE, case=label, p=p, strategy=name, tokens_per_s=rates[name],
                    x=p, note=notes.get(name, ""))
        best = max(rates["always"], rates["never"])
        strict = max(rates["always"], rates["plain decode"])
        res.add(SUMMARY, case=label, p=p, policy=rates["policy"], always=rates["always"],
                never=rates["never"], plain=rates["plain decode"],
                **{"policy / max(always, never)": rates["policy"] / best,
                   "ok (>= 0.97)": rates["policy"] >= 0.97 * best,
                   "policy / max(always, plain)": rates["policy"] / strict})
        _say(f"{label} p={p}: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items())
             + f" tok/s; policy {notes['policy']}")


RATIO = "policy / max(always, never)"


def verdict(rows: Sequence[dict], grid=None) -> list:
    """Lines judging the summary rows against issue 18's bar (>= 0.97 of the better of always
    and never at every point, faster than both somewhere), and the grid points (``grid``:
    (B, S) cases x P_GRID) not among them."""
    pts = [r for r in rows if r.get("table") == SUMMARY and r.get(RATIO) is not None]
    if not pts:
        return []
    where = lambda r: f"{r['case']} p={r['p']}"  # noqa: E731
    worst = min(pts, key=lambda r: r[RATIO])
    best = max(pts, key=lambda r: r[RATIO])
    ok = sum(r[RATIO] >= 0.97 for r in pts)
    wins = [r for r in pts if r[RATIO] > 1.0]
    out = [f"verdict: the policy is >= 0.97 x the better of always and never at {ok} of "
           f"{len(pts)} points (worst {worst[RATIO]:.3f} at {where(worst)}); faster than both "
           f"at {len(wins)} (best {best[RATIO]:.3f} at {where(best)})"]
    if grid is not None:
        have = {(r["case"], r["p"]) for r in pts}
        gaps, n = [], 0
        for b, s in grid:
            ps = [p for p in P_GRID if (f"B={b} S={s}", p) not in have]
            n += len(ps)
            if ps:
                gaps.append(f"B={b} S={s}" + ("" if len(ps) == len(P_GRID) else
                                              " p=" + "/".join(map(str, ps))))
        if gaps:
            out.append(f"verdict: {n} of {len(grid) * len(P_GRID)} grid points not measured: "
                       + ", ".join(gaps))
    return out


def merge(paths: Sequence[str], out_dir=None, make_plot: bool = True) -> Results:
    """``python -m dflash_ops.bench.policy merge A.json B.json ...``: the grid measured over
    several device calls (one process a call: DFLASH_OPS_BENCH_POLICY_CASES) as one table,
    summary, verdict and figure, written as ``policy.{md,json,png}`` (a later file's row of a
    point replaces an earlier one's). Each source's date, GPU, commit and floors go into the
    notes; the header is the first file's. Runs on the CPU."""
    docs = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"policy merge: cannot read {path}: {e}") from None
        if not str(doc.get("name", "")).startswith("policy") or "rows" not in doc:
            raise ValueError(f"policy merge: {path} is not a policy suite's JSON "
                             f"(name {doc.get('name')!r})")
        docs.append((path, doc))
    if not docs:
        raise ValueError("policy merge: no files given")
    head = docs[0][1]
    meta = {k: v for k, v in head.items() if k not in ("name", "floors", "notes", "rows")}
    res = Results("policy", floors=head.get("floors"), meta=meta, xlabel="p (draft right)")
    rows: dict = {}
    for path, doc in docs:
        for r in doc["rows"]:
            rows[(r.get("table"), r.get("case"), r.get("p"), r.get("strategy"))] = r
        fl = doc.get("floors") or {}
        cases = list(dict.fromkeys(r.get("case") for r in doc["rows"]))
        res.notes.append(f"from {Path(path).name}: {doc.get('date')} {doc.get('gpu')} commit "
                         f"{doc.get('commit')}, copy {fl.get('copy_GBps')} GB/s; cases "
                         + ", ".join(map(str, cases)))
    order = {t: i for i, t in enumerate((TABLE, SUMMARY))}
    # cases in (batch, context) order whatever order the files came in (a stable sort keeps
    # each case's rows as they were)
    res.rows = sorted(rows.values(), key=lambda r: (order.get(r.get("table"), 2),
                                                    _case_key(r.get("case"))))
    notes = [n for _, d in docs for n in d.get("notes", []) if not n.startswith("verdict:")]
    res.notes += list(dict.fromkeys(notes))
    res.notes += verdict(res.rows, CASES)
    res.plot = lambda path: plot(res, path)
    res.write(out_dir, plot=make_plot)
    return res


def _case_key(case) -> tuple:
    """"B=8 S=1024" -> (8, 1024); a case of another form sorts after them, by its text."""
    m = re.fullmatch(r"B=(\d+) S=(\d+)", str(case))
    return (0, int(m[1]), int(m[2]), "") if m else (1, 0, 0, str(case))


def plot(res: Results, path) -> Optional[str]:
    """Tokens a second vs p, one panel a case (three a row), one line a strategy."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = res.tables().get(TABLE, [])
    cases = list(dict.fromkeys(r["case"] for r in rows))
    if not cases:
        return None
    ncol = min(3, len(cases))
    nrow = -(-len(cases) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.5 * ncol, 4 * nrow), squeeze=False)
    for ax in axes.flat[len(cases):]:
        ax.set_visible(False)
    for ax, case in zip(axes.flat, cases):
        for name in STRATEGIES:
            pts = sorted((r["p"], r["tokens_per_s"]) for r in rows
                         if r["case"] == case and r["strategy"] == name)
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(xlabel="p (draft right)", ylabel="tokens / s", title=case)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return res._save_figure(fig, path)


# Bytes a case needs beside its caches (the steps' graphs and logits, the prefill's forwards of
# loop.PREFILL_TOKENS tokens: ~2.5 GB at Qwen3-8B's width) before it is tried at all; a case that
# passes this and still runs out of memory is caught and reported. Each case that runs prints
# and notes its peak (session 34, H100: the 16 GiB this was could not be justified, and it
# skipped 8 x 32k with 65 GB free for 50 GB of caches).
HEADROOM = 4 << 30
ENV_CASES = "DFLASH_OPS_BENCH_POLICY_CASES"  # e.g. "32x1k,8x32k": replaces the cases
ENV_PS = "DFLASH_OPS_BENCH_POLICY_PS"  # e.g. "0,0.2": a part of P_GRID (a case's part a call)
# a case whose caches do not fit shares its prompts' blocks in groups of up to this many
# requests (``--share``): 32 x 32k's K/V (target + drafter) is 177 GB with blocks of their own,
# 89 GB in pairs, 45 GB in fours
MAX_SHARE = 4
SCRATCH_LEN = 2 * 16  # the steps' scratch slot: a block of the largest draft (16), twice


def parse_ps(text: str) -> tuple:
    """``ENV_PS``'s value: comma-separated members of P_GRID, returned in P_GRID's order."""
    try:
        want = {float(x) for x in text.split(",") if x.strip()}
    except ValueError:
        want = None
    if not want or not want <= set(P_GRID):
        raise ValueError(f"{ENV_PS}: {text!r} is not a comma-separated subset of {P_GRID}")
    return tuple(p for p in P_GRID if p in want)


def add_options(p) -> None:
    p.add_argument("--real-prefill", action="store_true",
                   help="compute every prompt token's K/V in each run's prefill (default: only "
                        "the last token's, see fast_prefill; tokens a second exclude the "
                        "prefill either way)")
    from ..cli import int_in
    p.add_argument("--share", type=int_in(0, MAX_SHARE, " (0: the smallest that fits)"),
                   default=0, metavar="N",
                   help=f"requests share their prompts' K/V blocks in groups of N (1 to "
                        f"{MAX_SHARE}; e2e.SharedContextCache: the same bytes read, a fraction "
                        f"of the memory; meant for long contexts at batch >= 8, where the "
                        f"attention splits the keys at most twice); 0 (default): the smallest "
                        f"that fits. A forced N writes its own files (-shareN): a check "
                        f"against a run with blocks of their own, not a part of the grid")


def choose_share(need_of, free: int, forced: int = 0) -> int:
    """The smallest share in 1..MAX_SHARE (only ``forced`` if > 0) whose caches
    (``need_of(share)`` bytes) leave HEADROOM of ``free``, else 0 (the case does not fit)."""
    return next((k for k in ((forced,) if forced > 0 else range(1, MAX_SHARE + 1))
                 if need_of(k) + HEADROOM <= free), 0)


def check_options(quick: bool = False, cases=None, real_prefill: bool = False,
                  share: int = 0) -> tuple:
    """(cases, ps): ``cases`` or ``ENV_CASES``'s, and ``ENV_PS``'s p (default P_GRID); a bad
    variable or ``share`` raises ValueError naming it. ``harness.main`` calls it before its
    GPU check, ``run`` before its own."""
    from .e2e import parse_cases
    env = os.environ.get(ENV_CASES, "").strip()
    if env and cases is None:
        cases = parse_cases(env, ENV_CASES)
    if not 0 <= share <= MAX_SHARE:
        raise ValueError(f"policy suite: --share must be in [0, {MAX_SHARE}] (0: the smallest "
                         f"that fits), got {share}")
    env_ps = os.environ.get(ENV_PS, "").strip()
    return cases, (parse_ps(env_ps) if env_ps else P_GRID)


def run(quick: bool = False, cases=None, real_prefill: bool = False, share: int = 0) -> Results:
    from .e2e import (KV_BLOCK, build_models, install_caches, qwen3_8b_dflash_config,
                      qwen3_8b_target_config, release_caches)
    cases, ps = check_options(quick, cases, real_prefill, share)  # before the GPU check
    if not torch.cuda.is_available():
        raise RuntimeError("policy suite: needs a CUDA GPU; nothing was run.")
    grid = cases or (QUICK_CASES if quick else CASES)
    # a run of some cases names them (policy-1x1k-8x8k), so it never overwrites the full grid's
    # files; merge() joins such runs
    name = ("policy-quick" if quick and not cases else "policy" if not cases else
            "policy-" + "-".join(f"{b}x{s // 1024}k" if s % 1024 == 0 else f"{b}x{s}"
                                 for b, s in grid))
    if ps != P_GRID:
        name += "-p" + "-".join(f"{p:g}" for p in ps)
    if share > 0:  # forced: its own files, beside the run that shares only where it must
        name += f"-share{share}"
    res = Results(name, floors=measure_floors(), xlabel="p (draft right)")
    dcfg = qwen3_8b_dflash_config()
    target, drafter = build_models(
        qwen3_8b_target_config(), dcfg,
        edit_target=lambda st: counter_target(st, successor_of=dcfg.mask_token_id))
    def need_of(b, s, k):  # bytes of both caches of case (b, s) at share k
        blocks = case_cache(b, s, share=k)[1]
        return sum(2 * c.num_layers * blocks * KV_BLOCK * c.num_kv_heads * c.head_dim * 2
                   for c in (target.cfg, drafter.cfg))

    for b, s in grid:
        release_caches(target, drafter)
        free = torch.cuda.mem_get_info()[0]
        k = choose_share(lambda k: need_of(b, s, k), free, share)
        if k == 0:  # skipped before allocating
            most = share or MAX_SHARE
            need = need_of(b, s, most)
            _say(f"B={b} S={s}: skipped, the caches need {need / 1e9:.0f} GB (prompts' "
                 f"blocks shared by {most}) + {HEADROOM / 1e9:.0f} GB for the steps, "
                 f"{free / 1e9:.0f} GB free")
            res.notes.append(f"B={b} S={s} not run: its K/V caches need {need / 1e9:.0f} GB "
                             f"(shared by {most}), {free / 1e9:.0f} GB free")
            continue
        max_len, blocks = case_cache(b, s, share=k)
        need = need_of(b, s, k)
        try:
            base = torch.cuda.memory_allocated()  # the weights (and what else stays)
            torch.cuda.reset_peak_memory_stats()
            install_caches(target, drafter, b + 1, blocks, max_len, fill=False, share=k,
                           shared_len=s, shared_slots=b)
            if k > 1:
                msg = (f"B={b} S={s}: requests share their prompts' K/V blocks in groups of "
                       f"{k} (e2e.SharedContextCache, each reading them rotated: the same "
                       f"bytes read, {need / 1e9:.0f} GB of caches instead of "
                       f"{need_of(b, s, 1) / 1e9:.0f})")
                _say(msg)
                res.notes.append(msg)
            run_case(res, target, drafter, b, s, ps=ps, real_prefill=real_prefill)
            rest = torch.cuda.max_memory_allocated() - base - need
            _say(f"B={b} S={s}: peak memory {(base + need + rest) / 1e9:.1f} GB = weights "
                 f"{base / 1e9:.1f} + caches {need / 1e9:.1f} + steps and prefill {rest / 1e9:.1f}")
            res.notes.append(f"B={b} S={s}: peak memory beside weights and caches "
                             f"{rest / 1e9:.1f} GB (steps' graphs, logits, prefill)")
        except torch.cuda.OutOfMemoryError as e:
            _say(f"B={b} S={s}: out of memory, skipped ({str(e).splitlines()[0][:120]})")
        finally:
            release_caches(target, drafter)
    res.notes += [
        "oracle drafter: the real drafter's step, its drafts then replaced by the target's "
        "token with probability p (else a wrong one), independently per position",
        "tokens a second: new tokens / (wall time - prefill - graph capture), after one warm-up "
        "run of each strategy; plain decode subtracts its own prefill, timed in each run (until "
        "session 34 it subtracted the loop's, which also adds the drafter's context for every "
        "prompt row: plain decode read ~4-7% fast at batch 8 and 32)",
        f"{NEW_TOKENS} new tokens a request, random prompts, Qwen3-8B target and "
        "Qwen3-8B-DFlash-b16 drafter shapes, random bf16 weights, block 16",
        "prefill: every prompt token computed" if real_prefill else
        "prefill: only each prompt's last token computed, over zero K/V for the rest "
        "(fast_prefill: the steps timed after it and the tokens are the same; --real-prefill "
        "computes them all)",
    ]
    res.notes += verdict(res.rows)
    res.plot = lambda path: plot(res, path)  # the suite's own figure
    return res


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m dflash_ops.bench.policy",
                                 description="Join policy suite runs (JSON) into one table, "
                                             "verdict and figure (policy.{md,json,png}).")
    ap.add_argument("command", choices=["merge"])
    ap.add_argument("files", nargs="+", help="policy*.json files of `dflash-ops bench policy`")
    ap.add_argument("--out", default=None, help="directory (default ./benchmarks/results)")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    try:
        res = merge(a.files, a.out, make_plot=not a.no_plot)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(res.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
