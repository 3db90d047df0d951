"""Costs and report of the end-to-end suite (``bench.e2e``): the floors' byte and FLOP counts,
the memory estimate, the implied speedup, the tables and the plot.

Formulas (bf16, 2 bytes an element; H = 4096, L layers, Hq / Hkv heads of D, I = 12288,
V = 151936, b = 16, T = 5 taps of Ht = 4096; ``target_step_cost``, ``drafter_step_cost``):
* verify / decode bytes (n = 16 / 1 new tokens a request) = 2 * [ L*((Hq + 2Hkv)*D*H + H*Hq*D
  + 3*I*H + 2H + 2D) + H (layers, norms) + V*H (LM head) + B*S*L*2*Hkv*D (K/V of the S cached
  keys read) + B*n*L*2*Hkv*D (new K/V written) + B*n*H (embedding rows) + B*n*T*H (verify: taps
  out) ]; FLOPs = 2*B*n*(L*((Hq + 2Hkv)*D*H + H*Hq*D + 3*I*H) + V*H) + 4*B*L*Hq*D*(n*S +
  n(n+1)/2) (causal attention).
* draft bytes = 2 * [ H*T*Ht (fc) + 2H + L*((Hq + 2Hkv)*D*H + H*Hq*D + 3*I*H + 2H + 2D)
  + V*H (LM head; each weight once: our stacked k/v copy is not counted) + B*S*L*2*Hkv*D
  (context K/V read) + B*b*L*2*Hkv*D (new context K/V written) + B*b*H + B*b*T*Ht (block
  embeddings, taps in) ]; FLOPs = 2*B*b*(H*T*Ht + L*2*Hkv*D*H) + 2*B*b*L*((Hq + 2Hkv)*D*H +
  H*Hq*D + 3*I*H) + 4*B*b*L*Hq*D*(S + b) + 2*B*(b-1)*V*H (the drafter suite's formula).
* floor(step) = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate), both from
  ``measure_floors`` in this run; iteration floor = floor(draft) + floor(verify). At B 1 the bytes
  dominate (verify 15.3 GB at S 1024: ~3.6 ms at 4.27 TB/s; draft 3.4 GB: ~0.8 ms); at B >= ~16
  the verify's FLOPs do (16 x 16.4 GFLOP a request).
* ratios: iteration / (draft floor + verify floor), target <= 1.1 at B 1; decode / decode floor,
  target <= 1.1.
* serial floor(step) = max(K/V bytes / copy, attention FLOPs / GEMM rate) + max(the other bytes /
  copy, the other FLOPs / GEMM rate): the floor of a forward whose attention and GEMMs run one
  after the other, as they do layer by layer. It equals the floor where the same resource
  (bytes or FLOPs) limits both parts and exceeds it otherwise (B 32 x S 8k: the verify's
  38.7 GB of K/V and 7.8 TFLOP of GEMMs, ~1.35x the floor); the summary gives iteration /
  serial floor beside it.
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
"""
from __future__ import annotations

from typing import Optional, Tuple

from .harness import Results, floor_us

BLOCK = 16                 # DFlash block (draft tokens + 1)
KV_BLOCK = 16              # rows of a paged KV cache block
TAU_PUBLISHED = 6.55       # Qwen3-8B-DFlash-b16, GSM8K, temperature 0
PAPER_SPEEDUP = 5.2        # the paper's speedup at that tau (B200, batch 1)
TAU_ORACLE = float(BLOCK)  # every draft accepted
TARGET_RATIO = 1.1         # the bound on iteration / floor (B 1) and decode / floor
MEM_GB = 120.0             # default memory budget of a case
LOOP_PROMPT, LOOP_NEW = 32, 32  # the real loop's prompt and new tokens a request


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
    cost["attn_flops"] = 4 * batch * L * cfg.num_heads * cfg.head_dim * keys
    cost["flops"] = 2 * t * (L * mats + V * H) + cost["attn_flops"]
    return cost


