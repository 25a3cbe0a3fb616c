"""`servelm bench allreduce`: cost and error of each all-reduce mode per message size.

Spawns `--world-size` rank processes over gloo on this host (the same
`init_distributed` the server uses) and times plain, deterministic and quick
(fp/int8/int6/int4) all-reduces of 16 KB .. 16 MB fp32 messages.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
from typing import Any

import torch

DEFAULT_SIZES = "16K,64K,256K,1M,4M,16M"
DEFAULT_MODES = "none,deterministic,fp,int8,int6,int4"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_size(text: str) -> int:
    """"16K" / "4M" / "1024" -> bytes (powers of 1024)."""
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def _rank_main(rank: int, ws: int, addr: str, sizes: list[int], modes: list[str], iters: int, dtype: str,
               threads: int, out: Any) -> None:
    from servelm.distributed.parallel_state import destroy_distributed, init_distributed
    from servelm.distributed.quick_allreduce import bench_all_reduce

    torch.set_num_threads(threads)
    init_distributed(ws, rank, addr, timeout_s=300)
    try:
        rows = bench_all_reduce(sizes, modes, iters=iters, dtype=_DTYPES[dtype])
        if rank == 0:
            out.put(rows)
    finally:
        destroy_distributed()


def run(world_size: int, sizes: list[int], modes: list[str], iters: int, dtype: str = "float32",
        threads: int = 1) -> list[dict[str, Any]]:
    """Spawn the ranks, run the benchmark, return rank 0's rows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, addr, sizes, modes, iters, dtype, threads, out),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                rows = out.get(timeout=1.0)
                break
            except Exception as err:  # queue.Empty: check nobody died
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a benchmark rank failed: "
                                       f"exit codes {[p.exitcode for p in procs]}") from err
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point; prints one table row per (size, mode)."""
    parser = argparse.ArgumentParser(prog="servelm bench allreduce", description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"Message sizes (default {DEFAULT_SIZES}).")
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"Modes (default {DEFAULT_MODES}).")
    parser.add_argument("--iters", type=int, default=10, help="Timed calls per point; the median is reported.")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank.")
    parser.add_argument("--json", default=None, help="Append the rows as JSON lines to this file.")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    rows = run(args.world_size, sizes, modes, args.iters, args.dtype, args.threads)
    print(f"all-reduce, world size {args.world_size}, {args.dtype}, median of {args.iters}")
    print(f"{'bytes':>10} {'mode':>13} {'us':>10} {'GB/s':>7} {'max rel err':>12}")
    for r in rows:
        print(f"{r['bytes']:>10} {r['mode']:>13} {r['us']:>10.0f} {r['gbps']:>7.2f} {r['max_rel_err']:>12.2e}")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"world_size": args.world_size, "dtype": args.dtype, **r}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
