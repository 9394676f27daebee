"""The ``kube_api`` fixture: a fresh emulated Kubernetes API server per test.

    from tests.kube.fixtures import kube_api  # noqa: F401

    def test_x(kube_api: KubeAPI) -> None:
        kube_api.kubectl("apply", "-f", "crds/", cwd=REPO_ROOT)

The server is stopped after the test; the test then fails if the server itself raised (a bug of the
emulator rather than an API error such as 404).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube.api_server import KubeAPI

REPO_ROOT = Path(__file__).resolve().parents[2]
CRDS_DIR = Path(__file__).resolve().parent / "crds"


@pytest.fixture
def kube_api(tmp_path: Path) -> Iterator[KubeAPI]:
    api = KubeAPI(tmp_path / "kube-api").start()
    try:
        yield api
    finally:
        api.stop()
    if api.internal_errors:
        raise AssertionError(f"the emulated API server failed internally: {api.internal_errors!r}")
