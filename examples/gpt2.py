"""A GPT-2 decoder in NumPy on fastattn, generating token by token with a KVCache.

    python examples/gpt2.py

GPT-2 (Radford et al. 2019) is a stack of pre-LayerNorm blocks, each a
causal self-attention and an MLP, over token and position embeddings, with
the output layer tied to the token embedding.  This file reads Hugging Face
GPT2LMHeadModel's state-dict names (its Conv1D weights are stored
(in, out), the transpose of nn.Linear's), runs every attention layer on a
fastattn.MultiHeadAttention, and generates greedily with one KVCache per
layer.  No checkpoint is downloaded: the demo draws random weights, then
checks that each cached step equals the matching row of a full causal pass.

    python examples/gpt2.py --compare-storage --new-tokens 32

decodes with the caches held in each storage of a float32 KVCache (16-, 8-
and 4-bit ones; bfloat16 needs pip install 'fastattn[bfloat16]'), and the
int8 and int4 caches again with precision="int8" (integer dot products), and
compares the tokens and the logits of every step with the float32 cache's.
"""
import argparse
import math
import os
import sys

import numpy as np

# This script runs NumPy's BLAS (the projections) and fastattn's OpenMP
# threads by turns: threads that sleep while the other library works, instead
# of spinning, keep them from taking each other's cores (MiniLM: 86 -> 26 ms).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import fastattn  # noqa: E402  (after the setting above, which OpenMP reads when it loads)
from fastattn._extras import need  # noqa: E402
from fastattn._storage import FLOAT32_STORAGES  # noqa: E402  (KVCache's storage table)


def layer_norm(x, weight, bias, eps):
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(var + eps) * weight + bias


def conv1d(x, weight, bias):
    """Hugging Face's Conv1D, x @ weight + bias with weight (in, out), as one
    2-D BLAS product (NumPy runs a stack of 3-D products much slower)."""
    return (x.reshape(-1, x.shape[-1]) @ weight + bias).reshape(x.shape[:-1] + (-1,))


def gelu_new(x):
    """GPT-2's tanh approximation of GELU (Hendrycks & Gimpel 2016)."""
    c = x.dtype.type(math.sqrt(2 / math.pi))
    return 0.5 * x * (1 + np.tanh(c * (x + x.dtype.type(0.044715) * x * x * x)))


def random_state_dict(vocab_size, n_positions, n_embd, n_layer, rng, std=0.1):
    """Random weights under GPT2LMHeadModel's names (biases and LayerNorms
    random too, so that every parameter matters)."""
    E = n_embd
    shapes = {"transformer.wte.weight": (vocab_size, E), "transformer.wpe.weight": (n_positions, E),
              "transformer.ln_f.weight": (E,), "transformer.ln_f.bias": (E,)}
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        shapes.update({p + "ln_1.weight": (E,), p + "ln_1.bias": (E,),
                       p + "attn.c_attn.weight": (E, 3 * E), p + "attn.c_attn.bias": (3 * E,),
                       p + "attn.c_proj.weight": (E, E), p + "attn.c_proj.bias": (E,),
                       p + "ln_2.weight": (E,), p + "ln_2.bias": (E,),
                       p + "mlp.c_fc.weight": (E, 4 * E), p + "mlp.c_fc.bias": (4 * E,),
                       p + "mlp.c_proj.weight": (4 * E, E), p + "mlp.c_proj.bias": (E,)})
    sd = {k: (rng.standard_normal(s) * std).astype(np.float32) for k, s in shapes.items()}
    for k in sd:
        if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            sd[k] += 1
    return sd


