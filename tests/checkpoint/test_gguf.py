"""GGUF files (llama.cpp's format) as checkpoints: aotlm vs transformers' own GGUF loading.

Tiny GGUFs are written by the tests (``gguf_builders``: a random HF checkpoint, renamed with
gguf-py's name map, stored as F16 / Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K). Both sides read the same
file: transformers dequantizes it to float32 (``from_pretrained(dir, gguf_file=name)``), aotlm
converts it once (``aotlm.models.checkpoint.gguf``). With ``quant="none"`` both run the same float32 weights,
so every type gets the float32 conformance tolerance (1e-4 on logits of magnitude ~3) and equal
greedy tokens; the default int8 storage of quantized files is measured separately.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conformance import make_checkpoint
from gguf import GGMLQuantizationType as T
from gguf_builders import CHATML, VOCAB, smollm2_file, tiny_config, write_gguf

from aotlm import AutoModelForSampling
from aotlm.models import lookup, packing, quant4
from aotlm.models.checkpoint import CheckpointError, gguf
from aotlm.models.checkpoint.resolve import resolve, validate_checkpoint
from aotlm.text.tokens import load_tokenizer

TYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
TOL = 1e-4  # f32 storage: the same dequantized weights on both sides, only the summation order differs
SHAPES = dict(batch_size=1, n_positions=[32], context_length_estimate=[16])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh GGUF conversion cache for this module."""
    root = tmp_path_factory.mktemp("gguf_cache")
    before = os.environ.get("AOTLM_GGUF_CACHE")
    os.environ["AOTLM_GGUF_CACHE"] = str(root)
    yield root
    if before is None:
        os.environ.pop("AOTLM_GGUF_CACHE", None)
    else:
        os.environ["AOTLM_GGUF_CACHE"] = before


@pytest.fixture(scope="module")
def files(tmp_path_factory, cache):
    """``files(arch, type)``: the tiny GGUF of that architecture in that type (written once)."""
    from conformance import make_checkpoint

    root = tmp_path_factory.mktemp("gguf_files")
    made: dict = {}

    def get(arch: str, qtype: str) -> Path:
        if (arch, qtype) not in made:
            ckpt = make_checkpoint(root / f"hf-{arch}", tiny_config(arch), scale=3.0)
            made[arch, qtype] = write_gguf(ckpt, arch, getattr(T, qtype), root / f"{arch}-{qtype}.gguf")
        return made[arch, qtype]

    return get


@pytest.fixture(scope="module")
def compile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_compile")  # shared: same shapes, same graphs for every type


def _hf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _hf_greedy(ref, ids: np.ndarray, new: int) -> np.ndarray:
    with torch.no_grad():
        out = ref.generate(
            torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long), max_new_tokens=new,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return out.numpy()


def _hf_logits(ref, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor(ids)).logits[:, -1].float().numpy()


# every type on llama, one type per other architecture in the default run; the rest under -m slow
DEFAULT_CASES = {("qwen2", "Q4_0"), ("gpt2", "Q8_0"), ("gemma3", "Q4_K")}
CASES = [
    pytest.param(a, t, marks=() if a == "llama" or (a, t) in DEFAULT_CASES else pytest.mark.slow)
    for a in ("llama", "qwen2", "gpt2", "gemma3")
    for t in TYPES
]


@pytest.mark.parametrize(("arch", "qtype"), CASES)
def test_conformance(arch, qtype, files, compile_dir):
    path = files(arch, qtype)
    ref = _hf(path)
    model = AutoModelForSampling.from_pretrained(str(path), compile_cache=compile_dir, quant="none", **SHAPES)
    ids = np.random.default_rng(3).integers(0, VOCAB, (1, 12))
    got, want = model.forward(ids), _hf_logits(ref, ids)
    assert np.abs(got - want).max() <= TOL, f"{arch} {qtype}: logits differ by {np.abs(got - want).max()}"
    np.testing.assert_array_equal(model.sample(ids, max_new_tokens=8), _hf_greedy(ref, ids, 8))


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2", "bloom"])
def test_conformance_more_architectures(arch, files, compile_dir):
    """The other converted architectures, in one quantized type each (Q4_1)."""
    test_conformance(arch, "Q4_1", files, compile_dir)


