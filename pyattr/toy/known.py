"""The toy decoders' known circuit (``circuit.json`` beside the weights) as a dict that
shows itself in a few lines: in a notebook a table of its heads, at a prompt one summary
line (the whole record printed bare was 50 lines)."""

from __future__ import annotations

import html


class KnownCircuit(dict):
    """``circuit.json`` of a toy decoder: every key as written there
    (``previous_token_heads``, ``induction_heads`` as ``[layer, head]`` pairs, the per-head
    ``scores``, ``mean_ablation_accuracy``, ``head_patching_mean``, ``training``, ...)."""

    def _heads(self):
        roles = [("previous-token", h) for h in self.get("previous_token_heads", [])]
        roles += [("induction", h) for h in self.get("induction_heads", [])]
        return roles

    def __repr__(self) -> str:
        heads = ", ".join(f"{role} {layer}.{head}" for role, (layer, head) in self._heads())
        train = self.get("training", {})
        acc = self.get("mean_ablation_accuracy", {})
        ablated = acc.get("circuit")
        ablated = f"{ablated:.3g}" if isinstance(ablated, (int, float)) else "?"
        return (f"KnownCircuit({heads}; clean logit diff {self.get('clean_logit_diff_mean', float('nan')):.4g}, "
                f"corrupt {self.get('corrupt_logit_diff_mean', float('nan')):.4g}; accuracy {acc.get('clean', '?')} "
                f"clean, {ablated} with its heads mean-ablated; trained {train.get('steps', '?')} steps; "
                f"keys: {', '.join(self)})")

    def _repr_html_(self) -> str:
        scores = self.get("scores", {})
        per_head = self.get("mean_ablation_accuracy", {}).get("per_head")

        def at(table, layer, head):
            try:
                return f"{float(table[layer][head]):.3f}"
            except (TypeError, IndexError, KeyError, ValueError):
                return ""

        rows = "".join(
            f"<tr><td>{layer}.{head}</td><td>{html.escape(role)}</td>"
            f"<td>{at(scores.get('previous_token'), layer, head)}</td><td>{at(scores.get('induction'), layer, head)}</td>"
            f"<td>{at(per_head, layer, head)}</td></tr>"
            for role, (layer, head) in self._heads())
        return ("<div class='pyattr-result'><h4>known circuit of the toy decoder</h4><table class='plain'><tr>"
                "<th>head</th><th>role</th><th>previous-token score</th><th>induction score</th>"
                "<th>accuracy with the head mean-ablated</th></tr>" + rows + "</table><div class='note'>"
                + html.escape(repr(self)) + "</div></div>")
