"""A tiny random Stable Diffusion pipeline built in code and saved with `save_pretrained` (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("diffusers", reason="the diffusion extra: pip install 'servelm[diffusion]'")


def build_tiny_sd(out: Path, seed: int = 0) -> Path:
    """UNet (2 blocks), VAE (scale 2), CLIP text encoder (2 layers) over a byte-level CLIP tokenizer, DDIM."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    tok_dir = out.parent / f"{out.name}-tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    chars = sorted(ByteLevel.alphabet())  # every byte as a token, alone and word-final: no merges needed
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    (tok_dir / "vocab.json").write_text(json.dumps(vocab))
    (tok_dir / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"), model_max_length=32)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=4, attention_head_dim=4)
    vae = AutoencoderKL(block_out_channels=[8, 16], in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        norm_num_groups=4)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
        max_position_embeddings=32, bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"]))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline's folder (default size 32x32)."""
    return build_tiny_sd(tmp_path_factory.mktemp("tiny_sd") / "sd")
