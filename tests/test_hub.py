"""Hub downloads end to end against a hub-shaped server on loopback (tests/hub_server.py).

huggingface_hub is pointed at the server the way a user would do it, with environment variables:
HF_ENDPOINT, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_HUB_DISABLE_XET. huggingface_hub reads
them once, into `huggingface_hub.constants`, when it is first imported; a user sets them before
starting Python. Within one test process the `hf_env` fixture sets them with monkeypatch and then
reloads `huggingface_hub.constants` (what a fresh process would see), and reloads it again after
the test once the environment is restored. Nothing here reaches beyond 127.0.0.1."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import huggingface_hub.constants as hf_constants
import huggingface_hub.file_download as hf_file_download
import pytest

import mlx_omnia
from mlx_omnia import CheckpointError, DownloadError, GenerationOptions, ModelNotFoundError
from mlx_omnia.engine.loading.hub import ALLOW_PATTERNS, download
from mlx_omnia.engine.loading.weights import INDEX
from tests.fixtures.tiny import write_tiny_llama
from tests.hub_server import HubServer, iter_snapshot_files

REPO = "acme/tiny-llama"
UNNEEDED = {
    "pytorch_model.bin": os.urandom(1 << 20),  # LFS: served through the CDN redirect
    "tiny-llama.Q4_0.gguf": b"GGUF" + os.urandom(1 << 16),
    "README.md": b"# tiny llama\n",
    "onnx/model.onnx": os.urandom(1 << 12),
    "original/model.safetensors": os.urandom(1 << 12),  # loading reads only the top level
}
GREEDY = GenerationOptions(max_tokens=4, temperature=0.0)


class HfEnv:
    """The environment huggingface_hub sees; `set` changes it as if the process restarted."""

    def __init__(self, mp: pytest.MonkeyPatch, server: HubServer, home: Path) -> None:
        self.mp = mp
        self.server = server
        self.home = home
        self.cache = home / "hub"

    def set(self, **env: str | None) -> None:
        for key, value in env.items():
            if value is None:
                self.mp.delenv(key, raising=False)
            else:
                self.mp.setenv(key, value)
        importlib.reload(hf_constants)

    def storage(self, repo_id: str = REPO) -> Path:
        return self.cache / f"models--{repo_id.replace('/', '--')}"

    def snapshot(self, revision: str = "main", repo_id: str = REPO) -> Path:
        return self.storage(repo_id) / "snapshots" / self.server.commit(repo_id, revision)


@pytest.fixture
def hf_env(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[HfEnv]:
    server = HubServer().start()
    server.add_repo(REPO, tiny_llama_dir, extra_files=UNNEEDED)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(tmp_path)  # a repo id must never be mistaken for a local directory
            env = HfEnv(mp, server, tmp_path / "hf")
            env.set(
                HF_ENDPOINT=server.url,
                HF_HOME=str(env.home),
                HF_HUB_CACHE=str(env.cache),
                HF_HUB_DISABLE_XET="1",
                HF_HUB_DISABLE_TELEMETRY="1",
                HF_HUB_DISABLE_PROGRESS_BARS="1",
                HF_HUB_OFFLINE=None,
                TRANSFORMERS_OFFLINE=None,
                HF_TOKEN=None,
                HF_TOKEN_PATH=None,
                HUGGINGFACE_HUB_CACHE=None,
            )
            yield env
    finally:
        server.stop()
        importlib.reload(hf_constants)  # the restored environment


@pytest.fixture
def no_retry_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub sleeps 1 s before each resume attempt of a broken transfer; skip it."""

    class _Time:
        def __getattr__(self, name: str) -> object:
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            pass

    monkeypatch.setattr(hf_file_download, "time", _Time())


def needed_files(directory: Path) -> set[str]:
    """What loading `directory` as a repo reads: top-level files only; with an index, the
    shards it names rather than every *.safetensors."""
    names = {
        name
        for name in iter_snapshot_files(directory)
        if "/" not in name and any(fnmatch(name, pattern) for pattern in ALLOW_PATTERNS)
    }
    if INDEX in names:
        shards = set(json.loads((directory / INDEX).read_text())["weight_map"].values())
        names = {n for n in names if not n.endswith(".safetensors") or n in shards}
    return names