def test_llama3_rope_factors_are_read(tmp_path, compile_dir, monkeypatch):
    """A Llama 3.x file carries its llama3 rope scaling as llama.cpp's ``rope_freqs`` divisors, which
    transformers' GGUF loading drops: aotlm applies them, so its logits equal transformers' on the
    same weights with the scaling the original checkpoint had (and differ from the unscaled rope)."""
    monkeypatch.setenv("AOTLM_GGUF_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config("llama")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}  # fmt: skip
    cfg.rope_parameters = scaling
    path = write_gguf(make_checkpoint(tmp_path / "hf", cfg), "llama", T.F16, tmp_path / "llama3.gguf")
    ref = _hf(path)  # the file's weights, rope unscaled (transformers ignores rope_freqs)
    ids = np.random.default_rng(5).integers(0, VOCAB, (1, 40))
    plain = _hf_logits(ref, ids)
    ref.config.rope_parameters = scaling
    ref.model.rotary_emb = type(ref.model.rotary_emb)(config=ref.config)
    want = _hf_logits(ref, ids)
    shapes = dict(batch_size=1, n_positions=[64], context_length_estimate=[64])
    model = AutoModelForSampling.from_pretrained(str(path), compile_cache=compile_dir, quant="none", **shapes)
    got = model.forward(ids)
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()
    assert np.abs(plain - want).max() > 100 * TOL  # the scaling matters at these positions
    np.testing.assert_array_equal(model.sample(ids, max_new_tokens=8), _hf_greedy(ref, ids, 8))


def test_default_storage_and_int4_as_stored(files, compile_dir, caplog):
    """Quantized GGUF below 1B -> by default its 4-bit (and Q6_K) blocks kept with int16 activations
    (``int4-a16``), a Q8_0 file int8 groups (one log line each); ``quant="int4"`` keeps a file's 4-bit
    blocks as int4 groups with int8 activations (``test_int4_keeps_a_mixed_files_blocks_as_stored``: a
    file's other types stay int8 then; a file without 4-bit blocks is converted to int4, as asked). The
    error each adds against transformers' float32 dequantization of the same file, over 8 prompts:
    the largest logit difference (bound: 5% of the largest logit; the defaults 1e-3) and how often the
    top-1 token agrees (bound: 6 of 8; a random tiny model has near-ties a real one has far fewer of).
    """
    prompts = np.random.default_rng(4).integers(0, VOCAB, (8, 1, 12))
    report = []
    for qtype in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"):
        path = files("llama", qtype)
        ref = _hf(path)
        want = np.concatenate([_hf_logits(ref, ids) for ids in prompts])
        with caplog.at_level(logging.WARNING, logger="aotlm.models.checkpoint.gguf"):
            caplog.clear()
            model = AutoModelForSampling.from_pretrained(str(path), compile_cache=compile_dir, **SHAPES)
        a16 = qtype != "Q8_0"  # 4-bit / Q6_K blocks kept, x as int16
        assert model.quant.quant_dtype == ("int4" if a16 else "int8") and model.quant.activations == (
            a16 and "s16" or None
        )
        # the lookup reads the file's own codes (aotlm.models.lookup): rows as transformers dequantizes them
        table = ref.get_input_embeddings().weight.detach().numpy()
        rows = np.asarray(lookup.take(model.params, jnp.asarray(prompts[0])))
        four = qtype in ("Q4_0", "Q4_1", "Q4_K")  # two codes a byte (lookup.pack4)
        assert model.params["embed"].dtype == (np.uint8 if four else np.int8)
        assert model.params["embed_gscale"].dtype == np.float32
        np.testing.assert_allclose(rows, table[prompts[0]], rtol=0, atol=2e-7 * np.abs(table).max())
        lines = [r.getMessage() for r in caplog.records if r.name == "aotlm.models.checkpoint.gguf"]
        keep = "(quant='none' / --quant none keeps f32)"
        asym = "-asym" if qtype in ("Q4_1", "Q4_K") else ""  # blocks with minimums: one line names the form
        how = (
            f"blocks kept, activations held as int16; stored as int4{asym}-a16"
            if a16
            else "kept as int8 groups of 32; stored as int8"
        )
        assert lines == [f"{path.name}: {qtype} {how} {keep}"]
        as4 = AutoModelForSampling.from_pretrained(
            str(path), compile_cache=compile_dir, quant="int4", **SHAPES
        )
        assert as4.params["layers"][0]["wq"].dtype == np.uint8  # 4-bit codes (kept, or converted as asked)
        kept = qtype in ("Q4_0", "Q4_1", "Q4_K")  # int4 of another type re-rounds: no bound on that
        for name, m in (("default", model), ("int4", as4))[: 2 if kept else 1]:
            got = np.concatenate([m.forward(ids) for ids in prompts])
            diff = float(np.abs(got - want).max())
            agree = int((got.argmax(-1) == want.argmax(-1)).sum())
            top = np.abs(want).max()
            report.append(
                f"{qtype} {name}: max|logit diff| {diff:.3f} (max|logit| {top:.2f}), top-1 {agree}/8"
            )
            tight = name == "default" and qtype in ("Q4_0", "Q4_1", "Q4_K", "Q6_K")
            assert diff <= (1e-3 if tight else 0.05) * top and agree >= 6, report[-1]
    print("\nerror vs transformers' f32 dequantization:", "; ".join(report))


@pytest.mark.parametrize("base", ["Q4_K", "Q5_K"])
def test_int4_keeps_a_mixed_files_blocks_as_stored(tmp_path, compile_dir, monkeypatch, base):
    """A Q4_K_M- / Q5_K_M-like file (Q4_K / Q5_K matrices, Q6_K ``ffn_down`` / ``attn_v``) under
    ``quant="int4"``: the Q4_K matrices keep their codes and scales (``kscales``), the Q5_K ones their
    5-bit codes too (``kscales.pack5``), the Q6_K ones theirs (``k6scales``), none rounded down to 4 bits:
    every stored matrix is the file's values bit for bit. That is also the default for a file of
    ``AS_STORED_PARAMS`` (1B) parameters or more with such blocks (the tiny file is made to count as
    one); smaller ones keep them with int16 activations (``"int4-a16"``), files without them int8."""
    big = gguf.AS_STORED_PARAMS
    assert gguf.storage_for({"Q4_K", "Q6_K", "F32"}, big) == "int4"
    assert gguf.storage_for({"Q4_0", "F32"}, big - 1) == gguf.storage_for({"Q6_K"}, 1) == "int4-a16"
    assert gguf.storage_for({"Q8_0", "Q3_K"}, 8 * big) == gguf.storage_for({"Q8_0"}, 1) == "int8"
    assert gguf.storage_for({"Q5_0", "Q8_0"}, 1) == gguf.storage_for({"Q5_1"}, 1) == "int4-a16"
    assert gguf.storage_for({"Q5_K", "Q6_K"}, big) == gguf.storage_for({"Q6_K", "Q8_0"}, big) == "int4"
    assert gguf.storage_for({"F16"}, big) == "f16" and gguf.storage_for({"BF16"}, big) == "bf16"
    # the load's log line names what becomes of each type (a Gemma-3 Q4_K_M file mixes five)
    assert gguf.how_stored("int4", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "F16"]) == (
        "Q4_K/Q6_K/Q5_0 blocks kept, Q8_0 kept as int8 groups of 32, F16 re-rounded to int8 per channel, "
        "activations rounded to int8 per group"
    )
    assert gguf.how_stored("int8", ["Q5_1"]) == "Q5_1 kept as int8 groups of 32"
    assert gguf.how_stored("int8", ["Q3_K", "Q8_0"]) == (
        "Q8_0 kept as int8 groups of 32, Q3_K re-rounded to int8 per channel"
    )
    assert gguf.how_stored("f16", ["F16"]) == "F16 kept"
    assert gguf.how_stored("int4-asym-a16", ["Q4_1"]) == "Q4_1 blocks kept, activations held as int16"
    monkeypatch.setenv("AOTLM_GGUF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "AS_STORED_PARAMS", 1)
    ckpt = make_checkpoint(tmp_path / "hf", tiny_config("llama"), scale=3.0)
    mix = {"ffn_down": T.Q6_K, "attn_v": T.Q6_K}
    path = write_gguf(ckpt, "llama", getattr(T, base), tmp_path / f"{base}_m.gguf", mix=mix)
    m = AutoModelForSampling.from_pretrained(str(path), compile_cache=compile_dir, **SHAPES)
    assert m.quant.label == "int4-g32-asym"  # as quant="int4" gives for Q4_K blocks
    kw = dict(compile_cache=compile_dir, **SHAPES)
    floats = AutoModelForSampling.from_pretrained(str(path), quant="none", **kw)
    for i, layer in enumerate(m.params["layers"]):
        rows = {k: layer[f"{k}_scale"].shape[-2] for k in ("wq", "w_gate", "wv", "w_down")}
        own = 20 if base == "Q4_K" else 52  # Q4_K's scales (Q5_K's: and the codes' high bits)
        assert rows == {"wq": own, "w_gate": own, "wv": 82, "w_down": 82}  # Q6_K's: 82
        for k in rows:
            w, sm, want = layer[k], layer[f"{k}_scale"], floats.params["layers"][i][k]
            got = quant4.dequantize(jnp.asarray(w), jnp.asarray(sm), k)
            want = packing.unpack(want, k) if packing.is_packed(k, want.ndim) else want
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"layer {i} {k}")
    ref, ids = _hf(path), np.random.default_rng(6).integers(0, VOCAB, (1, 12))
    want = _hf_logits(ref, ids)
    assert np.abs(m.forward(ids) - want).max() <= 0.05 * np.abs(want).max()


