"""ModelConfig: the static description of a decoder-only transformer, and named presets.

A ``ModelConfig`` is frozen and hashable so it can be passed to ``jax.jit`` as a static
argument. Family differences (llama, qwen2, qwen3, gemma, gemma2, gemma3, and the mixture-of-experts
qwen3_moe and olmoe) are expressed as plain fields (``attention_bias``, ``qk_norm``,
``activation``, ``num_experts``, ...) so the forward pass has no per-family branches beyond
reading those flags.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple, Union

import jax.numpy as jnp
import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "qwen3_moe",
                         "olmoe")
LAYER_TYPES = ("full_attention", "sliding_attention")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_name(dtype) -> str:
    """Canonical string name ('float32', 'bfloat16', ...) of a dtype-like or string."""
    name = jnp.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return name


# Upper bounds of a model's counts: far above any real model, low enough that a corrupt or
# hostile config (block_count=2**40) is refused before anything is built from it.
COUNT_LIMITS = {"vocab_size": 1 << 24, "hidden_size": 1 << 20, "intermediate_size": 1 << 22,
                "num_layers": 1 << 12, "num_heads": 1 << 12, "num_kv_heads": 1 << 12,
                "head_dim": 1 << 16, "max_position_embeddings": 1 << 30,
                "sliding_window": 1 << 30, "num_experts": 1 << 14,
                "moe_intermediate_size": 1 << 22, "rope_original_max_position": 1 << 30}


def check_count(name: str, value, low: int = 1, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]`` (``high`` defaults to ``COUNT_LIMITS[name]``, or
    2**31); ValueError naming ``name`` otherwise (a bool, a float, a string, NaN)."""
    high = COUNT_LIMITS.get(name, 1 << 31) if high is None else high
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not low <= int(value) <= high:
        raise ValueError(f"{name}={value!r} must be an integer in [{low}, {high}]")
    return int(value)


def check_positive(name: str, value, optional: bool = False, below: float | None = None):
    """``value`` as a finite float > 0 (and < ``below``); None passes when ``optional``;
    ValueError naming ``name`` otherwise (NaN, inf, 0, a negative, a string)."""
    if value is None and optional:
        return None
    ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
          and math.isfinite(value) and value > 0 and (below is None or value < below))
    if not ok:
        bound = f"in (0, {below:g})" if below is not None else "> 0"
        raise ValueError(f"{name}={value!r} must be a finite number {bound}")
    return float(value)


VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Static shape of a Gemma 3 vision tower (SigLIP encoder + projector).

    E ``hidden_size``, F ``intermediate_size``, L ``num_layers``, H ``num_heads``, p
    ``patch_size``; images are ``[num_channels, image_size, image_size]``; each image becomes
    ``mm_tokens_per_image`` embeddings of width ``text_hidden_size``.
    """

    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    image_size: int = 32
    patch_size: int = 8
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    activation: str = "gelu_pytorch_tanh"
    mm_tokens_per_image: int = 4
    text_hidden_size: int = 64
    dtype: str = "float32"
    param_dtype: str = "float32"
    init_std: float = 0.02   # the random projector's std (the tower's own scales are SigLIP's)

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "param_dtype", dtype_name(self.param_dtype))
        if self.activation not in VISION_ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {self.activation!r}; "
                             f"use one of {VISION_ACTIVATIONS}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size={self.hidden_size} is not a multiple of "
                             f"num_heads={self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not a multiple of "
                             f"patch_size={self.patch_size}")
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image={self.mm_tokens_per_image} must be a square "
                             f"whose side divides the {self.patches_per_side} patches per side")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def pool(self) -> int:
        """Side of the average-pooling window over the patch grid."""
        return self.patches_per_side // math.isqrt(self.mm_tokens_per_image)

    def replace(self, **kw) -> "VisionConfig":
        return dataclasses.replace(self, **kw)


ATTENTION_IMPLS = ("xla", "cudnn", "auto")
REMAT_POLICIES = ("dots", "everything")
QK_NORM_SCOPES = ("head", "projection")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static hyper-parameters of a decoder-only transformer.

    Shapes used throughout: B batch, T tokens, S cache slots, L layers, D ``hidden_size``,
    H ``num_heads``, K ``num_kv_heads``, Dh ``head_dim``, F ``intermediate_size``, V ``vocab_size``.
    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype of parameters; both are
    kept as strings ('float32' / 'bfloat16') so the config stays hashable and JSON-able.
    """

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None  # None -> hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # RoPE scaling: None | "linear" | "llama3" (the Llama 3.1+ frequency-dependent scaling).
    rope_scaling_type: Optional[str] = None
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (qwen2)
    qk_norm: bool = False  # RMSNorm on q and k before RoPE (qwen3, gemma3, olmoe)
    # What that RMSNorm normalises over: "head" (each head's Dh values, a [Dh] scale: qwen3,
    # gemma3) | "projection" (the whole H*Dh query / K*Dh key projection, [H*Dh] / [K*Dh]
    # scales: olmoe).
    qk_norm_scope: str = "head"
    activation: str = "silu"  # gated MLP activation: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    scale_embeddings: bool = False  # multiply embeddings by sqrt(hidden_size) (gemma)
    norm_plus_one: bool = False  # RMSNorm computes x * (1 + w) (gemma)
    # Gemma 2/3: RMSNorms on the attention and MLP outputs before each residual add
    # ("post_attn_norm", "post_mlp_norm"), besides the usual pre-norms.
    post_norms: bool = False
    # Local attention: layers whose `layer_types` entry is "sliding_attention" see only the
    # `sliding_window` most recent positions (themselves included); None = every layer global.
    sliding_window: Optional[int] = None
    layer_types: Optional[Tuple[str, ...]] = None  # per layer; None = all "full_attention"
    # RoPE base of the sliding layers (gemma3: 10k, unscaled, while global layers use
    # `rope_theta` and the rope scaling); None = the same rotary table as the global layers.
    rope_local_theta: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None  # scores scaled by this ** -0.5 (None: Dh)
    attn_logit_softcapping: Optional[float] = None  # scores -> c * tanh(scores / c) (gemma2)
    final_logit_softcapping: Optional[float] = None  # logits -> c * tanh(logits / c) (gemma2)
    # Mixture of experts (qwen3_moe, olmoe): every layer's MLP is `num_experts` SwiGLU experts
    # of width `moe_intermediate_size`, each token sent to the `num_experts_per_tok` (k) with
    # the highest router probability and their outputs summed with those probabilities as
    # weights (renormalised to sum to 1 when `norm_topk_prob`). 0 experts = a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # The load-balancing loss's weight in HF training (config.json's router_aux_loss_coef);
    # kept so an export writes it back. rljax's own weight is `algo.moe_aux_loss_coef`.
    router_aux_loss_coef: float = 0.001
    # Expert-parallel dispatch (models.moe_dispatch): 0 = dropless (each device's buffers hold
    # the worst case); f > 0 = each device sends at most ceil(f * its tokens * k / expert
    # devices) rows to each expert device and drops the rest (counted: moe/dropped_frac).
    moe_capacity_factor: float = 0.0
    # Planning only (`rljax plan` sets it on the config it compiles with; training refuses
    # it): the experts' grouped matmuls run as dense matmuls over balanced per-expert buckets
    # (models.moe_dispatch.bucketed_ffn), a grouped matmul's cost rather than XLA:CPU's
    # masked dense lowering of ragged_dot. Its outputs are not the model's.
    moe_plan_balanced: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False  # jax.checkpoint each layer (recompute activations in the backward pass)
    # Without remat, what the training forward keeps for the backward pass: "dots" (the
    # projection/MLP matmul outputs; attention and elementwise ops are recomputed) |
    # "everything" (nothing recomputed: more memory, less work, see transformer.layer_checkpoint).
    remat_policy: str = "dots"
    # Attention over a whole sequence (training, old/ref log-probs, prefill): "xla" (dense
    # einsums, float32 scores; every backend) | "cudnn" (jax.nn.dot_product_attention's fused
    # cuDNN kernel: GPU, bf16/fp16 compute) | "auto" (cudnn where it applies, else xla).
    # Decoding over the KV cache always uses the xla path.
    attention_impl: str = "xla"
    init_std: float = 0.02
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, Tuple[int, ...]]] = None
    pad_token_id: Optional[int] = None
    # Multimodal Gemma 3: the placeholder id whose positions take image embeddings
    # (``trunk(image_embeds=...)``); a run of them is one image, whose tokens attend to each
    # other both ways (``models.image_tokens``). None = a text-only model.
    image_token_id: Optional[int] = None
    # Its vision tower (``params["vision"]``, ``models.vision``); None = no tower.
    vision: Optional[VisionConfig] = None
    # Train the tower too (full fine-tuning); False: it is frozen (no gradient reaches it).
    train_vision: bool = False
    lora_scale: float = 1.0  # LoRA alpha / rank, used when the params carry adapters ("lora")
    # LoRA dropout rate p on the adapters' inputs (PEFT's lora_dropout); applied only in passes
    # given a dropout key (training losses), never in sampling, evaluation or old/ref log-probs.
    lora_dropout: float = 0.0

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        # Normalise dtype-likes (jnp.bfloat16, np.dtype) to strings so equality/hash are stable.
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "param_dtype", dtype_name(self.param_dtype))
        self._check_numbers()
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"unsupported attention_impl {self.attention_impl!r}; "
                             f"use one of {ATTENTION_IMPLS}")
        if isinstance(self.vision, dict):   # a config read back from JSON
            object.__setattr__(self, "vision", VisionConfig(**self.vision))
        if self.vision is not None and self.image_token_id is None:
            raise ValueError("a vision tower needs image_token_id (where its images go)")
        if self.vision is not None and self.vision.text_hidden_size != self.hidden_size:
            raise ValueError(f"the vision projector's width {self.vision.text_hidden_size} is "
                             f"not hidden_size={self.hidden_size}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"unsupported remat_policy {self.remat_policy!r}; "
                             f"use one of {REMAT_POLICIES}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported activation {self.activation!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout={self.lora_dropout} must be in [0, 1)")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"unsupported qk_norm_scope {self.qk_norm_scope!r}; "
                             f"use one of {QK_NORM_SCOPES}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                                 f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size < 1:
                raise ValueError("a mixture of experts needs moe_intermediate_size >= 1")
            if self.moe_capacity_factor < 0:
                raise ValueError(f"moe_capacity_factor={self.moe_capacity_factor} must be >= 0 "
                                 "(0 = dropless)")
            if self.activation != "silu":
                raise ValueError("mixture-of-experts layers use SwiGLU experts (activation='silu')")
        if self.rope_scaling_type not in (None, "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling {self.rope_scaling_type!r}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers or \
                    any(t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(f"layer_types must give one of {LAYER_TYPES} per layer "
                                 f"({self.num_layers}), got {self.layer_types}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a sliding_window")

    def _check_numbers(self) -> None:
        """Every count positive and in range, every float finite and positive: a corrupt
        config is refused here, naming the field, not later as a division by zero or a
        NaN loss."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "max_position_embeddings",
                     "rope_original_max_position"):
            check_count(name, getattr(self, name))
        if self.head_dim is not None:
            check_count("head_dim", self.head_dim)
        if self.sliding_window is not None:
            check_count("sliding_window", self.sliding_window)
        if self.num_experts:
            check_count("num_experts", self.num_experts)
            check_count("moe_intermediate_size", self.moe_intermediate_size)
        check_positive("rms_norm_eps", self.rms_norm_eps, below=1.0)
        for name in ("rope_theta", "rope_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor"):
            check_positive(name, getattr(self, name))
        for name in ("rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping"):
            check_positive(name, getattr(self, name), optional=True)

    @property
    def local_layers(self) -> Tuple[bool, ...]:
        """Per layer: True where it attends only within ``sliding_window``; () when no layer
        does (the forward then builds no local masks or tables at all)."""
        if not self.sliding_window or self.layer_types is None:
            return ()
        local = tuple(t == "sliding_attention" for t in self.layer_types)
        return local if any(local) else ()

    @property
    def attn_scale(self) -> Optional[float]:
        """The attention-score scale when it is not ``head_dim ** -0.5`` (None then)."""
        if self.query_pre_attn_scalar is None:
            return None
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def is_moe(self) -> bool:
        """Whether every layer's MLP is a mixture of experts."""
        return self.num_experts > 0

    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def params_dtype(self):
        return _DTYPES[self.param_dtype]

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self, active: bool = False) -> int:
        """Parameter count (policy model, no value head). ``active``: of a mixture of
        experts, only the router and the k experts one token runs through."""
        d, f, h, k, dh, v = (self.hidden_size, self.intermediate_size, self.num_heads,
                             self.num_kv_heads, self.head_dim, self.vocab_size)
        if self.is_moe:
            experts = self.num_experts_per_tok if active else self.num_experts
            mlp = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
        else:
            mlp = 3 * d * f
        per_layer = d * (h + 2 * k) * dh + h * dh * d + mlp + 2 * d
        per_layer += (h + 2 * k) * dh if self.attention_bias else 0
        if self.qk_norm:
            per_layer += 2 * dh if self.qk_norm_scope == "head" else (h + k) * dh
        per_layer += 2 * d if self.post_norms else 0
        return self.num_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d


