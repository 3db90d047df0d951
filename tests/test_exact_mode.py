"""Exact mode (issue 19): greedy speculative output equal to plain greedy decoding bit for bit in
bf16, from kernels whose rows do not depend on the rows sharing the call.

CPU: the wiring (the target's forwards pass block_attention its absolute key splits and the
GEMMs their exact flag only inside ``exact_mode``, which restores the target after; the split
size follows the table width alone), and the loop's output in exact mode equals plain greedy
(fp32, where the torch paths agree anyway). GPU (to run: written after session 19's device time):
``linear(..., exact=True)`` rows bit-identical for any M; 200 random bf16 cases (vocabularies of
8-32 so drafts are often right, batch 1-13, block 2-16, stop tokens, prompts of 1-300 tokens)
with zero differences from plain greedy.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import dflash_ops.models.layer as layer_mod
from dflash_ops import dispatch
from dflash_ops.models.config import DFlashConfig
from dflash_ops.models.drafter import DFlashDrafter, random_drafter_state
from dflash_ops.models import linear as L
from dflash_ops.models.linear import linear
from dflash_ops.models.target import Target, TargetConfig, exact_split_keys
from dflash_ops.speculator import exact_mode, plain_greedy, speculative_generate


def _pair(vocab=97, block_size=4, seed=0, dtype=torch.float32, device="cpu", max_requests=5,
          num_blocks=64, max_len=128, h=64):
    tcfg = TargetConfig(hidden_size=h, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=2 * h, vocab_size=vocab, max_position_embeddings=1024,
                        source="<test>")
    target = Target.random(tcfg, seed=seed, dtype=dtype, num_blocks=num_blocks, block_size=4,
                           max_requests=max_requests, max_len=max_len, device=device)
    dcfg = DFlashConfig(hidden_size=h, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=96, vocab_size=vocab, mask_token_id=vocab - 1,
                        target_layer_ids=[0, 1], block_size=block_size,
                        max_position_embeddings=1024, source="<test>")
    drafter = DFlashDrafter(dcfg, random_drafter_state(dcfg, seed + 1),
                            embed_tokens=target.embed, lm_head=target.lm_head, dtype=dtype,
                            num_blocks=num_blocks, cache_block_size=4,
                            max_requests=max_requests, max_len=max_len, device=device)
    return target, drafter


def test_exact_split_keys_depends_on_the_table_width_only():
    for keys in (4, 128, 1000, 4096, 131072, 1 << 20):
        sk = exact_split_keys(keys)
        assert sk % 64 == 0 and sk >= 128 and -(-keys // sk) <= 32, (keys, sk)


class _Recorder:
    """Stands in for torch.ops.dflash in the layer module: records block_attention's
    split_keys."""

    def __init__(self, ops):
        self._ops, self.split_keys = ops, []

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def block_attention(self, *args):
        self.split_keys.append(args[10] if len(args) > 10 else 0)
        return self._ops.block_attention(*args)


def test_exact_mode_passes_absolute_splits_and_restores_the_target(monkeypatch):
    target, _ = _pair()
    rec = _Recorder(layer_mod.OPS)
    monkeypatch.setattr(layer_mod, "OPS", rec)
    prompts = [[1, 2, 3], [4, 5]]
    plain = plain_greedy(target, prompts, 3)
    assert set(rec.split_keys) == {0} and target.exact is False
    rec.split_keys.clear()
    exact = plain_greedy(target, prompts, 3, exact=True)
    want = exact_split_keys(target.cache.max_blocks * target.cache.block_size)
    assert set(rec.split_keys) == {want} and want > 0
    assert target.exact is False  # restored
    assert exact == plain  # fp32 on the CPU: the torch paths agree
    with exact_mode(target):
        assert target.exact is True
    assert target.exact is False


def test_exact_mode_refuses_a_cuda_target_without_exact_gemms():
    class Fake:  # exact_mode reads only these
        exact, device, dtype = False, torch.device("cuda"), torch.float32
    with pytest.raises(ValueError, match="bf16 / fp16 target"):
        with exact_mode(Fake()):
            pass


def test_exact_split_from_the_shape_alone():
    """K slices: doubled while the N tiles stay under EXACT_MIN_PROGRAMS programs and every
    slice keeps EXACT_MIN_SLICE_STEPS steps (Qwen3-8B's o_proj, down and qkv stream on 256+
    programs at one row; the LM head and gate_up have the tiles already)."""
    got = {name: L.exact_split(n, k) for name, (n, k) in dict(
        qkv=(6144, 4096), o=(4096, 4096), gate_up=(24576, 4096), down=(4096, 12288),
        lm_head=(151936, 4096), small_k=(4096, 512), tinier_k=(4096, 256), tiny=(96, 64)).items()}
    assert got == dict(qkv=8, o=8, gate_up=2, down=8, lm_head=1, small_k=2, tinier_k=1, tiny=1)
    for n in (1, 100, 4096, 40000):
        for k in (1, 64, 500, 4096, 12288):
            s = L.exact_split(n, k)
            assert 1 <= s <= L.EXACT_MAX_SPLIT and s & (s - 1) == 0
            assert s == 1 or -(-k // L.EXACT_CFG[2]) >= s * L.EXACT_MIN_SLICE_STEPS


def test_exact_serial_by_modelled_time():
    """A program a slice while the tiles leave SMs idle (one-row decode, 16-row verify), a
    program a tile once the tiles fill the GPU or the partials cost more than the idle SMs."""
    o, lm = (4096, 4096), (151936, 4096)
    for m in (1, 16, 64):
        assert not L.exact_serial(m, *o, 8, 132)
    assert L.exact_serial(512, *o, 8, 132)  # 256 tiles: the partials would double the bytes
    assert all(L.exact_serial(m, *lm, 1, 132) for m in (1, 512))  # one slice: nothing to split
    assert L.exact_serial(1, *o, 8, 16)  # a small GPU: 32 tiles already fill 16 SMs


def test_exact_compatible_family():
    """Exact mode's launches per M stay in the family whose bits are the split's alone: its
    split, wgmma tiles (>= 64 rows), BLOCK_K 64 / 128 with the same slice bounds."""
    o, dn = (4096, 4096), (4096, 12288)

    def cfg(bm=64, bn=128, bk=64, warps=4, split=8, serial=False, tma=False):
        return (bm, bn, bk, 8, warps, 3, tma, False, split, serial)

    for c in (cfg(), cfg(128, 256, 64, 8, serial=True, tma=True), cfg(64, 64, 128)):
        assert L.exact_compatible(c, *o) is None and L.exact_compatible(c, *dn) is None
    assert "split 4" in L.exact_compatible(cfg(split=4), *o)
    assert "tile 16 x 128" in L.exact_compatible(cfg(bm=16), *o)
    assert "tile 64 x 32" in L.exact_compatible(cfg(bn=32), *o)
    assert "2 warps" in L.exact_compatible(cfg(warps=2), *o)  # mma.sync, not wgmma
    assert "BLOCK_K 256" in L.exact_compatible(cfg(bk=256), *o)
    lm = (151936, 4096)  # split 1: only the split-K kernel's serial launch
    assert "without serial" in L.exact_compatible(cfg(split=1), *lm)
    assert L.exact_compatible(cfg(split=1, serial=True), *lm) is None
    # K 2880 in 8 slices: 384 with BLOCK_K 64, 384 with 128, but 2880 % 128 leaves a tail
    assert L.exact_split(4096, 2880) == 8
    assert "BLOCK_K 128" in L.exact_compatible(cfg(bk=128), 4096, 2880)
    # K 1600 in 4 slices: 448 with BLOCK_K 64, 512 with 128 (the bounds move)
    assert L.exact_split(4096, 1600) == 4
    assert L._slice_len(1600, 4, 64) != L._slice_len(1600, 4, 128)
    assert "BLOCK_K 128" in L.exact_compatible(cfg(bk=128, split=4), 4096, 1600)


def test_exact_table_parse_and_lookup(monkeypatch):
    """The table's exact entries load (an incompatible one is an error naming the entry), and
    exact_config takes the entry of M's bucket where the table holds, else the default."""
    good = [64, 256, 128, 8, 8, 3, True, False, 8, False]
    doc = {"exact": [dict(n=4096, k=4096, m=1, cfg=good),
                     dict(n=4096, k=4096, m=512, cfg=[128, 256, 64, 8, 8, 4, True, False, 8,
                                                      True])]}
    t = L.parse_exact(doc)
    assert t[(4096, 4096)][1] == tuple(good) and t[(4096, 4096)][512][9] is True
    bad = [dict(n=4096, k=4096, m=16, cfg=good[:8] + [4, False]),  # another split
           dict(n=4096, k=4096, m=16, cfg=good[:9]),  # nine fields
           dict(n=4096, k=4096, m=17, cfg=good)]  # not a bucket
    for e, match in zip(bad, ("N 4096, K 4096, M 16: split 4", "10-field cfg", "M 17 is not")):
        with pytest.raises(ValueError, match=match):
            L.parse_exact({"exact": [e]}, strict=True)
        with pytest.warns(UserWarning, match=match):  # at import: left out, not fatal
            assert L.parse_exact({"exact": doc["exact"] + [e]}) == t
    pytest.importorskip("triton")
    monkeypatch.setattr(L, "EXACT_TABLE", t)
    monkeypatch.setattr(L, "table_applies", lambda device: True)
    import dflash_ops.triton.context as tc
    monkeypatch.setattr(tc, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    assert tuple(L.exact_config(1, 4096, 4096, dev)) == tuple(good)
    assert L.exact_config(300, 4096, 4096, dev).bm == 128  # bucket 512
    assert tuple(L.exact_config(16, 4096, 4096, dev))[:8] == L.EXACT_CFG  # no entry: default
    monkeypatch.setattr(L, "table_applies", lambda device: False)
    assert tuple(L.exact_config(1, 4096, 4096, dev))[:8] == L.EXACT_CFG  # another GPU


def test_linear_exact_is_the_torch_path_off_cuda():
    x, w = torch.randn(5, 32), torch.randn(48, 32)
    assert torch.equal(linear(x, w, exact=True), linear(x, w))


@pytest.mark.parametrize("steps", ["direct", "static"])
def test_exact_loop_equals_exact_plain_greedy_cpu(steps):
    target, drafter = _pair(block_size=4, seed=3)
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    want = plain_greedy(target, prompts, 10, exact=True)
    got, _ = speculative_generate(target, drafter, prompts, 10, steps=steps, exact=True)
    assert got == want and target.exact is False


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(96, 64), (1000, 320), (4096, 1024), (4096, 12288)])
def test_linear_exact_rows_do_not_depend_on_m_gpu(n, k):
    """Every row equal bit for bit whatever the rows sharing the call; where the shape splits
    K, the calls cover both launches (a program a slice at few rows, a program a tile at 300),
    and a graph replay gives the eager bits (the tile counters back at zero)."""
    torch.manual_seed(0)
    x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    full = linear(x, w, b, exact=True)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float(), b.float()),
                               atol=0.05, rtol=0.02)
    ms = (1, 7, 16, 64, 65, 299)
    for m in ms:
        assert torch.equal(linear(x[:m], w, b, exact=True), full[:m]), m
    assert torch.equal(linear(x[130:131], w, b, exact=True), full[130:131])
    serial = {L.exact_config(m, n, k, x.device).serial for m in ms + (300,)}
    if L.exact_split(n, k) > 1:
        assert serial == {False, True}, "one launch kind only: the test shape proves nothing"
    xs = x[:16].clone()
    g, got = dispatch.capture_graph(lambda: linear(xs, w, b, exact=True))
    for _ in range(2):
        g.replay()
        assert torch.equal(got, full[:16])


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 4096), (96, 64), (4096, 12288), (1280, 5120)])
def test_linear_exact_table_tiles_keep_the_bits_gpu(n, k, monkeypatch):
    """Exact mode's table may give each M bucket another launch of the family
    (exact_compatible); rows must keep their bits across them: an M 1 call on a 64 x 256
    BLOCK_K 128 TMA tile, 16 rows on 64 x 64, 300 rows serial on 128 x 256 with 8 warps,
    each equal to the default launch's rows (shapes of split 8 and of split 1)."""
    from dflash_ops.triton.context import _stages
    torch.manual_seed(1)
    x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    monkeypatch.setattr(L, "EXACT_TABLE", {})
    want = linear(x, w, None, exact=True)  # the default launch at every M
    split = L.exact_split(n, k)
    few = split == 1  # one slice: the serial launch at every M
    cfgs = {1: (64, 256, 128, 8, 8, _stages(3, 64, 256, 128, 2), True, False, split, few),
            16: (64, 64, 64, 8, 4, 4, False, False, split, few),
            512: (128, 256, 64, 8, 8, _stages(3, 128, 256, 64, 2), True, False, split, True)}
    cfgs = {m: c for m, c in cfgs.items() if L.exact_compatible(c, n, k) is None}
    assert len(cfgs) >= 2, "the shape admits too few of the family to test"
    monkeypatch.setattr(L, "EXACT_TABLE", {(n, k): cfgs})
    monkeypatch.setattr(L, "table_applies", lambda device: True)
    for m in (1, 16, 300):
        assert torch.equal(linear(x[:m], w, None, exact=True), want[:m]), (m, cfgs.get(
            L.m_bucket(m)))


