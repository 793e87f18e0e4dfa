"""Tiny random transformers models of each supported family (float32), for parity tests."""

from __future__ import annotations

import torch
import transformers

VOCAB = 512
WINDOW = 48  # well below the test prompts' length, so sliding-window masks matter
_SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=0,
    pad_token_id=None,
)

# family -> (config class, model class, config kwargs); each sets the features that make the family.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    # Llama 3.1's RoPE scaling; original_max_position_embeddings is small so that every band is used.
    "llama3_1": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        num_hidden_layers=2, tie_word_embeddings=False, sliding_window=WINDOW,
    )),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(
        num_hidden_layers=2, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
    )),
    # Caps small enough to bite on these logits, a query scalar unlike head_dim, alternating local/global.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=2, tie_word_embeddings=True, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
    )),
    # Two local layers then a global one (as Gemma 3's 5:1, shortened); linear-scaled global RoPE.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, tie_word_embeddings=True, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )),
    # Mixtures of Experts: top-2 of 8 with the window; top-3 of 4 without renormalising (Qwen3-MoE's default)
    # and top-2 of 8 with it, experts narrower than intermediate_size, MoE every second layer (dense between).
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_hidden_layers=2, tie_word_embeddings=False, sliding_window=WINDOW, num_local_experts=8,
        num_experts_per_tok=2,
    )),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=2, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=48,
        norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )),
    "qwen3_moe_norm_topk": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=4, tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, decoder_sparse_step=2,
    )),
}


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny random model of `family` with weights large enough for non-uniform attention and norms away from 1."""
    config_cls, model_cls, kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(**_SIZES, **kwargs)
    config._attn_implementation = "eager"  # the reference computation, softcapping included
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms; Gemma's scale by (1 + w), so centre those on 0
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 1.0 if "embed" in name else 0.15)
    return model.to(dtype)