def drafter_step_cost(cfg, batch: int, context: int, block: int = BLOCK,
                      new: Optional[int] = None, elt: int = 2) -> dict:
    """Bytes (by part) and FLOPs of one draft step: the context K/V of ``new`` committed rows a
    request (default a whole block) at positions context-new .. context-1, then the block at
    context .. context+block-1 over the ``context`` cached keys, the LM head on block-1 rows.

    weights: fc, the layers, the final norm and hidden_norm, each weight once (our drafter
    also reads a stacked copy of the k/v weights for the context, not counted: a floor);
    lm_head: V*H (the target's);
    kv_read: the cached context K/V; kv_write: the new context K/V; other: block embedding rows +
    tap hidden states in. Not counted: the block's own K/V (on chip in a minimal step), logits."""
    new = block if new is None else new
    H, L, D = cfg.hidden_size, cfg.num_layers, cfg.head_dim
    T, Ht, V = cfg.n_taps, cfg.target_hidden_size, cfg.out_vocab_size
    mats, vecs = _layer_params(H, cfg.num_heads, cfg.num_kv_heads, D, cfg.intermediate_size,
                               True, cfg.attention_bias)
    kv_row = L * 2 * cfg.num_kv_heads * D
    cost = {"weights": elt * (H * T * Ht + 2 * H + L * (mats + vecs)),
            "lm_head": elt * V * H,
            "kv_read": elt * batch * context * kv_row,
            "kv_write": elt * batch * new * kv_row,
            "other": elt * (batch * block * H + batch * new * T * Ht)}
    cost["bytes"] = sum(cost.values())
    cost["attn_flops"] = 4 * batch * block * L * cfg.num_heads * D * (context + block)
    cost["flops"] = (2 * batch * new * (H * T * Ht + kv_row * H)
                     + 2 * batch * block * L * mats + cost["attn_flops"]
                     + 2 * batch * (block - 1) * V * H)
    return cost


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def case_memory_bytes(tcfg, dcfg, batch: int, context: int, block: int = BLOCK,
                      elt: int = 2) -> dict:
    """Device memory a case needs (estimate): both models' weights, both paged caches (B
    requests of context + 2 blocks positions, rounded up to cache blocks, + one block for the
    scratch slot), and activations (two [B*block, V] logits in fp32 + bf16, + 2 GiB)."""
    tokens = batch * round_up(context + 2 * block, KV_BLOCK) + round_up(block, KV_BLOCK)
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
    "hidden), median (>= 10 replays, ~300 ms; --quick >= 5, ~100 ms); checked first: each "
    "graph's tokens (draft, verify, decode argmax) against the same step run eagerly before "
    "capture, a case whose graph agrees in < 80% of places is 'WRONG, not timed' (bf16 near "
    "ties between backends may differ)",
    "floor(step) = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate) of this run; bytes = "
    "weights + LM head + K/V of the S cached keys read + new K/V written + embedding rows and "
    "taps (table 'floor terms'); x floor = time / floor; iteration floor = draft floor + "
    "verify floor; the targets: iteration <= 1.1x its floor at B 1, decode <= 1.1x",
    "serial floor(step) = max(K/V bytes / copy, attention FLOPs / GEMM rate) + max(other bytes "
    "/ copy, other FLOPs / GEMM rate): attention and GEMMs one after the other, as a forward "
    "runs them (the floor's max() assumes they overlap); iter/serial = iteration / (draft + "
    "verify serial floors)",
    "verify / decode bytes = 2*[L*((Hq+2Hkv)*D*H + H*Hq*D + 3*I*H + 2H + 2D) + H + V*H + "
    "B*S*L*2*Hkv*D + B*n*L*2*Hkv*D + B*n*H (+ B*n*5*H taps out, verify)], n = 16 / 1; FLOPs = "
    "2*B*n*(L*((Hq+2Hkv)*D*H + H*Hq*D + 3*I*H) + V*H) + 4*B*L*Hq*D*(n*S + n(n+1)/2)",
    "draft bytes = 2*[H*5*Ht + 2H + L*((Hq+2Hkv)*D*H + H*Hq*D + 3*I*H + 2H + 2D) + "
    "V*H + B*S*L*2*Hkv*D + B*16*L*2*Hkv*D + B*16*H "
    "+ B*16*5*Ht]; FLOPs = 2*B*16*(H*5*Ht + L*2*Hkv*D*H) + 2*B*16*L*((Hq+2Hkv)*D*H + H*Hq*D + "
    "3*I*H) + 4*B*16*L*Hq*D*(S+16) + 2*B*15*V*H",
    f"implied speedup(tau) = tau * t_decode / t_iteration at tau {TAU_PUBLISHED} (GSM8K, "
    f"published for Qwen3-8B-DFlash-b16; the paper's speedup there: {PAPER_SPEEDUP}x, B200, "
    f"batch 1) and tau {TAU_ORACLE:g} (oracle: all 15 drafts + the bonus accepted)",
    "host loop: speculative_generate's own iteration (speculator.step.Iteration: steps='graphs', "
    "greedy, time_stages=False): 'one graph' = loads, draft, verify, greedy_commit, the context "
    "rows and the flags in one graph, then one .tolist() sync; 'staged' = the same with the two "
    "step graphs replayed apart and the loads and the commit launched eagerly (before issue 19's "
    "one graph); repeated, starts reset to S each time; wall = host clock per iteration to the "
    "last sync; GPU idle = wall - (draft + verify graph times): host gaps plus the loop's small "
    "kernels; syncs/iter = 1 by construction",
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


