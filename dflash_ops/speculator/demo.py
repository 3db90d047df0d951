"""``dflash-ops demo``: greedy DFlash decoding on a target + drafter pair, checked against plain
greedy decoding of the same target, with tokens/s, acceptance length and time per stage.

Default: the built-in trained tiny pair (``dflash_ops/data/tiny_pair``, made by ``dflash-ops
train-tiny``: a byte-level 4-layer Qwen3 target trained on Python standard-library source and a
2-layer DFlash drafter, block 8, trained on its layers 1 and 2), on the GPU if there is one, else
the CPU, with prompts cut from the held-out end of that stdlib text (seeded). ``--target DIR
--draft DIR`` run local checkpoints (an HF Qwen3/Llama target and a DFlash drafter in z-lab or
speculators format; the drafter uses the target's embedding and LM head unless it ships its
own) with seeded random token prompts.

Timing: each side runs once to warm up (compilation, autotuning, allocator), then once timed,
prefill included, CUDA-graph capture excluded. The baseline is the target's fastest decode
path: on CUDA its decode step (forward of one token a request + argmax) captured as one CUDA
graph and replayed once a token, as ``bench/e2e.py`` times it; on the CPU ``loop.plain_greedy``.
DFlash runs ``loop.speculative_generate`` with ``--steps`` (on CUDA: draft and verify steps as
CUDA graphs), timed with one host sync an iteration; the time per stage comes from that run on
the CPU and from one more run that synchronises after each stage on CUDA.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

import torch

from ..cli import UsageError, device_arg, int_at_least, seed_arg
from ..ops.select import argmax_last
from .step import DECODE_STEPS

_KV_BLOCK = 16  # rows of a paged KV cache block


SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                       "tiny_pair")


def _text_prompts(n: int, length: int, seed: int) -> list:
    """``n`` windows of ``length`` bytes from the held-out end of train-tiny's stdlib text (the
    demo's limit on ``--prompt-len``, the pair's positions, is far below its length)."""
    from ..train_tiny import VAL_BYTES, corpus
    val = corpus()[0][-VAL_BYTES:]
    if length >= len(val):
        raise ValueError(f"_text_prompts: length {length}; allowed: 1 .. {len(val) - 1} (the "
                         f"held-out text's bytes - 1)")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(val) - length, (n,), generator=g)
    return [val[s:s + length].tolist() for s in starts]


def _tiny_pair(device, dtype, block_size, max_len, batch):
    """A random-weight tiny pair (seeded): the tests' and helpers' fast pair."""
    from ..models.config import DFlashConfig
    from ..models.drafter import DFlashDrafter, random_drafter_state
    from ..models.target import Target, TargetConfig

    tcfg = TargetConfig(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                        intermediate_size=256, vocab_size=512, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=4096,
                        tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                        source="<built-in tiny target>")
    slots = batch + 1  # + the steps' scratch request
    blocks = slots * (-(-max_len // _KV_BLOCK))
    kw = dict(dtype=dtype, device=device, max_requests=slots, max_len=max_len)
    target = Target.random(tcfg, seed=0, num_blocks=blocks, block_size=_KV_BLOCK, **kw)
    dcfg = DFlashConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                        intermediate_size=256, vocab_size=512, mask_token_id=511,
                        target_layer_ids=[1, 2], block_size=block_size,
                        max_position_embeddings=4096, source="<built-in tiny drafter>")
    drafter = DFlashDrafter(dcfg, random_drafter_state(dcfg, seed=1), embed_tokens=target.embed,
                            lm_head=target.lm_head, num_blocks=blocks,
                            cache_block_size=_KV_BLOCK, **kw)
    return target, drafter


def _load_failure(option: str, path: str, err: Exception, other: str = "") -> UsageError:
    """One line: an error over several lines (a list of problems) joined with "; ", at most
    six of them."""
    lines = [x.strip() for x in str(err).strip().splitlines() if x.strip()]
    text = "; ".join(lines[:6]) + (f"; ... ({len(lines) - 6} more)" if len(lines) > 6 else "")
    text = text.replace(":; ", ": ")
    return UsageError(f"argument {option}: got {path!r}, which does not load{other}: "
                      f"{text or type(err).__name__}")


def _check_positions(target_dir, draft_dir, tcfg, dcfg, block_size, new_positions) -> None:
    """The demo's one limit on the positions a request reaches: prompt + new tokens + a block
    (the last iteration drafts and verifies up to a block past its last token) within both
    models' max_position_embeddings; else a UsageError naming the option and the limit."""
    limit = min(tcfg.max_position_embeddings, dcfg.max_position_embeddings)
    if os.path.abspath(target_dir) == os.path.join(SHIPPED, "target"):
        why = f"the built-in pair's max_position_embeddings {limit}"
    elif tcfg.max_position_embeddings == limit:
        why = f"max_position_embeddings {limit} of --target {target_dir}"
    else:
        why = f"max_position_embeddings {limit} of --draft {draft_dir}"
    block = block_size or dcfg.block_size
    if new_positions + block <= limit:
        return
    if block_size and (new_positions + 2 <= limit or block_size > limit - 2):  # blame the block
        most, less = ((limit - new_positions, f"--prompt-len + --max-new-tokens, {new_positions}")
                      if new_positions + 2 <= limit else (limit - 2, "1 prompt and 1 new token"))
        raise UsageError(f"argument --block-size: got {block_size}; allowed: 2 .. {most} ({why} "
                         f"less {less})")
    raise UsageError(f"argument --prompt-len / --max-new-tokens: got {new_positions} "
                     f"positions together; allowed: at most {limit - block} ({why} less "
                     f"the block, {block})")


