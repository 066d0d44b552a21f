"""The KV prefix cache store: content addressing, the memory and disk tiers and their budgets,
and that a damaged file is dropped rather than served."""

from __future__ import annotations

import logging
import os
import random
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_omnia.engine.generate.prefix import BlockState, PrefixCache, default_prefix_dir

BLOCK = 4  # tokens per block
LAYERS = 2
MODEL = "org/model@rev1"


def block_state(tokens: list[int], i: int, dtype: mx.Dtype = mx.float32) -> BlockState:
    """A deterministic state for block i of `tokens`: a function of the tokens it covers."""
    seed = hash(tuple(tokens[: (i + 1) * BLOCK])) % 2**31
    keys = mx.random.split(mx.random.key(seed), 2 * LAYERS)
    return [
        {
            "keys": mx.random.normal((1, 2, BLOCK, 3), key=keys[2 * layer]).astype(dtype),
            "values": mx.random.normal((1, 2, BLOCK, 5), key=keys[2 * layer + 1]).astype(dtype),
        }
        for layer in range(LAYERS)
    ]


BLOCK_BYTES = LAYERS * (2 * BLOCK * 3 + 2 * BLOCK * 5) * 4  # float32


def states_of(tokens: list[int], dtype: mx.Dtype = mx.float32) -> Callable[[int], BlockState]:
    return lambda i: block_state(tokens, i, dtype)


def assert_same(got: BlockState, want: BlockState) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)
        for name in w:
            assert g[name].dtype == w[name].dtype
            assert g[name].shape == w[name].shape
            assert mx.array_equal(g[name], w[name]).item()


def conversation(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(blocks * BLOCK)]


def on_disk(root: Path, memory_bytes: int = 1 << 20, disk_bytes: int = 1 << 20) -> PrefixCache:
    return PrefixCache(block_tokens=BLOCK, memory_bytes=memory_bytes, disk_dir=root,
                       disk_bytes=disk_bytes)


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_lookup_returns_the_stored_arrays(tmp_path: Path, dtype: mx.Dtype, tier: str) -> None:
    tokens = conversation(0, 3)
    cache = on_disk(tmp_path)
    assert cache.store(MODEL, tokens, states_of(tokens, dtype)) == 3
    cache.close()
    if tier == "disk":  # a new process: memory is empty, the files remain
        cache = on_disk(tmp_path)
    got = cache.lookup(MODEL, tokens)
    assert len(got) == 3
    for i, state in enumerate(got):
        assert_same(state, block_state(tokens, i, dtype))
    cache.close()


def test_only_whole_blocks_count() -> None:
    tokens = conversation(1, 3)
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=1 << 20)
    assert cache.store(MODEL, tokens[: 2 * BLOCK + 3], states_of(tokens)) == 2
    assert len(cache.lookup(MODEL, tokens)) == 2
    assert len(cache.lookup(MODEL, tokens[: 2 * BLOCK - 1])) == 1
    assert cache.lookup(MODEL, tokens[: BLOCK - 1]) == []
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.memory_blocks) == (3, 1, 2)


def test_a_diverging_conversation_hits_the_common_blocks() -> None:
    first = conversation(2, 5)
    second = first[: 3 * BLOCK + 1] + [t + 1 for t in first[3 * BLOCK + 1 :]]  # differs in block 3
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=1 << 20)
    cache.store(MODEL, first, states_of(first))
    got = cache.lookup(MODEL, second)
    assert len(got) == 3
    for i, state in enumerate(got):
        assert_same(state, block_state(first, i))


def test_another_model_key_misses() -> None:
    tokens = conversation(3, 2)
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=1 << 20)
    cache.store(MODEL, tokens, states_of(tokens))
    assert cache.lookup("org/model@rev2", tokens) == []
    assert cache.stats().misses == 2


def test_state_of_is_called_only_for_missing_blocks() -> None:
    tokens = conversation(4, 4)
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=1 << 20)
    asked: list[int] = []

    def state_of(i: int) -> BlockState:
        asked.append(i)
        return block_state(tokens, i)

    assert cache.store(MODEL, tokens[: 2 * BLOCK], state_of) == 2
    assert cache.store(MODEL, tokens, state_of) == 2
    assert cache.store(MODEL, tokens, state_of) == 0
    assert asked == [0, 1, 2, 3]


