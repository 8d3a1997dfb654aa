"""examples/serve.py: continuous batching on paged caches gives every request
the tokens of generating it alone, in less memory than a padded cache."""
import numpy as np
import pytest
from conftest import load_example

serve = load_example("serve")


@pytest.mark.parametrize("rope", [False, True])
def test_ragged_steps_match_a_full_pass(rope):
    """A prompt in two chunks beside another sequence's tokens, then a token:
    the last logits equal the model's full causal pass over each sequence
    (GPT-2's own forward; with rotary, the paged forward of the whole
    sequence at once)."""
    rng = np.random.default_rng(1)
    model = serve.PagedGPT2(serve.gpt2.random_state_dict(50, 64, 32, 2, rng), 4, rope)
    caches = model.new_paged_caches(16, 4)
    for c in caches:  # the same sequence ids in every layer's cache
        a, b = c.add_sequence(), c.add_sequence()
    pa, pb = rng.integers(0, 50, 9), rng.integers(0, 50, 3)
    model.forward_ragged(np.concatenate([pa[:5], pb]), np.concatenate([np.arange(5), np.arange(3)]),
                         [a, b], np.array([0, 5, 8]), caches)
    got = model.forward_ragged(np.concatenate([pa[5:], [7]]), np.array([5, 6, 7, 8, 3]), [a, b],
                               np.array([0, 4, 5]), caches)
    if rope:
        fresh = model.new_paged_caches(16, 4)
        for c in fresh:
            s = c.add_sequence()
        want = model.forward_ragged(pa, np.arange(9), [s], np.array([0, 9]), fresh)[0]
    else:
        want = model.forward(pa[None])[0, -1]
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)


def test_the_stream(capsys):
    assert serve.main(["--requests", "12", "--blocks", "24", "--rope"]) == 0
    out = capsys.readouterr().out
    assert "12 of 12 equal" in out and "padded dense cache" in out
    assert "tokens equal to greedy decoding alone: 4 of 4" in out
    assert "parallel sampling: 8 forks of a prompt of 2100 tokens" in out


def test_parallel_sampling_reads_the_prompt_once():
    """Forks of a prompt beyond 2048 positions: each step streams the
    prompt's whole pieces of 1024 once, its own keys per fork."""
    rng = np.random.default_rng(3)
    model = serve.PagedGPT2(serve.gpt2.random_state_dict(50, 2200, 32, 2, rng), 4, True)
    reads, tokens = serve.parallel_sampling(model, rng.integers(0, 50, 2100), 4, 3, 16, rng)
    row = 2 * 4 * (8 + 8) * 4  # layers x (heads x (key + value features)) x float32
    for step, (shared, plain) in enumerate(reads):
        own = 2101 + step - 2048  # each fork's keys past the shared pieces (the new one too)
        assert shared == (2048 + 4 * own) * row
        assert plain == 4 * (2101 + step) * row
    assert len({tuple(t) for t in tokens}) > 1


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("size, block_size", [(1, 4), (5, 1), (8, 4), (12, 16)])
def test_speculative_steps_give_greedy_tokens(rope, size, block_size):
    """Trees verified in one call each (a tree of 1: plain decoding) give the
    tokens of greedy decoding alone, in fewer steps when drafts are kept."""
    rng = np.random.default_rng(size)
    model = serve.PagedGPT2(serve.gpt2.random_state_dict(50, 64, 32, 2, rng), 4, rope)
    r = serve.Request(0, 0, rng.integers(0, 50, 12), 30)
    tokens, steps = serve.speculate(model, r, block_size, size)
    assert tokens == serve.alone(model, r, block_size)
    assert steps <= 29 if size > 1 else steps == 29


def test_draft_tree_is_topological():
    tokens, parents, depths = serve.draft_tree([1, 2, 3, 1, 4, 1, 2, 5], 2, 6)
    assert tokens[0] == 2 and all(p < i for i, p in enumerate(parents))
    assert list(tokens) == [2, 5, 3, 1, 2, 4]  # after 2: 5, 3 (latest first); 5: none; 1: 2, 4
    assert list(depths) == [0, 1, 1, 2, 3, 3]


@pytest.mark.parametrize("args,words", [
    (["--blocks", "3"], "give --blocks"), (["--requests", "0"], "--requests must be at least 1"),
    (["--chunk", "0"], "--chunk must be at least 1"), (["--rate", "0"], "--rate must be above 0")])
def test_arguments_that_cannot_serve_are_refused(args, words, capsys):
    """A pool smaller than one request used to loop for ever (a fresh user's
    finding); the others ended in a traceback."""
    with pytest.raises(SystemExit):
        serve.main(args)
    assert words in capsys.readouterr().err
