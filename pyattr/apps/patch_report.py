"""``pyattr patch``: run the patching methods on one clean / corrupt pair and present the
result (terminal table, JSON, layer × position heatmaps as PNG or HTML, scatter plots of
each estimate against activation patching)."""

from __future__ import annotations

import base64
import html
import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from pyattr.methods._core.tokens import encoded_ids

from pyattr.apps.explain import (ExplainError, _check_text, _check_tokens, _load, bundled_model_dir, _tokens, check_prompt,
                                 model_label)
from pyattr.methods._core.tokens import prompt_ids

DEFAULT_CLEAN = "A man is playing a guitar on stage."
DEFAULT_CORRUPT = "A man is playing a ladder on stage."
DEFAULT_PARTNER = "Someone performs music with a guitar in front of an audience."
METHODS = ("relp", "atp", "exact")


@dataclass
class PatchReport:
    """Everything ``pyattr patch`` shows: per method a :class:`pyattr.patching.PatchingResult`
    (batch of one pair) and its wall time (s), the tokens, and the correlations of each
    estimate with activation patching (when it ran)."""

    model: str
    metric: str
    clean_tokens: List[str]
    corrupt_tokens: List[str]
    nodes: List[str]
    results: Dict[str, object]
    seconds: Dict[str, float]
    correlations: Dict[str, Dict[str, Dict[str, Optional[float]]]] = field(default_factory=dict)

    @property
    def first(self):
        return next(iter(self.results.values()))

    def sample(self, node: str):
        """The neuron sample of activation patching, if it took one for ``node``."""
        ex = self.results.get("exact")
        return None if ex is None else ex.sampled.get(node)

    def panel(self, method: str, node: str) -> torch.Tensor:
        r = self.results[method]
        return _heads_panel(r) if node == "heads" else _panel(r, node, self.sample(node))

    def to_json(self) -> dict:
        out = {
            "model": self.model,
            "metric": self.metric,
            "clean_tokens": self.clean_tokens,
            "corrupt_tokens": self.corrupt_tokens,
            "clean_metric": float(self.first.clean_metric[0]),
            "corrupt_metric": float(self.first.corrupt_metric[0]),
            "methods": {},
            "correlations": self.correlations,
        }
        for m, r in self.results.items():
            eff = {n: _nested(r[n][0]) for n in self.nodes}
            out["methods"][m] = {"seconds": self.seconds[m], "dims": {n: list(r.dims[n][1:]) for n in self.nodes},
                                 "effects": eff}
            if r.sampled:
                out["methods"][m]["sampled"] = {n: _nested(mask[0]) for n, mask in r.sampled.items()}
        return out


def _finite(v: float) -> Optional[float]:
    v = float(v)
    return None if v != v else v + 0.0


def _nested(t: torch.Tensor):
    """A tensor as nested lists; NaN (a neuron not patched) as null."""
    if t.dtype == torch.bool:
        return t.tolist()
    if t.dim() == 0:
        return _finite(t)
    return [_nested(x) for x in t]


def _panel(result, node: str, sample=None) -> torch.Tensor:
    """(layer, position) for the heatmaps: heads and neurons summed over their last dim.
    ``sample`` (bool, like the effects): sum only those neurons (the ones activation
    patching measured), so every method's panel adds up the same nodes; a cell with none
    of them is NaN."""
    e = result[node][0]
    if e.dim() == 3:
        if sample is not None:
            m = sample[0]
            e = torch.where(m, torch.nan_to_num(e), torch.zeros((), dtype=e.dtype)).sum(-1)
            e = torch.where(m.any(-1), e, torch.full((), float("nan")))
        else:
            e = e.sum(-1)
    return e


def _heads_panel(result) -> torch.Tensor:
    """(layer·head, position) for the heads heatmap."""
    e = result["heads"][0]  # (layer, position, head)
    return e.permute(0, 2, 1).reshape(-1, e.shape[1])


def logit_metric(tok, model, target: Optional[str], clean: str):
    """``(metric, description)``: the next-token logit of ``target`` after ``clean`` (the
    token as the tokenizer reads it there), or of the clean run's top-1 token."""
    import pyattr.targets as T

    if target is None:
        return T.Logit(), "logit of the clean run's top-1 next token at the last position"
    from pyattr.apps.explain import _target_id

    return T.Logit(_target_id(tok, target, model.config.vocab_size, clean)), f"logit of {target!r} at the last position"