def test_memory_evicts_the_least_recently_used() -> None:
    a, b, c, d = (conversation(10 + n, 1) for n in range(4))
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=3 * BLOCK_BYTES)
    for tokens in (a, b, c):
        cache.store(MODEL, tokens, states_of(tokens))
    assert len(cache.lookup(MODEL, a)) == 1  # a is now the most recent; b the least
    cache.store(MODEL, d, states_of(d))
    assert [len(cache.lookup(MODEL, t)) for t in (a, b, c, d)] == [1, 0, 1, 1]
    stats = cache.stats()
    assert (stats.memory_blocks, stats.memory_bytes, stats.evictions) == (3, 3 * BLOCK_BYTES, 1)


def test_a_block_larger_than_the_memory_budget_is_not_kept() -> None:
    tokens = conversation(5, 1)
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=BLOCK_BYTES - 1)
    assert cache.store(MODEL, tokens, states_of(tokens)) == 0
    assert cache.lookup(MODEL, tokens) == []
    assert cache.stats().memory_bytes == 0


def test_a_block_sliced_from_a_larger_buffer_is_kept_as_its_own_copy() -> None:
    tokens = conversation(6, 1)
    big = mx.random.normal((1, 64, 2 * BLOCK, 3))
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=1 << 20)
    cache.store(MODEL, tokens, lambda i: [{"keys": big[:, 1:2], "values": big[:, :, 4:8]}])
    (state,) = cache.lookup(MODEL, tokens)
    parts = {"keys": big[:, 1:2], "values": big[:, :, 4:8]}
    assert cache.stats().memory_bytes == sum(part.nbytes for part in parts.values()) == 3168
    for name, part in parts.items():
        assert mx.array_equal(state[0][name], part).item()
        assert not np.shares_memory(np.asarray(state[0][name]), np.asarray(big))


def test_memory_budget_holds_under_churn() -> None:
    rng = random.Random(7)
    pool = [conversation(100 + n, rng.randint(1, 4)) for n in range(12)]
    budget = 5 * BLOCK_BYTES
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=budget)
    for _ in range(200):
        tokens = rng.choice(pool)
        if rng.random() < 0.5:
            cache.store(MODEL, tokens, states_of(tokens))
        else:
            for i, state in enumerate(cache.lookup(MODEL, tokens)):
                assert_same(state, block_state(tokens, i))
        stats = cache.stats()
        assert stats.memory_bytes <= budget
        assert stats.memory_bytes == stats.memory_blocks * BLOCK_BYTES
    assert cache.stats().evictions > 0


def test_a_new_cache_on_the_same_directory_hits_from_disk_and_promotes(tmp_path: Path) -> None:
    tokens = conversation(8, 3)
    first = on_disk(tmp_path)
    first.store(MODEL, tokens, states_of(tokens))
    first.close()
    assert len(files(tmp_path)) == 3
    second = on_disk(tmp_path)
    assert (second.stats().memory_blocks, second.stats().disk_blocks) == (0, 3)
    assert len(second.lookup(MODEL, tokens)) == 3
    assert second.stats().memory_blocks == 3  # promoted
    for f in files(tmp_path):  # the next lookup is served from memory
        f.unlink()
    assert len(second.lookup(MODEL, tokens)) == 3
    second.close()


def test_disk_budget_holds_under_churn_and_evicted_files_are_gone(tmp_path: Path) -> None:
    rng = random.Random(9)
    pool = [conversation(200 + n, rng.randint(1, 3)) for n in range(15)]
    probe = on_disk(tmp_path, memory_bytes=0)
    probe.store(MODEL, pool[0][:BLOCK], states_of(pool[0]))
    probe.close()
    file_bytes = files(tmp_path)[0].stat().st_size  # every block here has the same file size
    budget = 6 * file_bytes
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=2 * BLOCK_BYTES, disk_dir=tmp_path,
                        disk_bytes=budget)
    for _ in range(150):
        tokens = rng.choice(pool)
        if rng.random() < 0.6:
            cache.store(MODEL, tokens, states_of(tokens))
        else:
            for i, state in enumerate(cache.lookup(MODEL, tokens)):
                assert_same(state, block_state(tokens, i))
        cache.flush()
        present = files(tmp_path)
        stats = cache.stats()
        assert sum(f.stat().st_size for f in present) == stats.disk_bytes <= budget
        assert len(present) == stats.disk_blocks
    assert cache.stats().disk_evictions > 0
    assert cache.stats().dropped_corrupt == 0
    cache.close()


