"""``python -m pyattr.bench.stable_check``: the kernels the ``cpp`` backend loaded
against the ``torch`` backend, op by op, where they run (README, Install).

For the prebuilt stable-ABI library (``pyattr._C_stable``) this is the check that it loads
and gives the torch backend's numbers under the torch that runs it: every rule op's
gradients (the Identity-rule for each activation, the Half-rule, the gated activation
under each rule pair, the LN-rule for LayerNorm and RMSNorm with the parameter gradients)
in float64, float32 and bfloat16, on rows whose length fills whole vectors and leaves a
tail, then a relevance attribution on the bundled induction model. ``--prebuilt`` makes
the loader take the prebuilt library even where a ``pyattr._C`` fits (a test, or a
checkout). Prints one line per check and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

# (atol, rtol) of the kernels against the torch backend: the same formulas with another
# summation order and vector math, one rounding of the dtype apart
TOLERANCE = {"float64": (1e-12, 1e-10), "float32": (1e-5, 1e-5), "bfloat16": (8e-3, 1.6e-2)}


def _cases(torch):
    """(name, fn(dtype) -> list of tensors whose backward is compared)."""
    from pyattr.ops import gated_activation, layer_norm, rms_norm
    from pyattr.rules import half_rule, identity_rule

    def grads(make, dtype, n_in):
        g = torch.Generator().manual_seed(0)
        ins = [(torch.randn(3, 5, 67, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
               for _ in range(n_in)]
        params = make(ins, g, dtype)
        out = params.pop("out")
        dy = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
        leaves = ins + params.get("leaves", [])
        return list(torch.autograd.grad(out, leaves, dy))

    cases = []
    for act in ("silu", "gelu", "gelu_tanh", "quick_gelu", "relu"):
        cases.append((f"identity_rule {act}", lambda dt, a=act: grads(
            lambda i, g, d: {"out": identity_rule(i[0], a)}, dt, 1)))
    cases.append(("half_rule", lambda dt: grads(lambda i, g, d: {"out": half_rule(i[0], i[1])}, dt, 2)))
    for identity in (True, False):
        for half in (True, False):
            cases.append((f"gated_activation silu identity={identity} half={half}", lambda dt, a=identity, b=half: grads(
                lambda i, g, d: {"out": gated_activation(i[0], i[1], "silu", identity=a, half=b)}, dt, 2)))

    def ln(i, g, d):
        w = torch.randn(67, generator=g, dtype=torch.float64).to(d).requires_grad_()
        b = torch.randn(67, generator=g, dtype=torch.float64).to(d).requires_grad_()
        return {"out": layer_norm(i[0], w, b, 1e-5), "leaves": [w, b]}

    def rms(offset):
        def f(i, g, d):
            w = torch.randn(67, generator=g, dtype=torch.float64).to(d).requires_grad_()
            return {"out": rms_norm(i[0], w, 1e-6, offset), "leaves": [w]}
        return f

    cases.append(("layer_norm (LN-rule) dx dweight dbias", lambda dt: grads(ln, dt, 1)))
    cases.append(("rms_norm (LN-rule) offset 0", lambda dt: grads(rms(0.0), dt, 1)))
    cases.append(("rms_norm (LN-rule) offset 1", lambda dt: grads(rms(1.0), dt, 1)))
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyattr.bench.stable_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prebuilt", action="store_true",
                    help="take the prebuilt pyattr._C_stable even where a pyattr._C fits")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.prebuilt:
        os.environ["PYATTR_JIT"] = "0"
        os.environ["PYATTR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pyattr-stable-check-")
    import torch

    import pyattr
    import pyattr.backends.extension as extension

    if args.prebuilt:
        extension.installed_library = lambda: None
    status = pyattr.available_backends()["cpp"]
    print(f"torch {torch.__version__}; cpp backend: {status.reason}")
    if not status.available:
        return 1
    if args.prebuilt and not status.reason.startswith("pyattr._C_stable "):
        print("the prebuilt library was not the one loaded")
        return 1
    failures, rows = 0, []
    for name, fn in _cases(torch):
        for dtype in ("float64", "float32", "bfloat16"):
            dt = getattr(torch, dtype)
            got = {}
            for backend in ("cpp", "torch"):
                with pyattr.backend(backend):
                    got[backend] = fn(dt)
            atol, rtol = TOLERANCE[dtype]
            worst = 0.0
            ok = True
            for a, b in zip(got["cpp"], got["torch"]):
                a, b = a.double(), b.double()
                worst = max(worst, (a - b).abs().max().item())
                ok &= bool(torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True))
            failures += not ok
            rows.append({"check": name, "dtype": dtype, "max_abs_diff": worst, "ok": ok})
            print(f"{'ok  ' if ok else 'FAIL'} {name:48s} {dtype:9s} max |cpp - torch| = {worst:.3g}")
    rel = {}
    for backend in ("cpp", "torch"):
        with pyattr.backend(backend):
            rel[backend] = pyattr.relevance("induction", "a b c d a b c").relevance
    worst = (rel["cpp"] - rel["torch"]).abs().max().item()
    ok = bool(torch.allclose(rel["cpp"], rel["torch"], atol=1e-5, rtol=1e-4))
    failures += not ok
    rows.append({"check": "relevance induction", "dtype": "float32", "max_abs_diff": worst, "ok": ok})
    label = 'pyattr.relevance("induction", ...)'
    print(f"{'ok  ' if ok else 'FAIL'} {label:48s} float32   max |cpp - torch| = {worst:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "cpp": status.reason, "checks": rows}, f, indent=1)
    print(f"{len(rows) - failures} of {len(rows)} checks agree" + (f"; {failures} FAILED" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
