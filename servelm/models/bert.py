"""BERT-family encoders (BertModel: MiniLM, bge, e5, gte) for embeddings: bidirectional attention, absolute
positions, token types, post-norm layers; no KV cache (a request is one forward over its whole input).

A batch is packed: everything runs on the batch's real tokens only, [T, H], attention input by input on views
of the packed rows. A padded `BertModel` forward (sentence-transformers' `encode`) pays the MLP and the
projections for every pad position of every input; the projections here multiply by weights pre-packed for
oneDNN once (`prepack`), where torch's default CPU GEMM packs them again on every call. With `--quantization`
(or a quantised BERT GGUF under `auto`) the four projections of each layer are ggml blocks instead, multiplied
by servelm's quantised-weight kernel (`servelm.kernels.quant`: int8 activations with AVX-512 VNNI or AVX2); the
embeddings, norms and heads stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelm.kernels import quant

ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# The same in place (on a projection's fresh output).
ACTIVATIONS_ = {"gelu": lambda x: torch.ops.aten.gelu_(x),
                "gelu_new": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"), "relu": F.relu_}
# The same activations as oneDNN post-ops of the up projection: (attr, algorithm) of _linear_pointwise.
ONEDNN_POST_OPS = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "gelu_pytorch_tanh": ("gelu", "tanh"),
                   "relu": ("relu", "")}
LINEARS = ("qkv", "out", "up", "down")


@dataclass
class PackedBatch:
    """Inputs one after another: ids, positions and token types [T]; where each starts and how long it is."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    token_types: torch.Tensor
    lengths: list[int]

    @classmethod
    def of(cls, seqs: list[list[int]], token_types: list[list[int]] | None = None) -> PackedBatch:
        flat = [t for s in seqs for t in s]
        positions = [p for s in seqs for p in range(len(s))]
        types = [t for ts in token_types for t in ts] if token_types is not None else [0] * len(flat)
        return cls(torch.tensor(flat, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                   torch.tensor(types, dtype=torch.long), [len(s) for s in seqs])

    @property
    def starts(self) -> torch.Tensor:
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        return torch.cumsum(lengths, 0) - lengths


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)  # query, key and value in one matmul
        self.out = nn.Linear(hidden, hidden, dtype=dtype)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.up = nn.Linear(hidden, intermediate, dtype=dtype)
        self.down = nn.Linear(intermediate, hidden, dtype=dtype)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.act = ACTIVATIONS[act]
        self.act_ = ACTIVATIONS_[act]
        self.act_name = act
        self.packed: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None  # see prepack
        # The activation as oneDNN's post-op of the pre-packed up projection, or torch's in place after it (the
        # same bits). NOTE: on AVX2 oneDNN's GELU post-op made MiniLM's up projection 1.5x slower (2,026 rows:
        # 25-26 against 17-18 ms plain, torch's GELU 1.8 ms more; a 2-core Zen 3 EPYC, docs/embeddings.md); it
        # stays fused where torch's CPU capability is AVX-512, where it was chosen.
        self.fuse_post_ops = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        self.quantized: dict[str, quant.QuantWeight] = {}  # projections kept as ggml blocks (see keep_blocks)

    def keep_blocks(self, name: str, qw: quant.QuantWeight) -> None:
        """Projection `name` multiplies by the blocks `qw` from now on (its fp32 weight freed; the bias stays)."""
        lin = getattr(self, name)
        if tuple(qw.shape) != tuple(lin.weight.shape):
            raise ValueError(f"a quantised {name} weight is {list(qw.shape)}, the model expects "
                             f"{list(lin.weight.shape)}")
        self.quantized[name] = qw
        lin.weight = nn.Parameter(lin.weight.new_empty(0), requires_grad=False)

    def prepack(self) -> None:
        """Each projection's weight in oneDNN's blocked layout (the plain copy freed), the activation fused
        into the up projection. NOTE: torch's default CPU GEMM packs the weight again on every call: pre-packed,
        a MiniLM projection runs 3.6x faster at 1,280 rows in fp32 and 3.6x at 10 (measured on a 2-core EPYC,
        docs/embeddings.md); the layout is what inductor's freezing pass emits."""
        self.packed = {}
        for name in LINEARS:
            if name in self.quantized:
                continue
            lin = getattr(self, name)
            self.packed[name] = (torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach().contiguous()),
                                 lin.bias.detach().clone())
            lin.weight = nn.Parameter(lin.weight.new_empty(0), requires_grad=False)

    def _linear(self, name: str, x: torch.Tensor, post: tuple[str, str] | None = None) -> torch.Tensor:
        qw = self.quantized.get(name)
        if qw is not None:
            y = quant.linear(x, qw, getattr(self, name).bias)
            return self.act(y) if post is not None else y
        if self.packed is None:
            y = getattr(self, name)(x)
            return self.act(y) if post is not None else y
        weight, bias = self.packed[name]
        if post is not None and not self.fuse_post_ops:
            return self.act_(torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], ""))
        attr, algorithm = post or ("none", "")
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)

    def forward(self, x: torch.Tensor, lengths: list[int], plan: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """x [T, H]: the batch's inputs one after another, `lengths` tokens each; `plan` (index, reqs) for
        servelm's fused attention (BertEncoder.forward), else torch's."""
        qkv = self._linear("qkv", x)
        if plan is not None:
            attn = self._fused_attention(qkv, *plan)
        else:
            # Attention input by input, on views of the packed rows: no padding, no gather (a padded batch cost
            # 40% more here, a third of it the copies in and out of the padded layout).
            outs, start = [], 0
            for n in lengths:
                q, k, v = qkv[start:start + n].view(n, 3, self.heads, self.head_dim).permute(1, 2, 0, 3).unbind(0)
                outs.append(F.scaled_dot_product_attention(q, k, v).permute(1, 0, 2).reshape(n, -1))
                start += n
            attn = torch.cat(outs) if len(outs) > 1 else outs[0]
        x = self.attn_norm(x + self._linear("out", attn))
        up = self._linear("up", x, ONEDNN_POST_OPS[self.act_name])
        return self.mlp_norm(x + self._linear("down", up))

    def _fused_attention(self, qkv: torch.Tensor, index: torch.Tensor, reqs: torch.Tensor) -> torch.Tensor:
        """Every input's bidirectional attention in one call of servelm's blocked prefill attention
        (`fused.prefill_attention`, not causal), its keys and values the packed rows themselves (index = every
        row). NOTE: torch's SDPA input by input cost ~150-320 us a call on a 2-core Zen 3 EPYC, 6 calls an input,
        ~19% of MiniLM's forward; here a layer's inputs are one call split over the threads
        (docs/embeddings.md)."""
        from servelm.layers import fused

        # bf16 projections: the attention in fp32 on fp32 copies of q, k and v. NOTE: torch's SDPA input by
        # input took 31% of a bf16 MiniLM forward (its math path on 3-D views) on a 2-core Zen 4 EPYC, this
        # kernel with the conversions ~15% (docs/embeddings.md).
        dtype = qkv.dtype
        t, hd = qkv.shape[0], self.heads * self.head_dim
        def dense(a: torch.Tensor) -> torch.Tensor:  # one copy either way (.float() of a strided slice is dense)
            return a.contiguous() if dtype == torch.float32 else a.float()

        q = qkv[:, :hd] if dtype == torch.float32 else qkv[:, :hd].float()
        k = dense(qkv[:, hd:2 * hd]).view(t, self.heads, self.head_dim)
        v = dense(qkv[:, 2 * hd:]).view(t, self.heads, self.head_dim)
        out = q.new_empty(t, hd)
        fused.prefill_attention(q.reshape(t, self.heads, self.head_dim), _Keys(k, v), index, reqs,
                                self.head_dim ** -0.5, out, causal=False)
        return out if dtype == torch.float32 else out.to(dtype)


@dataclass
class _Keys:
    """Keys and values [T, H, D] where `fused.prefill_attention` reads a layer's KV cache (fp32: no scales)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: None = None
    v_scale: None = None


class BertEncoder(nn.Module):
    """`BertModel`'s embeddings and encoder (no pooler: sentence embeddings pool the last hidden states)."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is not supported "
                             "(absolute only)")
        act = config.hidden_act if isinstance(config.hidden_act, str) else "gelu"
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.word = nn.Embedding(config.vocab_size, h, dtype=dtype)
        self.position = nn.Embedding(config.max_position_embeddings, h, dtype=dtype)
        self.token_type = nn.Embedding(max(1, config.type_vocab_size), h, dtype=dtype)
        self.norm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.layers = nn.ModuleList(BertLayer(h, config.num_attention_heads, config.intermediate_size, eps, act, dtype)
                                    for _ in range(config.num_hidden_layers))
        self.hidden_size = h
        self.max_positions = config.max_position_embeddings
        self.fused_attention = False  # see prepack

    def prepack(self) -> bool:
        """Pre-pack the projections for oneDNN (after loading), and take servelm's fused attention where it
        runs (on CPU, in fp32 also under bf16 weights; the kernel library built, `SERVELM_FUSED_OPS` not off);
        False where oneDNN cannot (not a CPU)."""
        from servelm.layers import fused

        # fp32 or bf16 weights: the attention runs in fp32 either way (_fused_attention)
        self.fused_attention = fused.available(self.word.weight.new_empty(0, dtype=torch.float32))
        if not torch.backends.mkldnn.is_available() or self.word.weight.device.type != "cpu":
            return False
        for layer in self.layers:
            layer.prepack()
        return True

    def weight_bytes(self) -> int:
        plain = sum(p.numel() * p.element_size() for p in self.parameters())
        return plain + sum(w.numel() * w.element_size() + b.numel() * b.element_size()
                           for layer in self.layers for w, b in (layer.packed or {}).values()) + sum(
            qw.nbytes for layer in self.layers for qw in layer.quantized.values())

    def quantize(self, fmt: str) -> None:
        """Every projection still in fp32 quantised to `fmt` (`--quantization`; after loading)."""
        for layer in self.layers:
            for name in LINEARS:
                if name not in layer.quantized:
                    layer.keep_blocks(name, quant.quantize(getattr(layer, name).weight.detach(), fmt))

    def weight_formats(self) -> dict[str, int]:
        """How many projections are held in each format ("float32" for the plain ones)."""
        out: dict[str, int] = {}
        for layer in self.layers:
            for name in LINEARS:
                qw = layer.quantized.get(name)
                fmt = qw.fmt if qw is not None else "float32"
                out[fmt] = out.get(fmt, 0) + 1
        return out

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """The last hidden states [T, H] of a packed batch."""
        x = self.word(batch.input_ids) + self.position(batch.positions) + self.token_type(batch.token_types)
        x = self.norm(x)
        plan = None
        if self.fused_attention:  # every row is a key of its own input: index = the rows, reqs = the inputs
            starts = batch.starts
            lens = torch.tensor(batch.lengths, dtype=torch.long)
            plan = (torch.arange(x.shape[0], dtype=torch.long), torch.stack([starts, lens, lens, starts], 1))
        for layer in self.layers:
            x = layer(x, batch.lengths, plan)
        return x

    # ------------------------------------------------------------------------------------------ weights
    def load_weights(self, weights: Any) -> dict[str, torch.Tensor]:
        """Copy HF `BertModel` tensors (names with or without the `bert.` prefix) into the modules. KeyError
        naming what is missing. Returns the tensors it did not use (the pooler, a task head)."""
        state = {}
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            state[name] = tensor
        own = self.state_dict()
        used = set()
        # Projections that come as ggml blocks (a quantised GGUF under --quantization auto) are kept as such:
        # query, key and value stacked when they share a format, else dequantised and stacked in fp32.
        for i, layer in enumerate(self.layers):
            hf = f"encoder.layer.{i}."
            qkv = [state.get(hf + f"attention.self.{w}.weight") for w in ("query", "key", "value")]
            if any(isinstance(t, quant.QuantWeight) for t in qkv):
                if all(isinstance(t, quant.QuantWeight) and t.fmt == qkv[0].fmt for t in qkv):
                    layer.keep_blocks("qkv", quant.cat_rows(qkv))
                    used.update(hf + f"attention.self.{w}.weight" for w in ("query", "key", "value"))
                else:
                    for w in ("query", "key", "value"):
                        t = state[hf + f"attention.self.{w}.weight"]
                        if isinstance(t, quant.QuantWeight):
                            state[hf + f"attention.self.{w}.weight"] = quant.dequantize(t)
            for name, theirs in (("out", "attention.output.dense"), ("up", "intermediate.dense"),
                                 ("down", "output.dense")):
                t = state.get(hf + theirs + ".weight")
                if isinstance(t, quant.QuantWeight):
                    layer.keep_blocks(name, t)
                    used.add(hf + theirs + ".weight")
        for name, t in state.items():
            if isinstance(t, quant.QuantWeight) and name not in used:  # a block matrix outside the projections
                state[name] = quant.dequantize(t)
        mapping = {"word.weight": "embeddings.word_embeddings.weight",
                   "position.weight": "embeddings.position_embeddings.weight",
                   "token_type.weight": "embeddings.token_type_embeddings.weight",
                   "norm.weight": "embeddings.LayerNorm.weight", "norm.bias": "embeddings.LayerNorm.bias"}
        for i in range(len(self.layers)):
            hf, me = f"encoder.layer.{i}.", f"layers.{i}."
            for part in ("weight", "bias"):
                mapping[me + f"out.{part}"] = hf + f"attention.output.dense.{part}"
                mapping[me + f"attn_norm.{part}"] = hf + f"attention.output.LayerNorm.{part}"
                mapping[me + f"up.{part}"] = hf + f"intermediate.dense.{part}"
                mapping[me + f"down.{part}"] = hf + f"output.dense.{part}"
                mapping[me + f"mlp_norm.{part}"] = hf + f"output.LayerNorm.{part}"
                qkv = [hf + f"attention.self.{w}.{part}" for w in ("query", "key", "value")]
                if qkv[0] not in used:  # not kept as blocks above
                    own[me + f"qkv.{part}"].copy_(torch.cat([state[n] for n in qkv]))
                used.update(qkv)
        if "embeddings.token_type_embeddings.weight" not in state:  # models without token types
            state["embeddings.token_type_embeddings.weight"] = torch.zeros_like(own["token_type.weight"])
        for mine, theirs in mapping.items():
            if theirs not in state:
                raise KeyError(f"the checkpoint has no {theirs}")
            if theirs in used:
                continue  # kept as blocks above
            own[mine].copy_(state[theirs])
            used.add(theirs)
        return {k: v for k, v in state.items() if k not in used and not k.endswith("position_ids")}


