"""Builds the model, loads its weights, sizes the KV pool, and runs forwards."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from servelm.config import ConfigError, ServerArgs
from servelm.cpu_memory import configure_malloc
from servelm.kernels import quant
from servelm.layers.kernel_choice import KernelChoice, freeze_kernels
from servelm.layers.sampler import sample
from servelm.managers.schedule_batch import SampleOutput, StepInput
from servelm.mem_cache.memory_pool import KVCache, resolve_kv_dtype
from servelm.model_executor.forward_batch import ForwardBatch
from servelm.model_loader.default_model import model_path_or_default
from servelm.model_loader.quantization import resolve_quantization
from servelm.models.llama import head_dim_of
from servelm.models.registry import resolve_model_class

if TYPE_CHECKING:
    from servelm.distributed.step_channel import StepSender

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # This class of CPU has no fast bf16 path; fp32 is both faster and exact.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def check_device_support(server_args: ServerArgs, device: torch.device) -> None:
    """One start-up line for what this device cannot run."""
    if device.type == "cuda" and server_args.enable_deterministic_inference:
        raise ConfigError("--enable-deterministic-inference runs on the CPU only: its batch-invariant matmuls and "
                          "attention are servelm's CPU kernels, and torch has no batch-invariant ones on CUDA; "
                          "drop the flag or use --device cpu")


def eos_token_ids_of(config: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for value in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and v not in ids:
                ids.append(int(v))
    return ids


def check_tp_divisibility(config: Any, tp_size: int) -> None:
    """One clear start-up error when the model's heads cannot be split over tp_size ranks."""
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    problems = []
    if heads % tp_size:
        problems.append(f"{heads} attention heads")
    if kv_heads % tp_size and tp_size % kv_heads:
        problems.append(f"{kv_heads} key/value heads")
    if config.intermediate_size % tp_size:
        problems.append(f"an intermediate size of {config.intermediate_size}")
    if problems:
        raise ConfigError(f"--tp-size {tp_size} does not divide the model's {' and '.join(problems)} "
                          f"(the model has {heads} attention heads and {kv_heads} key/value heads); "
                          "choose a tensor-parallel size that divides them")


