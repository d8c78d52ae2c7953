"""The reference EAP / EAP-IG implementation (the ``eap`` package of Hanna et al.'s EAP-IG
repository, on TransformerLens) run on the edges, pairs and metric of ``pyattr bench
--circuits`` (:mod:`pyattr.bench.circuits`), so that the benchmark can show it beside
pyattr's own edge attribution where it is installed. It is never a dependency of pyattr:
:func:`eap_available` tells whether it can be imported, and importing this module imports
neither ``eap`` nor ``transformer_lens``.

How a toy decoder is given to the library (its public ``Graph.from_model``, ``attribute``,
``Graph.apply_topn`` and ``evaluate_graph``):

- **model**: a ``HookedTransformer`` built from the Hugging Face Llama's own config and
  weights (:func:`hooked_from_llama`): ``HookedTransformerConfig`` with RMS norms, rotary
  positions (base from ``rope_parameters``, GPT-NeoX halves as Llama rotates them), gated
  SiLU MLP, no biases, final RMS norm, untied unembedding; the weights through
  TransformerLens's own ``convert_llama_weights``, loaded with no folding or centring (the
  norms stay where the Hugging Face model has them). EAP-IG's switches are set:
  ``use_split_qkv_input``, ``use_attn_result``, ``use_hook_mlp_in`` (and
  ``ungroup_grouped_query_attention`` for a grouped-query model).
- **graph**: ``Graph.from_model`` of that model. Its nodes are named as pyattr's
  (:mod:`pyattr.patching.graph`): ``input``, ``a{l}.h{h}``, ``m{l}``; downstream
  ``a{l}.h{h}<q|k|v>``, ``m{l}``, ``logits``; and its edges are ``"u->d"`` as pyattr's,
  so scores are mapped to pyattr's edge order by name (the two sets are checked equal).
- **pairs**: the token ids themselves. EAP-IG tokenizes strings (``tokenize_plus``, with a
  BOS prepended); during a call its two modules' ``tokenize_plus`` is replaced by one
  that takes an id tensor as it is (mask all ones, every row its full length).
- **device**: EAP-IG allocates its score matrix with ``device='cuda'``; during a call the
  ``torch`` its ``attribute`` module sees maps that device to the model's.
- **metric**: ``logit[answer] − logit[alternative]`` at the last position, summed over the
  batch for ``attribute`` (which divides its scores by the number of pairs: the mean over
  pairs, as pyattr's ``scores``), per pair for ``evaluate_graph``.
- **methods**: ``EAP``; ``EAP-IG-inputs`` (interpolated embeddings at ``k/steps``,
  k = 0 … steps − 1, from the corrupt end: a left Riemann sum, where pyattr's ``ig`` takes
  midpoints); ``EAP-IG-activations`` (each of ``input``, the attention layers and the MLPs
  in turn interpolated at ``k/steps``, k = 1 … steps, its gradients averaged over all those
  runs).
- **per pair** (for top-2): one ``attribute`` call per pair (its scores are sums over the
  batch); their mean is the batch call's scores.

The rows' CPR and CMD come from pyattr's own :func:`pyattr.patching.circuit_faithfulness`
on the library's scores in pyattr's edge order, so both libraries' circuits are judged by
one evaluator; :func:`library_faithfulness` gives the library's own (``apply_topn`` by
magnitude, pruned, ``evaluate_graph``) for comparison.

Where it runs: EAP-IG needs ``transformer_lens.HookedTransformer``, which TransformerLens
4.0 removed (its ``import`` then fails and :func:`eap_available` is False); TransformerLens
3.9 (which needs transformers >= 5.9) has it and reads nothing of the saved model: the
conversion works from the loaded Hugging Face model.

What was checked (EAP-IG 2.0.0 at its repository's head, TransformerLens 3.9.0,
transformers 5.25.0, torch 2.13.0 CPU; both toy decoders, key and value pairs, 64 each):

- the converted model's logits equal the Hugging Face model's to 1.1e-5 (every position
  and vocabulary entry, clean and corrupt ids; logits up to about 16);
- the graphs have the same 110 edges by name (EAP-IG lists them in another order: per
  head q, k, v where pyattr lists each layer's queries, then keys, then values);
- EAP's scores equal pyattr's ``edge_attribution(method="atp")`` to 4e-7 (scores up to
  7.5), per pair to 3e-6: the same estimator on the same graph;
- EAP-IG's ``exact`` (one ``evaluate_graph`` per edge) equals pyattr's ``edge_effects`` to
  2.3e-6 on all 110 edges (effects up to 14);
- on the same scores, the library's pruned top-n circuits are the very edge sets of
  pyattr's ``top_edges`` at every MIB size, their faithfulness by ``evaluate_graph`` equals
  pyattr's ``circuit_faithfulness`` to 3.3e-8, and CPR and CMD agree to 5e-8;
- EAP-IG-inputs (16 steps) and pyattr's ``ig`` (16 steps) differ by their quadrature
  alone: Pearson above 0.9998, largest difference 0.16 at 16 steps and 0.04 at 64;
- the mean of the per-pair calls equals the batch call to 1.1e-6.
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch

#: (row name, ``attribute`` method, ``ig_steps``)
VARIANTS = (
    ("EAP-IG library: EAP", "EAP", None),
    ("EAP-IG library: EAP-IG-inputs, 16 steps", "EAP-IG-inputs", 16),
    ("EAP-IG library: EAP-IG-activations, 4 steps", "EAP-IG-activations", 4),
)


def eap_available() -> bool:
    """Whether EAP-IG (``import eap.attribute``) and a TransformerLens with
    ``HookedTransformer`` (before 4.0) can be imported here."""
    try:
        importlib.import_module("eap.attribute")
        importlib.import_module("eap.evaluate")
        from transformer_lens import HookedTransformer  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means: not usable here
        return False
    return True


def hooked_from_llama(hf_model):
    """A ``HookedTransformer`` computing what the Hugging Face Llama ``hf_model`` computes,
    configured as EAP-IG requires (see the module docstring)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights

    c = hf_model.config
    if c.model_type != "llama" or getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("hf_model: expected a Llama without biases")
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"hf_model: rope type {rope.get('rope_type')!r} is not converted")
    base = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    d_head = getattr(c, "head_dim", None) or c.hidden_size // heads
    p = next(hf_model.parameters())
    cfg = HookedTransformerConfig(
        d_model=c.hidden_size, d_head=d_head, n_heads=heads, d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings, eps=c.rms_norm_eps,
        d_vocab=c.vocab_size, act_fn=c.hidden_act, n_key_value_heads=None if kv == heads else kv,
        normalization_type="RMS", positional_embedding_type="rotary", rotary_adjacent_pairs=False,
        rotary_dim=d_head, rotary_base=base, final_rms=True, gated_mlp=True,
        original_architecture="LlamaForCausalLM", device=str(p.device), dtype=p.dtype,
        use_split_qkv_input=True, use_attn_result=True, use_hook_mlp_in=True,
        ungroup_grouped_query_attention=kv != heads, default_prepend_bos=False)
    if getattr(c, "tie_word_embeddings", False):
        raise ValueError("hf_model: tied embeddings are not converted")
    ht = HookedTransformer(cfg)
    with torch.no_grad():
        sd = {k: v.detach().clone() for k, v in convert_llama_weights(hf_model, cfg).items()}
    ht.load_and_process_state_dict(sd, fold_ln=False, center_writing_weights=False, center_unembed=False,
                                   fold_value_biases=False)
    return ht.eval()


