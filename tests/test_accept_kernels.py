"""The greedy acceptance + commit: the Triton kernel (under TRITON_INTERPRET=1 on CPU, and on the
GPU) against the torch version on random cases: every acceptance length, stop tokens inside and
after the accepted prefix, max_new_tokens cuts (including no room left), distinct rows in any
order, B 2..16, no stop list."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dflash_ops.speculator.accept import greedy_commit


def make_case(seed, r=5, n=8, b=8, vocab=6, n_stop=2, max_new=20, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    post = torch.randint(0, vocab, (r, b), generator=g)
    block = torch.randint(0, vocab, (r, b), generator=g)
    # a chosen acceptance length per request: drafts copy post up to it
    acc = torch.randint(0, b, (r,), generator=g)
    for i in range(r):
        block[i, 1:acc[i] + 1] = post[i, :acc[i]]
    rows = torch.randperm(n, generator=g)[:r]
    n_out = torch.randint(1, max_new + 1, (n,), generator=g)  # some with no room left
    start = torch.randint(5, 50, (n,), generator=g)
    last = torch.randint(0, vocab, (n,), generator=g)
    out = torch.randint(0, vocab, (n, max_new + b + 1), generator=g)
    stops = torch.randperm(vocab, generator=g)[:n_stop]
    return [t.to(device) for t in (block, post, rows, n_out, start, last, out, stops)] + [max_new]


def check(device, backend, seeds=range(12)):
    for seed in seeds:
        for b, n_stop in ((8, 2), (2, 1), (16, 0), (5, 3)):
            args = make_case(seed, b=b, n_stop=n_stop, device=device)
            want_state = [a.clone() for a in args[:-1]]
            want = greedy_commit(*want_state, args[-1], backend="torch")
            got_state = [a.clone() for a in args[:-1]]
            got = greedy_commit(*got_state, args[-1], backend=backend)
            what = f"seed {seed} B {b} stops {n_stop}"
            for name, x, y in zip(("kept", "done", "ctx_pos"), got, want):
                assert torch.equal(x.cpu(), y.cpu()), f"{what}: {name} {x} vs {y}"
            for name, i in (("n_out", 3), ("start", 4), ("last", 5)):
                assert torch.equal(got_state[i].cpu(), want_state[i].cpu()), f"{what}: {name}"
            # tokens: the committed columns (the torch version also writes garbage past them)
            rows, n0, kept = args[2].cpu(), args[3].cpu(), want[0].cpu()
            for k, row in enumerate(rows.tolist()):
                cols = slice(int(n0[row]), int(n0[row] + kept[k]))
                assert torch.equal(got_state[6].cpu()[row, cols], want_state[6].cpu()[row, cols]), \
                    f"{what}: tokens of row {row}"
            untouched = [i for i in range(args[6].shape[0]) if i not in rows.tolist()]
            assert torch.equal(got_state[6].cpu()[untouched], args[6].cpu()[untouched])


def test_torch_version_cases_cover_stops_and_cuts():
    """The case generator reaches every branch: full acceptance, stops, no room."""
    seen = set()
    for seed in range(24):
        args = make_case(seed, n_stop=2 if seed % 2 else 0)
        kept, done, _ = greedy_commit(*[a.clone() for a in args[:-1]], args[-1], backend="torch")
        n0 = args[3][args[2]]
        seen |= {"no-room" for k in range(len(kept)) if n0[k] >= args[-1]}
        seen |= {"done" for x in done.tolist() if x} | {"open" for x in done.tolist() if not x}
        seen |= {"full" for x in kept.tolist() if x == 8}
    assert seen >= {"no-room", "done", "open", "full"}, seen


def test_bad_backend():
    with pytest.raises(ValueError, match="backend must be"):
        greedy_commit(*make_case(0), backend="gpu")


_SCRIPT = r"""
import tests.test_accept_kernels as t
t.check("cpu", "triton", seeds=range(4))
print("interp-ok")
"""


def test_triton_kernel_under_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "interp-ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_cuda_backend_without_the_extension_raises():
    from dflash_ops import _ext
    if _ext.load()["how"] != "absent":
        pytest.skip("the CUDA extension is loaded here")
    with pytest.raises(RuntimeError, match="needs the CUDA extension"):
        greedy_commit(*make_case(0), backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_kernels_gpu(backend):
    check("cuda", backend)


@pytest.mark.gpu
def test_cuda_kernel_rejects_bad_inputs_naming_them():
    args = make_case(0, device="cuda")
    block, post, rows, n_out, start, last, out, stops, max_new = args
    r, b = block.shape
    outs = (torch.empty(r, dtype=torch.long, device="cuda"),
            torch.empty(r, dtype=torch.bool, device="cuda"),
            torch.empty(r, b, dtype=torch.long, device="cuda"))
    op = torch.ops.dflash_spec.greedy_commit_
    cases = [("post", dict(post=post[:, :-1])), ("rows", dict(rows=rows[:-1])),
             ("start", dict(start=start[:-1])), ("block", dict(block=block.int())),
             ("stop_ids", dict(stops=stops.float())), ("block", dict(block=torch.zeros(
                 r, 33, dtype=torch.long, device="cuda"), post=torch.zeros(
                 r, 33, dtype=torch.long, device="cuda")))]
    for name, change in cases:
        kw = dict(block=block, post=post, rows=rows, n_out=n_out, start=start, last=last,
                  out=out, stops=stops)
        kw.update(change)
        with pytest.raises(ValueError, match=name):
            op(kw["block"], kw["post"], kw["rows"], kw["n_out"], kw["start"], kw["last"],
               kw["out"], kw["stops"], max_new, *outs)
