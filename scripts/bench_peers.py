"""Peers for ``scripts/bench.py``: the same checkpoint converted for CTranslate2, llama.cpp and
OpenVINO GenAI (``openvino_runner``, in ``bench_openvino``).

Each runner returns ``(prefill(), generate())`` callables for one batch of prompt ids, or raises
``Skip`` with the reason (peer not installed, conversion failed) so the bench goes on without it.
Both converters want a tokenizer: ``write_byte_vocab`` gives the random checkpoint a GPT-2-style
byte-level BPE (256 byte symbols, 50000 pair merges, ``<|endoftext|>``) covering every id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


class Skip(Exception):
    """This peer cannot run here; the message says why."""


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable unicode table (``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def write_bpe(path: Path, merges: list[tuple[str, str]]) -> list[str]:
    """A GPT-2 byte-level BPE of the 256 byte symbols, ``merges`` and ``<|endoftext|>`` in ``path``
    (``vocab.json``, ``merges.txt``, tokenizer configs; kept when already there); returns the
    token of every id."""
    tokens = _byte_symbols() + [a + b for a, b in merges] + ["<|endoftext|>"]
    if not (path / "vocab.json").is_file():
        (path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
        (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        cfg = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
        eos = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
        (path / "special_tokens_map.json").write_text(json.dumps(eos))
    return tokens


def write_byte_vocab(path: Path, vocab_size: int) -> list[str]:
    """``vocab_size`` tokens: the bytes, then merges of byte pairs in order (``write_bpe``)."""
    base = _byte_symbols()
    n_merges = vocab_size - 1 - len(base)
    return write_bpe(path, [(base[i // 256], base[i % 256]) for i in range(n_merges)])


def best_by_batch(rows: list[dict]) -> list[dict]:
    """Per batch: the fastest aotlm mode and the fastest mode of each peer (decode tok/s)."""
    kinds = {
        "aotlm": "aotlm",
        "ct2": "CTranslate2",
        "llama": "llama.cpp",
        "hf": "transformers",
        "ov": "OpenVINO",
    }
    out = []
    for b in dict.fromkeys(r["batch"] for r in rows):
        best: dict[str, dict] = {}
        for r in rows:
            kind = kinds.get(r["engine"].split(" ")[0].split("-")[0])
            if r["batch"] == b and kind and r["decode tok/s"] > best.get(kind, {}).get("decode tok/s", -1):
                best[kind] = r
        top = best.pop("aotlm", None)
        for r in best.values():
            ratio = top["decode tok/s"] / r["decode tok/s"] if top else float("nan")
            out.append({"batch": b, "aotlm best": top["engine"] if top else "-", "tok/s": top["decode tok/s"]
                        if top else float("nan"), "peer best": r["engine"], "peer tok/s": r["decode tok/s"],
                        "aotlm / peer": ratio})  # fmt: skip
    return out


# ------------------------------------------------------------------ CTranslate2
def ctranslate2_runner(ckpt: Path, work: Path, quant: str, ids, new: int):
    try:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        raise Skip("ctranslate2 not installed (pip install -e '.[bench]')") from None
    tokens = write_byte_vocab(ckpt, 50257)
    out = work / f"ct2-{quant}"
    if not (out / "model.bin").is_file():
        TransformersConverter(str(ckpt)).convert(str(out), quantization=quant, force=True)
    threads = os.cpu_count() or 1
    gen = ctranslate2.Generator(str(out), device="cpu", compute_type=quant, intra_threads=threads)
    prompts = [[tokens[i] for i in row] for row in ids]
    kw = dict(include_prompt_in_result=False, sampling_topk=1, end_token=[], max_batch_size=len(prompts))

    def prefill():
        gen.generate_batch(prompts, max_length=1, min_length=1, **kw)

    def generate():
        gen.generate_batch(prompts, max_length=new, min_length=new, **kw)

    return prefill, generate


def hf_checkpoint(ckpt: Path, work: Path) -> Path:
    """A checkpoint directory with its weights, for the peers that read one (transformers, CTranslate2's and
    OpenVINO's converters): ``ckpt`` itself, or for a converted GGUF model (aotlm reads its weights from the
    file: the directory has none) a float32 one written once by transformers' own GGUF loading into
    ``WORK/hf-<name>`` (temp dir + rename), with aotlm's tokenizer files beside it."""
    source = ckpt / "aotlm_gguf_source.json"
    if not source.is_file() or any(ckpt.glob("*.safetensors")):
        return ckpt
    out = work / f"hf-{ckpt.name}"
    if (out / "config.json").is_file():
        return out
    import shutil
    import tempfile

    import torch
    import transformers
    from safetensors.torch import save_model

    gguf = Path(json.loads(source.read_text())["path"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=work))
    try:  # save_pretrained refuses a model loaded from GGUF: the weights and a plain config instead
        save_model(model, str(tmp / "model.safetensors"))
        cfg = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            if (ckpt / f).is_file():
                shutil.copy(ckpt / f, tmp / f)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------------ OpenVINO GenAI
def openvino_runner(ckpt: Path, work: Path, fmt: str, ids, new: int):
    """(prefill, generate, weight bytes, KV bytes per value): ``bench_openvino.openvino_runner``."""
    from bench_openvino import openvino_runner as run  # local: bench_openvino imports Skip from here

    return run(ckpt, work, fmt, ids, new)


