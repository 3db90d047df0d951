"""DFlash inside real vLLM: stock vs the dflash_ops plugin, measured in one engine per process.

Variants (one process each, consecutive, same machine):
  plain   no speculation: vLLM's decode step alone (the baseline DFlash adds to)
  stock   vLLM's DFlash (DFLASH_OPS_VLLM=0)
  plugin  vLLM's DFlash with our context precompute
  custom  plugin + our draft attention backend ("attention_backend": "CUSTOM")
  ours    no vLLM: our own loop (speculative_generate, CUDA graphs, policy off, greedy) on the
          same checkpoints, and our graphed plain decode as its baseline (plain_ms_per_token)

Per (batch B, context S): B fresh random prompts of S tokens (prefix caching off), greedy,
ignore_eos; the decode time is the wall time of generating 1 + N tokens minus that of 1 token
(the prefill: at 32 x 32k ~27 s, whose run-to-run spread is a large share of 32 iterations, so
use a larger --new there, e.g. 256); an iteration is one draft-and-verify step (vLLM's spec_decode_num_drafts / B;
random weights accept ~nothing, so ~one token an iteration). The precompute's GPU time per call
comes from CUDA events around ``precompute_and_store_context_kv`` (it runs eagerly in 0.25).

  python benchmarks/vllm_check.py make-pair /tmp/pair8b --width 8b
  python benchmarks/bench_vllm.py run /tmp/pair8b --variant stock --out R.jsonl [--batch 1,8]
      [--context 1024,8192] [--new 64]
  python benchmarks/bench_vllm.py table R.jsonl [--md OUT.md] [--parts]
  (run --profile P: the kernels of P more decode tokens under torch.profiler, minus a 1-token
  run's, per iteration; table --parts sums them by part and subtracts plain's, splits the
  attention by owner (target verify, stock draft, ours) and the precompute's replaced kernels
  (stock vs plugin); runs of the same variant and shape appended by repeated processes are
  merged: medians, and a table of their spread with a verdict on plugin / custom vs stock)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

VARIANTS = ("plain", "stock", "plugin", "custom", "ours")
PRECOMPUTE_VARIANTS = ("stock", "plugin", "custom")  # vLLM's precompute, timed a call
BLOCK = 16


def _timer(variant: str):
    """Wrap the drafter class's precompute with CUDA events; returns the list of (start, end)."""
    import torch
    if variant == "stock":
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM as cls
    else:
        from dflash_ops.integrations.vllm.model import DFlashOpsQwen3ForCausalLM as cls
    inner = cls.precompute_and_store_context_kv
    events = []

    def timed(self, *a, **k):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = inner(self, *a, **k)
        e.record()
        events.append((s, e))
        return out

    cls.precompute_and_store_context_kv = timed
    return events


def _llm(root, variant, max_batch, max_len, dtype, gpu_memory=0.6):
    from vllm import LLM
    spec = None
    if variant != "plain":
        spec = {"method": "dflash", "model": os.path.join(root, "drafter"),
                "num_speculative_tokens": BLOCK - 1,
                "attention_backend": "CUSTOM" if variant == "custom" else "TRITON_ATTN"}
    return LLM(model=os.path.join(root, "target"), skip_tokenizer_init=True, dtype=dtype,
               max_model_len=max_len, max_num_seqs=max_batch, gpu_memory_utilization=gpu_memory,
               enable_prefix_caching=False, seed=0, disable_log_stats=False,
               max_num_batched_tokens=max(8192, max_len),
               attention_config={"backend": "TRITON_ATTN"}, speculative_config=spec)


def _drafts(llm) -> int:
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            return int(m.value)
    return 0


PARTS = (  # kernel-name patterns, first match wins: the profile's parts (table --parts)
    ("norm/rope/kv", ("norm", "rotary", "rope", "cache", "store_kv", "context_kv", "kv_epi")),
    ("attention", ("attention", "attn", "flash", "fmha")),
    ("gemm", ("gemm", "cutlass", "nvjet", "cublas", "xmma", "sm90_", "matmul", "_mm_")),
)


def part_of(name: str) -> str:
    # "flash" (FlashAttention's kernels) is also in every dflash_ops:: kernel name and in vLLM's
    # _prepare_dflash_inputs_kernel: match it with the "dflash" taken out
    low = name.lower().replace("dflash", "")
    for part, keys in PARTS:
        if any(k in low for k in keys):
            return part
    return "other"


TRITON_ATTN = "kernel_unified_attention"  # vLLM's TRITON_ATTN kernel (target and stock drafter)