def _checkpoint_pair(target_dir, draft_dir, device, dtype, block_size, new_positions, batch):
    """(target, drafter) from checkpoint directories; a directory that is absent or does not
    load raises UsageError naming its option. ``new_positions``: prompt + new tokens a request
    (the caches get room for that plus one block)."""
    from safetensors import SafetensorError

    from ..models.config import DFlashConfig
    from ..models.drafter import DFlashDrafter
    from ..models.target import Target, TargetConfig
    from ..models.weights import load_state
    from .step import check_pair

    for option, path in (("--target", target_dir), ("--draft", draft_dir)):
        if not os.path.isfile(os.path.join(path, "config.json")):
            what = ("a directory without config.json" if os.path.isdir(path)
                    else "which is not a directory")
            raise UsageError(f"argument {option}: got {path!r}, {what}; allowed: a checkpoint "
                             f"directory (config.json + safetensors weights)")
    # NotImplementedError: a config field we refuse (a rope_scaling type, sliding targets)
    load_errors = (OSError, ValueError, KeyError, SafetensorError, NotImplementedError)
    try:
        tcfg = TargetConfig.from_hf(target_dir)
    except load_errors as e:
        raise _load_failure("--target", target_dir, e) from None
    try:
        dcfg = DFlashConfig.from_pretrained(draft_dir)
    except load_errors as e:
        raise _load_failure("--draft", draft_dir, e) from None
    if not block_size and dcfg.block_size < 2:
        raise UsageError(f"argument --block-size: not given, and {draft_dir}/config.json has "
                         f"block_size {dcfg.block_size}; allowed: an integer >= 2")
    _check_positions(target_dir, draft_dir, tcfg, dcfg, block_size, new_positions)
    if block_size:
        dcfg = dcfg.replace(block_size=block_size)
    max_len = new_positions + dcfg.block_size + 1
    slots = batch + 1  # + the steps' scratch request
    kw = dict(dtype=dtype, device=device, max_requests=slots, max_len=max_len,
              num_blocks=slots * (-(-max_len // _KV_BLOCK)))
    try:
        target = Target(tcfg, load_state(target_dir), block_size=_KV_BLOCK, **kw)
    except load_errors as e:
        raise _load_failure("--target", target_dir, e) from None
    try:
        drafter = DFlashDrafter(dcfg, load_state(draft_dir), embed_tokens=target.embed,
                                lm_head=target.lm_head, cache_block_size=_KV_BLOCK, **kw)
    except load_errors as e:
        raise _load_failure("--draft", draft_dir, e, f" with --target {target_dir!r}") from None
    try:  # the pair's fit (vocabulary, tap layers, widths), before any decoding
        check_pair(target, drafter, "dflash-ops demo")
    except ValueError as e:
        raise UsageError(f"argument --draft: got {draft_dir!r}, which does not fit --target "
                         f"{target_dir!r}: {str(e).removeprefix('dflash-ops demo: ')}") from None
    return target, drafter


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _decode_graphed(target, prompts, max_new_tokens, timings: Optional[dict] = None):
    """(new tokens per prompt, seconds): plain greedy decoding (every request runs to
    ``max_new_tokens``, no stop tokens) with the target's decode step, the forward of one token
    a request + argmax, captured once as a CUDA graph and replayed once a token. The seconds
    cover the prefill and the replays, not the capture; ``timings`` (a dict) gets the
    prefill's own seconds as ``"prefill"`` (synchronised after it)."""
    from .. import dispatch
    from .loop import _prefill

    dev = target.device
    n = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    for r, p in enumerate(prompts):
        target.add_request(r, len(p) + max_new_tokens + 1)
    try:
        ids = torch.zeros(n, dtype=torch.long, device=dev)        # each request's last token
        starts = lens.clone()                                       # its position
        out = torch.zeros(n, max_new_tokens, dtype=torch.long, device=dev)
        col = torch.ones(1, dtype=torch.long, device=dev)           # the next column of out
        requests = torch.arange(n, device=dev)
        ones = torch.ones(n, dtype=torch.long, device=dev)

        def step():
            nxt = target.forward(ids, requests, starts, ones, None, fp32_logits=False)[0]
            nxt = argmax_last(nxt)  # = nxt.argmax(-1), as the speculative steps take it
            ids.copy_(nxt)
            out.index_copy_(1, col, nxt[:, None])
            starts.add_(1)
            col.add_(1)

        graph = dispatch.capture_graph(step, device=dev)[0] if max_new_tokens > 1 else None
        starts.copy_(lens)  # the capture's warm-up call ran one real step: back to the start
        col.fill_(1)
        _sync(dev)
        t0 = time.perf_counter()
        logits = _prefill(target, prompts, None, fp32_logits=False)  # as the loop's
        ids.copy_(logits.argmax(-1))
        out[:, 0] = ids
        if timings is not None:
            _sync(dev)
            timings["prefill"] = time.perf_counter() - t0
        for _ in range(max_new_tokens - 1):
            graph.replay()
        tokens = out.tolist()
        return tokens, time.perf_counter() - t0
    finally:
        for r in range(n):
            target.free_request(r)


def _plain_greedy_timed(target, prompts, max_new_tokens):
    from .loop import plain_greedy

    t0 = time.perf_counter()
    tokens = plain_greedy(target, prompts, max_new_tokens)
    return tokens, time.perf_counter() - t0


def _speculative_timed(target, drafter, prompts, max_new_tokens, steps, time_stages,
                       policy=True):
    """(tokens, Stats, seconds without graph capture) of one speculative_generate run."""
    from .loop import speculative_generate

    _sync(target.device)
    t0 = time.perf_counter()
    tokens, st = speculative_generate(target, drafter, prompts, max_new_tokens, steps=steps,
                                      time_stages=time_stages, policy=policy)
    _sync(target.device)
    return tokens, st, time.perf_counter() - t0 - st.seconds["capture"]


def _target_top2(target, prompt, prefix):
    """The target's two largest logits (values, tokens) after prompt + prefix, by a prefill."""
    ids = torch.tensor(list(prompt) + list(prefix), device=target.device)
    target.add_request(0, len(ids) + 1)
    try:
        logits, _ = target.forward(ids, [0], [0], [len(ids)])
    finally:
        target.free_request(0)
    top = logits[-1].float().topk(2)
    return top.values.tolist(), top.indices.tolist()


def _differences(target, prompts, got, want):
    """One line per request whose DFlash output differs from plain greedy: the first differing
    new token, both tokens, and the target's top-2 logit gap at that position."""
    lines = []
    for r, (a, b) in enumerate(zip(got, want)):
        if a == b:
            continue
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if j == min(len(a), len(b)):
            lines.append(f"  request {r}: {len(a)} DFlash tokens vs {len(b)} plain greedy, "
                         f"equal up to {j}")
            continue
        (v1, v2), (t1, t2) = _target_top2(target, prompts[r], b[:j])
        lines.append(f"  request {r}: first difference at new token {j}: plain greedy {b[j]}, "
                     f"DFlash {a[j]}; target top-2 there: {t1} ({v1:.4f}), {t2} ({v2:.4f}), "
                     f"gap {v1 - v2:.4g}")
    return lines


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args) -> int:
    threads = torch.get_num_threads()
    try:
        return _run(args)
    finally:  # the thread count is the demo's own choice, not its caller's
        torch.set_num_threads(threads)


def _run(args) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = torch.device(device).type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if on_cuda else "fp32")]
    if args.steps == "graphs" and not on_cuda:
        raise UsageError(f"argument --steps: got 'graphs', which needs a CUDA device (the device "
                         f"is {device}); allowed on {device}: auto, direct, static")
    if (args.target is None) != (args.draft is None):
        given, missing = ("--target", "--draft") if args.target else ("--draft", "--target")
        raise UsageError(f"argument {missing}: missing; --target and --draft go together (got "
                         f"{given} {args.target or args.draft!r})")
    if not on_cuda:
        # The built-in pair's ops are too small to split across threads; one thread is its
        # fastest setting, and keeps both timings free of thread hand-off stalls on busy cores.
        threads = args.threads or (1 if args.target is None else torch.get_num_threads())
        torch.set_num_threads(threads)
    new_positions = args.prompt_len + args.max_new_tokens
    if args.target:
        target, drafter = _checkpoint_pair(args.target, args.draft, device, dtype,
                                           args.block_size, new_positions, args.batch)
        what = f"target {args.target}, drafter {args.draft}"
    else:
        target, drafter = _checkpoint_pair(os.path.join(SHIPPED, "target"),
                                           os.path.join(SHIPPED, "drafter"), device, dtype,
                                           args.block_size, new_positions, args.batch)
        what = "built-in tiny pair (trained on stdlib source: dflash-ops train-tiny)"
    if args.target:
        g = torch.Generator().manual_seed(args.seed)
        vocab = min(target.cfg.vocab_size, drafter.cfg.mask_token_id)
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.batch)]
    else:
        prompts = _text_prompts(args.batch, args.prompt_len, args.seed)
    n_new = args.max_new_tokens
    total = args.batch * n_new
    block = drafter.cfg.block_size
    if args.draft_window is not None:
        if args.draft_window < block:
            raise UsageError(f"argument --draft-window: got {args.draft_window}; allowed: an "
                             f"integer >= the block size {block} (the block's own keys)")
        drafter.set_context_window(args.draft_window)
    n_threads = torch.get_num_threads()
    where = device if on_cuda else f"cpu ({n_threads} thread{'' if n_threads == 1 else 's'})"
    print(f"dflash-ops demo: {what}; {where}, {str(dtype).replace('torch.', '')}, batch "
          f"{args.batch}, prompt {args.prompt_len} tokens, {n_new} new tokens each, "
          f"block {block}, steps {args.steps}{', exact mode' if args.exact else ''}"
          f"{f', draft window first 16 + last {args.draft_window}' if args.draft_window else ''}")

    from .loop import exact_mode
    with exact_mode(target, args.exact):
        return _compare(args, target, drafter, prompts, on_cuda, dtype, n_new, total, block)


