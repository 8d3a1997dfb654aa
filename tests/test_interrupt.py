"""Ctrl-C during a long call: KeyboardInterrupt soon after SIGINT, nothing
left running or corrupted (the GIL-free loops run Python's signal handlers
between their tasks; fastattn/_core.pyx)."""
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import fastattn

# A call of minutes on any machine: (1, 32, 32768, 64) self-attention is
# 8.8 TFLOP.  The child reports how long the interrupted call ran and then
# checks that the inputs are intact and that the next call is right.
CHILD = r"""
import signal, sys, time, zlib
# Python's own Ctrl-C handler, whatever the disposition inherited: a job
# started with & by a shell without job control (nohup, CI runners) starts
# with SIGINT ignored, and Python then keeps it ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np
import fastattn
from fastattn import reference as ref

threads = int(sys.argv[1])
q = np.random.default_rng(0).standard_normal((1, 32, 32768, 64), dtype=np.float32)
crc = zlib.crc32(q)
print("started", flush=True)
try:
    fastattn.scaled_dot_product_attention(q, q, q, num_threads=threads)
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
assert zlib.crc32(q) == crc, "the input changed"
small = q[:, :2, :100]
got = fastattn.scaled_dot_product_attention(small, small, small, num_threads=threads)
want = ref.scaled_dot_product_attention(*(small.astype(np.float64),) * 3)
np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
print("next call ok", flush=True)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix",
                    reason="sends SIGINT to a child process")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_a_long_call(threads, inherited):
    """Also when the test itself runs with SIGINT ignored (a background job):
    the child sets Python's handler, so that fastattn is tested, not the
    runner's signal disposition."""
    def disposition():
        signal.signal(signal.SIGINT, signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL)

    # from outside the source tree, whose fastattn/ has no extension
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(threads)], cwd=tempfile.gettempdir(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=disposition)
    try:
        assert child.stdout.readline().strip() == "started"
        # The call runs for minutes; SIGINT once it is under way.  The bound
        # below only keeps a broken build from hanging the suite.
        time.sleep(0.5)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert out.split() == ["interrupted", "next", "call", "ok"], out + err


def test_a_failed_cache_step_leaves_the_cache_as_it_was(rng, monkeypatch):
    """An exception during MultiHeadAttention's attention over its cache (a
    Ctrl-C) takes back the keys and values the step appended."""
    mha = fastattn.MultiHeadAttention(16, 2, rng=rng)
    cache = mha.new_cache(batch_size=2, capacity=8)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    pad = np.array([[False, False, False], [True, False, False]])
    mha(x, key_padding_mask=pad, cache=cache)
    before = (cache.length, cache.lengths.copy(), cache.key.copy(), cache.attn_mask.copy())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "attend", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mha(x[:, :2], key_padding_mask=np.array([[True, False], [False, False]]), cache=cache)
    monkeypatch.undo()
    assert cache.length == before[0]
    np.testing.assert_array_equal(cache.lengths, before[1])
    np.testing.assert_array_equal(cache.key, before[2])
    np.testing.assert_array_equal(cache.attn_mask, before[3])
    # and the next step goes on from there as if the failed one never came
    y, _ = mha(x[:, 2:], cache=cache)
    fresh = mha.new_cache(batch_size=2, capacity=8)
    mha(x, key_padding_mask=pad, cache=fresh)
    np.testing.assert_array_equal(y, mha(x[:, 2:], cache=fresh)[0])
