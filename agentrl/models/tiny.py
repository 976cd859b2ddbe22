"""Tiny offline model presets: `tiny:<preset>[@seed]` -> a cached Hugging Face folder.

Tests and the default CPU run need a real Qwen2 model without a hub download. A preset is a
recipe (model config + tokenizer settings); building it trains the tokenizer, initialises the
weights from the seed and saves an ordinary HF folder that transformers and vLLM load as usual.
The folder name carries a hash of the recipe, so changing a recipe never reuses a stale build, and
the build happens in a temporary folder renamed into place, so a crash or a concurrent builder
never leaves a half folder behind.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.models import tokenizer as tok_lib
from agentrl.models.cache import cache_base
from agentrl.models.smollm2 import SMOLLM2_NAME, resolve_smollm2

TINY_PREFIX = "tiny:"
# Bump when the build code changes in a way the recipe dict does not capture.
_BUILD_VERSION = 1


@dataclass(frozen=True)
class TinyPreset:
    """A build recipe: `family` picks the transformers classes (a key of `_BUILDERS`), `text` holds the text
    model's config fields and `vision` (set for the vision-language families) the vision tower's. `dtype` is the
    dtype the weights are drawn and saved in: float32 builds through the model's own initialisation; a lower
    precision (the multi-billion shapes) draws each tensor straight in that dtype (`_draw_weights`), so the build
    holds one copy of the weights in host memory and no float32 copy at any point."""

    name: str
    text: dict[str, Any]
    family: str = "qwen2"
    vision: dict[str, Any] | None = None
    image_processor: dict[str, Any] | None = None
    vocab_size: int = tok_lib.DEFAULT_VOCAB_SIZE
    extra: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"

    def recipe(self) -> dict[str, Any]:
        # `dtype` joins the recipe only when it is not the default, so older presets keep their folders.
        saved_dtype = {"dtype": self.dtype} if self.dtype != "float32" else {}
        return {
            **saved_dtype,
            "build_version": _BUILD_VERSION,
            "name": self.name,
            "family": self.family,
            "text": self.text,
            "vision": self.vision,
            "image_processor": self.image_processor,
            "vocab_size": self.vocab_size,
            "chat_template": _sha(tok_lib.CHAT_TEMPLATE),
            "corpus": _corpus_sha(),
            "extra": self.extra,
        }


@functools.cache
def _corpus_sha() -> str:
    """Hash of the tokenizer corpus (computed once per process: resolve is called often)."""
    return _sha("\n".join(tok_lib.build_corpus()))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


_QWEN2_TEXT = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}

# Real model shapes with random weights and the offline tokenizer: GPU benchmarks and tests at a realistic size
# without a hub download. The embedding keeps Qwen2.5's 151,936 rows (ids past the tokenizer decode to nothing).
_QWEN25_SHAPE = {
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}
# Qwen2.5-1.5B's language model; Qwen2-VL-2B's is the same.
_QWEN25_1P5B_TEXT = {
    **_QWEN25_SHAPE,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
}

# Qwen2.5-3B and Qwen2.5-7B (3.09B and 7.62B parameters), drawn and saved in bfloat16: one GPU with offload
# (docs/scaling.md, "A large shape on one GPU").
_QWEN25_3B_TEXT = {
    **_QWEN25_SHAPE,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
}
_QWEN25_7B_TEXT = {
    **_QWEN25_SHAPE,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
}

PRESETS: dict[str, TinyPreset] = {
    "qwen2": TinyPreset(name="qwen2", text=_QWEN2_TEXT),
    "qwen2.5-0.5b-shape": TinyPreset(
        name="qwen2.5-0.5b-shape",
        text={
            **_QWEN25_SHAPE,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
        },
    ),
    "qwen2.5-1.5b-shape": TinyPreset(
        name="qwen2.5-1.5b-shape",
        text=_QWEN25_1P5B_TEXT,
    ),
    "qwen2.5-3b-shape": TinyPreset(name="qwen2.5-3b-shape", text=_QWEN25_3B_TEXT, dtype="bfloat16"),
    "qwen2.5-7b-shape": TinyPreset(name="qwen2.5-7b-shape", text=_QWEN25_7B_TEXT, dtype="bfloat16"),
    "qwen2-mini": TinyPreset(
        name="qwen2-mini",
        text={**_QWEN2_TEXT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    ),
    "qwen2-vl": TinyPreset(
        name="qwen2-vl",
        family="qwen2-vl",
        text={**_QWEN2_TEXT, "num_hidden_layers": 2},
        vision={
            "depth": 2,
            "embed_dim": 64,
            "num_heads": 4,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        # 56*56 .. 224*224 pixels -> 4 .. 64 image tokens after the 2x2 merge.
        image_processor={"min_pixels": 56 * 56, "max_pixels": 224 * 224},
    ),
    # Qwen2-VL-2B's shapes (language model, vision tower, mrope sections) with random weights and the offline
    # tokenizer: the VLM cookbook's GPU run (docs/vlm.md). Images up to 448x448 pixels (256 tokens).
    "qwen2-vl-2b-shape": TinyPreset(
        name="qwen2-vl-2b-shape",
        family="qwen2-vl",
        text=_QWEN25_1P5B_TEXT,
        vision={
            "depth": 32,
            "embed_dim": 1280,
            "num_heads": 16,
            "mlp_ratio": 4,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_processor={"min_pixels": 56 * 56, "max_pixels": 448 * 448},
        extra={"mrope_section": [16, 24, 24]},
    ),
    # Qwen3-VL at tiny-qwen2-vl's size: the same 2-layer language model (head_dim set: Qwen3 does not derive it),
    # interleaved mrope over its 16 rotary frequencies, a 2-block vision tower whose both blocks feed deepstack
    # features into the first two decoder layers, and Qwen3-VL's 16-pixel patches.
    "qwen3-vl": TinyPreset(
        name="qwen3-vl",
        family="qwen3-vl",
        text={
            **{k: v for k, v in _QWEN2_TEXT.items() if k != "rope_theta"},
            "num_hidden_layers": 2,
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
        },
        vision={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0, 1],
        },
        # 64*64 .. 256*256 pixels -> 4 .. 64 image tokens after the 2x2 merge of 16-pixel patches.
        image_processor={"min_pixels": 64 * 64, "max_pixels": 256 * 256},
    ),
}


def parse_tiny_spec(spec: str) -> tuple[TinyPreset, int]:
    """`tiny:<preset>[@seed]` -> (preset, seed). Raises ValueError naming the valid presets."""
    if not spec.startswith(TINY_PREFIX):
        raise ValueError(f"not a tiny model spec: {spec!r} (expected 'tiny:<preset>[@seed]')")
    body = spec[len(TINY_PREFIX) :]
    name, _, seed_text = body.partition("@")
    if name not in PRESETS:
        raise ValueError(f"unknown tiny preset {name!r} in {spec!r}; valid presets: {sorted(PRESETS)}")
    if not seed_text:
        return PRESETS[name], 0
    try:
        seed = int(seed_text)
    except ValueError:
        raise ValueError(
            f"bad seed {seed_text!r} in {spec!r}: expected an integer, e.g. 'tiny:{name}@1'"
        ) from None
    return PRESETS[name], seed


def cache_root() -> Path:
    """`$AGENTRL_CACHE/tiny` if set, else `~/.cache/agentrl/tiny`."""
    return cache_base() / "tiny"


def tiny_model_dir(preset: TinyPreset, seed: int) -> Path:
    recipe_hash = _sha(json.dumps(preset.recipe(), sort_keys=True))[:12]
    return cache_root() / f"{preset.name}-s{seed}-{recipe_hash}"


def resolve_model_path(path: str) -> str:
    """Return a loadable model path: `tiny:` specs are built (once) and cached, the `smollm2-135m-instruct`
    preset is converted (once) from its wheel and cached (before any local folder of that name); anything
    else unchanged."""
    if path == SMOLLM2_NAME:
        return resolve_smollm2()
    if not isinstance(path, str) or not path.startswith(TINY_PREFIX):
        return path
    preset, seed = parse_tiny_spec(path)
    target = tiny_model_dir(preset, seed)
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build_tiny_model(preset, seed, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another builder won the race; its folder is complete (renames are atomic), keep it.
            if not (target / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def build_tiny_model(preset: TinyPreset, seed: int, folder: str | Path) -> None:
    """Write a complete HF folder for `preset` with weights drawn from `seed` into `folder`."""
    import torch

    folder = Path(folder)
    tokenizer = tok_lib.build_tokenizer(vocab_size=preset.vocab_size)
    ids = {t: tokenizer.token_to_id(t) for t in tok_lib.SPECIAL_TOKENS}
    vocab_size = tokenizer.get_vocab_size()
    max_len = preset.text["max_position_embeddings"]
    common = {
        "vocab_size": vocab_size,
        "bos_token_id": None,
        "eos_token_id": ids[tok_lib.EOS_TOKEN],
        "pad_token_id": ids[tok_lib.PAD_TOKEN],
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _BUILDERS[preset.family](preset, common, ids)
    model.generation_config.eos_token_id = [ids[tok_lib.EOS_TOKEN], ids[tok_lib.PAD_TOKEN]]
    model.generation_config.pad_token_id = ids[tok_lib.PAD_TOKEN]
    model.generation_config.bos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)
    tok_lib.save_tokenizer_files(folder, tokenizer, model_max_length=max_len)
    if preset.vision is not None:
        from agentrl.models.vision import save_processor_files

        save_processor_files(folder, preset)
    (folder / "agentrl_recipe.json").write_text(json.dumps({**preset.recipe(), "seed": seed}, indent=1))


def _build_qwen2(preset: TinyPreset, common: dict[str, Any], ids: dict[str, int]):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**common, **preset.text}, torch_dtype=preset.dtype)  # a shape may set its vocab
    if preset.dtype != "float32":
        return _draw_weights(Qwen2ForCausalLM, config, getattr(torch, preset.dtype))
    return Qwen2ForCausalLM(config).to(torch.float32).eval()


def _draw_weights(model_cls, config, dtype):
    """`model_cls(config)` with weights drawn in `dtype` on the host: built on the meta device (no memory), given
    empty `dtype` storage, then filled as the transformers initialisation would (matrices and embeddings
    normal(0, initializer_range), the padding row 0, norms 1, biases 0). Host memory: one copy of the weights in
    `dtype` (7B in bfloat16: 15.2 GB). The draws run on every core: each block of `_DRAW_BLOCK` elements has its
    own generator, seeded from the build's seed and the block's place, so the weights do not depend on the
    thread count. Non-persistent buffers (rotary frequencies) stay unset: the model is only saved, and loading
    computes them."""
    import torch

    with torch.device("meta"):
        model = model_cls(config)
    model = model.to(dtype).to_empty(device="cpu").requires_grad_(False)  # grad mode is per thread
    model.tie_weights()  # to_empty gives every module its own tensor; tied weights share one again
    seed = torch.initial_seed()
    blocks = []
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):  # a tied tensor once
            if param.dim() > 1:
                flat = param.view(-1)
                for start in range(0, len(flat), _DRAW_BLOCK):
                    blocks.append((flat[start : start + _DRAW_BLOCK], f"{seed}/{index}/{start}"))
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # normal_ releases the GIL
            list(pool.map(lambda job: _draw_normal(*job, std=config.initializer_range), blocks))
        embedding = model.get_input_embeddings()
        if embedding.padding_idx is not None:
            embedding.weight[embedding.padding_idx].zero_()
    return model.eval()


_DRAW_BLOCK = 1 << 24


def _draw_normal(block, place: str, *, std: float) -> None:
    """Fill `block` from a generator seeded by its place (a CPU generator keeps 32 bits of its seed: hashed)."""
    import torch

    seed = int.from_bytes(hashlib.sha256(place.encode()).digest()[:4], "little")
    block.normal_(mean=0.0, std=std, generator=torch.Generator().manual_seed(seed))


def _build_qwen2_vl(preset: TinyPreset, common: dict[str, Any], ids: dict[str, int]):
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = {**preset.vision, "hidden_size": preset.text["hidden_size"]}
    # A shape preset sets its own vocabulary size (ids past the tokenizer decode to nothing).
    common = {**common, "vocab_size": preset.text.get("vocab_size", common["vocab_size"])}
    mrope = {"type": "mrope", "mrope_section": preset.extra.get("mrope_section", [4, 6, 6])}
    config = Qwen2VLConfig(
        text_config={**preset.text, **common, "rope_scaling": mrope},
        vision_config=vision,
        tie_word_embeddings=preset.text["tie_word_embeddings"],
        **_vision_token_ids(ids),
        **common,
    )
    return Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()


def _build_qwen3_vl(preset: TinyPreset, common: dict[str, Any], ids: dict[str, int]):
    """Qwen3-VL: the vision tower's width is its own (`hidden_size`), its merger projects to the text width."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision = {**preset.vision, "out_hidden_size": preset.text["hidden_size"]}
    config = Qwen3VLConfig(
        text_config={**preset.text, **common},
        vision_config=vision,
        tie_word_embeddings=preset.text["tie_word_embeddings"],
        **_vision_token_ids(ids),
    )
    return Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()


def _vision_token_ids(ids: dict[str, int]) -> dict[str, int]:
    """The image/video pad and vision start/end ids of the offline tokenizer, as VL configs name them."""
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


_BUILDERS = {"qwen2": _build_qwen2, "qwen2-vl": _build_qwen2_vl, "qwen3-vl": _build_qwen3_vl}
