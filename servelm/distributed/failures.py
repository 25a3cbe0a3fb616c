"""Telling a TP rank's death apart from its consequences.

When one rank dies, every other rank's pending collective fails too
("Connection reset by peer", "Connection closed by peer"). Those are
consequences: the logs must name the rank that died, once, and not drown it
in tracebacks of the others. So:

* a follower whose collective fails exits with `PEER_LOST_EXIT_CODE` after
  one short line, so rank 0 can tell it from the rank that really died;
* rank 0 turns a failed collective into `TPFailure` once it has named the dead
  rank (`TPWorkers.report_death`), and the scheduler exits without a traceback.

Torch-free at import time: the scheduler process imports this on its crash path.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

# Exit code of a follower that stopped because a collective failed (a peer died or stopped
# answering): not the cause of the failure, only a witness of it.
PEER_LOST_EXIT_CODE = 3


class TPFailure(RuntimeError):
    """A TP step failed because a rank died; the message names it and has already been logged."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` came out of a torch.distributed collective (so a peer died, hung or left).

    gloo reports a lost peer as a plain RuntimeError, so the type alone cannot tell it from
    a bug in the model code: where it was raised can. The innermost frame of a failed
    collective is in torch.distributed (the C++ error surfaces from `work.wait()` there).
    """
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).parent == Path(dist.__file__).parent


def describe_exit(exitcode: int) -> str:
    """'exit code 1', or 'exit code -9 / killed by SIGKILL' for a process ended by a signal."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    return f"exit code {exitcode} / killed by {name}"


# gloo prefixes its messages with the C++ source location: "[/.../gloo/transport/tcp/pair.cc:537] ".
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*:\d+\]\s*")


def first_line(exc: BaseException, limit: int = 160) -> str:
    """`Type: message`, first line only, without gloo's source location, at most `limit` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {_SOURCE_LOCATION.sub('', lines[0]) if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# gloo names the peer of a failed pair in its message: "Read error [10.0.0.2]:52891: Connection reset by peer".
_PEER = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")


def describe_remote_failure(exc: BaseException, peer_addresses: list[str] | None, ranks_per_node: int,
                            own_rank: int = 0) -> str:
    """The one line for a collective that failed because a rank on another node died or stopped answering:
    which node and ranks, from the peer address in gloo's message (or, when it names none, as after a
    timeout, the only other node there is) and the addresses the ranks announced at start-up
    (`TPGroup.peer_addresses`)."""
    match = _PEER.search(str(exc))
    ip = match.group(1) if match else None
    per_node = max(1, ranks_per_node)
    if ip is None and peer_addresses:
        others = {a for r, a in enumerate(peer_addresses) if r // per_node != own_rank // per_node}
        ip = others.pop() if len(others) == 1 else None
    ranks = [r for r, a in enumerate(peer_addresses or []) if ip is not None and a == ip]
    if ranks:
        who = f"TP rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on node " \
              f"{ranks[0] // per_node} ({ip})"
    else:
        who = f"a TP rank on another node{f' ({ip})' if ip else ''}"
    return f"{who} died or stopped answering ({first_line(exc)}); shutting down"