# ------------------------------------------------------------------ llama.cpp
def _gguf_source(ckpt: Path, work: Path) -> Path:
    """The checkpoint as the converter reads it: its GPT-2 code wants the legacy ``n_ctx`` config
    key, which transformers 5 no longer writes (a copy of config.json, the other files linked)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("model_type") != "gpt2" or "n_ctx" in cfg:
        return ckpt
    src = work / "gguf-src"
    src.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.name != "config.json" and not (src / f.name).exists():
            (src / f.name).symlink_to(f.resolve())
    (src / "config.json").write_text(json.dumps(dict(cfg, n_ctx=cfg["n_positions"]), indent=2))
    return src


def gguf_path(ckpt: Path, work: Path, outtype: str) -> Path:
    """Convert with llama.cpp's ``convert_hf_to_gguf.py`` (shipped with llama-cpp-python's sources)."""
    out = work / f"model-{outtype}.gguf"
    if out.is_file():
        return out
    script = os.environ.get("LLAMA_CPP_CONVERT")
    if not script or not Path(script).is_file():
        raise Skip("set LLAMA_CPP_CONVERT to llama.cpp's convert_hf_to_gguf.py to convert the checkpoint")
    src = _gguf_source(ckpt, work)
    # the converter refuses a byte-level BPE whose pre-tokenizer hash it does not know (our written
    # vocab); it is GPT-2's own pre-tokenization, so tell it so
    wrapper = (
        "import runpy, sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[2:]\n"
        "import conversion.base as b\n"
        "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    args = [str(src), "--outfile", str(out), "--outtype", outtype]
    cmd = [sys.executable, "-c", wrapper, str(Path(script).parent), script, *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise Skip(f"gguf conversion failed: {p.stderr.strip()[-300:]}")
    return out


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise Skip("llama-cpp-python not installed (pip install -e '.[bench]'; builds from source)") from None
    return llama_cpp


def converted_gguf(ckpt: Path, work: Path, outtype: str) -> Path:
    """A random-init checkpoint as a GGUF of ``outtype`` (a byte-level vocabulary written first)."""
    write_byte_vocab(ckpt, 50257)
    return gguf_path(ckpt, work, outtype)


def requantized_gguf(source: Path, work: Path, outtype: str) -> Path:
    """A real GGUF file re-quantized by llama.cpp's own quantizer (``llama_model_quantize``, as
    ``llama-quantize --allow-requantize`` does): a speed peer, its values re-rounded from the source's."""
    out = work / f"{source.stem}-{source.stat().st_size}-{outtype}.gguf"  # a same-named file: its own out
    if out.is_file():  # made before (or by `llama-quantize --allow-requantize SRC OUT TYPE`)
        return out
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{outtype.upper()}")
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        raise Skip(f"llama.cpp could not quantize {source.name} to {outtype}")
    tmp.replace(out)
    return out


def llama_cpp_runner(gguf: Path, ids, new: int):
    """Greedy decode of every row through llama.cpp's batched API: one ``llama_decode`` for all
    prompts (sequence ``b`` = row ``b``, logits of each prompt's last token), then one per step with
    a token per sequence; argmax over the returned logits in NumPy."""
    llama_cpp = _llama_cpp()
    import numpy as np

    llm = llama_cpp.Llama(str(gguf), n_ctx=16, verbose=False)  # loads the weights
    b, p = len(ids), len(ids[0])
    cp = llama_cpp.llama_context_default_params()
    cp.n_seq_max = b
    cp.n_ctx = b * -(-(p + new + 8) // 256) * 256  # a multiple of 256 per sequence, as llama.cpp pads
    cp.n_batch = cp.n_ubatch = b * p
    cp.n_threads = cp.n_threads_batch = os.cpu_count() or 1
    ctx = llama_cpp.llama_init_from_model(llm._model.model, cp)
    if not ctx:
        raise Skip(f"llama.cpp could not make a context for {b} sequences")
    llm._stack.callback(llama_cpp.llama_free, ctx)  # freed with the model
    n_vocab = llm.n_vocab()
    batch = llama_cpp.llama_batch_init(b * p, 0, 1)
    llm._stack.callback(llama_cpp.llama_batch_free, batch)

    def decode(tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """tokens: (token, position, sequence, wants logits) -> argmax of each wanted row's logits."""
        batch.n_tokens = len(tokens)
        for i, (tok, pos, seq, out) in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
            batch.seq_id[i][0] = seq
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [i for i, t in enumerate(tokens) if t[3]]
        return np.array(
            [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), (n_vocab,)).argmax() for i in rows]
        )

    def run(n: int, keep=llm) -> np.ndarray:  # keep: the model (with ctx and batch) lives as long as run
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        out = [decode([(int(t), j, s, j == p - 1) for s, row in enumerate(ids) for j, t in enumerate(row)])]
        for step in range(n - 1):
            out.append(decode([(int(out[-1][s]), p + step, s, True) for s in range(b)]))
        return np.stack(out, 1)  # [b, n] new tokens

    return (lambda: run(1)), (lambda: run(new))