@pytest.mark.parametrize("qtype", ["Q6_K", "Q8_0"])
def test_int8_matrices_rounded_row_by_row_from_the_blocks(files, compile_dir, monkeypatch, qtype):
    """The int8 storage of a block matrix (``lm_head``, the MLP's) is rounded from a few dequantized rows
    at a time (``GGUFWeights.row_chunks``), never the whole float32 matrix: the same leaves, bit for bit,
    as rounding the whole dequantized matrix."""
    from aotlm.models.checkpoint.gguf_weights import GGUFWeights

    monkeypatch.setenv("AOTLM_WEIGHT_CACHE", "0")
    seen, chunks = [], GGUFWeights.row_chunks
    monkeypatch.setattr(
        GGUFWeights, "row_chunks", lambda self, n, rows=7: seen.append(n) or chunks(self, n, rows)
    )
    path, kw = str(files("llama", qtype)), dict(compile_cache=compile_dir, quant="int8", **SHAPES)
    streamed = AutoModelForSampling.from_pretrained(path, **kw).params
    assert {"lm_head.weight", "model.layers.0.mlp.down_proj.weight"} <= set(seen)
    monkeypatch.setattr(GGUFWeights, "row_chunks", lambda self, n, rows=7: None)
    whole = AutoModelForSampling.from_pretrained(path, **kw).params
    assert streamed["lm_head"].dtype == np.int8
    for (where, a), b in zip(
        jax.tree_util.tree_leaves_with_path(streamed), jax.tree.leaves(whole), strict=True
    ):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), where