def file_gets(server: HubServer, filename: str) -> int:
    """GETs of a file's content (the /resolve GET of a regular file, or the CDN GET)."""
    return sum(
        1
        for r in server.file_requests(filename, "GET")
        if r.status in (200, 206) or r.path.startswith("/cdn/")
    )


def assert_generates(model: mlx_omnia.Model) -> None:
    completion = model.generate("hello", GREEDY)
    assert completion.usage.completion_tokens >= 1


# (a) fresh download -------------------------------------------------------------------------------


def test_fresh_download_fills_the_standard_cache_with_only_needed_files(
    hf_env: HfEnv, tiny_llama_dir: Path
) -> None:
    model = mlx_omnia.load(REPO)
    assert_generates(model)

    commit = hf_env.server.commit(REPO)
    snapshot = hf_env.storage() / "snapshots" / commit
    assert Path(model.source) == snapshot
    assert (hf_env.storage() / "refs" / "main").read_text() == commit

    needed = needed_files(tiny_llama_dir)
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= needed
    assert set(iter_snapshot_files(snapshot)) == needed
    for name in needed:
        assert (snapshot / name).read_bytes() == (tiny_llama_dir / name).read_bytes()
        assert file_gets(hf_env.server, name) == 1

    # Never asked for, not even a HEAD: the big weights in other formats, docs, subfolders.
    requested = hf_env.server.requested_files()
    assert requested == needed
    for name in UNNEEDED:
        assert hf_env.server.file_requests(name) == []
    # Blobs are content-addressed: the sha256 for LFS files, the git blob id for the others.
    blobs = {p.name for p in (hf_env.storage() / "blobs").iterdir()}
    assert len(blobs) == len(needed)
    assert not any(name.endswith(".incomplete") for name in blobs)


def test_second_online_load_only_resolves_the_revision(hf_env: HfEnv) -> None:
    mlx_omnia.load(REPO)
    before = len(hf_env.server.requests)
    model = mlx_omnia.load(REPO)
    assert_generates(model)
    new = hf_env.server.requests[before:]
    # The revision -> commit look-up; the file listing is cached on disk per commit.
    assert [(r.method, r.path) for r in new] == [("GET", f"/api/models/{REPO}/revision/main")]


# (b) cache hit without network --------------------------------------------------------------------


def test_cached_model_loads_with_the_hub_gone(hf_env: HfEnv) -> None:
    first = mlx_omnia.load(REPO)
    hf_env.server.stop()

    model = mlx_omnia.load(REPO, local_files_only=True)
    assert model.source == first.source
    assert_generates(model)

    hf_env.set(HF_HUB_OFFLINE="1")
    model = mlx_omnia.load(REPO)
    assert model.source == first.source
    assert_generates(model)

    # Online but the hub is unreachable: huggingface_hub falls back to the cached snapshot.
    hf_env.set(HF_HUB_OFFLINE=None)
    model = mlx_omnia.load(REPO)
    assert model.source == first.source


def test_uncached_model_offline_says_to_download_it_first(hf_env: HfEnv) -> None:
    with pytest.raises(ModelNotFoundError, match=r"not in the local HF cache .*off \(local_files_"
                       r"only=True\); download it first: .* or `omnia pull acme/tiny-llama`"):
        mlx_omnia.load(REPO, local_files_only=True)
    hf_env.set(HF_HUB_OFFLINE="1")
    with pytest.raises(ModelNotFoundError, match=r"off \(HF_HUB_OFFLINE is set\)"):
        mlx_omnia.load(REPO)
    assert hf_env.server.requests == []


def test_uncached_model_with_the_hub_unreachable_is_a_download_error(hf_env: HfEnv) -> None:
    hf_env.server.stop()
    with pytest.raises(DownloadError, match=r"could not reach the hub at http://127\.0\.0\.1:\d+"):
        mlx_omnia.load(REPO)
    # a pull plans its files first: the same plain words, not "try again" alone
    with pytest.raises(DownloadError, match=r"could not reach the hub at http://127\.0\.0\.1:\d+ to "
                       r"download 'acme/tiny-llama' \(ConnectError: .*\); check the network"):
        mlx_omnia.pull(REPO)


