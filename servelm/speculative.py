"""Speculative decoding: where the proposals come from, and how many to make.

A decoding request whose recent tokens also appear earlier in its own context (`ngram`, vLLM's prompt
lookup), or in the prompts and outputs of recent requests (`suffix`), is given the tokens that followed that
earlier occurrence as a draft. The scheduler then feeds the request's last token and the draft as k + 1 decode
rows of one ordinary step (row j attends to the context plus the draft's first j tokens) and samples every
row. The model's own token at each position decides: a draft token is accepted while it equals the token the
model drew there, and the first one that differs is replaced by the model's. With the sampler's per-position
seeded draws (servelm.layers.sampler), this is exact rejection sampling for a one-point draft distribution:
accepting d with probability p(d) and otherwise drawing from p without d is what "draw from p, keep d if it
came out" does. So the output is the one without speculation, token for token, at any temperature.

A draft model (`draft`) proposes greedily instead (servelm.model_executor.draft, attached to the Proposer by
the scheduler's builder): its tokens are one-point proposals too, verified the same way.

Torch-free: the scheduler's unit tests use it without a model.
"""

from __future__ import annotations

import json
from array import array
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from servelm.dataclass_flags import ConfigError

ALGORITHMS = ("ngram", "suffix", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """What `--speculative-*` asked for (see ServerArgs)."""

    algorithm: str  # "ngram", "suffix" or "draft"
    num_draft_tokens: int = 4  # most draft tokens a request gets per step (k)
    min_match: int = 2  # shortest run of recent tokens that must match to propose
    max_match: int = 8  # longest run tried first
    # Speculation stops while more requests than this decode at once: each step already yields that many tokens,
    # so a draft must be accepted far more often to pay for its rows. Measured on the default model (2-core EPYC,
    # docs/speculative-decoding.md): chat prompts at concurrency 8 ran at x0.70-x0.97 of no speculation with it
    # on, at concurrency 1 at x0.92-x1.10; copying at concurrency 1 at x1.37-x1.77.
    max_batch: int = 2
    suffix_capacity: int = 1 << 16  # tokens of recent requests the `suffix` proposer keeps
    guard: bool = True  # switch speculation off at a batch size where it measurably loses (RateGuard)
    draft_model_path: str | None = None  # `draft`: the draft model (same tokenizer as the target)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"--speculative-algorithm {self.algorithm!r} is not supported; choose one of: "
                              f"{', '.join(ALGORITHMS)}")
        if (self.algorithm == "draft") != (self.draft_model_path is not None):
            raise ConfigError("--speculative-algorithm draft and --speculative-draft-model-path go together: "
                              "give both, or neither")
        if not 1 <= self.num_draft_tokens <= 16:
            raise ConfigError(f"--speculative-num-draft-tokens must be in [1, 16], got {self.num_draft_tokens}")
        if self.max_batch < 1:
            raise ConfigError(f"--speculative-max-batch must be >= 1, got {self.max_batch}")
        if not 1 <= self.min_match <= self.max_match:
            raise ConfigError("--speculative-ngram-min-match-window-size must be >= 1 and <= "
                              f"--speculative-ngram-max-match-window-size, got {self.min_match} and {self.max_match}")


