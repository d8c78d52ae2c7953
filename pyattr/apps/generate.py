"""``pyattr generate``: generate (or take) a continuation, explain every generated token
over the context, and show it: the terminal (top sources per step), JSON, an interactive
HTML page (hover or click a generated token to light up its sources; a matrix view), and
a PNG heatmap (generated × context)."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Optional


from pyattr.methods._core.tokens import continuation_ids, prompt_ids
import pyattr.methods._core as core
from pyattr.apps.explain import ExplainError, _load, check_prompt, model_label
from pyattr.apps.render import LEGEND_CSS, _display, _rgb, legend_html, num
from pyattr.apps.generation_report import GenerationReport  # noqa: F401 - the report's home before
from pyattr.config import RelevanceRules

DEFAULT_PROMPT = "sun cat red tree sun"


def run_generate(model_dir: Path, text: str, max_new_tokens: Optional[int], continuation: Optional[str],
                 target: str, rules: RelevanceRules, batch_targets: Optional[int] = None) -> GenerationReport:
    from pyattr.methods.generation import generation_relevance

    from pyattr.apps.generate_seq2seq import encoder_decoder_checkpoint, run_seq2seq

    if encoder_decoder_checkpoint(model_dir):  # read from its config, before any weights load
        tok, model = _load(model_dir, causal=None)  # the checkpoint's own class (MarianMTModel, T5…)
        return run_seq2seq(model, tok, model_label(model_dir), text, max_new_tokens, continuation, target, rules,
                           batch_targets)
    tok, model = _load(model_dir, causal=True)
    tok.padding_side = "left"
    import torch

    kw = {}
    if continuation is not None:
        # the joint text's tokens, split where the tokenizer's offsets put the join:
        # tokenized apart, a byte-level BPE continuation loses its leading space
        try:
            prompt, cont = continuation_ids(tok, text, continuation)
        except ValueError as e:
            raise ExplainError(f"--{e}") from None
        kw["continuation"] = torch.tensor([cont])
    else:
        prompt = prompt_ids(tok, text)
    check_prompt("--text", prompt, model, tok)
    limit = core.max_positions(model)
    more, what = (len(kw["continuation"][0]), "--continuation") if continuation is not None else \
        (max_new_tokens, "--max-new-tokens")
    # the model reads every token but the last one generated
    if limit is not None and more is not None and len(prompt) + more - 1 > limit:
        raise ExplainError(f"--text is {len(prompt)} tokens and {what} adds {more}: the model would read "
                           f"{len(prompt) + more - 1} positions (all but the last token); it reads at most {limit}")
    ids = torch.tensor([prompt])
    enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if continuation is None:
        kw["max_new_tokens"] = max_new_tokens
    t0 = time.perf_counter()
    r = generation_relevance(model, enc, target=target, rules=rules, batch_targets=batch_targets, **kw)
    seconds = time.perf_counter() - t0
    steps = int(r.step_mask[0].sum())
    cols = r.attention_mask[0].bool().nonzero()[:, 0]
    first = int(cols[0])
    tokens = tok.convert_ids_to_tokens(r.sequences[0, cols].tolist())
    matrix = r.token_relevance[0, :steps][:, cols].tolist()
    return GenerationReport(
        model=model_label(model_dir), tokens=tokens, prompt_tokens=r.prompt_width - first,
        generated_text=tok.decode(r.generated[0, :steps], skip_special_tokens=True),
        matrix=matrix, targets=r.target[0, :steps].tolist(), deltas=r.conservation_delta[0, :steps].tolist(),
        target_kind=target, seconds=seconds, backend=r.backend, batch_targets=r.batch_targets,
    )


def print_terminal(rep: GenerationReport, top: int = 3, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(soft_wrap=True)
    console.print(f"[bold]model[/bold]      {escape(rep.model)}")
    if rep.source_tokens is None:
        console.print(f"[bold]prompt[/bold]     {escape(' '.join(_display(t) for t in rep.tokens[:rep.prompt_tokens]))}")
    else:  # an encoder–decoder: the source, then the decoder's own start
        n = rep.source_tokens
        console.print(f"[bold]source[/bold]     {escape(' '.join(_display(t) for t in rep.tokens[:n]))}")
        console.print(f"[bold]decoder start[/bold] "
                      f"{escape(' '.join(_display(t) for t in rep.tokens[n:rep.prompt_tokens]))}")
    console.print(f"[bold]generated[/bold]  {escape(rep.generated_text)}")
    t = Table(title=f"per generated token: its {rep.target_kind} and top {top} sources")
    for c in ("step", "token", rep.target_kind, "conservation delta", "top sources (position 'token' relevance)"):
        t.add_column(c)
    for s in range(len(rep.matrix)):
        src = ", ".join(f"{rep.position(i)} '{_display(w)}' {num(v, '+.3f')}" for i, w, v in rep.top_sources(s, top))
        t.add_row(str(s), escape(_display(rep.tokens[rep.prompt_tokens + s])), num(rep.targets[s], "+.4f"),
                  num(rep.deltas[s], "+.2e"), escape(src))
    console.print(t)
    console.print(f"wall time  {rep.seconds * 1e3:.1f} ms ({len(rep.matrix)} steps, {rep.batch_targets} per backward; "
                  f"backend {rep.backend})")


def to_html(rep: GenerationReport) -> str:
    """One page: the text with each generated token clickable (hover or click lights up its
    sources, red positive, blue negative, on that step's own scale; the first step is shown
    on load), a readout that names the value under the mouse (a context token of the shown
    step, or a matrix cell), the matrix view, and a colour legend for each."""
    data = json.dumps({"tokens": [_display(t) for t in rep.tokens], "prompt": rep.prompt_tokens,
                       "matrix": rep.matrix, "targets": rep.targets})
    scale = max((abs(v) for row in rep.matrix for v in row), default=1.0) or 1.0
    head = "".join(f"<th>{html.escape(_display(t))}</th>" for t in rep.tokens)
    rows = []
    for s, row in enumerate(rep.matrix):
        cells = "".join(
            f'<td style="background:rgb{_rgb(v, scale)}" title="{num(v, "+.4f")}" data-s="{s}" data-i="{i}" '
            f'data-v="{num(v, "+.4f")}"></td>'
            if i < rep.prompt_tokens + s else '<td class="na"></td>' for i, v in enumerate(row))
        rows.append(f"<tr><th>{html.escape(_display(rep.tokens[rep.prompt_tokens + s]))}</th>{cells}</tr>")
    text_legend = legend_html("-max", "+max", "Text: each context token's relevance for the shown generated token "
                              "(blue negative, red positive; full colour at that step's largest |relevance|)")
    matrix_legend = legend_html(num(-scale, "+.4f"), num(scale, "+.4f"),
                                "Matrix: relevance (blue negative, red positive; one scale for the whole matrix; "
                                "grey: not in that step's context)", ids="legend-matrix")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>pyattr generate</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 70em; color: #111; font-size: 16px; }}
#text {{ line-height: 2.2; }}
.tok {{ padding: 0.15em 0.3em; border-radius: 3px; font-family: monospace; font-size: 15px; cursor: default; }}
.tok:hover {{ outline: 2px solid #555; }}
.gen {{ border-bottom: 3px solid #555; cursor: pointer; }}
.gen.sel {{ font-weight: bold; }}
#info {{ position: sticky; top: 0; z-index: 5; width: fit-content; background: #222; color: #fff;
  font: 14px monospace; padding: 6px 10px; border-radius: 4px; }}
table.m {{ border-collapse: separate; border-spacing: 2px; }}
table.m td {{ width: 1.6em; height: 1.4em; border: 1px solid #ddd; }} table.m td.na {{ background: {OUT_OF_CONTEXT}; }}
table.m td[data-v]:hover {{ outline: 2px solid #111; }}
table.m th {{ font: 13px monospace; padding: 0 0.3em; }}
{LEGEND_CSS}</style></head><body>
<h1>Relevance of generated tokens</h1>
<p>model <code>{html.escape(rep.model)}</code>; target: each generated token's {html.escape(rep.target_kind)}.
Hover or click a generated (underlined) token: its sources light up (red positive, blue negative, scaled to the
step's largest |relevance|; the token shown is framed, a clicked one bold); hover a context token or a matrix cell
to read its value.</p>
<p id="text"></p>
<p id="info">&nbsp;</p>
{text_legend}
<h2>Matrix: generated token (rows) × context (columns)</h2>
<table class="m" id="matrix"><tr><th></th>{head}</tr>
{"".join(rows)}
</table>
{matrix_legend}
<script>
const D = {data};
const $ = id => document.getElementById(id);
const text = $("text"), info = $("info");
let current = 0;
const spans = D.tokens.map((t, i) => {{
  const s = document.createElement("span");
  s.className = "tok" + (i >= D.prompt ? " gen" : "");
  s.textContent = t; text.appendChild(s); text.appendChild(document.createTextNode(" "));
  if (i >= D.prompt) {{
    s.addEventListener("mouseenter", () => show(i - D.prompt));
    s.addEventListener("click", () => {{ spans.forEach(x => x.classList.remove("sel")); s.classList.add("sel"); show(i - D.prompt); }});
  }} else {{
    s.addEventListener("mouseenter", () => source(current, i));
  }}
  return s;
}});
function colour(v, m) {{
  const a = Math.max(-1, Math.min(1, v / m)), k = Math.round(255 * (1 - Math.abs(a)));
  return a >= 0 ? `rgb(255,${{k}},${{k}})` : `rgb(${{k}},${{k}},255)`;
}}
function ink(v, m) {{ return v / m < -0.6 ? "#fff" : "#000"; }}  // white text on the deep blues
function fmt(v) {{ const s = v.toFixed(4); return Number(s) === 0 ? (0).toFixed(4) : (v > 0 ? "+" : "") + s; }}
function source(step, i) {{
  const own = D.prompt + step;
  info.textContent = i < own
    ? `step ${{step}} '${{D.tokens[own]}}' <- '${{D.tokens[i]}}' (position ${{i}}): ${{fmt(D.matrix[step][i])}}`
    : `'${{D.tokens[i]}}' (position ${{i}}) is not in the context of step ${{step}}`;
}}
function show(step) {{
  current = step;
  const row = D.matrix[step], own = D.prompt + step;
  const m = Math.max(1e-12, ...row.slice(0, own).map(Math.abs));
  spans.forEach((s, i) => {{
    s.style.background = i < own ? colour(row[i], m) : "";
    s.style.color = i < own ? ink(row[i], m) : "";
    s.title = i < own ? row[i].toFixed(4) : "";
    s.style.boxShadow = i === own ? "0 0 0 2px #111" : "";  // the generated token shown
  }});
  info.textContent = `step ${{step}}: '${{D.tokens[own]}}', target ${{D.targets[step].toFixed(4)}}`;
  const lo = $("legend-lo"), hi = $("legend-hi");
  if (lo && hi) {{ lo.textContent = fmt(-m); hi.textContent = fmt(m); }}
}}
const M = $("matrix");
if (M && M.addEventListener) M.addEventListener("mouseover", e => {{
  const td = e.target.closest ? e.target.closest("td[data-s]") : null;
  if (td) source(Number(td.getAttribute("data-s")), Number(td.getAttribute("data-i")));
}});
if (D.matrix.length) show(0);
</script>
</body></html>
"""


