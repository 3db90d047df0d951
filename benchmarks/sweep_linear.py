"""Per-shape sweep: cuBLAS ``F.linear`` vs our Triton skinny GEMM (kv_proj's kernel) and, at M <=
8, the C++ kv_proj's skinny kernel (split-K over a thread-block cluster, sm_90) on the linear
layers of a Qwen3-8B target and its DFlash drafter (bf16, H200), for the table of
``dflash_ops/models/linear.py``.

Shapes (N, K): qkv (6144, 4096), o_proj (4096, 4096), gate_up (24576, 4096), down (4096, 12288),
the drafter's fc (4096, 5 * 4096), the LM head (151936, 4096) and DFlash 2's kernel projection
proj2 (1280, 5120); M (rows) = the M buckets of
models.linear up to 1024 (decode: M = batch; draft/verify blocks: M = 16 * batch). For each
(shape, M): cuBLAS, then a grid of ``ProjCfg`` launches, each checked against F.linear on the
same inputs before it is timed (CUDA-graph replay over copies of the weight totalling >= 256 MB,
so each call streams its weight from HBM as in a model; a wrong or failing config is listed,
never chosen), exact mode's launch (``models.linear.exact_config``) with and without its
split, and the fastest launch of exact mode's family (``exact_compatible``: same split, wgmma
tiles), each checked bit for bit against exact mode's default launch before it is timed.
At M <= 8 the skinny kernel also runs under each plan of ``skinny_plans`` (forced with
DFLASH_OPS_SKINNY_PLAN; --no-plans skips them), each checked before it is timed.
Prints the best few per (shape, M) with their ratio to cuBLAS and to the floor (max of bytes /
copy bandwidth and FLOPs / GEMM rate, measured in the same run); writes every measurement to
``--out`` (JSON) and, with ``--write-table``, the winners to
``dflash_ops/models/linear_table.json`` (the table models.linear loads at import; entries of
shapes and M not measured in this run are kept from the previous table), exact mode's fastest
launches under its ``exact`` key.

    python benchmarks/sweep_linear.py [--quick] [--shapes qkv,o] [--ms 1,16] [--write-table]

Run time on the H200 (estimate): ~30 Triton compiles (~1-2 s each) + ~600 timed launches
(~0.1 s each): 2-3 minutes; --quick (M 1, 16, 64, 256) about half.
"""
import argparse
import importlib.util
import itertools
import json
import os
import sys
import time
from pathlib import Path

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "fc": (4096, 20480), "lm_head": (151936, 4096),
          "proj2": (1280, 5120)}  # proj2: DFlash 2's kernel projection (H 5120, K 2, group 16)
MS = (1, 8, 16, 32, 64, 128, 256, 512, 1024)
ROTATE_BYTES = 256 << 20  # weight copies a shape rotates over (the H200's L2: 50 MB)
QUICK_MS = (1, 16, 64, 256)


PLAN_ENV = "DFLASH_OPS_SKINNY_PLAN"


