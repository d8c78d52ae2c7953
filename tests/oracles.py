"""float64 oracles written independently of pyattr's closed forms."""

import math

import torch


def act64(kind, x):
    if kind == "silu":
        return x / (1 + torch.exp(-x))
    if kind == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    if kind == "gelu_tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if kind == "quick_gelu":
        return x / (1 + torch.exp(-1.702 * x))
    if kind == "relu":
        return torch.clamp(x, min=0)
    raise KeyError(kind)


def phi64(kind, x):
    """act(x)/x by division, with the limit 0.5 (0 for relu) at x = 0."""
    x = x.double()
    limit = 0.0 if kind == "relu" else 0.5
    safe = torch.where(x == 0, torch.ones_like(x), x)
    return torch.where(x == 0, torch.full_like(x, limit), act64(kind, safe) / safe)


def layer_norm_rule_grads(x, w, b, eps, dy):
    """LN-rule via autograd in float64: σ detached, μ differentiable."""
    x = x.double().detach().requires_grad_(True)
    w64 = None if w is None else w.double().detach().requires_grad_(True)
    b64 = None if b is None else b.double().detach().requires_grad_(True)
    mu = x.mean(-1, keepdim=True)
    sigma = ((x - mu) ** 2).mean(-1, keepdim=True).add(eps).sqrt().detach()
    y = (x - mu) / sigma
    if w64 is not None:
        y = y * w64
    if b64 is not None:
        y = y + b64
    ins = [t for t in (x, w64, b64) if t is not None]
    gs = torch.autograd.grad(y, ins, dy.double())
    return gs


def rms_norm_rule_grads(x, w, eps, offset, dy):
    x = x.double().detach().requires_grad_(True)
    w64 = None if w is None else w.double().detach().requires_grad_(True)
    r = (x**2).mean(-1, keepdim=True).add(eps).sqrt().detach()
    y = x / r
    if w64 is not None:
        y = y * (offset + w64)
    ins = [t for t in (x, w64) if t is not None]
    return torch.autograd.grad(y, ins, dy.double())
