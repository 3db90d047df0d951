"""session 43: the selector walk's two launches timed apart, with the table launch's
num_stages / num_warps varied (R 1 and 64 requests, J 7, k 16, rank 256, V 248320, bf16)."""
import torch
import triton
from dflash_ops.bench.harness import time_fn
from dflash_ops.ops.select import select_candidates_ref
from dflash_ops.triton import select as ts
from dflash_ops.triton._pdl import pdl_kwargs

V, J, K, RANK = 248320, 7, 16, 256
pred = torch.randn(V, RANK, device="cuda", dtype=torch.bfloat16)
succ = torch.randn(V, RANK, device="cuda", dtype=torch.bfloat16)
for r in (1, 64):
    unary = torch.randn(r, J, K, device="cuda")
    cand = torch.randint(0, V, (r, J, K), device="cuda")
    hid = torch.randn(r, J, RANK, device="cuda", dtype=torch.bfloat16)
    anchor = torch.randint(0, V, (r,), device="cuda")
    want = select_candidates_ref(unary, cand, hid, anchor, pred, succ, 0.0)
    kp, bd = 16, 256
    tab = torch.empty((r, J, kp, kp), device="cuda")
    path = torch.empty((r, J), dtype=torch.long, device="cuda")
    q = torch.empty((r, J, K), device="cuda")
    def table(st, w):
        ts._table_kernel[(r, J)](unary, cand, hid, anchor, pred, succ, tab, J, K, RANK, V, KP=kp,
                                 BD=bd, num_warps=w, num_stages=st, **pdl_kwargs(unary.device))
    def walk(w):
        ts._walk_kernel[(r,)](tab, cand, unary, path, q, J, K, 1.0, SAMPLE=False, KP=kp,
                              num_warps=w, **pdl_kwargs(unary.device))
    for st, w in ((3, 4), (1, 4), (1, 2), (1, 8), (2, 4)):
        table(st, w); walk(1)
        ok = torch.equal(path, want[0])
        t = time_fn(lambda: table(st, w), graph=True)["us"]
        print(f"R {r} table stages {st} warps {w}: {t:.2f} us {'ok' if ok else 'WRONG'}")
    for w in (1, 2):
        walk(w)
        t = time_fn(lambda: walk(w), graph=True)["us"]
        print(f"R {r} walk warps {w}: {t:.2f} us {'ok' if torch.equal(path, want[0]) else 'WRONG'}")
    t = time_fn(lambda: ts.select_candidates(unary, cand, hid, anchor, pred, succ, 0.0), graph=True)["us"]
    print(f"R {r} select_candidates (both): {t:.2f} us")