# (c) missing repo ---------------------------------------------------------------------------------


def test_missing_repo_is_model_not_found(hf_env: HfEnv) -> None:
    with pytest.raises(ModelNotFoundError, match=r"'acme/nope' was not found on http://127"):
        mlx_omnia.load("acme/nope")
    assert [r.path for r in hf_env.server.requests] == ["/api/models/acme/nope/revision/main"]
    assert not hf_env.storage("acme/nope").joinpath("snapshots").exists()


def test_repo_without_hf_checkpoint_is_a_checkpoint_error(hf_env: HfEnv) -> None:
    hf_env.server.add_repo(
        "acme/gguf-only", extra_files={"README.md": b"hi", "m.Q4_0.gguf": b"GGUF" + bytes(64)}
    )
    with pytest.raises(CheckpointError, match=r"no config\.json.*GGUF-only repo"):
        mlx_omnia.load("acme/gguf-only")
    assert hf_env.server.requested_files() == set()


# (d) interrupted download -------------------------------------------------------------------------


def test_connection_cut_mid_file_is_retried_transparently(
    hf_env: HfEnv, tiny_llama_dir: Path, no_retry_sleep: None
) -> None:
    hf_env.server.cut_transfer("model.safetensors", after_bytes=4096)
    model = mlx_omnia.load(REPO)
    assert_generates(model)
    gets = [
        r
        for r in hf_env.server.file_requests("model.safetensors", "GET")
        if r.path.startswith("/cdn/")
    ]
    assert len(gets) == 2  # cut once, fetched again within the same load()
    # huggingface_hub 2.4.0 counts only whole 10 MB chunks as received, so a cut inside the first
    # chunk restarts the file from byte 0 rather than resuming with a Range request.
    assert gets[1].range is None
    snapshot = hf_env.snapshot()
    assert (snapshot / "model.safetensors").read_bytes() == (
        tiny_llama_dir / "model.safetensors"
    ).read_bytes()
    assert not list((hf_env.storage() / "blobs").glob("*.incomplete"))


def test_big_file_cut_mid_transfer_resumes_with_a_range_request(
    hf_env: HfEnv, no_retry_sleep: None
) -> None:
    """The server's Range support, through huggingface_hub's resume path (past the first 10 MB
    chunk)."""
    data = os.urandom(hf_constants.DOWNLOAD_CHUNK_SIZE + (1 << 20))
    hf_env.server.add_repo("acme/big", extra_files={"big.bin": data})
    hf_env.server.cut_transfer("big.bin", after_bytes=hf_constants.DOWNLOAD_CHUNK_SIZE + 1000)
    path = hf_file_download.hf_hub_download("acme/big", "big.bin")
    assert Path(path).read_bytes() == data
    ranges = [
        r.range for r in hf_env.server.file_requests("big.bin", "GET") if r.path.startswith("/cdn/")
    ]
    assert ranges == [None, f"bytes={hf_constants.DOWNLOAD_CHUNK_SIZE}-"]


def test_download_broken_for_good_raises_and_the_next_load_completes_it(
    hf_env: HfEnv, tiny_llama_dir: Path, no_retry_sleep: None
) -> None:
    hf_env.server.cut_transfer("model.safetensors", after_bytes=0, times=None)
    with pytest.raises(DownloadError, match=r"try again: files already complete are kept"):
        mlx_omnia.load(REPO)
    # huggingface_hub gave up after its 5 resume attempts (6 GETs), inside the one load() call.
    assert file_gets(hf_env.server, "model.safetensors") == 6
    snapshot = hf_env.snapshot()
    assert not (snapshot / "model.safetensors").exists()
    assert (snapshot / "config.json").is_file()
    assert not list((hf_env.storage() / "blobs").glob("*.incomplete"))

    # Offline, the half-filled snapshot is reported as incomplete, not loaded.
    with pytest.raises(DownloadError, match=r"incomplete.*run again with network access"):
        mlx_omnia.load(REPO, local_files_only=True)

    hf_env.server.clear_faults()
    model = mlx_omnia.load(REPO)
    assert_generates(model)
    assert (snapshot / "model.safetensors").read_bytes() == (
        tiny_llama_dir / "model.safetensors"
    ).read_bytes()
    # Files completed by the failed call were not fetched again.
    assert file_gets(hf_env.server, "config.json") == 1
    assert file_gets(hf_env.server, "model.safetensors") == 7


