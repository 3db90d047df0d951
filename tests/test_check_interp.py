"""``dflash-ops check`` on CPU under the Triton interpreter: every op's sample cases
(``samples()`` of each ops module: strided views, one-row blocks, partial rotary, a strided
norm weight, ...) through the torch and the Triton backends against the fp32 reference, in
fp32 (tl.dot on bf16 is wrong in the interpreter)."""
from tests.conftest import run_interpreted

_SCRIPT = r"""
import torch, dflash_ops
from dflash_ops import check
rows = check.run(device="cpu", dtype=torch.float32)
triton = [r for r in rows if r["backend"] == "triton"]
bad = [r for r in rows if not r["ok"]]
assert len(triton) >= 50, len(triton)  # the interpreter ran the Triton kernels
assert not bad, check.format_table(bad)
print("interp-ok")
"""


def test_every_sample_case_matches_the_reference_in_the_interpreter():
    run_interpreted(_SCRIPT, timeout=600)
