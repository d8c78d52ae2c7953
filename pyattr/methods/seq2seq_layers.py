"""Layer relevance on encoder–decoder models: activation, rule-modified gradient and
relevance at modules of both stacks from one forward and one backward."""

from __future__ import annotations

import contextlib
from typing import Dict, List, Sequence, Tuple, Union

import torch
from torch import nn

import pyattr.architectures as A
import pyattr.methods._core as core
import pyattr.methods.seq2seq_inputs as SI
import pyattr.methods.seq2seq_targets as ST
import pyattr.targets as T
from pyattr.config import RelevanceRules
from pyattr.methods._core.forward import backward, check_grad_outputs, evaluate_targets, leaf
from pyattr.methods.seq2seq import _words_to_ids, prepare


def _expand(model: nn.Module, layers: Union[str, Sequence[str]], to_input: bool) -> List[Tuple[str, str]]:
    """``(path, "input" | "output")`` per layer; ``"residual"``: every block's input, the
    encoder's blocks then the decoder's."""
    names = [layers] if isinstance(layers, str) else list(layers)
    if not names:
        raise ValueError("layers: expected at least one dotted module path or 'residual'")
    spec = A.SEQ2SEQ.get(A.model_type(model))
    out: List[Tuple[str, str]] = []
    for name in names:
        if name == "residual":
            if spec is None:
                raise ValueError(f"layers: 'residual' needs a mapped encoder–decoder; {type(model).__name__} has none")
            out += [(p, "input") for arch in (spec.encoder, spec.decoder) for p in A.layer_paths(model, arch)]
        elif name in ("attention", "mlp", "neurons"):
            raise ValueError(f"layers: the shorthand {name!r} is not supported on encoder–decoder models yet; pass "
                             "'residual' or dotted module paths")
        else:
            core.resolve_module(model, name, "layers")
            out.append((name, "input" if to_input else "output"))
    seen, unique = set(), []
    for p in out:  # one entry per path (the result is keyed by path): the first way it was asked for
        if p[0] not in seen:
            seen.add(p[0])
            unique.append(p)
    return unique


def seq2seq_layer_relevance(model: nn.Module, inputs, layers, target, rules: RelevanceRules, *, decoder_input_ids,
                            decoder_attention_mask, attention_mask, attribute_to_layer_input: bool,
                            grad_outputs=None, tokenizer=None):
    """``(layers, paths, target, target_ids, coverage, sides, (source tokens, decoder
    tokens))``: per path ``(activation, gradient, where)``, each path's stack
    (``"encoder"`` / ``"decoder"``), the token strings with ``tokenizer``;
    :func:`pyattr.layer_relevance` makes its result of them."""
    lays = _expand(model, layers, attribute_to_layer_input)
    kwargs, dec, dmask, entries = prepare(model, inputs, attention_mask, decoder_input_ids, decoder_attention_mask,
                                          "layer_relevance", tokenizer)
    tgts, several = T.normalize(_words_to_ids(target, tokenizer), dec.shape[0])
    side = ST.side_of(model, tgts, "layer_relevance")
    inside = ST.encoder_modules(model)
    sides = ["encoder" if id(A.get_submodule(model, p)) in inside else "decoder" for p, _ in lays]
    if side == "encoder" and "decoder" in sides:
        p = lays[sides.index("decoder")][0]
        raise ValueError(f"layers: {p!r} is in the decoder, which runs after the encoder module the target reads, "
                         "so no relevance reaches it; pass layers of the encoder (or a decoder-side target)")
    store: Dict[Tuple[str, str], torch.Tensor] = {}
    with core.attribution_pass(model, rules, False, "layer_relevance") as cov:
        calls: Dict[Tuple[str, str], int] = {}

        def fn_for(key):
            def fn(t):
                calls[key] = calls.get(key, 0) + 1
                store.setdefault(key, t)
                return None
            return fn

        with contextlib.ExitStack() as stack:
            # both stacks' entries as leaves: the graph the gradients run through
            stack.enter_context(core.tap(entries[0], "input", SI.one_per_token(leaf, kwargs["input_ids"].shape[1],
                                                                               model, "layer_relevance"), once=True))
            stack.enter_context(core.tap(entries[1], "input", leaf, once=True))
            for key in lays:
                stack.enter_context(core.tap(A.get_submodule(model, key[0]), key[1], fn_for(key)))
            stack.enter_context(ST.recording(model, tgts, targets_store := {}))
            out = model(**kwargs)
        missing = [p for p in lays if p not in store]
        if missing:
            raise ValueError(f"layers: {missing[0][0]!r} did not run in {type(model).__name__}'s forward pass")
        for p in lays:
            core.check_not_streams(entries[1], p[0], [store[p]], kwargs["decoder_input_ids"].shape[1])
        twice = [p for p in lays if calls.get(p, 0) > 1]
        if twice:
            raise ValueError(f"layers: {twice[0][0]!r} runs {calls[twice[0]]} times in one forward (a module shared "
                             "between places), so one activation per position cannot describe it; pass a module "
                             "that runs once")
        before = [p for p in lays if not store[p].requires_grad]
        if before:
            raise ValueError(f"layers: {before[0][0]!r} is computed before the entries where the residual streams "
                             "start (an embedding, a position table) or off the explained value's gradient path, so "
                             "no relevance reaches it; pass a module inside the blocks")
        value, tid, _ = evaluate_targets(tgts, ST.forward(side, out, kwargs, targets_store), several)
        go = check_grad_outputs(grad_outputs, value)
        acts = [store[k] for k in lays]
        grads = backward(value, acts, go, several)
    dt = torch.promote_types(torch.float32, acts[0].dtype)
    result = {}
    for (path, where), a, g in zip(lays, acts, grads):
        a = a.detach().to(dt)
        g = torch.zeros((*value.shape[:1],) * several + a.shape, dtype=dt) if g is None else g.to(dt)
        result[path] = (a, g, where)
    if tokenizer is not None:
        from pyattr.methods._core.text import token_strings

        mask = kwargs.get("attention_mask")
        tokens = (token_strings(tokenizer, kwargs["input_ids"].cpu(), None if mask is None else mask.cpu()),
                  token_strings(tokenizer, dec.cpu(), None if dmask is None else dmask.cpu()))
    else:
        tokens = (None, None)
    return result, [p for p, _ in lays], value.detach().double(), tid, cov, sides, tokens
