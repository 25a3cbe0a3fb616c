"""Server configuration.

`ServerArgs` is a frozen dataclass and the single home of every default: the
argparse parser is generated from its fields, so a flag's default, type and
help text live in exactly one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from servelm.dataclass_flags import ConfigError, add_flags, load_config_file, opt, values_of

__all__ = ["HTTP_SERVER_FIELDS", "ConfigError", "ServerArgs", "load_config_file"]

# Fields only the HTTP server reads (the offline commands accept them but leave them out of --help).
HTTP_SERVER_FIELDS = frozenset({
    "host", "port", "api_key", "served_model_name", "max_queued_requests", "log_requests", "uvicorn_log_level",
    "disable_uvicorn_access_log", "shutdown_timeout", "tool_call_parser", "reasoning_parser",
    "return_tokens_as_token_ids", "max_logprobs",
})


_opt = opt  # the fields below: help, choices, aliases, negations (servelm.dataclass_flags)


@dataclass(frozen=True)
class ServerArgs:
    # Model
    model_path: str | None = _opt(None, "HF folder, .gguf file, or none for the embedded default model.",
                                  aliases=("--model",))
    tokenizer_path: str | None = _opt(None, "Tokenizer folder (defaults to the model's).")
    served_model_name: str | None = _opt(None, "Model name reported by the API (defaults to the model path).")
    dtype: str = _opt("auto", "Compute dtype; auto = float32 on CPU, bfloat16 on CUDA.",
                      choices=["auto", "float32", "bfloat16", "float16"])
    device: str = _opt("auto", "Device to run on.", choices=["auto", "cpu", "cuda"])
    quantization: str = _opt("auto", "Weight format on CPU. auto: a GGUF keeps its Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/"
                             "IQ4_NL/Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_XS blocks at their own bits (other types dequantised "
                             "to fp32), a HF folder "
                             "stays fp32; none: dequantise everything to fp32; int8 (= q8_0), q8_0, q4_0, q4_1, "
                             "q5_0, q5_1: quantise every linear and the embedding to these blocks of 32 at load "
                             "(tensors already in that format are kept as they are).",
                             choices=["auto", "none", "int8", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
    context_length: int | None = _opt(None, "Override the model's maximum context length.",
                                      aliases=("--max-model-len",))
    chat_template: str | None = _opt(None, "Chat template override: a Jinja file path or template string.")
    trust_remote_code: bool = _opt(False, "Accepted for compatibility; remote code is never run.")
    is_embedding: bool = _opt(False, "Serve the model as an embedding model: /v1/embeddings, no generation "
                              "(SGLang's flag; an encoder such as BertModel, or a sentence-transformers folder, is "
                              "detected without it).")
    runner: str = _opt("auto", "vLLM's --runner: pooling (= --is-embedding), generate, or auto (detected from the "
                       "model).", choices=["auto", "generate", "pooling"])
    pooling: str | None = _opt(None, "How an embedding model pools its token states: mean, cls (first token), last "
                               "(last token), max, mean_sqrt_len or weightedmean (sentence-transformers' modes); "
                               "overrides the model's sentence-transformers files.",
                               choices=["mean", "cls", "last", "max", "mean_sqrt_len", "weightedmean"])

    # HTTP server
    host: str = _opt("127.0.0.1", "Host to bind.")
    port: int = _opt(30000, "Port to bind.")
    api_key: str | None = _opt(None, "Require this bearer token on every API request.")
    max_queued_requests: int = _opt(256, "Requests waiting beyond this answer 429.")
    log_requests: bool = _opt(False, "Log every request and its output.", negations=("--disable-log-requests",))
    log_level: str = _opt("info", "Log level.", choices=["debug", "info", "warning", "error"])
    uvicorn_log_level: str | None = _opt(None, "Log level of uvicorn's own messages (default: --log-level).",
                                         choices=["debug", "info", "warning", "error"])
    disable_uvicorn_access_log: bool = _opt(False, "No access log line per HTTP request.")
    shutdown_timeout: float = _opt(5.0, "On SIGTERM/Ctrl-C, seconds that running requests get to finish before "
                                   "they are ended with an error (new requests get 503 at once).")
    tool_call_parser: str | None = _opt(None, "Read tool calls in the model's own format, which allows "
                                        "tool_choice 'auto': hermes (Qwen2.5/3, Hermes), llama3_json, mistral, "
                                        "pythonic, qwen3_coder, openai (gpt-oss harmony), a plugin's name, or "
                                        "auto (from the chat template).")
    max_logprobs: int = _opt(20, "Most top logprobs a request may ask for (top_logprobs, logprobs, "
                             "prompt_logprobs); -1: any number, and -1 in a request means the whole vocabulary "
                             "(vLLM's flag).")
    return_tokens_as_token_ids: bool = _opt(False, "Logprobs name every token as token_id:N (vLLM's flag; a request's "
                                            "own return_tokens_as_token_ids also turns it on).")
    reasoning_parser: str | None = _opt(None, "Split the model's thinking from its answer into reasoning_content: "
                                        "qwen3, deepseek_r1 (<think>...</think>), openai_gptoss (gpt-oss harmony), "
                                        "a plugin's name, or auto (from "
                                        "the chat template). Structured output and tool calls then apply to the "
                                        "answer after the thinking.")

    # Memory and scheduling
    page_size: int = _opt(1, "Tokens per KV page.")
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens (overrides the memory-based size).")
    cpu_kv_cache_gb: float = _opt(4.0, "KV pool budget on CPU, in GiB.")
    kv_cache_dtype: str = _opt(os.environ.get("SERVELM_KV_CACHE_DTYPE") or "auto",
                               "KV cache storage: auto (bfloat16 on a CPU with AVX-512 BF16, else float16, "
                               "for an fp32 model; fp32 in deterministic mode; the model's dtype otherwise), "
                               "float32, bfloat16, float16, fp8_e4m3, fp8_e5m2, or int8 (a float16 scale per "
                               "token and KV head). The pool holds more tokens by the ratio. Default: "
                               "$SERVELM_KV_CACHE_DTYPE, else auto.",
                               choices=["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8"])
    mem_fraction_static: float = _opt(0.85, "Fraction of free GPU memory after weights used for the KV pool.")
    chunked_prefill_size: int | None = _opt(None, "Token budget per scheduler step (prefill chunks + decodes); "
                                            "default 512 on a CPU, 8192 on a GPU.")
    max_running_requests: int = _opt(64, "Most requests decoding at once.")
    prefix_cache_dir: str | None = _opt(None, "Keep finished prefixes' KV in files under this folder too, and read "
                                        "them back (also after a restart) instead of recomputing them (TP 1).")
    prefix_cache_size_gb: float = _opt(8.0, "Most GB the --prefix-cache-dir files of one model may take; the "
                                       "least recently used go first.")
    disable_radix_cache: bool = _opt(False, "Turn the radix prefix cache off.", aliases=("--no-enable-prefix-caching",),
                                     negations=("--enable-prefix-caching",))
    disable_fast_path: bool = _opt(False, "Eager PyTorch only: plain F.linear instead of oneDNN with pre-packed "
                                          "weights on CPU.", aliases=("--disable-torch-compile",))
    cuda_graph_max_bs: int | None = _opt(None, "CUDA: decode steps of up to this many requests replay captured CUDA "
                                         "graphs (SGLang's flag; default: --max-running-requests, at most 256).")
    disable_cuda_graph: bool = _opt(False, "CUDA: run every decode step eagerly, without CUDA graphs.")
    num_threads: int | None = _opt(None, "CPU threads for the model (default: the CPUs available to the process, "
                                         "from its affinity and cgroup quota).")
    random_seed: int = _opt(0, "Seed for sampling when a request gives none.")
    enable_deterministic_inference: bool = _opt(False, "Batch-invariant kernels and sampling.")

    # Speculative decoding (servelm.speculative)
    speculative_algorithm: str | None = _opt(None, "Speculative decoding: ngram (the request's own context "
                                             "proposes the tokens that followed its last tokens there; vLLM's "
                                             "prompt lookup), suffix (also the prompts and outputs of recent "
                                             "requests), or draft (a smaller model, --speculative-draft-model-path). "
                                             "Output is unchanged; copy-heavy tasks (editing, quoting) decode faster.")
    speculative_num_draft_tokens: int | None = _opt(None, "Most draft tokens a request gets per step (adapted per "
                                                    "request). Default: 8 for ngram and suffix where the weights "
                                                    "take the 16-row kernel (AVX-512 VNNI, AVX2), else 4.")
    speculative_ngram_min_match_window_size: int = _opt(2, "Shortest run of recent tokens that must match.")
    speculative_ngram_max_match_window_size: int = _opt(8, "Longest run of recent tokens tried first.")
    speculative_draft_model_path: str | None = _opt(None, "The draft model of --speculative-algorithm draft: a smaller "
                                                    "model with the target's tokenizer (HF folder or GGUF), run "
                                                    "greedily beside it with a KV pool of its own.")
    speculative_max_batch: int = _opt(2, "Speculate only while at most this many requests decode at once (they "
                                      "share --speculative-num-draft-tokens).")
    speculative_config: str | None = _opt(None, "vLLM's JSON form, as an alias: '{\"method\": \"ngram\", "
                                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 8, "
                                          "\"prompt_lookup_min\": 2}' (method ngram or suffix; or \"model\": a draft "
                                          "model's path).")

    # Parallelism
    tp_size: int = _opt(1, "Tensor-parallel size.", aliases=("--tp", "--tensor-parallel-size"))
    nnodes: int = _opt(1, "Number of nodes.")
    node_rank: int = _opt(0, "This node's rank.")
    dist_init_addr: str | None = _opt(None, "host:port of the torch.distributed rendezvous.")
    dist_timeout: int = _opt(600, "Timeout of collectives, in seconds.")
    dist_interface: str | None = _opt(None, "The network interface (a name such as eth0, or one of its addresses) "
                                      "that the TP ranks of a multi-node group talk over (default: "
                                      "$GLOO_SOCKET_IFNAME, else the interface that routes to --dist-init-addr).")
    quick_allreduce: str = _opt("none", "Quantised all-reduce mode.", choices=["none", "fp", "int8", "int6", "int4"])
    quick_allreduce_min_bytes: int = _opt(1 << 20, "Smallest message that takes the quick all-reduce.")
    enable_tp_lm_head_all_to_all: bool = _opt(False, "Sample vocab-parallel logits after an all-to-all.")
    strict_memory_balance: bool = _opt(False, "Fail when ranks see unbalanced free memory.")
    dp_size: int = _opt(1, "Data-parallel replicas: scheduler processes behind this one API process, each with "
                        "its own KV pool and prefix cache and its own CPUs (x --tp-size processes each).",
                        aliases=("--dp", "--data-parallel-size"))
    dp_cpus: str | None = _opt(None, "Each replica's CPUs, ';' between replicas, e.g. \"0-15;16-31\" (default: "
                               "the CPUs this process may use, split evenly).")
    load_balance_method: str = _opt("cache_aware", "How a request picks its replica: cache_aware (the longest "
                                    "prefix cached there, the least-loaded replica when none holds much or the "
                                    "loads are imbalanced), round_robin, or shortest_queue.",
                                    choices=["cache_aware", "round_robin", "shortest_queue"])

    def step_token_budget(self, device_type: str) -> int:
        """--chunked-prefill-size, or its default on this device: 512 tokens on a CPU (a step of the default
        model's prefill takes ~0.5 s there), 8192 on a GPU (SGLang's order of magnitude)."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return 512 if device_type == "cpu" else 8192

    def __post_init__(self) -> None:
        if self.tp_size > 1 and self.nnodes == 1 and self.node_rank == 0 and self.dist_init_addr is None:
            # In a LeaderWorkerSet pod group, its variables stand in for the multi-node flags left unset.
            from servelm.distributed.network import leader_worker_set_defaults

            lws = leader_worker_set_defaults()
            if lws and int(lws["nnodes"]) > 1 and self.tp_size % int(lws["nnodes"]) == 0:  # type: ignore[call-overload]
                for name, value in lws.items():
                    object.__setattr__(self, name, value)
        checks = [
            (self.page_size >= 1, f"--page-size must be >= 1, got {self.page_size}"),
            (self.chunked_prefill_size is None or self.chunked_prefill_size >= 1,
             f"--chunked-prefill-size must be >= 1, got {self.chunked_prefill_size}"),
            (self.max_running_requests >= 1, f"--max-running-requests must be >= 1, got {self.max_running_requests}"),
            (self.max_total_tokens is None or self.max_total_tokens >= 1,
             f"--max-total-tokens must be >= 1, got {self.max_total_tokens}"),
            (self.cpu_kv_cache_gb > 0, f"--cpu-kv-cache-gb must be > 0, got {self.cpu_kv_cache_gb}"),
            (self.prefix_cache_size_gb > 0, f"--prefix-cache-size-gb must be > 0, got {self.prefix_cache_size_gb}"),
            (self.prefix_cache_dir is None or self.tp_size == 1,
             f"--prefix-cache-dir needs --tp-size 1 (each rank would keep its own shard), got {self.tp_size}"),
            (self.prefix_cache_dir is None or 256 % self.page_size == 0,
             f"--prefix-cache-dir needs a --page-size that divides 256 (its block), got {self.page_size}"),
            (self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
             f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}"),
            (0 < self.mem_fraction_static < 1,
             f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}"),
            (self.tp_size >= 1, f"--tp-size must be >= 1, got {self.tp_size}"),
            (self.dp_size >= 1, f"--dp-size must be >= 1, got {self.dp_size}"),
            (self.dp_size == 1 or self.nnodes == 1,
             f"--dp-size {self.dp_size} with --nnodes {self.nnodes} is not supported: run one server per node with "
             "its own --dp-size, behind a router (docs/deploy.md)"),
            (self.dp_size == 1 or self.prefix_cache_dir is None,
             "--prefix-cache-dir needs --dp-size 1 (the replicas would write the same files)"),
            (self.dp_cpus is None or self.dp_size > 1, "--dp-cpus needs --dp-size > 1"),
            (self.speculative_draft_model_path is None or (self.speculative_algorithm or "").lower() == "draft",
             "--speculative-draft-model-path needs --speculative-algorithm draft"),
            (self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}"),
            (0 <= self.node_rank < self.nnodes, f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}"),
            (1 <= self.port <= 65535, f"--port must be in [1, 65535], got {self.port}"),
            (self.shutdown_timeout >= 0, f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}"),
            (self.num_threads is None or self.num_threads >= 1, f"--num-threads must be >= 1, got {self.num_threads}"),
            (self.max_queued_requests >= 1, f"--max-queued-requests must be >= 1, got {self.max_queued_requests}"),
        ]
        checks.append((not (self.is_embedding and self.runner == "generate"),
                       "--is-embedding and --runner generate contradict each other: choose one"))
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        if self.speculative_config is not None:
            from servelm.speculative import parse_vllm_config

            for name, value in parse_vllm_config(self.speculative_config).items():
                object.__setattr__(self, name, value)
            object.__setattr__(self, "speculative_config", None)  # now in the fields (replace() must not redo it)
        if self.speculative_algorithm is not None:
            object.__setattr__(self, "speculative_algorithm", self.speculative_algorithm.lower())
            self.spec_config()  # validates
        if self.tool_call_parser not in (None, "auto"):
            from servelm.entrypoints.tool_parsers import parsers

            known_parsers = parsers()
            if self.tool_call_parser not in known_parsers:
                raise ConfigError(f"--tool-call-parser {self.tool_call_parser!r} is not known; choose one of: auto, "
                                  f"{', '.join(known_parsers)}")
        if self.reasoning_parser not in (None, "auto"):
            from servelm.entrypoints.reasoning import formats

            known = formats()
            if self.reasoning_parser not in known:
                raise ConfigError(f"--reasoning-parser {self.reasoning_parser!r} is not known; choose one of: auto, "
                                  f"{', '.join(known)}")

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, hidden: frozenset[str] = frozenset()) -> None:
        """Add one flag per field; defaults, types and help come from the field. Fields in `hidden` are
        still accepted but left out of --help (e.g. the HTTP server's flags under `servelm generate`)."""
        add_flags(parser, ServerArgs, hidden)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        """The flags, then the --config file's keys for flags the command line did not give."""
        return cls(**values_of(ns, cls))

    def spec_config(self, rows16: bool = False) -> Any:
        """The speculative decoding settings (servelm.speculative.SpecConfig), or None when it is off. `rows16`:
        the model's weights take the 16-row kernel, whose verify rows cost less (a step of k = 8 drafts 2.2x a
        decode step on the default model, against 1.4x for k = 4), so that drafts from the context (ngram,
        suffix) get up to 8 by default: copying 400-token blocks ran 3-17% faster than with 4 on AVX-512 VNNI,
        chat questions alike, and as fast on AVX2 (docs/speculative-decoding.md). A draft model's proposals cost
        a step of it per token: 4."""
        if self.speculative_algorithm is None:
            return None
        from servelm.speculative import SpecConfig

        k = self.speculative_num_draft_tokens
        if k is None:
            k = 8 if rows16 and self.speculative_algorithm != "draft" else 4  # lower-cased at init
        return SpecConfig(self.speculative_algorithm, k,
                          self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size,
                          self.speculative_max_batch, draft_model_path=self.speculative_draft_model_path)

    @property
    def tp_ranks_per_node(self) -> int:
        """TP ranks (model processes) on each node: they share that node's CPUs."""
        return max(1, self.tp_size // self.nnodes)

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)