def test_server_error_on_a_file_raises_download_error(hf_env: HfEnv) -> None:
    hf_env.server.fail("model.safetensors", status=500)
    with pytest.raises(
        DownloadError, match=r"acme/tiny-llama.*HfHubHTTPError.*try again"
    ):
        mlx_omnia.load(REPO)
    assert_generates(mlx_omnia.load(REPO))


# (e) revisions ------------------------------------------------------------------------------------


def test_named_revisions_and_commits_resolve(hf_env: HfEnv, tmp_path: Path) -> None:
    v2 = write_tiny_llama(tmp_path / "v2", seed=1)
    hf_env.server.add_repo(REPO, v2, revision="v2")
    hf_env.server.add_repo(REPO, v2, revision="refs/pr/1")

    main = mlx_omnia.load(REPO)
    other = mlx_omnia.load(REPO, revision="v2")
    assert Path(other.source) == hf_env.snapshot("v2") != Path(main.source)
    assert (hf_env.storage() / "refs" / "v2").read_text() == hf_env.server.commit(REPO, "v2")
    assert (Path(other.source) / "model.safetensors").read_bytes() == (
        v2 / "model.safetensors"
    ).read_bytes()
    assert main.generate("hello", GREEDY).token_ids != other.generate("hello", GREEDY).token_ids

    pr = mlx_omnia.load(REPO, revision="refs/pr/1")  # sent as one %2F-quoted path segment
    assert Path(pr.source) == hf_env.snapshot("refs/pr/1")

    commit = hf_env.server.commit(REPO, "main")
    before = len(hf_env.server.requests)
    pinned = mlx_omnia.load(REPO, revision=commit)
    assert pinned.source == main.source
    assert hf_env.server.requests[before:] == []  # a cached commit needs no request at all

    # Cached branches load offline too.
    hf_env.server.stop()
    assert mlx_omnia.load(REPO, revision="v2", local_files_only=True).source == other.source


def test_unknown_revision_is_model_not_found(hf_env: HfEnv) -> None:
    with pytest.raises(ModelNotFoundError, match=r"has no revision 'nope'"):
        mlx_omnia.load(REPO, revision="nope")
    with pytest.raises(ModelNotFoundError, match=r"has no revision"):
        mlx_omnia.load(REPO, revision="0" * 40)
    assert hf_env.server.requested_files() == set()


# (f) names that are paths -------------------------------------------------------------------------


