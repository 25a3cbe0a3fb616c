"""The scheduler: admits requests within a token budget and runs one mixed batch per step.

As in vLLM v1, a request carries counters (`num_computed` of `len(all_ids)`
tokens have KV), not a prefill/decode phase. Each step hands out a token
budget (`chunked_prefill_size`): running requests first (one token each when
decoding, the next chunk when still prefilling), then waiting requests, so
chunked prefill and mixed prefill+decode batches need no special cases.

KV bookkeeping is plain Python over page ids (PageAllocator + prefix cache);
the model runner only sees the resulting StepInput.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from servelm.constrained import GrammarFactory
from servelm.managers.detokenizer import IncrementalDetokenizer
from servelm.managers.io_struct import FinishReason, GenerateReq, TokenOut
from servelm.managers.schedule_batch import SampleOutput, SamplingRow, StepInput
from servelm.mem_cache.allocator import PageAllocator, slots_for
from servelm.mem_cache.radix_cache import NoPrefixCache, RadixCache, TreeNode, check_integrity
from servelm.sampling_params import SamplingParams, context_length_error, input_length_error, token_ids_error
from servelm.speculative import Proposer, SpecConfig, SpecState

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What the scheduler needs from a model runner (a fake one in unit tests)."""

    def execute(self, step: StepInput) -> SampleOutput | None:
        """Run one forward (on every TP rank) and sample step.sample_rows; None when there are none."""


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    sample_index: int
    stream: bool
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of all_ids whose KV is in the pool
    pages: list[int] = field(default_factory=list)  # KV pages covering positions [0, num_computed)
    slots: list[int] = field(default_factory=list)  # slot of each computed position (cached expansion of pages)
    # Positions < cache_protected_len live in prefix-cache pages, locked through `last_node` (SGLang's names).
    cache_protected_len: int = 0
    last_node: TreeNode | None = None
    cached_tokens: int = 0  # prefix-cache hit at first admission (reported in usage)
    admitted: bool = False
    finish_reason: FinishReason | None = None
    # Not yet handed out (a non-streaming request gets everything at the end):
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    pending_top: list[list[tuple[int, float]]] = field(default_factory=list)
    # With params.prompt_logprobs: entry p scores prompt token p + 1 (kept across retraction), handed out once.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    matcher: Any = None  # llguidance matcher of a constrained request (servelm.constrained), fed every token
    # Reasoning markers still to pass before the matcher applies (params.constraint_after; [] once it does).
    gate: list[int] = field(default_factory=list)
    # Scoring: the logprobs of these ids after the whole sequence, taken in the step that completes it.
    label_ids: list[int] = field(default_factory=list)
    label_logprobs: list[float] = field(default_factory=list)
    # time.monotonic() of arrival, first admission and first token (the final output's `timings`).
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    spec: SpecState | None = None  # speculative decoding: its adaptive draft length (servelm.speculative)
    draft: list[int] = field(default_factory=list)  # this step's draft tokens (verified in the step)
    embedding: str | None = None  # an embedding server's result (SampleOutput.hidden)

    @property
    def prompt_positions_to_score(self) -> range:
        """Prompt positions whose logits are still needed for prompt logprobs (empty when not asked)."""
        if not self.params.prompt_logprobs:
            return range(0)
        return range(len(self.prompt_logprobs), len(self.prompt_ids) - 1)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int
    page_size: int = 1
    chunked_prefill_size: int = 512
    max_running_requests: int = 64
    max_context_len: int = 4096
    model_context_len: int | None = None  # the model's own, when the KV pool makes max_context_len less
    disable_radix_cache: bool = False
    random_seed: int = 0
    deterministic: bool = False
    speculative: SpecConfig | None = None
    # A decoder served as an embedding model: every request is its prompt's last hidden state (last-token
    # pooling), nothing is generated.
    embedding: bool = False


