"""The zoo's checks of an encoder–decoder entry (:mod:`pyattr.bench.zoo`): the same four as
for one stack, read at both entries (the source where the encoder's residual stream
starts, the target prefix where the decoder's does).

The entry is explained as its mapping uses it: the source alone (a masked-LM or classifier
entry: the decoder's inputs are the ones the model makes from the source, read back by
pyattr), the explained value the top logit at the last decoder position.

- rules off (``RelevanceRules()``) = plain autograd gradient × input at both entries
  (relative 1e-5 of the largest, the target to 1e-9);
- Σ source + Σ target prefix = the target with the rules on (1e-6 of |target| or of Σ|relevance|);
- the user's own scope (``use_relevance_rules(model, generic=True)`` around their forward
  and backward, the parameters trainable) = ``pyattr.relevance`` (1e-5);
- the source padded on the right (two pad tokens, masked), the decoder's inputs given as
  they were made from the row alone = the row alone (1e-5), nothing on the pads.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

import pyattr.architectures as A


def _at_entries(model, x: torch.Tensor, dec: Optional[torch.Tensor], tid: int, smask=None):
    """``(source leaf, target-prefix leaf, value)``: one forward with both entries made
    leaves (their first call, as pyattr taps them) and the logit of ``tid`` at the last
    decoder position; differentiate inside the caller's ``with``."""
    from pyattr.methods._core.taps import tap
    from pyattr.methods.seq2seq_inputs import entries, no_cache

    _, (enc, dec_entry) = entries(model, "zoo")
    xs: Dict[int, list] = {0: [], 1: []}

    def leaf(i):
        def fn(t):
            xs[i].append(t.detach().requires_grad_(True))
            return xs[i][-1]
        return fn

    kw = {"input_ids": x, **no_cache(model)}
    if dec is not None:
        kw["decoder_input_ids"] = dec
    if smask is not None:
        kw["attention_mask"] = smask
    with tap(enc, "input", leaf(0), once=True), tap(dec_entry, "input", leaf(1), once=True):
        y = model(**kw).logits
    return xs[0][0], xs[1][0], (y[0, -1, tid] if y.dim() == 3 else y[0, tid])


def rules_off(pyattr, model, x, tid: int) -> Optional[str]:
    """Rules off against plain autograd gradient × input at both entries: None when equal."""
    r0 = pyattr.relevance(model, x, target=tid, rules=pyattr.RelevanceRules(), generic=True)
    with torch.enable_grad():
        ls, lt, value = _at_entries(model, x, None, tid)
        gs, gt = torch.autograd.grad(value, [ls, lt], allow_unused=True)
    errs = []
    for name, leaf, g, have in (("source", ls, gs, r0.source_relevance), ("target prefix", lt, gt, r0.target_relevance)):
        want = (leaf.detach() * (torch.zeros_like(leaf) if g is None else g)).sum(-1).double()
        if tuple(have.shape) != tuple(want.shape):
            return f"rules off: {name} relevance shaped {tuple(have.shape)}, autograd's {tuple(want.shape)}"
        errs.append((float((have.double() - want).abs().max()), float(want.abs().max())))
    scale = max(s for _, s in errs) + 1e-300
    err = max(e for e, _ in errs)
    t0, t1 = float(r0.target.reshape(-1)[0]), float(value)
    if not (err <= 1e-5 * scale and abs(t0 - t1) <= 1e-9 * (1 + abs(t1))):
        return (f"rules off differs from autograd gradient × input by {err:.3g} (max |relevance| {scale:.3g}); "
                f"target {t0:.6g} vs {t1:.6g}")
    return None


def conserved(r) -> Optional[str]:
    t, d = float(r.target.abs().max()), float(r.conservation_delta.abs().max())
    total = float(r.source_relevance.double().abs().sum() + r.target_relevance.double().abs().sum())
    if not d <= 1e-6 * max(t, total, 1e-12):
        return f"conservation |delta| {d:.3g} for |target| {t:.3g}"
    return None