def test_f16_file_defaults_to_f16_storage(files, compile_dir):
    model = AutoModelForSampling.from_pretrained(
        str(files("llama", "F16")), compile_cache=compile_dir, **SHAPES
    )
    assert model.quant is not None and model.quant.quant_dtype == "f16"


def test_tokenizer_and_chat_template(files):
    path = files("llama", "Q8_0")
    ours = load_tokenizer(validate_checkpoint(str(path)).tokenizer)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ["def f(x):\n    return x + 1\n", "  spaces\tand tabs", "<|im_start|>user\nhi<|im_end|>"]:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids) == text
    chat = [{"role": "user", "content": "print hello"}, {"role": "assistant", "content": "print('hello')"}]
    for kw in ({"tokenize": False}, {"tokenize": True}):
        assert ours.apply_chat_template(chat, add_generation_prompt=True, **kw) == ref.apply_chat_template(
            chat, add_generation_prompt=True, **kw
        )
    assert ours.chat_template == CHATML
    cfg = validate_checkpoint(str(path)).checkpoint / "generation_config.json"
    assert '"eos_token_id": 1025' in cfg.read_text()  # <|im_end|>, from tokenizer.ggml.eos_token_id


def test_second_load_hits_the_cache(files, cache):
    path = files("llama", "Q4_0")
    first = resolve(str(path))
    conversions, hits = gguf.stats["conversions"], gguf.stats["cache_hits"]
    assert resolve(str(path)) == first
    assert gguf.stats == {"conversions": conversions, "cache_hits": hits + 1}
    copy = path.parent / "renamed-copy.gguf"  # same content elsewhere: hashed, not converted again
    shutil.copyfile(path, copy)
    assert resolve(str(copy)) == first and gguf.stats["conversions"] == conversions


