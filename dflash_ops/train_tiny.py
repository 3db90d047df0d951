"""``dflash-ops train-tiny``: train the built-in tiny pair (a byte-level Qwen3 target and a DFlash
drafter for it) from Python standard-library source, on a CPU (about 20-40 minutes on 2 cores)
or a GPU.

Data: ``MODULES``, a fixed list of pure-Python standard-library files present in 3.11 and 3.12,
read from this interpreter's stdlib at training time (their SHA-256 is recorded in the saved
configs: other Python versions give other bytes, so other weights). Bytes are tokens 0-255;
token 256 is the drafter's mask (the target never sees it). The last ``VAL_BYTES`` bytes are held
out.

Target: transformers' Qwen3ForCausalLM (H 256, 4 layers, 4 / 2 heads of 64, MLP 768, untied LM
head), next-byte cross-entropy, AdamW with warm-up and cosine decay.

Drafter: the ``dflash`` package's DFlashDraftModel (2 layers, block 8, taps = target layers
[1, 2]) trained with the DFlash block recipe: per sequence, N random anchors; a block is the
anchor's byte then 7 mask tokens through the target's frozen embedding, at positions anchor ..
anchor + 7; a block row sees the context rows (the target's tap hidden states) strictly before
its anchor and its own block, nothing of other blocks; slot k >= 1 is trained (cross-entropy
through the target's frozen LM head) to the target's greedy next token at anchor + k - 1, with
weight exp(-(k - 1) / 4). Only the drafter's layers, fc and norms train.

Saved (``save``): HF-format target and z-lab-format drafter, bf16 safetensors, which
``dflash-ops demo --target DIR/target --draft DIR/drafter`` and vLLM load.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
import tempfile
import time

import torch
import torch.nn.functional as F

MODULES = (
    "abc", "bisect", "calendar", "colorsys", "copy", "csv", "dataclasses", "difflib", "enum",
    "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "graphlib", "hashlib",
    "heapq", "hmac", "inspect", "keyword", "linecache", "locale", "netrc", "numbers",
    "operator", "optparse", "os", "pathlib", "pickle", "platform", "pprint", "queue", "quopri",
    "random", "reprlib", "sched", "selectors", "shlex", "shutil", "socket", "statistics",
    "string", "struct", "subprocess", "tempfile", "textwrap", "threading", "timeit", "token",
    "tokenize", "trace", "traceback", "types", "typing", "uuid", "warnings", "wave", "weakref",
    "zipfile")
VAL_BYTES = 50_000
VOCAB, MASK = 257, 256
HIDDEN, TARGET_LAYERS, DRAFT_LAYERS, BLOCK, TAPS = 256, 4, 2, 8, [1, 2]
SEQ = 256


def _module_file(root: str, name: str) -> str:
    """The source file of a stdlib module: name.py, or name/__init__.py where the module became a
    package (zipfile in Python 3.12); "" when neither exists."""
    for path in (os.path.join(root, name + ".py"), os.path.join(root, name, "__init__.py")):
        if os.path.isfile(path):
            return path
    return ""


def corpus() -> tuple:
    """(token ids [n] int64, sha256 hex of the bytes, stdlib dir)."""
    root = sysconfig.get_paths()["stdlib"]
    files = [_module_file(root, m) for m in MODULES]
    missing = [m for m, f in zip(MODULES, files) if not f]
    if missing:
        raise FileNotFoundError(f"train-tiny: the standard library at {root} lacks "
                                f"{', '.join(m + '.py' for m in missing)}")
    data = b"".join(open(f, "rb").read() for f in files)
    return (torch.frombuffer(bytearray(data), dtype=torch.uint8).long(),
            hashlib.sha256(data).hexdigest(), root)


def _qwen3_fields(layers: int) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                intermediate_size=3 * HIDDEN, max_position_embeddings=4096, rope_theta=10000.0,
                rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
                hidden_act="silu")


def target_config_dict() -> dict:
    return dict(_qwen3_fields(TARGET_LAYERS), architectures=["Qwen3ForCausalLM"],
                model_type="qwen3", torch_dtype="bfloat16")


def drafter_config_dict() -> dict:
    return dict(_qwen3_fields(DRAFT_LAYERS), architectures=["DFlashDraftModel"],
                model_type="qwen3", torch_dtype="bfloat16", block_size=BLOCK,
                num_target_layers=TARGET_LAYERS,
                dflash_config={"mask_token_id": MASK, "target_layer_ids": list(TAPS)})


def _import_failure():
    """None when transformers and dflash.model import; else what is missing and how to install
    it (one line)."""
    try:
        import transformers  # noqa: F401
        import dflash.model  # noqa: F401
    except ImportError as e:
        return (f"transformers and the dflash package ({e}); install them: pip install "
                f"transformers && pip install --no-deps dflash")
    return None


def _imports():
    why = _import_failure()
    if why:
        raise RuntimeError(f"train-tiny needs {why}")
    import transformers
    import dflash.model as dm
    return transformers, dm


def _schedule(opt, steps: int, warmup: int = 20):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))


def _update(opt, sched, loss, model) -> None:
    """One optimiser step: backward, gradient norm clipped to 1, step, schedule."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()


