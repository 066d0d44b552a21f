"""What the CUDA path binds, pinned on the CPU.

Binding: each model below is built (zero weights of its real shapes, bfloat16, or affine 4-bit
g64 as a quantized checkpoint declares it) and bound with the backend made to look like CUDA;
then one decode step runs on a static cache with `mx.fast.cuda_kernel` replaced by a recorder.
The launches it records (kernel name, which bakes in every spec constant, source and header
digests, grid, block, inputs, outputs) are which declarations run as one launch and with which
kernel spec: a refactor of the binding or of a family must leave them unchanged.

To change them on purpose, run with OMNIA_PIN_DUMP=DIR before and after, diff the files, and
set the new digests (`python -m tests.test_binding_pin` prints them all), saying why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_omnia.engine.core.cache import KVCache, StaticKVCache
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Linear
from mlx_omnia.engine.core.moe import ExpertLinear
from mlx_omnia.engine.core.mxcompat import evaluate, named_modules
from mlx_omnia.engine.core.state import RecurrentState, StaticRecurrentState
from mlx_omnia.engine.loading import finish_network
from mlx_omnia.engine.loading.registry import family_for
from mlx_omnia.engine.loading.weights import read_json
from tests.fixtures import parity

# -- the models ------------------------------------------------------------------------------
# bench shapes (src/mlx_omnia/bench/shapes.py), one layer each: every layer binds alike
BENCH = ("qwen3-4b", "qwen3-0.6b", "llama3.2-1b", "smollm2-135m", "qwen3-30b-a3b", "olmoe-1b-7b")
FORMATS = ("bf16", "q4")
# environment arms: the unchained A/B arm and RouteExperts left out
ARMS: dict[str, dict[str, str]] = {
    "": {},
    "unchained": {"OMNIA_CHAINED_KERNELS": "0"},
    "no-route-experts": {"OMNIA_ROUTE_EXPERTS": "0"},
}
ARMED = ("qwen3-qknorm", "qwen3_moe-sparse", "llama-default", "qwen3-4b", "qwen3-30b-a3b")


def bench_config(name: str) -> dict[str, Any]:
    from mlx_omnia.bench.shapes import SHAPES

    config = dict(SHAPES[name])
    config["num_hidden_layers"] = 1
    return config


def fixture_config(variant: str) -> dict[str, Any]:
    return read_json(parity.checkpoint_dir(variant, "v5") / "config.json")


# Variants whose bf16 step cannot run on this CPU: experts no kernel binds (nemotron_h's ungated
# relu² experts) run MLX's CPU gather_mm, which takes float32 only. Their q4 step is pinned.
NO_CPU_BF16 = ("nemotron_h-hybrid", "nemotron_h-latent")


def cases() -> list[str]:
    out: list[str] = []
    for source in (*parity.VARIANTS, *BENCH):
        for fmt in FORMATS:
            if fmt == "bf16" and source in NO_CPU_BF16:
                continue
            out.append(f"{source}/{fmt}")
            if source in ARMED and (source, fmt) != ("qwen3-30b-a3b", "bf16"):
                out += [f"{source}/{fmt}/{arm}" for arm in ARMS if arm]
    return out


def _quantize_declared(network: nn.Module, bits: int = 4, group_size: int = 64) -> None:
    """Placeholders of a 4-bit checkpoint, as loading declares them (no arithmetic)."""
    for _, module in named_modules(network):
        if isinstance(module, Linear | ExpertLinear | Embedding):
            dims = module.dims if isinstance(module, Embedding) else module.input_dims
            if dims % group_size == 0:
                module.to_quantized(bits=bits, group_size=group_size)


# -- CUDA made to appear, kernels recorded ---------------------------------------------------
LAUNCHES: list[list[Any]] = []
_HASH = re.compile(r'#include "[^"]*/([^"/]+)"')


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _recorder(*, name: str, input_names: list[str], output_names: list[str], source: str,
              header: str = "", **options: Any) -> Any:
    made = [name, list(input_names), list(output_names), _digest(source),
            _HASH.sub(r"\1", header) if header.startswith("#include") else _digest(header),
            repr(sorted(options.items()))]

    def call(*, inputs: list[mx.array], output_shapes: list[Any], output_dtypes: list[mx.Dtype],
             grid: Any, threadgroup: Any, **more: Any) -> list[mx.array]:
        LAUNCHES.append([*made, list(grid), list(threadgroup),
                         [[str(a.dtype), list(a.shape)] for a in inputs],
                         [[str(d), list(s)] for s, d in zip(output_shapes, output_dtypes, strict=True)],
                         repr(sorted(more.items()))])
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

    return call


@contextmanager
def as_if_cuda(monkeypatch: pytest.MonkeyPatch, tmp: Path, env: dict[str, str]) -> Generator[None]:
    with monkeypatch.context() as patch:
        patch.setattr(mx.cuda, "is_available", lambda: True)
        patch.setattr(mx, "default_device", lambda: mx.gpu)
        patch.setattr(mx.fast, "cuda_kernel", _recorder)
        patch.setenv("OMNIA_KERNEL_HEADERS", str(tmp))
        for key in ("OMNIA_CHAINED_KERNELS", "OMNIA_ROUTE_EXPERTS", "OMNIA_REFERENCE_KERNELS"):
            patch.delenv(key, raising=False)
        for key, value in env.items():
            patch.setenv(key, value)
        yield


def build(case: str) -> nn.Module:
    source, fmt = case.split("/")[:2]
    config = bench_config(source) if source in BENCH else fixture_config(source)
    network = family_for(str(config["model_type"])).build(config)
    if fmt == "q4":
        _quantize_declared(network)
    finish_network(network, dtype=mx.bfloat16, quantize=None)
    return network


def launches(case: str, monkeypatch: pytest.MonkeyPatch, tmp: Path) -> list[Any]:
    """The launches of one decode step of `case`, bound as CUDA would bind it, on static caches
    holding three rows."""
    arm = case.split("/")[2] if case.count("/") == 2 else ""
    with as_if_cuda(monkeypatch, tmp, ARMS[arm]):
        network: Any = build(case)
        cache: list[KVCache | RecurrentState] = network.make_cache()
        if any(isinstance(c, RecurrentState) for c in cache):
            # a recurrent layer's state has the shapes its layer makes: run three tokens, one
            # at a time (a one-token MoE binds the experts kernels, recorded; a three-token one
            # would run MLX's CPU gather_mm, float32 only, on bf16 experts)
            for token in (4, 5, 6):
                evaluate(network(mx.array([[token]], dtype=mx.int32), cache))
        else:
            steps = sorted(
                ((p, m) for p, m in named_modules(network) if isinstance(m, AttentionStep)),
                key=lambda pm: [int(t) if t.isdigit() else t for t in pm[0].split(".")],
            )
            for c, (_, step) in zip(cache, steps, strict=True):
                dims = (1, step.n_kv_heads, 3)
                assert isinstance(c, KVCache)
                c.update_and_fetch(mx.zeros((*dims, step.head_dim), dtype=mx.bfloat16),
                                   mx.zeros((*dims, step.value_dim), dtype=mx.bfloat16))
        static = [StaticRecurrentState.from_state(c) if isinstance(c, RecurrentState)
                  else StaticKVCache.from_cache(c) for c in cache]
        LAUNCHES.clear()
        evaluate(network(mx.array([[4]], dtype=mx.int32), static))
        return list(LAUNCHES)


def launch_digest(record: list[Any]) -> str:
    text = json.dumps(record, sort_keys=True)
    return f"{len(record)} {hashlib.sha256(text.encode()).hexdigest()[:24]}"


def _dump(kind: str, case: str, record: Any) -> None:
    where = os.environ.get("OMNIA_PIN_DUMP")
    if where:
        path = Path(where) / kind / f"{case.replace('/', '__')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


# -- the pins ---------------------------------------------------------------------------------
PINNED_LAUNCHES: dict[str, str] = {
    "llama-default/bf16": "7 71b8fcfcfd27b66b48b55914",
    "llama-default/bf16/unchained": "9 6d726550e3a50c933eb6bb97",
    "llama-default/bf16/no-route-experts": "7 71b8fcfcfd27b66b48b55914",
    "llama-default/q4": "7 1320a7349ecc8d9644fc8714",
    "llama-default/q4/unchained": "9 b651fc765bea1943180ecbc2",
    "llama-default/q4/no-route-experts": "7 1320a7349ecc8d9644fc8714",
    "llama-llama3-tied/bf16": "10 3666739f3ba94e4b302c361d",
    "llama-llama3-tied/q4": "10 eaa0c4cd4527167f00f136d8",
    "qwen2-bias-tied/bf16": "5 30a655ae624f610a8d1ed28c",
    "qwen2-bias-tied/q4": "5 d8f0c90ca23eeb68bafbfa3b",
    "qwen3-qknorm/bf16": "10 c8e5b4a82903c0647826f383",
    "qwen3-qknorm/bf16/unchained": "16 c6cd9b7fdcc9294eaef407ff",
    "qwen3-qknorm/bf16/no-route-experts": "10 c8e5b4a82903c0647826f383",
    "qwen3-qknorm/q4": "10 c2bc32c0081c14420d9dbf55",
    "qwen3-qknorm/q4/unchained": "16 20b8c840b074c1443c8b1d7b",
    "qwen3-qknorm/q4/no-route-experts": "10 c2bc32c0081c14420d9dbf55",
    "mistral-sliding/bf16": "7 71b8fcfcfd27b66b48b55914",
    "mistral-sliding/q4": "7 1320a7349ecc8d9644fc8714",
    "mistral-full/bf16": "9 7e46733e6d0a8e7212c0e734",
    "mistral-full/q4": "9 484e60a42611961b958154cf",
    "qwen3_moe-sparse/bf16": "9 dbdbaac01777474e4129d2ab",
    "qwen3_moe-sparse/bf16/unchained": "18 bae39d112053fa204fad02b8",
    "qwen3_moe-sparse/bf16/no-route-experts": "11 0a63d601374f353eaf3b92e9",
    "qwen3_moe-sparse/q4": "9 7a17908324512b51cad33492",
    "qwen3_moe-sparse/q4/unchained": "18 18d95fa87ecb7b54cc67c421",
    "qwen3_moe-sparse/q4/no-route-experts": "11 a0b32798b9f1f1ddbc6ab3e0",
    "mixtral-default/bf16": "17 d675412be9da53cf0d13685e",
    "mixtral-default/q4": "17 759e8af1116316cbfe552475",
    "mixtral-window/bf16": "25 79897964d7ab371efae7d210",
    "mixtral-window/q4": "25 45fd00eb14a45c14f65a0cc5",
    "olmoe-default/bf16": "17 9e81fe8fa80a231f6f774b6f",
    "olmoe-default/q4": "17 878b9839822f3704475d30e1",
    "olmoe-clip/bf16": "13 547003eaeae2cb1bfe260bd5",
    "olmoe-clip/q4": "13 bbba342353add86a4ecb45de",
    "qwen2_moe-shared/bf16": "19 8a08d52f93f7fef1d1cfb428",
    "qwen2_moe-shared/q4": "19 5ebc74ff656bc91d981873c5",
    "qwen2_moe-step2/bf16": "17 f7dcf7a40d007a7ce47fba20",
    "qwen2_moe-step2/q4": "17 21572fc296089eb7a5e5b38c",
    "phi3-sliding/bf16": "9 8f1c00d5c922a5faaf05d168",
    "phi3-sliding/q4": "9 a421633f9260c08973b5b9c1",
    "phi3-longrope/bf16": "8 3bd0a0308c60974d2a595448",
    "phi3-longrope/q4": "8 22aa5a4ad885d74d1615970c",
    "granite-tied/bf16": "14 301d997fec4595a2c70397d1",
    "granite-tied/q4": "14 f6c6c7daa5ad03db87642e9a",
    "granite-bias/bf16": "1 575c54adacf0039611a97b20",
    "granite-bias/q4": "1 4b592722ae470ee0b28364e9",
    "olmo2-untied/bf16": "15 ba61b3b6a9608213ea7d8896",
    "olmo2-untied/q4": "15 b79cd2dfcdf348c67e344123",
    "olmo2-gqa-tied/bf16": "6 ee1156931118cead2d08d2a7",
    "olmo2-gqa-tied/q4": "6 f93b9e173e2e72fd6875b3fa",
    "smollm3-nope/bf16": "28 f6a04320fd8643fe0f5c1e19",
    "smollm3-nope/q4": "28 e84df1d9fa6689cde031ada2",
    "starcoder2-sliding/bf16": "0 4f53cda18c2baa0c0354bb5f",
    "starcoder2-sliding/q4": "0 4f53cda18c2baa0c0354bb5f",
    "starcoder2-untied/bf16": "1 575c54adacf0039611a97b20",
    "starcoder2-untied/q4": "1 4b592722ae470ee0b28364e9",
    "gemma-tied/bf16": "21 55e9f10ef5a8b3270894ba7d",
    "gemma-tied/q4": "21 9a650f7ba6cdc15bd2c45aba",
    "gemma2-softcap/bf16": "21 55e9f10ef5a8b3270894ba7d",
    "gemma2-softcap/q4": "21 9a650f7ba6cdc15bd2c45aba",
    "gemma3_text-linear/bf16": "21 55e9f10ef5a8b3270894ba7d",
    "gemma3_text-linear/q4": "21 9a650f7ba6cdc15bd2c45aba",
    "gemma3_text-default/bf16": "21 b9d832fb0603987605859d5a",
    "gemma3_text-default/q4": "21 5bce9df8194d8b46b8ef0eee",
    "lfm2-hybrid/bf16": "29 bafce455cc7b345f08313d8b",
    "lfm2-hybrid/q4": "29 d86d7f202a1ee2298c97da07",
    "lfm2-bias/bf16": "18 ef5d1690a1228a846b549c56",
    "lfm2-bias/q4": "18 730779b613a4c9fd96239974",
    "lfm2_moe-bias/bf16": "29 bd38fa401083f6863ab6fbbe",
    "lfm2_moe-bias/q4": "29 6f997004d37838956c838523",
    "lfm2_moe-plain/bf16": "24 cc9f468b66db7e77655c71de",
    "lfm2_moe-plain/q4": "24 5742d817f252d6c3ab7c87b7",
    "qwen3_next-moe/bf16": "46 d1838b10665f5e7593d05644",
    "qwen3_next-moe/q4": "46 65355c706d12c9ed90830fd4",
    "qwen3_next-dense/bf16": "29 1ae48922b1e9f5023d4e38d6",
    "qwen3_next-dense/q4": "29 629b992654acdb948815399a",
    "qwen3_5-dense/bf16": "31 0d28cf5f0510cb0ed51e36c9",
    "qwen3_5-dense/q4": "31 dfbd387476739df46347cd8a",
    "qwen3_5-moe/bf16": "64 bc49041dfaa302a88760a10c",
    "qwen3_5-moe/q4": "64 14347ff736b3c61e7f97a144",
    "mamba2-groups/bf16": "7 0c833fb5c5a2538de1f077b3",
    "mamba2-groups/q4": "7 165bf977bb09a14eaae0e2bf",
    "mamba2-tied/bf16": "0 4f53cda18c2baa0c0354bb5f",
    "mamba2-tied/q4": "0 4f53cda18c2baa0c0354bb5f",
    "granitemoehybrid-moe/bf16": "34 7baec305ced348c7b88f43f4",
    "granitemoehybrid-moe/q4": "34 4e7d1de3cf3f756840fe601e",
    "granitemoehybrid-dense/bf16": "7 1cd0206139fd098512501761",
    "granitemoehybrid-dense/q4": "7 1d3d8b1cf96b1a7aae431105",
    "nemotron_h-hybrid/q4": "11 3340372e49ac5355f820fe3f",
    "nemotron_h-latent/q4": "5 48c62f9d4564cc38f6c39fe9",
    "jamba-moe/bf16": "28 c18db291fd424b460603119c",
    "jamba-moe/q4": "28 0ec0a1f4c269f235707c125d",
    "jamba-tied/bf16": "24 4a71ede51ffbd49cbf1399fb",
    "jamba-tied/q4": "24 164216cd5eb9585ab91147e8",
    "falcon_h1-default/bf16": "31 617cc0ded75181a70f482b1e",
    "falcon_h1-default/q4": "31 42d73ee3e2ae5338f82d6cd4",
    "falcon_h1-rmsnorm/bf16": "0 4f53cda18c2baa0c0354bb5f",
    "falcon_h1-rmsnorm/q4": "0 4f53cda18c2baa0c0354bb5f",
    "cohere-default/bf16": "21 52efea63aca5229a4dfb3002",
    "cohere-default/q4": "21 a3f0ef00ef8e6468ccb1db7b",
    "cohere-qknorm/bf16": "9 66823211239ea5835fc3e05b",
    "cohere-qknorm/q4": "9 50e651cf89df421241863e67",
    "glm4-partial/bf16": "10 f2f4a06b2fb879914595b01a",
    "glm4-partial/q4": "10 dd1f86f92ae0d4853a2bc10b",
    "deepseek_v2-lite/bf16": "27 26c85927e70ab1f9c175ec6d",
    "deepseek_v2-lite/q4": "27 9c7f49e55798315c08a6f514",
    "deepseek_v2-qlora/bf16": "28 6cbbb45cc998ae807cef9ce5",
    "deepseek_v2-qlora/q4": "28 82052bec24d323b494153c8d",
    "kimi_linear-moe/bf16": "46 eab3be58eba8d91c05dd9c46",
    "kimi_linear-moe/q4": "46 03d4a6d8e4f6ae37f08d50a6",
    "kimi_linear-qlora/bf16": "36 8f8a1a4fde4c173377c00d2e",
    "kimi_linear-qlora/q4": "36 a8d49e83961218cf96d8a668",
    "gpt_oss-yarn/bf16": "4 118e2972354aa78059aac63a",
    "gpt_oss-yarn/q4": "4 41ef946eadc19369dc3ec144",
    "gpt_oss-mxfp4/bf16": "4 118e2972354aa78059aac63a",
    "gpt_oss-mxfp4/q4": "4 41ef946eadc19369dc3ec144",
    "exaone4-hybrid/bf16": "29 06eb80b2d646c244a077a480",
    "exaone4-hybrid/q4": "29 358bf3aee31906692044bc3a",
    "exaone4-global/bf16": "14 fafabdaed18be4621a21159b",
    "exaone4-global/q4": "14 a9f7b7dad02a881cc1b7d34b",
    "gpt2-tied/bf16": "0 4f53cda18c2baa0c0354bb5f",
    "gpt2-tied/q4": "0 4f53cda18c2baa0c0354bb5f",
    "gpt2-layerscale/bf16": "1 575c54adacf0039611a97b20",
    "gpt2-layerscale/q4": "1 4b592722ae470ee0b28364e9",
    "bailing_hybrid-moe/bf16": "38 c575bff0937b16fe90aac27a",
    "bailing_hybrid-moe/q4": "38 e32011cc4ea8a6a0d0d63ee1",
    "bailing_hybrid-softplus/bf16": "27 274d59be04eb4679d12eda50",
    "bailing_hybrid-softplus/q4": "27 a67c69e5f60a6d2c56175d28",
    "qwen3-4b/bf16": "4 801b620dbc8de12a0b03c87a",
    "qwen3-4b/bf16/unchained": "6 edd44a73866915542be37cda",
    "qwen3-4b/bf16/no-route-experts": "4 801b620dbc8de12a0b03c87a",
    "qwen3-4b/q4": "4 63afd978e7149a301073ac09",
    "qwen3-4b/q4/unchained": "6 b058a97ee37707022789152b",
    "qwen3-4b/q4/no-route-experts": "4 63afd978e7149a301073ac09",
    "qwen3-0.6b/bf16": "4 114ccbdcc9f1caf6ef73ce2a",
    "qwen3-0.6b/q4": "5 c30b8e0ba19a5870bd70179c",
    "llama3.2-1b/bf16": "5 5a6ffc664f60a0780880617d",
    "llama3.2-1b/q4": "5 0a2a4e56d55ed0093e38a999",
    "smollm2-135m/bf16": "5 74355d15db883768e5fb34b4",
    "smollm2-135m/q4": "5 bfcb3e4768bb6d5c20aeb032",
    "qwen3-30b-a3b/bf16": "3 e7dfd08f40ab95b36e085ef7",
    "qwen3-30b-a3b/q4": "3 8e5d9d9265b5a97ca0d6abc5",
    "qwen3-30b-a3b/q4/unchained": "7 fb5ede35124fdb97f987f354",
    "qwen3-30b-a3b/q4/no-route-experts": "4 c84cb62483c233be439d4a4e",
    "olmoe-1b-7b/bf16": "9 031dfb272ee0318ad7122d3b",
    "olmoe-1b-7b/q4": "9 cb956830498eefe12c7e8067",
}


@pytest.mark.parametrize("case", cases())
def test_cuda_binds_the_pinned_launches(case: str, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    record = launches(case, monkeypatch, tmp_path)
    _dump("launches", case, record)
    assert launch_digest(record) == PINNED_LAUNCHES[case]


def main() -> None:
    """Print every digest, for pasting into PINNED_*."""
    import tempfile

    patch = pytest.MonkeyPatch()
    tmp = Path(tempfile.mkdtemp(prefix="omnia-pin-"))
    print("PINNED_LAUNCHES: dict[str, str] = {")
    for case in cases():
        print(f'    "{case}": "{launch_digest(launches(case, patch, tmp))}",')
    print("}")


if __name__ == "__main__":
    main()