def parse_vllm_config(text: str) -> dict[str, Any]:
    """vLLM's `--speculative-config '{"method": "ngram", ...}'` as ServerArgs field values."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError("--speculative-config must be a JSON object, such as "
                          '{"method": "ngram", "num_speculative_tokens": 4}')
    known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ConfigError(f"--speculative-config: unsupported keys {', '.join(unknown)} (supported: "
                          f"{', '.join(sorted(known))})")
    # vLLM infers a draft model from "model"; it names that method "draft_model".
    method = cfg.get("method", "draft" if "model" in cfg else "ngram")
    method = "draft" if method == "draft_model" else method
    if method not in ALGORITHMS:
        raise ConfigError(f"--speculative-config: method {method!r} is not supported; choose one of: "
                          f"{', '.join(ALGORITHMS)}")
    out: dict[str, Any] = {"speculative_algorithm": method}
    if "model" in cfg:
        out["speculative_draft_model_path"] = str(cfg["model"])
    for key, field_name in (("num_speculative_tokens", "speculative_num_draft_tokens"),
                            ("prompt_lookup_max", "speculative_ngram_max_match_window_size"),
                            ("prompt_lookup_min", "speculative_ngram_min_match_window_size")):
        if key in cfg:
            if not isinstance(cfg[key], int) or isinstance(cfg[key], bool):
                raise ConfigError(f"--speculative-config: {key} must be an integer, got {cfg[key]!r}")
            out[field_name] = cfg[key]
    return out


def _tokens(ids: list[int] | array) -> bytes:
    return (ids if isinstance(ids, array) else array("i", ids)).tobytes()


def _last_match(buf: bytes, pattern: bytes, end: int) -> int:
    """Token index where the last whole-token occurrence of `pattern` in buf[:end] starts, or -1.

    bytes.rfind (a C two-way search) over 4-byte tokens; a hit that straddles token boundaries is skipped.
    """
    while True:
        at = buf.rfind(pattern, 0, end)
        if at < 0:
            return -1
        if at % 4 == 0:
            return at // 4
        end = at + len(pattern) - 1


def lookup(context: list[int], k: int, min_match: int, max_match: int) -> tuple[int, list[int]]:
    """Prompt lookup: the longest run of the context's last n tokens (n from max_match down to min_match) that
    also occurs earlier in it; (n, up to k tokens that followed its latest such occurrence), (0, []) if none."""
    buf = _tokens(context)
    L = len(context)
    for n in range(min(max_match, L - 1), min_match - 1, -1):
        at = _last_match(buf, buf[-4 * n:], 4 * (L - 1))  # must end before the last token: one follows it
        if at >= 0:
            return n, context[at + n: at + n + k]
    return 0, []


class SuffixStore:
    """The prompts and outputs of recent requests, for `suffix` proposals: up to `capacity` tokens, oldest
    dropped first, indexed by their runs of `min_match` tokens (a dict lookup per step, no scan).

    vLLM's suffix decoding (Arctic Inference) keeps a suffix tree of past outputs; this keeps the same text
    in a flat buffer with an n-gram index, which is enough for proposing (the longest match is checked
    backwards from the few latest occurrences of the last `min_match` tokens).
    """

    def __init__(self, capacity: int, min_match: int, max_match: int, candidates: int = 8) -> None:
        self.capacity = capacity
        self.min_match = min_match
        self.max_match = max_match
        self.candidates = candidates
        self._tokens: list[int] = []  # absolute position p is _tokens[p - _base]
        self._base = 0
        self._index: dict[tuple[int, ...], deque[int]] = {}  # n-gram -> absolute end positions, latest last
        self._seq_ends: list[int] = []  # absolute end of each stored sequence, ascending

    def __len__(self) -> int:
        return len(self._tokens)

    def add(self, ids: list[int]) -> None:
        """Store a finished sequence (prompt and output)."""
        ids = ids[-self.capacity:]
        m = self.min_match
        start = self._base + len(self._tokens)
        self._tokens.extend(ids)
        for i in range(m, len(ids) + 1):
            key = tuple(ids[i - m: i])
            q = self._index.get(key)
            if q is None:
                q = self._index[key] = deque(maxlen=self.candidates)
            q.append(start + i)
        self._seq_ends.append(start + len(ids))
        if len(self._tokens) > self.capacity:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Keep the newest sequences that fit in half the capacity (at least the newest one) and rebuild the
        index over them: one rebuild per half capacity of adds."""
        starts = [self._base, *self._seq_ends[:-1]]
        keep: list[tuple[int, int]] = []
        total = 0
        for s, e in reversed(list(zip(starts, self._seq_ends))):
            if keep and total + (e - s) > self.capacity // 2:
                break
            keep.append((s, e))
            total += e - s
        tokens, base = self._tokens, self._base
        self._tokens, self._index, self._seq_ends = [], {}, []
        self._base = keep[-1][0]  # positions stay absolute: candidates found before stay comparable
        for s, e in reversed(keep):
            self.add(tokens[s - base: e - base])

    def lookup(self, context: list[int], k: int) -> tuple[int, list[int]]:
        """(match length, up to k tokens that followed it) of the longest match of the context's tail."""
        m = self.min_match
        if len(context) < m:
            return 0, []
        ends = self._index.get(tuple(context[-m:]))
        if not ends:
            return 0, []
        best_n, best_end, best_stop = 0, -1, 0
        for end in reversed(ends):
            at = end - self._base
            if at < m:  # dropped
                continue
            stop = self._seq_ends[bisect_left(self._seq_ends, end)] - self._base  # its sequence's end
            if stop <= at:  # nothing follows it in its sequence
                continue
            n = m
            while n < self.max_match and n < len(context) and at - n - 1 >= 0 \
                    and self._tokens[at - n - 1] == context[-n - 1]:
                n += 1
            if n > best_n:
                best_n, best_end, best_stop = n, at, stop
            if n == self.max_match:
                break
        if best_end < 0:
            return 0, []
        follow = self._tokens[best_end: min(best_stop, best_end + k)]
        return best_n, follow


@dataclass
class SpecState:
    """A request's speculation: how many draft tokens it gets now, and its back-off after misses."""

    k: int
    misses: int = 0  # verify steps in a row that accepted nothing
    pause: int = 0  # decode steps left without proposals
    pause_len: int = 8  # the next pause's length (doubles after each pause, up to 256)
    draft: list[int] = field(default_factory=list)  # this step's proposal
    # With a draft model: the tokens whose KV the draft holds for this request, and their slots in its pool.
    draft_ids: list[int] = field(default_factory=list)
    draft_slots: list[int] = field(default_factory=list)

    def after_verify(self, proposed: int, accepted: int, max_k: int) -> None:
        """Adapt k to the outcome (HF's heuristic schedule: +2 when all were taken, down to what was taken
        plus one when not); three misses in a row pause proposals, for longer each time."""
        if accepted == proposed:
            self.k = min(max_k, self.k + 2)
            self.misses = 0
            self.pause_len = 8
        else:
            self.k = max(1, min(max_k, accepted + 1))
            if accepted == 0:
                self.misses += 1
                if self.misses >= 3:
                    self.pause, self.pause_len, self.misses = self.pause_len, min(256, self.pause_len * 2), 0
            else:
                self.misses = 0


