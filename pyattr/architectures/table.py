"""The architecture table: per supported ``model_type``, one :class:`Arch` entry declaring
every role the methods read, by position in the model (paths relative to its base model),
never by class. A module of a norm class elsewhere (Qwen3's per-head ``q_norm``/``k_norm``)
is never a mount."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple


@dataclass(frozen=True)
class FusedGatedForm:
    """An MLP with one projection for both halves: ``a, b = proj(x).chunk(2)``, then
    ``down(drop(act(a) * b))`` (``drop`` optional). The whole body of its forward must
    match ``pattern`` (see :func:`pyattr.architectures.forms.flat_body`)."""

    proj: str
    act: str
    down: str
    drop: Optional[str]
    pattern: str


PHI3_MLP = FusedGatedForm(
    "gate_up_proj", "activation_fn", "down_proj", None,
    r"(\w+)=self\.gate_up_proj\((\w+)\);gate,(\w+)=\1\.chunk\(2,dim=-1\);\3=\3\*self\.activation_fn\(gate\);"
    r"returnself\.down_proj\(\3\)",
)


MODERNBERT_MLP = FusedGatedForm(
    "Wi", "act", "Wo", "drop",
    r"(\w+),(\w+)=self\.Wi\((\w+)\)\.chunk\(2,dim=-1\);returnself\.Wo\(self\.drop\(self\.act\(\1\)\*\2\)\)",
)


#: every fused gated MLP form the table knows (structural discovery tries each)
FUSED_GATED_FORMS = (PHI3_MLP, MODERNBERT_MLP)


@dataclass(frozen=True)
class Arch:
    layers: str                       # ModuleList of blocks
    norm: str                         # "rms_norm" or "layer_norm"
    layer_norms: Tuple[str, ...]      # per block, residual-stream norms
    outer_norms: Tuple[str, ...]      # norms outside the blocks (final / embedding norm)
    mlp: Tuple[str, str]              # ("gated", mlp path), ("gated_fused", mlp path with one
                                      # gate_up_proj), ("moe", sparse block path), ("gated_named",
                                      # mlp path; see gated_extra) or ("act", activation path)
    attention: Tuple                  # ("separate", q, k, v), ("concat", fused), ("per_head", fused)
                                      # or ("split", fused): q | k | v with GQA widths
    entry: Tuple[str, str]            # (module path, "layer0") where relevance is measured
    offset: float = 0.0               # RMSNorm weight offset (1.0 for Gemma)
    # per-head q/k norms inside attention (Qwen3): LN-rule only under AttnLRP, where
    # gradient reaches q and k; under the AH-rule none does, and they stay native
    qk_norms: Tuple[str, ...] = field(default=())
    # (gate, up, down, act) attribute names of a gated MLP under other names (mlp kind
    # "gated_named": T5 v1.1's wi_0, wi_1, wo, act), its form checked on its first call
    gated_extra: Tuple[str, ...] = field(default=())
    # a task head's own norm and activation (BERT's masked-LM transform: dense → act →
    # LayerNorm), relative to the whole model; mounted where the model has the head
    head_norms: Tuple[str, ...] = field(default=())
    head_acts: Tuple[str, ...] = field(default=())
    # a head module whose forward calls its activation as a function (RoBERTa's
    # lm_head): its forward is replaced by the same computation with the Identity-rule
    head_forward: Optional[str] = None
    # activation modules of the base model outside the blocks (BERT's pooler: dense → tanh),
    # relative to the base model
    base_acts: Tuple[str, ...] = field(default=())
    # heads whose activation no rule can reach, by (path, class name): reported as skipped
    unruled_heads: Tuple[Tuple[str, str], ...] = field(default=())
    # how the model numbers positions: "mask" (real tokens at 0, 1, …) or "padding_idx"
    # (RoBERTa family: real tokens at padding_idx + 1, …, padding at padding_idx)
    positions: str = "mask"
    # block-relative roles the methods read (layer_relevance's shorthands, patching nodes):
    # the attention block's and the MLP block's contribution to the residual stream (BERT is
    # post-norm: the dense projections before the residual add and the LayerNorm), and
    # (module, "input" | "output") holding the MLP hidden activation (act(g)·u for gated
    # MLPs); None for mixture-of-experts, whose hidden units belong to each expert
    attention_out: Optional[str] = None
    mlp_out: Optional[str] = None
    neurons: Optional[Tuple[str, str]] = None
    # the attention output projection, whose input splits per head (patching node "heads")
    heads: Optional[str] = None
    # the module that computes the attention pattern and returns it as the second element
    # of its output (Hugging Face eager attention): AtP*'s recomputation; None: not supported
    attention_core: Optional[str] = None
    # the library's sparse MoE block (module, class): its forward is the form the MoE rules expect
    moe_block: Optional[Tuple[str, str]] = None
    # the forward form of a fused gated MLP (mlp kind "gated_fused")
    fused_mlp: Optional[FusedGatedForm] = None
    # (role, reason) for each role this entry declares it does not have, by field name: an
    # entry found by structural discovery (:func:`pyattr.architectures.discover`) leaves
    # such a role None and says why here; a method that needs it refuses with the reason
    refusals: Tuple[Tuple[str, str], ...] = field(default=())
    # a vision transformer: its inputs are pixel_values, cut into patches of
    # config.patch_size, with a [CLS] token first
    vision: bool = False
    # block-relative projections of the hidden states added to the attention logits
    # (ProphetNet's relative_pos_embeddings): on the logit path as q·k is, so they carry
    # the logit path's rule (the AH-rule: no gradient; AttnLRP: the ½ of the p·v product)
    score_bias: Tuple[str, ...] = field(default=())
    # a config attribute counting the streams the model appends after the tokens at its
    # entry (ProphetNet's decoder: ``ngram`` predicting streams, each as long as the input,
    # whose inputs hold no token); the entry's first stream is the tokens'
    streams: Optional[str] = None

    def refusal(self, role: str) -> Optional[str]:
        """Why this entry has no ``role`` (a field name), or None when it declares none."""
        return next((why for r, why in self.refusals if r == role), None)


_LLAMA = Arch(
    layers="layers",
    norm="rms_norm",
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    outer_norms=("norm",),
    mlp=("gated", "mlp"),
    attention=("separate", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    entry=("layers.0", "hidden_states"),
    attention_out="self_attn",
    mlp_out="mlp",
    neurons=("mlp.down_proj", "input"),
    heads="self_attn.o_proj",
    attention_core="self_attn",
)


def _moe(module: str, cls: str, **extra) -> "Arch":
    return Arch(**{**_LLAMA.__dict__, "mlp": ("moe", "mlp"), "neurons": None,
                   "moe_block": (f"transformers.models.{module}.modeling_{module}", cls), **extra})


ARCHITECTURES = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": Arch(**{**_LLAMA.__dict__, "qk_norms": ("self_attn.q_norm", "self_attn.k_norm")}),
    "gemma": Arch(**{**_LLAMA.__dict__, "offset": 1.0}),
    "gemma2": Arch(
        **{
            **_LLAMA.__dict__,
            "offset": 1.0,
            "layer_norms": (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ),
        }
    ),
    # Gemma 3 text: Gemma 2's sandwich norms, per-head q/k norms, (1 + w) RMSNorm
    "gemma3_text": Arch(
        **{
            **_LLAMA.__dict__,
            "offset": 1.0,
            "layer_norms": (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ),
            "qk_norms": ("self_attn.q_norm", "self_attn.k_norm"),
        }
    ),
    # OLMo 2: no norm before the sublayers; each sublayer's output is normed before the
    # residual add; q/k norms span all heads
    "olmo2": Arch(
        **{
            **_LLAMA.__dict__,
            "layer_norms": ("post_attention_layernorm", "post_feedforward_layernorm"),
            "qk_norms": ("self_attn.q_norm", "self_attn.k_norm"),
        }
    ),
    # Phi-3: one projection for q | k | v (GQA widths) and one for gate | up
    "phi3": Arch(
        **{
            **_LLAMA.__dict__,
            "mlp": ("gated_fused", "mlp"),
            "fused_mlp": PHI3_MLP,
            "attention": ("split", "self_attn.qkv_proj"),
        }
    ),
    # mixture of experts: a router, experts stored as 3-D weights, and (Qwen2-MoE) a
    # shared expert behind a sigmoid gate; layers without experts are gated MLPs
    "mixtral": _moe("mixtral", "MixtralSparseMoeBlock"),
    "qwen2_moe": _moe("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": _moe("qwen3_moe", "Qwen3MoeSparseMoeBlock", qk_norms=("self_attn.q_norm", "self_attn.k_norm")),
    "gpt2": Arch(
        layers="h",
        norm="layer_norm",
        layer_norms=("ln_1", "ln_2"),
        outer_norms=("ln_f",),
        mlp=("act", "mlp.act"),
        attention=("concat", "attn.c_attn"),
        entry=("h.0", "hidden_states"),
        attention_out="attn", mlp_out="mlp", neurons=("mlp.c_proj", "input"), heads="attn.c_proj",
        attention_core="attn",
    ),
    "gpt_neox": Arch(
        layers="layers",
        norm="layer_norm",
        layer_norms=("input_layernorm", "post_attention_layernorm"),
        outer_norms=("final_layer_norm",),
        mlp=("act", "mlp.act"),
        attention=("per_head", "attention.query_key_value"),
        entry=("layers.0", "hidden_states"),
        attention_out="attention", mlp_out="mlp", neurons=("mlp.dense_4h_to_h", "input"), heads="attention.dense",
        attention_core="attention",
    ),
    "bert": Arch(
        layers="encoder.layer",
        norm="layer_norm",
        layer_norms=("attention.output.LayerNorm", "output.LayerNorm"),
        outer_norms=("embeddings.LayerNorm",),
        mlp=("act", "intermediate.intermediate_act_fn"),
        attention=(
            "separate",
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
        ),
        # the sum of word, position and token-type embeddings, before the first LayerNorm
        entry=("embeddings.LayerNorm", "input"),
        head_norms=("cls.predictions.transform.LayerNorm",),
        head_acts=("cls.predictions.transform.transform_act_fn",),
        base_acts=("pooler.activation",),
        attention_out="attention.output.dense", mlp_out="output.dense", neurons=("intermediate", "output"),
        heads="attention.output.dense", attention_core="attention.self",
    ),
    # ModernBERT: pre-norm (the first layer's attention norm is an nn.Identity), LayerNorms
    # without bias, fused Wqkv (MHA thirds), GeGLU through one Wi, a dense → act → norm head
    "modernbert": Arch(
        layers="layers",
        norm="layer_norm",
        layer_norms=("attn_norm", "mlp_norm"),
        outer_norms=("embeddings.norm", "final_norm"),
        mlp=("gated_fused", "mlp"),
        fused_mlp=MODERNBERT_MLP,
        attention=("concat", "attn.Wqkv"),
        entry=("embeddings.norm", "input"),
        head_norms=("head.norm",),
        head_acts=("head.act",),
        attention_out="attn", mlp_out="mlp", neurons=("mlp.Wo", "input"), heads="attn.Wo",
    ),
    # CLIP's text tower (CLIPTextModel, CLIPTextModelWithProjection): pre-norm, quick-GELU
    # MLP, causal self-attention, a final LayerNorm
    "clip_text_model": Arch(
        layers="encoder.layers",
        norm="layer_norm",
        layer_norms=("layer_norm1", "layer_norm2"),
        outer_norms=("final_layer_norm",),
        mlp=("act", "mlp.activation_fn"),
        attention=("separate", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        entry=("encoder.layers.0", "hidden_states"),
        attention_out="self_attn", mlp_out="mlp", neurons=("mlp.fc2", "input"), heads="self_attn.out_proj",
    ),
    # ViT (ViTModel, ViTForImageClassification): pre-norm blocks, GELU MLP; the blocks'
    # input is the patch embeddings with the [CLS] token and position embeddings added
    "vit": Arch(
        layers="layers",
        norm="layer_norm",
        layer_norms=("layernorm_before", "layernorm_after"),
        outer_norms=("layernorm",),
        mlp=("act", "mlp.activation_fn"),
        attention=("separate", "attention.q_proj", "attention.k_proj", "attention.v_proj"),
        entry=("layers.0", "hidden_states"),
        base_acts=("pooler.activation",),
        attention_out="attention", mlp_out="mlp", neurons=("mlp.fc2", "input"), heads="attention.o_proj",
        vision=True,
    ),
    "distilbert": Arch(
        layers="transformer.layer",
        norm="layer_norm",
        layer_norms=("sa_layer_norm", "output_layer_norm"),
        outer_norms=("embeddings.LayerNorm",),
        mlp=("act", "ffn.activation"),
        attention=("separate", "attention.q_lin", "attention.k_lin", "attention.v_lin"),
        entry=("embeddings.LayerNorm", "input"),
        head_norms=("vocab_layer_norm",),
        head_acts=("activation",),
        attention_out="attention.out_lin", mlp_out="ffn", neurons=("ffn.activation", "output"),
        heads="attention.out_lin",
    ),
}


# CLIP's vision tower (CLIPVisionModel, CLIPVisionModelWithProjection, and
# CLIPForImageClassification's vision_model): the text tower's blocks; the embeddings pass
# one LayerNorm (pre_layrnorm) before the blocks, and the pooled [CLS] state another
ARCHITECTURES["clip_vision_model"] = Arch(
    **{**ARCHITECTURES["clip_text_model"].__dict__, "outer_norms": ("pre_layrnorm", "post_layernorm"),
       "entry": ("pre_layrnorm", "input"), "vision": True}
)


# RoBERTa is BERT's encoder; its masked-LM head (dense → functional gelu → LayerNorm →
# decoder) calls gelu as a function, so the head's forward itself carries the rule
ARCHITECTURES["roberta"] = Arch(
    **{**ARCHITECTURES["bert"].__dict__, "head_norms": ("lm_head.layer_norm",), "head_acts": (),
       "head_forward": "lm_head", "unruled_heads": (("classifier", "RobertaClassificationHead"),),
       "positions": "padding_idx"}
)


# XLM-RoBERTa (the multilingual sentence-transformers models) and CamemBERT are RoBERTa's
# encoder and heads under another model_type and class names
ARCHITECTURES["xlm-roberta"] = Arch(
    **{**ARCHITECTURES["roberta"].__dict__, "unruled_heads": (("classifier", "XLMRobertaClassificationHead"),)}
)
ARCHITECTURES["camembert"] = Arch(
    **{**ARCHITECTURES["roberta"].__dict__, "unruled_heads": (("classifier", "CamembertClassificationHead"),)}
)
# Phi-1/1.5/2: one LayerNorm before a parallel attention and GELU MLP, a final LayerNorm,
# partial rotary embeddings, biases everywhere
ARCHITECTURES["phi"] = Arch(
    layers="layers",
    norm="layer_norm",
    layer_norms=("input_layernorm",),
    outer_norms=("final_layernorm",),
    mlp=("act", "mlp.activation_fn"),
    attention=("separate", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    entry=("layers.0", "hidden_states"),
    attention_out="self_attn", mlp_out="mlp", neurons=("mlp.fc2", "input"), heads="self_attn.dense",
    attention_core="self_attn",
)


# vision transformers: their inputs are pixel_values, cut into patches of config.patch_size
VISION = tuple(k for k, a in ARCHITECTURES.items() if a.vision)
