"""BERT encoders from GGUF files as llama.cpp's `convert_hf_to_gguf.py` writes them (`general.architecture`
"bert"): the config and pooling from the metadata, the tensors under their Hugging Face names (dequantised to
fp32: an encoder is small), and the WordPiece tokenizer rebuilt from the file's vocabulary. transformers'
GGUF loader does not read BERT files.

llama.cpp stores the WordPiece vocabulary in SentencePiece's spelling: a token that starts a word carries a
"▁" prefix, a continuation drops WordPiece's "##", and control tokens ([CLS], [SEP], ...) are as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import transformers

from servelm.model_loader.model_path import ModelSourceError

# llama.cpp's enum llama_pooling_type
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
_LAYER = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
          "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
          "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
_TOP = {"token_embd": "embeddings.word_embeddings", "position_embd": "embeddings.position_embeddings",
        "token_types": "embeddings.token_type_embeddings", "token_embd_norm": "embeddings.LayerNorm"}
_TOKEN_TYPE_CONTROL = 3


@lru_cache(maxsize=4)
def _reader(path: str) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def architecture(path: str) -> str | None:
    """`general.architecture` of a GGUF file (None when it cannot be read)."""
    try:
        return _field(_reader(path), "general.architecture")
    except Exception:  # not a GGUF file gguf can read: the model loader says why
        return None


def config(path: str) -> transformers.BertConfig:
    r = _reader(path)

    def need(key: str) -> Any:
        value = _field(r, f"bert.{key}")
        if value is None:
            raise ModelSourceError(f"{path}: the GGUF metadata has no bert.{key}")
        return value

    vocab = _field(r, "tokenizer.ggml.tokens")
    cfg = transformers.BertConfig(
        vocab_size=len(vocab) if vocab else 30522, hidden_size=int(need("embedding_length")),
        num_hidden_layers=int(need("block_count")), num_attention_heads=int(need("attention.head_count")),
        intermediate_size=int(need("feed_forward_length")), max_position_embeddings=int(need("context_length")),
        layer_norm_eps=float(need("attention.layer_norm_epsilon")),
        type_vocab_size=int(_field(r, "tokenizer.ggml.token_type_count", 2)), hidden_act="gelu")
    cfg.architectures = ["BertModel"]
    return cfg


def pooling_mode(path: str) -> str:
    return GGUF_POOLING.get(int(_field(_reader(path), "bert.pooling_type", 2)), "cls")


_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")


def tensors(path: str, keep_formats: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor | Any]]:
    """Every tensor under its Hugging Face `BertModel` name, as fp32; a layer's projection whose ggml type is
    in `keep_formats` (kernel format names) as a `QuantWeight` of the file's blocks instead."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from servelm.kernels import quant

    for t in _reader(path).tensors:
        name, _, part = t.name.rpartition(".")
        if name.startswith("blk."):
            _, index, kind = name.split(".", 2)
            if kind not in _LAYER:
                raise ModelSourceError(f"{path}: unexpected BERT tensor {t.name}")
            hf = f"encoder.layer.{index}.{_LAYER[kind]}.{part}"
        elif name in _TOP:
            hf = f"{_TOP[name]}.{part}"
        else:
            continue  # a classifier or pooler head this loader does not serve
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dimensions innermost first
        fmt = t.tensor_type.name.lower()
        if name.startswith("blk.") and kind in _PROJECTIONS and part == "weight" and fmt in keep_formats:
            yield hf, quant.from_gguf(t.data, fmt, tuple(shape))
            continue
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = np.asarray(t.data, dtype=np.float32)
        else:
            data = dequantize(t.data, t.tensor_type)
        yield hf, torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))  # a writable copy


def tokenizer(path: str) -> transformers.PreTrainedTokenizerFast:
    """The BERT WordPiece tokenizer of a llama.cpp BERT GGUF (lowercasing as its metadata says)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    r = _reader(path)
    if _field(r, "tokenizer.ggml.model") != "bert":
        raise ModelSourceError(f"{path}: the tokenizer is not BERT's WordPiece")
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == _TOKEN_TYPE_CONTROL:
            word = token
        elif token.startswith("▁"):
            word = token[1:]
        else:
            word = "##" + token
        vocab.setdefault(word, i)

    def special(key: str, fallback: str) -> str:
        index = _field(r, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None else fallback

    cls, sep = special("bos", "[CLS]"), special("seperator", special("eos", "[SEP]"))
    unk, pad, mask = special("unknown", "[UNK]"), special("padding", "[PAD]"), special("mask", "[MASK]")
    lowercase = bool(_field(r, "tokenizer.ggml.normalizer.lowercase", True))
    tok = Tokenizer(WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tok.decoder = decoders.WordPiece(prefix="##")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, cls_token=cls, sep_token=sep, unk_token=unk,
                                                pad_token=pad, mask_token=mask, model_max_length=512,
                                                model_input_names=["input_ids", "token_type_ids", "attention_mask"])