def _log(what: str, step: int, steps: int, loss: float, t0: float, extra: str = "") -> None:
    done = (step + 1) / steps
    bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
    print(f"\r[{what}] [{bar}] {step + 1}/{steps} loss {loss:.3f}{extra} "
          f"{time.time() - t0:.0f} s", end="\n" if step + 1 == steps else "", file=sys.stderr,
          flush=True)


def _batch(ids: torch.Tensor, n: int, length: int, g: torch.Generator, device) -> torch.Tensor:
    ix = torch.randint(0, len(ids) - length, (n,), generator=g)
    return torch.stack([ids[i:i + length] for i in ix]).to(device)


def train_target(ids, steps: int = 400, batch: int = 16, lr: float = 2e-3, seed: int = 0,
                 device="cpu", log_every: int = 10):
    transformers, _ = _imports()
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    cfg = transformers.Qwen3Config(**_qwen3_fields(TARGET_LAYERS))
    model = transformers.Qwen3ForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = _schedule(opt, steps)
    t0 = time.time()
    for s in range(steps):
        x = _batch(ids, batch, SEQ + 1, g, device)
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))
        _update(opt, sched, loss, model)
        if s % log_every == 0 or s + 1 == steps:
            _log("target", s, steps, loss.item(), t0)
    return model.eval()


def train_drafter(target, ids, steps: int = 600, batch: int = 8, anchors: int = 24,
                  lr: float = 1e-3, gamma: float = 4.0, seed: int = 1, device="cpu",
                  log_every: int = 10):
    transformers, dm = _imports()
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    cfg = transformers.Qwen3Config(**_qwen3_fields(DRAFT_LAYERS))
    cfg.dflash_config = {"mask_token_id": MASK, "target_layer_ids": list(TAPS)}
    cfg.block_size = BLOCK
    cfg.num_target_layers = TARGET_LAYERS
    drafter = dm.DFlashDraftModel(cfg).to(device)
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    sched = _schedule(opt, steps)
    b, n, s_len = BLOCK, anchors, SEQ
    w = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, b)], device=device)
    blk = torch.arange(n, device=device).repeat_interleave(b)
    same_block = blk[:, None] == blk[None, :]
    t0 = time.time()
    for s in range(steps):
        x = _batch(ids, batch, s_len, g, device)
        with torch.no_grad():
            out = target(input_ids=x, output_hidden_states=True)
            taps = torch.cat([out.hidden_states[i + 1] for i in TAPS], -1)
            want = out.logits.argmax(-1)  # the target's greedy next token after each position
        a = torch.stack([torch.randperm(s_len - b, generator=g)[:n] + 1
                         for _ in range(batch)]).sort(1).values.to(device)  # [batch, n]
        block_ids = torch.full((batch, n, b), MASK, device=device)
        block_ids[:, :, 0] = x.gather(1, a)
        noise = target.model.embed_tokens(block_ids.view(batch, n * b))
        bpos = (a[:, :, None] + torch.arange(b, device=device)).view(batch, n * b)
        pos = torch.cat([torch.arange(s_len, device=device).expand(batch, s_len), bpos], 1)
        ctx_ok = torch.arange(s_len, device=device)[None, None, :] < \
            a.repeat_interleave(b, 1)[:, :, None]
        mask = torch.cat([ctx_ok, same_block.expand(batch, -1, -1)], 2)[:, None]
        h = drafter(position_ids=pos, attention_mask=mask, noise_embedding=noise,
                    target_hidden=taps)
        logits = target.lm_head(h).float()
        labels = want.gather(1, bpos - 1)  # slot k of anchor a: the target's token at a + k
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                             reduction="none").view(batch, n, b)
        loss = (ce * w).sum() / (w.sum() * batch * n)
        _update(opt, sched, loss, drafter)
        if s % log_every == 0 or s + 1 == steps:
            acc = (logits.argmax(-1).view(batch, n, b)[..., 1] == labels.view(batch, n, b)[..., 1])
            _log("drafter", s, steps, loss.item(), t0, f" slot-1 acc {acc.float().mean():.2f}")
    return drafter.eval()


