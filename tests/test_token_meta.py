"""``PagedKVCache.token_meta``: a forward's positions, cache slots, seq_lens and query starts in
one launch. The torch version (``token_meta_ref``) against a per-token Python loop; the Triton
kernel against it under the interpreter (CPU) and on the GPU, including graph replay, with
request slots outside the table, positions past a request's blocks, negative positions (the
drafter's padding rows) and requests of no tokens."""
import pytest
import torch

from dflash_ops.models.cache import PagedKVCache, token_meta_ref
from tests.conftest import run_interpreted


def make_cache(device="cpu", seed=0):
    """Six request slots of 4-position blocks, some holding blocks (in a shuffled order: the
    free list is consumed and refilled), some never added, one freed."""
    c = PagedKVCache(1, 40, 4, 1, 8, max_requests=6, max_len=32, dtype=torch.float32,
                     device=device)
    for r, n in ((0, 32), (2, 9), (3, 20), (5, 4)):
        c.add_request(r, n)
    c.free_request(0)
    c.add_request(4, 17)
    c.add_request(0, 12)
    return c


def loop_meta(cache, requests, starts, q_lens, block):
    """Per token, in Python: the expected (pos, slots, seq_lens, qsl)."""
    table = cache.block_table.tolist()
    pos, slots, seq, qsl = [], [], [], [0]
    for i, (r, s) in enumerate(zip(requests.tolist(), starts.tolist())):
        n = block if q_lens is None else int(q_lens[i])
        for j in range(n):
            p = s + j
            slot = -1
            if 0 <= r < len(table) and p >= 0 and p // cache.block_size < cache.max_blocks:
                blk = table[r][p // cache.block_size]
                if 0 <= blk < cache.num_blocks:
                    slot = blk * cache.block_size + p % cache.block_size
            pos.append(p)
            slots.append(slot)
        seq.append(s + n)
        qsl.append(qsl[-1] + n)
    return pos, slots, seq, qsl


CASES = [  # (requests, starts, q_lens or None, block)
    ([0], [5], [1], 1),                        # a decode token
    ([2, 3, 4], [3, 0, 10], [16, 16, 16], 1),  # verify blocks, across block boundaries
    ([3, 0, 5, 2], [7, 1, 0, 4], [4, 0, 9, 1], 1),  # a request of no tokens; past its blocks
    ([4, 1, 7, -2], [2, 0, 3, 1], [3, 2, 2, 2], 1),  # a slot with no blocks; outside the table
    ([2, 3], [0, 0], [40, 33], 1),             # prefill past max_len (slots -1 there)
    ([0, 4, 2, 3], [8, 0, 20, 3], None, 8),    # the drafter's blocks of 8
    ([2, 0, 3, 4, 4], [-1, 5, -1, 16, 30], None, 1),  # add_context rows: padding at -1
    ([3], [0], None, 1),
]


def check(device):
    cache = make_cache(device)
    from dflash_ops.triton.loop import token_meta

    for req, st, ql, block in CASES:
        requests = torch.tensor(req, device=device)
        starts = torch.tensor(st, device=device)
        q_lens = None if ql is None else torch.tensor(ql, device=device)
        total = len(req) * block if ql is None else sum(ql)
        want = loop_meta(cache, requests.cpu(), starts.cpu(), ql, block)
        ref = token_meta_ref(cache, requests, starts, q_lens, total, block)
        assert [t.tolist() for t in ref] == list(want), (req, st, ql)
        assert [t.dtype for t in ref] == [torch.long, torch.long, torch.int32, torch.int32]
        r = len(req)
        outs = (torch.full((total,), 99, dtype=torch.long, device=device),
                torch.full((total,), 99, dtype=torch.long, device=device),
                torch.full((r,), 99, dtype=torch.int32, device=device),
                torch.full((r + 1,), 99, dtype=torch.int32, device=device))
        token_meta(requests, starts, q_lens, block, cache.block_table, cache.block_size,
                   cache.num_blocks, *outs)
        assert [t.tolist() for t in outs] == list(want), (req, st, ql, "triton")


def check_strided(device):
    """Expanded and strided index tensors (the drafter's parity test adds context with one
    request expanded over its rows): the kernel's wrapper copies them."""
    from dflash_ops.triton.loop import token_meta

    cache = make_cache(device)
    pos = torch.arange(-1, 9, device=device)
    for req in (torch.tensor([2], device=device).expand(10),
                torch.tensor([[3, 0]] * 10, device=device)[:, 0]):
        outs = (torch.empty(10, dtype=torch.long, device=device),
                torch.empty(10, dtype=torch.long, device=device),
                torch.empty(10, dtype=torch.int32, device=device),
                torch.empty(11, dtype=torch.int32, device=device))
        token_meta(req, pos[::1], None, 1, cache.block_table, cache.block_size,
                   cache.num_blocks, *outs)
        want = token_meta_ref(cache, req, pos, None, 10)
        assert all(torch.equal(a, b) for a, b in zip(outs, want)), req.stride()
        assert outs[1][0] == -1 and (outs[1][1:] >= 0).all()


def test_reference_equals_a_per_token_loop():
    cache = make_cache()
    for req, st, ql, block in CASES:
        requests, starts = torch.tensor(req), torch.tensor(st)
        total = len(req) * block if ql is None else sum(ql)
        got = token_meta_ref(cache, requests, starts, None if ql is None else torch.tensor(ql),
                             total, block)
        assert [t.tolist() for t in got] == list(loop_meta(cache, requests, starts, ql, block))


def test_cache_token_meta_on_cpu_is_the_reference():
    cache = make_cache()
    req, st, ql = torch.tensor([2, 3]), torch.tensor([3, 0]), torch.tensor([16, 16])
    got = cache.token_meta(req, st, ql, 32)
    want = token_meta_ref(cache, req, st, ql, 32)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


_SCRIPT = r"""
import tests.test_token_meta as t
t.check("cpu")
t.check_strided("cpu")
print("interp-ok")
"""


def test_triton_kernel_under_interpreter():
    run_interpreted(_SCRIPT, timeout=600)


@pytest.mark.gpu
def test_triton_kernel_gpu():
    check("cuda")
    check_strided("cuda")


@pytest.mark.gpu
def test_cache_token_meta_graph_replay_gpu():
    """Captured once, replayed with new starts and q_lens of the same shapes."""
    from dflash_ops import dispatch

    cache = make_cache("cuda")
    requests = torch.tensor([2, 3, 4], device="cuda")
    starts = torch.tensor([3, 0, 10], device="cuda")
    q_lens = torch.tensor([16, 16, 16], device="cuda")
    cache.token_meta(requests, starts, q_lens, 48)  # compile before capture
    g, outs = dispatch.capture_graph(lambda: cache.token_meta(requests, starts, q_lens, 48))
    for st, ql in (([4, 8, 0], [16, 16, 16]), ([0, 1, 2], [20, 8, 20])):
        starts.copy_(torch.tensor(st))
        q_lens.copy_(torch.tensor(ql))
        g.replay()
        want = loop_meta(cache, requests.cpu(), starts.cpu(), ql, 1)
        assert [t.tolist() for t in outs] == list(want), (st, ql)


@pytest.mark.parametrize("var", [True, False])
def test_kernel_compiles_for_sm90(var):
    """The GPU compile exists (no GPU needed): variable q_lens and uniform blocks, PDL on."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash_ops.triton import loop

    fn = loop._token_meta_kernel
    consts = dict(BLOCK=0 if var else 16, VAR=var, BR=8 if var else 1, BT=16, PDL=True)
    ptrs = {"req_ptr": "*i64", "start_ptr": "*i64", "qlen_ptr": "*i64", "table_ptr": "*i32",
            "pos_ptr": "*i64", "slot_ptr": "*i64", "seq_ptr": "*i32", "qsl_ptr": "*i32"}
    sig = {name: "constexpr" if name in consts else ptrs.get(name, "i32")
           for name in fn.arg_names}
    out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                         target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4, launch_pdl=True))
    ptx = out.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "st.global" in ptx
