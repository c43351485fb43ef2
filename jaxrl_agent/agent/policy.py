"""HOST: the policy an agent job acts with: where it comes from (`PolicyConfig`, the shipped
`DEMO_POLICY_DIR`), loading it with its tokenizer (`load_policy`), and the size of one trained
from scratch (`TinyModelConfig`).

    HF directory --hf.load_pretrained--> CausalLM ---+--> (model, tokenizer), vocabularies checked
                 --tokenizer.load_tokenizer--------'
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from jaxrl_agent import hf
from jaxrl_agent.model.decoder import ModelConfig
from jaxrl_agent.tokenizer import has_tokenizer_files, load_tokenizer

# The SFT policy of `python -m experiments.binary_search_rl`, copied by its --ship_demo_policy=true.
DEMO_POLICY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo_policy")


@dataclass(frozen=True)
class PolicyConfig:
    """Where a policy comes from."""

    path: str = DEMO_POLICY_DIR
    """HF checkpoint directory (the repo ships a tiny demo policy here)."""
    tokenizer: str = "file"
    """How its tokenizer is read (`tokenizer.load_tokenizer`): "file" (tokenizer.json as
    written: the tokenizer the policy trained with) or "auto" (what transformers' AutoTokenizer
    builds: Qwen2Tokenizer for our exports, whose pre-tokenizer is not the file's; for
    directories without tokenizer.json)."""


@dataclass(frozen=True)
class TinyModelConfig:
    """Size of a policy trained from scratch (Qwen2-style: qkv bias, tied embeddings)."""

    hidden_size: int = 128
    """D."""
    num_layers: int = 4
    """Decoder blocks."""
    num_heads: int = 4
    """Query heads (head_dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Key/value heads."""
    intermediate_size: int = 384
    """SwiGLU width."""

    def build(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.hidden_size // self.num_heads, rope_theta=10000.0, qkv_bias=True,
                           tie_word_embeddings=True, architecture="Qwen2ForCausalLM")


def load_policy(path: str, tokenizer: str = "file"):
    """(model, tokenizer) from an HF directory; a clear error when it is missing. The tokenizer
    is the directory's own when it has one (read in `tokenizer` mode, `load_tokenizer`), else
    the repo's tiny tokenizer (older exports); one with more ids than the model has embedding
    rows is refused (sampling would index past it)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"policy directory {path!r} does not exist: train one with "
                                "`python -m jaxrl_agent sft` or pass --policy.path=DIR")
    model, _ = hf.load_pretrained(path)
    own = has_tokenizer_files(path)
    tok = load_tokenizer(path if own else None, tokenizer)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"{'the tokenizer in ' + repr(path) if own else 'the repo tokenizer'} has {tok.vocab_size} "
                         f"ids but the model in {path!r} has vocab_size={model.config.vocab_size}")
    return model, tok