class _DeviceTorch:
    """``torch`` with ``zeros(..., device='cuda')`` placed on ``device`` instead."""

    def __init__(self, device):
        self._device = device

    def __getattr__(self, name):
        return getattr(torch, name)

    def zeros(self, *args, device=None, **kw):
        return torch.zeros(*args, device=self._device if device == "cuda" else device, **kw)


def _ids_plus(model, inputs, max_length=None):
    """EAP-IG's ``tokenize_plus`` for an id tensor: (ids, mask, lengths, positions)."""
    ids = inputs.to(model.cfg.device)
    mask = torch.ones_like(ids)
    return ids, mask, mask.sum(1), ids.shape[1]


@contextlib.contextmanager
def _patched_eap(device):
    import eap.attribute as EA
    import eap.evaluate as EE

    saved = (EA.torch, EA.tokenize_plus, EE.tokenize_plus)
    EA.torch, EA.tokenize_plus, EE.tokenize_plus = _DeviceTorch(device), _ids_plus, _ids_plus
    try:
        yield EA, EE
    finally:
        EA.torch, EA.tokenize_plus, EE.tokenize_plus = saved


def _metric(summed: bool):
    """EAP-IG's metric signature ``(logits, clean_logits, input_lengths, label)``; ``label``
    is (answer, alternative), LongTensor[batch] each."""
    def metric(logits, clean_logits, input_lengths, label):
        answer, alternative = label
        last = logits[torch.arange(logits.shape[0]), input_lengths - 1]
        diff = last.gather(1, answer[:, None].to(last.device))[:, 0] \
            - last.gather(1, alternative[:, None].to(last.device))[:, 0]
        return diff.sum() if summed else diff
    return metric