def test_lookups_while_the_writer_runs_serve_only_whole_correct_blocks(tmp_path: Path) -> None:
    rng = random.Random(11)
    pool = [conversation(300 + n, rng.randint(1, 3)) for n in range(10)]
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=0, disk_dir=tmp_path, disk_bytes=4000)
    for _ in range(200):  # no flush: reads race the writer's writes and evictions
        tokens = rng.choice(pool)
        cache.store(MODEL, tokens, states_of(tokens))
        other = rng.choice(pool)
        for i, state in enumerate(cache.lookup(MODEL, other)):
            assert_same(state, block_state(other, i))
    cache.close()
    stats = cache.stats()
    assert stats.hits > 0 and stats.disk_evictions > 0 and stats.dropped_corrupt == 0


def test_a_block_larger_than_the_disk_budget_is_not_written(tmp_path: Path) -> None:
    tokens = conversation(15, 1)
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1)
    assert cache.store(MODEL, tokens, states_of(tokens)) == 1  # memory keeps it
    cache.flush()
    assert (files(tmp_path), cache.stats().disk_bytes) == ([], 0)
    cache.close()


def test_disk_evicts_the_least_recently_read(tmp_path: Path) -> None:
    a, b, c, d = (conversation(20 + n, 1) for n in range(4))
    probe = on_disk(tmp_path, memory_bytes=0)
    probe.store(MODEL, a, states_of(a))
    probe.close()
    budget = 3 * files(tmp_path)[0].stat().st_size
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=0, disk_dir=tmp_path, disk_bytes=budget)
    for tokens in (b, c):
        cache.store(MODEL, tokens, states_of(tokens))
    cache.flush()
    assert len(cache.lookup(MODEL, a)) == 1  # a was written first but read last
    cache.store(MODEL, d, states_of(d))
    cache.flush()
    assert [len(cache.lookup(MODEL, t)) for t in (a, b, c, d)] == [1, 0, 1, 1]
    assert len(files(tmp_path)) == 3
    cache.close()


def test_a_restart_trims_the_oldest_files_to_the_budget(tmp_path: Path) -> None:
    blocks = [conversation(30 + n, 1) for n in range(3)]
    cache = on_disk(tmp_path, memory_bytes=0)
    written: list[Path] = []
    for tokens in blocks:
        cache.store(MODEL, tokens, states_of(tokens))
        cache.flush()
        written += [f for f in files(tmp_path) if f not in written]
    cache.close()
    for age, f in enumerate([written[1], written[0], written[2]]):  # explicit mtimes: 1 < 0 < 2
        stamp = 1_700_000_000_000_000_000 + age * 1_000_000_000
        os.utime(f, ns=(stamp, stamp))
    size = written[0].stat().st_size
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=0, disk_dir=tmp_path, disk_bytes=2 * size)
    assert files(tmp_path) == sorted([written[0], written[2]])
    assert [len(cache.lookup(MODEL, t)) for t in blocks] == [1, 0, 1]
    cache.close()


def _flip_payload(path: Path, others: list[Path]) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path, others: list[Path]) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _appended(path: Path, others: list[Path]) -> None:
    path.write_bytes(path.read_bytes() + bytes(8))


def _renamed_from_another_key(path: Path, others: list[Path]) -> None:
    others[-1].replace(path)


def _garbage(path: Path, others: list[Path]) -> None:
    path.write_bytes(random.Random(0).randbytes(300))


def _odd_header(path: Path, others: list[Path]) -> None:
    header = b'[{"__metadata__": 7}]    '
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))