class BertClassifier(nn.Module):
    """`BertForSequenceClassification` (a cross-encoder: a query and a document in, relevance logits out): the
    encoder, BERT's pooler (dense + tanh over the first token) and the classifier."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.encoder = BertEncoder(config, dtype)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size, dtype=dtype)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, dtype=dtype)
        self.num_labels = config.num_labels

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Logits [B, num_labels]."""
        hidden = self.encoder(batch)
        first = hidden[batch.starts]
        return self.classifier(torch.tanh(self.pooler(first)))

    def load_weights(self, weights: Any) -> None:
        rest = self.encoder.load_weights(weights)
        for mine, theirs in (("pooler", "pooler.dense"), ("classifier", "classifier")):
            for part in ("weight", "bias"):
                if f"{theirs}.{part}" not in rest:
                    raise KeyError(f"the checkpoint has no {theirs}.{part}")
                getattr(self, mine).get_parameter(part).copy_(rest[f"{theirs}.{part}"])


def pool(hidden: torch.Tensor, lengths: list[int], mode: str, normalize: bool) -> torch.Tensor:
    """Sentence embeddings [B, H x modes] from packed hidden states [T, H], as sentence-transformers' Pooling:
    `cls` each input's first token, `last` its last, `max` the largest value of each dimension, `mean` the
    mean, `mean_sqrt_len` the sum over sqrt(length), `weightedmean` the mean weighted by position (1, 2, ...);
    several modes joined by "+" are concatenated in that order; then unit length if `normalize`."""
    lens = torch.tensor(lengths, dtype=torch.long)
    ends = torch.cumsum(lens, 0)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lens)

    def summed(x: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, seq, x)

    parts = []
    for one in mode.split("+"):
        if one == "cls":
            parts.append(hidden[ends - lens])
        elif one == "last":
            parts.append(hidden[ends - 1])
        elif one == "mean":
            parts.append(summed(hidden) / lens[:, None].to(hidden.dtype))
        elif one == "mean_sqrt_len":
            parts.append(summed(hidden) / lens[:, None].to(hidden.dtype).sqrt())
        elif one == "weightedmean":
            weights = (torch.arange(hidden.shape[0]) - torch.repeat_interleave(ends - lens, lens) + 1)
            weights = weights.to(hidden.dtype)[:, None]
            parts.append(summed(hidden * weights) / (lens * (lens + 1) // 2)[:, None].to(hidden.dtype))
        elif one == "max":
            index = seq[:, None].expand_as(hidden)
            parts.append(hidden.new_full((len(lengths), hidden.shape[1]), float("-inf")).scatter_reduce_(
                0, index, hidden, reduce="amax"))
        else:
            raise ValueError(f"pooling {one!r} is not one of cls, last, max, mean, mean_sqrt_len, weightedmean")
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return F.normalize(out, dim=-1) if normalize else out
