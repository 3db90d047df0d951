"""The loop ops: ``greedy_commit_`` / ``sample_commit_`` (acceptance + commit of a verified block)
and ``prepare_step_`` (a step's static inputs in one launch).

Commit: the Triton kernel (under TRITON_INTERPRET=1 on CPU, and on the GPU) against the torch
version on random cases: every acceptance length, stop tokens inside and after the accepted
prefix, max_new_tokens cuts (including no room left), distinct rows in any order, B 2..16, no
stop list. The same for the sampling acceptance (speculative rejection sampling + commit), whose
torch version is also checked against its definition: the inverse-CDF draw gives each token its
probability mass, the match follows the acceptance rule.

Prepare: the torch version against the contract written out as loops, the Triton kernel against
it on random cases: with and without drafts and context rows, padding rows, rows in any order,
B 1..16; outputs poisoned first; named errors on bad arguments with nothing written.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_interpreted

from dflash_ops import dispatch
from dflash_ops.ops.loop import (_commit_state, greedy_commit, inverse_cdf, prepare_step_,
                                 sample_accept_ref, sample_commit)

LOOP_OPS = ("greedy_commit_", "sample_commit_", "prepare_step_")


def forced(backend, fn, *args):
    """fn(*args) with the loop ops on ``backend``."""
    with dispatch.use_backend(backend, ops=LOOP_OPS):
        return fn(*args)


def make_commit_case(seed, r=5, n=8, b=8, vocab=6, n_stop=2, max_new=20, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    post = torch.randint(0, vocab, (r, b), generator=g)
    block = torch.randint(0, vocab, (r, b), generator=g)
    # a chosen acceptance length per request: drafts copy post up to it
    acc = torch.randint(0, b, (r,), generator=g)
    for i in range(r):
        block[i, 1:acc[i] + 1] = post[i, :acc[i]]
    state = _commit_state(g, r, n, b, vocab, max_new, n_stop, device)
    return [block.to(device), post.to(device), *state, max_new]


def check_greedy(device, backend, seeds=range(12)):
    for seed in seeds:
        for b, n_stop in ((8, 2), (2, 1), (16, 0), (5, 3)):
            args = make_commit_case(seed, b=b, n_stop=n_stop, device=device)
            want_state = [a.clone() for a in args[:-1]]
            want = forced("torch", greedy_commit, *want_state, args[-1])
            got_state = [a.clone() for a in args[:-1]]
            got = forced(backend, greedy_commit, *got_state, args[-1])
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
        args = make_commit_case(seed, n_stop=2 if seed % 2 else 0)
        kept, done, _ = greedy_commit(*[a.clone() for a in args[:-1]], args[-1])
        n0 = args[3][args[2]]
        seen |= {"no-room" for k in range(len(kept)) if n0[k] >= args[-1]}
        seen |= {"done" for x in done.tolist() if x} | {"open" for x in done.tolist() if not x}
        seen |= {"full" for x in kept.tolist() if x == 8}
    assert seen >= {"no-room", "done", "open", "full"}, seen


def _dist(g, shape, zero_frac=0.3):
    """Random weights over the last dim, about zero_frac of them exactly 0, each a multiple of
    2^-12 below 2^-8: their fp32 sums are exact in any order (up to 2^20 entries), so every
    backend's running sum, whatever its order, lands on the same values and the draws agree
    exactly. Rows are not normalised (the kernels never assume it)."""
    w = torch.floor(torch.rand(shape, generator=g) ** 2 * 16)
    w = torch.where(torch.rand(shape, generator=g) < zero_frac, torch.zeros_like(w), w)
    w[..., 0] = w[..., 0].clamp_min(1)  # never an all-zero row
    return w * 2.0 ** -12


def _strided(t, pad):
    """t [R, J, V] as a view with row strides (J+1) * (V+pad) and V+pad (not contiguous)."""
    r, j, v = t.shape
    big = torch.full((r, j + 1, v + pad), float("nan"), dtype=t.dtype, device=t.device)
    big[:, :j, :v] = t
    return big[:, :j, :v]


def make_sample_case(seed, r=6, n=9, b=8, vocab=300, n_stop=2, max_new=20, device="cpu"):
    """(block, p, q, u, u_res, rows, n_out, start, last, out, stops, max_new): drafts drawn from
    q; request i has p = q on its first acc[i] positions (those drafts are always accepted), the
    last request has p = q everywhere (the bonus is drawn from p[B-1]) and one request a p row
    scaled by 0.5 at its first position (max(p - q, 0) is all zero there: the draw falls back to
    p)."""
    g = torch.Generator().manual_seed(seed)
    q = _dist(g, (r, b - 1, vocab))
    p = _dist(g, (r, b, vocab))
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(r, b - 1)
    acc = torch.randint(0, b, (r,), generator=g)
    for i in range(r):
        p[i, :acc[i]] = q[i, :acc[i]]
    p[-1, :b - 1] = q[-1]
    if r > 1:
        p[0, 0] = 0.5 * q[0, 0]  # unnormalised on purpose: rejection with zero residual mass
    block = torch.cat([torch.randint(0, vocab, (r, 1), generator=g), drafts], 1)
    u = torch.rand((r, b - 1), generator=g)
    u_res = torch.rand((r,), generator=g)
    rows = torch.randperm(n, generator=g)[:r]
    n_out = torch.randint(1, max_new + 1, (n,), generator=g)
    start = torch.randint(5, 50, (n,), generator=g)
    last = torch.randint(0, vocab, (n,), generator=g)
    out = torch.randint(0, vocab, (n, max_new + b + 1), generator=g)
    stops = drafts.reshape(-1)[torch.randperm(drafts.numel(), generator=g)[:n_stop]]
    return [t.to(device) for t in (block, p, q, u, u_res, rows, n_out, start, last, out,
                                   stops)] + [max_new]


def check_sample(device, backend, seeds=range(8), shapes=((8, 2, 300), (2, 1, 37), (16, 0, 5000),
                                                          (5, 3, 4097))):
    for seed in seeds:
        for b, n_stop, vocab in shapes:
            args = make_sample_case(seed, b=b, n_stop=n_stop, vocab=vocab, device=device)
            if seed % 2:  # p, q as strided views (their row strides differ from each other's)
                args[1], args[2] = _strided(args[1], 7), _strided(args[2], 3)
            # copies of the state the call updates (n_out, start, last, out); the inputs as
            # they are (a clone would make the strided p / q contiguous)
            want_state = [a.clone() if i in (6, 7, 8, 9) else a for i, a in enumerate(args[:-1])]
            want = forced("torch", sample_commit, *want_state, args[-1])
            got_state = [a.clone() if i in (6, 7, 8, 9) else a for i, a in enumerate(args[:-1])]
            got = forced(backend, sample_commit, *got_state, args[-1])
            what = f"seed {seed} B {b} stops {n_stop} V {vocab}"
            for name, x, y in zip(("kept", "done", "ctx_pos"), got, want):
                assert torch.equal(x.cpu(), y.cpu()), f"{what}: {name} {x} vs {y}"
            for name, i in (("n_out", 6), ("start", 7), ("last", 8)):
                assert torch.equal(got_state[i].cpu(), want_state[i].cpu()), f"{what}: {name}"
            rows, n0, kept = args[5].cpu(), args[6].cpu(), want[0].cpu()
            for k, row in enumerate(rows.tolist()):
                cols = slice(int(n0[row]), int(n0[row] + kept[k]))
                assert torch.equal(got_state[9].cpu()[row, cols], want_state[9].cpu()[row, cols]), \
                    f"{what}: tokens of row {row}"


def check_sample_sparse(device, backend, seeds=range(6), shapes=((4, 40, 5), (8, 300, 16),
                                                                 (2, 37, 1), (5, 5000, 20))):
    """A sparse q (k candidates a row, drafts among them, one draft replaced by a token no row
    lists) on ``backend`` against the torch backend on the same q scattered into the
    vocabulary (``dense_q``): the same commit, state and tokens."""
    from dflash_ops.ops.loop import _sparse_q_sample, dense_q
    for seed in seeds:
        for b, vocab, k in shapes:
            kw = _sparse_q_sample(seed, device, r=5, b=b, vocab=vocab, k=k)
            if seed % 2:  # a draft with q = 0 (not a candidate): always rejected
                kw["block"][0, 1] = int(kw["q_idx"][0, 0].max()) + 1 if vocab > k else 0
            dense = dict(kw, q=dense_q(kw["q"], kw["q_idx"], vocab), q_idx=None)
            outs = []
            for bk, args in ((backend, kw), ("torch", dense)):
                a = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in args.items()}
                with dispatch.use_backend(bk, ops=LOOP_OPS):
                    torch.ops.dflash.sample_commit_.default(*a.values())
                outs.append(a)
            what = f"seed {seed} B {b} V {vocab} k {k}"
            for name in ("kept", "done", "ctx_pos", "n_out", "start", "last", "out_tokens"):
                assert torch.equal(outs[0][name].cpu(), outs[1][name].cpu()), f"{what}: {name}"


def test_sparse_q_torch_equals_dense():
    check_sample_sparse("cpu", "torch")


def test_inverse_cdf_gives_each_token_its_mass():
    """Stratified uniforms (i + 0.5) / N: token k is drawn N * w_k / sum(w) times, +-1; zero-weight
    tokens never (also at u just below 1)."""
    g = torch.Generator().manual_seed(3)
    w = _dist(g, (4, 50)) * torch.tensor([[1.0], [3.0], [0.25], [7.0]])  # unnormalised rows
    n = 20000
    u = ((torch.arange(n) + 0.5) / n)
    draws = inverse_cdf(w.repeat_interleave(n, 0), u.repeat(4)).view(4, n)
    for i in range(4):
        counts = torch.bincount(draws[i], minlength=50).float()
        want = n * w[i] / w[i].sum()
        assert (counts - want).abs().max() <= 1.0 + 1e-6, (i, counts, want)
        assert counts[w[i] == 0].sum() == 0
    top = inverse_cdf(w, torch.full((4,), 1 - 2 ** -24))
    assert bool((w.gather(1, top[:, None]) > 0).all())


def check_sample_distribution(device, backend, n=4096, vocab=50):
    """n requests, one draft each that the target gives weight 0 (always rejected), stratified
    u_res = (i + 0.5) / n: the committed token k comes up n * w_k / sum(w) times +-1, w =
    max(p - q, 0), and never where w = 0."""
    g = torch.Generator().manual_seed(7)
    p1, q1 = _dist(g, (1, 2, vocab)), _dist(g, (1, 1, vocab))
    d = int(torch.nonzero(q1[0, 0] > 0)[-1])
    p1[0, 0, d] = 0.0  # the draft has no target weight: rejected whatever u
    w = (p1[0, 0] - q1[0, 0]).clamp_min(0)
    block = torch.tensor([[0, d]]).repeat(n, 1)
    u = torch.rand((n, 1), generator=g)
    u_res = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    state = (torch.arange(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
             torch.zeros(n, dtype=torch.long), torch.zeros(n, 4, dtype=torch.long),
             torch.zeros(0, dtype=torch.long))
    args = [t.to(device) for t in (block, p1.expand(n, -1, -1).contiguous(),
                                   q1.expand(n, -1, -1).contiguous(), u, u_res, *state)]
    kept, done, _ = forced(backend, sample_commit, *args, 8)
    assert bool((kept.cpu() == 1).all())  # the drawn token only
    counts = torch.bincount(args[9][:, 0].cpu(), minlength=vocab).float()
    want = n * w / w.sum()
    assert (counts - want).abs().max() <= 1.0 + 1e-6, (backend, counts, want)
    assert counts[w == 0].sum() == 0


def test_sample_commit_distribution_torch():
    check_sample_distribution("cpu", "torch")


def test_sample_accept_follows_the_rule():
    args = make_sample_case(1, r=6, b=8, vocab=40)
    block, p, q, u, u_res = args[:5]
    match, post = sample_accept_ref(block, p, q, u, u_res)
    for i in range(6):
        m = 0
        while m < 7:
            d = block[i, m + 1]
            if not u[i, m] * q[i, m, d] < p[i, m, d]:
                break
            m += 1
        assert int(match[i]) == m
        assert torch.equal(post[i, :m], block[i, 1:m + 1])  # accepted drafts
        qm = q[i, m] if m < 7 else torch.zeros_like(p[i, m])
        resid = (p[i, m] - qm).clamp_min(0)
        dist = resid if resid.sum() > 0 else p[i, m]
        assert dist[post[i, m]] > 0  # the draw comes from the right distribution's support
    assert int(match[-1]) == 7  # p == q: every draft accepted, the bonus drawn from p[B-1]
    assert int(match[0]) == 0  # p[0, 0] = q / 2 ... rejected at once unless u < 1/2
    # (seed 1: u[0, 0] >= 1/2; the zero-residual fallback drew from p)


def check_commit_bad_arguments(device):
    """One argument check for every backend (the dispatcher's): a ValueError naming the
    argument, the state tensors untouched."""
    args = make_sample_case(0, device=device)
    block, p, q, u, u_res, rows, n_out, start, last, out, stops, max_new = args
    post = torch.zeros_like(block)
    state = (n_out, start, last, out)
    before = [t.clone() for t in state]
    sample_bad = [("block", dict(block=block.int())), ("block", dict(block=block[:, :1])),
                  ("p", dict(p=p.double())), ("q", dict(q=q[:, :-1])), ("u", dict(u=u[:, :-1])),
                  ("u_res", dict(u_res=u_res[:-1])), ("rows", dict(rows=rows[:-1])),
                  ("start", dict(start=start[:-1])), ("last", dict(last=last.int())),
                  ("out_tokens", dict(out=out.t())), ("stop_ids", dict(stops=stops.float())),
                  ("p", dict(p=p.transpose(1, 2).contiguous().transpose(1, 2)))]
    for name, change in sample_bad:
        kw = dict(block=block, p=p, q=q, u=u, u_res=u_res, rows=rows, stops=stops, out=out)
        kw.update(change)
        with pytest.raises(ValueError, match=rf"dflash.sample_commit_: {name} must"):
            sample_commit(kw["block"], kw["p"], kw["q"], kw["u"], kw["u_res"], kw["rows"],
                          n_out, kw.get("start", start), kw.get("last", last), kw["out"],
                          kw["stops"], max_new)
    for name, change in [("post", dict(post=post[:, :-1])), ("rows", dict(rows=rows.float())),
                         ("n_out", dict(n_out=n_out[:, None])), ("block", dict(block=block[0]))]:
        kw = dict(block=block, post=post, rows=rows, n_out=n_out)
        kw.update(change)
        with pytest.raises(ValueError, match=rf"dflash.greedy_commit_: {name} must"):
            greedy_commit(kw["block"], kw["post"], kw["rows"], kw["n_out"], start, last, out,
                          stops, max_new)
    for t, b in zip(state, before):
        assert torch.equal(t, b)


def test_commit_bad_arguments_named_and_nothing_written():
    check_commit_bad_arguments("cpu")


POISON = -7777


def make_prepare_case(seed, r=3, n=7, b=8, pad=2, rc=2, c_extra=1, drafts=True, ctx=True,
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
    forced(backend, prepare_step_, ins["rows"], ins["last"], ins["start"], ins["drafts"],
           ins["ctx_rows"], ins["ctx_pos"], fill_id, scratch, outs["block_out"],
           outs["requests_out"], outs["start_out"], outs["ctx_req_out"], outs["ctx_pos_out"])


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


def check_prepare(device, backend, seeds=range(3)):
    for seed in seeds:
        for cfg in CONFIGS:
            ins, outs = make_prepare_case(seed, device=device, **cfg)
            call(ins, outs, backend=backend)
            want = expected({k: (v.cpu() if v is not None else None) for k, v in ins.items()},
                            outs)
            for name, w in want.items():
                got = outs[name].cpu().tolist()
                assert got == w, f"{backend} seed {seed} {cfg}: {name} {got} vs {w}"


def test_prepare_torch_version_matches_the_contract():
    check_prepare("cpu", "torch")


def test_prepare_bad_arguments_named_and_nothing_written():
    ins, outs = make_prepare_case(0)
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


_SCRIPT = r"""
import tests.test_loop_kernels as t
t.check_greedy("cpu", "triton", seeds=range(4))
t.check_sample("cpu", "triton", seeds=range(4))
t.check_sample_distribution("cpu", "triton", n=256)
t.check_prepare("cpu", "triton", seeds=range(2))
t.check_sample_sparse("cpu", "triton", seeds=range(2))
print("interp-ok")
"""


def test_triton_kernels_under_interpreter():
    run_interpreted(_SCRIPT, timeout=900)


@pytest.mark.gpu
def test_commit_kernels_gpu():
    check_sample_sparse("cuda", "triton")
    check_greedy("cuda", "triton")
    check_sample("cuda", "triton",
                 shapes=((8, 2, 300), (2, 1, 37), (16, 0, 151936), (5, 3, 4097), (32, 2, 1000)))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sample_commit_distribution_gpu(backend):
    check_sample_distribution("cuda", backend)


@pytest.mark.gpu
def test_bad_arguments_gpu():
    """The default (triton) path on CUDA tensors checks the same way."""
    assert dispatch.resolve("sample_commit_", "cuda") == "triton"
    check_commit_bad_arguments("cuda")


@pytest.mark.gpu
def test_prepare_kernel_gpu():
    check_prepare("cuda", "triton")


@pytest.mark.gpu
def test_prepare_kernel_replays_in_a_graph_with_new_state():
    """Captured once (dispatch.capture_graph), replayed after the device state (last, start,
    drafts, rows) changed."""
    ins, outs = make_prepare_case(0, device="cuda")
    g, _ = dispatch.capture_graph(lambda: call(ins, outs, backend="triton"))
    for seed in (1, 2):
        new, _ = make_prepare_case(seed, device="cuda")
        for k in ins:
            ins[k].copy_(new[k])
        for v in outs.values():
            v.fill_(POISON)
        g.replay()
        torch.cuda.synchronize()
        want = expected({k: v.cpu() for k, v in ins.items()}, outs)
        for name, w in want.items():
            assert outs[name].cpu().tolist() == w, f"replay {seed}: {name}"


@pytest.mark.gpu
def test_greedy_commit_replays_in_a_graph():
    """The default kernel captured in a graph commits the same as an eager torch call."""
    args = make_commit_case(0, device="cuda")
    want_state = [a.clone() for a in args[:-1]]
    want = forced("torch", greedy_commit, *want_state, args[-1])
    got_state = [a.clone() for a in args[:-1]]
    g, got = dispatch.capture_graph(lambda: greedy_commit(*got_state, args[-1]))
    for i, a in enumerate(args[:-1]):  # the warm-up ran once: start the replay from the inputs
        got_state[i].copy_(a)
    g.replay()
    torch.cuda.synchronize()
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    for i in (3, 4, 5):
        assert torch.equal(got_state[i], want_state[i])