def all_paths(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize(
    "name",
    # (A name that is an existing local directory, such as "..", is loaded as one by resolve().)
    [
        "../x",
        "/etc/passwd",
        "a/../../b",
        "acme/..",
        "../acme/tiny-llama",
        "acme/../../x",
        "acme\\..\\x",
    ],
)
def test_path_like_model_names_never_leave_the_cache(
    hf_env: HfEnv, tmp_path: Path, name: str
) -> None:
    before = all_paths(tmp_path.parent)
    with pytest.raises(ModelNotFoundError):
        mlx_omnia.load(name)
    with pytest.raises(ModelNotFoundError, match=r"not a hub repo id"):
        download(name)
    assert hf_env.server.requests == []
    assert all_paths(tmp_path.parent) == before


@pytest.mark.parametrize(
    "revision", ["../../../../x", "/etc", "main/../../x", "a b", ".hidden", ""]
)
def test_path_like_revisions_never_leave_the_cache(
    hf_env: HfEnv, tmp_path: Path, revision: str
) -> None:
    mlx_omnia.load(REPO)
    before = all_paths(tmp_path.parent)
    requests = len(hf_env.server.requests)
    for local_files_only in (False, True):
        with pytest.raises(ModelNotFoundError, match=r"not a valid revision"):
            mlx_omnia.load(REPO, revision=revision, local_files_only=local_files_only)
    assert len(hf_env.server.requests) == requests
    assert all_paths(tmp_path.parent) == before


# (g) sharded checkpoints --------------------------------------------------------------------------

SHARDED = "acme/tiny-sharded"


def write_sharded(src: Path, dst: Path) -> Path:
    """src's checkpoint with its weights in two shards and a model.safetensors.index.json."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i, keys in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in keys}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def serve_sharded(env: HfEnv, tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """SHARDED on the hub: two shards and their index, plus what loading never reads: the same
    weights consolidated in one top-level file (as Mistral's repos ship them) and in a folder."""
    sharded = write_sharded(tiny_llama_dir, tmp_path / "sharded")
    full = (tiny_llama_dir / "model.safetensors").read_bytes()
    env.server.add_repo(
        SHARDED,
        sharded,
        extra_files={"consolidated.safetensors": full, "original/model.safetensors": full},
    )
    return sharded


def test_sharded_repo_fetches_only_the_shards_its_index_names(
    hf_env: HfEnv, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    sharded = serve_sharded(hf_env, tiny_llama_dir, tmp_path)
    model = mlx_omnia.load(SHARDED)
    reference = mlx_omnia.load(str(tiny_llama_dir))
    assert model.generate("hello", GREEDY).token_ids == reference.generate("hello", GREEDY).token_ids

    needed = needed_files(sharded)
    assert {INDEX, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= needed
    assert "consolidated.safetensors" not in needed
    assert set(iter_snapshot_files(Path(model.source))) == needed
    assert hf_env.server.requested_files() == needed
    for name in needed:
        assert file_gets(hf_env.server, name) == 1
    # The memory estimate prices the shards once, not the consolidated copy beside them.
    assert mlx_omnia.estimate_memory(SHARDED) == mlx_omnia.estimate_memory(str(tiny_llama_dir))

    # A second load online asks the hub only which commit main is.
    before = len(hf_env.server.requests)
    mlx_omnia.load(SHARDED)
    new = hf_env.server.requests[before:]
    assert [(r.method, r.path) for r in new] == [("GET", f"/api/models/{SHARDED}/revision/main")]


def test_pull_of_a_sharded_repo_counts_and_fetches_only_what_loading_reads(
    hf_env: HfEnv, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    sharded = serve_sharded(hf_env, tiny_llama_dir, tmp_path)
    events: list[mlx_omnia.PullProgress] = []
    path = mlx_omnia.pull(SHARDED, progress=events.append)
    needed = needed_files(sharded)
    assert set(iter_snapshot_files(path)) == needed
    assert hf_env.server.requested_files() == needed
    for name in needed:
        assert file_gets(hf_env.server, name) == 1
    total = sum((sharded / name).stat().st_size for name in needed)
    assert events[-1].state == "done"
    assert {e.total for e in events} == {total}
    assert events[-1].done == total
    assert_generates(mlx_omnia.load(SHARDED, local_files_only=True))


@pytest.mark.parametrize(
    "shard",
    ["../evil.safetensors", "original/model.safetensors", "/tmp/x.safetensors", "model.bin",
     ".model.safetensors", "a\\..\\b.safetensors"],
)
def test_an_index_naming_files_outside_the_checkpoint_is_refused(
    hf_env: HfEnv, tiny_llama_dir: Path, tmp_path: Path, shard: str
) -> None:
    bad = write_sharded(tiny_llama_dir, tmp_path / "bad")
    index = json.loads((bad / INDEX).read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = shard
    (bad / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="beside the index"):
        mlx_omnia.load(str(bad))
    with pytest.raises(CheckpointError, match="beside the index"):
        mlx_omnia.estimate_memory(str(bad))
    hf_env.server.add_repo("acme/bad-index", bad)
    with pytest.raises(CheckpointError, match="beside the index"):
        mlx_omnia.load("acme/bad-index")
    with pytest.raises(CheckpointError, match="beside the index"):
        mlx_omnia.pull("acme/bad-index")
    # Only the configs, tokenizer and index were fetched: no weights.
    assert not any(n.endswith(".safetensors") for n in hf_env.server.requested_files())