def skinny_plans(n, k, sms):
    """The skinny kernel's plans (MT,KG,SPLITS,U) worth timing for N x K on ``sms`` SMs: every
    plan whose grid is between half an SM each and eight CTAs an SM."""
    out = []
    for mt, kg in ((2, 1), (1, 1), (1, 4)):
        tiles = -(-n // (128 * mt // kg))
        for splits in (1, 2, 4, 8):
            if splits > k // 64 or not sms // 2 <= tiles * splits <= 8 * sms:
                continue
            out += [f"{mt},{kg},{splits},{u}" for u in (1, 2)]
    return out


def pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def grid(m, tc):
    """Candidate launches for M rows (skinny M: narrow N tiles so every SM streams weights)."""
    if m <= 64:
        bm = max(16, pow2(m))
        for bn, bk in itertools.product((16, 32, 64, 128), (128, 256)):
            yield tc.ProjCfg(bm, bn, bk, 8, 4, tc._stages(4, bm, bn, bk, 2), True)
        for bn in (32, 64):
            yield tc.ProjCfg(bm, bn, 128, 8, 4, tc._stages(4, bm, bn, 128, 2), True, True)
        yield tc.ProjCfg(bm, 32, 128, 8, 4, 4, False)
        # split-K: K in 2-8 slices, so narrow N (proj2: 1280 columns are 40-80 tiles) still
        # spreads over every SM; the tile's last program sums the fp32 partials
        for split, bn in itertools.product((2, 4, 8), (16, 32, 64)):
            yield tc.ProjCfg(bm, bn, 128, 8, 4, tc._stages(4, bm, bn, 128, 2), True, False, split)
    else:
        for bm, bn, st in itertools.product((64, 128), (64, 128, 256), (3, 4)):
            w = 8 if bm * bn >= 128 * 128 else 4
            for pers in (False, True):
                yield tc.ProjCfg(bm, bn, 64, 8, w, tc._stages(st, bm, bn, 64, 2), True, pers)


def exact_grid(m, n, k, L, tc):
    """Exact mode's candidate launches for M rows of w [n, k]: its split, wgmma tiles (the
    family of models.linear.exact_compatible, whose bits session 25's exact_probe measured
    equal); a program a slice at M <= 64 (split 1: the serial launch), both kinds above."""
    split = L.exact_split(n, k)
    if m <= 64:
        tiles = [(64, bn, bk, 8 if bn == 256 else 4) for bn in (64, 128, 256) for bk in (64, 128)]
        serials = (split == 1,)
    else:
        tiles = [(bm, bn, 64, 8 if bm * bn >= 128 * 128 else 4)
                 for bm in (64, 128) for bn in (128, 256)]
        serials = (True,) if split == 1 else (False, True)
    for (bm, bn, bk, warps), st, tma, serial in itertools.product(tiles, (3, 4), (False, True),
                                                                  serials):
        cfg = tc.ProjCfg(bm, bn, bk, 8, warps, tc._stages(st, bm, bn, bk, 2), tma, False,
                         split, serial)
        if L.exact_compatible(tuple(cfg), n, k) is None:
            yield cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {','.join(SHAPES)}")
    ap.add_argument("--ms", default=None, help="comma-separated M values")
    ap.add_argument("--out", default="benchmarks/results/sweep_linear.json")
    ap.add_argument("--write-table", action="store_true")
    ap.add_argument("--no-plans", dest="plans", action="store_false",
                    help="time only the skinny kernel's default plan, not the others")
    a = ap.parse_args()
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"--shapes: unknown {bad}; known: {list(SHAPES)}")
    ms = tuple(int(v) for v in a.ms.split(",")) if a.ms else (QUICK_MS if a.quick else MS)
    if importlib.util.find_spec("dflash_ops") is None:  # from a checkout without installing
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("sweep_linear: needs a CUDA GPU", file=sys.stderr)
        return 2
    from dflash_ops.bench.harness import env_info, floor_us, measure_floors, time_fn
    from dflash_ops.models import linear as L
    from dflash_ops import dispatch
    from dflash_ops.triton import context as tc

    has_cuda = dispatch.has_backend("kv_proj", "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    bf16 = torch.bfloat16
    floors = measure_floors()
    print(f"floors: copy {floors['copy_GBps']:.0f} GB/s, bf16 GEMM {floors['gemm_TFLOPs']:.0f} "
          f"TFLOP/s", flush=True)

    def t_us(fn, ws):
        sets = [(wi,) for wi in ws]
        calls = 16 * len(sets) if len(sets) > 1 else 16
        return time_fn(fn, rotate=sets, graph=True, warmup_ms=5, rep_ms=40, calls=calls)["us"]

    def write(entries):
        """Every measurement so far to --out and (--write-table) the table: after each
        shape, so a run cut short keeps the shapes it finished."""
        env = env_info()
        doc = dict(env=env, floors=floors, entries=entries)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {a.out}")
        if a.write_table:
            # an entry needs a 2% win over cuBLAS (a tie is noise: cuBLAS stays); the C++
            # skinny kernel's (cfg ["cuda"]) where it also beats the best Triton launch
            keep = []
            for e in entries:
                if e["m"] not in L.M_BUCKETS:
                    continue
                tri = e["triton_us"] if e["cfg"] is not None else float("inf")
                sk = e.get("skinny_us") or float("inf")
                if sk < tri and sk < 0.98 * e["cublas_us"]:
                    keep.append(dict(e, cfg=list(L.CUDA_CFG)))
                elif tri < 0.98 * e["cublas_us"]:
                    keep.append(dict(e))
            for e in keep:
                e["measured"] = f"{doc['env'].get('date')} {doc['env'].get('commit')}"
            # (N, K, M) not measured in this run keep their entry from the table on disk
            done = {(e["n"], e["k"], e["m"]) for e in entries}
            old_doc = json.loads(L.TABLE_PATH.read_text()) if L.TABLE_PATH.exists() else {}
            kept = [e for e in old_doc.get("entries", []) if (e["n"], e["k"], e["m"]) not in done]
            # exact mode: the fastest launch of its family at every M bucket measured (kept
            # even where the default launch is as fast: the choice is measured either way)
            exact = [dict(name=e["name"], n=e["n"], k=e["k"], m=e["m"],
                          cfg=e["exact_best_cfg"], us=e["exact_best"], default_us=e["exact"],
                          cublas_us=e["cublas_us"],
                          measured=f"{doc['env'].get('date')} {doc['env'].get('commit')}")
                     for e in entries if "exact_best_cfg" in e and e["m"] in L.M_BUCKETS]
            # old entries still in exact mode's family (a changed EXACT_CFG or split rule
            # retires them)
            exact += [e for e in old_doc.get("exact", []) if (e["n"], e["k"], e["m"]) not in done
                      and L.exact_compatible(tuple(e["cfg"]), e["n"], e["k"]) is None]
            # other GPUs' end-to-end checks carry over (they judged the previous table: the
            # printed line asks for a rerun there)
            holds_on = [h for h in old_doc.get("holds_on", [])
                        if h["gpu"] != doc["env"].get("gpu")]
            L.TABLE_PATH.write_text(json.dumps(dict(env=doc["env"], holds_on=holds_on,
                                                    entries=keep + kept, exact=exact),
                                               indent=1, default=str))
            if holds_on:
                print(f"the table still holds on {', '.join(h['gpu'] for h in holds_on)} "
                      "(its holds_on): rerun bench_e2e there with and without it")
            print(f"wrote {L.TABLE_PATH} ({len(keep)} Triton / CUDA wins of {len(entries)} shapes "
                  f"measured, {len(kept)} entries kept from the previous table; {len(exact)} "
                  f"exact-mode entries)")

    entries, t0 = [], time.time()
    for name in shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=bf16) * k ** -0.5
        # In a model every layer's weight streams from HBM: rotate over copies totalling
        # >= ROTATE_BYTES (> 2x the 50 MB L2), so no call finds its weight in L2.
        ws = [w] + [w.clone() for _ in range(-(-ROTATE_BYTES // (2 * n * k)) - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=bf16)
            want = F.linear(x.float(), w.float())
            lin = t_us(lambda wi: F.linear(x, wi), ws)
            fl = floor_us(floors, bytes_moved=2 * (m * k + n * k + m * n), flops=2 * m * n * k)
            rows = []
            for cfg in dict.fromkeys(grid(m, tc)):
                o = torch.empty(m, n, device="cuda", dtype=bf16)
                try:
                    tc.launch_proj(x, w, None, o, cfg)
                    torch.cuda.synchronize()
                    err = ((o.float() - want).abs().max() / want.abs().max()).item()
                    if not err <= 2e-2:
                        rows.append((float("inf"), cfg, f"WRONG (rel err {err:.2e})"))
                        continue
                    rows.append((t_us(lambda wi: tc.launch_proj(x, wi, None, o, cfg), ws),
                                 cfg, ""))
                except Exception as ex:  # noqa: BLE001 - e.g. out of shared memory
                    rows.append((float("inf"), cfg, f"failed: {type(ex).__name__}: "
                                                    f"{str(ex)[:80]}"))
            rows.sort(key=lambda r: r[0])
            best_us, best = rows[0][0], rows[0][1]
            # the C++ kv_proj at M <= 8: its skinny kernel (split-K over a cluster, sm_90)
            skinny = {}
            if m <= L.SKINNY_MAX_ROWS and has_cuda:
                try:
                    with torch.profiler.profile(
                            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        o = torch.ops.dflash_cuda.kv_proj(x, w, None)
                        torch.cuda.synchronize()
                    ran = any("skinny_kernel" in e.key for e in prof.key_averages())
                    err = ((o.float() - want).abs().max() / want.abs().max()).item()
                    if not ran:  # kv_proj fell back to cuBLAS: nothing of ours to time
                        skinny["skinny_error"] = "not taken (kv_proj ran cuBLAS)"
                    elif err <= 2e-2:
                        skinny["skinny_us"] = t_us(
                            lambda wi: torch.ops.dflash_cuda.kv_proj(x, wi, None), ws)
                    else:
                        skinny["skinny_error"] = f"WRONG (rel err {err:.2e})"
                except Exception as e:  # noqa: BLE001
                    skinny["skinny_error"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
            # the skinny kernel's other plans (DFLASH_OPS_SKINNY_PLAN, read at each call: the
            # capture bakes it in), each checked before it is timed; where one beats the
            # shape's default plan, skinny_plan (csrc/context.cu) is the place to say so
            if "skinny_us" in skinny and a.plans:
                plan_us = {}
                for plan in skinny_plans(n, k, sms):
                    os.environ[PLAN_ENV] = plan
                    try:
                        with torch.profiler.profile(
                                activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                            o = torch.ops.dflash_cuda.kv_proj(x, w, None)
                            torch.cuda.synchronize()
                        err = ((o.float() - want).abs().max() / want.abs().max()).item()
                        if not any("skinny_kernel" in e.key for e in prof.key_averages()):
                            plan_us[plan] = "not taken (its cluster cannot run: cuBLAS ran)"
                        elif err > 2e-2:
                            plan_us[plan] = f"WRONG (rel err {err:.2e})"
                        else:
                            plan_us[plan] = t_us(
                                lambda wi: torch.ops.dflash_cuda.kv_proj(x, wi, None), ws)
                    except Exception as e:  # noqa: BLE001
                        plan_us[plan] = f"failed: {type(e).__name__}: {str(e)[:80]}"
                    finally:
                        os.environ.pop(PLAN_ENV, None)
                skinny["skinny_plans"] = plan_us
                timed = {p_: v for p_, v in plan_us.items() if isinstance(v, float)}
                if timed:
                    bp = min(timed, key=timed.get)
                    skinny["skinny_best_plan"], skinny["skinny_best_us"] = bp, timed[bp]
            # exact mode's default launch (models.linear.exact_default: one tile and split per
            # shape, serial or not by M; not the table's pick) and the same tile without the
            # split (session 21's)
            ex = {}
            for key, cfg in (("exact", L.exact_default(m, n, k, x.device)),
                             ("exact_nosplit", tc.ProjCfg(*L.EXACT_CFG))):
                o = torch.empty(m, n, device="cuda", dtype=bf16)
                ex[key], ex[key + "_cfg"] = float("inf"), list(cfg)
                try:  # a failure is recorded (inf and the error), the sweep goes on
                    tc.launch_proj(x, w, None, o, cfg)
                    torch.cuda.synchronize()
                    err = ((o.float() - want).abs().max() / want.abs().max()).item()
                    if err <= 2e-2:
                        ex[key] = t_us(lambda wi: tc.launch_proj(x, wi, None, o, cfg), ws)
                    else:
                        ex[key + "_error"] = f"WRONG (rel err {err:.2e})"
                except Exception as e:  # noqa: BLE001
                    ex[key + "_error"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
            # exact mode's fastest launch of its family, each checked bit for bit against the
            # default launch's output on the same inputs (a launch that differs is listed,
            # never chosen: it would break the row's independence of M)
            ref = torch.empty(m, n, device="cuda", dtype=bf16)
            ex_rows = []
            if ex["exact"] < float("inf"):
                tc.launch_proj(x, w, None, ref, tc.ProjCfg(*ex["exact_cfg"]))
                for cfg in dict.fromkeys(exact_grid(m, n, k, L, tc)):
                    o = torch.empty(m, n, device="cuda", dtype=bf16)
                    try:
                        tc.launch_proj(x, w, None, o, cfg)
                        torch.cuda.synchronize()
                        if not torch.equal(o.view(torch.int16), ref.view(torch.int16)):
                            ex_rows.append((float("inf"), cfg, "BITS DIFFER from the default"))
                            continue
                        ex_rows.append((t_us(lambda wi: tc.launch_proj(x, wi, None, o, cfg),
                                             ws), cfg, ""))
                    except Exception as e:  # noqa: BLE001
                        ex_rows.append((float("inf"), cfg, f"failed: {type(e).__name__}: "
                                                           f"{str(e)[:80]}"))
                ex_rows.sort(key=lambda r: r[0])
            if ex_rows and ex_rows[0][0] < float("inf"):
                ex["exact_best"], ex["exact_best_cfg"] = ex_rows[0][0], list(ex_rows[0][1])
            ex["exact_bits_differ"] = sum(r[2].startswith("BITS") for r in ex_rows)
            print(f"\n{name} M={m} N={n} K={k}: cuBLAS {lin:.1f} us ({lin / fl:.2f}x floor "
                  f"{fl:.1f} us); best triton {best_us:.1f} us ({best_us / lin:.2f}x cuBLAS) "
                  f"[{time.time() - t0:.0f} s]", flush=True)
            for us, cfg, note in rows[:4] + [r for r in rows if r[2]][:3]:
                print(f"   {us:8.1f} us  {us / lin:5.2f}x cuBLAS  {us / fl:5.2f}x floor  {cfg} "
                      f"{note}", flush=True)
            if "skinny_us" in skinny:
                us = skinny["skinny_us"]
                print(f"   {us:8.1f} us  {us / lin:5.2f}x cuBLAS  {us / fl:5.2f}x floor  the C++ "
                      f"skinny kernel (kv_proj)", flush=True)
            elif skinny:
                print(f"   the C++ skinny kernel: {skinny['skinny_error']}", flush=True)
            if "skinny_best_plan" in skinny:
                us, plans = skinny["skinny_best_us"], skinny["skinny_plans"]
                bad = [f"{p_}: {v}" for p_, v in plans.items() if not isinstance(v, float)]
                print(f"   {us:8.1f} us  {us / lin:5.2f}x cuBLAS  {us / fl:5.2f}x floor  the "
                      f"skinny kernel's best of {len(plans)} plans (MT,KG,SPLITS,U) "
                      f"{skinny['skinny_best_plan']}" + (f"; {'; '.join(bad[:3])}" if bad else ""),
                      flush=True)
            ec = ex["exact_cfg"]
            print(f"   exact: {ex['exact']:.1f} us ({ex['exact'] / lin:.2f}x cuBLAS, "
                  f"{ex['exact'] / fl:.2f}x floor; split {ec[8]}, "
                  f"{'serial' if ec[9] else 'a program a slice'}); without the split "
                  f"{ex['exact_nosplit']:.1f} us {ex.get('exact_error', '')} "
                  f"{ex.get('exact_nosplit_error', '')}", flush=True)
            if "exact_best" in ex:
                print(f"   exact, fastest of {len(ex_rows)} launches of its family: "
                      f"{ex['exact_best']:.1f} us ({ex['exact_best'] / lin:.2f}x cuBLAS, "
                      f"{ex['exact_best'] / fl:.2f}x floor) {tuple(ex['exact_best_cfg'])}; "
                      f"{ex['exact_bits_differ']} gave other bits", flush=True)
            for us, cfg, note in [r for r in ex_rows if r[2]][:3]:
                print(f"   exact candidate {cfg}: {note}", flush=True)
            entries.append(dict(name=name, n=n, k=k, m=m, cublas_us=lin, floor_us=fl,
                                triton_us=best_us if best_us < float("inf") else None,
                                cfg=list(best) if best_us < float("inf") else None, **skinny,
                                **ex))
        write(entries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
