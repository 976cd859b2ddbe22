"""Models: offline presets (`tiny:<preset>[@seed]`, `smollm2-135m-instruct`) and loading through transformers."""

from agentrl.models.loading import load_causal_lm, load_processor, load_tokenizer
from agentrl.models.smollm2 import SMOLLM2_NAME
from agentrl.models.tiny import PRESETS, parse_tiny_spec, resolve_model_path
from agentrl.models.tokenizer import SPECIAL_TOKENS

__all__ = [
    "PRESETS",
    "SMOLLM2_NAME",
    "SPECIAL_TOKENS",
    "load_causal_lm",
    "load_processor",
    "load_tokenizer",
    "parse_tiny_spec",
    "resolve_model_path",
]
