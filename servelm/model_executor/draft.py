"""Speculative decoding with a draft model (`--speculative-algorithm draft --speculative-draft-model-path P`):
a second, smaller model with the same tokenizer proposes the next k tokens greedily, and the target verifies
them in one step as it verifies n-gram drafts (servelm.speculative).

The draft model runs in the scheduler's process, on a `ModelRunner` of its own with a small KV pool of its
own (one-token pages, no prefix sharing). Each speculating request keeps the draft KV of the tokens the draft
has seen (`SpecState.draft_ids` / `draft_slots`). At each proposal the draft's KV is cut back to the longest
prefix it shares with the request's context (the rest were rejected draft tokens), the context's new tokens
are prefilled in one forward, and then k - 1 one-token forwards follow. A request that ends gives its draft
slots back; one that finds the pool full simply gets no draft this step.

TP: the draft runs whole on rank 0 (the scheduler's rank), and its proposals ride in the step to the other
ranks as n-gram drafts do. Its layers are built and run inside `single_rank()`, a world of one installed as
the TP group, so that they neither shard nor all-reduce over the target's group (the target's steps never run
while the draft does: both are called from the scheduler's thread, and the followers' keep-alives carry a
group of their own).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from servelm.config import ConfigError, ServerArgs
from servelm.distributed.step_codec import common_prefix
from servelm.managers.schedule_batch import StepInput
from servelm.mem_cache.allocator import PageAllocator
from servelm.sampling_params import SamplingParams, SamplingRow

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1)


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """A world of one as the TP group while the draft builds or runs (the target's group back afterwards)."""
    from servelm.distributed.parallel_state import TPGroup, get_tp_group, set_tp_group

    target = get_tp_group()
    if target.world_size == 1:
        yield
        return
    set_tp_group(TPGroup(device=target.device))
    try:
        yield
    finally:
        set_tp_group(target)


class DraftModel:
    """The draft model and its KV pool; `propose` drafts for one request (SpecState holds its draft KV)."""

    def __init__(self, server_args: ServerArgs, path: str, target_vocab_size: int, max_tokens: int) -> None:
        from servelm.model_executor.model_runner import ModelRunner

        args = server_args.replace(model_path=path, max_total_tokens=max_tokens, speculative_algorithm=None,
                                   speculative_draft_model_path=None, tp_size=1, nnodes=1, node_rank=0,
                                   dist_init_addr=None, is_embedding=False, runner="generate", page_size=1,
                                   prefix_cache_dir=None, cuda_graph_max_bs=1)  # a draft decodes one row
        with single_rank():
            self.runner = ModelRunner(args)
        # The same tokenizer, its embedding table perhaps padded less: every draft token is then a target token.
        if self.runner.vocab_size > target_vocab_size:
            raise ConfigError(f"the draft model {path} has a vocabulary of {self.runner.vocab_size} tokens and the "
                              f"target {target_vocab_size}: a draft model must share the target's tokenizer")
        self.allocator = PageAllocator(self.runner.num_pages, 1)
        logger.info("Speculative draft model %s: %d KV tokens of its own", path, self.runner.num_pages)

    def _forward(self, ids: list[int], start: int, slots: list[int], context_slots: list[int]) -> int:
        """Run `ids` at positions start.. (their KV into `slots`, after `context_slots`); the greedy next token."""
        step = StepInput(list(ids), list(range(start, start + len(ids))), list(slots), [len(ids)],
                         [context_slots + slots], [len(ids) - 1],
                         [SamplingRow(_GREEDY, 0, 0, start + len(ids), [], [])])
        with single_rank():
            out = self.runner.execute(step)
        assert out is not None
        return int(out.token_ids[0])

    def propose(self, state: Any, context: list[int], k: int) -> list[int]:
        """Up to k greedy draft tokens after `context` ([] when the draft's pool is full)."""
        keep = min(common_prefix(state.draft_ids, context), len(context) - 1)  # the last token feeds the draft
        self.allocator.free(state.draft_slots[keep:])
        del state.draft_slots[keep:]
        del state.draft_ids[keep:]
        new = context[keep:]
        slots = self.allocator.alloc(len(new) + k - 1)
        if slots is None:  # no room: this request drafts nothing now, and gives its draft KV back
            self.release(state)
            return []
        token = self._forward(new, keep, slots[:len(new)], state.draft_slots)
        state.draft_slots.extend(slots[:len(new)])
        state.draft_ids.extend(new)
        draft = [token]
        for i in range(k - 1):
            slot = slots[len(new) + i]
            token = self._forward([draft[-1]], len(state.draft_ids), [slot], state.draft_slots)
            state.draft_slots.append(slot)
            state.draft_ids.append(draft[-1])
            draft.append(token)
        return draft

    def release(self, state: Any) -> None:
        """A request ended (or its draft KV is dropped): its draft slots go back."""
        self.allocator.free(state.draft_slots)
        state.draft_slots.clear()
        state.draft_ids.clear()

    @property
    def free_tokens(self) -> int:
        return self.allocator.num_free_pages
