"""Hugging Face generate() with every attention layer on fastattn.

    python examples/transformers_generate.py                      # a small random Llama, offline
    python examples/transformers_generate.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        "The capital of France is" "Attention is"                 # a checkpoint from the hub

Registering once is all it takes: fastattn.integrations.transformers.register()
adds the name "fastattn" to transformers' attention and mask interfaces, and
from_pretrained(..., attn_implementation="fastattn") (or
model.set_attn_implementation("fastattn")) picks it.  The prompts are batched
with left padding, as generate() wants them.  The same generate() is then run
on PyTorch's SDPA, and the two are compared: tokens, and the time of the
whole generate() (median of alternating runs after one warm-up call each).
"""
import argparse
import statistics
import time

from fastattn._extras import need

need("transformers", "examples/transformers_generate.py")  # a one-line hint, not a traceback
import torch  # noqa: E402
import transformers  # noqa: E402

from fastattn.integrations.transformers import register  # noqa: E402


def random_llama():
    """A Llama-shaped model with random weights (grouped-query attention:
    8 query heads share 2 key/value heads), and random prompts."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=704,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, max_position_embeddings=1024,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 1000, (2, 200))
    mask = torch.ones_like(ids)
    ids[1, :80], mask[1, :80] = 0, 0  # the second prompt is 120 tokens, left-padded
    return model, None, ids, mask


def from_hub(name, prompts):
    tokenizer = transformers.AutoTokenizer.from_pretrained(name, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(
        name, dtype=torch.float32, attn_implementation="fastattn").eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    return model, tokenizer, batch["input_ids"], batch["attention_mask"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prompts", nargs="*", default=["The capital of France is"],
                   help="prompts for --model (default: one)")
    p.add_argument("--model", help="a causal LM on the hub or a local directory "
                   "(default: a small Llama with random weights, nothing downloaded)")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--runs", type=int, default=5,
                   help="timed generate() calls per implementation, alternating (default 5)")
    args = p.parse_args()
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")

    register()  # once per process: the name "fastattn" for attention and masks
    if args.model:
        model, tokenizer, ids, mask = from_hub(args.model, args.prompts)
    else:
        model, tokenizer, ids, mask = random_llama()
    threads = torch.get_num_threads()
    print(f"{type(model).__name__}: {model.config.num_hidden_layers} layers, "
          f"{model.config.num_attention_heads} query / "
          f"{getattr(model.config, 'num_key_value_heads', model.config.num_attention_heads)} "
          f"key-value heads; batch {tuple(ids.shape)}, {threads} thread{'s' * (threads != 1)}")

    def generate(impl):
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                 do_sample=False)
            return out[:, ids.shape[1]:], time.perf_counter() - t0

    # one untimed call each (the first allocates, loads and warms caches), then
    # the two in turn, so that a machine whose load changes slows both alike
    impls = ["fastattn", "sdpa"]
    results = {impl: generate(impl)[0] for impl in impls}
    times = {impl: [] for impl in impls}
    for run in range(args.runs):
        for impl in impls if run % 2 == 0 else impls[::-1]:
            times[impl].append(generate(impl)[1])
    print(f"generate() of {args.max_new_tokens} new tokens, the whole call (the model's "
          f"projections and MLPs included), median of {args.runs} alternating runs after a "
          "warm-up:")
    for impl in impls:
        t = sorted(times[impl])
        print(f"{impl:>8}: {statistics.median(t):.3f} s (runs {t[0]:.3f} to {t[-1]:.3f} s)")

    same = torch.equal(results["fastattn"], results["sdpa"])
    print(f"same tokens on fastattn and SDPA: {same}")
    for row, tokens in enumerate(results["fastattn"]):
        text = tokens.tolist() if tokenizer is None else repr(
            tokenizer.decode(tokens, skip_special_tokens=True))
        print(f"[{row}] {text}")


if __name__ == "__main__":
    main()
