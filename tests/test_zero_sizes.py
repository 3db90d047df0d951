"""Zero-size dimensions the checks admit, through the torch reference and the Triton kernels
(interpreter): q with no heads, k with no layers (a [0, D] per-layer weight), selector codebooks
of rank 0 (the scores are the unary scores). Each backend returns what the reference returns,
without an error."""
from tests.conftest import run_interpreted

_SCRIPT = r"""
import torch, dflash_ops
from dflash_ops import dispatch
from dflash_ops.ops import attention as A, rope as RP, select as S

def both(name, fn):
    outs = {}
    for be in ("torch", "triton"):
        with dispatch.use_backend(be):
            outs[be] = fn()
    for a, b in zip(*outs.values()):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if a.is_floating_point():  # the softmax of the sampled walk: to fp32 rounding
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
        else:
            assert torch.equal(a, b), (name, a, b)

kw = dict(A.samples("cpu", torch.float32)["block_attention"]["noncausal"])
both("attention Hq 0", lambda: [A.block_attention(**dict(kw, q=torch.randn(8, 0, 64)))])

kw = dict(RP.samples("cpu", torch.float32)["knorm_rope_"]["gptj-strided"])
def knorm():
    k = torch.randn(5, 0, 2, 64)
    RP.knorm_rope_(**dict(kw, k=k, k_weight=torch.randn(0, 64)))
    return [k]
both("knorm_rope_ no layers", knorm)

for case in ("greedy", "sampled"):
    kw = dict(S.samples("cpu", torch.float32)["select_candidates"][case])
    r, j = kw["unary"].shape[:2]
    v = kw["pred"].shape[0]
    z = dict(kw, pred=torch.randn(v, 0), succ=torch.randn(v, 0), hidden=torch.randn(r, j, 0))
    both("select rank 0 " + case, lambda: list(S.select_candidates(**z)))
print("interp-ok")
"""


def test_zero_sizes_run_alike_in_every_backend():
    run_interpreted(_SCRIPT, timeout=600)
