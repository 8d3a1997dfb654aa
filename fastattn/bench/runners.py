"""The implementations compared by the benchmark, each called the way its
users call it, at a given thread count.

A runner's ``setup(query, key, value, shape, num_threads)`` is a context
manager: on entry it converts the inputs to the library's own layout and sets
its thread count (both outside the timed call), and yields a ``Prepared``
whose ``call()`` computes the attention once; on exit it restores the
library's thread setting.  query/key/value are float32 (B, H, L|S, E|Ev);
shape (shapes.Shape) says causal, window or packed sequences: a library
without a window or packed sequences gets their explicit mask.
"""
import contextlib
import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import numpy as np


@dataclass
class Prepared:
    call: Callable[[], Any]                  # one attention call, the runner's own output
    to_bhle: Callable[[Any], np.ndarray]     # that output as a (B, H, L, Ev) ndarray
    allocates_output: bool = True            # False: the output buffer is bound once at setup


@dataclass(frozen=True)
class Runner:
    name: str                      # key used on the command line and in JSON
    label: str                     # row label
    library: str                   # the library measured (its version is recorded)
    requires: Tuple[str, ...]      # modules that must be importable
    install: str                   # how to get them
    setup: Callable
    holds_scores: bool = False     # keeps the whole (B, H, L, S) score matrix
    masks: bool = True             # can take an explicit mask (window, packed shapes)
    # decodes through a cache graph whose new rows see the whole cache, after
    # an untimed first step of L positions: not causal, no window, S >= 2 L
    whole_cache_decode: bool = False
    precision: str = "exact"       # fastattn's precision argument (its int8 mode: "int8")
    gqa: bool = True               # takes fewer key/value heads than query heads
    broadcast_heads_only: bool = False  # ... only one of them (broadcast to every head)

    def missing(self, shape=None) -> Optional[str]:
        """None when the runner can run here (on shape), else why not."""
        absent = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if absent:
            return f"{', '.join(absent)} not installed ({self.install})"
        if shape is not None and shape.mask() is not None and not self.masks:
            return "no sliding window, packed sequences or (L, S) mask in this runner"
        if shape is not None and shape.Hkv != shape.H and not self.gqa:
            return "no grouped-query or latent attention in this runner's operator"
        if shape is not None and 1 != shape.Hkv != shape.H and self.broadcast_heads_only:
            return "only one key/value head broadcast to every query head in this runner"
        if shape is not None and shape.storage != "float32" and self.library != "fastattn":
            # no article before the name, which "a int8" got wrong
            return f"{shape.storage} key/value caches are fastattn's (the others: float32)"
        if (shape is not None and self.precision != "exact" and shape.storage not in INT8_MODE
                and (shape.kind == "decode" or shape.storage != "float32")):
            return (f'precision="{self.precision}" rounds a call\'s float keys and values each '
                    "call: for decoding, a cache stores them rounded once (the shapes "
                    "decode-8192-int8 and decode-8192-int4)")
        if (shape is not None and shape.kind == "decode" and self.whole_cache_decode
                and (shape.causal or shape.window >= 0 or shape.S < 2 * shape.L)):
            return "its key/value-cache graph here: not causal, no window, S >= 2 L"
        return None


# the caches whose scores fastattn's precision="int8" computes with integers
INT8_MODE = ("int8", "int4")


@contextlib.contextmanager
def _fastattn(q, k, v, shape, num_threads, precision="exact"):
    import fastattn

    if shape.seqlens:  # (1, H, T, E) seen as packed (T, H, E): no copy
        cu = np.concatenate([[0], np.cumsum(shape.seqlens)]).astype(np.int64)
        packed = [a[0].transpose(1, 0, 2) for a in (q, k, v)]
        yield Prepared(lambda: fastattn.varlen_attention(*packed, cu, cu, is_causal=shape.causal,
                                                         num_threads=num_threads,
                                                         precision=precision),
                       lambda out: out.transpose(1, 0, 2)[None])
        return
    if shape.storage != "float32":  # a decoding step over a cache in that storage
        cache = fastattn.KVCache(shape.B, shape.H, shape.S, shape.E, value_dim=shape.Ev,
                                 storage=shape.storage)
        cache.append(k, v)
        yield Prepared(lambda: cache.attend(q, num_threads=num_threads, precision=precision),
                       lambda out: out)
        return
    window = (shape.window, 0) if shape.window >= 0 else None

    def call():
        return fastattn.scaled_dot_product_attention(q, k, v, is_causal=shape.causal,
                                                     window_size=window, num_threads=num_threads,
                                                     enable_gqa=shape.Hkv != shape.H,
                                                     precision=precision)
    yield Prepared(call, lambda out: out)


