"""Continuous batching on a paged cache: requests join a running batch as they
arrive, leave when done, and their blocks serve the next ones.

    python examples/serve.py                 # GPT-2 (learned positions)
    python examples/serve.py --rope          # the same model with rotary positions
    python examples/serve.py --plot serve.png
    python examples/serve.py --draft 6       # speculative steps: trees of 6 drafts

The model is the NumPy GPT-2 of examples/gpt2.py with random weights, every
attention layer a fastattn.MultiHeadAttention over its own PagedKVCache
(blocks of --block-size positions from one pool).  A stream of requests with
different prompt and output lengths arrives over time; each step of the
server is ONE call per layer for everything running: the prompt chunks of
requests just admitted and one token of each decoding request, packed
(cu_seqlens).  A request is admitted when the pool has the blocks it will
fill besides those the running ones will still take (so that no admitted
request ever waits), and freed (free) when it has its tokens; greedy
decoding.

It prints the tokens per second, the blocks in use at the peak and the
memory a padded dense cache for the same requests in flight would have
needed, then checks that every request's tokens equal those of generating
it alone (fastattn's attention gives each sequence the bits of a call of
its own; NumPy's BLAS may round a projection of another batch differently
in the last bits, which can only flip a token at a near-tie of its logits:
reported if it happens).

Parallel sampling then forks a prompt of 2100 tokens --samples ways: the
forks hold the prompt's blocks, and each decoding step reads them once for
all the forks (the bytes per step printed, and plotted with --plot).

Then speculative decoding (SpecInfer, Medusa, EAGLE-2) of the first
requests: each step verifies a tree of up to --draft tokens in one call
(``tree_mask``: a draft sees the tokens before the tree and its own
ancestors), keeps the longest path greedy decoding agrees with, and drops
the rest (``PagedKVCache.accept_draft``).  The drafts come from the
context itself, prompt-lookup style: the tokens that followed the last
token where it occurred before.  Greedy verification gives the tokens of
plain greedy decoding, which the example checks.
"""
import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see examples/gpt2.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fastattn  # noqa: E402
import gpt2  # noqa: E402  (the model of examples/gpt2.py)
from fastattn._extras import need  # noqa: E402


def rotary_tables(max_pos, head_dim, base=10000.0):
    """cos and sin (max_pos, head_dim / 2) of RoFormer's angles (Llama's)."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.arange(max_pos)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class PagedGPT2(gpt2.GPT2):
    """GPT-2 over paged caches: forward on a ragged batch of new tokens."""

    def __init__(self, state_dict, num_heads, rope=False):
        super().__init__(state_dict, num_heads)
        head_dim = self.embed_dim // num_heads
        self.rotary = rotary_tables(self.n_positions, head_dim) if rope else None

    def new_paged_caches(self, num_blocks, block_size):
        return [mha.new_paged_cache(num_blocks, block_size) for mha in self.attn]

    def forward_ragged(self, tokens, positions, seq_ids, cu, caches, tree_mask=None):
        """Logits (B, vocab) of the last new token of each of B sequences:
        tokens and positions (n,) packed, sequence b's at cu[b]..cu[b+1]-1;
        with a tree_mask (paged_attention's), the logits of every token."""
        w, eps = self.w, self.eps
        x = w["transformer.wte.weight"][tokens]
        if self.rotary is None:  # GPT-2's learned positions; with rotary, none added here
            x = x + w["transformer.wpe.weight"][positions]
        for i, mha in enumerate(self.attn):
            p = f"transformer.h.{i}."
            h = gpt2.layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
            tree = {} if tree_mask is None else dict(
                tree_mask=tree_mask, positions=None if self.rotary is None else positions)
            a, _ = mha(h, cache=caches[i], seq_ids=seq_ids, cu_seqlens=cu, rotary=self.rotary,
                       **tree)
            x = x + a
            h = gpt2.layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
            h = gpt2.gelu_new(gpt2.conv1d(h, w[p + "mlp.c_fc.weight"], w[p + "mlp.c_fc.bias"]))
            x = x + gpt2.conv1d(h, w[p + "mlp.c_proj.weight"], w[p + "mlp.c_proj.bias"])
        last = x[cu[1:] - 1] if tree_mask is None else x
        last = gpt2.layer_norm(last, w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], eps)
        return last @ self.lm_head.T