class RateGuard:
    """Speculation switches itself off where it clearly loses, from the step times it measures.

    Per number of decoding requests: an exponential average of output tokens per second over decode-only steps
    without drafts (a paused or unmatched request, or speculation off), and windows of `window` decode-only steps
    with drafts. When a window's rate (its tokens over its seconds) is under `margin` x the plain average (which
    needs `min_samples`), speculation at that batch size stops for `cooldown` steps, then is tried again. A
    window, not each step, is judged, and only a clear loss counts: on a busy machine single steps vary by
    tens of percent, and a copy task, which drafts at nearly every step, must not be switched off by a spike.
    """

    def __init__(self, alpha: float = 0.05, min_samples: int = 16, window: int = 32, margin: float = 0.9,
                 cooldown: int = 256) -> None:
        self.alpha, self.min_samples, self.window, self.margin, self.cooldown = alpha, min_samples, window, margin, \
            cooldown
        self._plain: dict[int, tuple[float, int]] = {}  # batch -> (average tokens/s, samples)
        self._spec: dict[int, tuple[int, float, int]] = {}  # batch -> (tokens, seconds, steps) of the open window
        self._off_until: dict[int, int] = {}
        self._steps = 0
        self.switched_off = 0  # times speculation was switched off (reported in /server_info)

    def allows(self, batch: int) -> bool:
        return self._steps >= self._off_until.get(batch, 0)

    def observe(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """One decode-only step of `batch` requests that gave `tokens` tokens in `seconds`."""
        self._steps += 1
        if seconds <= 0 or tokens <= 0:
            return
        if not drafted:
            rate, n = self._plain.get(batch, (tokens / seconds, 0))
            self._plain[batch] = (rate + self.alpha * (tokens / seconds - rate), n + 1)
            return
        t, sec, n = self._spec.get(batch, (0, 0.0, 0))
        t, sec, n = t + tokens, sec + seconds, n + 1
        if n < self.window:
            self._spec[batch] = (t, sec, n)
            return
        self._spec.pop(batch, None)
        plain, samples = self._plain.get(batch, (0.0, 0))
        if samples >= self.min_samples and t / sec < self.margin * plain:
            self._off_until[batch] = self._steps + self.cooldown
            self.switched_off += 1


class Proposer:
    """The scheduler's side: drafts for decoding requests, and the counters vLLM reports."""

    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self.suffix = (SuffixStore(config.suffix_capacity, config.min_match, config.max_match)
                       if config.algorithm == "suffix" else None)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_draft_tokens
        self.guard = RateGuard() if config.guard else None
        self.draft_model: Any = None  # `draft`: a servelm.model_executor.draft.DraftModel, attached by the builder

    def allows(self, batch: int) -> bool:
        """Whether requests may draft in a step where `batch` of them decode."""
        return batch <= self.config.max_batch and (self.guard is None or self.guard.allows(batch))

    def observe_step(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if self.guard is not None and batch <= self.config.max_batch:
            self.guard.observe(batch, drafted, tokens, seconds)

    def new_state(self) -> SpecState:
        return SpecState(k=self.config.num_draft_tokens)

    def propose(self, state: SpecState, context: list[int], limit: int, decoding: int = 1) -> list[int]:
        """Up to min(state.k, limit) draft tokens to follow `context` ([] when none or paused); with `decoding`
        requests in the step, each gets its share of num_draft_tokens (at least one)."""
        if state.pause > 0:
            state.pause -= 1
            return []
        k = min(state.k, limit, max(1, self.config.num_draft_tokens // max(1, decoding)))
        if k <= 0:
            return []
        c = self.config
        if c.algorithm == "draft":
            return self.draft_model.propose(state, context, k) if self.draft_model is not None else []
        n, draft = lookup(context, k, c.min_match, c.max_match)
        if self.suffix is not None and n < c.max_match:
            n2, draft2 = self.suffix.lookup(context, k)
            if n2 > n:
                draft = draft2
        return draft

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def finished(self, ids: list[int]) -> None:
        if self.suffix is not None:
            self.suffix.add(ids)

    def release(self, state: SpecState | None) -> None:
        """A request ended: the draft model's KV for it goes back."""
        if state is not None and self.draft_model is not None:
            self.draft_model.release(state)

    def info(self) -> dict[str, Any]:
        """/server_info's speculative fields (vLLM's counter names)."""
        return {
            "speculative_algorithm": self.config.algorithm,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_times_switched_off": self.guard.switched_off if self.guard is not None else 0,
            # tokens a verify step yields: the accepted draft tokens plus the model's own
            "spec_decode_mean_acceptance_length": (round(1 + self.num_accepted_tokens / self.num_drafts, 4)
                                                   if self.num_drafts else None),
        }