@pytest.mark.gpu
def test_exact_mode_equals_plain_greedy_200_random_bf16_cases_gpu():
    """200 cases over 8 pairs (vocab 8-32, block 2-16): batch 1-13, prompts of 1-300 tokens,
    stop tokens taken from the plain run; every output equal to plain greedy in exact mode."""
    rng = random.Random(19)
    cases = differ = accepted = 0
    for pair_i in range(8):
        vocab = rng.choice([8, 12, 16, 24, 32])
        block = rng.choice([2, 4, 8, 16])
        target, drafter = _pair(vocab=vocab, block_size=block, seed=100 + pair_i,
                                dtype=torch.bfloat16, device="cuda", max_requests=14,
                                num_blocks=14 * 90, max_len=360, h=128)
        for _ in range(25):
            batch = rng.randint(1, 13)
            prompts = [[rng.randrange(vocab - 1) for _ in range(rng.randint(1, 300))]
                       for _ in range(batch)]
            n_new = rng.randint(1, 40)
            free = plain_greedy(target, prompts, n_new, exact=True)
            stop = sorted({o[len(o) // 2] for o in free[:2]}) if rng.random() < 0.5 else []
            want = plain_greedy(target, prompts, n_new, stop, exact=True)
            # mostly policy off: with a random drafter the policy would mostly decode, and the
            # point is the multi-row verify against the one-row decode
            got, st = speculative_generate(target, drafter, prompts, n_new, stop, exact=True,
                                           steps=rng.choice(["direct", "graphs"]),
                                           time_stages=False, policy=rng.random() < 0.2)
            cases += 1
            differ += int(got != want)
            accepted += sum(a - 1 for a in st.acceptance)
    assert cases == 200 and differ == 0, f"{differ} of {cases} cases differ from plain greedy"
    assert accepted > 0, "no draft was accepted: the verify path was not exercised"
