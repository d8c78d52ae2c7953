"""Loading a model whose name :mod:`pyattr.hub.names` resolved: the checkpoint's class, its
tokenizer, the checks that its weights are complete. :mod:`pyattr.hub` is the public face."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from pyattr._quiet import quiet_transformers
from pyattr.hub.names import (
    TOKENIZER_FILES,
    ModelLoadError,
    Source,
    _hub_preflight,
    check_dir,
    config_type,
    resolve,
)

if TYPE_CHECKING:
    import torch


def _quietly(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with quiet_transformers():
            return fn(*args, **kwargs)

    return run


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ModelLoadError("transformers is not installed (install pyattr with its hf extra: pip install '.[hf]' in a checkout, or pip install transformers)") from None
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


@_quietly
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


@_quietly
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
