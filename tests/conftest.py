"""Shared fixtures: tiny random HF models built in code, with the default model's tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# fp32 KV unless a test asks for another --kv-cache-dtype: the tests compare servelm's tokens with transformers'
# fp32 ones, which a bf16 cache (the `auto` default on an fp32 model) would flip on near ties of the tiny random
# models. Read by servelm.config at import, and inherited by the servers the tests start.
os.environ.setdefault("SERVELM_KV_CACHE_DTYPE", "float32")
torch.set_num_threads(min(2, os.cpu_count() or 1))

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, "LlamaForCausalLM"),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, "MistralForCausalLM"),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, "Qwen2ForCausalLM"),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, "Qwen3ForCausalLM"),
}


@pytest.fixture(scope="session")
def default_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model's tokenizer (with chat template), saved as a HF folder once."""
    from servelm.model_loader.default_model import default_model_path
    from servelm.model_loader.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(default_model_path()).save_pretrained(out)
    return out


def build_tiny_model(out: Path, tokenizer_dir: Path, arch: str = "llama", std: float | None = None,
                     seed: int = 0, **overrides: object) -> tuple[Path, torch.nn.Module]:
    """Save a 2-layer random `arch` model + tokenizer to `out`; returns (folder, the HF reference model)."""
    config_cls, model_cls, arch_name = ARCHS[arch]
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    kwargs: dict = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=len(tok), max_position_embeddings=1024,
                        tie_word_embeddings=arch == "llama", bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config.architectures = [arch_name]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, std)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out, model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> tuple[Path, torch.nn.Module]:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), default_tokenizer_dir, "llama", std=0.5)


def build_bigram_chain_model(out: Path, tokenizer_dir: Path, chain: list[int],
                             messages: list[dict]) -> tuple[Path, list[int]]:
    """A tiny Qwen3 (tokenizer from `tokenizer_dir`) whose weights make it a bigram chain: with o_proj and
    down_proj zero every layer adds nothing to the residual stream, so the logits depend on the current token
    alone, and lm_head row y is aimed at token x's normalised embedding for each link x -> y of `chain` (whose
    tokens must be distinct; chain[0] is the generation prompt's last token). Checked against transformers'
    own greedy output after `messages`' generation prompt; returns (folder, that output: chain[1:])."""
    assert len(set(chain)) == len(chain), chain
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    out, model = build_tiny_model(out, tokenizer_dir, "qwen3", tie_word_embeddings=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        unit = emb / emb.norm(dim=-1, keepdim=True)
        head = model.lm_head.weight
        head.normal_(0.0, 0.01)
        for x, y in zip(chain, chain[1:], strict=False):
            head[y] = 5.0 * unit[x]
    model.save_pretrained(out, safe_serialization=True)
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    assert ids[0, -1].item() == chain[0]
    got = model.generate(ids, max_new_tokens=len(chain) + 2, do_sample=False)[0, ids.shape[1]:].tolist()
    assert got == chain[1:], (got, chain)
    return out, got
