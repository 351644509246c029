"""The models that ship inside the aotlm package, so every command works offline out of the box.

``aotlm/tiny-py`` is a ~5.5M-parameter Llama trained on the Python standard library's sources by
``scripts/train_default_model.py``; ``aotlm/tiny-py-draft`` is its ~6x smaller sibling on the same
tokenizer, for speculative decoding. Both are normal Hugging Face checkpoint directories installed
as package data (``aotlm/data/<dir>``), so transformers loads them too.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# public name -> directory under aotlm/data/
BUNDLED_MODELS: dict[str, str] = {
    "aotlm/tiny-py": "tiny-py",
    "aotlm/tiny-py-draft": "tiny-py-draft",
}
DEFAULT_MODEL = "aotlm/tiny-py"
DRAFT_MODEL = "aotlm/tiny-py-draft"


def bundled_path(name: str) -> Path | None:
    """The installed checkpoint directory of bundled model ``name``, or None if it is not bundled.

    None also when the name is known but its files are missing (a broken install), so callers
    can fall back to treating ``name`` as a path and report that.
    """
    sub = BUNDLED_MODELS.get(str(name))
    if sub is None:
        return None
    path = Path(str(resources.files("aotlm"))) / "data" / sub  # package data of ``aotlm`` (engine/data)
    return path if (path / "config.json").is_file() else None