@dataclass
class Request:
    rid: int
    arrival: int              # the step it arrives at
    prompt: np.ndarray
    new_tokens: int
    tokens: list = field(default_factory=list)
    seq: int = -1             # its sequence in the caches, once admitted
    prefilled: int = 0        # prompt tokens in the cache so far
    last_margin: float = np.inf  # smallest gap between its two best logits

    def done(self):
        return len(self.tokens) == self.new_tokens


def requests(rng, n, vocab, max_prompt, max_new, rate):
    arrivals = np.cumsum(rng.poisson(1 / rate, n))
    return [Request(i, int(t), rng.integers(0, vocab, rng.integers(4, max_prompt + 1)),
                    int(rng.integers(4, max_new + 1))) for i, t in enumerate(arrivals)]


def blocks(r, block_size):
    """Blocks a request holds when done: its prompt and its tokens but the
    last (which is never fed back)."""
    return -(-(len(r.prompt) + r.new_tokens - 1) // block_size)


def serve(model, reqs, num_blocks, block_size, chunk):
    """Runs the stream; returns the per-step log (tokens, blocks, padded positions)."""
    caches = model.new_paged_caches(num_blocks, block_size)
    waiting, running, log, step = list(reqs), [], [], 0
    while waiting or running:
        # admit arrived requests, first come first served, while the pool can
        # hold all they will write and all the running ones still will: no
        # request ever waits for a block once admitted (no preemption)
        while waiting and waiting[0].arrival <= step:
            r = waiting[0]
            owed = sum(blocks(q, block_size) - len(caches[0].block_table([q.seq])[0])
                       for q in running)
            if blocks(r, block_size) + owed > caches[0].num_free_blocks:
                break
            waiting.pop(0)
            for c in caches:
                r.seq = c.add_sequence()
            running.append(r)
        if not running:
            step += 1
            continue
        ids, toks, pos, cu = [], [], [], [0]
        for r in running:  # a prompt chunk, or the last token generated
            held = r.prefilled + max(len(r.tokens) - 1, 0)
            new = r.prompt[r.prefilled:r.prefilled + chunk] if r.prefilled < len(r.prompt) \
                else np.array([r.tokens[-1]])
            ids.append(r.seq)
            toks.append(new)
            pos.append(held + np.arange(len(new)))
            cu.append(cu[-1] + len(new))
        logits = model.forward_ragged(np.concatenate(toks), np.concatenate(pos), ids,
                                      np.array(cu), caches)
        finished = []
        for b, r in enumerate(running):
            if r.prefilled < len(r.prompt):
                r.prefilled += len(toks[b])
                if r.prefilled < len(r.prompt):
                    continue  # more of the prompt next step
            top2 = np.sort(logits[b])[-2:]
            r.last_margin = min(r.last_margin, float(top2[1] - top2[0]))
            r.tokens.append(int(np.argmax(logits[b])))
            if r.done():
                finished.append(r)
        in_use = num_blocks - caches[0].num_free_blocks
        longest = max(len(r.prompt) + r.new_tokens for r in running)
        log.append(dict(step=step, tokens=int(cu[-1]), running=len(running), blocks=in_use,
                        padded=len(running) * longest))
        for r in finished:
            running.remove(r)
            for c in caches:
                c.free(r.seq)
        step += 1
    return log


def alone(model, r, block_size):
    """The request generated by itself, on fresh caches, prompt then tokens."""
    caches = model.new_paged_caches(blocks(r, block_size), block_size)
    for c in caches:
        seq = c.add_sequence()
    tokens = []
    ids, pos = r.prompt, np.arange(len(r.prompt))
    for _ in range(r.new_tokens):
        logits = model.forward_ragged(ids, pos, [seq], np.array([0, len(ids)]), caches)
        tokens.append(int(np.argmax(logits[0])))
        ids, pos = np.array([tokens[-1]]), np.array([pos[-1] + 1])
    return tokens


def draft_tree(context, root, size):
    """A tree of at most `size` tokens after the context, rooted at its last
    token `root` (not yet in the cache): each node's children are the
    distinct tokens that followed its token in the context, latest first, a
    breadth-first tree.  Returns its tokens, each one's parent (-1: the
    root) and depth, in topological order."""
    followers = {}
    for a, b in zip(context, context[1:]):
        followers.setdefault(a, []).insert(0, b)
    tokens, parents, depths, at = [root], [-1], [0], 0
    while at < len(tokens) and len(tokens) < size:
        for t in dict.fromkeys(followers.get(tokens[at], [])):
            if len(tokens) == size:
                break
            tokens.append(t)
            parents.append(at)
            depths.append(depths[at] + 1)
        at += 1
    return np.array(tokens), parents, np.array(depths)


def speculate(model, r, block_size, size):
    """Greedy decoding of request r with tree verification: (its tokens,
    verify steps).  Each step feeds the tree rooted at the last token and
    keeps the path whose every token is the argmax after its parent, plus
    the argmax after the path (the step's free token)."""
    caches = model.new_paged_caches(blocks(r, block_size) + -(-size // block_size) + 1, block_size)
    for c in caches:
        seq = c.add_sequence()
    logits = model.forward_ragged(r.prompt, np.arange(len(r.prompt)), [seq],
                                  np.array([0, len(r.prompt)]), caches)
    tokens, steps = [int(np.argmax(logits[0]))], 0
    while len(tokens) < r.new_tokens:
        held = len(r.prompt) + len(tokens) - 1
        tree, parents, depths = draft_tree(list(r.prompt) + tokens, tokens[-1], size)
        mask = np.zeros((len(tree), len(tree)), bool)
        for i, p in enumerate(parents):
            mask[i] = mask[p] if p >= 0 else False
            mask[i, i] = True
        logits = model.forward_ragged(tree, held + depths, [seq], np.array([0, len(tree)]),
                                      caches, tree_mask=mask.ravel())
        path, node = [0], 0
        while True:  # down the children greedy decoding agrees with
            best = int(np.argmax(logits[node]))
            child = next((i for i, p in enumerate(parents) if p == node and tree[i] == best), None)
            tokens.append(best)
            if child is None:
                break
            path.append(node := child)
        for c in caches:
            c.accept_draft([seq], [len(tree)], [path])
        steps += 1
    return tokens[:r.new_tokens], steps


def parallel_sampling(model, prompt, samples, new_tokens, block_size, rng):
    """Parallel sampling: the prompt prefilled once, forked `samples` ways
    (PagedKVCache.fork: its blocks shared, copy on write), each fork
    sampling its own tokens (temperature 1).  Per decoding step, the bytes
    of keys and values the attention kernels stream, as the scheduler
    counts them (the prompt's blocks once for the forks that read them
    together, fastattn._dispatch.reads: what `fastattn bench --serving`
    reports), and what each fork reading its own would stream.  Returns
    ([(shared, plain) per step], the forks' tokens)."""
    need = -(-(len(prompt) + new_tokens) // block_size) * samples
    caches = model.new_paged_caches(need, block_size)
    for c in caches:
        first = c.add_sequence()
    model.forward_ragged(prompt, np.arange(len(prompt)), [first], np.array([0, len(prompt)]),
                         caches)
    for c in caches:  # the same ids in every layer's cache
        ids = [first] + [c.fork(first) for _ in range(samples - 1)]
    last = np.full(samples, prompt[-1])
    tokens, reads = [[] for _ in range(samples)], []
    row = sum(c.num_kv_heads * (c.head_dim + c.value_dim) * c.dtype.itemsize for c in caches)
    for step in range(new_tokens):
        pos = np.full(samples, len(prompt) + step - 1)
        with fastattn._dispatch.reads() as shared:
            logits = model.forward_ragged(last, pos, ids, np.arange(samples + 1), caches)
        reads.append((sum(shared), int(caches[0].seq_lens_of(ids).sum()) * row))
        last = np.argmax(logits + rng.gumbel(size=logits.shape), axis=1)  # a sample each
        for t, x in zip(tokens, last):
            t.append(int(x))
    return reads, tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="requests in the stream (32)")
    parser.add_argument("--rate", type=float, default=0.5,
                        help="requests arriving per step, on average (0.5)")
    parser.add_argument("--block-size", type=int, default=16, help="positions per block (16)")
    parser.add_argument("--blocks", type=int, default=64,
                        help="blocks in each layer's pool (64): fewer makes requests wait")
    parser.add_argument("--chunk", type=int, default=32,
                        help="prompt tokens of a request per step (chunked prefill, 32)")
    parser.add_argument("--rope", action="store_true",
                        help="rotary positions (a Llama-like variant) instead of GPT-2's learned ones")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the stream")
    parser.add_argument("--draft", type=int, default=6,
                        help="tokens per tree in the speculative run of the first requests (6)")
    parser.add_argument("--samples", type=int, default=8,
                        help="forks of a 2100-token prompt in the parallel-sampling run (8)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw tokens per step, blocks in use and a padded cache's size, "
                             "and the bytes parallel sampling's steps read")
    args = parser.parse_args(argv)
    for name in ("requests", "block_size", "blocks", "chunk", "draft", "samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.rate > 0:
        parser.error(f"--rate must be above 0, got {args.rate}")
    if args.plot and not args.plot.endswith(".png"):
        parser.error(f"--plot takes a file name ending in .png, like serve.png; got {args.plot!r}")
    if args.plot:  # checked before the run, not after it
        need("plot", "examples/serve.py --plot")
    vocab, n_pos, embed, layers, heads = 101, 128, 64, 3, 4
    rng = np.random.default_rng(args.seed)
    model = PagedGPT2(gpt2.random_state_dict(vocab, n_pos, embed, layers, rng), heads, args.rope)
    reqs = requests(rng, args.requests, vocab, 48, 40, args.rate)
    largest = max(blocks(r, args.block_size) for r in reqs)
    if largest > args.blocks:  # it could never be admitted: the stream would not end
        parser.error(f"a request of this stream needs {largest} blocks of {args.block_size} "
                     f"positions and the pool has {args.blocks}: give --blocks {largest} or more")
    start = time.perf_counter()
    log = serve(model, reqs, args.blocks, args.block_size, args.chunk)
    seconds = time.perf_counter() - start

    generated = sum(r.new_tokens for r in reqs)
    tokens = sum(e["tokens"] for e in log)
    per_block = args.block_size * layers * 2 * embed * 4  # keys and values of every layer
    peak = max(e["blocks"] for e in log)
    padded = max(e["padded"] for e in log)
    print(f"random GPT-2 ({layers} layers, {heads} heads, embed_dim {embed}"
          f"{', rotary positions' if args.rope else ''}) on fastattn {fastattn.__version__}: "
          f"{len(reqs)} requests, prompts of {min(len(r.prompt) for r in reqs)}.."
          f"{max(len(r.prompt) for r in reqs)} tokens, {min(r.new_tokens for r in reqs)}.."
          f"{max(r.new_tokens for r in reqs)} new tokens, arriving over "
          f"{reqs[-1].arrival + 1} steps")
    print(f"{len(log)} steps, at most {max(e['running'] for e in log)} requests at once: "
          f"{generated} tokens generated ({tokens} processed) in {seconds:.2f} s, "
          f"{generated / seconds:.0f} generated tokens/s")
    print(f"memory: at most {peak} of {args.blocks} blocks of {args.block_size} positions in use "
          f"({peak * per_block / 2**10:.0f} KiB); a padded dense cache for the same requests in "
          f"flight needs {padded} positions ({padded * per_block / args.block_size / 2**10:.0f} "
          f"KiB), {padded / (peak * args.block_size):.1f}x as much")

    differ = [(r, t) for r in reqs if (t := alone(model, r, args.block_size)) != r.tokens]
    near_ties = [r for r, _ in differ if r.last_margin < 1e-3]
    print(f"each request's tokens against generating it alone: {len(reqs) - len(differ)} of "
          f"{len(reqs)} equal" + (f" ({len(near_ties)} differ at a near-tie of their logits)"
                                  if differ else ""))
    spec = reqs[:4]
    runs = [speculate(model, r, args.block_size, args.draft) for r in spec]
    tokens = sum(r.new_tokens for r in spec)
    same = [r for r, (t, _) in zip(spec, runs) if t == alone(model, r, args.block_size)]
    print(f"speculative decoding of the first {len(spec)} requests, trees of up to "
          f"{args.draft} tokens: {tokens} tokens in {sum(n for _, n in runs)} verify steps "
          f"(plain decoding: {tokens - len(spec)}); tokens equal to greedy decoding alone: "
          f"{len(same)} of {len(spec)}")
    # decoding splits keys from 2048 on: a longer model with rotary positions
    long_model = PagedGPT2(gpt2.random_state_dict(vocab, 2200, embed, layers, rng), heads, True)
    prompt = rng.integers(0, vocab, 2100)
    reads, samples = parallel_sampling(long_model, prompt, args.samples, 8, args.block_size, rng)
    shared, plain = sum(r[0] for r in reads) / len(reads), sum(r[1] for r in reads) / len(reads)
    print(f"parallel sampling: {args.samples} forks of a prompt of {len(prompt)} tokens, "
          f"{len(reads)} steps: {shared / 2**10:.0f} KiB of keys and values read per step, "
          f"against {plain / 2**10:.0f} KiB with each fork reading its own "
          f"({plain / shared:.1f}x); {len(set(map(tuple, samples)))} different samples")
    if args.plot:
        plot(log, reads, args.plot, args.block_size)
        print(f"wrote {args.plot}")
    return 0 if len(differ) == len(near_ties) and len(same) == len(spec) else 1


def plot(log, reads, path, block_size):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in log]
    fig = plt.figure(figsize=(8, 9))
    top = fig.add_subplot(3, 1, 1)
    bottom = fig.add_subplot(3, 1, 2, sharex=top)
    sampling = fig.add_subplot(3, 1, 3)
    top.plot(steps, [e["tokens"] for e in log], label="tokens in the step's call")
    top.plot(steps, [e["running"] for e in log], label="requests running")
    top.set_ylabel("per step")
    top.legend()
    bottom.plot(steps, [e["blocks"] * block_size for e in log], label="paged: positions in blocks in use")
    bottom.plot(steps, [e["padded"] for e in log], label="padded dense cache: positions")
    bottom.set_xlabel("step")
    bottom.set_ylabel("positions held (per layer)")
    bottom.legend()
    n = range(1, len(reads) + 1)
    sampling.plot(n, [r[1] / 2**10 for r in reads], "o-", label="each fork reads its own")
    sampling.plot(n, [r[0] / 2**10 for r in reads], "o-", label="shared blocks read once")
    sampling.set_xlabel("parallel sampling: decoding step")
    sampling.set_ylabel("KiB of keys and values read")
    sampling.set_ylim(bottom=0)
    sampling.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