class GPT2:
    """GPT2LMHeadModel's forward in NumPy, attention on fastattn.

    Parameters
    ----------
    state_dict : mapping of Hugging Face GPT2LMHeadModel names -> arrays
        (``lm_head.weight`` may be absent: it is tied to the token embedding)
    num_heads : int
    eps : float, the LayerNorms' epsilon (GPT-2's layer_norm_epsilon)
    dtype : float32 or float64
    """

    def __init__(self, state_dict, num_heads, *, eps=1e-5, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        w = {k: np.asarray(v, dtype=self.dtype) for k, v in state_dict.items()
             if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # old causal-mask buffers
        self.w, self.eps = w, eps
        self.n_positions, self.embed_dim = w["transformer.wpe.weight"].shape
        self.attn = []
        i = 0
        while f"transformer.h.{i}.ln_1.weight" in w:
            p = f"transformer.h.{i}.attn."
            mha = fastattn.MultiHeadAttention(self.embed_dim, num_heads, dtype=self.dtype)
            mha.load_state_dict({"in_proj_weight": w[p + "c_attn.weight"].T,  # Conv1D: (in, out)
                                 "in_proj_bias": w[p + "c_attn.bias"],
                                 "out_proj.weight": w[p + "c_proj.weight"].T,
                                 "out_proj.bias": w[p + "c_proj.bias"]})
            self.attn.append(mha)
            i += 1
        self.lm_head = w.get("lm_head.weight", w["transformer.wte.weight"])

    def new_caches(self, batch_size, capacity, storage=None):
        """One empty KVCache per layer, holding its keys and values in
        storage (KVCache's: "float32", "float16", "bfloat16", "int8",
        "float8_e4m3fn", "float8_e5m2", "int4"; None:
        the model's dtype)."""
        return [mha.new_cache(batch_size, capacity, storage=storage) for mha in self.attn]

    def forward(self, input_ids, attention_mask=None, caches=None, precision="exact"):
        """Logits (B, L, vocab_size) of L new tokens.

        input_ids : int (B, L); attention_mask : int or bool (B, L), 1 = real
        token, 0 = padding (Hugging Face's convention), None = all real.
        caches : list of KVCache (``new_caches``) holding the earlier tokens,
        or None for a full causal pass.  Positions count the real tokens
        before each one, as Hugging Face's generate does for left padding.
        precision : the caches' (MultiHeadAttention.forward's: "int8" for
        integer dot products against int8 and int4 caches)."""
        B, L = input_ids.shape
        real = np.ones((B, L), bool) if attention_mask is None else np.asarray(attention_mask) != 0
        before = caches[0].lengths if caches else np.zeros(B, np.int64)
        positions = np.maximum(before[:, None] + np.cumsum(real, axis=1) - 1, 0)
        if positions.max(initial=0) >= self.n_positions:
            raise ValueError(f"position {positions.max()} is past n_positions={self.n_positions}")
        w, eps = self.w, self.eps
        x = w["transformer.wte.weight"][input_ids] + w["transformer.wpe.weight"][positions]
        padding = ~real  # nn.MultiheadAttention's convention: True = ignore
        for i, mha in enumerate(self.attn):
            p = f"transformer.h.{i}."
            h = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
            a, _ = mha(h, key_padding_mask=padding, is_causal=True,
                       cache=caches[i] if caches else None, precision=precision)
            x = x + a
            h = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
            h = gelu_new(conv1d(h, w[p + "mlp.c_fc.weight"], w[p + "mlp.c_fc.bias"]))
            x = x + conv1d(h, w[p + "mlp.c_proj.weight"], w[p + "mlp.c_proj.bias"])
        x = layer_norm(x, w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], eps)
        return conv1d(x, self.lm_head.T, 0)

    def generate(self, input_ids, max_new_tokens, attention_mask=None, storage=None,
                 precision="exact"):
        """Greedy decoding with one KVCache per layer (in storage, as
        new_caches, read with precision as forward's): the prompt in one
        step, then one token per step.
        Prompts of unequal length are padded on the left (attention_mask 0
        there).  Returns the new tokens (B, max_new_tokens) and the logits of
        every step (B, max_new_tokens, vocab_size)."""
        B, P = input_ids.shape
        caches = self.new_caches(B, P + max_new_tokens, storage)
        tokens, steps = [], []
        logits = self.forward(input_ids, attention_mask, caches, precision)[:, -1]
        for _ in range(max_new_tokens):
            steps.append(logits)
            tokens.append(np.argmax(logits, axis=-1))
            logits = self.forward(tokens[-1][:, None], None, caches, precision)[:, -1]
        return np.stack(tokens, axis=1), np.stack(steps, axis=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=16,
                        help="tokens to generate for each prompt (default 16)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random weights and prompts (default 0)")
    parser.add_argument("--compare-storage", action="store_true",
                        help=f"decode with caches in {', '.join(FLOAT32_STORAGES)} and "
                             "compare their tokens and logits with the float32 cache's")
    args = parser.parse_args(argv)
    if args.compare_storage:  # bfloat16 storage: before the model is built, not after
        need("bfloat16", "examples/gpt2.py --compare-storage")
    vocab, n_pos, E, layers, heads = 101, 64, 64, 3, 4
    lengths = [7, 3, 5]
    P = max(lengths)
    if not 1 <= args.new_tokens <= n_pos - P:
        parser.error(f"--new-tokens must be 1..{n_pos - P} (the demo model has {n_pos} "
                     f"positions and prompts of up to {P} tokens), got {args.new_tokens}")
    rng = np.random.default_rng(args.seed)
    model = GPT2(random_state_dict(vocab, n_pos, E, layers, rng), heads)
    prompt = rng.integers(0, vocab, (len(lengths), P))
    mask = (np.arange(P) >= P - np.array(lengths)[:, None]).astype(np.int64)  # left padding
    tokens, step_logits = model.generate(prompt, args.new_tokens, mask)
    if args.compare_storage:
        return compare_storage(model, prompt, mask, tokens, step_logits)

    full_ids = np.concatenate([prompt, tokens], axis=1)
    full_mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
    full = model.forward(full_ids, full_mask)[:, P - 1:-1]
    diff = float(np.abs(full - step_logits).max())
    print(f"random GPT-2 ({layers} layers, {heads} heads, embed_dim {E}) on fastattn "
          f"{fastattn.__version__}: greedy decoding with a KVCache per layer")
    for b, n in enumerate(lengths):
        print(f"  prompt {prompt[b, P - n:].tolist()} -> {tokens[b].tolist()}")
    ok = diff <= 1e-4
    print(f"max |cached step logits - full causal pass logits| = {diff:.2e} "
          f"(logits up to {np.abs(full).max():.1f}): {'agree' if ok else 'DIFFER'} "
          f"within 1e-4")
    return 0 if ok else 1


def compare_storage(model, prompt, mask, tokens, logits):
    """Greedy decoding with each cache storage against the float32 cache's
    tokens and logits; 0 when the 16-bit caches give the same tokens."""
    print(f"greedy decoding of {tokens.shape[1]} tokens, {tokens.shape[0]} prompts, against a "
          f"float32 cache (logits up to {np.abs(logits).max():.1f}):")
    same16 = True
    runs = [(s, "exact") for s in FLOAT32_STORAGES if s != "float32"]  # float32: the reference
    for storage, precision in runs + [("int8", "int8"), ("int4", "int8")]:
        t, lg = model.generate(prompt, tokens.shape[1], mask, storage=storage, precision=precision)
        agree = int((t == tokens).all(axis=1).sum())
        first = np.flatnonzero((t != tokens).any(axis=0))
        # logits compared while the tokens agree (after a differing token the inputs differ)
        upto = first[0] + 1 if first.size else t.shape[1]
        diff = np.abs(lg[:, :upto] - logits[:, :upto])
        where = ""
        if first.size:  # a near-tie of the float32 logits there: the two best within the error
            top2 = np.sort(logits[:, first[0]], axis=-1)[:, -2:]
            margin = float((top2[:, 1] - top2[:, 0])[(t != tokens)[:, first[0]]].min())
            where = f" (first difference at step {first[0]}, where the two best logits differ by {margin:.1e})"
        name = storage + (" cache" if precision == "exact" else " cache, int8 mode")
        print(f"  {name:24s}: {agree} of {len(t)} sequences with the same tokens{where}"
              + f"; |logit difference| max {diff.max():.2e}, RMS {np.sqrt((diff ** 2).mean()):.2e}")
        same16 &= storage not in ("float16", "bfloat16") or agree == len(t)
    if not same16:
        print("a 16-bit cache changed a token: at a near-tie of the float32 logits (the margin "
              "above) their rounding can, elsewhere it should not; exit status 1")
    return 0 if same16 else 1


if __name__ == "__main__":
    sys.exit(main())
