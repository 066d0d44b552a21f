"""Continuous batching (`Batch`): answers decoded together equal each answer decoded alone, token
for token, for a dense, a MoE, a sliding-window and an MLA family; requests join and leave at any
step; each keeps its own options; cancelling one leaves the others untouched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mlx_omnia import (
    Batch,
    Chat,
    Constraint,
    Generation,
    GenerationOptions,
    Model,
    Piece,
    PrefixCache,
    load,
)
from tests.fixtures import parity

PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2,
    "Once",
]


def drive(
    batch: Batch, joins: dict[int, Callable[[], Generation]]
) -> tuple[dict[Generation, list[Piece]], int]:
    """Step the batch to the end, adding joins[n]() before step n; every generation's pieces
    and the most generations that decoded in one step."""
    out: dict[Generation, list[Piece]] = {}
    widest, n = 0, 0
    while len(batch) or n in joins or any(k > n for k in joins):
        if n in joins:
            out[joins[n]()] = []
        for generation, event in batch.step():
            assert not isinstance(event, Exception), event
            out.setdefault(generation, []).extend(event)
        widest = max(widest, batch.running)
        n += 1
    return out, widest


def joiner(
    batch: Batch, order: list[Generation], prompt: str, max_tokens: int
) -> Callable[[], Generation]:
    """What `drive` calls to add `prompt` at its step (the generation is appended to `order`)."""

    def add() -> Generation:
        order.append(batch.add(prompt, GenerationOptions(max_tokens=max_tokens)))
        return order[-1]

    return add


def ask(text: str) -> Chat:
    return Chat([{"role": "user", "content": text}])


def tokens(pieces: list[Piece]) -> tuple[int, ...]:
    return tuple(t for p in pieces for t in p.token_ids)


@pytest.mark.parametrize(
    "variant", ["llama-default", "qwen3_moe-sparse", "mistral-sliding", "deepseek_v2-lite"]
)
def test_batched_greedy_equals_each_alone(variant: str) -> None:
    model = load(parity.checkpoint_dir(variant, "v5"), dtype="float32")
    # different lengths: they leave at different steps; joins come while others decode
    limits = [24, 9, 17, 30]
    alone = [
        model.generate(p, GenerationOptions(max_tokens=n)).token_ids
        for p, n in zip(PROMPTS, limits, strict=True)
    ]
    batch = Batch(model)
    order: list[Generation] = []

    def join(i: int) -> Callable[[], Generation]:
        return joiner(batch, order, PROMPTS[i], limits[i])

    out, widest = drive(batch, {0: join(0), 3: join(1), 5: join(2), 6: join(3)})
    assert widest >= 3
    assert [tokens(out[g]) for g in order] == alone
    assert all(out[g][-1].finish_reason == "length" for g in order)


def test_a_family_that_cannot_batch_answers_one_at_a_time() -> None:
    model = load(parity.checkpoint_dir("phi3-longrope", "v5"), dtype="float32")
    assert not model.signature.batched
    options = GenerationOptions(max_tokens=12)
    alone = [model.generate(p, options).token_ids for p in PROMPTS]
    batch = Batch(model)
    order = [batch.add(p, options) for p in PROMPTS]
    out, widest = drive(batch, {})
    assert widest == 1
    assert [tokens(out[g]) for g in order] == alone


def test_each_generation_keeps_its_own_options(smollm2: Model) -> None:
    chats = [ask(f"Name {n} animals that live in the sea.") for n in (3, 4, 5, 6, 7)]
    options = [
        GenerationOptions(max_tokens=30),
        GenerationOptions(max_tokens=30, stop=["whale", "."]),
        GenerationOptions(max_tokens=25, temperature=0.8, top_p=0.9, seed=7, logprobs=3),
        GenerationOptions(max_tokens=30, logit_bias={504: -100.0}, repetition_penalty=1.3),
        GenerationOptions(max_tokens=40, constraint=Constraint.regex(r"(Fish|Crab|Squid)( (Fish|Crab|Squid)){2,4}")),
    ]
    alone = [smollm2.generate(c, o) for c, o in zip(chats, options, strict=True)]
    batch = Batch(smollm2)
    order = [batch.add(c, o) for c, o in zip(chats, options, strict=True)]
    out, widest = drive(batch, {})
    assert widest >= 4
    for g, solo in zip(order, alone, strict=True):
        pieces = out[g]
        assert "".join(p.text for p in pieces) == solo.text
        assert tokens(pieces) == solo.token_ids
        assert pieces[-1].finish_reason == solo.finish_reason
        assert pieces[-1].usage == solo.usage
    sampled = [lp for p in out[order[2]] for lp in p.logprobs]
    assert [lp.token_id for lp in sampled] == [lp.token_id for lp in alone[2].logprobs]
    for got, want in zip(sampled, alone[2].logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
    assert alone[4].text.split()[0] in {"Fish", "Crab", "Squid"}


def test_cancelling_one_leaves_the_others_untouched(smollm2: Model) -> None:
    chats = [ask("Write a short poem about the moon."), ask("Count from one to ten."),
             ask("What is the capital of France?")]
    options = GenerationOptions(max_tokens=24)
    alone = [smollm2.generate(c, options).token_ids for c in chats]
    batch = Batch(smollm2)
    order = [batch.add(c, options) for c in chats]
    out: dict[Generation, list[Piece]] = {g: [] for g in order}
    steps = 0
    while len(batch):
        for generation, event in batch.step():
            assert not isinstance(event, Exception)
            out[generation].extend(event)
        steps += 1
        if steps == 8:
            batch.cancel(order[1])
    assert tokens(out[order[0]]) == alone[0]
    assert tokens(out[order[2]]) == alone[2]
    assert 0 < len(tokens(out[order[1]])) < len(alone[1])
    assert all(p.finish_reason is None for p in out[order[1]])


def test_max_tokens_zero_is_answered_without_a_step(smollm2: Model) -> None:
    batch = Batch(smollm2)
    g = batch.add("Hi", GenerationOptions(max_tokens=0))
    [(generation, pieces)] = batch.step()
    assert generation is g and not isinstance(pieces, Exception)
    assert pieces[-1].finish_reason == "length" and len(batch) == 0


def _answer(batch: Batch, chat: Chat, options: GenerationOptions) -> list[Piece]:
    g = batch.add(chat, options)
    out, _ = drive(batch, {})
    return out[g]


def test_a_resent_conversation_is_prefilled_from_the_cache(smollm2: Model, tmp_path: Path) -> None:
    """The second turn resends the first (and its answer): the cached blocks, the answer's
    included, are not prefilled again, and the greedy answer is the uncached one; after a
    restart (a new cache on the same directory, memory empty) the blocks come from disk."""
    system = "You are a careful assistant who answers in one short sentence. " * 6
    first = Chat([{"role": "system", "content": system},
                  {"role": "user", "content": "What is the capital of France?"}])
    options = GenerationOptions(max_tokens=16)
    cache = PrefixCache(block_tokens=32, memory_bytes=64 * 2**20, disk_dir=tmp_path,
                        disk_bytes=64 * 2**20)
    batch = Batch(smollm2, cache)
    one = _answer(batch, first, options)
    assert one[-1].usage is not None and one[-1].usage.cached_tokens == 0
    reply = "".join(p.text for p in one)
    second = Chat([*first.messages, {"role": "assistant", "content": reply},
                   {"role": "user", "content": "And of Italy?"}])
    prompt = len(smollm2.encode(second))
    two = _answer(batch, second, options)
    usage = two[-1].usage
    assert usage is not None and usage.prompt_tokens == prompt
    assert usage.cached_tokens % 32 == 0 and prompt - 64 < usage.cached_tokens < prompt
    assert usage.cached_tokens > len(smollm2.encode(first))  # the first answer's blocks too
    uncached = smollm2.generate(second, options)
    assert tokens(two) == uncached.token_ids
    cache.close()

    restarted = PrefixCache(block_tokens=32, memory_bytes=64 * 2**20, disk_dir=tmp_path,
                            disk_bytes=64 * 2**20)
    again = _answer(Batch(smollm2, restarted), second, options)
    assert again[-1].usage is not None and again[-1].usage.cached_tokens == usage.cached_tokens
    assert tokens(again) == uncached.token_ids
    assert restarted.stats().memory_blocks > 0 and restarted.stats().dropped_corrupt == 0
    restarted.close()


def test_requests_added_together_share_a_prompt_prefilled_once(smollm2: Model) -> None:
    """Three choices of one long prompt (an n > 1 request): the first is prefilled, the others
    find its blocks when their own prefill starts."""
    chat = ask("Repeat after me, carefully and slowly: " + "the quick brown fox " * 30)
    cache = PrefixCache(block_tokens=32, memory_bytes=64 * 2**20)
    batch = Batch(smollm2, cache)
    options = GenerationOptions(max_tokens=6)
    order = [batch.add(chat, options) for _ in range(3)]
    out, _ = drive(batch, {})
    cached = [out[g][-1].usage.cached_tokens for g in order if out[g][-1].usage is not None]
    prompt = len(smollm2.encode(chat))
    assert cached[0] == 0 and cached[1] == cached[2] == (prompt - 1) // 32 * 32
    assert len({tokens(out[g]) for g in order}) == 1


def test_sampled_rows_of_one_setting_equal_each_alone(smollm2: Model) -> None:
    """Rows that share a sampling setting are sampled in one call, each with its own key: a
    seeded answer is the one it gets alone."""
    chats = [ask(f"Write a line about the number {n}.") for n in range(4)]
    options = [GenerationOptions(max_tokens=20, temperature=0.9, top_k=50, top_p=0.95, seed=n)
               for n in range(4)]
    alone = [smollm2.generate(c, o).token_ids for c, o in zip(chats, options, strict=True)]
    batch = Batch(smollm2)
    order = [batch.add(c, o) for c, o in zip(chats, options, strict=True)]
    out, widest = drive(batch, {})
    assert widest == 4
    assert [tokens(out[g]) for g in order] == alone
    assert len(set(alone)) == 4  # the seeds differ, and so do the answers


def test_churn_through_the_slots_keeps_every_answer() -> None:
    """Nine answers of different lengths join at different steps (the slots double to 16) and
    leave one by one (the slots halve as they empty, the rest moving): each answer is still
    the one it gets alone."""
    model = load(parity.checkpoint_dir("llama-default", "v5"), dtype="float32")
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(9)]
    limits = [5, 31, 12, 3, 27, 8, 19, 2, 24]
    alone = [model.generate(p, GenerationOptions(max_tokens=n)).token_ids
             for p, n in zip(prompts, limits, strict=True)]
    batch = Batch(model)
    order: list[Generation] = []

    def join(i: int) -> Callable[[], Generation]:
        return joiner(batch, order, prompts[i], limits[i])

    out, widest = drive(batch, {0: join(0), 1: join(1), 2: join(2), 3: join(3), 4: join(4),
                                5: join(5), 6: join(6), 7: join(7), 9: join(8)})
    assert widest >= 5
    assert [tokens(out[g]) for g in order] == alone


def test_the_last_one_left_reads_its_own_logits() -> None:
    """B joins A's batch in the second slot; A leaves; B decodes alone again (its logits one
    row) and then others join it: B's answer is still its own."""
    model = load(parity.checkpoint_dir("llama-default", "v5"), dtype="float32")
    limits = [3, 20, 8, 8]
    alone = [model.generate(p, GenerationOptions(max_tokens=n)).token_ids
             for p, n in zip(PROMPTS, limits, strict=True)]
    batch = Batch(model)
    order: list[Generation] = []

    def join(i: int) -> Callable[[], Generation]:
        return joiner(batch, order, PROMPTS[i], limits[i])

    out, _ = drive(batch, {0: join(0), 1: join(1), 8: join(2), 9: join(3)})
    assert [tokens(out[g]) for g in order] == alone


