"""`servelm bench verify-step`: what a speculative verify step of k draft tokens costs against a decode step.

One request at a time, in-process (the server's scheduler and kernels): a prompt of --context-len random tokens,
then --steps timed steps with k forced random draft tokens a step (k = 0: plain decode). Random drafts are
rejected (almost) always, so every verify step runs k + 1 rows at about the same context, as a step whose draft
misses does; what it costs does not depend on the drafts' values. The values of k alternate within each round, so
that a drifting machine (memory bandwidth, other tenants) hits them alike; each round gives the median step time
of each k, and the report gives the medians over the rounds and each k's ratio to decode (k = 0).

Speculative decoding pays when a step's accepted tokens outweigh this ratio: the ngram proposer's acceptance
length over the verify cost (docs/speculative-decoding.md).
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import sys
import time
from typing import Any

from servelm.bench.common import build_parser, random_prompts
from servelm.config import ServerArgs
from servelm.cpu_threads import describe_threads
from servelm.entrypoints.engine import Engine
from servelm.managers.io_struct import GenerateReq


class ForcedDrafts:
    """Stands in for the scheduler's proposer's `propose`: `k` random token ids a step (fewer where the request's
    output or context leaves less room), never paused."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.k = 0
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(self, state: Any, context: list[int], limit: int, decoding: int = 1) -> list[int]:
        return [self.rng.randrange(100, self.vocab_size) for _ in range(min(self.k, limit))]


def step_times(engine: Engine, prompt: list[int], steps: int, k: int, rid: str) -> list[float]:
    """Seconds of each of `steps` scheduler steps after the prompt's (one request, greedy, eos ignored), with
    room left in its output for k draft tokens in every one of them."""
    sched = engine.scheduler
    sched.add_request(GenerateReq(rid, prompt, {"max_new_tokens": steps + k + 2, "temperature": 0,
                                               "ignore_eos": True}))
    while sched.waiting or any(not r.output_ids for r in sched.running):
        engine.step()  # the prompt (in chunks if it is long)
    times = []
    while sched.has_work() and len(times) < steps:
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while sched.has_work():
        engine.step()
    return times


def main(argv: list[str]) -> int:
    parser = build_parser("servelm bench verify-step", __doc__.splitlines()[0])
    parser.add_argument("--num-draft-tokens", type=int, nargs="+", default=[4],
                        help="Values of k to verify (each against k = 0, which is always run).")
    parser.add_argument("--context-len", type=int, default=128, help="Tokens of the request's prompt.")
    parser.add_argument("--steps", type=int, default=30, help="Timed steps of each k in a round.")
    ns = parser.parse_args(argv)
    ks = sorted({0, *ns.num_draft_tokens})
    if ks[0] < 0 or ns.steps < 1 or ns.context_len < 1:
        parser.error("--num-draft-tokens must be >= 0, --steps and --context-len >= 1")
    args = ServerArgs.from_namespace(ns)
    # Verify steps need a proposer; which one does not matter, its drafts are replaced below.
    args = dataclasses.replace(args, speculative_algorithm=args.speculative_algorithm or "ngram",
                               speculative_num_draft_tokens=max(ks[-1], 1),
                               chunked_prefill_size=max(args.chunked_prefill_size or 0, ns.context_len))
    engine = Engine(args)
    sched = engine.scheduler
    if sched.spec is None:  # an embedding model: nothing decodes
        engine.shutdown()
        print("servelm bench verify-step: the model does not generate (an embedding model has no decode steps)",
              file=sys.stderr)
        return 2
    sched.spec.guard = None  # no switching off: every step drafts
    forced = ForcedDrafts(sched.vocab_size, ns.seed)
    sched.spec.propose = forced.propose
    prompt = random_prompts(1, ns.context_len, sched.vocab_size, ns.seed)[0]
    runner = sched.runner
    print(f"model {runner.model_path}  device {runner.device}  context {ns.context_len} tokens  "
          f"{ns.steps} steps a k a round, {ns.runs} rounds\n{describe_threads(engine.cpu_threads)}", flush=True)
    forced.k = ks[-1]
    step_times(engine, prompt, 3, forced.k, "warm-up")
    rounds: dict[int, list[float]] = {k: [] for k in ks}
    drafts = {k: [0, 0] for k in ks}  # verify steps and draft tokens of each k (the proposer's counters)
    for r in range(ns.runs):
        for k in ks:
            forced.k = k
            before = (sched.spec.num_drafts, sched.spec.num_draft_tokens)
            times = step_times(engine, prompt, ns.steps, k, f"r{r}k{k}")
            drafts[k][0] += sched.spec.num_drafts - before[0]
            drafts[k][1] += sched.spec.num_draft_tokens - before[1]
            rounds[k].append(statistics.median(times) * 1e3)
        print(f"round {r + 1}: " + "  ".join(f"k={k} {rounds[k][-1]:.2f}" for k in ks) + " ms/step", flush=True)
    decode = statistics.median(rounds[0])
    result: dict[str, Any] = {"bench": "verify-step", "context_len": ns.context_len, "steps": ns.steps,
                              "rounds": ns.runs, "num_threads": engine.cpu_threads.num_threads,
                              "decode_step_ms": decode, "verify_step_ms": {}, "ratio": {},
                              "verify_steps": {k: n for k, (n, _) in drafts.items()},
                              "draft_tokens": {k: t for k, (_, t) in drafts.items()}}
    print(f"decode (k=0): {decode:.2f} ms/step")
    for k in ks[1:]:
        ms = statistics.median(rounds[k])
        per_round = [v / d for v, d in zip(rounds[k], rounds[0], strict=True)]
        result["verify_step_ms"][k] = ms
        result["ratio"][k] = ms / decode
        print(f"verify k={k} ({k + 1} rows): {ms:.2f} ms/step  x{ms / decode:.2f} of decode  "
              f"(round by round x{min(per_round):.2f}-x{max(per_round):.2f})", flush=True)
    if ns.json:
        with open(ns.json, "a") as fh:
            fh.write(json.dumps(result) + "\n")
    engine.shutdown()
    return 0