def save(out_dir: str, target, drafter, meta: dict) -> tuple:
    """(target dir, drafter dir) under ``out_dir``, bf16 safetensors; ``meta`` goes into both
    configs under ``dflash_ops_train_tiny``."""
    from .models import save_target, save_zlab
    tdir, ddir = os.path.join(out_dir, "target"), os.path.join(out_dir, "drafter")

    def bf16(m):
        return {k: v.detach().to("cpu", torch.bfloat16).contiguous()
                for k, v in m.state_dict().items()}

    save_target(tdir, dict(target_config_dict(), dflash_ops_train_tiny=meta), bf16(target))
    save_zlab(ddir, dict(drafter_config_dict(), dflash_ops_train_tiny=meta), bf16(drafter))
    return tdir, ddir


def add_parser(sub) -> None:
    from .cli import device_arg, int_at_least
    p = sub.add_parser("train-tiny", help="train the built-in tiny pair from stdlib source",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where target/ (HF format) and drafter/ (z-lab format) are written "
                        "(created if absent, checked before training; required)")
    p.add_argument("--target-steps", type=int_at_least(1), default=400,
                   help="target optimiser steps of 16 x 256 bytes (default: %(default)s)")
    p.add_argument("--draft-steps", type=int_at_least(1), default=600,
                   help="drafter optimiser steps of 8 sequences x 24 blocks (default: "
                        "%(default)s)")
    p.add_argument("--device", type=device_arg, default="cpu",
                   help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--seed", type=int_at_least(0), default=0,
                   help="seed of the weights and batches (default: %(default)s; the shipped "
                        "pair's)")


def _check_out(out: str) -> None:
    """Create ``--out`` and write a probe file in it, so that a path that cannot hold the pair
    fails now, not after training."""
    from .cli import UsageError
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise UsageError(f"argument --out: got {out!r}, which cannot be created or written "
                         f"({e.strerror or e}); allowed: a writable directory, existing or "
                         f"not") from None


def run(args) -> int:
    from .cli import UsageError
    why = _import_failure()  # before anything else: training needs both
    if why:
        raise UsageError(f"needs {why}")
    _check_out(args.out)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    ids, sha, root = corpus()
    train = ids[:-VAL_BYTES]
    print(f"[train-tiny] corpus: {len(MODULES)} stdlib files from {root}, {len(ids)} bytes, "
          f"sha256 {sha[:16]}", file=sys.stderr)
    t0 = time.time()
    target = train_target(train, args.target_steps, seed=args.seed, device=args.device)
    drafter = train_drafter(target, train, args.draft_steps, seed=args.seed + 1,
                            device=args.device)
    meta = {"corpus_sha256": sha, "files": len(MODULES), "python": sys.version.split()[0],
            "target_steps": args.target_steps, "draft_steps": args.draft_steps,
            "seed": args.seed}
    tdir, ddir = save(args.out, target, drafter, meta)
    print(f"[train-tiny] wrote {tdir} and {ddir} in {time.time() - t0:.0f} s", file=sys.stderr)
    return 0
