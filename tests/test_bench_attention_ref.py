"""The attention suite's windowed reference (``bench.attention_columns.reference``), on CPU: with a
window it drops the cache blocks before the first query's window (every position shifted by the
same amount), and that must leave every output as the reference over all keys gives it; also the
suite's query length override (``query_length``, the dflash2 table's 8 queries)."""
import torch

from dflash_ops.bench import attention as suite
from dflash_ops.bench import attention_columns as ac
from dflash_ops.ops.attention import block_attention_ref


def test_windowed_reference_drops_only_unseen_blocks(monkeypatch):
    monkeypatch.setattr(ac, "DEVICE", "cpu")
    monkeypatch.setattr(ac, "HQ", 8)
    monkeypatch.setattr(ac, "HKV", 2)
    monkeypatch.setattr(ac, "D", 32)
    monkeypatch.setattr(ac, "G", 4)
    torch.manual_seed(0)
    with ac.query_length(8):
        assert ac.QLEN == 8 and suite.QLEN == 8
        case = ac.Case.__new__(ac.Case)  # the caches only (Case's SDPA layouts need HQ etc.)
        case.b, case.s, case.m = 2, 400, 400 // ac.BLOCK_SIZE
        case.nb = case.b * case.m
        case.block_table = torch.randperm(case.nb).view(2, case.m).to(torch.int32)
        case.seq_lens = torch.tensor([400, 400], dtype=torch.int32)
        case.qsl = torch.arange(3, dtype=torch.int32) * 8
        q = torch.randn(16, 8, 32)
        kc, vc = torch.randn(case.nb, 16, 2, 32), torch.randn(case.nb, 16, 2, 32)
        case.sets = [(q, kc, vc)]
        for window in (40, 100, 1000):
            got = ac.reference(case, False, window)
            full = block_attention_ref(q, kc, vc, case.block_table, case.seq_lens, case.qsl,
                                       ac.SCALE, False, window)
            torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
        vis = ac.visible(400, False, 40)
        assert vis.shape == (8, 400) and int(vis.any(0).sum()) == 8 + 39  # 353..399
    assert ac.QLEN == 16 and suite.QLEN == 16
