"""`servelm bench deterministic`: does a running server give the same output whatever the batch?

Sends the same prompts many times inside different concurrent batches to a
server's native `POST /generate` and counts distinct outputs per prompt. An
output is the generated token ids together with their logprobs (compared
bitwise), so a batch-dependent rounding difference shows up even when it does
not flip a token. With `--enable-deterministic-inference` every prompt should
report `Unique samples: 1`.

Modes:
  single  one prompt, sent in batches of 1..N requests (the others random prompts)
  mixed   short and long prompts mixed in random concurrent batches
  prefix  after POST /flush_cache, random batches of prefixes of one long prompt
          (so later requests find earlier ones' prefixes in the radix cache)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
from collections import defaultdict
from typing import Any

import httpx

_TOPICS = ["the ocean", "a small robot", "mountains in winter", "the history of tea", "a lost key", "quantum bits",
           "a city at night", "bread baking", "an old lighthouse", "the moon landing", "a chess endgame",
           "desert foxes", "a jazz trio", "paper airplanes", "the northern lights", "a busy kitchen"]
_SINGLE_PROMPT = "Write a short story about a cat who learns to play the piano."
_SHORT_PROMPTS = ["Hello, my name is", "The capital of France is", "List three colours:"]
_LONG_PROMPTS = [
    "Here is a long passage about rivers. " + " ".join(
        f"River number {i} flows through valley {i * 7 % 13} and joins the sea near town {i * 3 % 11}."
        for i in range(24)) + " Summarise the passage:",
    "Explain step by step how a compiler turns source code into machine code, covering lexing, parsing, "
    "semantic analysis, intermediate representations, optimisation passes, register allocation, instruction "
    "selection and linking, with an example for each stage. " * 3,
]
_PREFIX_PROMPT = " ".join(f"Sentence {i}: the quick brown fox number {i} jumps over lazy dog {i * 5 % 17}."
                          for i in range(30))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="servelm bench deterministic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000", help="The server (default: %(default)s).")
    parser.add_argument("--mode", choices=["single", "mixed", "prefix"], default="single",
                        help="Which batches to send (see above; default: %(default)s).")
    parser.add_argument("--n-trials", type=int, default=50,
                        help="single: the largest batch (batches of 1..N); mixed/prefix: number of batches.")
    parser.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (default: 0).")
    parser.add_argument("--seed", type=int, default=None,
                        help="Sampling seed sent with every request (default: none, i.e. the server's).")
    parser.add_argument("--max-tokens", type=int, default=32, help="Tokens generated per request.")
    parser.add_argument("--rng-seed", type=int, default=0, help="Seed of the harness's own batch choices.")
    parser.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout in seconds.")
    return parser


class Harness:
    """Sends concurrent /generate requests and tallies each prompt's distinct outputs."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.rng = random.Random(ns.rng_seed)
        self.samples: dict[str, list[tuple]] = defaultdict(list)
        self.labels: list[str] = []

    def _params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"max_new_tokens": self.ns.max_tokens, "temperature": self.ns.temperature,
                             "ignore_eos": True, "logprobs": True}
        if self.ns.seed is not None:
            p["seed"] = self.ns.seed
        return p

    async def _one(self, client: httpx.AsyncClient, prompt: str | list[int]) -> tuple:
        body: dict[str, Any] = {"sampling_params": self._params()}
        body["input_ids" if isinstance(prompt, list) else "text"] = prompt
        resp = await client.post("/generate", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"/generate answered {resp.status_code}: {resp.text[:500]}")
        out = resp.json()
        logprobs = out.get("meta_info", {}).get("output_token_logprobs") or []  # SGLang's [logprob, id, text]
        return tuple(out["output_ids"]), tuple(entry[0] for entry in logprobs)

    async def batch(self, client: httpx.AsyncClient, items: list[tuple[str | None, str | list[int]]]) -> None:
        """Send all items at once; record the outputs of those with a label."""
        results = await asyncio.gather(*(self._one(client, prompt) for _, prompt in items))
        for (label, _), result in zip(items, results):
            if label is not None:
                if label not in self.samples:
                    self.labels.append(label)
                self.samples[label].append(result)

    def report(self) -> bool:
        """Print one line per prompt; True when every prompt gave a single distinct output."""
        ok = True
        for label in self.labels:
            outs = self.samples[label]
            unique = len(set(outs))
            ok = ok and unique == 1
            print(f"{label}: Total samples: {len(outs)}, Unique samples: {unique}", flush=True)
        return ok

    def _filler(self) -> str:
        return f"Tell me something about {self.rng.choice(_TOPICS)} in {self.rng.randint(1, 9)} sentences."

    async def run(self) -> bool:
        ns = self.ns
        async with httpx.AsyncClient(base_url=ns.base_url, timeout=ns.timeout) as client:
            if ns.mode == "single":
                for size in range(1, ns.n_trials + 1):
                    items: list[tuple[str | None, str | list[int]]] = [(None, self._filler()) for _ in range(size - 1)]
                    items.insert(self.rng.randrange(size), ("Prompt 0 (single)", _SINGLE_PROMPT))
                    await self.batch(client, items)
            elif ns.mode == "mixed":
                prompts = [(f"Prompt {i} (short)", p) for i, p in enumerate(_SHORT_PROMPTS)]
                prompts += [(f"Prompt {len(prompts) + i} (long)", p) for i, p in enumerate(_LONG_PROMPTS)]
                for _ in range(ns.n_trials):
                    items = [prompts[self.rng.randrange(len(prompts))] for _ in range(self.rng.randint(1, 8))]
                    await self.batch(client, items)
            else:
                resp = await client.post("/flush_cache")
                if resp.status_code != 200:
                    raise RuntimeError(f"/flush_cache answered {resp.status_code}: {resp.text[:300]}")
                tok = await client.post("/v1/tokenize", json={"prompt": _PREFIX_PROMPT})
                ids = tok.json()["tokens"]
                cuts = sorted({max(1, len(ids) * k // 4) for k in range(1, 5)})
                prefixes = [(f"Prompt {i} (prefix of {c} tokens)", ids[:c]) for i, c in enumerate(cuts)]
                for _ in range(ns.n_trials):
                    items = [prefixes[self.rng.randrange(len(prefixes))] for _ in range(self.rng.randint(1, 6))]
                    await self.batch(client, items)
        return self.report()


def main(argv: list[str]) -> int:
    """Run the harness against --base-url; exit 0 when it ran (the verdict is in the printed lines)."""
    ns = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the report
    if ns.n_trials < 1:
        print("--n-trials must be >= 1")
        return 2
    try:
        deterministic = asyncio.run(Harness(ns).run())
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"error: {exc}")
        return 1
    print(f"Deterministic: {'yes' if deterministic else 'no'}", flush=True)
    return 0