def numpy_attention(query, key, value, is_causal=False, mask=None):
    """softmax(query keyᵀ / sqrt(E)) value in NumPy, written as a user who
    knows NumPy writes it: one batched matmul per product (NumPy's BLAS), the
    scale applied to the smaller query, the mask (bool, True = may attend),
    max subtraction, exp and normalisation done in place on the one (B, H,
    L, S) score matrix, the division deferred to the (L, Ev) output.  It
    holds that whole matrix."""
    L, E = query.shape[-2:]
    S = key.shape[-2]
    scores = np.matmul(query * query.dtype.type(1 / math.sqrt(E)), np.swapaxes(key, -1, -2))
    if mask is not None:
        np.copyto(scores, -np.inf, where=~mask)
    elif is_causal:
        np.copyto(scores, -np.inf, where=np.triu(np.ones((L, S), dtype=bool), 1))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denominator = scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, value)
    out /= denominator
    return out


@contextlib.contextmanager
def _numpy(q, k, v, shape, num_threads):
    from threadpoolctl import threadpool_limits

    mask = shape.mask()
    B, H, L, E = q.shape
    Hkv = k.shape[1]
    if Hkv != H:  # a group's heads as query rows of its key/value head (not causal)
        q = q.reshape(B, Hkv, H // Hkv * L, E)
    with threadpool_limits(limits=num_threads, user_api="blas"):
        yield Prepared(lambda: numpy_attention(q, k, v, shape.causal, mask),
                       lambda out: out.reshape(B, H, L, -1))


@contextlib.contextmanager
def _torch(q, k, v, shape, num_threads):
    import torch
    import torch.nn.functional as F

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))  # shares the memory
    mask = shape.mask()  # PyTorch has no window or packed option: the explicit mask
    options = ({"is_causal": shape.causal} if mask is None
               else {"attn_mask": torch.from_numpy(mask)})
    if shape.Hkv != shape.H:
        options["enable_gqa"] = True

    def call():
        return F.scaled_dot_product_attention(tq, tk, tv, **options)
    try:
        yield Prepared(call, lambda out: out.numpy())
    finally:
        torch.set_num_threads(before)


