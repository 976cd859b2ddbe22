"""A byte-level BPE tokenizer trained locally, plus the Qwen-style chat template.

The tiny presets must build with no network, so their tokenizer is trained here on a corpus that
this module writes itself. The pipeline (NFC, Qwen2's split regex with single digits, byte-level)
is exactly Qwen2's, so transformers' `Qwen2Tokenizer` (which rebuilds the pipeline in code in
transformers 5), `PreTrainedTokenizerFast` and vLLM all encode the same text to the same ids.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from agentrl.models.chat_template import CHAT_TEMPLATE

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# Order fixes the ids: special tokens come first in the vocab (0, 1, 2, ...).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2's pre-tokenizer regex: `\p{N}` alone splits every digit into its own piece.
SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
DEFAULT_VOCAB_SIZE = 2048

_NAMES = "Alice Bob Carla Dmitri Emma Farid Grace Hiro Ines Jamal Kate Liam Maya Noah Olga Priya Quinn Rosa Sam Tara Uma Victor".split()
_ITEMS = (
    "apples books cookies marbles pencils stickers eggs cards shirts flowers candies tickets cupcakes "
    "balloons coins boxes toys plates"
).split()
_UNITS = "dollars hours minutes miles pages days weeks meters liters points".split()
_CHAT_LINES = [
    "You are a helpful assistant.",
    "Hello! How can I help you today?",
    "Can you explain how this works, step by step?",
    'Sure. Let\'s think step by step and output the final answer after "####".',
    "The answer is correct. Thank you for your question.",
    "Please solve the following problem and show your reasoning.",
    "I need to call a tool to get the result. The tool returned the following output.",
    "What is the weather like in Paris today? It is sunny and warm.",
    "Write a short summary of the text below in one sentence.",
    "The function takes two arguments and returns their sum.",
    "Question: how many are there in total? Answer: there are",
    "First, we compute the total. Then we subtract the amount that was used.",
    "Therefore, the final answer is",
    "If you have any other questions, feel free to ask.",
    "I'm sorry, I don't know the answer to that, but I can try to find out.",
    "Let me check the calculator. The result of the calculation is shown below.",
    "Search the web for the latest news about science and technology.",
    "The user wants to know the number of items left after giving some away.",
]
# A general English word bank; random sentences over it give BPE enough repeated words to merge.
_WORDS = """
the a an and or but if then so because when while after before since until of to in on at by for
with from about into over under between through during without within along across behind near
I you he she it we they me him her us them my your his its our their this that these those there
here who what which where why how all each every some any many much more most few less least
other another such no not only also just very too again still even ever never always often
sometimes usually already soon now today tomorrow yesterday first second third last next final
one two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty hundred
thousand million half quarter double triple twice once percent number numbers amount total sum
difference product quotient remainder average price cost costs paid pays pay spent spend spends
save saves saved earn earns earned sell sells sold buy buys bought give gives gave get gets got
take takes took make makes made have has had do does did is are was were be been being will would
can could should may might must need needs needed want wants wanted like likes liked use uses used
find finds found think thinks thought know knows knew see sees saw look looks looked come comes came
go goes went run runs ran walk walks walked read reads write writes wrote eat eats ate drink bake
bakes baked cook cut plant grow grows grew fill fills share shares split shared left remain remains
remaining more fewer than as same different equal equals greater smaller larger bigger each per
every week weeks day days hour hours minute minutes second seconds month months year years morning
evening night afternoon time times store shop market school class teacher student students friend
friends family mother father brother sister son daughter children child kids people person man
woman boy girl team game games player players farm farmer garden house home room car bus train
bike road trip city town park library office company worker workers job money dollar dollars cent
cents bag bags box boxes basket jar bottle cup cups glass water milk juice cake pie pizza bread
fruit apple orange banana grape lemon egg chicken cow cows dog dogs cat cats bird birds fish tree
trees flower flowers book books page pages pen pencil paper card cards toy toys ball shoe shoes
shirt dress hat coat ticket tickets seat seats table chair window door wall floor paint color red
blue green yellow black white big small long short tall high low fast slow hot cold new old young
good bad better best worse worst right wrong true false yes okay please thank thanks sorry hello
question questions answer answers problem problems solution step steps reason reasoning explain
explanation example result results value values function functions tool tools call calls argument
arguments return returns output input text message messages user assistant system response
request data file files list string integer object name names type description parameter
parameters required properties calculate calculator compute computes computed add adds added
subtract subtracts multiply multiplies divide divides divided plus minus times over equation
expression check checks correct incorrect verify search weather location query result error
river mountain ocean island forest desert village country world planet science history music art
movie song story letter word words sentence language computer phone screen picture camera video
image images photo doctor nurse hospital medicine health sleep dream happy sad angry tired hungry
quickly slowly carefully exactly almost nearly about around roughly instead together altogether
alone across perhaps probably certainly clearly simply actually really especially finally
initially originally remaining collect collected collects deliver delivered travel traveled
weigh weighs weight pound pounds ounce ounces gallon gallons inch inches foot feet yard yards
kilometer kilograms gram grams salary wage wages profit discount tax interest budget savings
rent bill bills receipt change coin coins rate speed distance height width length area volume
circle square triangle rectangle side sides angle degree degrees temperature fraction fractions
decimal percentage ratio probability chance random sample group groups row rows column columns
morning lunch dinner breakfast snack meal meals recipe cookie cookies candy candies chocolate
summer winter spring autumn holiday birthday party gift gifts present presents guest guests
"""
_SENTENCE_SHAPES = [
    "{N} {v} {n} {w} {w} {x} {n}.",
    "How many {x} does {N} {v} {w} the {x}?",
    "{N} and {M} {v} {n} {x} {w} {w}.",
    "If {N} has {n} {x} and {v} {n}, how many {x} are {w}?",
    "The {x} {v} {w} {w} {w} {x}, so the {w} is {n}.",
    "{W} {w} {w} {x} {w} {n} {x}, {w} {w} {w} {w}.",
]
_TEMPLATE_WORDS = [
    "# Tools",
    "You may call one or more functions to assist with the user query.",
    "You are provided with function signatures within <tools></tools> XML tags:",
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:",
    '{"name": <function-name>, "arguments": <args-json-object>}',
    *"system user assistant tool <tools> </tools>".split(),
]


def _build_sentence_lines(rng: random.Random, n: int) -> list[str]:
    words = _WORDS.split()
    lines = []
    for _ in range(n):
        shape = rng.choice(_SENTENCE_SHAPES)
        line = shape.format_map(_RandomFields(rng, words))
        lines.append(line)
    return lines


class _RandomFields(dict):
    """format_map source that draws a fresh random value for every placeholder occurrence."""

    def __init__(self, rng: random.Random, words: list[str]) -> None:
        super().__init__()
        self._rng, self._words = rng, words

    def __missing__(self, key: str) -> str:
        rng = self._rng
        if key in ("N", "M"):
            return rng.choice(_NAMES)
        if key == "n":
            return str(rng.randint(0, 200))
        if key == "x":
            return rng.choice(_ITEMS + _UNITS)
        if key == "v":
            return rng.choice(["has", "buys", "sells", "gives", "needs", "makes", "earns", "spends", "finds"])
        word = rng.choice(self._words)
        return word.capitalize() if key == "W" else word


def _build_arithmetic_lines(rng: random.Random, n: int) -> list[str]:
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        op = rng.choice("+-*/")
        value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 2)}[op]
        lines.append(f"{a} {op} {b} = {value}")
        lines.append(f"<<{a}{op}{b}={value}>>{value}")
        lines.append(f"#### {value}")
    return lines


def _build_word_problem_lines(rng: random.Random, n: int) -> list[str]:
    lines = []
    for _ in range(n):
        name, other = rng.sample(_NAMES, 2)
        item, unit = rng.choice(_ITEMS), rng.choice(_UNITS)
        a, b, c = rng.randint(2, 90), rng.randint(2, 40), rng.randint(2, 12)
        lines.append(
            f"{name} has {a} {item}. {other} gives {name} {b} more {item}. "
            f"How many {item} does {name} have now?"
        )
        lines.append(f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item} now.\n#### {a + b}")
        lines.append(
            f"{name} earns ${c} per hour and works {b} {unit} a week. How much does {name} earn in a week?"
        )
        lines.append(f"In a week {name} earns {c} x {b} = ${c * b}. The answer is {c * b}.")
        lines.append(f"Half of the {a} {item} were sold, so {a} / 2 = {a / 2} remain.")
    return lines


def _build_tool_json_lines(rng: random.Random, n: int) -> list[str]:
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 500), rng.randint(0, 500)
        call = {"name": "calculator", "arguments": {"expression": f"{a} + {b}"}}
        lines.append("<tool_call>\n" + json.dumps(call) + "\n</tool_call>")
        lines.append("<tool_response>\n" + json.dumps({"result": a + b}) + "\n</tool_response>")
        schema = {
            "type": "function",
            "function": {
                "name": rng.choice(["calculator", "search", "get_weather", "python"]),
                "description": "Evaluate an arithmetic expression and return the result.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "The expression."}},
                    "required": ["expression"],
                },
            },
        }
        lines.append(json.dumps(schema))
    return lines


def build_corpus(seed: int = 0) -> list[str]:
    """The fixed training corpus: chat text, template words, arithmetic, word problems, tool JSON."""
    rng = random.Random(seed)
    lines: list[str] = []
    lines += _CHAT_LINES * 20 + _TEMPLATE_WORDS * 20
    lines += _build_sentence_lines(rng, 6000)
    lines += _build_arithmetic_lines(rng, 1500)
    lines += _build_word_problem_lines(rng, 800)
    lines += _build_tool_json_lines(rng, 300)
    for line in list(lines[:400]):
        lines.append(f"<|im_start|>user\n{line}<|im_end|>\n<|im_start|>assistant\n")
    return lines


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, corpus_seed: int = 0) -> Tokenizer:
    """Train the byte-level BPE deterministically (same corpus and size -> identical tokenizer)."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(build_corpus(corpus_seed), trainer=trainer)
    return tokenizer


def _build_tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict:
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (PAD_TOKEN, EOS_TOKEN)],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer_files(folder: str | Path, tokenizer: Tokenizer, model_max_length: int) -> None:
    """Write tokenizer.json, vocab.json, merges.txt and tokenizer_config.json (with the chat template).

    vocab.json + merges.txt are what transformers' `Qwen2Tokenizer` reads when it rebuilds the
    pipeline itself; tokenizer.json is what `PreTrainedTokenizerFast` and vLLM read.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    # Special tokens must be registered as added tokens with special=True so they never split.
    data = json.loads((folder / "tokenizer.json").read_text())
    for entry in data["added_tokens"]:
        entry["special"] = True
        entry["normalized"] = False
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=1))
    vocab = data["model"]["vocab"]
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    merges = data["model"]["merges"]
    lines = [m if isinstance(m, str) else " ".join(m) for m in merges]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n")
    config = _build_tokenizer_config(tokenizer, model_max_length)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