def test_random_joins_and_leaves_keep_every_answer(tiny_llama_dir: Path) -> None:
    """A seeded storm of arrivals (up to six at once), answers of different lengths and
    cancellations mid-answer, as a busy server sees them: every answer that completes is the
    one it gets alone (the batch grows, shrinks, empties and decodes alone again)."""
    import random

    model = load(tiny_llama_dir)
    prompts = [f"{PROMPTS[i % 4]} number {i}" for i in range(8)]
    limits = [4, 9, 16, 24]
    alone = {(i, n): model.generate(prompts[i], GenerationOptions(max_tokens=n)).token_ids
             for i in range(8) for n in limits}
    rng = random.Random(7)
    batch = Batch(model)
    live: dict[Generation, tuple[tuple[int, int], list[int], int | None]] = {}
    completed = 0
    for _ in range(400):
        while len(live) < rng.randint(0, 6):
            key = (rng.randrange(8), rng.choice(limits))
            cut = rng.randrange(1, key[1]) if rng.random() < 0.3 else None
            live[batch.add(prompts[key[0]], GenerationOptions(max_tokens=key[1]))] = (key, [], cut)
        for generation, event in batch.step():
            assert not isinstance(event, Exception)
            key, got, _ = live[generation]
            got.extend(t for p in event for t in p.token_ids)
            if event and event[-1].finish_reason is not None:
                assert tuple(got) == alone[key]
                completed += 1
                del live[generation]
        for generation, (_, got, cut) in list(live.items()):
            if cut is not None and len(got) >= cut:
                batch.cancel(generation)
                del live[generation]
    assert completed >= 40
