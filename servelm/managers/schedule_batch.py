"""The scheduler-to-runner messages, in plain Python (no torch): what one step asks the model runner to do
and what sampling gives back (as vLLM's `v1/core/sched/output.py`).

The scheduler builds a `StepInput` per step (rank 0 also broadcasts it to the other TP ranks); the runner
turns it into tensors (`ForwardBatch.from_step`), runs the model and samples the `SamplingRow`s into a
`SampleOutput`. Keeping these torch-free keeps the scheduler testable, and importable, without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The sampler's rows live with the sampling params (layers/ must not import managers/); re-exported here.
from servelm.sampling_params import SampleOutput, SamplingRow  # noqa: F401


@dataclass
class StepInput:
    """One scheduler step in plain Python: what rank 0 broadcasts to the other TP ranks.

    Request i adds tokens at positions [seq_len_i - extend_lens[i], seq_len_i); its KV
    (prefix + new) is at kv_indices[i]; `sample_rows` are the sampling rows, in the order
    of `logits_indices`.
    """

    input_ids: list[int]
    positions: list[int]
    out_cache_loc: list[int]
    extend_lens: list[int]
    kv_indices: list[list[int]]
    logits_indices: list[int]
    sample_rows: list[SamplingRow] = field(default_factory=list)
    # A decoder embedder: rows (of input_ids) whose last hidden state is an embedding (last-token pooling).
    hidden_indices: list[int] = field(default_factory=list)
    # A stable key per entry of kv_indices (its request; a verify row's (request, j)), so that under TP only the
    # change of each request's slot list goes to the other ranks (servelm.distributed.step_codec).
    row_keys: list[Any] = field(default_factory=list)
