"""prepare_step_ (a speculator step's static inputs in one launch): the torch version against the
contract written out as loops, the Triton kernel (under TRITON_INTERPRET=1 on CPU, and on the
GPU) and the CUDA kernel against the torch version on random cases: with and without drafts
and context rows, padding rows, rows in any order, B 1..16; outputs poisoned first; named
errors on bad arguments with nothing written."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_interpreted

from dflash_ops.speculator.prepare import prepare_step_

POISON = -7777


def make_case(seed, r=3, n=7, b=8, pad=2, rc=2, c_extra=1, drafts=True, ctx=True,
              device="cpu"):
    """(inputs dict, outputs dict poisoned). Outputs: block [r + pad, b], ... ctx [(rc +
    c_extra) * b] (None without ctx)."""
    g = torch.Generator().manual_seed(seed)
    ins = dict(rows=torch.randperm(n, generator=g)[:r],
               last=torch.randint(0, 1000, (n,), generator=g),
               start=torch.randint(0, 5000, (n,), generator=g),
               drafts=torch.randint(0, 1000, (r, b - 1), generator=g) if drafts else None,
               ctx_rows=torch.randperm(n, generator=g)[:rc] if ctx else None,
               ctx_pos=(torch.where(torch.rand(rc, b, generator=g) < 0.3, -1,
                                    torch.randint(0, 5000, (rc, b), generator=g))
                        if ctx else None))
    p = r + pad
    outs = dict(block_out=torch.full((p, b), POISON), requests_out=torch.full((p,), POISON),
                start_out=torch.full((p,), POISON),
                ctx_req_out=torch.full(((rc + c_extra) * b,), POISON) if ctx else None,
                ctx_pos_out=torch.full(((rc + c_extra) * b,), POISON) if ctx else None)
    move = {k: (v.to(device) if v is not None else None) for k, v in ins.items()}
    return move, {k: (v.to(device) if v is not None else None) for k, v in outs.items()}


def call(ins, outs, fill_id=999, scratch=6, backend="torch"):
    prepare_step_(ins["rows"], ins["last"], ins["start"], ins["drafts"], ins["ctx_rows"],
                  ins["ctx_pos"], fill_id, scratch, outs["block_out"], outs["requests_out"],
                  outs["start_out"], outs["ctx_req_out"], outs["ctx_pos_out"], backend=backend)


def expected(ins, outs, fill_id=999, scratch=6):
    """The contract as loops (independent of prepare_step_ref)."""
    p, b = outs["block_out"].shape
    rows = ins["rows"].tolist()
    block, reqs, starts = [], [], []
    for i in range(p):
        if i < len(rows):
            row = rows[i]
            rest = ins["drafts"][i].tolist() if ins["drafts"] is not None else [fill_id] * (b - 1)
            block.append([int(ins["last"][row])] + rest)
            reqs.append(row)
            starts.append(int(ins["start"][row]))
        else:
            block.append([fill_id] * b)
            reqs.append(scratch)
            starts.append(0)
    want = dict(block_out=block, requests_out=reqs, start_out=starts)
    if outs["ctx_req_out"] is not None:
        c = outs["ctx_req_out"].shape[0]
        cr = ins["ctx_rows"].tolist() if ins["ctx_rows"] is not None else []
        want["ctx_req_out"] = [cr[e // b] if e // b < len(cr) else scratch for e in range(c)]
        want["ctx_pos_out"] = [int(ins["ctx_pos"][e // b, e % b]) if e // b < len(cr) else -1
                               for e in range(c)]
    return want


CONFIGS = [dict(), dict(drafts=False), dict(ctx=False), dict(drafts=False, ctx=False),
           dict(b=1, drafts=False), dict(b=16, r=5, pad=3, rc=4, c_extra=4), dict(r=0, pad=4),
           dict(rc=0, c_extra=3), dict(pad=0, c_extra=0), dict(b=5, r=6, rc=6, pad=1)]


def check(device, backend, seeds=range(3)):
    for seed in seeds:
        for cfg in CONFIGS:
            ins, outs = make_case(seed, device=device, **cfg)
            call(ins, outs, backend=backend)
            want = expected({k: (v.cpu() if v is not None else None) for k, v in ins.items()},
                            outs)
            for name, w in want.items():
                got = outs[name].cpu().tolist()
                assert got == w, f"{backend} seed {seed} {cfg}: {name} {got} vs {w}"


def test_torch_version_matches_the_contract():
    check("cpu", "torch")


def test_bad_arguments_named_and_nothing_written():
    ins, outs = make_case(0)
    cases = [("rows must be", dict(rows=ins["rows"].int())),
             ("start must be", dict(start=ins["start"][:-1])),
             ("drafts must be", dict(drafts=ins["drafts"][:, :-1])),
             ("ctx_pos must be", dict(ctx_pos=ins["ctx_pos"][:, :-1].contiguous())),
             ("ctx_rows and ctx_pos go together", dict(ctx_pos=None)),
             ("block_out must be", dict(block_out=torch.zeros(1, 8, dtype=torch.long))),
             ("requests_out must be", dict(requests_out=torch.zeros(4, dtype=torch.long))),
             ("ctx_req_out must be", dict(ctx_req_out=torch.zeros(9, dtype=torch.long))),
             ("ctx_pos_out must be", dict(ctx_pos_out=torch.zeros(24, dtype=torch.int32)))]
    for match, change in cases:
        i2 = dict(ins, **{k: v for k, v in change.items() if k in ins})
        o2 = {k: (v.clone() if v is not None else None) for k, v in outs.items()}
        o2.update({k: v for k, v in change.items() if k in outs})
        before = {k: (v.clone() if v is not None else None) for k, v in o2.items()}
        with pytest.raises(ValueError, match=match):
            call(i2, o2)
        for k, v in o2.items():
            assert v is None or torch.equal(v, before[k]), f"{match}: {k} was written"


_SCRIPT = """
import tests.test_prepare_kernels as t
t.check("cpu", "triton", seeds=range(2))
print("interp-ok")
"""


def test_triton_kernel_under_interpreter():
    run_interpreted(_SCRIPT, timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_kernels_gpu(backend):
    check("cuda", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_kernel_replays_in_a_graph_with_new_state(backend):
    """Captured once, replayed after the device state (last, start, drafts, rows) changed."""
    ins, outs = make_case(0, device="cuda")
    call(ins, outs, backend=backend)  # compile / warm up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(ins, outs, backend=backend)
    for seed in (1, 2):
        new, _ = make_case(seed, device="cuda")
        for k in ins:
            ins[k].copy_(new[k])
        for v in outs.values():
            v.fill_(POISON)
        g.replay()
        torch.cuda.synchronize()
        want = expected({k: v.cpu() for k, v in ins.items()}, outs)
        for name, w in want.items():
            assert outs[name].cpu().tolist() == w, f"{backend} replay {seed}: {name}"


@pytest.mark.gpu
def test_cuda_kernel_rejects_bad_inputs_naming_them():
    ins, outs = make_case(0, device="cuda")
    op = torch.ops.dflash_spec.prepare_step_
    b = outs["block_out"].shape[1]
    cases = [(": rows must be int64", dict(rows=ins["rows"].int())),
             (": start must have shape", dict(start=ins["start"][:-1])),
             (": drafts must have shape", dict(drafts=ins["drafts"][:, :-1].contiguous())),
             (": ctx_pos must have shape", dict(ctx_pos=ins["ctx_pos"][:, :-1].contiguous())),
             (": ctx_req_out must have a multiple of B", dict(
                 ctx_req_out=torch.zeros(b + 1, dtype=torch.long, device="cuda"))),
             (": block_out must be \\[P, B\\]", dict(
                 block_out=torch.zeros(1, b, dtype=torch.long, device="cuda")))]
    for match, change in cases:
        kw = dict(ins, **outs)
        kw.update(change)
        with pytest.raises(ValueError, match=match):
            op(kw["rows"], kw["last"], kw["start"], kw["drafts"], kw["ctx_rows"], kw["ctx_pos"],
               999, 6, kw["block_out"], kw["requests_out"], kw["start_out"],
               kw["ctx_req_out"], kw["ctx_pos_out"])
