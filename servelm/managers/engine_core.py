"""Assembling rank 0 of a model server (as vLLM's `EngineCore` builds both sides): resolve the model, start
this node's other TP ranks, build the model runner, then the scheduler over it.

The scheduler owns neither the processes nor the process group: it gets an `on_shutdown` that releases
them, and the runner gets a way to name a dead rank (`TPWorkers.report_death`), not the workers themselves.
The server's scheduler process and the offline `Engine` both build through here.
"""

from __future__ import annotations

from typing import Any

from servelm.config import ServerArgs
from servelm.managers.scheduler import Scheduler, SchedulerConfig


def build_scheduler(server_args: ServerArgs) -> Scheduler:
    """The scheduler of rank 0, with its model runner and (under TP) this node's other ranks running."""
    from servelm.managers.tp_worker import start_local_workers, with_dist_init_addr
    from servelm.model_executor.model_runner import ModelRunner, check_tp_divisibility, freeze_startup_heap
    from servelm.model_loader.default_model import model_path_or_default
    from servelm.model_loader.source import load_model_source

    # The default model is resolved (and logged) once, here; every rank then gets its path.
    server_args = with_dist_init_addr(
        server_args.replace(model_path=model_path_or_default(server_args.model_path, announce=True)))
    from servelm.model_loader.pooling import embedding_mode

    embedding = embedding_mode(server_args, server_args.model_path)
    if embedding and _is_encoder(server_args.model_path):
        return build_embedding_scheduler(server_args)
    if embedding:  # a decoder (Qwen3-Embedding): the KV-paged scheduler, every request pooled at its last token
        server_args = server_args.replace(is_embedding=True)
    # Checked before any rank process starts, so a bad --tp-size is one clear error.
    source = load_model_source(server_args.model_path)
    check_tp_divisibility(source.config, server_args.tp_size)
    workers = start_local_workers(server_args)
    try:
        runner = ModelRunner(server_args, tp_rank=0, source=source)
    except BaseException:
        if workers is not None:
            workers.stop(timeout=0)
        raise
    if workers is not None:
        runner.dead_rank_reporter = workers.report_death
    rows16 = getattr(runner, "rows16", False)  # the 16-row kernel's cheaper verify rows: more drafts by default
    cfg = SchedulerConfig(num_pages=runner.num_pages, page_size=server_args.page_size,
                          chunked_prefill_size=server_args.step_token_budget(runner.device.type),
                          max_running_requests=server_args.max_running_requests,
                          max_context_len=runner.max_context_len,
                          model_context_len=runner.model_context_len,
                          disable_radix_cache=server_args.disable_radix_cache,
                          random_seed=server_args.random_seed,
                          deterministic=server_args.enable_deterministic_inference,
                          speculative=None if embedding else server_args.spec_config(rows16=rows16),
                          embedding=embedding)
    disk = None
    if server_args.prefix_cache_dir and not server_args.disable_radix_cache:
        from servelm.mem_cache.disk_cache import DiskPrefixCache

        disk = DiskPrefixCache(server_args.prefix_cache_dir, runner.model_path, runner.kv_cache,
                               int(server_args.prefix_cache_size_gb * 1e9))
    scheduler = Scheduler(runner, runner.tokenizer, cfg, runner.eos_token_ids, runner.vocab_size,
                          runner.model_info(), on_shutdown=lambda: _shutdown(runner, workers), disk_cache=disk)
    spec = cfg.speculative
    if spec is not None and spec.algorithm == "draft" and scheduler.spec is not None:
        from servelm.model_executor.draft import DraftModel

        # Room for the context of every request that may speculate at once, and their drafts.
        tokens = min(runner.num_pages * server_args.page_size,
                     spec.max_batch * (runner.max_context_len + spec.num_draft_tokens))
        scheduler.spec.draft_model = DraftModel(server_args, str(spec.draft_model_path), runner.vocab_size, tokens)
    freeze_startup_heap()
    return scheduler


def _is_encoder(model_path: str) -> bool:
    import os

    from servelm.model_loader.model_path import ENCODER_ARCHITECTURES, read_hf_config

    if os.path.isfile(model_path):
        from servelm.model_loader.gguf_bert import architecture

        return architecture(model_path) == "bert"
    try:
        return read_hf_config(model_path)[1] in ENCODER_ARCHITECTURES
    except Exception:  # not a model servelm knows: the runner says so
        return True


def build_embedding_scheduler(server_args: ServerArgs) -> Any:
    """An embedding server's scheduler over its encoder (no KV pool, no TP ranks)."""
    from servelm.managers.embedding_scheduler import EmbeddingScheduler
    from servelm.model_executor.embedding_runner import EmbeddingRunner
    from servelm.model_executor.model_runner import freeze_startup_heap

    runner = EmbeddingRunner(server_args, server_args.model_path)
    # The token budget of a step: at least a whole longest input; more inputs share the forward.
    budget = max(server_args.step_token_budget("cpu") * 4, runner.max_context_len)  # encoders run on the CPU
    scheduler = EmbeddingScheduler(runner, budget, runner.max_context_len, runner.config.vocab_size)
    freeze_startup_heap()
    return scheduler


def _shutdown(runner: Any, workers: Any) -> None:
    """Release the other TP ranks from their follow loop and leave the process group, then reap them."""
    if workers is not None:
        workers.expect_exit()  # their exit is no longer a death
    runner.shutdown()
    if workers is not None:
        workers.stop()
