"""The compiled decode step (StaticKVCache + mx.compile) computes what the eager step does."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia import GenerationOptions, load
from mlx_omnia.engine.core.cache import KVCache, StaticKVCache
from mlx_omnia.engine.generate.loop import CompiledStep, prefill


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.fixtures.tiny import write_tiny_llama

    # A 512-token context, so a generation can outgrow the 256-slot buffer (StaticKVCache.step).
    return load(write_tiny_llama(tmp_path_factory.mktemp("compiled"), max_position_embeddings=512))


def test_compiled_steps_match_eager_logits_across_buffer_growth(tiny) -> None:  # type: ignore[no-untyped-def]
    net = tiny.network
    prompt = list(range(3, 40))
    rng = np.random.default_rng(1)
    forced = [int(t) for t in rng.integers(3, 300, size=260)]  # crosses the 256-row buffer
    eager_cache: list[KVCache] = net.make_cache()
    prefill(net, prompt, eager_cache)
    compiled_cache: list[KVCache] = net.make_cache()
    prefill(net, prompt, compiled_cache)
    step = CompiledStep.acquire(net, compiled_cache, len(prompt))
    worst = 0.0
    for token in forced:
        ids = mx.array([[token]], dtype=mx.int32)
        want = np.array(net(ids, eager_cache)[0, -1, :])
        got = np.array(step(ids))
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    assert all(isinstance(c, StaticKVCache) for c in step.caches)
    assert step.caches[0].capacity >= len(prompt) + len(forced)
    step.release()
    assert step.caches[0].capacity == 0  # the sequence's buffers are let go
    assert worst < 1e-5


def test_a_dropped_decoding_hands_its_traced_step_to_the_next(tiny) -> None:  # type: ignore[no-untyped-def]
    """A sequence dropped without close() still returns its compiled step (and its traces), so
    a new sequence does not trace the step again; the reused step computes the same logits."""
    prompt = list(range(3, 30))

    def run() -> tuple[object, np.ndarray]:
        decoding = tiny.decoding()
        decoding.feed(prompt)
        rows = [np.array(decoding.feed([t])[-1]) for t in (5, 6, 7)]
        return decoding._step, np.stack(rows)  # pyright: ignore[reportPrivateUsage]

    first, want = run()
    second, got = run()
    assert first is not None and second is first
    np.testing.assert_array_equal(got, want)
    with tiny.decoding() as decoding:
        decoding.feed(prompt)
        decoding.feed([5])
        assert decoding._step is first  # pyright: ignore[reportPrivateUsage]
    assert decoding._step is None  # pyright: ignore[reportPrivateUsage]


def test_generation_is_identical_with_and_without_compile(
    tiny, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    options = GenerationOptions(max_tokens=280, temperature=0, stop_token_ids=())
    monkeypatch.setenv("OMNIA_COMPILE", "0")
    eager = tiny.generate("Hello world, tell me a story", options)
    monkeypatch.setenv("OMNIA_COMPILE", "1")
    compiled = tiny.generate("Hello world, tell me a story", options)
    again = tiny.generate("Hello world, tell me a story", options)  # reuses the compiled step
    assert compiled.token_ids == eager.token_ids == again.token_ids


def test_interleaved_generations_do_not_share_a_cache(tiny) -> None:  # type: ignore[no-untyped-def]
    options = GenerationOptions(max_tokens=12, temperature=0)
    alone_a = tiny.generate("first prompt", options).token_ids
    alone_b = tiny.generate("a different second prompt", options).token_ids
    a, b = tiny.stream("first prompt", options), tiny.stream("a different second prompt", options)
    got_a: list[int] = []
    got_b: list[int] = []
    for pa, pb in zip(a, b, strict=False):
        got_a.extend(pa.token_ids)
        got_b.extend(pb.token_ids)
    got_a.extend(t for p in a for t in p.token_ids)
    got_b.extend(t for p in b for t in p.token_ids)
    assert tuple(got_a) == alone_a and tuple(got_b) == alone_b


def test_static_cache_masks_a_sliding_window() -> None:
    from mlx_omnia.engine.core.layers import AttentionStep

    step = AttentionStep(n_heads=2, n_kv_heads=1, head_dim=4, window=3)
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, h, 9, 4)).astype(np.float32)) for h in (2, 1, 1))
    eager = KVCache()
    step.attend(q[:, :, :5], k[:, :, :5], v[:, :, :5], eager)
    static = StaticKVCache.from_cache(eager)
    outs = []
    for t in range(5, 9):
        static.reserve(t + 1)
        outs.append(np.array(step.attend(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], static)))  # type: ignore[arg-type]
    want = np.array(step.attend(q, k, v, None))[:, :, 5:]
    assert np.abs(np.concatenate(outs, axis=2) - want).max() < 1e-5


def test_generations_in_two_threads_share_the_idle_step(tiny) -> None:  # type: ignore[no-untyped-def]
    """The idle compiled step (traced in this thread) serves a generation in another thread:
    everything it captured is evaluated, so no operation waits on this thread's streams (the
    server's engine thread and a library caller may share a model)."""
    import threading

    options = GenerationOptions(max_tokens=6, temperature=0)
    here = tiny.generate("a prompt for two threads", options).token_ids
    there: list[tuple[int, ...]] = []
    worker = threading.Thread(
        target=lambda: there.append(tiny.generate("a prompt for two threads", options).token_ids)
    )
    worker.start()
    worker.join()
    assert there == [here]
    assert tiny.generate("a prompt for two threads", options).token_ids == here


def test_a_prompt_fed_last_only_is_prefilled_as_generation_prefills_it(
    tiny, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """`Decoding.feed(prompt, last_only=True)` gives the last row of what feeding it whole
    gives, through generation's chunked prefill (a small chunk here, so the prompt spans three),
    and the sequence then decodes as the other does; a later feed of several ids (the compiled
    step's eager path) takes `last_only` too."""
    import mlx_omnia.engine.generate.loop as loop

    monkeypatch.setattr(loop, "PREFILL_CHUNK", 8)
    prompt = list(range(3, 23))
    a, b = tiny.decoding(), tiny.decoding()
    whole, last = a.feed(prompt), b.feed(prompt, last_only=True)
    assert whole.shape == (len(prompt), tiny.config["vocab_size"])
    assert last.shape == (1, whole.shape[-1])
    np.testing.assert_allclose(np.array(last), np.array(whole[-1:]), rtol=1e-5, atol=1e-5)
    for token in (5, 9):
        np.testing.assert_allclose(np.array(b.feed([token])), np.array(a.feed([token])),
                                   rtol=1e-5, atol=1e-5)
    more = [7, 11, 13]
    np.testing.assert_allclose(np.array(b.feed(more, last_only=True)),
                               np.array(a.feed(more)[-1:]), rtol=1e-5, atol=1e-5)
    a.close()
    b.close()


def test_teacher_forcing_a_greedy_answer_gives_back_its_tokens(tiny) -> None:  # type: ignore[no-untyped-def]
    """Generation and `Model.decoding()` run one driver: feeding a greedy answer back token by
    token, each step's argmax is the token generation chose next."""
    options = GenerationOptions(max_tokens=20, temperature=0, stop_token_ids=())
    answer = tiny.generate("teacher forcing", options).token_ids
    with tiny.decoding() as decoding:
        logits = decoding.feed(tiny.encode("teacher forcing"), last_only=True)
        chosen = [int(mx.argmax(logits[-1]).item())]
        for token in answer[:-1]:
            chosen.append(int(mx.argmax(decoding.feed([token])[-1]).item()))
    assert tuple(chosen) == answer
