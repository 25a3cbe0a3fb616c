"""`ServerState`: what the endpoints share (configuration, the tokenizer manager, lifecycle flags), in a module
of its own so that the serving classes can name it without importing the app that holds them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from servelm.config import ServerArgs
from servelm.entrypoints.http_common import ServerLifecycle
from servelm.managers.tokenizer_manager import TokenizerManager
from servelm.metrics import ServerMetrics


@dataclass
class ServerState(ServerLifecycle):
    """What the endpoints share: configuration, the tokenizer manager and lifecycle flags."""

    server_args: ServerArgs
    model_name: str
    manager: TokenizerManager
    metrics: ServerMetrics
    started_at: float = field(default_factory=time.monotonic)
    proc: Any = None  # the scheduler process (under --dp-size, replica 0's)
    ready_reader: Connection | None = None
    replicas: list[Any] = field(default_factory=list)  # launch.Replica under --dp-size, else empty
    from_scheduler: str = ""  # the address every scheduler process sends its outputs to
    stop_event: threading.Event = field(default_factory=threading.Event)

    @property
    def api_key(self) -> str | None:
        return self.server_args.api_key

    def on_fail(self, message: str) -> None:
        self.manager.fail_all(message)
