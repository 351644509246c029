"""A GGUF file's metadata -> its transformers config and tokenizer, without torch.

transformers builds both from a ``.gguf`` (``from_pretrained(dir, gguf_file=name)``) through its
GGUF loading modules, which import torch. aotlm runs without torch, so it reads the metadata with
gguf-py (the reader :mod:`aotlm.models.checkpoint.gguf_file` already opened) and builds the same two objects
from transformers' own torch-free parts:

* the config: every key renamed by transformers' table (``GGUF_CONFIG_MAPPING``, e.g.
  ``llama.context_length`` -> ``max_position_embeddings``), its per-architecture defaults
  (``GGUF_CONFIG_DEFAULTS_MAPPING``) and the fix-ups its loader applies to the architectures aotlm
  converts (see :func:`config_dict`), then the family's config class;
* the tokenizer: the vocabulary, merges and token types grouped by ``GGUF_TOKENIZER_MAPPING`` and
  converted by ``convert_gguf_tokenizer`` (the backend ``tokenizers`` object), wrapped in the
  tokenizer class ``AutoTokenizer`` picks for the config, with the special tokens, the
  ``add_bos_token`` / ``add_eos_token`` flags and the chat template of the file.

The tests compare the result with transformers' own GGUF loading (same config values, same token
ids, same chat template rendering) and run it in a process where torch cannot be imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, TokenizersBackend

__all__ = ["read_metadata", "config_dict", "build_config", "tokenizer_parts", "build_tokenizer"]

# GGUF token id keys -> the tokenizer's special token attributes
_SPECIAL = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
# llama.cpp writes an output matrix for these even when it is the embedding (transformers ties them)
_ALWAYS_TIED = ("falcon", "bloom")


def read_metadata(reader) -> dict:
    """Every metadata field of a gguf-py ``GGUFReader``: key -> str / int / float / bool / list."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _family(arch: str, metadata: dict) -> str:
    """The name transformers reads the file's keys under.

    llama.cpp writes Mistral models as ``llama``; transformers renames them ``mistral`` only when
    ``general.name`` is exactly ``"mistral"`` (it tests membership in the one-element list it reads
    the name as), so a file named e.g. "Mistral 7B" stays a ``llama`` config there, and here.
    """
    return "mistral" if arch == "llama" and metadata.get("general.name") == "mistral" else arch


def config_dict(metadata: dict, tensor_names: Iterable[str]) -> dict:
    """The config dict transformers' GGUF loading builds for a file with this metadata and tensors."""
    # local: transformers is slow to import (~1-2 s), needed only when a GGUF file is converted
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = metadata["general.architecture"]
    family = _family(arch, metadata)
    if arch not in GGUF_CONFIG_MAPPING and family not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"transformers has no GGUF config table for architecture {arch!r}")
    # the output matrix is written only when it differs from the embedding
    config = {"tie_word_embeddings": "output.weight" not in set(tensor_names) or arch in _ALWAYS_TIED}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(family) or GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, rest = key.replace(arch, family).partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target is None or target == -1:  # not a config key, or one the table skips on purpose
            continue
        if isinstance(value, list) and len(value) == 1:  # one-element arrays are read as scalars
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, family)
        config[target] = value
    if config.get("model_type") == "gemma3":  # a Gemma 3 GGUF holds the text model only
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), list):
        config["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    return config


def build_config(metadata: dict, tensor_names: Iterable[str]) -> PreTrainedConfig:
    """The transformers config object of the file (the class of its ``model_type``)."""
    from transformers import CONFIG_MAPPING  # local: slow import, only when a GGUF file is converted

    fields = config_dict(metadata, tensor_names)
    if fields.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(f"transformers has no config class for model_type {fields.get('model_type')!r}")
    return CONFIG_MAPPING[fields["model_type"]].from_dict(fields)


def tokenizer_parts(metadata: dict) -> tuple[dict, dict]:
    """``(tokenizer_dict, tokenizer_kwargs)``: the converter's input and the tokenizer's settings.

    The metadata grouped by transformers' ``GGUF_TOKENIZER_MAPPING`` (vocabulary, merges, types,
    scores -> the converter; chat template, add_bos / add_eos flags -> the tokenizer), plus the
    special tokens by their ids. A sentencepiece (``llama``) vocabulary without an ``add_bos_token``
    flag adds BOS (llama.cpp's default for it).
    """
    # local: slow import (transformers, tokenizers), only when a GGUF file is converted
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    groups = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, kwargs = groups["tokenizer"], groups["tokenizer_config"]
    kind = tokenizer_dict.get("tokenizer_type")
    if kind == "llama":
        kwargs.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes <bos> itself: transformers adds none
        kwargs["add_bos_token"] = False
    tokens = tokenizer_dict.get("tokens") or []
    for name, key in _SPECIAL.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(
                f"tokenizer.ggml.{key} is {token_id}, outside its {len(tokens)}-token vocabulary"
            )
        kwargs[name] = None if token_id is None else tokens[token_id]
    return tokenizer_dict, kwargs


def build_tokenizer(metadata: dict, config: PreTrainedConfig) -> TokenizersBackend:
    """The tokenizer of the file, in the class ``AutoTokenizer`` picks for ``config``.

    Raises ``ValueError`` when transformers cannot convert the file's tokenizer type.
    """
    from transformers import TokenizersBackend  # local: slow import, only when a GGUF file is converted
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer  # local: same
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING  # local: same

    tokenizer_dict, kwargs = tokenizer_parts(metadata)
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    cls = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    if not (isinstance(cls, type) and issubclass(cls, TokenizersBackend)):  # e.g. Mistral's own backend
        cls = TokenizersBackend
    return cls(tokenizer_object=backend, **kwargs, **extra)