def attention_split(by: dict, b: int, s: int) -> Optional[dict]:
    """The draft attention of stock vs ours (us an iteration), from one profile of each: stock's
    drafter runs TRITON_ATTN like its target, so its share is stock's TRITON_ATTN time minus
    the custom run's (there TRITON_ATTN is the target's only; ours is every dflash_ops
    attention kernel). None without both profiles."""
    st = (by.get(("stock", b, s)) or {}).get("kernels_us_per_iter")
    cu = (by.get(("custom", b, s)) or {}).get("kernels_us_per_iter")
    if not st or not cu:
        return None
    def ta(kernels):  # its 2d / 3d variants and the 3d path's segment reduction included
        return sum(v for k, v in kernels.items()
                   if k.startswith(TRITON_ATTN) or k.startswith("reduce_segments"))

    tgt = ta(cu)
    ours = sum(v for k, v in cu.items() if "dflash_ops" in k and part_of(k) == "attention")
    stock = ta(st) - tgt
    plain = (by.get(("plain", b, s)) or {}).get("kernels_us_per_iter") or {}
    return {"target verify (TRITON_ATTN)": tgt, "target decode (plain)": ta(plain),
            "draft, stock (TRITON_ATTN)": stock, "draft, ours (CUSTOM)": ours,
            "stock / ours": stock / ours if ours else None}


def precompute_split(by: dict, b: int, s: int) -> Optional[dict]:
    """The context precompute's kernels that the plugin replaces, stock vs plugin (us an
    iteration), from one profile of each: the non-GEMM kernels found in one profile and not
    the other (stock: vLLM's rms_norm, rotary, copies; plugin: dflash_ops' context_kv_
    kernels), plus the difference in ``reshape_and_cache`` (the drafter's cache writes share
    that kernel with the target's). The GEMM is left out: both sides run the same cuBLAS call
    (a one-off GEMM name in one profile is cuBLAS choosing another algorithm, not a replaced
    part). None without both profiles."""
    st = (by.get(("stock", b, s)) or {}).get("kernels_us_per_iter")
    pl = (by.get(("plugin", b, s)) or {}).get("kernels_us_per_iter")
    if not st or not pl:
        return None

    def only(a, other):
        return sum(v for k, v in a.items() if k not in other and part_of(k) != "gemm")

    def cache(a):
        return sum(v for k, v in a.items() if "reshape_and_cache" in k)

    d = cache(st) - cache(pl)
    stock, plugin = only(st, pl) + max(d, 0.0), only(pl, st) + max(-d, 0.0)
    return {"stock": stock, "plugin": plugin,
            "removed": 1 - plugin / stock if stock > 0 else None}


def _kernel_us(prof) -> dict:
    """Per kernel name, its total GPU time (us) in a torch.profiler run."""
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            out[e.key] = out.get(e.key, 0.0) + float(t)
    return out


def _shapes(contexts, batches, t0: float, budget_s: float):
    """(S, B) in the run's order while the time budget lasts (a line says where it stopped)."""
    for s in contexts:
        for b in batches:
            if time.time() - t0 > budget_s:
                print(f"budget: stopping before B {b} S {s}", flush=True)
                return
            yield s, b


def _emit(out, rec: dict) -> None:
    """One result record: appended to the results file (flushed) and printed."""
    out.write(json.dumps(rec) + "\n")
    out.flush()
    print(json.dumps(rec), flush=True)


def _profiled(fn, b: int, profile: int, iterations) -> Optional[dict]:
    """Each kernel's GPU time (us) an iteration: ``fn(n)`` run for 1 and 1 + ``profile`` new
    tokens under torch.profiler, the difference over the iterations ``iterations(result)``
    counts in the longer run."""
    if not profile:
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile as prof_ctx
    # GPU kernels; on a CPU-only host (the ours variant's tests) the CPU ops instead
    act = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    runs = []
    for n in (1, 1 + profile):
        with prof_ctx(activities=[act]) as prof:
            res = fn(n)
        runs.append((_kernel_us(prof), res))
    (k1, _), (kn, res) = runs
    it = iterations(res)
    return {k: round((v - k1.get(k, 0.0)) / max(it, 1), 3)
            for k, v in kn.items() if v - k1.get(k, 0.0) > 0}