def _bad_files(files, tmp: Path) -> dict[str, tuple[Path, str]]:
    good = files("llama", "Q8_0")
    data = good.read_bytes()
    (tmp / "magic.gguf").write_bytes(b"GGML" + data[4:])
    (tmp / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    from conformance import make_checkpoint

    write_gguf(make_checkpoint(tmp / "hf", tiny_config("llama")), "llama", T.TQ2_0, tmp / "tq2.gguf")
    import gguf as gg

    w = gg.GGUFWriter(str(tmp / "mamba.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return {
        "wrong magic": (tmp / "magic.gguf", "is not a GGUF file (starts with b'GGML'"),
        "truncated": (tmp / "cut.gguf", "truncated"),
        "unknown architecture": (
            tmp / "mamba.gguf",
            "GGUF architecture 'mamba' is not supported; aotlm converts: ",
        ),
        "unsupported type": (
            tmp / "tq2.gguf",
            "has GGUF type TQ2_0, which aotlm cannot convert; supported: ",
        ),
    }


def test_bad_files_one_line_nothing_cached(files, tmp_path, monkeypatch):
    monkeypatch.setenv("AOTLM_GGUF_CACHE", str(tmp_path / "cache"))
    for case, (path, message) in _bad_files(files, tmp_path).items():
        with pytest.raises(CheckpointError) as e:
            resolve(str(path))
        assert message in str(e.value) and "\n" not in str(e.value), (case, str(e.value))
        assert not (tmp_path / "cache").exists(), case


def test_failed_conversion_leaves_nothing(files, tmp_path, monkeypatch):
    monkeypatch.setenv("AOTLM_GGUF_CACHE", str(tmp_path / "cache"))

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_write_generation_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve(str(files("gpt2", "F16")))
    assert list((tmp_path / "cache").iterdir()) == []


def test_name_tables_match_gguf_py():
    """aotlm's GGUF -> HF names invert gguf-py's HF -> GGUF map (the one llama.cpp converts with)."""
    import gguf as gg

    from aotlm.models.checkpoint.gguf_names import ARCHS

    checked = 0
    for arch_name, arch in ARCHS.items():
        enum = next(a for a, n in gg.MODEL_ARCH_NAMES.items() if n == arch_name)
        names = gg.get_tensor_name_map(enum, 2)
        known = {gg.TENSOR_NAMES[t] for t in gg.MODEL_TENSORS[enum]}
        pairs = list(arch.top.items()) + [
            (f"blk.{{bid}}.{k}", f"{arch.layer_prefix}{{bid}}.{v}") for k, v in arch.layer.items()
        ]
        for g, hf in pairs:
            if g in known:
                hf = hf.format(bid=1)  # gguf-py knows Bloom's names from BloomModel (no "transformer.")
                mapped = names.get_name(hf) or names.get_name(hf.removeprefix("transformer."))
                assert mapped == g.format(bid=1), (arch_name, g, hf)
                checked += 1
    assert checked > 60


def test_smollm2_chat_matches_transformers(cache, compile_dir):
    path = smollm2_file()
    ref, tok = _hf(path), transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForSampling.from_pretrained(
        str(path), batch_size=1, n_positions=[256], context_length_estimate=[64], compile_cache=compile_dir
    )
    assert model.quant.label == "int4-g32-asym-a16"  # the default below 1B: the Q4_1 blocks kept, x as int16
    assert model.params["embed_q_scale"].dtype == np.float16  # the tied Q8_0 table's groups for the logits
    answers = []
    for question in ("What is the capital of France?", "Write a haiku about the sea."):
        chat = [{"role": "user", "content": question}]
        ids = np.array(
            [
                tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
                    "input_ids"
                ]
            ]
        )
        got, want = model.forward(ids), _hf_logits(ref, ids)
        # 3.2e-4 of the largest (the Q8_0 lm_head's groups kept too); int8 storage was 5.1e-2 off
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), question
        out = model.sample(ids, max_new_tokens=16)
        np.testing.assert_array_equal(out, _hf_greedy(ref, ids, 16))
        answers.append(tok.decode(out[0, ids.shape[1] :]))
    assert "Paris" in answers[0], answers  # a real model answering, not only two engines agreeing


@pytest.mark.slow  # ~80 s; the default run's real-model conformance is SmolLM2's (and tiny gemma3 GGUFs)
def test_gemma3_270m_continuation_matches_transformers(cache, compile_dir):
    """The real Gemma-3-270M (Q4_K_M, ``gemma3-270m`` by name) where its package is installed."""
    from aotlm.models.checkpoint import named

    m = named.NAMED_MODELS["gemma3-270m"]
    if m.package_version() is None:
        pytest.skip(f"{m.distribution} is not installed ({m.install})")
    path = named.locate("gemma3-270m")
    ref, tok = _hf(path), transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    shapes = dict(batch_size=1, n_positions=[64], context_length_estimate=[16], quant="none")
    model = AutoModelForSampling.from_pretrained("gemma3-270m", compile_cache=compile_dir, **shapes)
    ids = np.array([tok("The capital of France is")["input_ids"]])
    got, want = model.forward(ids), _hf_logits(ref, ids)
    assert np.abs(got - want).max() <= 1e-3, np.abs(got - want).max()  # logits of magnitude ~20
    out = model.sample(ids, max_new_tokens=16)
    np.testing.assert_array_equal(out, _hf_greedy(ref, ids, 16))
    assert "France" in tok.decode(out[0, ids.shape[1] :])  # English about France, not noise
