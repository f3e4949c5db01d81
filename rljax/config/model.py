"""The policy network: the ``model`` section (preset or checkpoint, dtype, LoRA) and the
``tokenizer`` section, with their checks."""
from __future__ import annotations

from typing import Any

from rljax.config.base import ConfigError


def model() -> dict[str, Any]:
    return dict(
        preset="tiny",               # models.get_preset name; ignored when `path` is set
        path="",                     # HF dir (config.json + *.safetensors) or .gguf file to load
        dtype="float32",             # parameter dtype
        remat=False,                 # rematerialise layer activations in the update step
        overrides={},                # free-form ModelConfig overrides for the preset
        # LoRA (docs/lora.md): rank > 0 trains adapters on the frozen base; the base model
        # (adapters off) is then the reference policy. targets: projection names or regexes
        # out of q k v o gate up down.
        lora=dict(rank=0, alpha=16.0, dropout=0.0,
                  targets=("q", "k", "v", "o", "gate", "up", "down"),
                  # Rollouts and evals sample from the adapters merged into a float32 base
                  # once per call (W + scale * A @ B; a second copy of the weights while
                  # sampling) instead of two extra matmuls per projection per token: faster on
                  # SmolLM2-135M (CPU) and a 0.5B model (H100), docs/lora.md. A bf16/fp16 base
                  # is never merged (rounding would erase small adapter updates).
                  merge_for_sampling=True),
        adapter_path="",             # PEFT adapter dir to start from (implies LoRA)
        # QLoRA (docs/lora.md): keep the frozen base quantized on device ("" = off; int8,
        # int4 or nf4, one scale per `quantize_block` inputs; keep = a GGUF file's own
        # blocks); needs LoRA.
        quantize="",
        quantize_block=64,
        # Images in the prompt (docs/vision.md): load a multimodal Gemma 3 checkpoint's vision
        # tower too (a preset with a tower always has one); train it (full fine-tuning only;
        # else frozen); the text of the image placeholder token (one token of the tokenizer).
        vision=dict(load=False, train=False, image_token="<image_soft_token>"),
    )


def tokenizer() -> dict[str, Any]:
    return dict(
        path="",                     # "" = model.path, or the built-in char tokenizer
        kind="auto",
        chat_template=False,         # wrap prompts with the tokenizer's chat template
    )


SECTIONS = {"model": model, "tokenizer": tokenizer}

CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.quantize": ("", "int8", "int4", "nf4", "keep"),
    "tokenizer.kind": ("auto", "hf", "sentencepiece", "char"),
}

RANGES = ()


def check_lora(cfg) -> None:
    """Adapter shape and scale, and a reference policy that LoRA leaves as the frozen base."""
    lora, algo = cfg.model.lora, cfg.algo
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank={lora.rank} must be > 0 (0 = LoRA off)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={lora.dropout} must be in [0, 1) (the "
                          "probability of dropping an adapter input; 0 = off)")
    if (lora.rank or cfg.model.adapter_path) and lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha={lora.alpha} must be > 0")
    if cfg.model.quantize and not (lora.rank or cfg.model.adapter_path):
        raise ConfigError(f"model.quantize={cfg.model.quantize!r} keeps the base frozen and "
                          "quantized, so only LoRA adapters can train: set model.lora.rank "
                          "(e.g. 16) or model.adapter_path, or model.quantize='' for full "
                          "fine-tuning")
    if cfg.model.quantize == "keep" and not str(cfg.model.path).lower().endswith(".gguf"):
        raise ConfigError("model.quantize='keep' keeps a GGUF file's own quantized blocks: "
                          f"model.path={cfg.model.path!r} is not a .gguf file (int8, int4 "
                          "or nf4 quantize any model at load)")
    if cfg.model.quantize and (cfg.model.quantize_block <= 0 or cfg.model.quantize_block % 2):
        raise ConfigError(f"model.quantize_block={cfg.model.quantize_block} must be a "
                          "positive even number (inputs sharing one scale)")
    if (lora.rank or cfg.model.adapter_path) and algo.ref_update_every:
        raise ConfigError(f"algo.ref_update_every={algo.ref_update_every} refreshes a copied "
                          "reference; with LoRA (model.lora.rank > 0) the reference is the "
                          "frozen base model: set it to 0")


def has_vision_tower(cfg) -> bool:
    """The run's model reads images: a checkpoint loaded with ``model.vision.load``, or a
    preset with a tower (``tiny-vlm``)."""
    if cfg.model.path:
        return bool(cfg.model.vision.load)
    from rljax.models.config import PRESETS   # the model registry, imported when needed
    return PRESETS.get(cfg.model.preset, {}).get("vision") is not None


def check_images(cfg) -> None:
    """Images in the prompt go through single-turn rollouts (static sampler, slot engine,
    partial rollouts, trees) and multi-turn episodes (static turn batches or the episode
    engine; carried across iterations, in groups of the knapsack's sizes, their first turns
    a tree's leaves, valued by VinePPO's forks, after a warm-up on scripted episodes),
    synchronous or not (docs/vision.md). Only self-play refuses them: a game has no images."""
    if not (has_vision_tower(cfg) and cfg.env.name):
        return
    what = f"env.name={cfg.env.name!r} with images in the prompt (a model with a vision tower)"
    mode = cfg.env.selfplay.mode
    if mode != "off":
        raise ConfigError(f"env.selfplay.mode={mode!r}: {what} is not supported (a board "
                          "game's matches have no images)")
