"""Tensor parallelism end to end: TP>1 gives the TP=1 tokens (and logprobs), offline and through the server.

Every test runs real rank processes over gloo on this CPU.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from servelm.entrypoints.engine import Engine
from servelm.kernels import quant
from servelm.layers import batch_invariant
from tests.conftest import build_tiny_model
from tests.server_fixtures import REPO_ROOT, free_port, start_server

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True, "prompt_logprobs": True}


def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(2, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, default_tokenizer_dir):
    out = {}
    for arch in ("llama", "qwen3"):
        out[arch], _ = build_tiny_model(tmp_path_factory.mktemp(arch), default_tokenizer_dir, arch, std=0.5)
    return out


def _run(folder, **kw) -> list[dict]:
    engine = Engine(model_path=str(folder), max_total_tokens=2048, **kw)
    try:
        # The last prompt's output is constrained: its allowed-token mask travels with its sampling row.
        constrained = {**GREEDY, "regex": "[0-9]{2,12}"}
        outs = engine.generate(input_ids=_prompts(), sampling_params=[GREEDY] * 3 + [constrained])
        assert re.fullmatch("[0-9]{2,12}", outs[-1]["text"]), outs[-1]["text"]
        return outs
    finally:
        engine.shutdown()


def _assert_same(a: list[dict], b: list[dict], tol: float = 1e-4) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        # logprob = logit - logsumexp(logits): a logit error shows up here.
        assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True)) < tol
        # Prompt scoring rows travel with the sampled ones (also through the LM-head all-to-all).
        assert x["prompt_logprobs"][0] is None is y["prompt_logprobs"][0]
        assert max(abs(p - q) for p, q in zip(x["prompt_logprobs"][1:], y["prompt_logprobs"][1:], strict=True)) < tol


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp_equals_tp1_offline(arch: str, tiny_models) -> None:
    base = _run(tiny_models[arch])
    _assert_same(_run(tiny_models[arch], tp_size=2), base)
    _assert_same(_run(tiny_models[arch], tp_size=2, enable_tp_lm_head_all_to_all=True), base)


def test_tp2_deterministic_tied_fp32_head_equals_tp1(tiny_models) -> None:
    """The tied Llama's fp32 LM head reads each rank's plain vocab shard in place (oneDNN, no packed copy), padded
    to probed row counts in deterministic mode."""
    base = _run(tiny_models["llama"])
    try:
        _assert_same(_run(tiny_models["llama"], tp_size=2, enable_deterministic_inference=True), base)
    finally:
        batch_invariant.set_batch_invariant(False)  # process-wide: off for the tests after this one


def test_tp4_replicates_kv_heads(tiny_models) -> None:
    """4 ranks over 2 KV heads: each KV head is replicated on two ranks."""
    base = _run(tiny_models["qwen3"])
    _assert_same(_run(tiny_models["qwen3"], tp_size=4, enable_tp_lm_head_all_to_all=True), base)


def test_multi_node_layout(tiny_models) -> None:
    """Two 'nodes' on one machine: node 1 runs `servelm serve --node-rank 1`, node 0 is the offline Engine."""
    addr = f"127.0.0.1:{free_port()}"
    folder = str(tiny_models["llama"])
    node1 = subprocess.Popen([sys.executable, "-m", "servelm", "serve", "--model-path", folder, "--tp", "2",
                              "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                              "--max-total-tokens", "2048"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        out = _run(folder, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
        assert node1.wait(timeout=60) == 0, node1.stderr.read()
    finally:
        if node1.poll() is None:
            node1.kill()
    _assert_same(out, _run(folder))


def test_server_tp2_matches_offline_tp1(tiny_models, tmp_path) -> None:
    folder = tiny_models["llama"]
    expected = _run(folder)
    srv = start_server(["--model-path", str(folder), "--tp", "2", "--max-total-tokens", "2048"],
                       tmp_path / "server.log")
    try:
        for ids, exp in zip(_prompts()[:3], expected[:3], strict=True):  # the unconstrained ones
            r = httpx.post(f"{srv.base_url}/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == exp["output_ids"]
        # A rank that dies takes the whole server down: non-zero exit, no orphans.
        sched = [p for p in psutil.Process(srv.proc.pid).children() if _is_spawned(p)]
        assert len(sched) == 1
        workers = [p for p in sched[0].children() if _is_spawned(p)]
        assert len(workers) == 1  # TP rank 1
        children = srv.children()
        workers[0].kill()
        code = srv.wait_exit(30)
        assert code != 0
        assert "TP rank 1 died" in srv.log()
        time.sleep(0.5)
        assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        srv.stop()


def _is_spawned(p: psutil.Process) -> bool:
    """A multiprocessing 'spawn' child (not the resource tracker)."""
    try:
        return any("spawn_main" in part for part in p.cmdline())
    except psutil.Error:
        return False


def test_tp2_on_default_model_fails_at_startup_naming_the_heads() -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "servelm", "generate", "--prompt", "hi", "--tp", "2"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "Error: --tp-size 2 does not divide the model's 9 attention heads and 3 key/value heads (the model has 9 "
        "attention heads and 3 key/value heads); choose a tensor-parallel size that divides them")
    assert time.monotonic() - t0 < 60


# TP=1 and TP=3 on the default model. On the fp32 path (SERVELM_QUANT_KERNEL=torch: the weights dequantized,
# fp32 activations) only the row-parallel shards' sum order differs: ~1e-3 nats apart. On the int8 kernels each
# run's activation codes (a scale per 32) round another way wherever an fp32 order moves a value across a code
# boundary, and the flips add up over 30 layers: on "What is the capital of France?" TP=1 and TP=3 each part from
# fp32 by up to 0.29 and 0.40 nats at one of 12 positions, and from each other by up to 0.35, 0.06-0.09 on average
# (measured on a Zen 3 EPYC, AVX2). A broken shard moves every position by nats.
TP_LOGPROB_TOL = {"torch": (1e-2, 1e-2), "kernels": (1.0, 0.2)}  # (at any position, on average)


@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_tp3_on_default_model_follows_tp1(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP=3 on the default model (Q4_1 kept; 9 heads, 3 KV heads) computes TP=1's model: the row-parallel
    projections' shards are summed in another fp32 order, so the two can part at a near tie (on a Zen 3 EPYC,
    AVX2, "What is the capital of France?" gave "The capital of France is Paris." on one rank and "L'Etoile, la
    Marseillaise," on three, from a first token 0.0067 nats ahead of the second: the same greedy text is not a
    promise the arithmetic can keep). So TP=3 scores TP=1's greedy continuation teacher-forced: every logprob
    within TP_LOGPROB_TOL of TP=1's, and its argmax TP=1's token wherever TP=1's top two are further apart than
    twice that."""
    before = quant.kernel_backend()
    if path == "torch":
        monkeypatch.setenv(quant.FORCE_ENV, "torch")  # the spawned ranks read it at start-up
        quant.force_backend("torch")  # this process resolved its path once, with the first kernel call
    try:
        _tp3_follows_tp1(*TP_LOGPROB_TOL[path])
    finally:
        quant.force_backend(before)


