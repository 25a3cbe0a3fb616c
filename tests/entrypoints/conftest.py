"""Fixtures shared by the entrypoint test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_fixtures import ServerProcess, start_server

# The KV pool of `parity_server`: small enough that four ~150-token requests at once make the scheduler
# retract (the preemption metric), large enough for every other request of its tests.
PARITY_KV_TOKENS = 512


@pytest.fixture(scope="session")
def parity_server(tiny_llama: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One `servelm serve` on the tiny random Llama (served as `tiny`) for the API-parity modules
    (test_endpoints_parity.py, test_responses_api.py): one start-up instead of one per module."""
    model_dir, _ = tiny_llama
    log = tmp_path_factory.mktemp("parity") / "server.log"
    srv = start_server(["--model-path", str(model_dir), "--disable-torch-compile", "--max-total-tokens",
                        str(PARITY_KV_TOKENS), "--served-model-name", "tiny"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