@pytest.mark.parametrize(
    "damage",
    [_flip_payload, _truncate, _appended, _renamed_from_another_key, _garbage, _odd_header],
)
def test_a_damaged_file_is_dropped_not_served(
    tmp_path: Path, damage: Callable[[Path, list[Path]], None], caplog: pytest.LogCaptureFixture
) -> None:
    tokens = conversation(40, 4)
    cache = on_disk(tmp_path, memory_bytes=0)
    by_block: list[Path] = []  # each block's file, found by storing one block more at a time
    for i in range(4):
        cache.store(MODEL, tokens[: (i + 1) * BLOCK], states_of(tokens))
        cache.flush()
        by_block += [f for f in files(tmp_path) if f not in by_block]
    cache.close()
    damage(by_block[2], by_block)
    cache = on_disk(tmp_path)
    with caplog.at_level(logging.WARNING, logger="mlx_omnia.engine.generate.prefix"):
        got = cache.lookup(MODEL, tokens)
    assert len(got) == 2
    for i, state in enumerate(got):
        assert_same(state, block_state(tokens, i))
    assert not by_block[2].exists()
    assert cache.stats().dropped_corrupt == 1
    assert "dropping" in caplog.text
    cache.close()


def test_opaque_layer_states_round_trip(tmp_path: Path) -> None:
    tokens = conversation(50, 1)
    state: BlockState = [
        {"conv.state": mx.arange(6, dtype=mx.int32).reshape(1, 2, 3)},
        {"ssm": mx.ones((2, 2), dtype=mx.bfloat16), "step": mx.array([3], dtype=mx.uint8)},
        {},
    ]
    cache = on_disk(tmp_path, memory_bytes=0)
    cache.store(MODEL, tokens, lambda i: state)
    cache.flush()
    (got,) = cache.lookup(MODEL, tokens)
    assert_same(got, state)
    cache.close()


def test_close_is_idempotent(tmp_path: Path) -> None:
    tokens = conversation(60, 1)
    cache = on_disk(tmp_path)
    cache.store(MODEL, tokens, states_of(tokens))
    cache.close()
    cache.close()
    assert len(files(tmp_path)) == 1  # close waited for the write
    other = conversation(61, 1)
    assert cache.store(MODEL, other, states_of(other)) == 1  # memory only from now on
    assert len(files(tmp_path)) == 1


def test_a_disk_error_does_not_reach_the_caller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    tokens = conversation(70, 2)
    cache = PrefixCache(block_tokens=BLOCK, memory_bytes=1 << 20, disk_dir=blocker / "prefix",
                        disk_bytes=1 << 20)
    with caplog.at_level(logging.WARNING, logger="mlx_omnia.engine.generate.prefix"):
        assert cache.store(MODEL, tokens, states_of(tokens)) == 2
        cache.flush()
    assert len(cache.lookup(MODEL, tokens)) == 2  # memory still serves
    stats = cache.stats()
    assert (stats.disk_errors, stats.disk_blocks, stats.pending_writes) == (2, 0, 0)
    assert "disk write failed" in caplog.text
    cache.close()


def test_clear_drops_both_tiers(tmp_path: Path) -> None:
    tokens = conversation(80, 2)
    cache = on_disk(tmp_path)
    cache.store(MODEL, tokens, states_of(tokens))
    cache.clear()
    assert cache.lookup(MODEL, tokens) == []
    assert files(tmp_path) == []
    stats = cache.stats()
    assert (stats.memory_blocks, stats.disk_blocks) == (0, 0)
    assert (stats.memory_bytes, stats.disk_bytes) == (0, 0)
    cache.close()


def test_default_prefix_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMNIA_PREFIX_DIR", str(tmp_path / "chosen"))
    assert default_prefix_dir() == tmp_path / "chosen"
    monkeypatch.delenv("OMNIA_PREFIX_DIR")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_prefix_dir() == tmp_path / "mlx-omnia" / "prefix"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_prefix_dir() == Path.home() / ".cache" / "mlx-omnia" / "prefix"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert default_prefix_dir() == Path.home() / "Library" / "Caches" / "mlx-omnia" / "prefix"
