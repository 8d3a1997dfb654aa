"""fastattn.integrations.torch: torch.autograd's gradcheck on every variant,
float32 gradients against PyTorch's SDPA backward, torch.compile without
graph breaks, torch.library's opcheck, the same bits for any thread count,
and tiny transformers models trained on fastattn against SDPA and eager."""
import numpy as np
import pytest

import fastattn

torch = pytest.importorskip("torch")
fa = pytest.importorskip("fastattn.integrations.torch")
F = torch.nn.functional

VARIANTS = {
    "plain": {},
    "causal": {"is_causal": True},
    "lower-right": {"is_causal": True, "causal_alignment": "lower_right"},
    "offset": {"is_causal": True, "causal_alignment": 2},
    "bool-mask": {"attn_mask": "bool"},
    "additive-mask": {"attn_mask": "float"},
    "window": {"window_size": (3, 1)},
    "alibi": {"alibi_slopes": "slopes"},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": "sinks"},
    "gqa": {"enable_gqa": True},
    "everything": {"enable_gqa": True, "is_causal": True, "window_size": (4, -1),
                   "alibi_slopes": "slopes", "softcap": 2.0, "sinks": "sinks",
                   "attn_mask": "bool", "scale": 0.4},
}


def operands(variant, dtype=torch.float64, B=2, H=4, L=6, S=9, E=5, Ev=3, seed=0):
    """Leaf tensors (query, key, value and, with sinks, sinks) and the other options."""
    g = torch.Generator().manual_seed(seed)
    kw = dict(VARIANTS[variant])
    Hkv = H // 2 if kw.get("enable_gqa") else H
    leaves = [torch.randn(B, H, L, E, generator=g, dtype=dtype),
              torch.randn(B, Hkv, S, E, generator=g, dtype=dtype),
              torch.randn(B, Hkv, S, Ev, generator=g, dtype=dtype)]
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(L, S, generator=g) > 0.3
        kw["attn_mask"][1] = False  # a row that sees nothing
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(L, S, generator=g, dtype=dtype)
    if kw.get("alibi_slopes") == "slopes":
        kw["alibi_slopes"] = torch.linspace(0.1, 0.8, H, dtype=torch.float64)
    if kw.pop("sinks", None):
        leaves.append(torch.linspace(-1.0, 1.0, H, dtype=dtype))
    return [x.requires_grad_() for x in leaves], kw


def call(leaves, kw):
    sinks = leaves[3] if len(leaves) > 3 else None
    return fa.scaled_dot_product_attention(*leaves[:3], sinks=sinks, **kw)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradcheck(variant):
    leaves, kw = operands(variant)
    assert torch.autograd.gradcheck(lambda *x: call(list(x), kw), tuple(leaves))


@pytest.mark.parametrize("variant", ["plain", "causal", "bool-mask", "additive-mask", "gqa"])
def test_float32_gradients_match_pytorch(variant):
    """What an attn_mask can express, against SDPA's own backward (math and flash
    kernels on the CPU) in float32: the two float32 computations within the bound
    of reductions over S + E + Ev, twice, relative to each gradient's largest."""
    leaves, kw = operands(variant, torch.float32, L=70, S=150, E=40, Ev=24)
    out = call(leaves, kw)
    grad_out = torch.randn_like(out)
    ours = torch.autograd.grad(out, leaves, grad_out)
    theirs = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, **kw), leaves, grad_out)
    bound = 2 * 8 * (150 + 40 + 24) * float(np.finfo(np.float32).eps)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=bound * float(b.abs().max()))


def test_torch_compile_traces_without_graph_breaks():
    leaves, kw = operands("everything", torch.float32)

    def loss(*x):
        return call(list(x), kw).square().sum()

    eager = torch.autograd.grad(loss(*leaves), leaves)
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    traced = torch.autograd.grad(compiled(*leaves), leaves)
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", ["everything", "plain"])
def test_opcheck(variant):
    """The operators' schema, fake (meta) functions and autograd registration
    as torch.library checks them."""
    leaves, kw = operands(variant)
    sinks = leaves[3] if len(leaves) > 3 else None
    window = kw.get("window_size", (-2, -2))
    args = (*leaves[:3], kw.get("attn_mask"), kw.get("is_causal", False), kw.get("scale"),
            kw.get("enable_gqa", False), str(kw.get("causal_alignment", "upper_left")),
            window[0], window[1], kw.get("alibi_slopes"), kw.get("softcap"), sinks, 1)
    torch.library.opcheck(torch.ops.fastattn.sdpa.default, args)


