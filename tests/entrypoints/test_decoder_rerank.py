"""A generative model as a decoder-only reranker (Qwen3-Reranker's way, as SGLang and vLLM serve it), over real
HTTP: /v1/rerank and /v1/score's text_1/text_2 ask each (query, document) pair as a yes/no question and score
P(yes) / (P(yes) + P(no)) of the next token.

The reference is Qwen3-Reranker's own recipe from its model card, run on transformers: the literal ChatML prefix
and suffix (with the empty thinking block) around `<Instruct>: ...\\n<Query>: ...\\n<Document>: ...`, the three
tokenized apart, and the softmax of the last position's `no` and `yes` logits. The server renders the frame
with the model's chat template, so on a tiny random Qwen3 whose template is Qwen3's (thinking off: the empty
block) the prompts must be that recipe's exactly; on the tiny Llama with the default model's ChatML template
the frame is that template's, without the thinking block.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from servelm.entrypoints.serving_rerank import RERANK_INSTRUCTION, RERANK_SYSTEM, yes_no_ids
from tests.conftest import build_tiny_model
from tests.entrypoints.test_reasoning import TEMPLATE as QWEN3_TEMPLATE
from tests.entrypoints.test_rerank import DOCS, QUERY, assert_ranked
from tests.server_fixtures import ServerProcess, start_server

pytestmark = pytest.mark.slow  # starts a server

PREFIX = f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"  # Qwen3-Reranker's model card
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CHATML_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"  # the default model's template: no thinking block


def reference_scores(model: torch.nn.Module, tok: transformers.PreTrainedTokenizerBase, query: str, docs: list[str],
                     instruction: str = RERANK_INSTRUCTION, suffix: str = SUFFIX,
                     keep: int | None = None) -> list[float]:
    pre = tok.encode(PREFIX, add_special_tokens=False)
    post = tok.encode(suffix, add_special_tokens=False)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    scores = []
    for doc in docs:
        body = tok.encode(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}", add_special_tokens=False)
        if keep is not None:
            body = body[:keep - len(pre) - len(post)]
        with torch.no_grad():
            logits = model(torch.tensor([pre + body + post])).logits[0, -1].float()
        scores.append(torch.stack([logits[no], logits[yes]]).log_softmax(-1).exp()[1].item())
    return scores


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> tuple[Path, torch.nn.Module]:
    tok_dir = tmp_path_factory.mktemp("qwen3_reranker_tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(tok_dir)
    return build_tiny_model(tmp_path_factory.mktemp("qwen3_reranker"), tok_dir, "qwen3", std=0.5,
                            tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tokenizer(qwen3: tuple[Path, torch.nn.Module]) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(qwen3[0])


@pytest.fixture(scope="module")
def server(qwen3: tuple[Path, torch.nn.Module], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("decoder_rerank") / "server.log"
    srv = start_server(["--model-path", str(qwen3[0]), "--disable-torch-compile", "--max-total-tokens", "8192",
                        "--served-model-name", "qwen3-reranker"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def test_rerank_equals_qwen3_rerankers_recipe(server: ServerProcess, qwen3: tuple[Path, torch.nn.Module],
                                              tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    ref = reference_scores(qwen3[1], tokenizer, QUERY, DOCS)
    assert max(ref) - min(ref) > 1e-3  # the random model tells the documents apart
    r = _post(server, "/v1/rerank", {"model": "qwen3-reranker", "query": QUERY, "documents": DOCS})
    body = assert_ranked(r, ref, 1e-4)
    results = body["results"]
    pre, post = (len(tokenizer.encode(t, add_special_tokens=False)) for t in (PREFIX, SUFFIX))
    body_tokens = sum(len(tokenizer.encode(f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {d}",
                                           add_special_tokens=False)) for d in DOCS)
    assert body["usage"]["total_tokens"] == body_tokens + len(DOCS) * (pre + post)

    top = _post(server, "/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                    "return_documents": False}).json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in results[:2]] and top[0].get("document") is None


def test_instruction_and_score_pairs(server: ServerProcess, qwen3: tuple[Path, torch.nn.Module],
                                     tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    task = "Given a question about animals, find the passages that answer it"
    ref = reference_scores(qwen3[1], tokenizer, QUERY, DOCS[:3], instruction=task)
    r = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCS[:3], "instruction": task})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(ref, abs=1e-4)
    pairwise = _post(server, "/v1/score", {"text_1": [QUERY, "grass"], "text_2": DOCS[:2]}).json()["data"]
    assert [d["score"] for d in pairwise] == pytest.approx(
        [reference_scores(qwen3[1], tokenizer, q, [d])[0] for q, d in zip([QUERY, "grass"], DOCS[:2])], abs=1e-4)


def test_truncate_prompt_tokens_cuts_the_document(server: ServerProcess, qwen3: tuple[Path, torch.nn.Module],
                                                  tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    long_doc = "llamas eat grass " * 400  # past the model's 1,024 positions
    r = _post(server, "/v1/rerank", {"query": QUERY, "documents": [DOCS[0], long_doc]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents.1", r.text
    r = _post(server, "/v1/rerank", {"query": QUERY, "documents": [DOCS[0], long_doc], "truncate_prompt_tokens": 200})
    assert r.status_code == 200, r.text
    ref = reference_scores(qwen3[1], tokenizer, QUERY, [DOCS[0], long_doc], keep=200)
    assert {x["index"]: x["relevance_score"] for x in r.json()["results"]} == pytest.approx(dict(enumerate(ref)),
                                                                                            abs=1e-4)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "model": "other"}, "model"),
    ("/v1/score", {"text_1": QUERY, "text_2": DOCS, "label_token_ids": [1]}, "label_token_ids"),
    ("/v1/score", {"query": QUERY, "items": DOCS, "label_token_ids": [1], "instruction": "x"}, "instruction"),
])
def test_bad_input_is_a_400_and_the_server_serves_on(server: ServerProcess, path: str, body: dict, param: str) -> None:
    r = _post(server, path, body)
    assert r.status_code in (400, 404), r.text
    err = r.json().get("error", r.json())
    assert err["param"] == param, r.text
    assert _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS[:1]}).status_code == 200


def test_a_chatml_model_reranks_in_its_own_template(parity_server: ServerProcess,
                                                    tiny_llama: tuple[Path, torch.nn.Module]) -> None:
    """The tiny Llama with the default model's ChatML template (no thinking switch): the same question in that
    template's frame, and the chat routes work beside it."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama[0])
    ref = reference_scores(tiny_llama[1], tok, QUERY, DOCS[:3], suffix=CHATML_SUFFIX)
    r = _post(parity_server, "/v1/rerank", {"query": QUERY, "documents": DOCS[:3]})
    assert r.status_code == 200, r.text
    assert {x["index"]: x["relevance_score"] for x in r.json()["results"]} == pytest.approx(dict(enumerate(ref)),
                                                                                            abs=2e-3)


def test_yes_no_ids_need_one_token_each(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    assert yes_no_ids(tokenizer) == (tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no"))

    class NoYes:
        unk_token_id = 0

        def convert_tokens_to_ids(self, word: str) -> int:
            return 0 if word == "yes" else 5

    assert yes_no_ids(NoYes()) is None
