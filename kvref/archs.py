"""Per-architecture facts kvref needs from llama.cpp (src/llama-arch.cpp, src/llama-model.cpp, October 2026).

Every table keyed by architecture name lives here; ``HParams``, ``create_memory`` and ``kvref.state.load`` read
them. The per-arch GGUF loading rules (which keys an arch requires) stay with the loader in ``hparams.py``.
"""

from __future__ import annotations

from .constants import RopeType

# llm_arch_is_recurrent / llm_arch_is_hybrid (src/llama-arch.cpp)
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID_ARCHS = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
    "deepseek4", "minimax-01",
})  # fmt: skip

# llama_model_rope_type (src/llama-model.cpp): the archs with a fixed rope type
_ROPE_NONE = (
    "arwkv7 bloom clip glm5-next gpt2 gptj jais jamba jina-bert-v2 kimi-k3 kimi-linear mamba mamba2 mpt "
    "nemotron_h nemotron_h_moe refact rwkv6 rwkv6qwen2 rwkv7 t5 t5encoder wavtokenizer-dec"
)
_ROPE_NORM = (
    "arcee arctic baichuan bailingmoe chameleon chatglm cohere2 cohere2moe command-r deci deepseek deepseek2 "
    "deepseek2-ocr deepseek32 deepseek4 dots3note eagle3 ernie4_5 ernie4_5-moe glm-dsa granite granite_swa "
    "granitehybrid granitemoe graniteswitch hy_v4 internlm2 llada llama llama-embed llama4 maincoder minicpm "
    "mistral3 mistral4 muse-glimmer nanbeige neo-bert olmo plm pockettts smollm3 starcoder xverse"
)
_ROPE_NEOX = (
    "afmoe apertus bailingmoe2 bert bitnet codeshell cogvlm dbrx dots1 dream eurobert exaone exaone-moe "
    "exaone4 falcon falcon-h1 gemma gemma-embedding gemma2 gemma3 gemma3n gemma4 gemma4-assistant gpt-oss "
    "gptneox grok grovemoe hrm_text hunyuan-dense hunyuan-moe hy_v3 jais2 jina-bert-v3 laguna lfm2 lfm2moe "
    "llada-moe maple mellum mimo2 minicpm3 minimax-01 minimax-m2 minimax-m3 modern-bert nemotron nomic-bert "
    "nomic-bert-moe olmo2 olmoe openelm orion pangu-embedded phi2 phi3 phimoe plamo plamo2 plamo3 qwen qwen2 "
    "qwen2moe qwen3 qwen3moe qwen3next rnd1 seed_oss smallthinker spark2_5 stablelm starcoder2 step35 talkie"
)
ARCH_ROPE_TYPE: dict[str, RopeType] = {
    **{a: RopeType.NONE for a in _ROPE_NONE.split()},
    **{a: RopeType.NORM for a in _ROPE_NORM.split()},
    **{a: RopeType.NEOX for a in _ROPE_NEOX.split()},
    **{a: RopeType.MROPE for a in ("qwen2vl", "paddleocr")},
    **{a: RopeType.IMROPE for a in ("qwen35", "qwen35moe", "qwen3tts", "qwen3vl", "qwen3vlmoe", "qwen4exp")},
}
# rope type depends on whether the file carries M-RoPE sections (use_mrope: sections 0 and 1 > 0)
_ARCH_ROPE_IF_MROPE = {
    "glm4": RopeType.NORM, "glm4moe": RopeType.NEOX, "hunyuan_vl": RopeType.NEOX, "bailingmoe3": RopeType.NORM,
}  # fmt: skip

# llama_model::create_memory: architectures without a memory (encoders, diffusion models)
NO_MEMORY_ARCHS = frozenset({
    "bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert", "nomic-bert-moe", "neo-bert", "eurobert",
    "wavtokenizer-dec", "modern-bert", "gemma-embedding", "dream", "llada", "llada-moe", "rnd1",
})  # fmt: skip

# archs with a memory kvref does not model: none (every memory llama.cpp 0.3.36's create_memory builds is modelled;
# the paths llama.cpp itself aborts on are refused where they are reached)
UNSUPPORTED_ARCHS: frozenset[str] = frozenset()


__all__ = ["ARCH_ROPE_TYPE", "HYBRID_ARCHS", "NO_MEMORY_ARCHS", "RECURRENT_ARCHS", "UNSUPPORTED_ARCHS"]
