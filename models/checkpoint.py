"""Reading Hugging Face checkpoints: ``config.json`` plus safetensors (single or sharded).

Tensors are read memory-mapped, one at a time, so host memory holds at most one
full-precision tensor beyond the converted parameters. ``pytorch_model.bin`` is read
through torch when it is installed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_SINGLE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or holds unreadable ones."""


def load_hf_config(path: str | os.PathLike):
    """The transformers config of a checkpoint directory (never downloads)."""
    # local: slow to import (~1-2 s): kept out of `import aotlm` until text is needed
    from transformers import AutoConfig

    path = Path(path)
    cfg_file = path / "config.json"
    if path.is_file():
        raise CheckpointError(f"{path} is a file: give the checkpoint directory (holding config.json)")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist; check the path")
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing: a checkpoint directory needs config.json")
    try:
        json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); re-save the checkpoint") from e
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types, with multi-line messages
        why = " ".join(str(e).split("\n")[0].split())
        raise CheckpointError(
            f"{cfg_file} cannot be read by transformers AutoConfig ({why}); fix config.json (model_type, "
            "field types) or re-save the checkpoint"
        ) from e


class WeightReader:
    """Name -> numpy tensor access over the checkpoint's weight files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._stack = ExitStack()
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        self._torch_state: dict[str, object] | None = None
        p = self.path
        if (p / SAFE_INDEX).is_file():
            self._index(p / SAFE_INDEX)
        elif (p / SAFE_SINGLE).is_file():
            self._open_safetensors(SAFE_SINGLE)
        elif (p / TORCH_INDEX).is_file() or (p / TORCH_SINGLE).is_file():
            self._load_torch()
        else:
            raise CheckpointError(
                f"no weights in {p}: expected {SAFE_SINGLE}, {SAFE_INDEX} or {TORCH_SINGLE}; copy the "
                "weight files next to config.json"
            )

    def _index(self, index_file: Path) -> None:
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{index_file} is not a valid safetensors index ({e}); re-download or re-save the checkpoint"
            ) from e
        for fname in sorted(set(weight_map.values())):
            self._open_safetensors(fname)

    def _open_safetensors(self, fname: str) -> None:
        # local: kept out of `import aotlm` until weights are read or written
        from safetensors import safe_open

        f = self.path / fname
        if not f.is_file():
            raise CheckpointError(
                f"weight file {f} is missing (named in {SAFE_INDEX}); copy every shard of the checkpoint"
            )
        try:
            handle = self._stack.enter_context(safe_open(str(f), framework="numpy"))
            names = list(handle.keys())
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(
                f"weight file {f} is corrupt or not safetensors ({e}); re-download or re-save the checkpoint"
            ) from e
        self._files[fname] = handle
        for n in names:
            self._where[n] = fname

    def _load_torch(self) -> None:
        try:
            import torch  # local: optional (HF interop / .bin checkpoints): kept out of `import aotlm`
        except ImportError as e:
            raise CheckpointError(
                f"{self.path} holds only pytorch_model.bin weights, which need torch: "
                "pip install torch==2.13.0, or convert the checkpoint to safetensors"
            ) from e
        p = self.path
        files = [TORCH_SINGLE]
        if (p / TORCH_INDEX).is_file():
            files = sorted(set(json.loads((p / TORCH_INDEX).read_text())["weight_map"].values()))
        self._torch_state = {}
        for fname in files:
            try:
                sd = torch.load(str(p / fname), map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:
                raise CheckpointError(f"weight file {p / fname} cannot be read by torch: {e}") from e
            self._torch_state.update(sd)
        self._where = {n: "torch" for n in self._torch_state}

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        """One tensor as a numpy array (float tensors widened to float32)."""
        if name not in self._where:
            raise CheckpointError(
                f"tensor {name!r} is missing from the checkpoint in {self.path}; re-save the checkpoint"
            )
        if self._torch_state is not None:
            t = self._torch_state[name]
            arr = t.float().numpy() if t.is_floating_point() else t.numpy()
        else:
            fname = self._where[name]
            try:
                arr = self._files[fname].get_tensor(name)
            except Exception as e:
                raise CheckpointError(
                    f"tensor {name!r} in {self.path / fname} is unreadable ({e}); re-save the checkpoint"
                ) from e
        if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
            arr = np.asarray(arr, dtype=np.float32)
        return arr

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for n in self._where:
            yield n, self.get(n)

    def close(self) -> None:
        self._stack.close()
        self._torch_state = None
