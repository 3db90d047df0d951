"""``dflash-ops demo``: greedy DFlash decoding on a target + drafter pair, checked against plain
greedy decoding of the same target, with tokens/s, acceptance length and time per stage.

Default: a built-in tiny pair with seeded random weights (a 4-layer Qwen3-style target and a
2-layer drafter reading its layers 1 and 2), on the GPU if there is one, else the CPU. Random
weights mean the drafter rarely guesses right (acceptance near 1 token an iteration), so the
speedup is below 1: the demo shows the machinery and its exactness, not a trained drafter.
``--target DIR --draft DIR`` run local checkpoints (an HF Qwen3/Llama target and a DFlash
drafter in z-lab or speculators format; the drafter uses the target's embedding and LM head
unless it ships its own).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def _tiny_pair(device, dtype, block_size, max_len, batch):
    from ..models.config import DFlashConfig
    from ..models.drafter import DFlashDrafter, random_drafter_state
    from ..models.target import Target, TargetConfig

    tcfg = TargetConfig(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                        intermediate_size=256, vocab_size=512, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=4096,
                        tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                        source="<built-in tiny target>")
    slots = batch + 1  # + the steps' scratch request
    kw = dict(dtype=dtype, device=device, max_requests=slots, max_len=max_len)
    target = Target.random(tcfg, seed=0, num_blocks=slots * (-(-max_len // 16)), block_size=16,
                           **kw)
    dcfg = DFlashConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                        intermediate_size=256, vocab_size=512, mask_token_id=511,
                        target_layer_ids=[1, 2], block_size=block_size,
                        max_position_embeddings=4096, source="<built-in tiny drafter>")
    drafter = DFlashDrafter(dcfg, random_drafter_state(dcfg, seed=1), embed_tokens=target.embed,
                            lm_head=target.lm_head, num_blocks=slots * (-(-max_len // 16)),
                            cache_block_size=16, **kw)
    return target, drafter


def _checkpoint_pair(target_dir, draft_dir, device, dtype, block_size, max_len, batch):
    from ..models.config import DFlashConfig
    from ..models.drafter import DFlashDrafter
    from ..models.target import Target
    from ..models.weights import load_state

    slots = batch + 1  # + the steps' scratch request
    kw = dict(dtype=dtype, device=device, max_requests=slots, max_len=max_len)
    target = Target.from_pretrained(target_dir, num_blocks=slots * (-(-max_len // 16)), **kw)
    dcfg = DFlashConfig.from_pretrained(draft_dir)
    if block_size:
        dcfg = dcfg.replace(block_size=block_size)
    drafter = DFlashDrafter(dcfg, load_state(draft_dir), embed_tokens=target.embed,
                            lm_head=target.lm_head, num_blocks=slots * (-(-max_len // 16)),
                            **kw)
    return target, drafter


class _Progress:
    def __init__(self, total, label, stream=sys.stderr):
        self.total, self.label, self.stream, self.t0 = total, label, stream, time.perf_counter()

    def __call__(self, done):
        width = 30
        fill = int(width * min(done, self.total) / max(1, self.total))
        rate = done / max(1e-9, time.perf_counter() - self.t0)
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] "
                          f"{done}/{self.total} tokens {rate:7.1f} tok/s")
        self.stream.flush()

    def close(self):
        self.stream.write("\n")


def run(args) -> int:
    from .loop import plain_greedy, speculative_generate

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device == "cuda" else "fp32")]
    if args.batch < 1 or args.prompt_len < 1 or args.max_new_tokens < 1:
        print(f"dflash-ops demo: --batch, --prompt-len and --max-new-tokens must be >= 1, got "
              f"{args.batch}, {args.prompt_len}, {args.max_new_tokens}", file=sys.stderr)
        return 2
    max_len = args.prompt_len + args.max_new_tokens + 64
    if (args.target is None) != (args.draft is None):
        print("dflash-ops demo: give both --target and --draft, or neither", file=sys.stderr)
        return 2
    if args.target:
        target, drafter = _checkpoint_pair(args.target, args.draft, device, dtype,
                                           args.block_size, max_len, args.batch)
        what = f"target {args.target}, drafter {args.draft}"
    else:
        target, drafter = _tiny_pair(device, dtype, args.block_size or 8, max_len, args.batch)
        what = "built-in tiny pair (random weights, seeded)"
    g = torch.Generator().manual_seed(args.seed)
    vocab = min(target.cfg.vocab_size, drafter.cfg.mask_token_id)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.batch)]
    total = args.batch * args.max_new_tokens
    print(f"dflash-ops demo: {what}; {device}, {str(dtype).replace('torch.', '')}, batch "
          f"{args.batch}, prompt {args.prompt_len} tokens, {args.max_new_tokens} new tokens each, "
          f"block {drafter.cfg.block_size}, steps {args.steps}")

    bar = _Progress(total, "plain greedy ")
    t0 = time.perf_counter()
    want = plain_greedy(target, prompts, args.max_new_tokens)
    t_plain = time.perf_counter() - t0
    bar(total)
    bar.close()

    bar = _Progress(total, "DFlash greedy")
    t0 = time.perf_counter()
    got, st = speculative_generate(target, drafter, prompts, args.max_new_tokens,
                                   on_iteration=bar, steps=args.steps,
                                   time_stages=not args.no_stage_times)
    t_spec = time.perf_counter() - t0
    bar.close()

    same = got == want
    print()
    print(f"{'':24} {'plain greedy':>14} {'DFlash':>14}")
    print(f"{'tokens':24} {total:>14} {st.committed:>14}")
    print(f"{'seconds':24} {t_plain:>14.3f} {t_spec:>14.3f}")
    print(f"{'tokens/s':24} {total / t_plain:>14.1f} {st.committed / t_spec:>14.1f}")
    print(f"{'steps':24} {'':>14} {st.steps:>14}")
    print(f"{'iterations':24} {'':>14} {st.iterations:>14}")
    print(f"{'host syncs / iteration':24} {'':>14} "
          f"{st.host_syncs / max(1, st.iterations):>14.2f}")
    print(f"{'acceptance length':24} {'1.00':>14} {st.mean_acceptance:>14.2f}")
    print(f"{'speedup':24} {'1.00x':>14} {t_plain / t_spec:>13.2f}x")
    for k, v in st.seconds.items():
        print(f"{'  time in ' + k:24} {'':>14} {v:>13.3f}s")
    print(f"\noutput equals plain greedy decoding: {'yes' if same else 'NO'}")
    if not same:
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                j = next(k for k in range(min(len(a), len(b))) if a[k] != b[k]) \
                    if any(x != y for x, y in zip(a, b)) else min(len(a), len(b))
                print(f"  request {i}: first difference at new token {j}", file=sys.stderr)
    return 0 if same else 1


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="DFlash greedy decoding on a tiny built-in pair (or local "
                                    "checkpoints), checked against plain greedy decoding")
    p.add_argument("--target", default=None, help="HF Qwen3/Llama checkpoint directory")
    p.add_argument("--draft", default=None, help="DFlash drafter checkpoint directory")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", choices=["auto", "direct", "static", "graphs"], default="auto",
                   help="the loop's draft/verify calls: direct, static-buffer steps, or those "
                        "steps captured as CUDA graphs (auto: graphs on CUDA, else direct)")
    p.add_argument("--no-stage-times", action="store_true",
                   help="no synchronisation per stage (one host sync an iteration; the time "
                        "per stage is then launch time only)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-ops demo")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    return run(ap.parse_args(["demo", *(argv or [])]))
