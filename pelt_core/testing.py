"""Tiny random-config backbones for tests and examples: no files, no hub, built in a few milliseconds."""

from __future__ import annotations

import torch

from pelt_core.backbones import Backbone

VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + [f"w{i}" for i in range(95)]
    + [
        "good",
        "bad",
        "great",
        "awful",
        "movie",
        "film",
        "the",
        "a",
        "is",
        "was",
        "not",
        "very",
        "fun",
        "boring",
    ]
)


def tiny_tokenizer(tmp_dir: str | None = None):
    """A BERT WordPiece tokenizer over a small fixed vocabulary (tmp_dir is unused, kept for call symmetry)."""
    from transformers import BertTokenizerFast

    return BertTokenizerFast(vocab={word: i for i, word in enumerate(VOCAB)}, do_lower_case=True)


def tiny_bert_config(**overrides):
    """The config of the tiny BERT: 2 layers, hidden 32, 4 heads, no dropout unless overridden."""
    from transformers import BertConfig

    settings = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **overrides}
    return BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        **settings,
    )


def tiny_bert(tmp_dir: str, seed: int = 0, attn_implementation: str = "sdpa", **overrides) -> Backbone:
    """A 2-layer BERT (hidden 32, 4 heads) with random weights and its tokenizer; no dropout unless overridden."""
    from transformers import BertModel

    torch.manual_seed(seed)
    config = tiny_bert_config(**overrides)
    config._attn_implementation = attn_implementation
    model = BertModel(config, add_pooling_layer=False).eval()
    return Backbone(model, tiny_tokenizer(tmp_dir), name=f"tiny-bert-{seed}")


def tiny_llama(tmp_dir: str, seed: int = 0, attn_implementation: str = "sdpa", **overrides) -> Backbone:
    """A 2-layer Llama (hidden 32, 4 query heads, 2 key/value heads) with random weights."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        **overrides,
    )
    config._attn_implementation = attn_implementation
    model = LlamaModel(config).eval()
    return Backbone(model, tiny_tokenizer(tmp_dir), name=f"tiny-llama-{seed}")