#: The colour of a matrix cell outside its step's context, in the PNG as in the HTML page.
OUT_OF_CONTEXT = "#dddddd"


def figure(rep: GenerationReport):
    """The generated × context heatmap as a matplotlib figure: the page's matrix view (one
    colour scale, blue negative, white zero, red positive, cells outside a step's context
    grey as on the page) with a colour bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    m = np.array(rep.matrix, dtype=float).reshape(len(rep.matrix), len(rep.tokens))
    for s in range(m.shape[0]):
        m[s, rep.prompt_tokens + s:] = np.nan
    lim = float(np.nanmax(np.abs(m))) if np.isfinite(m).any() else 0.0
    lim = lim or 1.0
    # white is a relevance of zero: the cells outside a step's context (the token itself
    # and what follows) are grey, as on the page
    cmap = matplotlib.colormaps["bwr"].with_extremes(bad=OUT_OF_CONTEXT)
    fig, ax = plt.subplots(figsize=(max(4.5, 0.4 * m.shape[1] + 2), max(3, 0.35 * m.shape[0] + 2)))
    im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto",
                   interpolation="nearest")
    ax.set_xticks(range(m.shape[1]), [_display(t) for t in rep.tokens], rotation=90, fontsize=8)
    ax.set_yticks(range(m.shape[0]), [_display(t) for t in rep.tokens[rep.prompt_tokens:]], fontsize=8)
    ax.set_xlabel("context token (grey: not in that step's context)")
    ax.set_ylabel("generated token")
    ax.set_title(f"{rep.model}: each generated token's {rep.target_kind} over its context", fontsize=9)
    fig.colorbar(im, ax=ax, label=f"relevance of the {rep.target_kind} (±{lim:.3g})")
    fig.tight_layout()
    return fig


def save_png(rep: GenerationReport, path) -> None:
    """:func:`figure` written to ``path`` as PNG (120 dpi)."""
    import matplotlib.pyplot as plt

    fig = figure(rep)
    fig.savefig(path, dpi=120)
    plt.close(fig)
