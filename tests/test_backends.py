import pytest
import torch

import pyattr
from pyattr import backends


def test_available_backends_reports_every_backend():
    st = pyattr.available_backends()
    assert list(st) == ["torch", "cpp", "cuda", "triton"]
    assert st["torch"].available
    for name, s in st.items():
        assert isinstance(s.available, bool) and isinstance(s.reason, str) and s.reason
    if not torch.cuda.is_available():
        assert not st["cuda"].available


def test_auto_picks_cpp_on_cpu_when_built_and_force_torch():
    expected = "cpp" if pyattr.available_backends()["cpp"].available else "torch"
    assert backends.select(torch.device("cpu"), "identity") == expected
    with pyattr.backend("torch"):
        assert backends.requested_backend() == "torch"
    assert backends.requested_backend() == "auto"


def test_forcing_an_unavailable_backend_raises(monkeypatch):
    # make one backend unavailable whatever this machine has, so the test always runs
    real = backends.available_backends

    def fake():
        st = real()
        st["cuda"] = backends.BackendStatus("cuda", False, "no CUDA device visible to torch")
        return st

    monkeypatch.setattr(backends, "available_backends", fake)
    with pytest.raises(pyattr.BackendUnavailableError, match="backend 'cuda' is not available: no CUDA device"):
        with pyattr.backend("cuda"):
            pass
    monkeypatch.setenv("PYATTR_BACKEND", "cuda")  # forced through the environment: raised at use
    with pytest.raises(pyattr.BackendUnavailableError, match="backend 'cuda' is not available"):
        backends.select(torch.device("cpu"), "identity")


def test_env_variable(monkeypatch):
    monkeypatch.setenv("PYATTR_BACKEND", "torch")
    assert backends.requested_backend() == "torch"
    monkeypatch.setenv("PYATTR_BACKEND", "fast")
    with pytest.raises(ValueError, match="PYATTR_BACKEND: unknown backend 'fast'"):
        backends.requested_backend()
    with pytest.raises(ValueError, match="PYATTR_BACKEND: unknown backend 'fast'"):
        x = torch.randn(3, requires_grad=True)
        pyattr.rules.identity_rule(x, "silu").sum().backward()


def test_unknown_backend_name():
    with pytest.raises(ValueError, match=r"backend: unknown backend 'numpy'"):
        with pyattr.backend("numpy"):
            pass


def test_context_overrides_env(monkeypatch):
    monkeypatch.setenv("PYATTR_BACKEND", "auto")
    with pyattr.backend("torch"):
        assert backends.requested_backend() == "torch"
