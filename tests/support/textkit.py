"""Tiny text checkpoints for tests: a byte-level BPE tokenizer trained on a few strings next to a
random-init transformers model whose vocabulary matches it (no hub, built in well under a second)."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\nimport sys\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "for i in range(10):\n    print(i, 'héllo wörld', \"naïve café\")\n",
    "# 日本語のコメント ✓ — ünïcödé ∑ λ → ok\nvalue = {'key': [1, 2, 3]}\n",
]
EOS = "<|endoftext|>"


def make_tokenizer(path: Path, vocab_size: int = 320):
    """Byte-level BPE (any text encodes; multi-byte characters span several tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    fast.save_pretrained(str(path))
    return fast


def make_text_checkpoint(
    path: Path, family: str = "llama", tokenizer: bool = True, scale: float = 4.0
) -> Path:
    """A tiny random model of ``family`` whose vocabulary is the tokenizer's (saved alongside)."""
    import transformers
    from conformance import make_checkpoint

    path = Path(path)
    tok_dir = path.parent / (path.name + "-tok")
    tok = make_tokenizer(tok_dir)
    n = len(tok)
    ids = dict(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=n, n_positions=64, **ids)
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            num_hidden_layers=2,
            vocab_size=n,
            max_position_embeddings=64,
            **ids,
        )
    make_checkpoint(path, cfg, scale=scale)
    if tokenizer:
        tok.save_pretrained(str(path))
    return path


def shared_text_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """``(checkpoint, compile cache dir)`` at fixed places of the session's temp root, so the
    test files that use it share one compile cache (subprocess runs then start warm)."""
    root = tmp_path_factory.getbasetemp() / "text-shared"
    return make_text_checkpoint(root / "llama"), root / "compile_cache"


# shapes the CLI picks by default for this checkpoint with several prompts (max positions 64)
PIPE_SHAPES = dict(batch_size=4, n_positions=64)

# a compact chat template: the tiny tokenizer spells ChatML's markers out in bytes, too long for 64 positions
CHAT_TEMPLATE = (
    "{% for d in documents or [] %}{{ 'd:' + d['text'] + '\n' }}{% endfor %}"
    "{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'a:' }}{% endif %}"
    "{% if flag %}{{ 'F!' }}{% endif %}"  # a variable (tokenizer_encode_kwargs, chat_template_kwargs)
)


def chat_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """The shared checkpoint copied with ``CHAT_TEMPLATE`` in its tokenizer, and the shared cache."""
    import shutil

    from transformers import AutoTokenizer

    ckpt, cache = shared_text_checkpoint(tmp_path_factory)
    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(ckpt, path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    return path, cache


def text_pipes(path: Path, cache: Path):
    """``(aotlm pipeline, transformers pipeline)`` over one checkpoint at ``PIPE_SHAPES``."""
    import transformers
    from conformance import hf_model

    import aotlm

    ours = aotlm.pipeline("text-generation", model=str(path), compile_cache=str(cache), **PIPE_SHAPES)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    ref = transformers.pipeline("text-generation", model=hf_model(path), tokenizer=tok, batch_size=4)
    return ours, ref