def _family(model_type: str) -> dict:
    """Field defaults that distinguish one family from another."""
    return {
        "llama": dict(model_type="llama"),
        "qwen2": dict(model_type="qwen2", attention_bias=True),
        "qwen3": dict(model_type="qwen3", qk_norm=True),
        "gemma": dict(model_type="gemma", activation="gelu_tanh", scale_embeddings=True,
                      norm_plus_one=True, tie_word_embeddings=True),
        "gemma2": dict(model_type="gemma2", activation="gelu_tanh", scale_embeddings=True,
                       norm_plus_one=True, tie_word_embeddings=True, post_norms=True,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        "gemma3": dict(model_type="gemma3", activation="gelu_tanh", scale_embeddings=True,
                       norm_plus_one=True, tie_word_embeddings=True, post_norms=True,
                       qk_norm=True, rope_theta=1000000.0, rope_local_theta=10000.0),
        "qwen3_moe": dict(model_type="qwen3_moe", qk_norm=True, norm_topk_prob=True),
        "olmoe": dict(model_type="olmoe", qk_norm=True, qk_norm_scope="projection"),
    }[model_type]


def _gemma3_layers(n: int) -> tuple:
    """Gemma 3's layer kinds: every sixth layer global, the rest sliding-window."""
    return tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(n))