class Scheduler:
    def __init__(self, runner: Runner, tokenizer: Any, config: SchedulerConfig, eos_token_ids: list[int],
                 vocab_size: int, model_info: dict[str, Any] | None = None,
                 on_shutdown: Callable[[], None] | None = None, disk_cache: Any = None) -> None:
        """`on_shutdown` releases what was assembled around the scheduler (the model's other TP ranks);
        the scheduler itself owns no process (`managers/engine_core.py` builds both sides)."""
        self.runner = runner
        self.on_shutdown = on_shutdown
        # The prefix cache's disk tier (mem_cache/disk_cache.DiskPrefixCache, --prefix-cache-dir) or None.
        self.disk = disk_cache if not config.disable_radix_cache else None
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self._model_info = dict(model_info or {})
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages, config.page_size)
        self.cache = NoPrefixCache(self.allocator) if config.disable_radix_cache else RadixCache(self.allocator)
        # A request must fit in the pool on its own, or retraction could never make room.
        self.max_context_len = min(config.max_context_len, config.num_pages * config.page_size)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._rng = random.Random(config.random_seed)
        self.grammars = GrammarFactory(tokenizer, vocab_size, self.eos_token_ids)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "cached_tokens": 0, "retractions": 0,
                      "finished": 0, "aborted": 0, "disk_cached_tokens": 0}
        self.last_step_tokens = 0  # the last step's tokens as vLLM's iteration_tokens_total counts them
        self.spec = Proposer(config.speculative) if config.speculative is not None else None

    # ------------------------------------------------------------ requests
    def add_request(self, req: GenerateReq) -> None:
        """Queue a tokenized request; ValueError (SamplingParamsError) if it can never be served."""
        params = SamplingParams.from_dict(dict(req.sampling_params))
        params.validate(self.vocab_size)
        # The API checks the same first (as 400s); this is the safety net for the Engine and other callers.
        if self.config.embedding and (params.max_new_tokens or req.label_token_ids):
            raise ValueError("this is an embedding model: it embeds inputs (POST /v1/embeddings) and does not "
                             "generate or score")
        error = token_ids_error(req.input_ids, self.vocab_size) or (
            input_length_error(len(req.input_ids), self.max_context_len) if self.config.embedding else
            context_length_error(len(req.input_ids), params.max_new_tokens, self.max_context_len,
                                 limit="max_new_tokens", model_context=self.config.model_context_len))
        if error:
            raise ValueError(error)
        if params.seed is not None:
            seed = params.seed
        elif self.config.deterministic:
            seed = self.config.random_seed
        else:
            seed = self._rng.getrandbits(63)
        grammar = params.grammar()
        matcher = self.grammars.matcher(grammar) if grammar is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                       params.stop_regex)
        self.waiting.append(Req(req.rid, list(req.input_ids), params, seed, req.sample_index, req.stream, detok,
                                matcher=matcher, gate=list(params.constraint_after) if matcher is not None else [],
                                label_ids=list(req.label_token_ids or [])))
        self.stats["prompt_tokens"] += len(req.input_ids)

    def abort_request(self, rid: str) -> list[TokenOut]:
        """Abort the request whose id is exactly `rid` (ids are the API's internal ones, never
        client text, so no other request can match); frees its KV now."""
        outs = []
        for r in [r for r in self.waiting if r.rid == rid]:
            self.waiting.remove(r)
            outs.append(self._finish(r, FinishReason.abort()))
        for r in [r for r in self.running if r.rid == rid]:
            self.running.remove(r)
            outs.append(self._finish(r, FinishReason.abort()))
        return outs

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ KV bookkeeping
    def _ensure_pages(self, req: Req, upto: int) -> bool:
        need = -(-upto // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self.allocator.alloc(need)
        if pages is None:
            self.cache.evict(need - self.allocator.num_free_pages)
            pages = self.allocator.alloc(need)
            if pages is None:
                return False
        req.pages.extend(pages)
        return True

    def _release(self, req: Req) -> None:
        """Hand the request's KV to the prefix cache (or free it) and drop all its references."""
        n = req.num_computed
        if req.pages:
            all_slots = slots_for(req.pages, self.page_size, 0, len(req.pages) * self.page_size)
            # All slots of all pages, even past num_computed, so reserved-but-unused pages are freed too.
            self.cache.cache_finished_req(req.all_ids[:n], all_slots, req.cache_protected_len, req.last_node)
        elif req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        req.pages, req.slots, req.last_node, req.cache_protected_len, req.num_computed = [], [], None, 0, 0

    def in_use_pages(self) -> int:
        return sum(len(r.pages) - r.cache_protected_len // self.page_size for r in self.running)

    def check_integrity(self) -> None:
        """Raise unless free + cached + in use == total pages."""
        check_integrity(self.allocator, self.cache, self.in_use_pages())

    def _retract_newest(self, keep: set[int]) -> bool:
        """Retraction (preemption in vLLM): when the KV pool is full, free the newest running request not in
        `keep` and requeue it at the front. Its output so far
        is kept; positions are recomputed on re-admission, and seeded sampling is keyed by position, so
        its output is unchanged."""
        for req in reversed(self.running):
            if id(req) in keep:
                continue
            self.running.remove(req)
            self._release(req)
            req.draft = []  # re-admitted as a prefill: its draft (if it had one this step) is gone
            self.waiting.appendleft(req)
            self.stats["retractions"] += 1
            logger.info("KV pool full: retracted request %s (%d tokens) back to the queue", req.rid, req.seq_len)
            return True
        return False

    # ------------------------------------------------------------ scheduling
    def schedule(self) -> list[tuple[Req, int]]:
        """Pick this step's work: [(req, number of new tokens)], with KV pages allocated."""
        budget = self.config.chunked_prefill_size
        plan: list[tuple[Req, int]] = []
        planned: set[int] = set()
        retracted = False
        # Speculation only while few requests decode: at larger batches their rows already fill the kernels.
        decoding = sum(1 for r in self.running if r.seq_len - r.num_computed == 1)
        speculate = self.spec is not None and self.spec.allows(decoding)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.seq_len - req.num_computed, budget)
            req.draft = []
            if speculate and n == 1 and budget > 1:
                req.draft = self._propose(req, budget - 1, decoding)
                n += len(req.draft)
                if req.draft and not self._ensure_pages(req, req.num_computed + n):
                    req.draft, n = [], 1  # no room for the draft: never retract anyone for one
            while not self._ensure_pages(req, req.num_computed + n):
                if not self._retract_newest(planned | {id(req)}):
                    # Nothing else to take memory from: this request itself goes back.
                    self._retract_newest(planned)
                    n = 0
                    break
                retracted = True
            if n == 0:
                break  # req itself was retracted; later entries are newer and were retracted before it
            plan.append((req, n))
            planned.add(id(req))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and not retracted and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            # A waiting request holds no KV (retraction and failed admission release it): match afresh.
            self._match_prefix(req)
            n = min(req.seq_len - req.num_computed, budget)
            if not self._ensure_pages(req, req.num_computed + n):
                self._release(req)
                break
            self.waiting.popleft()
            if req.scheduled_at is None:  # first admitted (an attempt that found no pages does not count)
                req.scheduled_at = time.monotonic()
            self.running.append(req)
            plan.append((req, n))
            budget -= n
        return plan

    def _propose(self, req: Req, budget: int, decoding: int) -> list[int]:
        """Draft tokens for a decoding request ([] when it cannot speculate): never more than its output may
        still take beside the model's own token, nor past the context limit."""
        assert self.spec is not None
        # Scoring, or a constraint gated behind the model's thinking: plain decoding.
        if req.label_ids or (req.matcher is not None and req.gate):
            return []
        if req.spec is None:
            req.spec = self.spec.new_state()
        limit = min(budget, req.params.max_new_tokens - len(req.output_ids) - 1,
                    self.max_context_len - req.seq_len - 1)
        draft = self.spec.propose(req.spec, req.all_ids, limit, decoding)
        if draft and req.matcher is not None:  # only what the constraint would take; never past its end
            draft = draft[:req.matcher.validate_tokens(draft)]
        return draft

    @staticmethod
    def _draft_masks(req: Req) -> list[bytes | None]:
        """A constrained request's verify rows: row j's allowed tokens, the constraint's after the draft's first
        j tokens (fed to the matcher, then rolled back). A row after a token that ends the constraint gets
        None: it is only reached when that token was accepted, and the request then stops there."""
        if req.matcher is None:
            return [None] * (len(req.draft) + 1)
        masks: list[bytes | None] = [req.matcher.compute_bitmask()]
        consumed = 0
        for token in req.draft:
            if req.matcher.is_stopped() or not req.matcher.consume_token(token):
                masks.append(None)
                continue
            consumed += 1
            masks.append(None if req.matcher.is_stopped() else req.matcher.compute_bitmask())
        if consumed:
            req.matcher.rollback(consumed)
        return masks

    def _match_prefix(self, req: Req) -> None:
        # The last token is never matched: it must be computed to get logits for the next one. Nor is a
        # prompt position still to be scored for prompt logprobs (a cached prefix has no logits).
        limit = len(req.all_ids) - 1
        if req.prompt_positions_to_score:
            limit = min(limit, req.prompt_positions_to_score.start)
        match = self.cache.match_prefix(req.all_ids[:limit])
        if self.disk is not None:
            match = self._restore_from_disk(req.all_ids[:limit], match)
        slots = match.slots
        self.cache.inc_lock_ref(match.node)
        req.last_node = match.node
        req.pages = [s // self.page_size for s in slots[:: self.page_size]]
        req.slots = list(slots)
        req.cache_protected_len = req.num_computed = len(slots)
        if not req.admitted:
            req.cached_tokens = len(slots)
            self.stats["cached_tokens"] += len(slots)
            req.admitted = True

    def _restore_from_disk(self, ids: list[int], match: Any) -> Any:
        """When the disk holds a longer prefix of `ids` than the tree: read the rest of it into new pages and
        insert it into the tree (the tree then owns those pages); the new match. On no room or a bad file:
        the tree's match as it was."""
        hit = self.disk.lookup(ids)
        have = len(match.slots)
        if hit is None or hit[1] <= have:
            return match
        path, end = hit
        need = (end - have) // self.page_size
        self.cache.inc_lock_ref(match.node)  # the matched prefix stays while room is made
        pages = self.allocator.alloc(need)
        if pages is None:
            self.cache.evict(need - self.allocator.num_free_pages)
            pages = self.allocator.alloc(need)
        self.cache.dec_lock_ref(match.node)
        if pages is None:
            return match
        slots = slots_for(pages, self.page_size, 0, need * self.page_size)
        if not self.disk.load(path, ids, have, end, slots):
            self.allocator.free(pages)
            return match
        already = self.cache.insert(ids[:end], list(match.slots) + slots)
        if already != have:  # nothing touched the tree in between, so this is a bug
            raise RuntimeError(f"disk restore: the tree held {already} tokens, not the {have} matched")
        self.stats["disk_cached_tokens"] += end - have
        logger.info("Prefix cache: %d tokens read back from disk (%s)", end - have, path.name)
        return self.cache.match_prefix(ids)

    # ------------------------------------------------------------ one step
    def step(self) -> list[TokenOut]:
        """Schedule, run one forward over the mixed batch, sample, and report progress."""
        plan = self.schedule()
        self.last_step_tokens = sum(self._iteration_tokens(req, n) for req, n in plan)
        if not plan:
            return []
        input_ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        kv_indices: list[list[int]] = []
        logits_rows: list[int] = []
        rows: list[SamplingRow] = []
        sampled: list[Req] = []  # one per row: the request whose row it is
        prefilled_only: list[Req] = []  # max_new_tokens 0: done once the prompt is in
        hidden_rows: list[int] = []  # an embedding server: each finished prompt's last row
        pooled: list[Req] = []
        extend_lens: list[int] = []
        verify: dict[int, list[int]] = {}  # id(req) -> its rows in `rows`, a speculating request's k + 1
        row_keys: list[Any] = []
        for req, n in plan:
            start, end = req.num_computed, req.num_computed + n
            ids = req.all_ids
            new_slots = slots_for(req.pages, self.page_size, start, end)
            req.slots.extend(new_slots)
            first_row = len(input_ids)
            if req.draft:
                # The last token and the draft, as k + 1 decode rows: row j sees the context and the draft's
                # first j tokens (its own slot included), exactly as that position's plain decode step would.
                input_ids.extend([ids[start], *req.draft])
                positions.extend(range(start, end))
                out_loc.extend(new_slots)
                verify[id(req)] = []
                masks = self._draft_masks(req)
                for j in range(n):
                    extend_lens.append(1)
                    kv_indices.append(req.slots[: start + j + 1])
                    row_keys.append((id(req), j))
                    logits_rows.append(first_row + j)
                    verify[id(req)].append(len(rows))
                    rows.append(SamplingRow(req.params, req.seed, req.sample_index, req.seq_len + j, req.prompt_ids,
                                            req.output_ids + req.draft[:j], self._banned_ids(req, j),
                                            allowed=masks[j]))
                    sampled.append(req)
                continue
            input_ids.extend(ids[start:end])
            positions.extend(range(start, end))
            out_loc.extend(new_slots)
            kv_indices.append(req.slots)
            row_keys.append(id(req))
            extend_lens.append(n)
            todo = req.prompt_positions_to_score
            for pos in range(max(start, todo.start), min(end, todo.stop)):
                logits_rows.append(first_row + pos - start)
                rows.append(SamplingRow(req.params, req.seed, req.sample_index, pos + 1, req.prompt_ids, [],
                                        target=ids[pos + 1]))
                sampled.append(req)
            if end == len(ids) and not req.output_ids:  # scoring rows: each label id's logprob after the prompt
                for label in req.label_ids:
                    logits_rows.append(len(input_ids) - 1)
                    rows.append(SamplingRow(req.params, req.seed, req.sample_index, len(ids), req.prompt_ids,
                                            req.output_ids, target=label))
                    sampled.append(req)
            if end == len(ids) and self.config.embedding:
                hidden_rows.append(len(input_ids) - 1)
                pooled.append(req)
            if end == len(ids) and req.params.max_new_tokens == 0:
                prefilled_only.append(req)  # its prompt is in (and scored): nothing to sample
            elif end == len(ids):
                logits_rows.append(len(input_ids) - 1)
                rows.append(SamplingRow(req.params, req.seed, req.sample_index, req.seq_len, req.prompt_ids,
                                        req.output_ids, self._banned_ids(req),
                                        allowed=self._constraint_mask(req)))
                sampled.append(req)
        # Runs even when nothing samples: partial prefill chunks still fill the KV cache.
        started, generated = time.perf_counter(), self.stats["generation_tokens"]
        result = self.runner.execute(StepInput(input_ids, positions, out_loc, extend_lens, kv_indices,
                                               logits_rows, rows, hidden_rows, row_keys))
        if pooled:
            assert result is not None
            for req, vector in zip(pooled, result.hidden, strict=True):
                req.embedding = vector
        for req, n in plan:
            if id(req) in verify:
                continue  # its KV counts only up to the accepted tokens (_accept)
            req.num_computed += n
            if n > 1:
                self._share_prefix(req)
        outputs: list[TokenOut] = []
        if sampled:
            assert result is not None
            for req, _ in plan:
                if id(req) in verify:
                    self._accept(req, verify[id(req)], result)
                    if req.finish_reason is not None:
                        self.running.remove(req)
                        outputs.append(self._finish(req, req.finish_reason))
                    elif req.stream:
                        outputs.append(self._make_out(req))
            for k, (req, row) in enumerate(zip(sampled, rows)):
                if id(req) in verify:
                    continue
                if row.target is not None and row.position == req.seq_len:
                    req.label_logprobs.append(result.logprobs[k])
                    continue
                if row.target is not None:
                    req.prompt_logprobs.append(result.logprobs[k])
                    req.prompt_top.append(result.top_logprobs[k] or [])
                    req.prompt_ranks.append(result.ranks[k] if k < len(result.ranks) else None)
                    continue
                self._append_token(req, result.token_ids[k], result.logprobs[k], result.top_logprobs[k])
                if req.finish_reason is not None:
                    self.running.remove(req)
                    outputs.append(self._finish(req, req.finish_reason))
                elif req.stream:
                    outputs.append(self._make_out(req))
        for req in prefilled_only:
            self.running.remove(req)
            outputs.append(self._finish(req, FinishReason.stop() if req.embedding is not None
                                        else FinishReason.length()))
        if self.spec is not None and all(n == 1 or id(req) in verify for req, n in plan):
            # a decode-only step: what speculation's guard compares (tokens out per second, with and without)
            self.spec.observe_step(len(plan), bool(verify), self.stats["generation_tokens"] - generated,
                                   time.perf_counter() - started)
        return outputs

    def _accept(self, req: Req, at: list[int], result: SampleOutput) -> None:
        """A speculating request's verify rows: the model's token at each position, kept while the draft
        agrees, up to and including the first one that differs (or the one after the whole draft). Only
        these tokens reach the output, the stop checks and the KV count; the slots written for the
        rejected rest are overwritten later (their pages stay the request's until it ends)."""
        assert self.spec is not None and req.spec is not None
        draft, tokens = req.draft, [result.token_ids[k] for k in at]
        accepted = 0
        while accepted < len(draft) and tokens[accepted] == draft[accepted]:
            accepted += 1
        self.spec.record(len(draft), accepted)
        req.spec.after_verify(len(draft), accepted, self.spec.config.num_draft_tokens)
        appended = 0
        for k, token in zip(at[: accepted + 1], tokens[: accepted + 1]):
            self._append_token(req, token, result.logprobs[k], result.top_logprobs[k])
            appended += 1
            if req.finish_reason is not None:
                break
        req.num_computed += appended
        del req.slots[req.num_computed:]
        req.draft = []
        self.last_step_tokens += appended - 1  # the step was counted with one token for it (_iteration_tokens)

    @staticmethod
    def _iteration_tokens(req: Req, n: int) -> int:
        """vLLM's count of a request's tokens in a step: nothing for a prefill chunk that does not end the
        prompt; the whole prompt, cached part included, in the step that ends it; one per token generated."""
        if req.num_computed + n < len(req.all_ids):
            return 0
        generated = 1 if req.params.max_new_tokens > 0 else 0
        return generated + (len(req.prompt_ids) if not req.output_ids else 0)

    def _share_prefix(self, req: Req) -> None:
        """After a prefill chunk, put the request's KV so far in the prefix cache (as SGLang does), so
        requests admitted while it still runs reuse it; the request keeps it locked. Pages it computed
        twice (another request inserted the same prefix first) are freed and it reads the cached ones."""
        res = self.cache.cache_unfinished_req(req.all_ids[:req.num_computed], req.slots, req.cache_protected_len,
                                              req.last_node)
        req.last_node, req.cache_protected_len = res.node, len(res.slots)
        req.slots = list(res.slots) + req.slots[len(res.slots):]
        req.pages = [s // self.page_size for s in req.slots[:: self.page_size]]

    def _banned_ids(self, req: Req, ahead: int = 0) -> list[int]:
        """Ids the next token (or the one `ahead` draft tokens later) may not be: stops before min_tokens."""
        if len(req.output_ids) + ahead >= req.params.min_new_tokens:
            return []
        return list(req.params.stop_token_ids) + ([] if req.params.ignore_eos else self.eos_token_ids)

    @staticmethod
    def _constraint_mask(req: Req) -> bytes | None:
        """The tokens the constraint allows next (llguidance's bitmask), None for any: also while the model
        thinks; a first token that may open the thinking is allowed besides the constraint's."""
        if req.matcher is None or len(req.gate) == 1:
            return None
        mask = req.matcher.compute_bitmask()
        if req.gate:  # bit t % 8 of byte t // 8 (little-endian 32-bit words)
            opening = req.gate[0]
            mask = bytearray(mask)
            if opening // 8 < len(mask):
                mask[opening // 8] |= 1 << (opening % 8)
            mask = bytes(mask)
        return mask

    @staticmethod
    def _pass_gate(req: Req, token: int) -> bool:
        """Whether `token` is the model's thinking (not fed to the constraint), moving past the markers."""
        if not req.gate:
            return False
        if len(req.gate) == 2 and token != req.gate[0]:
            req.gate = []  # the answer starts without thinking: this token is the constraint's first
            return False
        req.gate = req.gate[1:] if len(req.gate) == 2 or token == req.gate[0] else req.gate
        return True

    def _append_token(self, req: Req, token: int, logprob: float | None, top: list | None) -> None:
        p = req.params
        gated = self._pass_gate(req, token)
        if req.matcher is not None and not gated and not req.matcher.consume_token(token) \
                and token not in self.eos_token_ids:
            # Not reachable while the mask is applied; kept out of the output if it ever happens.
            req.finish_reason = FinishReason.abort(f"constrained decoding failed: {req.matcher.get_error()}")
            return
        req.output_ids.append(token)
        req.pending_ids.append(token)
        req.first_token_at = req.first_token_at or time.monotonic()
        if logprob is not None:
            req.pending_logprobs.append(logprob)
            req.pending_top.append(top or [])
        self.stats["generation_tokens"] += 1
        if token in p.stop_token_ids:
            req.finish_reason = FinishReason.stop(token)
        elif not p.ignore_eos and token in self.eos_token_ids:
            req.finish_reason = FinishReason.stop(token)
        else:
            stop_str = req.detok.add(token)
            if stop_str is not None:
                req.finish_reason = FinishReason.stop(stop_str)
            elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.max_context_len:
                req.finish_reason = FinishReason.length()
            elif req.matcher is not None and not gated and req.matcher.is_stopped():
                req.finish_reason = FinishReason.stop()  # the constraint is complete

    def _make_out(self, req: Req) -> TokenOut:
        finished = req.finish_reason is not None
        if finished:
            req.detok.flush()
        out = TokenOut(rid=req.rid, token_ids=req.pending_ids, text=req.detok.take(finished),
                       finish_reason=req.finish_reason, prompt_tokens=len(req.prompt_ids),
                       completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
                       logprobs=req.pending_logprobs, top_logprobs=req.pending_top)
        if finished:
            out.label_logprobs = req.label_logprobs if req.label_ids else None
            out.embedding = req.embedding
            out.timings = self._timings(req)
        if req.params.prompt_logprobs and not req.prompt_logprobs_sent:
            out.prompt_logprobs, out.prompt_top_logprobs = [None, *req.prompt_logprobs], [None, *req.prompt_top]
            out.prompt_ranks = [None, *req.prompt_ranks]
            req.prompt_logprobs_sent = True
        req.pending_ids, req.pending_logprobs, req.pending_top = [], [], []
        return out

    @staticmethod
    def _timings(req: Req) -> dict[str, float]:
        """Seconds queued (arrival to first admission), prefilling (to the first token) and decoding (first to
        last token) of a finished request; a phase it never reached is left out."""
        now, out = time.monotonic(), {}
        out["queue"] = (req.scheduled_at or now) - req.arrival
        if req.scheduled_at is not None:
            out["prefill"] = (req.first_token_at or now) - req.scheduled_at
        if req.first_token_at is not None:
            out["decode"] = now - req.first_token_at
        return out

    def _finish(self, req: Req, reason: FinishReason) -> TokenOut:
        req.finish_reason = reason
        req.draft = []
        if self.spec is not None:
            self.spec.release(req.spec)
        if self.spec is not None and reason.type != "abort":
            self.spec.finished(req.all_ids)
        if self.disk is not None and req.pages and reason.type != "abort":
            n = req.num_computed
            self.disk.save(req.all_ids[:n], slots_for(req.pages, self.page_size, 0, n))
        self._release(req)
        self.stats["aborted" if reason.type == "abort" else "finished"] += 1
        return self._make_out(req)

    # ------------------------------------------------------------ control
    def shutdown(self) -> None:
        """Release the model's other TP ranks (if any) and leave the process group."""
        if self.disk is not None:
            self.disk.flush()  # queued prefix files are written before the process goes
        if self.on_shutdown is not None:
            self.on_shutdown()

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused while requests are running."""
        if self.running:
            return False
        return self.cache.reset()

    def server_info(self) -> dict[str, Any]:
        P = self.page_size
        try:
            self.check_integrity()
            integrity_ok, integrity_error = True, None
        except RuntimeError as exc:
            integrity_ok, integrity_error = False, str(exc)
        return {
            "kv_total_tokens": self.allocator.num_pages * P,
            "kv_free_tokens": self.allocator.num_free_pages * P,
            "kv_cached_tokens": self.cache.cached_pages * P,
            "kv_in_use_tokens": self.in_use_pages() * P,
            "kv_integrity_ok": integrity_ok,
            "kv_integrity_error": integrity_error,
            # what the pool holds (the runner's --kv-cache-dtype): dtype, storage, scales, bytes per token
            **{k: v for k, v in self._model_info.items() if k.startswith("kv_cache_")},
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "cache_hit_rate": self.cache.hit_rate,
            "cache_hit_tokens": self.cache.total_matched_tokens,
            "cache_query_tokens": self.cache.total_queried_tokens,
            **{f"{k}_total": v for k, v in self.stats.items()},
            **(self.spec.info() if self.spec is not None else {}),
            **(self.runner.tp_channel_stats() if hasattr(self.runner, "tp_channel_stats") else {}),
        }

    def model_info(self) -> dict[str, Any]:
        return {**self._model_info, "max_context_length": self.max_context_len, "vocab_size": self.vocab_size,
                "kv_capacity_tokens": self.allocator.num_pages * self.page_size,
                "model_context_length": self.config.model_context_len or self.config.max_context_len,
                "eos_token_ids": self.eos_token_ids}
