"""The draft context window's acceptance cost (issue 18's option): the shipped trained tiny pair
(dflash_ops/data/tiny_pair), greedy, policy off, the same held-out stdlib prompts for every
window; per window (the drafter attends to its context's first FIRST and last W tokens,
``DFlashDrafter.set_context_window``): the mean tokens committed per request-iteration
(acceptance length), whether the output equals plain greedy decoding (it must: the window only
changes the drafts), and the loop's wall time (informational: the tiny pair is launch-bound,
so no window speeds it up; the window is for long contexts on a GPU).

    python benchmarks/draft_window.py [--device cpu] [--dtype fp32] [--prompts 8]
        [--prompt-len 192] [--new 48] [--windows 128,64,32,16] [--first 16] [--out DIR]

The pair was trained on 256-byte sequences: keep prompt-len + new <= 256 for a fair number.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draft_window.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--prompts", type=int, default=8, help="prompts (run as one batch)")
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--new", type=int, default=48, help="new tokens a prompt")
    p.add_argument("--windows", default="128,64,32,16",
                   help="comma-separated W (last context tokens kept), each >= the block size")
    p.add_argument("--first", type=int, default=16, help="first context tokens kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    return p


def main() -> int:
    a = _parser().parse_args()
    if importlib.util.find_spec("dflash_ops") is None:  # a checkout without installing
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    from dflash_ops.speculator import plain_greedy, speculative_generate
    from dflash_ops.speculator.demo import SHIPPED, _checkpoint_pair, _text_prompts

    try:
        windows = [None] + [int(w) for w in a.windows.split(",") if w.strip()]
    except ValueError:
        print(f"draft_window.py: --windows {a.windows!r} is not a list of integers",
              file=sys.stderr)
        return 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    if a.device == "cpu":
        torch.set_num_threads(1)  # the tiny pair's fastest CPU setting (the demo's)
    target, drafter = _checkpoint_pair(os.path.join(SHIPPED, "target"),
                                       os.path.join(SHIPPED, "drafter"), a.device, dtype, None,
                                       a.prompt_len + a.new, a.prompts)
    prompts = _text_prompts(a.prompts, a.prompt_len, a.seed)
    want = plain_greedy(target, prompts, a.new)
    rows = []
    for w in windows:
        drafter.set_context_window(w, first=a.first)
        speculative_generate(target, drafter, prompts, a.new, policy=False)  # warm-up
        t0 = time.perf_counter()
        got, st = speculative_generate(target, drafter, prompts, a.new, policy=False)
        secs = time.perf_counter() - t0
        name = "full context" if w is None else f"first {a.first} + last {w}"
        acc = st.mean_acceptance
        rows.append((name, acc, got == want, secs))
        print(f"[draft-window] {name}: acceptance length {acc:.3f}, output "
              f"{'equal to' if got == want else 'DIFFERENT from'} plain greedy, {secs:.2f} s",
              flush=True)
    drafter.set_context_window(None)
    base = rows[0][1]
    out = Path(a.out) if a.out else Path(__file__).resolve().parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    dev = a.device if a.device == "cpu" else torch.cuda.get_device_name()
    lines = [
        f"# draft-window-{a.device}", "",
        f"{stamp}  {dev}  {platform.python_version()}  torch {torch.__version__}  "
        f"commit {os.environ.get('DFLASH_OPS_COMMIT', '?')}", "",
        f"Shipped tiny pair (trained, block {drafter.cfg.block_size}), {a.dtype}, {a.prompts} "
        f"held-out stdlib prompts of {a.prompt_len} bytes (seed {a.seed}) as one batch, "
        f"{a.new} new tokens each, greedy, policy off; context window = the drafter's "
        f"attention keeps its context's first {a.first} and last W tokens (whole 16-key pages:"
        f" up to 15 more), the block's own keys always.", "",
        "| drafter context | acceptance length | vs full | output = plain greedy | loop s |",
        "|---|---|---|---|---|"]
    for name, acc, same, secs in rows:
        lines.append(f"| {name} | {acc:.3f} | {acc / base:.3f} | {'yes' if same else 'NO'} | "
                     f"{secs:.2f} |")
    lines += ["", "Acceptance length: mean tokens committed per request-iteration (Stats)."]
    path = out / f"draft-window-{a.device}.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
