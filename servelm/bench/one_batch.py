"""`servelm bench one-batch`: prefill and decode latency/throughput of one static batch.

Drives the real scheduler in-process (the same code path as the server),
optionally next to transformers' `generate` on the same weights. The step
budget and running limit are raised to the largest batch, so the whole batch
is prefilled in one step and then decodes together, as transformers does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from servelm.bench.common import (
    build_parser,
    hf_generate_seconds,
    hf_prefill_and_decode,
    load_hf_baseline,
    median_of,
    memory_bandwidth_gbs,
    random_prompts,
)
from servelm.config import ServerArgs
from servelm.cpu_threads import describe_threads
from servelm.entrypoints.engine import Engine
from servelm.managers.io_struct import GenerateReq


def run_once(engine: Engine, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    sched = engine.scheduler
    engine.flush_cache()
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    assert sched.config.chunked_prefill_size >= sum(map(len, prompts)), "one-batch needs a one-step prefill"
    for i, p in enumerate(prompts):
        sched.add_request(GenerateReq(f"b{i}", p, params))
    produced = {f"b{i}": 0 for i in range(len(prompts))}
    t0 = time.perf_counter()
    while min(produced.values()) == 0:
        for out in engine.step():
            produced[out.rid] += len(out.token_ids)
        # Non-streaming requests report at the end; count the first token from the scheduler itself.
        for r in sched.running:
            produced[r.rid] = max(produced[r.rid], len(r.output_ids))
    t1 = time.perf_counter()
    steps = 0
    while sched.has_work():
        engine.step()
        steps += 1
    t2 = time.perf_counter()
    bs = len(prompts)
    return {"prefill_s": t1 - t0, "prefill_tok_s": sum(map(len, prompts)) / (t1 - t0),
            "decode_step_ms": (t2 - t1) / max(steps, 1) * 1e3,
            "decode_tok_s": bs * (output_len - 1) / (t2 - t1)}


@contextlib.contextmanager
def competing_load(processes: int) -> Iterator[None]:
    """`processes` other processes each burning one core for the duration: a busy shared machine or CI runner.

    Plain Python busy loops, so they compete for CPU time only (not memory bandwidth), as
    the other test processes on a shared runner mostly do between their own forwards.
    """
    procs = [subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"]) for _ in range(processes)]
    try:
        time.sleep(0.3)  # let them start spinning (and the kernel spread them) before measuring
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def idle_and_busy(runs: int, processes: int, fn: Callable[[], dict[str, float]]) -> tuple[dict[str, float],
                                                                                          dict[str, float]]:
    """Medians of `runs` idle and `runs` busy runs, interleaved so that drifts of the machine hit both."""
    idle, busy = [], []
    for _ in range(runs):
        idle.append(fn())
        with competing_load(processes):
            busy.append(fn())
    def medians(results: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in results) for k in results[0]}

    return medians(idle), medians(busy)


def profile_decode(engine: Engine, prompts: list[list[int]], steps: int = 8) -> str:
    """torch.profiler table (self CPU time by op) of `steps` decode steps at this batch size."""
    from torch.profiler import ProfilerActivity, profile

    sched = engine.scheduler
    engine.flush_cache()
    for i, p in enumerate(prompts):
        sched.add_request(GenerateReq(f"p{i}", p, {"max_new_tokens": steps + 2, "temperature": 0,
                                                    "ignore_eos": True}))
    while any(not r.output_ids for r in sched.running) or sched.waiting:
        sched.step()
    assert len(sched.running) == len(prompts)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            sched.step()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    while sched.has_work():
        sched.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return (f"profile of {steps} decode steps at batch {len(prompts)} (self CPU time by op; "
            f"{wall_ms:.1f} ms/step wall clock under the profiler):\n{table}")


def main(argv: list[str]) -> int:
    parser = build_parser("servelm bench one-batch", __doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--profile", action="store_true",
                        help="Also print where one decode step's time goes, by op (torch.profiler).")
    parser.add_argument("--competing-load", type=int, default=0, metavar="N",
                        help="Also measure with N other processes each burning a core (a busy machine), "
                             "interleaved with the idle runs; reports both and their ratio.")
    ns = parser.parse_args(argv)
    args = ServerArgs.from_namespace(ns)
    biggest = max(ns.batch_size)
    args = dataclasses.replace(args, chunked_prefill_size=max(args.chunked_prefill_size or 0, biggest * ns.input_len),
                               max_running_requests=max(args.max_running_requests, biggest))
    engine = Engine(args)
    runner = engine.scheduler.runner
    hf = load_hf_baseline(ns.model_path, runner.device, runner.dtype) if ns.baseline == "hf" else None
    bw = memory_bandwidth_gbs(device=runner.device)
    weight_bytes = runner.weight_bytes  # resident: fp32 (pre-packed) or quantised blocks
    graphs = getattr(runner, "decode_graphs", None)
    print(f"model {runner.model_path}  device {runner.device}  fast_path={runner.fast_path}  "
          f"cuda graphs {'up to batch ' + str(graphs.max_bs) if graphs is not None else 'off'}  "
          f"quantization={args.quantization}  "
          f"weights {weight_bytes / 1e6:.0f} MB  memory bandwidth {bw:.1f} GB/s\n"
          f"{describe_threads(engine.cpu_threads)}")
    for bs in ns.batch_size:
        prompts = random_prompts(bs, ns.input_len, engine.scheduler.vocab_size, ns.seed)
        run_once(engine, prompts, min(ns.output_len, 4))  # warm-up
        spec = engine.scheduler.spec
        spec_before = spec.info() if spec is not None else {}
        once = lambda: run_once(engine, prompts, ns.output_len)  # noqa: B023, E731
        if ns.competing_load:
            res, busy = idle_and_busy(ns.runs, ns.competing_load, once)
        else:
            res = median_of(ns.runs, once)
        line = (f"batch {bs:3d}  in {ns.input_len}  out {ns.output_len}  prefill {res['prefill_s'] * 1e3:8.1f} ms "
                f"({res['prefill_tok_s']:7.1f} tok/s)  decode {res['decode_step_ms']:7.1f} ms/step "
                f"({res['decode_tok_s']:7.1f} tok/s)")
        if bs == 1:
            res["bandwidth_fraction"] = weight_bytes / (res["decode_step_ms"] / 1e3) / 1e9 / bw
            line += f"  {res['bandwidth_fraction'] * 100:.0f}% of the weights' bandwidth limit"
        if ns.competing_load:
            res.update({f"busy_{k}": v for k, v in busy.items()})
            res["busy_decode_ratio"] = busy["decode_tok_s"] / res["decode_tok_s"]
            line += (f"\n           with {ns.competing_load} competing process(es): prefill "
                     f"{busy['prefill_s'] * 1e3:8.1f} ms  decode {busy['decode_step_ms']:7.1f} ms/step "
                     f"({busy['decode_tok_s']:7.1f} tok/s)  -> x{res['busy_decode_ratio']:.2f} of idle")
        if hf is not None:
            hf_generate_seconds(hf, prompts, 2)  # warm-up

            def hf_once() -> dict[str, float]:
                pre, decode = hf_prefill_and_decode(hf, prompts, ns.output_len)  # noqa: B023
                return {"prefill_s": pre, "decode_tok_s": bs * (ns.output_len - 1) / decode}  # noqa: B023

            ref = median_of(ns.runs, hf_once)
            res.update({f"hf_{k}": v for k, v in ref.items()})
            res["decode_speedup"] = res["decode_tok_s"] / ref["decode_tok_s"]
            line += (f"\n           transformers: prefill {ref['prefill_s'] * 1e3:8.1f} ms  decode "
                     f"{ref['decode_tok_s']:7.1f} tok/s  -> servelm decode x{res['decode_speedup']:.2f}")
        print(line, flush=True)
        if spec is not None:  # the measured runs of this batch size
            from servelm.bench.serving import speculation_delta

            d = speculation_delta(spec_before, spec.info())
            mean = d["spec_decode_mean_acceptance_length"]
            print(f"           speculative decoding ({spec.config.algorithm}): {d['spec_decode_num_drafts']} drafts, "
                  f"{d['spec_decode_num_accepted_tokens']} of {d['spec_decode_num_draft_tokens']} draft tokens "
                  f"accepted, mean acceptance length {mean:.2f}" if mean else
                  f"           speculative decoding ({spec.config.algorithm}): no drafts", flush=True)
        if ns.profile:
            print(profile_decode(engine, prompts), flush=True)
        if ns.json:
            with open(ns.json, "a") as fh:
                fh.write(json.dumps({"bench": "one-batch", "batch_size": bs, "input_len": ns.input_len,
                                     "output_len": ns.output_len, "competing_load": ns.competing_load,
                                     "num_threads": engine.cpu_threads.num_threads,
                                     "wait_policy": engine.cpu_threads.wait_policy, **res}) + "\n")
    engine.shutdown()
    return 0
