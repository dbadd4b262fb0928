"""Tiny random-weight transformers checkpoints, built locally (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never wait on a network

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 97


def _spread(model, std=0.25, seed=0):
    """Random weights large enough that logits differ by O(1) between tokens (the init's
    std 0.02 makes every logit ~0, and a parity test on ~0 proves little)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or "LayerNorm" in name:
                p.copy_(
                    1 + 0.1 * torch.randn(p.shape, generator=g)
                    if p.dim() == 1 and "bias" not in name
                    else 0.1 * torch.randn(p.shape, generator=g)
                )
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model.eval()


def configs():
    T = transformers
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, **common)),
        "gpt2-untied": (
            T.GPT2LMHeadModel,
            T.GPT2Config(
                n_layer=1,
                n_head=2,
                n_embd=32,
                n_positions=64,
                n_inner=80,
                tie_word_embeddings=False,
                activation_function="relu",
                **common,
            ),
        ),
        "llama-gqa": (
            T.LlamaForCausalLM,
            T.LlamaConfig(
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                hidden_size=64,
                intermediate_size=96,
                max_position_embeddings=128,
                **common,
            ),
        ),
        "llama-mqa-tied-bias": (
            T.LlamaForCausalLM,
            T.LlamaConfig(
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=1,
                hidden_size=48,
                head_dim=16,
                intermediate_size=64,
                max_position_embeddings=128,
                tie_word_embeddings=True,
                attention_bias=True,
                mlp_bias=True,
                **common,
            ),
        ),
        "llama-yarn": (
            T.LlamaForCausalLM,
            T.LlamaConfig(
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                hidden_size=64,
                intermediate_size=96,
                max_position_embeddings=128,
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                **common,
            ),
        ),
        "llama3-rope": (
            T.LlamaForCausalLM,
            T.LlamaConfig(
                num_hidden_layers=1,
                num_attention_heads=2,
                hidden_size=64,
                intermediate_size=96,
                max_position_embeddings=128,
                rope_theta=50000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
                **common,
            ),
        ),
        "bert": (
            T.BertModel,
            T.BertConfig(
                num_hidden_layers=2,
                num_attention_heads=4,
                hidden_size=64,
                intermediate_size=96,
                max_position_embeddings=64,
                vocab_size=VOCAB,
            ),
        ),
    }


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``hf_checkpoint(name) -> (folder, transformers model in eval mode, eager attention)``."""
    made = {}

    def get(name):
        if name not in made:
            cls, cfg = configs()[name]
            torch.manual_seed(0)
            model = _spread(cls._from_config(cfg, attn_implementation="eager"))
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            made[name] = (folder, model)
        return made[name]

    return get