def mha_model(B, H, L, S, E, Ev, is_causal, kv_heads_first=False):
    """A one-node ONNX graph: com.microsoft MultiHeadAttention (ONNX Runtime's
    contrib operator) with num_heads = H, inputs query (B, L, H·E), key and
    value (B, S, H·E) and (B, S, H·Ev), or with kv_heads_first (B, H, S, E)
    and (B, H, S, Ev); output (B, L, H·Ev); unidirectional = 1 for causal.
    The default scale is 1/sqrt(E).

    The two key/value layouts take different paths in ONNX Runtime's CPU
    kernel (1.32): (B, S, H·E) is transposed to (B, H, S, E) on every call,
    then, unless causal, goes to MLAS's flash attention; (B, H, S, E) is
    used in place by the unfused path, which holds the L x S scores.
    Neither is faster on every shape, so the benchmark runs both."""
    from onnx import TensorProto, helper

    def tensor(name, *dims):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))

    node = helper.make_node("MultiHeadAttention", ["query", "key", "value"], ["output"],
                            domain="com.microsoft", num_heads=H, unidirectional=int(is_causal))
    kv = ([tensor("key", B, H, S, E), tensor("value", B, H, S, Ev)] if kv_heads_first else
          [tensor("key", B, S, H * E), tensor("value", B, S, H * Ev)])
    graph = helper.make_graph([node], "attention", [tensor("query", B, L, H * E)] + kv,
                              [tensor("output", B, L, H * Ev)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _heads_last(x):
    """(B, H, N, D) -> contiguous (B, N, H·D)."""
    B, H, N, D = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(B, N, H * D)


@contextlib.contextmanager
def _onnxruntime(q, k, v, shape, num_threads, kv_heads_first=False):
    import onnxruntime as ort

    B, H, L, E = q.shape
    S, Ev = v.shape[-2:]
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    model = mha_model(B, H, L, S, E, Ev, shape.causal, kv_heads_first)
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    # I/O binding: inputs and output bound once, so a call is the kernel and
    # ONNX Runtime's own dispatch, without Python-side copies.
    if kv_heads_first:
        key, value = np.ascontiguousarray(k), np.ascontiguousarray(v)
    else:
        key, value = _heads_last(k), _heads_last(v)
    feeds = {"query": _heads_last(q), "key": key, "value": value}
    out = np.empty((B, L, H * Ev), np.float32)
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("output", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)

    def call():
        session.run_with_iobinding(binding)
        return out
    yield Prepared(call, lambda o: o.reshape(B, L, H, Ev).transpose(0, 2, 1, 3),
                   allocates_output=False)


def sdpa_model(B, H, L, S, E, Ev, is_causal, masked, Hkv=None):
    """An OpenVINO model of one opset-13 ScaledDotProductAttention op:
    query (B, H, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev) (Hkv = 1
    or H: the op broadcasts the heads), with an additive (L, S) float mask
    input when masked; causal is upper-left, as PyTorch's.  The default
    scale is 1/sqrt(E)."""
    import openvino as ov
    import openvino.opset13 as ops

    kv = H if Hkv is None else Hkv
    inputs = [ops.parameter([B, h, n, d], ov.Type.f32, name=name)
              for name, h, n, d in (("query", H, L, E), ("key", kv, S, E), ("value", kv, S, Ev))]
    if masked:
        inputs.append(ops.parameter([L, S], ov.Type.f32, name="mask"))
    out = ops.scaled_dot_product_attention(*inputs, causal=is_causal)
    return ov.Model([out], inputs, "attention")


def stateful_decode_model(B, H, L, E, Ev):
    """An OpenVINO model of a decoding step as its LLM exports are made
    (optimum-intel's stateful form): the key and value caches are the
    variables "past_key" (B, H, ?, E) and "past_value" (B, H, ?, Ev), each
    read (ReadValue, empty at first), reordered by the beam_idx input
    (Gather on the batch axis), extended by the L new positions of the key
    and value inputs (Concat on the sequence axis), written back (Assign) and
    given to the opset-13 ScaledDotProductAttention op with the query (B, H,
    L, E), not causal: each new row sees the whole cache.  The CPU plugin
    fuses that pattern into its key/value-cache attention node
    (StatefulSDPAFusion), which appends in place and runs its own kernel."""
    import openvino as ov
    import openvino.opset6 as ops6
    import openvino.opset13 as ops
    from openvino.op.util import Variable, VariableInfo

    query = ops.parameter([B, H, L, E], ov.Type.f32, name="query")
    new = [ops.parameter([B, H, L, d], ov.Type.f32, name=name) for name, d in (("key", E),
                                                                               ("value", Ev))]
    beam_idx = ops.parameter([B], ov.Type.i32, name="beam_idx")
    present, assigns = [], []
    for name, cur, d in (("past_key", new[0], E), ("past_value", new[1], Ev)):
        info = VariableInfo()
        info.variable_id, info.data_type = name, ov.Type.f32
        info.data_shape = ov.PartialShape([-1, H, -1, d])
        variable = Variable(info)
        past = ops6.read_value(ops.constant(np.zeros((B, H, 0, d), np.float32)), variable)
        reordered = ops.gather(past, beam_idx, ops.constant(np.int64(0)))
        present.append(ops.concat([reordered, cur], 2))
        assigns.append(ops6.assign(present[-1], variable))
    out = ops.scaled_dot_product_attention(query, *present, causal=False)
    return ov.Model([ops.result(out)], assigns, [query, *new, beam_idx], "decode")


def _openvino_config(num_threads):
    # f32: its default on CPUs with AVX512_BF16 is bf16 (and its key/value
    # cache's u8 or bf16); one stream: one call at a time, on num_threads threads
    return {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": num_threads,
            "NUM_STREAMS": 1, "KV_CACHE_PRECISION": "f32"}


@contextlib.contextmanager
def _openvino(q, k, v, shape, num_threads):
    import openvino as ov

    B, H, L, E = q.shape
    S, Ev = v.shape[-2:]
    mask = shape.mask()
    if shape.kind == "decode":
        # The cache is set to the first S - 2L positions (the variables'
        # state), and one step appends the next L before anything is
        # measured: that step copies the state into OpenVINO's own cache
        # buffer, which a cache filled by its own steps never does.  Then
        # each call appends the last L, as a generation step does, so the
        # first call attends to exactly the S positions of the others'
        # call, and call n to S + (n - 1)·L (a second call sees the last
        # positions twice).
        model = stateful_decode_model(B, H, L, E, Ev)
        request = ov.Core().compile_model(model, "CPU", _openvino_config(num_threads)
                                          ).create_infer_request()
        for state in request.query_state():
            held = k if state.name == "past_key" else v
            state.state = ov.Tensor(np.ascontiguousarray(held[:, :, :S - 2 * L]))
        beams = np.arange(B, dtype=np.int32)
        request.infer([q, k[:, :, S - 2 * L:S - L], v[:, :, S - 2 * L:S - L], beams])
        feeds = [np.ascontiguousarray(a) for a in (q, k[:, :, S - L:], v[:, :, S - L:])]
        feeds.append(beams)
    else:
        model = sdpa_model(B, H, L, S, E, Ev, shape.causal and mask is None, mask is not None,
                           k.shape[1])
        request = ov.Core().compile_model(model, "CPU", _openvino_config(num_threads)
                                          ).create_infer_request()
        feeds = [np.ascontiguousarray(a) for a in (q, k, v)]
        if mask is not None:
            feeds.append(np.where(mask, 0.0, -np.inf).astype(np.float32))
    out = np.empty((B, H, L, Ev), np.float32)
    # shared tensors: OpenVINO reads the inputs and writes the output in place
    for i, array in enumerate(feeds):
        request.set_input_tensor(i, ov.Tensor(array, shared_memory=True))
    request.set_output_tensor(0, ov.Tensor(out, shared_memory=True))

    def call():
        request.infer()
        return out
    yield Prepared(call, lambda o: o, allocates_output=False)


_ORT = (("onnxruntime", "onnx"), "pip install onnxruntime onnx")
RUNNERS = {r.name: r for r in (
    Runner("fastattn", "fastattn", "fastattn", (), "pip install fastattn", _fastattn),
    Runner("fastattn-int8", "fastattn int8", "fastattn", (), "pip install fastattn",
           functools.partial(_fastattn, precision="int8"), precision="int8"),
    Runner("numpy", "NumPy", "numpy", ("threadpoolctl",), "pip install threadpoolctl", _numpy,
           holds_scores=True),
    Runner("torch", "PyTorch", "torch", ("torch",), "pip install torch==2.13.0", _torch),
    Runner("onnxruntime", "ORT BSD", "onnxruntime", *_ORT, _onnxruntime, masks=False,
           gqa=False),
    Runner("onnxruntime-bhsd", "ORT BHSD", "onnxruntime", *_ORT,
           functools.partial(_onnxruntime, kv_heads_first=True), holds_scores=True, masks=False,
           gqa=False),
    Runner("openvino", "OpenVINO", "openvino", ("openvino",), "pip install openvino", _openvino,
           whole_cache_decode=True, broadcast_heads_only=True),
)}
# the libraries' names in prose (Runner.library -> name): the help texts
# list the peers from here, so that a new runner's library is never left out
LIBRARY_NAMES = {"fastattn": "fastattn", "numpy": "NumPy", "torch": "PyTorch",
                 "onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}


def peer_names():
    """The libraries fastattn is compared with, in RUNNERS' order, as prose:
    "NumPy, PyTorch, ONNX Runtime and OpenVINO"."""
    names = list(dict.fromkeys(LIBRARY_NAMES[r.library] for r in RUNNERS.values()
                               if r.library != "fastattn"))
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


# What the speed-ups are relative to: per library, the faster of its runners
# on each case.  PEERS: the libraries of the "faster peer".
BASELINES = {"numpy": ("numpy",), "torch": ("torch",),
             "onnxruntime": ("onnxruntime", "onnxruntime-bhsd"), "openvino": ("openvino",)}
PEERS = ("torch", "onnxruntime", "openvino")


def reference_rows(shape):
    """Query rows whose output is checked against the float64 reference:
    all of them up to 64, else 64 spread from the first to the last."""
    if shape.L <= 64:
        return np.arange(shape.L)
    return np.unique(np.linspace(0, shape.L - 1, 64).round().astype(np.int64))


def output_errors(out, q, k, v, shape, rows):
    """The largest and the root-mean-square |out - reference| over the given
    query rows, with fastattn.reference in float64 on the same float32
    inputs.  The largest is one rounding event among many; the RMS is the
    distance of the whole result, the fairer comparison between libraries."""
    from fastattn import reference

    group = q.shape[1] // k.shape[1]  # grouped-query shapes: each head its key/value head
    q64 = q[..., rows, :].astype(np.float64)
    k64, v64 = (np.repeat(a, group, axis=1).astype(np.float64) for a in (k, v))
    mask = shape.mask()
    if mask is not None:
        mask = mask[rows]
    elif shape.causal:  # upper-left: query i sees keys 0..i
        mask = np.arange(k.shape[-2])[None, :] <= rows[:, None]
    expected = reference.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask)
    err = np.abs(np.asarray(out)[..., rows, :] - expected)
    if err.size == 0:
        return 0.0, 0.0
    return float(err.max()), float(np.sqrt(np.mean(err * err)))