def run_ours(args, batches, contexts) -> int:
    """The ``ours`` variant: our loop and our graphed plain decode on the pair's checkpoints
    (the target's HF format, the drafter's z-lab format), timed as the vLLM variants are: the
    wall time of 1 + N new tokens minus that of 1 (the prefill), over the iterations."""
    import torch
    from dflash_ops.speculator.demo import (_checkpoint_pair, _decode_graphed,
                                            _plain_greedy_timed, _speculative_timed)
    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    target, drafter = _checkpoint_pair(os.path.join(args.root, "target"),
                                       os.path.join(args.root, "drafter"), dev, dtype, None,
                                       max(contexts) + args.new + 64, max(batches))
    start_s = time.time() - t0
    vocab = target.cfg.vocab_size
    g = torch.Generator().manual_seed(0)

    steps = "graphs" if dev == "cuda" else "direct"  # CPU: the tests' run, no graphs

    def spec(prompts, n):
        toks, st, sec = _speculative_timed(target, drafter, prompts, n, steps, False,
                                           policy=False)
        return sec, st.iterations, toks

    def plain(prompts, n):
        _, sec = (_decode_graphed if dev == "cuda" else _plain_greedy_timed)(target, prompts, n)
        return sec

    with open(args.out, "a") as out:
        for s, b in _shapes(contexts, batches, t0, args.budget_s):
            prompts = [torch.randint(2, vocab - 2, (s,), generator=g).tolist()
                       for _ in range(b)]
            spec(prompts, 2)  # warm this shape (and capture its graphs)
            # the faster of two runs each (one run of a short call is noisy on a host)
            t_pre = min(spec(prompts, 1)[0] for _ in range(2))
            t_all, iters, toks = min((spec(prompts, 1 + args.new) for _ in range(2)),
                                     key=lambda run: run[0])
            plain(prompts, 2)
            p_pre = min(plain(prompts, 1) for _ in range(2))
            p_all = min(plain(prompts, 1 + args.new) for _ in range(2))
            new = sum(len(t) for t in toks) / b - 1
            dec = max(t_all - t_pre, 0.0)
            kernels = _profiled(lambda n: spec(prompts, n), b, args.profile,
                                lambda res: res[1])
            rec = {"variant": "ours", "batch": b, "context": s, "new": args.new,
                   "decode_s": round(dec, 4), "iterations": iters,
                   "ms_per_iter": round(1e3 * dec / max(iters, 1), 3),
                   "tokens_per_iter": round(new / max(iters, 1), 3),
                   "plain_ms_per_token": round(1e3 * max(p_all - p_pre, 0.0)
                                               / max(args.new, 1), 3),
                   "precompute_calls": 0, "precompute_ms_mean": None,
                   "engine_start_s": round(start_s, 1), "dtype": args.dtype,
                   "kernels_us_per_iter": kernels, "steps": steps,
                   "commit": os.environ.get("DFLASH_OPS_COMMIT", "")}
            _emit(out, rec)
    return 0