def run_patch(clean: Optional[str], corrupt: Optional[str], partner: Optional[str], model_dir: Optional[Path],
              target: Optional[str], nodes: Sequence[str], methods: Sequence[str], sample: int,
              generic: bool = False) -> PatchReport:
    import pyattr.patching as P
    import pyattr.targets as T

    clean = _check_text("--clean", clean if clean is not None else DEFAULT_CLEAN)
    corrupt = _check_text("--corrupt", corrupt if corrupt is not None else DEFAULT_CORRUPT)
    causal = model_dir is not None
    path = model_dir if causal else bundled_model_dir()
    tok, model = _load(path, causal=causal)
    if "atp*" in methods:
        from pyattr.patching.atp_star import use_eager

        use_eager(model)
    if causal:  # the next token after the text, read as explain reads a prompt (no appended </s>)
        enc_c = {"input_ids": torch.tensor([prompt_ids(tok, clean)])}
        enc_x = {"input_ids": torch.tensor([prompt_ids(tok, corrupt)])}
    else:  # a sentence embedding: the whole tokenization, as explain --pair reads it
        enc_c = {"input_ids": torch.tensor([encoded_ids(tok, clean)])}
        enc_x = {"input_ids": torch.tensor([encoded_ids(tok, corrupt)])}
    nc, nx = enc_c["input_ids"].shape[1], enc_x["input_ids"].shape[1]
    if causal:  # prompt ids: the appended markers are already gone
        check_prompt("--clean", enc_c["input_ids"][0].tolist(), model, tok)
        check_prompt("--corrupt", enc_x["input_ids"][0].tolist(), model, tok)
    else:
        _check_tokens("--clean", nc, model, tok)
        _check_tokens("--corrupt", nx, model, tok)
    if nc != nx:
        raise ExplainError(
            f"--clean is {nc} tokens and --corrupt {nx}; patching pairs position p with position p, so the "
            "two texts must have the same number of tokens (replace a word by one of the same token length)"
        )
    if causal:
        metric, desc = logit_metric(tok, model, target, clean)
    else:
        partner = _check_text("--pair", partner if partner is not None else DEFAULT_PARTNER)
        enc_p = {"input_ids": torch.tensor([encoded_ids(tok, partner)])}
        _check_tokens("--pair", enc_p["input_ids"].shape[1], model, tok)
        with torch.no_grad():
            ref = model(**enc_p).last_hidden_state.mean(1)[0]
        metric = T.Cosine(ref)
        desc = f"cosine similarity of the mean-pooled embedding with {partner!r}"
    results, seconds = {}, {}
    for m in methods:
        t0 = time.perf_counter()
        if m == "exact":
            results[m] = P.activation_patching(model, dict(enc_c), dict(enc_x), metric, nodes=nodes,
                                               sample=sample if "neurons" in nodes else None, generic=generic)
        else:
            results[m] = P.attribution_patching(model, dict(enc_c), dict(enc_x), metric, nodes=nodes, method=m,
                                                generic=generic)
        seconds[m] = time.perf_counter() - t0
    rep = PatchReport(
        model=model_label(path),
        metric=desc,
        clean_tokens=_tokens(tok, enc_c["input_ids"][0]),
        corrupt_tokens=_tokens(tok, enc_x["input_ids"][0]),
        nodes=list(nodes),
        results=results,
        seconds=seconds,
    )
    if "exact" in results:
        from pyattr.patching.result import correlations

        ex = results["exact"]
        for m in results:
            if m == "exact":
                continue
            rep.correlations[m] = {}
            for n in nodes:
                keep = ~torch.isnan(ex[n])
                pr, sr = correlations(results[m][n][keep], ex[n][keep])
                rep.correlations[m][n] = {"pearson": pr, "spearman": sr}
    return rep


def _label(node: str, idx) -> str:
    layer, pos = idx[0], idx[1]
    extra = f" head {idx[2]}" if node == "heads" else f" neuron {idx[2]}" if node == "neurons" else ""
    return f"{node:<9} layer {layer} pos {pos}{extra}"


def print_terminal(rep: PatchReport, top: int = 10, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False)
    first = rep.first
    console.print(f"model    {rep.model}")
    console.print(f"metric   {rep.metric}")
    from pyattr.apps.render import num

    console.print(f"clean    {' '.join(rep.clean_tokens)}   metric {float(first.clean_metric[0]):+.6f}")
    console.print(f"corrupt  {' '.join(rep.corrupt_tokens)}   metric {float(first.corrupt_metric[0]):+.6f}")
    lead = "exact" if "exact" in rep.results else next(iter(rep.results))
    table = Table(title=f"top {top} nodes by |effect| ({lead})", title_justify="left")
    table.add_column("node")
    table.add_column("token")
    for m in rep.results:
        table.add_column(m, justify="right")
    for node, idx, _ in rep.results[lead].top(top):
        tokname = rep.clean_tokens[idx[1]] if idx[1] < len(rep.clean_tokens) else ""
        vals = [num(float(r[node][(0, *idx)]), "+.5f") for r in rep.results.values()]
        table.add_row(_label(node, idx), tokname, *vals)
    console.print(table)
    if rep.correlations:
        ct = Table(title="Pearson / Spearman with activation patching", title_justify="left")
        ct.add_column("method")
        for n in rep.nodes:
            ct.add_column(n, justify="right")
        for m, by in rep.correlations.items():
            ct.add_row(m, *[_corr(by[n]) for n in rep.nodes])
        console.print(ct)
    console.print("time     " + "   ".join(f"{m} {s * 1000:.0f} ms" for m, s in rep.seconds.items()))