def _tp3_follows_tp1(at_most: float, on_average: float) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    engine = Engine(max_total_tokens=2048)
    try:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        one = engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                "ignore_eos": True, "logprobs": True,
                                                                "top_logprobs": 2})[0]
    finally:
        engine.shutdown()
    engine = Engine(max_total_tokens=2048, tp_size=3)
    try:
        three = engine.generate(input_ids=[ids + one["output_ids"]],
                                sampling_params={"max_new_tokens": 1, "temperature": 0, "prompt_logprobs": True,
                                                 "prompt_top_logprobs": 1})[0]
    finally:
        engine.shutdown()
    assert one["text"].strip() and len(one["output_ids"]) == 12
    rows = []  # (position, TP=1's top-two gap, TP=3's logprob - TP=1's, TP=3's argmax is TP=1's token)
    for i, token in enumerate(one["output_ids"]):
        at = len(ids) + i
        (top, top_lp), (_, second_lp) = one["top_logprobs"][i][:2]
        assert top == token
        rows.append((i, round(top_lp - second_lp, 4), round(three["prompt_logprobs"][at] - one["logprobs"][i], 4),
                     three["prompt_top_logprobs"][at][0][0] == token))
    assert all(abs(d) < at_most for _, _, d, _ in rows), rows
    assert sum(abs(d) for _, _, d, _ in rows) / len(rows) < on_average, rows
    assert all(same for _, gap, _, same in rows if gap > 2 * at_most), rows