def trainable_scope(model, x, tid: int, r) -> Optional[str]:
    """The user's own scope, parameters trainable as loaded, against ``pyattr.relevance``."""
    from pyattr import use_relevance_rules

    with torch.enable_grad(), use_relevance_rules(model, generic=True):
        ls, lt, value = _at_entries(model, x, None, tid)
        value.backward()
    model.zero_grad(set_to_none=True)
    errs = []
    for leaf, want in ((ls, r.source_relevance), (lt, r.target_relevance)):
        g = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
        errs.append((float(((leaf * g).sum(-1).detach().double() - want.double()).abs().max()),
                     float(want.abs().max())))
    scale = max(s for _, s in errs) + 1e-300
    err = max(e for e, _ in errs)
    if not err <= 1e-5 * scale:
        return (f"the user's scope with trainable parameters differs from pyattr.relevance by {err:.3g} (max "
                f"|relevance| {scale:.3g})")
    return None


def padded(pyattr, model, x, r, tid: int) -> Optional[Dict[str, str]]:
    """The source padded on the right (the decoder's inputs as made from the row alone)
    against the row alone: None when equal, else the status."""
    from pyattr.methods.seq2seq_inputs import derived_decoder_ids, no_cache

    pad = int(getattr(model.config, "pad_token_id", 0) or 0)
    ids = torch.cat([x, torch.full((1, 2), pad, dtype=x.dtype)], 1)
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0
    n = x.shape[1]
    # a classifier reads the decoder's state at the source's end-of-text token, so its
    # decoder inputs are the model's own from the padded source (the pads come after that
    # state under the causal mask); a language model's explained position is the last
    # decoder input, so those are the ones made from the row alone
    lm = r.target_ids is not None and A.classifier_head(model) is None
    dec = derived_decoder_ids(model, {"input_ids": x}, "zoo") if lm else None
    rp = pyattr.relevance(model, {"input_ids": ids, "attention_mask": mask}, decoder_input_ids=dec, target=tid,
                          generic=True)
    a = torch.cat([r.source_relevance[0], r.target_relevance[0]]).double()
    b = torch.cat([rp.source_relevance[0, :n], rp.target_relevance[0, :r.target_relevance.shape[1]]]).double()
    big = float(a.abs().max()) + 1e-300
    rest = max(float(rp.source_relevance[0, n:].abs().max()),
               float(rp.target_relevance[0, r.target_relevance.shape[1]:].abs().sum()))
    err = max(float((a - b).abs().max()), rest) / big
    terr = abs(float(r.target[0]) - float(rp.target[0])) / (abs(float(r.target[0])) + 1e-300)
    if max(err, terr) <= 1e-5:
        return None
    with torch.no_grad():
        alone = model(input_ids=x, decoder_input_ids=dec, **no_cache(model)).logits
        pl = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, **no_cache(model)).logits
    if alone.dim() == 3:
        pl = pl[:, :alone.shape[1]]
    noise = float((alone - pl).abs().max()) / (float(alone.abs().max()) + 1e-300)
    if not noise <= 1e-6:
        return {"status": "transformers", "detail": f"the model's own output with the source padded differs from "
                f"alone by {noise:.2g} of its largest"}
    return {"status": "wrong", "detail": f"right-padded source differs from the row alone by {err:.3g} of the largest "
                                         f"relevance (target by {terr:.2g})"}


def verdict(r, off: Optional[str], scope: Optional[str], pad: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The status of an encoder–decoder entry whose four checks ran (refusals and crashes
    are the caller's to classify, as for one stack)."""
    for detail in (off, scope, conserved(r)):
        if detail is not None:
            return {"status": "wrong", "detail": detail}
    if pad is not None:
        return pad
    d = float(r.conservation_delta.abs().max()) / max(float(r.target.abs().max()), 1e-300)
    return {"status": "right", "detail": f"both stacks; |delta|/|target| {d:.1e}"}
