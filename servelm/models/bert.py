"""BERT-family encoders (BertModel: MiniLM, bge, e5, gte) for embeddings: bidirectional attention, absolute
positions, token types, post-norm layers; no KV cache (a request is one forward over its whole input).

A batch is packed: the token-wise work (embeddings, the projections, the MLP, the norms) runs on the batch's
real tokens only, [T, H]; only attention pads, to the batch's longest input, with a key mask. This is where
it beats a padded `BertModel` forward (sentence-transformers' `encode`), which pays the MLP and projections for
every pad position of every input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


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

    def forward(self, x: torch.Tensor, pad: torch.Tensor, real: torch.Tensor, mask: torch.Tensor,
                shape: tuple[int, int]) -> torch.Tensor:
        """x [T, H] packed; `pad` [B*L] indexes rows of x plus a zero row (index T) into the padded layout,
        `real` [T] the padded rows that are tokens; mask [B, 1, 1, L] marks real keys."""
        batch, longest = shape
        qkv = self.qkv(x)
        qkv = torch.cat([qkv, qkv.new_zeros(1, qkv.shape[1])])[pad]
        q, k, v = qkv.view(batch, longest, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, L, D]
        attn = attn.transpose(1, 2).reshape(batch * longest, -1)[real]
        x = self.attn_norm(x + self.out(attn))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


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

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """The last hidden states [T, H] of a packed batch."""
        x = self.word(batch.input_ids) + self.position(batch.positions) + self.token_type(batch.token_types)
        x = self.norm(x)
        lengths = torch.tensor(batch.lengths, dtype=torch.long)
        count, longest, total = len(batch.lengths), max(batch.lengths), x.shape[0]
        slot = torch.arange(longest).expand(count, longest)
        valid = slot < lengths[:, None]  # [B, L]
        pad = torch.full((count, longest), total, dtype=torch.long)
        pad[valid] = torch.arange(total)
        real = valid.reshape(-1).nonzero().squeeze(1)
        mask = valid[:, None, None, :]
        for layer in self.layers:
            x = layer(x, pad.reshape(-1), real, mask, (count, longest))
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
                own[me + f"qkv.{part}"].copy_(torch.cat([state[n] for n in qkv]))
                used.update(qkv)
        if "embeddings.token_type_embeddings.weight" not in state:  # models without token types
            state["embeddings.token_type_embeddings.weight"] = torch.zeros_like(own["token_type.weight"])
        for mine, theirs in mapping.items():
            if theirs not in state:
                raise KeyError(f"the checkpoint has no {theirs}")
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
    """Sentence embeddings [B, H] from packed hidden states [T, H]: `mean` over each input's tokens, `cls` its
    first token, `last` its last token; then unit length if `normalize`."""
    lens = torch.tensor(lengths, dtype=torch.long)
    ends = torch.cumsum(lens, 0)
    if mode == "cls":
        out = hidden[ends - lens]
    elif mode == "last":
        out = hidden[ends - 1]
    elif mode == "mean":
        seq = torch.repeat_interleave(torch.arange(len(lengths)), lens)
        out = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, seq, hidden)
        out = out / lens[:, None].to(hidden.dtype)
    else:
        raise ValueError(f"pooling {mode!r} is not one of mean, cls, last")
    return F.normalize(out, dim=-1) if normalize else out