def library_scores(ht, clean, corrupt, answer, alternative, method: str, steps: Optional[int],
                   edge_names: Sequence[str]) -> torch.Tensor:
    """Tensor[edges] float64: EAP-IG's ``attribute`` scores (mean over the pairs), in the
    order of ``edge_names`` (pyattr's). Raises ValueError where the edge sets differ."""
    from eap.graph import Graph

    g = Graph.from_model(ht)
    if set(g.edges) != set(edge_names):
        raise ValueError(f"edge sets differ: only EAP-IG {sorted(set(g.edges) - set(edge_names))[:3]}, "
                         f"only pyattr {sorted(set(edge_names) - set(g.edges))[:3]}")
    with _patched_eap(ht.cfg.device) as (EA, _):
        EA.attribute(ht, g, [(clean, corrupt, (answer, alternative))], _metric(True), method=method,
                     ig_steps=steps, quiet=True)
    s = g.scores.detach().double().cpu()
    return torch.tensor([float(s[g.edges[n].matrix_index]) for n in edge_names], dtype=torch.float64)


def library_faithfulness(ht, clean, corrupt, answer, alternative, scores: torch.Tensor,
                         edge_names: Sequence[str], sizes: Optional[Sequence[float]] = None) -> Dict:
    """EAP-IG's own evaluation of the circuits of ``scores``' top edges (pyattr's order):
    at each size ``int(size × edges)`` edges by magnitude (``apply_topn``, pruned), run by
    ``evaluate_graph``; ``{"curve", "counts", "cpr", "cmd"}`` as pyattr computes them."""
    from eap.graph import Graph
    from pyattr.patching.circuit import MIB_SIZES, _areas

    sizes = MIB_SIZES if sizes is None else tuple(sizes)
    g = Graph.from_model(ht)
    for n, v in zip(edge_names, scores.tolist()):
        g.edges[n].score = v
    data = [(clean, corrupt, (answer, alternative))]
    with _patched_eap(ht.cfg.device) as (_, EE):
        clean_m = float(EE.evaluate_baseline(ht, data, _metric(False), quiet=True).double().mean())
        corrupt_m = float(EE.evaluate_baseline(ht, data, _metric(False), run_corrupted=True, quiet=True)
                          .double().mean())
        curve, counts = [], []
        for s in sizes:
            g.apply_topn(int(s * len(edge_names)), absolute=True)
            counts.append(int(g.count_included_edges()))
            m = float(EE.evaluate_graph(ht, g, data, _metric(False), quiet=True).double().mean())
            curve.append((m - corrupt_m) / (clean_m - corrupt_m))
    curve = torch.tensor(curve, dtype=torch.float64)
    cpr, cmd = _areas(torch.tensor(sizes, dtype=torch.float64), curve)
    return {"curve": curve, "counts": counts, "cpr": cpr, "cmd": cmd, "clean": clean_m, "corrupt": corrupt_m}