_LLAMA3_ROPE = dict(rope_scaling_type="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_max_position=8192)

PRESETS = {
    # Tests: fast everywhere.
    "tiny": dict(_family("llama"), vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=512),
    # A mixture of experts with `tiny`'s active MLP size: 8 experts of width 64, 2 per token
    # (2 x 3 x 64 x 64 = tiny's 3 x 64 x 128 per layer, plus a 64 x 8 router).
    "tiny-moe": dict(_family("qwen3_moe"), vocab_size=256, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=64),
    # Demos / CPU experiments (~7M params with a 256-token vocab).
    "small": dict(_family("llama"), vocab_size=256, hidden_size=256, intermediate_size=768,
                  num_layers=8, num_heads=8, num_kv_heads=4, max_position_embeddings=2048),
    # A from-scratch vision-language model for CPU experiments (docs/vision.md): the tiny
    # Gemma 3 text model and a 2-layer SigLIP tower reading 32x32 images as 4 tokens. The
    # image token is the character tokenizer's "@" (a run sets it from model.vision).
    "tiny-vlm": dict(_family("gemma3"), vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     query_pre_attn_scalar=16.0, max_position_embeddings=512,
                     image_token_id=44,
                     vision=VisionConfig(hidden_size=32, intermediate_size=64, num_layers=2,
                                         num_heads=2, image_size=32, patch_size=8,
                                         mm_tokens_per_image=4, text_hidden_size=64)),
    # Shapes of real checkpoints (weights come from load_hf).
    "qwen2.5-0.5b": dict(_family("qwen2"), vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                         rope_theta=1000000.0, max_position_embeddings=32768,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643),
    "qwen2.5-1.5b": dict(_family("qwen2"), vocab_size=151936, hidden_size=1536,
                         intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                         rope_theta=1000000.0, max_position_embeddings=32768,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643),
    "qwen2.5-7b": dict(_family("qwen2"), vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                       rope_theta=1000000.0, max_position_embeddings=131072,
                       bos_token_id=151643, eos_token_id=151643),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 per token (30.5B parameters, 3.3B active).
    "qwen3-30b-a3b": dict(_family("qwen3_moe"), vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
                          head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          bos_token_id=151643, eos_token_id=151645),
    "llama-3.2-1b": dict(_family("llama"), vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                         rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                         tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                         **_LLAMA3_ROPE),
    "llama-3.2-3b": dict(_family("llama"), vocab_size=128256, hidden_size=3072,
                         intermediate_size=8192, num_layers=28, num_heads=24, num_kv_heads=8,
                         rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                         tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                         **_LLAMA3_ROPE),
    "llama-3.1-8b": dict(_family("llama"), vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                         rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                         bos_token_id=128000, eos_token_id=128001,
                         **dict(_LLAMA3_ROPE, rope_factor=8.0)),
    "gemma-2b": dict(_family("gemma"), vocab_size=256000, hidden_size=2048,
                     intermediate_size=16384, num_layers=18, num_heads=8, num_kv_heads=1,
                     head_dim=256, max_position_embeddings=8192, bos_token_id=2,
                     eos_token_id=1, pad_token_id=0),
    # Gemma 3: five sliding-window layers (512 positions) to each global one.
    "gemma3-270m": dict(_family("gemma3"), vocab_size=262144, hidden_size=640,
                        intermediate_size=2048, num_layers=18, num_heads=4, num_kv_heads=1,
                        head_dim=256, max_position_embeddings=32768, sliding_window=512,
                        layer_types=_gemma3_layers(18), query_pre_attn_scalar=256.0,
                        bos_token_id=2, eos_token_id=1, pad_token_id=0),
    "gemma3-1b": dict(_family("gemma3"), vocab_size=262144, hidden_size=1152,
                      intermediate_size=6912, num_layers=26, num_heads=4, num_kv_heads=1,
                      head_dim=256, max_position_embeddings=32768, sliding_window=512,
                      layer_types=_gemma3_layers(26), query_pre_attn_scalar=256.0,
                      bos_token_id=2, eos_token_id=1, pad_token_id=0),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A named ``ModelConfig`` with optional field overrides.

    ``get_preset("tiny", model_type="qwen3")`` switches family defaults too (qk_norm etc.), unless
    those fields are overridden explicitly.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    fields = dict(PRESETS[name])
    if "model_type" in overrides and overrides["model_type"] != fields["model_type"]:
        # Reset the old family's flags before applying the new family's.
        for key in ("attention_bias", "qk_norm", "qk_norm_scope", "norm_topk_prob",
                    "activation", "scale_embeddings",
                    "norm_plus_one", "tie_word_embeddings", "post_norms",
                    "rope_local_theta", "attn_logit_softcapping", "final_logit_softcapping"):
            fields.pop(key, None)
        fields.update(_family(overrides["model_type"]))
    fields.update(overrides)
    return ModelConfig(**fields)