def run(args) -> int:
    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    if args.variant == "ours":
        return run_ours(args, batches, contexts)
    import torch
    from vllm import SamplingParams
    if args.variant == "stock":
        os.environ["DFLASH_OPS_VLLM"] = "0"
    with open(os.path.join(args.root, "target", "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    events = _timer(args.variant) if args.variant != "plain" else []
    t0 = time.time()
    llm = _llm(args.root, args.variant, max(batches), max(contexts) + args.new + 64, args.dtype,
               args.gpu_memory)
    start_s = time.time() - t0
    g = torch.Generator().manual_seed(0)

    def prompts(b, s):
        return [{"prompt_token_ids": torch.randint(2, vocab - 2, (s,), generator=g).tolist()}
                for _ in range(b)]

    def gen(b, s, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        torch.cuda.synchronize()
        d0, t = _drafts(llm), time.perf_counter()
        outs = llm.generate(prompts(b, s), sp, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t, _drafts(llm) - d0, outs

    gen(1, 64, 8)  # warm-up
    with open(args.out, "a") as out:
        for s, b in _shapes(contexts, batches, t0, args.budget_s):
            # warm this shape: one request of the full context (the prefill's chunk shapes)
            # and the batch at a short context (the decode's batch shape); a whole batch of
            # long prompts costs as much as a timed run (32 x 32k: ~27 s of prefill)
            gen(1, s, 2)
            gen(b, min(s, 1024), 2)
            t_pre, _, _ = gen(b, s, 1)
            events.clear()
            t_all, drafts, outs = gen(b, s, 1 + args.new)
            pre_ms = [a.elapsed_time(e) for a, e in events]
            new = sum(len(o.outputs[0].token_ids) for o in outs) / b - 1
            iters = drafts / b if args.variant != "plain" else new
            dec = max(t_all - t_pre, 0.0)
            # decode's kernels an iteration: (1 + P tokens) - (1 token)
            kernels = _profiled(lambda n: gen(b, s, n), b, args.profile, lambda res: (
                res[1] / b if args.variant != "plain" else
                sum(len(x.outputs[0].token_ids) for x in res[2]) / b - 1))
            rec = {"variant": args.variant, "batch": b, "context": s, "new": args.new,
                   "decode_s": round(dec, 4), "iterations": iters,
                   "ms_per_iter": round(1e3 * dec / max(iters, 1), 3),
                   "tokens_per_iter": round(new / max(iters, 1), 3),
                   "precompute_calls": len(pre_ms),
                   "precompute_ms_mean": round(sum(pre_ms) / len(pre_ms), 4)
                   if pre_ms else None,
                   "engine_start_s": round(start_s, 1), "dtype": args.dtype,
                   "kernels_us_per_iter": kernels,
                   "commit": os.environ.get("DFLASH_OPS_COMMIT", "")}
            _emit(out, rec)
    return 0


def merge_runs(rows) -> tuple:
    """(by, runs): rows of the same (variant, batch, context) from repeated engine processes
    merged: ``by[key]`` the first row with ms_per_iter and precompute_ms_mean the medians of
    the runs and the first profiled run's kernels; ``runs[key]`` every run's ms_per_iter, in
    file order. Rows of one key with another ``new`` or ``dtype`` are an error (different
    experiments)."""
    group = {}
    for r in rows:
        group.setdefault((r["variant"], r["batch"], r["context"]), []).append(r)
    by, runs = {}, {}
    for key, rs in group.items():
        settings = {(r.get("new"), r.get("dtype")) for r in rs}
        if len(settings) > 1:
            raise SystemExit(f"bench_vllm table: {key[0]} at B {key[1]} S {key[2]} mixes "
                             f"runs of (new, dtype) {sorted(settings, key=str)}: table one "
                             f"setting at a time")
        runs[key] = [r["ms_per_iter"] for r in rs]
        pre = [r["precompute_ms_mean"] for r in rs if r.get("precompute_ms_mean") is not None]
        kernels = next((r["kernels_us_per_iter"] for r in rs if r.get("kernels_us_per_iter")),
                       None)
        by[key] = dict(rs[0], ms_per_iter=statistics.median(runs[key]),
                       precompute_ms_mean=statistics.median(pre) if pre else None,
                       kernels_us_per_iter=kernels)
    return by, runs


def table(args) -> int:
    rows = []
    for path in args.results:  # several files: the runs of one table (e.g. two device calls)
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    by, runs = merge_runs(rows)
    keys = sorted({(r["batch"], r["context"]) for r in rows}, key=lambda k: (k[1], k[0]))
    lines = ["| B x S | plain ms/token | " + " | ".join(
        f"{v} ms/iter (+ over {'our plain decode' if v == 'ours' else 'plain'})"
        for v in VARIANTS[1:]) + " | precompute ms/call "
        "stock / plugin / custom |", "|---|---|" + "---|" * (len(VARIANTS) - 1) + "---|"]
    for b, s in keys:
        plain = by.get(("plain", b, s))
        cells = [f"{b} x {s}", f"{plain['ms_per_iter']:.3f}" if plain else "-"]
        for v in VARIANTS[1:]:
            r = by.get((v, b, s))
            if r is None:
                cells.append("-")
                continue
            base = r.get("plain_ms_per_token") if v == "ours" else \
                (plain["ms_per_iter"] if plain else None)
            add = f" (+{r['ms_per_iter'] - base:.3f})" if base is not None else ""
            if v == "ours" and base is not None:
                add = f" (+{r['ms_per_iter'] - base:.3f} over {base:.3f})"
            cells.append(f"{r['ms_per_iter']:.3f}{add}")
        pre = [by.get((v, b, s), {}).get("precompute_ms_mean") for v in PRECOMPUTE_VARIANTS]
        cells.append(" / ".join(f"{p:.3f}" if p is not None else "-" for p in pre))
        lines.append("| " + " | ".join(cells) + " |")
    if any(len(v) > 1 for v in runs.values()):  # repeated runs: the spread and the verdict
        lines += ["", "repeated runs (one engine process each, in file order): ms an iteration, "
                  "median [min - max] (n); plugin - stock: the medians' difference, and "
                  "'slower' only if every plugin run is slower than every stock run", "",
                  "| B x S | " + " | ".join(VARIANTS) + " | plugin - stock | custom - stock |",
                  "|---|" + "---|" * (len(VARIANTS) + 2)]
        for b, s in keys:
            cells = [f"{b} x {s}"]
            for v in VARIANTS:
                xs = runs.get((v, b, s))
                cells.append("-" if not xs else f"{statistics.median(xs):.3f} "
                             f"[{min(xs):.3f} - {max(xs):.3f}] ({len(xs)})")
            stock = runs.get(("stock", b, s))
            for v in ("plugin", "custom"):
                xs = runs.get((v, b, s))
                if not (xs and stock):
                    cells.append("-")
                    continue
                d = statistics.median(xs) - statistics.median(stock)
                verdict = ("one run a side: no spread" if len(xs) < 2 or len(stock) < 2 else
                           "slower" if min(xs) > max(stock) else
                           "faster" if max(xs) < min(stock) else "within the spread")
                cells.append(f"{d:+.3f} ({verdict})")
            lines.append("| " + " | ".join(cells) + " |")
    # each variant's GPU time an iteration by part, and its excess over plain
    if args.parts and any(r.get("kernels_us_per_iter") for r in by.values()):
        names = ["attention", "gemm", "norm/rope/kv", "other"]
        lines += ["", "GPU time an iteration by part, us (torch profiler; over plain in "
                  "parentheses: the drafter's share; ours: our loop's whole iteration, our "
                  "own target and drafter kernels)", "",
                  "| B x S | variant | " + " | ".join(names) + " | total |",
                  "|---|---|" + "---|" * (len(names) + 1)]
        for b, s in keys:
            sums = {}
            for v in VARIANTS:
                k = by.get((v, b, s), {}).get("kernels_us_per_iter")
                if k:
                    sums[v] = {p: 0.0 for p in names}
                    for name, us in k.items():
                        sums[v][part_of(name)] += us
            for v, parts in sums.items():
                base = sums.get("plain")
                cells = []
                for p in names + ["total"]:
                    val = sum(parts.values()) if p == "total" else parts[p]
                    ref = (sum(base.values()) if p == "total" else base[p]) if base else None
                    cells.append(f"{val:.1f}" + (f" (+{val - ref:.1f})" if ref is not None
                                                 and v not in ("plain", "ours") else ""))
                lines.append(f"| {b} x {s} | {v} | " + " | ".join(cells) + " |")
    if args.parts:
        split = {(b, s): attention_split(by, b, s) for b, s in keys}
        split = {k: v for k, v in split.items() if v}
        if split:
            cols = list(next(iter(split.values())))
            lines += ["", "attention by owner, us an iteration (stock's draft share = its "
                      "TRITON_ATTN time minus the custom run's, which is the target's only)", "",
                      "| B x S | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
            for (b, s), v in split.items():
                lines.append(f"| {b} x {s} | " + " | ".join(
                    "-" if v[c] is None else (f"{v[c]:.2f}x" if c == "stock / ours"
                                              else f"{v[c]:.1f}") for c in cols) + " |")
    if args.parts:
        pre = {(b, s): precompute_split(by, b, s) for b, s in keys}
        pre = {k: v for k, v in pre.items() if v}
        if pre:
            lines += ["", "the precompute's replaced kernels, us an iteration (non-GEMM kernels "
                      "in one profile only, plus the drafter's share of reshape_and_cache; the "
                      "GEMM, the same cuBLAS call on both sides, left out)", "",
                      "| B x S | stock | plugin | removed |", "|---|---|---|---|"]
            for (b, s), v in pre.items():
                rem = "-" if v["removed"] is None else f"{100 * v['removed']:.0f}%"
                lines.append(f"| {b} x {s} | {v['stock']:.1f} | {v['plugin']:.1f} | {rem} |")
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("root")
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--context", default="1024,8192")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--gpu-memory", type=float, default=0.6, metavar="F",
                   help="vLLM's gpu_memory_utilization (0.85 fits 32 x 32k on an 80 GB card)")
    p.add_argument("--profile", type=int, default=0, metavar="P",
                   help="also profile P decode tokens a case (torch.profiler): each kernel's "
                        "GPU time an iteration in the record")
    p.add_argument("--out", required=True)
    p = sub.add_parser("table")
    p.add_argument("results", nargs="+",
                   help="results files (jsonl) of `run`; several are read as one")
    p.add_argument("--md")
    p.add_argument("--parts", action="store_true",
                   help="add the profiled GPU time by part (attention, GEMM, norm/rope/KV, "
                        "other) and each variant's excess over plain")
    args = ap.parse_args(argv)
    if args.cmd == "run" and not 0 < args.gpu_memory <= 1:
        ap.error(f"--gpu-memory: expected a fraction in (0, 1]; got {args.gpu_memory}")
    if args.cmd == "table":
        for path in args.results:
            if not os.path.isfile(path):
                ap.error(f"results: expected a results file of `run`; got {path!r}, not a file")
    return run(args) if args.cmd == "run" else table(args)


if __name__ == "__main__":
    sys.exit(main())