class ModelRunner:
    """Owns the model and the KV storage of one TP rank.

    With tp_size > 1, every rank builds its shard of the model; rank 0 (the one
    driven by the Scheduler) broadcasts each StepInput, the other ranks run
    `follow()` and execute the same steps in lockstep. While rank 0 has no step
    to send, keep-alives hold the followers' wait under `--dist-timeout`
    (servelm/distributed/step_channel.py), so an idle TP server never times out.
    """

    def __init__(self, server_args: ServerArgs, tp_rank: int = 0, source: Any = None) -> None:
        from servelm.model_loader.source import load_model_source
        from servelm.model_loader.tokenizer import load_tokenizer

        t0 = time.perf_counter()
        self.server_args = server_args
        self.tp_rank, self.tp_size = tp_rank, server_args.tp_size
        # Rank 0 under TP: names this node's TP rank that died, if one did (TPWorkers.report_death, set by
        # managers/engine_core.py); the runner owns no worker process.
        self.dead_rank_reporter: Callable[[], str | None] | None = None
        self._remote_failure: str | None = None  # the line naming another node's lost rank, logged once
        self._sender: StepSender | None = None  # rank 0 under TP: carries the steps to the followers
        self.device = resolve_device(server_args.device)
        self.rows16 = False  # the weights interleaved by 16 rows (quant.interleave_rows16), set at load
        self.dtype = resolve_dtype(server_args.dtype, self.device)
        check_device_support(server_args, self.device)
        if self.device.type == "cpu":  # activations' freed memory stays for the next step (cpu_memory.py)
            configure_malloc()
        self.model_path = model_path_or_default(server_args.model_path)
        source = source or load_model_source(self.model_path)
        self.config = config = source.config
        check_tp_divisibility(config, self.tp_size)
        if self.tp_size > 1:
            self._init_tp()
        model_cls = resolve_model_class(config.architectures)
        max_positions = server_args.context_length or config.max_position_embeddings
        self.quant_policy = resolve_quantization(server_args.quantization, source.format, self.dtype, self.device)
        with torch.device(self.device):
            self.model = model_cls(config, self.dtype, max_positions=max_positions)
        self._load_weights(source)
        self.model.eval()
        if self.device.type == "cpu":  # the quantised matrices in one huge-page buffer, in execution order
            if quant.rows16_default():  # interleaved by 16 rows for the int8 paths' kernel (quant.interleave_rows16)
                self.rows16 = quant.interleave_in_place(
                    [qw for m in self.model.modules() for qw in _quant_weights(m, lookup=False)]) > 0
            quant.pack_weights([qw for m in self.model.modules() for qw in _quant_weights(m)])
        self.fast_path = not server_args.disable_fast_path and self.model.prepack_weights() > 0
        # The kernels, chosen once and frozen into the model's modules (no process-wide switch is read later).
        self.kernels = KernelChoice.resolve(server_args.enable_deterministic_inference, self.device)
        freeze_kernels(self.model, self.kernels)
        self.weight_bytes = self.model.weight_bytes()
        self.tokenizer = load_tokenizer(server_args.tokenizer_path or self.model_path, server_args.chat_template)
        # Served as an embedding model (--is-embedding): its pooling (last token only, for a decoder).
        self.pooling = None
        if server_args.is_embedding or server_args.runner == "pooling":
            from servelm.model_loader.pooling import PoolingConfig, read_pooling

            folder = self.model_path if os.path.isdir(self.model_path) else os.path.dirname(self.model_path)
            self.pooling = read_pooling(folder, default_mode="last")
            if server_args.pooling is not None:
                self.pooling = PoolingConfig(server_args.pooling, self.pooling.normalize, None, "--pooling")
            if self.pooling.mode != "last":
                raise ConfigError(f"a decoder model embeds by its last token; pooling {self.pooling.mode!r} is not "
                                  "supported for it (pass --pooling last)")
        self.eos_token_ids = eos_token_ids_of(config, self.tokenizer)
        self.vocab_size = config.vocab_size

        attn = self.model.model.layers[0].self_attn
        kv_dtype = resolve_kv_dtype(server_args.kv_cache_dtype, self.dtype, self.device,
                                    server_args.enable_deterministic_inference)
        bytes_per_token = KVCache.bytes_per_token(config.num_hidden_layers, attn.num_kv_heads, head_dim_of(config),
                                                  kv_dtype)
        tokens = self._kv_budget_tokens(bytes_per_token)
        page = server_args.page_size
        self.num_pages = max(tokens // page, 2)
        # One page more than the allocator hands out: the padding rows of a captured decode step write there.
        self.pad_slot = self.num_pages * page
        self.kv_cache = KVCache(config.num_hidden_layers, self.num_pages * page + page, attn.num_kv_heads,
                                head_dim_of(config), self.dtype, self.device, kv_dtype)
        self.max_context_len = min(max_positions, self.num_pages * page)
        self.model_context_len = max_positions  # before the KV pool's limit
        self.load_seconds = time.perf_counter() - t0
        tp_note = f", TP rank {tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        logger.info("Loaded %s (%s, %s, %s%s) in %.1f s; KV cache %d tokens (%.2f GiB, %s)", self.model_path,
                    config.architectures[0], str(self.dtype).removeprefix("torch."),
                    "oneDNN pre-packed linears" if self.fast_path else
                    "quantised linears" if self.quant_policy.quantized else "eager linears", tp_note, self.load_seconds,
                    self.num_pages * page, self.num_pages * page * bytes_per_token / 2**30, kv_dtype)
        self._log_weights()
        self.decode_graphs_error: str | None = None
        self.decode_graphs = self._capture_decode_graphs()
        if self.tp_size > 1 and tp_rank == 0:
            self._start_step_sender()

    def _capture_decode_graphs(self) -> Any:
        """CUDA graphs of the decode step (servelm.model_executor.cuda_graph_runner) on a GPU at TP 1, unless
        --disable-cuda-graph; the shortest key bucket is captured now for every batch size, others on first use."""
        sa = self.server_args
        if self.device.type != "cuda" or sa.disable_cuda_graph or self.pooling is not None:
            return None
        if self.tp_size > 1:
            logger.info("CUDA graphs are off under --tp-size > 1 (not yet supported); decode runs eagerly")
            return None
        from servelm.model_executor.cuda_graph_runner import DecodeGraphs

        graphs = DecodeGraphs(self, sa.cuda_graph_max_bs or sa.max_running_requests, self.pad_slot)
        try:
            graphs.capture()
        except Exception as exc:  # the server still serves, every step eagerly; the line says why
            from servelm.distributed.failures import first_line

            self.decode_graphs_error = first_line(exc)
            logger.warning("CUDA graphs of the decode step could not be captured (%s); decode runs eagerly",
                           self.decode_graphs_error)
            return None
        logger.info("Captured CUDA graphs of the decode step for batch sizes %s in %.1f s (longer contexts are "
                    "captured on first use)", graphs.sizes, graphs.capture_seconds)
        return graphs

    def weight_formats(self) -> dict[str, int]:
        """How many weight matrices of this rank each format holds, e.g. {"q4_1": 210, "q8_0": 1}."""
        return dict(Counter(fmt for fmt, _ in self.model.weight_matrices()))

    def _log_weights(self) -> None:
        formats = ", ".join(f"{n} {fmt}" for fmt, n in sorted(self.weight_formats().items()))
        kernels = ""
        if self.quant_policy.quantized:
            from servelm.kernels import quant

            invariant = ("batch-invariant" if quant.batch_invariant(self.kernels.quant)
                         else "padded to probed row counts")
            kernels = f", kernels: {self.kernels.describe()}" + (
                f", {invariant} in deterministic mode" if self.server_args.enable_deterministic_inference else "")
        rank = f" (TP rank {self.tp_rank})" if self.tp_size > 1 else ""
        logger.info("Loaded %s weights%s: %.1f MB in RAM (--quantization %s: %s matrices%s)",
                    os.path.basename(self.model_path), rank, self.weight_bytes / 1e6, self.quant_policy.mode,
                    formats, kernels)

    def _init_tp(self) -> None:
        from servelm.distributed.communicator import configure_all_reduce
        from servelm.distributed.parallel_state import init_distributed

        sa = self.server_args
        if not sa.dist_init_addr:
            raise ConfigError("--dist-init-addr host:port is required with --tp-size > 1")
        init_distributed(sa.tp_size, self.tp_rank, sa.dist_init_addr, sa.nnodes, sa.node_rank, sa.dist_timeout,
                         interface=sa.dist_interface)
        configure_all_reduce(sa.quick_allreduce, sa.quick_allreduce_min_bytes, sa.enable_deterministic_inference)

    def _start_step_sender(self) -> None:
        """Rank 0: from now on (every start-up collective is done) steps and keep-alives go out."""
        from servelm.distributed.step_channel import StepSender

        self._sender = StepSender(self.server_args.dist_timeout, self._keep_alive_failed,
                                  rows_needed=self.server_args.enable_tp_lm_head_all_to_all)

    def _keep_alive_failed(self, exc: BaseException) -> None:
        """A keep-alive broadcast failed: a rank died or left while rank 0 was idle.

        Same policy as TPWorkers.watch: rank 0 never outlives a lost rank (its TP group can
        run no step any more), and it names the dead rank when it is one of this node's.
        """
        if self._report_dead_rank(exc) is None:
            from servelm.distributed.failures import first_line

            logger.critical("TP keep-alive failed, a TP rank on another node died or stopped answering (%s); "
                            "shutting down", first_line(exc))
        os._exit(1)

    def _report_dead_rank(self, exc: BaseException) -> str | None:
        """When `exc` is a failed collective and one of this node's ranks died: the (once) logged
        line naming it. None when the failure is not that (a bug here, or a rank elsewhere)."""
        from servelm.distributed.failures import is_collective_failure

        if not is_collective_failure(exc):
            return None
        line = self.dead_rank_reporter() if self.dead_rank_reporter is not None else None
        if line is None and self.server_args.nnodes > 1:  # not one of this node's: name the other node
            if self._remote_failure is None:
                from servelm.distributed.failures import describe_remote_failure
                from servelm.distributed.parallel_state import get_tp_group

                self._remote_failure = describe_remote_failure(exc, get_tp_group().peer_addresses,
                                                               self.server_args.tp_ranks_per_node, self.tp_rank)
                logger.critical("%s", self._remote_failure)
            line = self._remote_failure
        return line

    def _load_weights(self, source: Any) -> None:
        policy = self.quant_policy
        # A tied embedding's blocks, kept for the lookup, save memory only when the LM head's fp32 copy is the
        # packed one (a plain one would serve the lookup as well).
        lookup = policy.lookup_formats if (self.model.tie_word_embeddings and not self.server_args.disable_fast_path
                                           and torch.backends.mkldnn.is_available()) else frozenset()
        weights = tqdm(policy.apply(source.iter_weights(self.dtype, keep_formats=policy.keep_formats,
                                                        embedding_formats=lookup)),
                       total=source.num_weights, desc="Loading weights", unit="tensor", leave=False,
                       disable=self.tp_rank != 0)
        loaded = self.model.load_weights(weights)
        self.model.finish_loading(fp32_lm_head=bool(lookup))
        expected = {n for n, _ in self.model.named_parameters()}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"Checkpoint {self.model_path} lacks weights for: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))

    def _kv_budget_tokens(self, bytes_per_token: int) -> int:
        """KV pool size in tokens. Under TP every rank uses the minimum free memory over all ranks
        (measured after the collective warm-ups), so all pools are identical."""
        from servelm.distributed.startup import get_local_free_memory, run_startup_checks

        sa = self.server_args
        if self.tp_size > 1:
            free = run_startup_checks(sa.strict_memory_balance, sa.enable_tp_lm_head_all_to_all)
        else:
            free = get_local_free_memory(self.device)
        if sa.max_total_tokens is not None:
            return sa.max_total_tokens
        if self.device.type == "cuda":
            return int(free * sa.mem_fraction_static) // bytes_per_token
        # On CPU: --cpu-kv-cache-gb, but never more than 80% of the RAM this rank may use.
        return int(min(sa.cpu_kv_cache_gb * 2**30, 0.8 * free)) // bytes_per_token

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, gather_logits: bool = True) -> torch.Tensor:
        fb.kv_cache = self.kv_cache
        return self.model(fb, gather_logits=gather_logits)

    def execute(self, step: StepInput) -> SampleOutput | None:
        """One scheduler step: forward over the mixed batch, then sample its rows (called on rank 0).

        Under TP the step goes to the followers first; the result is meaningful on rank 0. A
        step that fails because another rank died raises TPFailure, whose message names that
        rank and is already logged (the collective's own error is only a consequence).
        """
        sender = self._sender
        if sender is None:
            return self._execute(step)
        # Held across the whole step, so no keep-alive interleaves with the step's collectives.
        with sender.lock:
            try:
                sender.send(step)
                return self._execute(step)
            except Exception as exc:
                if (line := self._report_dead_rank(exc)) is not None:
                    from servelm.distributed.failures import TPFailure

                    raise TPFailure(line) from exc
                raise

    def _execute(self, step: StepInput) -> SampleOutput | None:
        """Run `step` on this rank (every rank runs every step, in the same order)."""
        rows = step.sample_rows
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(step):
            logits = graphs.run(step)
            return sample(logits, rows) if rows else None
        fb = ForwardBatch.from_step(step, self.device)
        if step.hidden_indices:
            return self._execute_pooling(fb, step)
        if self.tp_size > 1 and self.server_args.enable_tp_lm_head_all_to_all and rows:
            from servelm.distributed.lm_head_all_to_all import can_use_all_to_all

            if can_use_all_to_all(len(rows)):
                return self._sample_all_to_all(fb, rows)
        logits = self.forward(fb)
        if not rows or self.tp_rank != 0:
            return None  # every rank holds the full logits; only rank 0 needs the samples
        return sample(logits, rows)

    @torch.inference_mode()
    def _execute_pooling(self, fb: ForwardBatch, step: StepInput) -> SampleOutput | None:
        """A decoder embedder's step: the last hidden states of `step.hidden_indices` (after the final norm),
        normalised as the model's pooling says, as float32 in base64; rows to sample, if any, as usual."""
        import base64

        fb.kv_cache = self.kv_cache
        hidden = self.model.model(fb)
        out = SampleOutput([], [], [])
        if step.sample_rows:
            logits = self.model.logits_processor(hidden[fb.logits_indices], self.model.lm_head)  # collective
            if self.tp_rank == 0:  # only rank 0 samples (the others' rows are placeholders)
                out = sample(logits, step.sample_rows)
        if self.tp_rank != 0:
            return None
        vectors = hidden[torch.tensor(step.hidden_indices, device=hidden.device)].float()
        if self.pooling is not None and self.pooling.normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        out.hidden = [base64.b64encode(row.tobytes()).decode() for row in vectors.cpu().numpy().astype("<f4")]
        return out

    def _sample_all_to_all(self, fb: ForwardBatch, rows: list[Any]) -> SampleOutput:
        """Each rank samples its block of rows from [rows/tp, V] logits; only the results are gathered."""
        import torch.distributed as dist

        from servelm.distributed.lm_head_all_to_all import gather_sampled_tokens, lm_head_all_to_all, my_rows
        from servelm.distributed.parallel_state import get_tp_group

        local = self.forward(fb, gather_logits=False)  # [R, V_padded/tp]
        mine = lm_head_all_to_all(local)[:, : self.vocab_size]  # [R/tp, V]
        out = sample(mine, [rows[i] for i in my_rows(len(rows))])
        token_ids = gather_sampled_tokens(torch.tensor(out.token_ids, dtype=torch.long, device=self.device))
        if not any(r.wants_logprob for r in rows):
            return SampleOutput(token_ids.tolist(), [None] * len(rows), [None] * len(rows))
        parts: list[Any] = [None] * self.tp_size
        dist.all_gather_object(parts, (out.logprobs, out.top_logprobs), group=get_tp_group().cpu_group)
        return SampleOutput(token_ids.tolist(), [x for p in parts for x in p[0]], [x for p in parts for x in p[1]])

    def follow(self) -> None:
        """Non-zero TP ranks: execute every step rank 0 sends (keep-alives skipped), until it closes."""
        from servelm.distributed.step_channel import receive_steps

        for step in receive_steps():
            self._execute(step)

    def shutdown(self) -> None:
        """Rank 0: release the followers from `follow()` and leave the process group."""
        if self._sender is not None:
            from servelm.distributed.parallel_state import destroy_distributed

            self._sender.close()
            self._sender = None
            destroy_distributed()

    def tp_channel_stats(self) -> dict[str, int]:
        """Rank 0 under TP: steps sent to the other ranks and their pickled bytes (only what changed)."""
        if self._sender is None:
            return {}
        return {"tp_steps_sent": self._sender.steps_sent, "tp_step_bytes_sent": self._sender.step_bytes_sent}

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "architecture": self.config.architectures[0],
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                "fast_path": self.fast_path, "tp_size": self.tp_size, "load_seconds": round(self.load_seconds, 2),
                "quantization": self.quant_policy.mode, "weight_formats": self.weight_formats(),
                "weight_bytes": self.weight_bytes, **self.kv_cache.describe(),
                **(self.decode_graphs.describe() if self.decode_graphs is not None else {}),
                **({"cuda_graph_error": self.decode_graphs_error} if self.decode_graphs_error else {}),
                **({"task": "embed", "embedding_dimensions": self.config.hidden_size, "pooling": self.pooling.mode,
                    "normalize": self.pooling.normalize} if self.pooling is not None else {})}


def _quant_weights(module: Any, lookup: bool = True) -> list[Any]:
    """The QuantWeights a module holds: a linear's weight or its parts, an embedding's lookup blocks (with
    `lookup`)."""
    parts = getattr(module, "qweight_parts", None) or []
    return [qw for qw in (getattr(module, "qweight", None), *parts, getattr(module, "lookup_qweight", None) if lookup
                          else None) if qw is not None]


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, transformers, the tokenizer, the model's modules: ~815,000
    on the default model) out of the cyclic garbage collector's reach, as vLLM does (`gc.freeze`). A full
    collection had walked all of them: 320 ms on a 2-core EPYC, one stalled step each time the requests'
    short-lived objects set one off (perf saw gc_collect_main in 7% of a decode run's samples)."""
    import gc

    gc.collect()
    gc.freeze()
