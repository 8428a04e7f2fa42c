"""Resolving a model source (hub id, local folder, GGUF file) into a loaded PyTorch model."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.models.architectures import ArchitectureSpec, architecture_for
from specdec.models.errors import ExportError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


@dataclass
class LoadedSource:
    """A model ready to export: the folder optimum reads, plus the torch model and tokenizer."""

    source: str  # what the user passed
    export_path: str  # local folder (a cached hub snapshot when the hub is unreachable) or hub id for optimum
    model: Any  # transformers PreTrainedModel, fp32, eval mode
    tokenizer: Any  # transformers fast tokenizer
    config: dict[str, Any]
    architecture: ArchitectureSpec
    revision: str | None
    generation_eos: list[int]


def _is_gguf(source: str) -> bool:
    return source.lower().endswith(".gguf")


def _check_local_or_hub(source: str) -> None:
    path = Path(source)
    if _is_gguf(source):
        if not path.is_file():
            raise ExportError(f"GGUF file '{source}' does not exist")
        with open(path, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise ExportError(f"'{source}' is not a GGUF file (bad magic bytes)")
        return
    if path.exists():
        if not path.is_dir():
            raise ExportError(f"source '{source}' is a file but not a .gguf; give a model folder, hub id or GGUF file")
        if not (path / "config.json").is_file():
            raise ExportError(f"source folder '{source}' has no config.json: not a Hugging Face model folder")
        return
    if source.startswith((".", "/", "~")) or not _HUB_ID.match(source):
        raise ExportError(f"source '{source}' does not exist (not a folder, GGUF file or hub id)")


def _hub_cache_only(source: str, revision: str | None) -> bool:
    """Return True when a hub id must load from the local cache (hub unreachable or offline mode),
    False when the hub answers for it.

    One quick metadata request decides, because transformers on its own retries an unreachable
    hub for about 30 s, printing every retry, before saying a typo'd path does not exist.
    Raises ExportError for an id the hub does not have, or an unreachable hub with no cached copy.
    """
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    cached = isinstance(try_to_load_from_cache(source, "config.json", revision=revision), str)
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise ExportError(f"'{source}' is not a local folder or GGUF file, and not in the hub cache "
                              "(HF_HUB_OFFLINE is set)")
        return True
    try:
        model_info(source, revision=revision, timeout=10)
    except RevisionNotFoundError:
        raise ExportError(f"the hub model '{source}' has no revision '{revision}'") from None
    except RepositoryNotFoundError:
        raise ExportError(f"no model '{source}' on the Hugging Face hub, and no such local folder or GGUF file "
                          "(a private or gated model needs `huggingface-cli login`)") from None
    except OSError:  # connection refused, DNS failure, timeout: requests' errors are OSErrors
        if not cached:
            raise ExportError(f"cannot reach the Hugging Face hub for '{source}', and it is not in the local cache, "
                              "nor a local folder or GGUF file") from None
        return True
    return False


def load_source(source: str, workdir: Path, trust_remote_code: bool = False,
                revision: str | None = None) -> LoadedSource:
    """Return the loaded model behind a hub id, a local folder or a `.gguf` file.

    A GGUF file is dequantized by transformers and saved as a plain fp32 folder in
    `workdir`, which optimum then exports. Raises ExportError for a missing, unreadable or
    unsupported source.
    """
    _check_local_or_hub(source)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision:
        kwargs["revision"] = revision
    export_path = source
    cache_only = not _is_gguf(source) and not Path(source).exists() and _hub_cache_only(source, revision)
    if cache_only:
        # Read the cached snapshot as a local folder: optimum's hub lookups fail offline even
        # with local_files_only.
        from huggingface_hub import snapshot_download

        export_path = snapshot_download(source, revision=revision, local_files_only=True)
        kwargs.pop("revision", None)
    try:
        if _is_gguf(source):
            gguf = Path(source).resolve()
            kwargs = {"gguf_file": gguf.name}
            config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
            architecture_for(config.model_type)  # refuse before the slow dequantization
            # Handing the config on spares two more parses of the file's metadata (~5 s each on SmolLM2).
            tokenizer = gguf_tokenizer(gguf, config)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, config=config, dtype="float32", **kwargs)
            export_path = str(workdir / "hf")
            model.save_pretrained(export_path)
            tokenizer.save_pretrained(export_path)
        else:
            config = AutoConfig.from_pretrained(export_path, **kwargs)
            architecture_for(config.model_type)
            tokenizer = AutoTokenizer.from_pretrained(export_path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(export_path, dtype="float32", **kwargs)
    except ExportError:
        raise
    except OSError as err:
        raise ExportError(f"cannot load '{source}': {_first_line(err)}") from None
    except Exception as err:  # transformers/gguf raise many kinds on corrupt files
        # A cut-off download passes the magic-bytes check and fails deep in a reshape.
        what = " as GGUF (truncated or corrupt file?)" if _is_gguf(source) else ""
        raise ExportError(f"cannot read '{source}'{what}: {type(err).__name__}: {_first_line(err)}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ExportError(f"'{source}' has no fast tokenizer (tokenizer.json); specdec's runtime needs one")
    model.eval()
    config_dict = json.loads(model.config.to_json_string())
    eos = getattr(model.generation_config, "eos_token_id", None)
    generation_eos = [eos] if isinstance(eos, int) else list(eos or [])
    return LoadedSource(
        source=source,
        export_path=export_path,
        model=model,
        tokenizer=tokenizer,
        config=config_dict,
        architecture=architecture_for(config_dict["model_type"]),
        revision=revision,
        generation_eos=generation_eos,
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def gguf_tokenizer(gguf: Path, config):
    """Return the tokenizer of a GGUF file (transformers'), given its already parsed config."""
    from transformers import AutoTokenizer

    # legacy=True: the behaviour transformers picks by default, chosen here so that it need not say so.
    return AutoTokenizer.from_pretrained(gguf.parent, config=config, gguf_file=gguf.name, legacy=True)
