"""The encoder–decoder table: per supported ``model_type``, the encoder stack and the
decoder stack as two :class:`~pyattr.architectures.table.Arch` entries (paths relative to
the base model, as in the decoder-only table) and the decoder blocks' cross-attention.

Each stack is planned as a decoder-only model's blocks are; the cross-attention's q/k/v
projections carry the attention rule of the self-attention (the AH-rule: only the value
path, here from the encoder's output, carries relevance; AttnLRP: q, k and v scaled by
(¼, ¼, ½)), and its norm is one more residual-stream norm of the decoder block. T5's
relative position bias is a function of positions only (a constant under every rule);
its RMS norm has no mean and no offset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from pyattr.architectures.paths import layer_paths
from pyattr.architectures.table import Arch


@dataclass(frozen=True)
class Seq2Seq:
    """One encoder–decoder architecture.

    ``encoder`` and ``decoder`` describe the two stacks; ``cross_attention`` is the
    attention spec (as ``Arch.attention``) of each decoder block's cross-attention (None:
    merged into the decoder's self-attention, whose q/k/v run on both the decoder's states
    and the encoder's output: T5Gemma 2); ``off_path``: modules of the model that text
    inputs never run (T5Gemma 2's vision tower), refused if they run;
    ``gated_ff``: (path of the feed-forward module in an encoder block, in a decoder
    block, its (gate, up, down, act) names) for T5, whose feed-forward is a plain
    ``act`` MLP (T5 v1.0) or a gated one (T5 v1.1, mT5, Flan-T5), read off the instance;
    ``cross_norms``: the decoder block's norms of an optional cross-attention (planned with
    it where the block has it, else left out with it)."""

    encoder: Arch
    decoder: Arch
    cross_attention: Optional[Tuple]
    gated_ff: Optional[Tuple[str, str, Tuple[str, str, str, str]]] = None
    off_path: Tuple[str, ...] = ()
    # decoder-block norms that exist only with the cross-attention, which a decoder built
    # alone may leave out (ProphetNetForCausalLM with add_cross_attention=False)
    cross_norms: Tuple[str, ...] = ()


def _t5() -> Seq2Seq:
    sa = ("separate", "layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v")
    common = dict(norm="rms_norm", attention=sa, attention_out="layer.0.SelfAttention",
                  heads="layer.0.SelfAttention.o")
    enc = Arch(layers="encoder.block", layer_norms=("layer.0.layer_norm", "layer.1.layer_norm"),
               outer_norms=("encoder.final_layer_norm",), mlp=("act", "layer.1.DenseReluDense.act"),
               entry=("encoder.block.0", "hidden_states"), mlp_out="layer.1.DenseReluDense",
               neurons=("layer.1.DenseReluDense.wo", "input"), **common)
    dec = Arch(layers="decoder.block",
               layer_norms=("layer.0.layer_norm", "layer.1.layer_norm", "layer.2.layer_norm"),
               outer_norms=("decoder.final_layer_norm",), mlp=("act", "layer.2.DenseReluDense.act"),
               entry=("decoder.block.0", "hidden_states"), mlp_out="layer.2.DenseReluDense",
               neurons=("layer.2.DenseReluDense.wo", "input"), **common)
    cross = ("separate", "layer.1.EncDecAttention.q", "layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v")
    return Seq2Seq(enc, dec, cross, ("layer.1.DenseReluDense", "layer.2.DenseReluDense", ("wi_0", "wi_1", "wo", "act")))


def _bart_family(embedding_norm: bool, final_norm: bool) -> Seq2Seq:
    """BART, mBART, Marian, M2M100 / NLLB, Pegasus: the same blocks; they differ in
    where the norms sit (post-norm BART and Marian, pre-norm mBART, M2M100 and Pegasus
    with a final norm per stack) and whether a LayerNorm follows the embeddings."""

    def stack(side: str, norms: Tuple[str, ...]) -> Arch:
        outer = ((f"{side}.layernorm_embedding",) if embedding_norm else ()) + \
            ((f"{side}.layer_norm",) if final_norm else ())
        # the residual stream as the first block sees it: the LayerNorm after the embeddings
        # takes the scaled token embeddings plus positions as its input (BERT's entry)
        entry = (f"{side}.layernorm_embedding", "input") if embedding_norm else (f"{side}.layers.0", "hidden_states")
        return Arch(layers=f"{side}.layers", norm="layer_norm", layer_norms=norms, outer_norms=outer,
                    mlp=("act", "activation_fn"),
                    attention=("separate", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    entry=entry, attention_out="self_attn", mlp_out="fc2", neurons=("fc2", "input"),
                    heads="self_attn.out_proj")

    enc = stack("encoder", ("self_attn_layer_norm", "final_layer_norm"))
    dec = stack("decoder", ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"))
    return Seq2Seq(enc, dec, ("separate", "encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj"))


def _bigbird_pegasus() -> Seq2Seq:
    """BigBird-Pegasus: Pegasus' pre-norm blocks with the final norm of each stack named
    ``layernorm_embedding`` (applied after the last block, not after the embeddings), and
    an encoder self-attention (full or block-sparse) whose q/k/v are ``self.query`` /
    ``self.key`` / ``self.value`` and whose output projection is ``output``. Block-sparse
    attention is the same bilinear form of q, k and v over chosen key blocks, so the
    attention rule of its projections is the rule; the source it pads internally to whole
    blocks is refused by the entry check (the encoder's entry longer than the source)."""

    def stack(side: str, attention: Tuple[str, str, str], heads: str, norms: Tuple[str, ...]) -> Arch:
        return Arch(layers=f"{side}.layers", norm="layer_norm", layer_norms=norms,
                    outer_norms=(f"{side}.layernorm_embedding",), mlp=("act", "activation_fn"),
                    attention=("separate",) + attention, entry=(f"{side}.layers.0", "hidden_states"),
                    attention_out="self_attn", mlp_out="fc2", neurons=("fc2", "input"), heads=heads)

    enc = stack("encoder", ("self_attn.self.query", "self_attn.self.key", "self_attn.self.value"),
                "self_attn.output", ("self_attn_layer_norm", "final_layer_norm"))
    dec = stack("decoder", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.out_proj",
                ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"))
    return Seq2Seq(enc, dec, ("separate", "encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj"))


def _t5gemma() -> Seq2Seq:
    """T5Gemma: two Gemma 2 stacks — (1 + w) RMSNorms before and after each sublayer (the
    decoder's cross-attention has its pair too), rotary positions, a gated-GELU MLP with a
    dropout before its down projection (planned as T5 v1.1's, by the instance's names)."""

    def stack(side: str, extra: Tuple[str, ...]) -> Arch:
        return Arch(layers=f"{side}.layers", norm="rms_norm", offset=1.0,
                    layer_norms=("pre_self_attn_layernorm", "post_self_attn_layernorm") + extra
                    + ("pre_feedforward_layernorm", "post_feedforward_layernorm"),
                    outer_norms=(f"{side}.norm",), mlp=("gated_named", "mlp"),
                    gated_extra=("gate_proj", "up_proj", "down_proj", "act_fn"),
                    attention=("separate", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    entry=(f"{side}.layers.0", "hidden_states"), attention_out="self_attn", mlp_out="mlp",
                    neurons=("mlp.down_proj", "input"), heads="self_attn.o_proj")

    return Seq2Seq(stack("encoder", ()), stack("decoder", ("pre_cross_attn_layernorm", "post_cross_attn_layernorm")),
                   ("separate", "cross_attn.q_proj", "cross_attn.k_proj", "cross_attn.v_proj"))


def _t5gemma2() -> Seq2Seq:
    """T5Gemma 2: Gemma 3 stacks ((1 + w) RMSNorms before and after each sublayer, q/k
    norms, rotary positions, a gated-GELU MLP); the encoder's text stack under
    ``encoder.text_model`` beside a vision tower text inputs never run; the decoder's
    attention merged: one softmax over its own keys and the encoder's, the same q/k/v
    projections on both (so the attention rule of those projections is the rule of both)."""

    def stack(layers: str, outer: str) -> Arch:
        return Arch(layers=layers, norm="rms_norm", offset=1.0,
                    layer_norms=("pre_self_attn_layernorm", "post_self_attn_layernorm", "pre_feedforward_layernorm",
                                 "post_feedforward_layernorm"),
                    outer_norms=(outer,), mlp=("gated_named", "mlp"),
                    gated_extra=("gate_proj", "up_proj", "down_proj", "act_fn"),
                    attention=("separate", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    qk_norms=("self_attn.q_norm", "self_attn.k_norm"), entry=(f"{layers}.0", "hidden_states"),
                    attention_out="self_attn", mlp_out="mlp", neurons=("mlp.down_proj", "input"),
                    heads="self_attn.o_proj")

    return Seq2Seq(stack("encoder.text_model.layers", "encoder.text_model.norm"),
                   stack("decoder.layers", "decoder.norm"), None,
                   off_path=("encoder.vision_tower", "encoder.multi_modal_projector"))


def _prophetnet() -> Seq2Seq:
    """ProphetNet: post-norm blocks (LayerNorm after each residual add), learned positions
    added before a LayerNorm after the embeddings, a plain GELU feed-forward. The decoder
    appends ``config.ngram`` predicting streams after the tokens at its entry (inputs: an
    n-gram embedding plus the next position's embedding, no token); its self-attention
    runs the main stream causally and each predicting stream over the main stream and
    itself, with a relative position bias that is a projection of the hidden states
    (``relative_pos_embeddings``, on the logit path). The logits are read from the first
    predicting stream, which reaches the tokens only through attention."""

    def stack(side: str, norms: Tuple[str, ...], **extra) -> Arch:
        return Arch(layers=f"{side}.layers", norm="layer_norm", layer_norms=norms,
                    outer_norms=(f"{side}.embeddings_layer_norm",), mlp=("act", "feed_forward.activation_fn"),
                    attention=("separate", "self_attn.query_proj", "self_attn.key_proj", "self_attn.value_proj"),
                    entry=(f"{side}.embeddings_layer_norm", "input"), attention_out="self_attn",
                    mlp_out="feed_forward", neurons=("feed_forward.output", "input"), heads="self_attn.out_proj",
                    **extra)

    enc = stack("encoder", ("self_attn_layer_norm", "feed_forward_layer_norm"))
    dec = stack("decoder", ("self_attn_layer_norm", "cross_attn_layer_norm", "feed_forward_layer_norm"),
                score_bias=("self_attn.relative_pos_embeddings",), streams="ngram")
    return Seq2Seq(enc, dec, ("separate", "cross_attn.query_proj", "cross_attn.key_proj", "cross_attn.value_proj"),
                   cross_norms=("cross_attn_layer_norm",))


SEQ2SEQ = {
    "t5": _t5(),
    "mt5": _t5(),
    "umt5": _t5(),  # T5's module names; each block keeps its own relative position bias (a constant too)
    "bart": _bart_family(embedding_norm=True, final_norm=False),
    "mbart": _bart_family(embedding_norm=True, final_norm=True),
    "marian": _bart_family(embedding_norm=False, final_norm=False),
    "m2m_100": _bart_family(embedding_norm=False, final_norm=True),
    "pegasus": _bart_family(embedding_norm=False, final_norm=True),
    # the same blocks and embeddings under other names (read off their modeling files):
    # MVP (without its prompts, whose modules the plan would find unmounted and refuse) and
    # PLBART as BART; Blenderbot as Pegasus (pre-norm, a final norm per stack)
    "mvp": _bart_family(embedding_norm=True, final_norm=False),
    "plbart": _bart_family(embedding_norm=True, final_norm=False),
    "blenderbot": _bart_family(embedding_norm=False, final_norm=True),
    "t5gemma": _t5gemma(),
    "bigbird_pegasus": _bigbird_pegasus(),
    "t5gemma2": _t5gemma2(),
    "prophetnet": _prophetnet(),
}


#: where an encoder–decoder sequence classifier keeps its head: BART, mBART, PLBART, MVP,
#: T5, mT5, UMT5 a ``classification_head`` (dense → ``torch.tanh`` → out_proj) on the
#: decoder's state at the source's last end-of-text token; T5Gemma a linear ``score`` at
#: the last non-pad token
CLASSIFIER_HEADS = ("classification_head", "score")


def classifier_head(model):
    """``(path, module)`` of an encoder–decoder sequence classifier's head, else None."""
    from torch import nn

    return next(((p, getattr(model, p)) for p in CLASSIFIER_HEADS if isinstance(getattr(model, p, None), nn.Module)),
                None)


def one_stack(model, model_type: str):
    """The decoder stack's :class:`Arch` when ``model`` holds only the decoder of an
    encoder–decoder type (BartForCausalLM, MarianForCausalLM, …: a decoder-only model
    whose blocks keep an unused cross-attention), else None."""
    spec = SEQ2SEQ.get(model_type)
    if spec is None or bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)):
        return None
    if layer_paths(model, spec.encoder) or not layer_paths(model, spec.decoder):
        return None
    return spec.decoder


def streams_decoder(model) -> Optional[str]:
    """The config attribute counting the streams the decoder of ``model`` appends after the
    tokens (``Arch.streams``: ProphetNet's ``ngram``), else None."""
    from pyattr.architectures.paths import model_type

    spec = SEQ2SEQ.get(model_type(model))
    return None if spec is None else spec.decoder.streams


def refuse_one_forward_of_steps(model, caller: str) -> None:
    """A decoder with appended streams (ProphetNet) gathers its predicting streams'
    position bias by an index that depends on the input's length (transformers' own
    layout), so its logits at a position change when later tokens are appended: one
    teacher-forced forward over every generated step does not give the logits that
    generated them. ValueError naming the model."""
    if streams_decoder(model) is not None:
        raise ValueError(
            f"{caller}(): {type(model).__name__}'s logits at a position depend on the length of its decoder input (its "
            "predicting streams' position bias is gathered by a length-dependent index), so one teacher-forced forward "
            "over the generated steps does not reproduce the logits that generated them; explain each step with "
            "pyattr.relevance on the tokens up to it")


def refuse_padded_streams(model, mask, name: str, caller: str) -> None:
    """A padded decoder input (``mask`` with a 0) of a decoder with appended streams
    (ProphetNet) is not the row alone: its logits depend on the decoder input's length
    (see :func:`refuse_one_forward_of_steps`). ValueError naming ``name``."""
    if streams_decoder(model) is None or mask is None or bool(mask.bool().all()):
        return
    raise ValueError(
        f"{name}: {caller}() on {type(model).__name__} with padding: its logits depend on the length of its decoder "
        "input (its predicting streams' position bias is gathered by a length-dependent index), so a padded row is not "
        "the row alone; explain rows of one length together (or one at a time)")

