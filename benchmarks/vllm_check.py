"""The vLLM plugin inside real vLLM (the bundle of ``.vllm/``, see benchmarks/gpu_check.sh vllm).

One engine per process (vLLM's own rule of thumb); the engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the drafter class can be instrumented:

  python benchmarks/vllm_check.py make-pair DIR [--width tiny|8b]
      an HF Qwen3 target (DIR/target) and a z-lab DFlash drafter (DIR/drafter), random weights
  python benchmarks/vllm_check.py caches DIR [--eager] [--calls N] [--dtype bfloat16]
      for the first N precompute calls that write: vLLM's own method into the real caches,
      those caches saved and restored, then the plugin's; the two results compared per layer:
      the K and V rows the slots address within the tolerance, every other element bit-equal. The runner
      is vLLM's choice or VLLM_USE_V2_MODEL_RUNNER's. Prints one JSON line per call and a
      summary line; exits 1 when a call is out of tolerance or the plugin did not run.
  python benchmarks/vllm_check.py attention
      the CUSTOM backend's impl against vLLM's TRITON_ATTN impl on one paged cache (no engine)
  python benchmarks/vllm_check.py generate DIR [--eager] [--draft-backend CUSTOM] --out FILE.json
      greedy outputs and vLLM's speculative-decoding counters (DFLASH_OPS_VLLM=0: stock vLLM;
      --draft-backend CUSTOM: the plugin's draft attention backend)
  python benchmarks/vllm_check.py compare STOCK.json OURS.json [--exact] [--rate-tol F]
      two generate results: outputs equal, accepted tokens, acceptance rates, drafts
  make-pair --variant counter: models.synthetic.counter_pair (drafts accepted; its prompts are
      counting sequences), for the end-to-end equality of outputs and accepted counts
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

WIDTHS = {  # hidden, target layers, heads, kv heads, head_dim, inter, vocab, draft layers
    "tiny": (512, 4, 8, 4, 64, 1024, 2048, 2),
    "8b": (4096, 6, 32, 8, 128, 12288, 151936, 5),
}
BLOCK = 16  # drafter block: 15 speculative tokens


VARIANTS = {  # drafter attention features beyond the plain pair, for the caches / attention checks
    "plain": {},
    "bias-swa": {"attention_bias": True, "swa": 64},  # qkv/o bias; non-causal window of 64
    "counter": {},  # models.synthetic.counter_pair: drafts accepted (the width is its own)
}


def make_pair(root: str, width: str, variant: str = "plain") -> None:
    import torch
    from dflash_ops.models import save_target, save_zlab
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "pair.json"), "w") as f:
        json.dump({"width": width, "variant": variant}, f)
    if variant == "counter":
        from dflash_ops.models.synthetic import counter_pair
        tcfg, ts, dcfg, ds = counter_pair(block_size=BLOCK)
        save_target(os.path.join(root, "target"), tcfg,
                    {k: v.to(torch.bfloat16) for k, v in ts.items()})
        save_zlab(os.path.join(root, "drafter"), dcfg,
                  {k: v.to(torch.bfloat16) for k, v in ds.items()})
        print(f"pair counter in {root}: target {tcfg['num_hidden_layers']} layers H "
              f"{tcfg['hidden_size']} vocab {tcfg['vocab_size']} (next = token + 1), drafter "
              f"{dcfg['num_hidden_layers']} layers copying from {tcfg['vocab_size'] + 1} back")
        return
    from dflash_ops.models.config import DFlashConfig
    from dflash_ops.models.drafter import random_drafter_state
    from dflash_ops.models.target import TargetConfig, random_state

    h, lt, nh, nkv, hd, inter, vocab, ld = WIDTHS[width]
    tcfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=h,
                num_hidden_layers=lt, num_attention_heads=nh, num_key_value_heads=nkv,
                head_dim=hd, intermediate_size=inter, vocab_size=vocab, hidden_act="silu",
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                tie_word_embeddings=False, attention_bias=False, torch_dtype="bfloat16",
                bos_token_id=0, eos_token_id=1)
    tc = TargetConfig(hidden_size=h, num_layers=lt, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                      intermediate_size=inter, vocab_size=vocab, rope_theta=1e6,
                      max_position_embeddings=40960)
    taps = [1, lt - 2]
    dcfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=h,
                num_hidden_layers=ld, num_attention_heads=nh, num_key_value_heads=nkv,
                head_dim=hd, intermediate_size=inter, vocab_size=vocab, hidden_act="silu",
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                attention_bias=False, tie_word_embeddings=False, torch_dtype="bfloat16",
                num_target_layers=lt, block_size=BLOCK,
                dflash_config={"target_layer_ids": taps, "mask_token_id": vocab - 1})
    feats = VARIANTS[variant]
    if feats.get("attention_bias"):
        dcfg["attention_bias"] = True
    dc = DFlashConfig.from_dict(dcfg, source="vllm_check drafter")  # (weights' shapes only)
    if feats.get("swa"):  # vLLM reads dflash_config.use_swa / swa_window_size
        dcfg["dflash_config"].update(use_swa=True, swa_window_size=feats["swa"])
    bf = {k: v.to(torch.bfloat16) for k, v in random_state(tc, seed=0).items()}
    save_target(os.path.join(root, "target"), tcfg, bf)
    ds = {k: v.to(torch.bfloat16) for k, v in random_drafter_state(dc, seed=1).items()}
    save_zlab(os.path.join(root, "drafter"), dcfg, ds)
    print(f"pair {width}/{variant} in {root}: target {lt} layers H {h} vocab {vocab}, drafter "
          f"{ld} layers")


def _llm(root: str, eager: bool, dtype: str, max_num_seqs: int = 8, max_model_len: int = 4096,
         draft_backend: str = "TRITON_ATTN", **kw):
    from vllm import LLM
    return LLM(**kw, model=os.path.join(root, "target"), skip_tokenizer_init=True, dtype=dtype,
               max_model_len=max_model_len, gpu_memory_utilization=0.3, enforce_eager=eager,
               seed=0, max_num_seqs=max_num_seqs, disable_log_stats=False,
               attention_config={"backend": "TRITON_ATTN"},
               speculative_config={"method": "dflash", "model": os.path.join(root, "drafter"),
                                   "num_speculative_tokens": BLOCK - 1,
                                   "attention_backend": draft_backend})


def _prompts(root: str, n: int = 4, lens=(37, 300, 5, 129)):
    import torch
    with open(os.path.join(root, "target", "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    meta = os.path.join(root, "pair.json")
    if os.path.exists(meta) and json.load(open(meta)).get("variant") == "counter":
        from dflash_ops.models.synthetic import counter_prompts  # counting sequences > vocab
        return [{"prompt_token_ids": p} for p in counter_prompts(n, vocab=vocab, seed=5)]
    g = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(2, vocab - 2, (lens[i % len(lens)],),
                                               generator=g).tolist()} for i in range(n)]


def check_caches(args) -> int:
    import torch
    from vllm import SamplingParams
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM as Stock
    from dflash_ops.integrations.vllm import model as pm
    from dflash_ops.integrations.vllm.cache import kv_views

    ours = pm.DFlashOpsQwen3ForCausalLM.precompute_and_store_context_kv
    records = []

    def checked(self, x, pos, slots=None):
        if slots is None or len(records) >= args.calls:
            return ours(self, x, pos, slots)
        caches = [a.kv_cache for a in self.model._attn_layers]
        caches = [c[0] if isinstance(c, (list, tuple)) else c for c in caches]
        before = [c.clone() for c in caches]
        Stock.precompute_and_store_context_kv(self, x, pos, slots)
        want = [c.clone() for c in caches]
        for c, b in zip(caches, before):
            c.copy_(b)
        ours(self, x, pos, slots)
        torch.cuda.synchronize()
        used = getattr(self, "_dflash_ops_cached", (None, None))[1] is not None
        rec = {"call": len(records), "rows": int(x.shape[0]), "plugin_ran": used,
               "slots": type(slots).__name__, "layers": []}
        m = self.model
        for i, (c, w, b) in enumerate(zip(caches, want, before)):
            # the elements the slots address (slot >= 0), in K and in V
            s = slots[i] if isinstance(slots, (list, tuple)) else slots
            written = torch.zeros(c.shape, dtype=torch.bool, device=c.device)
            if s is not None:
                mk, mv = kv_views(written, m._num_kv_heads, m._head_dim)
                bs = mk.shape[1]
                s = s[(s >= 0) & (s < mk.shape[0] * bs)]
                mk[s // bs, s % bs] = True
                mv[s // bs, s % bs] = True
            lay = {"written": int(written.sum()),
                   "unwritten_changed": int(((c != b) & ~written).sum())}
            for name, (cv, wv) in zip("kv", zip(kv_views(c, m._num_kv_heads, m._head_dim),
                                                 kv_views(w, m._num_kv_heads, m._head_dim))):
                sel = (mk if name == "k" else mv) if s is not None else None
                got = cv[sel].float() if sel is not None else cv.flatten()[:0].float()
                ref = wv[sel].float() if sel is not None else got
                err = (got - ref).abs()
                lay[name] = {"max_err": err.max().item() if err.numel() else 0.0,
                             "max_rel": (err.max() / ref.abs().max().clamp_min(1e-30)).item()
                             if err.numel() else 0.0,
                             "not_equal": int((got != ref).sum())}
            lay["max_rel"] = max(lay["k"]["max_rel"], lay["v"]["max_rel"])
            rec["layers"].append(lay)
        rec["ok"] = used and all(l["max_rel"] <= args.rel_tol and l["unwritten_changed"] == 0
                                 and l["written"] > 0 for l in rec["layers"])
        records.append(rec)
        print(json.dumps(rec), flush=True)

    pm.DFlashOpsQwen3ForCausalLM.precompute_and_store_context_kv = checked
    t0 = time.time()
    llm = _llm(args.root, args.eager, args.dtype, draft_backend=args.draft_backend,
               num_gpu_blocks_override=512)  # small caches:
    t1 = time.time()  # each checked call clones the drafter's caches twice
    outs = llm.generate(_prompts(args.root), SamplingParams(max_tokens=24, temperature=0.0,
                                                            ignore_eos=True, detokenize=False))
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    ok = bool(records) and all(r["ok"] for r in records)
    print(json.dumps({"summary": "caches", "runner_v2": os.environ.get(
        "VLLM_USE_V2_MODEL_RUNNER", "default"), "eager": args.eager, "dtype": args.dtype,
        "calls_checked": len(records), "all_ok": ok, "tokens": n_tok,
        "engine_start_s": round(t1 - t0, 1), "generate_s": round(time.time() - t1, 1),
        "worst_rel": max((l["max_rel"] for r in records for l in r["layers"]), default=None)}),
        flush=True)
    return 0 if ok else 1


def _record_drafts(limit: int = 64) -> list:
    """The drafter's greedy drafts (argmax of compute_logits) of its first ``limit`` eager calls,
    as lists of token ids: outputs alone cannot tell a broken drafter (greedy speculative
    decoding is lossless, and random weights accept nothing), the drafts can."""
    import torch
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    inner = DFlashQwen3ForCausalLM.compute_logits
    drafts = []

    def recording(self, hidden_states, *a, **k):
        logits = inner(self, hidden_states, *a, **k)
        if len(drafts) < limit and logits is not None \
                and not torch.cuda.is_current_stream_capturing():
            drafts.append(logits.argmax(-1).tolist())
        return logits

    DFlashQwen3ForCausalLM.compute_logits = recording
    return drafts


def generate(args) -> int:
    from vllm import SamplingParams
    drafts = _record_drafts()
    t0 = time.time()
    llm = _llm(args.root, args.eager, args.dtype, draft_backend=args.draft_backend)
    t1 = time.time()
    outs = llm.generate(_prompts(args.root, n=8), SamplingParams(
        max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False))
    t2 = time.time()
    metrics = {}
    try:
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                metrics[m.name] = getattr(m, "value", None) if hasattr(m, "value") else \
                    getattr(m, "values", None)
    except Exception as e:  # older / newer metric APIs: report, do not fail
        metrics["error"] = repr(e)
    res = {"plugin": os.environ.get("DFLASH_OPS_VLLM", "1") != "0", "eager": args.eager,
           "draft_backend": args.draft_backend,
           "dtype": args.dtype, "outputs": [list(o.outputs[0].token_ids) for o in outs],
           "drafts": drafts,
           "metrics": metrics, "engine_start_s": round(t1 - t0, 1),
           "generate_s": round(t2 - t1, 1)}
    with open(args.out, "w") as f:
        json.dump(res, f)
    print(json.dumps({k: v for k, v in res.items() if k not in ("outputs", "drafts")}),
          flush=True)
    return 0


def check_attention(args) -> int:
    """The CUSTOM backend's impl against vLLM's TRITON_ATTN impl on the same paged cache and
    metadata (no engine): random bf16 / fp32 inputs, non-causal / causal, windows, sinks, GQA,
    several requests of different lengths and padded query rows. Prints one line per case;
    exit 1 when a case is out of tolerance."""
    import contextlib
    import types
    import torch
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from dflash_ops.dispatch import use_backend
    from dflash_ops.integrations.vllm.attention import DFlashOpsAttentionImpl

    torch.manual_seed(0)
    dev, nb, bs, hkv, d, hq = "cuda", 96, 16, 4, 128, 16
    seq_lens = torch.tensor([40, 7, 300, 129], dtype=torch.int32, device=dev)
    q_lens = [16, 5, 16, 1]
    qsl = torch.tensor([0, 16, 21, 37, 38], dtype=torch.int32, device=dev)
    n, pad = sum(q_lens), 6
    table = torch.randperm(nb, device=dev)[:4 * 20].view(4, 20).to(torch.int32)
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        cache = torch.randn(nb, 2, bs, hkv, d, dtype=dtype, device=dev)
        for causal, window, sinks in ((False, None, False), (True, None, False),
                                      (False, 64, True), (True, 32, True), (False, None, True)):
            sk = torch.randn(hq, device=dev) if sinks else None
            kw = dict(num_heads=hq, head_size=d, scale=d ** -0.5, num_kv_heads=hkv,
                      alibi_slopes=None, sliding_window=window, kv_cache_dtype="auto", sinks=sk)
            meta = types.SimpleNamespace(
                num_actual_tokens=n, max_query_len=16, query_start_loc=qsl, max_seq_len=300,
                seq_lens=seq_lens, block_table=table, slot_mapping=None, causal=causal,
                use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None,
                prefix_kv_lens=None, suffix_kv_lens=None, scheduler_metadata=None,
                prefix_scheduler_metadata=None, mm_prefix_range=None,
                mm_prefix_range_tensor=None, rswa_prefix_lens=None, rswa_window=None,
                seq_threshold_3D=0, num_par_softmax_segments=16,
                softmax_segm_output=torch.empty(0, hq, 16, d, device=dev),
                softmax_segm_max=torch.empty(0, hq, 16, device=dev),
                softmax_segm_expsum=torch.empty(0, hq, 16, device=dev))
            layer = types.SimpleNamespace(_k_scale=torch.ones(1, device=dev),
                                          _v_scale=torch.ones(1, device=dev), _q_scale=None)
            query = torch.randn(n + pad, hq, d, dtype=dtype, device=dev)
            outs = []
            for cls, ref in ((TritonAttentionImpl, False), (DFlashOpsAttentionImpl, False),
                             (DFlashOpsAttentionImpl, True)):
                out = torch.zeros(n + pad, hq * d, dtype=dtype, device=dev)
                with use_backend("torch") if ref else contextlib.nullcontext():
                    cls(**kw).forward(layer, query, None, None, cache, meta,
                                      out.view(n + pad, hq, d))
                outs.append(out)
            torch.cuda.synchronize()
            # TRITON_ATTN's fp32 dots run in TF32 (Triton's default input precision), so in fp32
            # it is held to TF32's bound; ours is held to fp32's against our torch reference.
            tf32 = dtype == torch.float32
            err = (outs[0].float() - outs[1].float()).abs().max().item()
            err_ref = (outs[2].float() - outs[1].float()).abs().max().item()
            tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
            tol_ref = 2e-2 if dtype == torch.bfloat16 else 1e-4
            good = err <= tol and err_ref <= tol_ref and bool((outs[1][n:] == 0).all())
            ok &= good
            print(json.dumps({"dtype": str(dtype), "causal": causal, "window": window,
                              "sinks": sinks, "max_err_vs_triton_attn": err,
                              "max_err_vs_torch_ref": err_ref, "tf32_side": tf32,
                              "ok": good}), flush=True)
    print(json.dumps({"summary": "attention", "all_ok": ok}), flush=True)
    return 0 if ok else 1


def compare(args) -> int:
    """Two generate results (stock first): equal outputs, accepted-token counts, acceptance rate
    (accepted / drafted tokens), drafts. --exact: outputs and accepted counts must be equal
    (fp32); --rate-tol: the acceptance rates within that fraction of stock's (bf16). Exit 1 on a
    miss."""
    a, b = (json.load(open(p)) for p in (args.a, args.b))
    same = sum(x == y for x, y in zip(a["outputs"], b["outputs"]))

    def counts(r):
        m = r["metrics"]
        acc, drafted = (m.get(f"vllm:spec_decode_num_{n}_tokens") for n in ("accepted", "draft"))
        return acc, drafted, (acc / drafted if acc is not None and drafted else None)

    (acc_a, dr_a, rate_a), (acc_b, dr_b, rate_b) = counts(a), counts(b)
    rows = list(zip(a.get("drafts", []), b.get("drafts", [])))  # a drafter call's argmax rows
    tok = [(u, v) for x, y in rows for u, v in zip(x, y)]
    res = {"summary": "compare", "dtype": a["dtype"], "sides": [args.a, args.b],
           "outputs_equal": f"{same} of {len(a['outputs'])}",
           "accepted": [acc_a, acc_b], "drafted": [dr_a, dr_b], "rate": [rate_a, rate_b],
           "draft_calls_equal": f"{sum(x == y for x, y in rows)} of {len(rows)}",
           "draft_tokens_equal": f"{sum(u == v for u, v in tok)} of {len(tok)}"}
    ok = True
    if args.exact:
        ok = same == len(a["outputs"]) and acc_a == acc_b
    if args.rate_tol is not None:
        ok = ok and rate_a is not None and rate_b is not None \
            and abs(rate_b - rate_a) <= args.rate_tol * rate_a
    if args.min_rate is not None:
        ok = ok and rate_a is not None and min(rate_a, rate_b) >= args.min_rate
    res["ok"] = ok
    print(json.dumps(res), flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-pair")
    p.add_argument("root")
    p.add_argument("--width", choices=sorted(WIDTHS), default="tiny")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="plain",
                   help="drafter features: plain, bias-swa (qkv/o bias, a window of 64), or "
                        "counter (a pair whose drafts are accepted)")
    sub.add_parser("attention", help="the CUSTOM impl vs TRITON_ATTN's on one cache")
    for name in ("caches", "generate"):
        p = sub.add_parser(name)
        p.add_argument("root")
        p.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--draft-backend", default="TRITON_ATTN",
                       help="the drafter's attention backend (CUSTOM: the plugin's)")
        if name == "caches":
            p.add_argument("--calls", type=int, default=6)
            p.add_argument("--rel-tol", type=float, default=0.02,
                           help="max |ours - vLLM's| over max |vLLM's| per layer (bf16: a few "
                                "ulps; vLLM rotates with a bf16 table, we with fp32)")
        else:
            p.add_argument("--out", required=True)
    p = sub.add_parser("compare", help="two generate results: outputs, acceptance, drafts")
    p.add_argument("a", help="the stock side's generate JSON")
    p.add_argument("b")
    p.add_argument("--exact", action="store_true", help="outputs and accepted counts equal")
    p.add_argument("--rate-tol", type=float, help="acceptance rates within this fraction")
    p.add_argument("--min-rate", type=float, help="both acceptance rates at least this")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args)
    if args.cmd == "make-pair":
        make_pair(args.root, args.width, args.variant)
        return 0
    if args.cmd == "attention":
        return check_attention(args)
    return check_caches(args) if args.cmd == "caches" else generate(args)


if __name__ == "__main__":
    sys.exit(main())