def _corr(c) -> str:
    return "n/a" if c["pearson"] is None else f"{c['pearson']:+.3f} / {c['spearman']:+.3f}"


def shared_limits(rep: PatchReport) -> Dict[str, float]:
    """Per node type, the colour limit every method's panel of it shares: the largest
    |effect| over the methods (1.0 where all are zero), so that a panel's colours read the
    same in every row and an estimate that is too small or too large shows as paler or
    saturated against activation patching."""
    out = {}
    for n in rep.nodes:
        lim = max(float(torch.nan_to_num(rep.panel(m, n)).abs().max()) for m in rep.results)
        out[n] = lim or 1.0
    return out


def figure(rep: PatchReport):
    """A matplotlib figure: one row of heatmaps per method (one panel per node type;
    heads as layer·head × position; the panels of one node type on one colour scale,
    :func:`shared_limits`, stated in each title with the panel's own largest |effect|),
    and with activation patching a row of scatter plots of each estimate against it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(rep.results)
    scatter = "exact" in rep.results and len(methods) > 1
    rows = len(methods) + (1 if scatter else 0)
    cols = len(rep.nodes)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1, 2.8 * rows + 0.6), squeeze=False)
    lims = shared_limits(rep)
    for i, m in enumerate(methods):
        for j, n in enumerate(rep.nodes):
            ax = axes[i][j]
            data = rep.panel(m, n)
            lim = lims[n]
            # grey: a neuron cell activation patching did not measure
            cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="#dddddd")
            im = ax.imshow(data.numpy(), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
            own = float(torch.nan_to_num(data).abs().max())
            ax.set_title(f"{m}: {n}" + (" (sampled)" if n == "neurons" and rep.sample(n) is not None else "")
                         + f"\ncolour ±{lim:.3g} (the column's), max here {own:.3g}", fontsize=8)
            ax.set_xticks(range(len(rep.clean_tokens)))
            ax.set_xticklabels(rep.clean_tokens, rotation=90, fontsize=7)
            ax.set_ylabel("layer·head" if n == "heads" else "layer", fontsize=8)
            heads = rep.results[m]["heads"].shape[-1] if n == "heads" else 0
            ticks = range(0, data.shape[0], max(1, -(-data.shape[0] // 16)))  # whole rows, 16 labels at most
            ax.set_yticks(list(ticks))
            ax.set_yticklabels([f"L{i // heads} H{i % heads}" if heads else str(i) for i in ticks], fontsize=7)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    if scatter:
        ex = rep.results["exact"]
        for j, n in enumerate(rep.nodes):
            ax = axes[rows - 1][j]
            keep = ~torch.isnan(ex[n])
            for m in methods:
                if m == "exact":
                    continue
                c = rep.correlations[m][n]
                r = "n/a" if c["pearson"] is None else f"{c['pearson']:+.2f}"
                ax.scatter(ex[n][keep].numpy(), rep.results[m][n][keep].numpy(), s=6, alpha=0.6, label=f"{m} r={r}")
            ax.axline((0, 0), slope=1, color="grey", lw=0.6)
            ax.set_xlabel("activation patching", fontsize=7)
            ax.set_ylabel("estimate", fontsize=7)
            ax.set_title(f"{n}: estimate vs exact", fontsize=9)
            ax.legend(fontsize=6)
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(f"{rep.model}: {rep.metric}. Red: the metric goes up when the node is "
                                         "patched, blue: down; the panels of a column share one colour scale (±limit in each title)",
                                         width=int(40 * cols))), fontsize=9)
    fig.tight_layout()
    return fig


def to_png(rep: PatchReport) -> bytes:
    import matplotlib.pyplot as plt

    fig = figure(rep)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _cell(v: float, lim: float, where: str) -> str:
    """One table cell: the effect printed and as its colour (red positive, blue negative,
    full colour at ``lim``); ``where`` (method, node, row, token) for the hover readout."""
    from pyattr.apps.render import _ink, _rgb, num

    if v != v:
        return f'<td class="na" data-v="not measured" data-w="{where}">·</td>'
    rgb = _rgb(v, lim or 1.0)
    return (f'<td style="background:rgb{rgb};color:{_ink(rgb)}" title="{num(v, "+.6f")}" data-v="{num(v, "+.6f")}" '
            f'data-w="{where}">{num(v, "+.3f")}</td>')


# the hover readout: a box fixed to the window's lower right that names the hovered cell
_READOUT_JS = """<script>
(function () {
  var out = document.getElementById("readout");
  document.addEventListener("mouseover", function (e) {
    var td = e.target.closest ? e.target.closest("td[data-v]") : null;
    if (td) out.textContent = td.getAttribute("data-w") + ": " + td.getAttribute("data-v");
  });
})();
</script>"""


def to_html(rep: PatchReport) -> str:
    """A self-contained page: a table per method and node type (rows layers, or layer·head
    for heads; columns the clean tokens; cells coloured by effect, each table on its own
    scale, with its legend; neurons summed per layer and position, over activation
    patching's sample when it took one), a hover readout naming the cell under the mouse,
    the correlations, and the matplotlib figure embedded as a PNG."""
    from pyattr.apps.render import LEGEND_CSS, legend_html, num

    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>pyattr patch</title><style>"
        "body{font-family:sans-serif;margin:1.5em;color:#111;font-size:15px}"
        "table{border-collapse:collapse;margin:0.5em 0 0.5em}"
        "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;text-align:right}"
        "td{font-family:monospace}td[data-v]:hover{outline:2px solid #111;outline-offset:-2px}"
        "th{background:#f4f4f4}.na{color:#888}.panel{margin-bottom:1.8em}"
        "#readout{position:fixed;right:1em;bottom:1em;background:#222;color:#fff;font:14px monospace;"
        "padding:6px 10px;border-radius:4px;z-index:10;max-width:40em}"
        "img.fig{max-width:100%}" + LEGEND_CSS + "</style></head><body>",
        f"<h2>pyattr patch</h2><p>model: {esc(rep.model)}<br>metric: {esc(rep.metric)}<br>"
        f"clean: {esc(' '.join(rep.clean_tokens))} (metric {float(rep.first.clean_metric[0]):+.6f})<br>"
        f"corrupt: {esc(' '.join(rep.corrupt_tokens))} (metric {float(rep.first.corrupt_metric[0]):+.6f})</p>",
        "<div id='readout'>hover a cell for its value</div>",
        "<p>Each cell: the change in the metric when that node is patched from the corrupt run into the clean "
        "one (red: the metric goes up, blue: down). Every table has its own colour scale, shown under it.</p>",
    ]
    if rep.correlations:
        parts.append("<h3>Pearson / Spearman with activation patching</h3><table><tr><th>method</th>"
                     + "".join(f"<th>{esc(n)}</th>" for n in rep.nodes) + "</tr>")
        for m, by in rep.correlations.items():
            parts.append(f"<tr><th>{esc(m)}</th>" + "".join(f"<td>{_corr(by[n])}</td>" for n in rep.nodes) + "</tr>")
        parts.append("</table>")
    k = 0
    for m, r in rep.results.items():
        for n in rep.nodes:
            data = rep.panel(m, n)
            lim = float(torch.nan_to_num(data).abs().max())
            heads = r["heads"].shape[-1] if n == "heads" else 0
            parts.append(f"<div class='panel'><h3>{esc(m)}: {esc(n)} ({rep.seconds[m] * 1000:.0f} ms)</h3>"
                         "<table><tr><th></th>" + "".join(f"<th>{esc(t)}</th>" for t in rep.clean_tokens) + "</tr>")
            for i, row in enumerate(data.tolist()):
                label = f"L{i // heads} H{i % heads}" if heads else f"layer {i}"
                cells = "".join(
                    _cell(v, lim, esc(f"{m}: {n}, {label}, token {rep.clean_tokens[j]!r} (position {j})", quote=True))
                    for j, v in enumerate(row))
                parts.append(f"<tr><th>{label}</th>{cells}</tr>")
            lo, hi = (num(-lim, "+.3g"), num(lim, "+.3g")) if lim else ("-1", "+1")
            parts.append("</table>" + legend_html(lo, hi, f"{esc(m)}: {esc(n)} colour scale (effect)",
                                                  ids=f"legend-{k}") + "</div>")
            k += 1
    try:
        png = to_png(rep)
    except ImportError:
        parts.append("<p>(matplotlib is not installed: no figure)</p>")
    else:
        parts.append(f"<img class='fig' alt='heatmaps' src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    parts.append(_READOUT_JS)
    parts.append("</body></html>")
    return "\n".join(parts)