@pytest.mark.parametrize(("kv", "tol"), [("bfloat16", 1e-3), ("int8", 5e-3)])
def test_tp2_equals_tp1_with_a_kv_cache_dtype(kv: str, tol: float, tiny_models) -> None:
    """Heads are sharded whole, and each is encoded on its own (int8: a scale per token and head): TP=2 gives
    TP=1's tokens with the same KV dtype; logprobs within what a flipped rounding of a K/V value can move."""
    base = _run(tiny_models["llama"], kv_cache_dtype=kv)
    _assert_same(_run(tiny_models["llama"], tp_size=2, kv_cache_dtype=kv), base, tol)


def test_tp2_with_speculation_equals_tp1(tiny_models) -> None:
    """The drafts ride in the step to the other rank: TP=2 with `suffix` (the second pass drafted from the
    first one's outputs) gives TP=1's tokens and logprobs without speculation."""
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": True}
    outs = {}
    for tp, algo in ((1, None), (2, "suffix")):
        engine = Engine(model_path=str(tiny_models["llama"]), max_total_tokens=2048, tp_size=tp,
                        speculative_algorithm=algo, speculative_max_batch=8)
        try:
            outs[tp] = [engine.generate(input_ids=_prompts(), sampling_params=params) for _ in range(2)]
            info = engine.scheduler.server_info()
        finally:
            engine.shutdown()
    assert info["spec_decode_num_accepted_tokens"] > 0
    for a, b in zip(outs[2], outs[1], strict=True):
        for x, y in zip(a, b, strict=True):
            assert x["output_ids"] == y["output_ids"]
            assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True)) < 1e-4


def test_tp2_with_a_draft_model_gives_tp1_tokens(tiny_models) -> None:
    """--speculative-algorithm draft under TP: the draft (here the target itself, so it always agrees) runs whole
    on rank 0 in a world of one, its proposals ride in the step; the tokens and logprobs are TP=1's without
    speculation, and the draft's KV pool comes back whole."""
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": True}
    outs = {}
    for tp, algo in ((1, None), (2, "draft")):
        engine = Engine(model_path=str(tiny_models["llama"]), max_total_tokens=2048, tp_size=tp,
                        speculative_algorithm=algo, speculative_max_batch=8,
                        speculative_draft_model_path=str(tiny_models["llama"]) if algo else None)
        try:
            outs[tp] = [engine.generate(input_ids=_prompts(), sampling_params=params)]
            info = engine.scheduler.server_info()
            if algo:
                draft = engine.scheduler.spec.draft_model  # type: ignore[union-attr]
                assert draft.runner.tp_size == 1 and draft.free_tokens == draft.runner.num_pages
        finally:
            engine.shutdown()
    assert info["spec_decode_num_drafts"] > 0
    assert info["spec_decode_num_accepted_tokens"] == info["spec_decode_num_draft_tokens"]
    for a, b in zip(outs[2], outs[1], strict=True):
        for x, y in zip(a, b, strict=True):
            assert x["output_ids"] == y["output_ids"]
            assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=True)) < 1e-4