def test_same_bits_for_any_thread_count():
    leaves, kw = operands("everything", torch.float32, B=3, L=150, S=300, E=64, Ev=64)
    grad_out = torch.randn(3, 4, 150, 64)
    first = torch.autograd.grad(call(leaves, dict(kw, num_threads=1)), leaves, grad_out)
    for threads in (2, 3):
        again = torch.autograd.grad(call(leaves, dict(kw, num_threads=threads)), leaves,
                                    grad_out)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def test_zero_copy_inputs_and_errors():
    leaves, _ = operands("plain", torch.float32)
    strided = leaves[0].detach().transpose(-1, -2).contiguous().transpose(-1, -2)
    out = fa.scaled_dot_product_attention(strided.requires_grad_(), *leaves[1:])
    out.sum().backward()
    assert strided.grad.shape == strided.shape
    with pytest.raises(ValueError, match="dropout_p"):
        fa.scaled_dot_product_attention(*leaves, dropout_p=0.1)
    with pytest.raises(ValueError, match="num_threads"):
        fa.scaled_dot_product_attention(*leaves, num_threads=0)
    with pytest.raises(ValueError, match="softcap"):
        fa.scaled_dot_product_attention(*leaves, softcap=-1.0)


transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("fastattn.integrations.transformers",
                         reason="needs transformers with AttentionMaskInterface")
hf.register()


def train(kind, impl, steps=4):
    """Losses of a few AdamW steps of a tiny decoder on a left-padded batch,
    and the last step's gradients."""
    torch.manual_seed(0)
    common = dict(vocab_size=97, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  attn_implementation=impl)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:  # sinks (s_aux, one learned logit per head) and sliding windows
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, num_local_experts=2, num_experts_per_tok=1, sliding_window=5))
    model.train()
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(3, 97, (3, 12)))
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[2, :8] = 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("kind, reference", [("llama", "sdpa"), ("gpt_oss", "eager")])
def test_transformers_model_trains_on_fastattn(kind, reference, monkeypatch):
    """The same losses step by step as on transformers' own attention (sinks:
    its eager attention, which has them), within float32 rounding compounded over
    the steps; fastattn's kernels did run, forward and backward."""
    seen = []
    real = fastattn.attention_backward
    monkeypatch.setattr(fastattn, "attention_backward",
                        lambda *a, **k: seen.append(1) or real(*a, **k))
    ours, grads = train(kind, "fastattn")
    assert len(seen) == 4 * 2  # every step, every layer
    theirs, their_grads = train(kind, reference)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    sinks = [n for n in grads if n.endswith("sinks")]
    assert len(sinks) == (2 if kind == "gpt_oss" else 0)
    for name in sinks:  # the sinks' own gradients, the first step's parameters aside
        torch.testing.assert_close(grads[name], their_grads[name], rtol=1e-3, atol=1e-5)


def test_a_window_of_any_negative_side_is_the_numpy_apis():
    leaves, _ = operands("plain")
    ours = fa.scaled_dot_product_attention(*leaves, window_size=(-100, 0))
    theirs = fastattn.scaled_dot_product_attention(
        *(x.detach().numpy() for x in leaves), window_size=(-100, 0))
    np.testing.assert_array_equal(ours.detach().numpy(), theirs)


def test_operator_argument_errors():
    leaves, _ = operands("plain")
    mask = torch.zeros(6, 9, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask requires a gradient"):
        fa.scaled_dot_product_attention(*leaves, attn_mask=mask)
    with pytest.raises(ValueError, match="causal_alignment"):
        fa.scaled_dot_product_attention(*leaves, is_causal=True, causal_alignment="lower-right")
    with pytest.raises(ValueError, match="causal_alignment"):
        fa.scaled_dot_product_attention(*leaves, is_causal=True, causal_alignment="3")
    with pytest.raises(TypeError, match="window_size"):
        fa.scaled_dot_product_attention(*leaves, window_size=(1,))