def _top2(per_pair: torch.Tensor) -> List[set]:
    return [set(r.tolist()) for r in per_pair.abs().topk(2, dim=-1).indices]


def eap_rows(hf_model, clean, corrupt, answer, alternative, name: str, exact_scores: torch.Tensor,
             exact_seconds: float, exact_per_pair: Optional[torch.Tensor] = None, repeats: int = 3,
             per_pair: bool = True, ht=None) -> List[Dict]:
    """Rows of :mod:`pyattr.bench.circuits` for EAP-IG's methods (:data:`VARIANTS`).

    Args:
        hf_model: the toy decoder (a Hugging Face Llama).
        clean, corrupt (LongTensor[pairs, seq]); answer, alternative (LongTensor[pairs]).
        name (str): the row's ``model``.
        exact_scores (Tensor[edges]): pyattr's exact edge effects (mean over pairs, pyattr's
            edge order), for ``pearson``; ``exact_seconds``: their time, for ``time_over_exact``.
        exact_per_pair (Tensor[pairs, edges], optional): for ``top2_equal_exact`` (None
            without it, or with ``per_pair=False``).
        repeats: timed calls (median) after one warm-up.
        per_pair: run one ``attribute`` call per pair for top-2 (untimed).
        ht: the converted model (default :func:`hooked_from_llama` of ``hf_model``).

    Returns:
        list of dict with the keys of :func:`pyattr.bench.circuits.model_rows`.
    """
    import pyattr.patching as P
    import pyattr.patching.graph as G
    import pyattr.targets as T
    from pyattr.patching.edges import EdgeAttributionResult

    ht = hooked_from_llama(hf_model) if ht is None else ht
    graph = G.build_graph(G.layout(hf_model))
    names = graph.edge_names()
    metric_target = T.LogitDiff(answer, alternative)
    top_exact = _top2(exact_per_pair) if exact_per_pair is not None else None
    rows = []
    for variant, method, steps in VARIANTS:
        def call():
            return library_scores(ht, clean, corrupt, answer, alternative, method, steps, names)
        scores = call()  # warm-up
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            scores = call()
            seconds.append(time.perf_counter() - t0)
        top2 = None
        pp = scores[None]
        if per_pair and top_exact is not None:
            pp = torch.stack([library_scores(ht, clean[i:i + 1], corrupt[i:i + 1], answer[i:i + 1],
                                             alternative[i:i + 1], method, steps, names)
                              for i in range(clean.shape[0])])
            top2 = statistics.fmean(a == b for a, b in zip(_top2(pp), top_exact))
        nan = torch.full((clean.shape[0],), float("nan"), dtype=torch.float64)
        result = EdgeAttributionResult(scores, pp, list(names), list(graph.upstream), list(graph.downstream),
                                       nan, nan, f"eap:{method}", steps or 1)
        cf = P.circuit_faithfulness(hf_model, clean, corrupt, result, metric=metric_target)
        pearson = float(torch.corrcoef(torch.stack([scores, exact_scores.double()]))[0, 1])
        sec = statistics.median(seconds)
        rows.append({"model": name, "variant": variant, "pairs": int(clean.shape[0]), "edges": len(names),
                     "seconds": sec, "pearson": pearson, "top2_equal_exact": top2, "cpr": cf.cpr,
                     "cmd": cf.cmd, "time_over_exact": sec / exact_seconds})
    return rows
