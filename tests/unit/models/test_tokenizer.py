import json

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from agentrl.models.tokenizer import DEFAULT_VOCAB_SIZE, SPECIAL_TOKENS, build_corpus, build_tokenizer

EXPECTED_IDS = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<tool_call>": 3,
    "</tool_call>": 4,
    "<tool_response>": 5,
    "</tool_response>": 6,
    "<|vision_start|>": 7,
    "<|vision_end|>": 8,
    "<|image_pad|>": 9,
    "<|video_pad|>": 10,
}
SAMPLES = [
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    'I\'ll call <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>',
    "<|im_start|>user\nhéllo wörld 你好  \t tabs\n\n<|im_end|>\n",
    "<|vision_start|><|image_pad|><|vision_end|>What is this?",
]


@pytest.fixture(scope="module")
def hf_tokenizer(mini_path):
    return AutoTokenizer.from_pretrained(mini_path)


def test_training_is_deterministic():
    assert build_corpus() == build_corpus()
    assert build_tokenizer().to_str() == build_tokenizer().to_str()


def test_vocab_size_and_special_token_ids(hf_tokenizer):
    assert len(hf_tokenizer) == DEFAULT_VOCAB_SIZE == 2048
    assert {t: hf_tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS} == EXPECTED_IDS
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.eos_token_id == 2
    assert hf_tokenizer.pad_token == "<|endoftext|>" and hf_tokenizer.pad_token_id == 0
    assert hf_tokenizer.bos_token is None


def test_special_tokens_are_never_split(hf_tokenizer):
    ids = hf_tokenizer.encode("a<tool_call>b</tool_call><|im_end|>", add_special_tokens=False)
    assert ids[1] == 3 and ids[-2] == 4 and ids[-1] == 2


def test_digits_are_split_one_by_one(hf_tokenizer):
    tokens = hf_tokenizer.tokenize("12345 + 678 = 7023")
    digit_tokens = [t.lstrip("Ġ") for t in tokens if t.lstrip("Ġ").isdigit()]
    assert digit_tokens == list("12345") + list("678") + list("7023")
    assert all(len(t) == 1 for t in digit_tokens)


def test_common_words_are_single_tokens(hf_tokenizer):
    assert hf_tokenizer.tokenize(" the answer is") == ["Ġthe", "Ġanswer", "Ġis"]


@pytest.mark.parametrize("text", SAMPLES)
def test_all_loaders_agree_and_roundtrip(mini_path, hf_tokenizer, text):
    """transformers' Qwen2Tokenizer rebuilds the pipeline in code; it must match tokenizer.json."""
    raw = Tokenizer.from_file(f"{mini_path}/tokenizer.json")
    fast = PreTrainedTokenizerFast(tokenizer_file=f"{mini_path}/tokenizer.json")
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids == raw.encode(text).ids == fast.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(ids) == text


def test_saved_files_are_consistent(mini_path):
    config = json.loads(open(f"{mini_path}/tokenizer_config.json").read())
    template = open(f"{mini_path}/chat_template.jinja").read()
    assert config["chat_template"] == template
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    vocab = json.loads(open(f"{mini_path}/vocab.json").read())
    assert len(vocab) == 2048 and vocab["<|im_end|>"] == 2