def serial_floor_us(floors: dict, cost: dict) -> float:
    """The floor of a step whose attention and GEMMs run one after the other (as a forward
    does, layer by layer): max(K/V bytes / copy, attention FLOPs / GEMM rate) + max(the other
    bytes / copy, the other FLOPs / GEMM rate). Equal to the floor where the same resource
    limits both parts; above it where the K/V stream and the GEMMs' FLOPs are both large
    (batch 32 x 8k: the verify's 38.7 GB of K/V and its 7.8 TFLOP of GEMMs), since the
    floor's max() assumes they overlap."""
    kv = cost["kv_read"] + cost["kv_write"]
    return (floor_us(floors, kv, cost["attn_flops"])
            + floor_us(floors, cost["bytes"] - kv, cost["flops"] - cost["attn_flops"]))


def step_serial_floors(floors: dict, costs: dict) -> dict:
    """us per step: serial_floor_us; 'draft+verify' = their sum."""
    fl = {k: serial_floor_us(floors, c) for k, c in costs.items()}
    fl["draft+verify"] = fl["draft"] + fl["verify"]
    return fl


def summary_row(batch: int, t_iteration: float, t_decode: float, fl: dict,
                serial: Optional[dict] = None) -> dict:
    """The summary table's fields from the iteration and decode times and the floors (us);
    ``serial``: step_serial_floors, for the iteration's ratio to its serial floor."""
    r_it, r_dec = t_iteration / fl["draft+verify"], t_decode / fl["decode"]
    extra = {} if serial is None else {
        "iter serial floor ms": _ms(serial["draft+verify"]),
        "iter/serial": t_iteration / serial["draft+verify"]}
    return {"iter ms": _ms(t_iteration), "iter floor ms": _ms(fl["draft+verify"]),
            "iter/floor": r_it, **extra,
            "<=1.1 (B=1)": ("yes" if r_it <= TARGET_RATIO else "NO") if batch == 1 else "-",
            "decode ms": _ms(t_decode), "decode floor ms": _ms(fl["decode"]),
            "decode/floor": r_dec, "<=1.1": "yes" if r_dec <= TARGET_RATIO else "NO",
            f"speedup @{TAU_PUBLISHED}": implied_speedup(TAU_PUBLISHED, t_decode, t_iteration),
            "paper (B200, B=1)": PAPER_SPEEDUP if batch == 1 else None,
            f"speedup @{TAU_ORACLE:g}": implied_speedup(TAU_ORACLE, t_decode, t_iteration)}


def progress(m: dict, row: dict) -> str:
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
HOST = "host loop (speculative_generate's iteration, one sync an iteration): one graph vs staged"
TERMS = "floor terms (GB, TFLOP, us)"
REAL = "speculative_generate (steps='graphs', time_stages=False), short run"
EXACT = ("exact mode vs default (graph replays, us; cost = exact / default - 1): verify, "
         "iteration, decode")


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
            costs = step_costs(tcfg, dcfg, b, s)
            fields = summary_row(b, e["m"]["iteration"]["us"], e["m"]["decode"]["us"],
                                 step_floors(res.floors, costs),
                                 step_serial_floors(res.floors, costs))
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
    for e in done:  # exact mode beside the default (bench e2e --exact)
        m = e["m"]
        if "decode exact" not in m:
            continue
        fl = step_floors(res.floors, step_costs(tcfg, dcfg, e["batch"], e["context"]))
        cells = {}
        for name, key in (("verify", "verify"), ("draft+verify", "iteration"),
                          ("decode", "decode")):
            d, x = m[key]["us"], m[f"{key} exact"]["us"]
            cells.update({f"{name} us": d, f"{name} exact us": x,
                          f"{name} exact cost %": 100 * (x / d - 1),
                          f"{name} exact x floor": x / fl[name]})
        res.add(EXACT, case=case_label(e["batch"], e["context"]), **cells, note="")
    for e in done:
        label = case_label(e["batch"], e["context"])
        for key, loop in (("loop", "one graph"), ("loop staged", "staged")):
            lp = e["m"].get(key)
            if lp is None:
                continue
            if "error" in lp:
                res.add(HOST, case=label, loop=loop, note=f"failed: {lp['error']}")
                continue
            res.add(HOST, case=label, loop=loop,
                    **{"wall ms/iter": _ms(lp["wall_us"]), "graphs ms/iter": _ms(lp["graphs_us"]),
                       "GPU idle ms/iter": _ms(lp["idle_us"]),
                       "idle %": 100 * lp["idle_us"] / lp["wall_us"], "iters": lp["iters"],
                       "syncs/iter": 1}, note="")
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
                       "FLOP us": floor_us(res.floors, 0, c["flops"]), "floor us": fl[name],
                       "serial floor us": serial_floor_us(res.floors, c)})
    for lp in loops:
        res.add(REAL, case=f"B={lp['batch']}", prompt=LOOP_PROMPT,
                **{"new tokens": lp["new"]}, **lp["stats"], note=lp["note"])