def _compare(args, target, drafter, prompts, on_cuda, dtype, n_new, total, block) -> int:
    if on_cuda:
        baseline, base_path = _decode_graphed, "the target's decode step as a CUDA graph"
    else:
        baseline, base_path = _plain_greedy_timed, "loop.plain_greedy"
    stage_times = not args.no_stage_times
    _say("warm-up: plain greedy, DFlash ...")
    baseline(target, prompts, n_new)
    policy = args.policy == "on"
    _speculative_timed(target, drafter, prompts, n_new, args.steps, False, policy)
    _say("timed: plain greedy, DFlash ...")
    want, t_plain = baseline(target, prompts, n_new)
    # On the CPU stage timing adds no synchronisation, so the timed run also gives the stages.
    got, st, t_spec = _speculative_timed(target, drafter, prompts, n_new, args.steps,
                                         stage_times and not on_cuda, policy)
    stages = st.seconds
    if stage_times and on_cuda:
        _say("one more DFlash run, synchronising after each stage ...")
        stages = _speculative_timed(target, drafter, prompts, n_new, args.steps, True,
                                    policy)[1].seconds

    accepted = sum(a - 1 for a in st.acceptance)
    proposed = st.drafted
    speedup = t_plain / t_spec
    print()
    print(f"{'':24} {'plain greedy':>14} {'DFlash':>14}")
    print(f"{'tokens':24} {total:>14} {st.committed:>14}")
    print(f"{'seconds':24} {t_plain:>14.4f} {t_spec:>14.4f}")
    print(f"{'tokens/s':24} {total / t_plain:>14.1f} {st.committed / t_spec:>14.1f}")
    print(f"{'steps':24} {'':>14} {st.steps:>14}")
    print(f"{'iterations':24} {'':>14} {st.iterations:>14}")
    forwards = 1 + st.iterations - st.blocks.get(1, 0) + st.decode_steps
    print(f"{'target forwards':24} {n_new:>14} {forwards:>14}")
    ran = st.iterations > 0  # none where the prefill's token was all a request needed
    print(f"{'host syncs / iteration':24} {'':>14} "
          f"{f'{st.host_syncs / st.iterations:.2f}' if ran else 'n/a':>14}")
    print(f"{'acceptance length':24} {'1.00':>14} "
          f"{f'{st.mean_acceptance:.2f}' if ran else 'n/a':>14}")
    if policy and ran:
        chosen = ", ".join(f"{'decode' if b == 1 else f'block {b}'} {k}"
                           for b, k in sorted(st.blocks.items(), reverse=True))
        print(f"{'policy: iterations':24} {'':>14} {chosen:>14}")
    print(f"{'drafts accepted':24} {'':>14} {f'{accepted}/{proposed}':>14}")
    print(f"{'speedup':24} {'1.00x':>14} {speedup:>13.2f}x")
    if stage_times:
        for k, v in stages.items():
            if k != "capture":
                print(f"{'  time in ' + k:24} {'':>14} {v:>13.4f}s")
    print(f"{'  graph capture':24} {'':>14} {st.seconds['capture']:>13.4f}s (not timed)")
    print(f"\ntiming: one warm-up run each, then one timed run (prefill included); plain greedy "
          f"through {base_path}, DFlash through steps {st.steps}"
          + ("; time per stage from one more run, synchronised after each stage"
             if stage_times and on_cuda else ""))
    per_iter = (t_spec / max(1, st.iterations)) / (t_plain / n_new)
    print(f"acceptance length: tokens committed a request a drafting iteration; " +
          (f"an iteration took as long as {per_iter:.2f} plain decode steps on average" if ran
           else "no iteration ran (the prefill's token was every token asked for)"))
    if policy:
        print("policy (--policy on): each iteration drafts a block or decodes (greedy with "
              f"static or graphed steps: {DECODE_STEPS} tokens a request between host reads, "
              "else one), "
              "whichever its measured costs and the requests' acceptance make faster; "
              "--policy off always drafts")
    if speedup < 1 and not args.target and not policy:
        print(f"speedup below 1: {st.iterations} iterations (the batch runs until its slowest "
              f"request is done) at {per_iter:.2f} decode steps each cost more than plain "
              f"greedy's {n_new} decode steps; the tiny pair's steps are launch-bound, so a "
              f"draft step and an {block}-row verify cost what several 1-row decode steps do")

    diff = _differences(target, prompts, got, want)
    print(f"\noutput equals plain greedy decoding: {'no' if diff else 'yes'}")
    for line in diff:
        print(line)
    if diff and dtype != torch.float32 and not args.exact:
        print(f"  (in {str(dtype).replace('torch.', '')} a {block}-row verify and a 1-row decode "
              f"step round differently: where the target's top-2 gap is that small, the two "
              f"paths split at a near tie; --exact removes that)")
        return 0
    return 1 if diff else 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="DFlash greedy decoding on a tiny built-in pair (or local "
                                    "checkpoints), checked against plain greedy decoding",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, metavar="DIR",
                   help="HF Qwen3/Llama checkpoint directory, with --draft (default: the "
                        "built-in tiny pair)")
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="DFlash drafter checkpoint directory, with --target (default: the "
                        "built-in tiny pair)")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu, cuda or cuda:N (default: cuda if a GPU is visible, else cpu)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="model dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--batch", type=int_at_least(1), default=2,
                   help="requests decoded together (default: %(default)s)")
    p.add_argument("--prompt-len", type=int_at_least(1), default=24,
                   help="prompt tokens a request: stdlib text bytes for the built-in pair, "
                        "random tokens for checkpoints; prompt + new tokens + block within the "
                        "models' max_position_embeddings (4096 for the built-in pair; default: "
                        "%(default)s)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=48,
                   help="new tokens a request (default: %(default)s)")
    p.add_argument("--block-size", type=int_at_least(2, " (the last token + at least one draft)"),
                   default=None, help="DFlash block: the last committed token + block-1 drafts "
                                      "(default: the drafter's, 8 for the built-in pair)")
    p.add_argument("--seed", type=seed_arg, default=0,
                   help="seed of the prompts (default: %(default)s)")
    p.add_argument("--steps", choices=["auto", "direct", "static", "graphs"], default="auto",
                   help="the loop's draft/verify calls: direct, static-buffer steps, or those "
                        "steps captured as CUDA graphs (default: auto = graphs on CUDA, else "
                        "direct)")
    p.add_argument("--exact", action="store_true",
                   help="exact mode: GEMMs and attention whose rows do not depend on the rows "
                        "sharing the call, one kernel per op in eager and graphed calls, so "
                        "the DFlash output equals plain greedy decoding bit for bit in bf16 "
                        "too (it costs more time: README.md gives its measured cost, after "
                        "the quick start; default: off)")
    p.add_argument("--policy", choices=["on", "off"], default="on",
                   help="speculate only where it pays: each iteration drafts or decodes, "
                        "whichever is faster by the measured step costs and the acceptance so "
                        "far (default: %(default)s; off: always draft)")
    p.add_argument("--draft-window", type=int_at_least(2), default=None, metavar="W",
                   help="the drafter attends to its context's first 16 and last W tokens only "
                        "(whole cache pages; W >= the block size; lossless: only acceptance "
                        "moves; default: the whole context)")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="CPU threads of torch on the CPU (default: 1 for the built-in pair, "
                        "whose ops are too small to split; torch's own for checkpoints)")
    p.add_argument("--no-stage-times", action="store_true",
                   help="skip the time per stage (on CUDA it takes one more run that "
                        "synchronises after each stage; default: shown)")
