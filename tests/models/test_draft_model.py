"""Speculative decoding with a draft model (`--speculative-algorithm draft`): the target's own tokens, greedy
and seeded, whether the draft agrees with it always (the same model) or often not (another random model); the
draft's KV pool is returned whole; a pool too small for a context drafts nothing and leaks nothing; the flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servelm.config import ConfigError, ServerArgs
from servelm.entrypoints.engine import Engine
from tests.conftest import build_tiny_model

GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
SEEDED = {**GREEDY, "temperature": 0.8, "top_p": 0.9, "seed": 11}
PROMPTS = [[5, 17, 300, 42, 5, 17, 300, 42, 5, 17], [9, 8, 7, 6, 5, 4, 3], [1000, 20, 33, 44]]


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("draft"), default_tokenizer_dir, "llama", std=0.5, seed=1)[0]


def _run(target: Path, params: dict[str, Any], **kw: Any) -> tuple[list[list[int]], dict[str, Any], Engine]:
    engine = Engine(model_path=str(target), max_total_tokens=2048, **kw)
    outs = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=params)]
    return outs, engine.server_info(), engine


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_targets_tokens_whatever_the_draft(tiny_llama: tuple[Path, Any], other_llama: Path,
                                               params: dict[str, Any]) -> None:
    target = tiny_llama[0]
    base, _, engine = _run(target, params)
    engine.shutdown()
    for draft in (target, other_llama):
        outs, info, engine = _run(target, params, speculative_algorithm="draft",
                                  speculative_draft_model_path=str(draft), speculative_max_batch=4)
        try:
            assert outs == base
            assert info["speculative_algorithm"] == "draft" and info["spec_decode_num_drafts"] > 0
            rate = info["spec_decode_num_accepted_tokens"] / info["spec_decode_num_draft_tokens"]
            if params is GREEDY:  # the draft is greedy: the same model agrees always, another one not
                assert rate == 1.0 if draft == target else rate < 1.0
            model = engine.scheduler.spec.draft_model  # type: ignore[union-attr]
            assert model.free_tokens == model.runner.num_pages  # every request gave its draft KV back
        finally:
            engine.shutdown()


def test_a_draft_pool_too_small_drafts_nothing_and_keeps_nothing(tiny_llama: tuple[Path, Any]) -> None:
    from servelm.model_executor.draft import DraftModel
    from servelm.speculative import SpecState

    model = DraftModel(ServerArgs(), str(tiny_llama[0]), 49152, max_tokens=16)
    state = SpecState(k=4)
    assert len(model.propose(state, list(range(3, 10)), 4)) == 4
    assert state.draft_ids == list(range(3, 10)) + state.draft_ids[7:] and len(state.draft_slots) == 10
    assert model.propose(state, list(range(3, 40)), 4) == []  # 37 tokens do not fit 16 slots
    assert state.draft_slots == [] and model.free_tokens == model.runner.num_pages


def test_flags(tiny_llama: tuple[Path, Any], default_tokenizer_dir: Path, tmp_path: Path) -> None:
    path = str(tiny_llama[0])
    with pytest.raises(ConfigError, match="go together"):
        ServerArgs(speculative_algorithm="draft")
    with pytest.raises(ConfigError, match="needs --speculative-algorithm draft"):
        ServerArgs(speculative_draft_model_path=path)
    args = ServerArgs(speculative_config=f'{{"model": "{path}", "num_speculative_tokens": 3}}')
    assert (args.speculative_algorithm, args.speculative_draft_model_path, args.speculative_num_draft_tokens) == (
        "draft", path, 3)
    wide = build_tiny_model(tmp_path / "wide", default_tokenizer_dir, "llama", vocab_size=50000)[0]
    with pytest.raises(ConfigError, match="must share the target's tokenizer"):
        Engine(model_path=path, max_total_tokens=2048, speculative_algorithm="draft",
               speculative_draft_model_path=str(wide))
