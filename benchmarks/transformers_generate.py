"""A whole Hugging Face generate() on fastattn against SDPA: time and peak memory.

    python benchmarks/transformers_generate.py                  # 4096 prompt tokens
    python benchmarks/transformers_generate.py --prompt 1024 --new-tokens 16 --overhead

A Llama-shaped model is built from its config with random weights (nothing
is downloaded): by default hidden 1024, 16 query heads and 4 key/value heads
of 64, 4 layers, float32.  Each case runs in a fresh process, so that one
implementation's allocations and threads do not colour the other's, and
reports:

* prefill: seconds from generate() to the first token (the prompt's pass);
* per token: the mean seconds of each later token (one-token steps on the cache);
* peak: the resident memory generate() added at its high point (Linux), KV
  cache included, and the model and inputs excluded.

generate() runs twice: times are the better of the two, and the peak is
given for both, as the first run also grows the memory allocator's heap
(the second is what a long-running process sees).

Cases: one prompt (no padding: SDPA's mask is None), and a left-padded batch
of two prompts (the second a quarter shorter), where SDPA's mask function
materialises a (B, 1, L, S) boolean mask and fastattn's keeps (B, 1, 1, S).

``--overhead`` also times one attention call at tiny decode shapes through
transformers' SDPA function and through fastattn's, on one thread: the
per-call cost of each path when the arithmetic is negligible.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def build_model(args):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt + args.new_tokens,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


def run_case(args):
    """In the child process: one implementation, one case; prints a JSON line."""
    import torch
    import transformers

    from fastattn.bench.measure import PeakRSS
    from fastattn.integrations.transformers import register

    register()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    model.set_attn_implementation(args.impl)
    batch = 1 if args.case == "single" else 2
    ids = torch.randint(3, 32000, (batch, args.prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if batch == 2:
        mask[1, :args.prompt // 4] = 0
        ids[1, :args.prompt // 4] = 0

    stamps = []

    class Stamp(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    def generate():
        stamps.clear()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False,
                                 logits_processor=[Stamp()])
        return out, t0

    runs = []
    for _ in range(2):  # the first run also grows the allocator's heap; the second shows the steady state
        with PeakRSS() as peak:
            out, t0 = generate()
        runs.append(dict(prefill_s=stamps[0] - t0,
                         per_token_s=(stamps[-1] - stamps[0]) / (len(stamps) - 1),
                         peak_mb=None if peak.bytes is None else peak.bytes / 2**20))
    result = dict(impl=args.impl, case=args.case, batch=batch, prompt=args.prompt,
                  new_tokens=args.new_tokens, threads=args.threads, runs=runs,
                  tokens=out[:, args.prompt:].tolist())
    print(json.dumps(result))


def overhead(repeat=20000):
    """Per-call microseconds of transformers' SDPA function and fastattn's at
    tiny decode shapes (one query, 32 cached keys), on one thread."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fastattn.integrations._hf_masks import fastattn_mask
    from fastattn.integrations.transformers import attention_forward

    torch.set_num_threads(1)
    rows = []
    for hq, hkv, e in [(4, 2, 16), (4, 4, 16), (32, 8, 64)]:
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = hq // hkv, True
        q = torch.randn(1, 1, hq * e).view(1, 1, hq, e).transpose(1, 2)
        k, v = torch.randn(1, hkv, 32, e), torch.randn(1, hkv, 32, e)
        mask = fastattn_mask(batch_size=1, q_length=1, kv_length=32, q_offset=31)
        calls = {"sdpa": lambda: sdpa_attention_forward(module, q, k, v, None, scaling=0.125),
                 "fastattn": lambda: attention_forward(module, q, k, v, mask, scaling=0.125)}
        best = {name: float("inf") for name in calls}
        with torch.inference_mode():
            for _ in range(15):  # interleaved rounds: a busy machine disturbs both alike
                for name, call in calls.items():
                    for _ in range(200):
                        call()
                    t0 = time.perf_counter()
                    for _ in range(repeat // 15):
                        call()
                    best[name] = min(best[name], (time.perf_counter() - t0) / (repeat // 15))
        rows.append((hq, hkv, e, best["sdpa"] * 1e6, best["fastattn"] * 1e6))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated (default 32)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads, which fastattn follows (default: torch's)")
    p.add_argument("--cases", default="single,padded", help="single,padded (default both)")
    p.add_argument("--overhead", action="store_true", help="also time one tiny decode call")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument("--impl", help=argparse.SUPPRESS)  # the child process's case
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (a time per token needs two tokens)")
    if args.threads is None:
        import torch
        args.threads = torch.get_num_threads()
    if args.impl:
        return run_case(args)

    results = []
    for case in args.cases.split(","):
        for impl in ["sdpa", "fastattn"]:
            child = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--overhead"]
            r = subprocess.run([sys.executable, __file__, *child, "--impl", impl, "--case", case,
                                "--threads", str(args.threads)],
                               capture_output=True, text=True, check=False)
            if r.returncode:
                sys.exit(f"{impl} {case} failed:\n{r.stderr}")
            results.append(json.loads(r.stdout.splitlines()[-1]))
    print(f"Llama-shaped model from config: hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads} query / {args.kv_heads} key-value heads of {args.hidden // args.heads}, "
          f"float32; {args.prompt} prompt tokens, {args.new_tokens} new; {args.threads} threads")
    print(f"{'case':<8} {'impl':<9} {'prefill s':>10} {'ms/token':>9} {'peak MB, 1st run':>17} "
          f"{'2nd run':>8}")
    for r in results:
        first, second = r["runs"]
        peaks = ["-" if x["peak_mb"] is None else f"{x['peak_mb']:.0f}" for x in r["runs"]]
        print(f"{r['case']:<8} {r['impl']:<9} {min(first['prefill_s'], second['prefill_s']):>10.2f} "
              f"{min(first['per_token_s'], second['per_token_s']) * 1e3:>9.1f} {peaks[0]:>17} "
              f"{peaks[1]:>8}")
    for case in args.cases.split(","):
        a, b = (next(r for r in results if r["case"] == case and r["impl"] == i)
                for i in ("sdpa", "fastattn"))
        print(f"{case}: same tokens as SDPA: {a['tokens'] == b['tokens']}")
    if args.overhead:
        print("one attention call, 1 query, 32 keys, 1 thread (best of 15 rounds):")
        for hq, hkv, e, t_sdpa, t_ours in overhead():
            print(f"  Hq {hq:>2} Hkv {hkv} E {e:>2}: SDPA {t_sdpa:5.1f} us, fastattn {t_ours:5.1f} us"
                  f" ({t_ours - t_sdpa:+.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
