"""Models of the size people run, from GGUF files made the way users get them: aotlm against
llama.cpp on the same file, each engine in a process of its own.

    python scripts/bench_sizes.py                                  # Llama-3.2-1B shape, Q4_0 Q4_K_M Q8_0
    python scripts/bench_sizes.py --shapes 1b 8b --types Q4_K_M    # + Llama-3.1-8B (16 GB bf16 written once)
    python scripts/bench_sizes.py --shapes tiny --types Q4_0 Q8_0 --runs 2 --new 16   # the pipeline, quickly
    python scripts/bench_sizes.py --aotlm-quant int4 --json sizes.json   # + aotlm rows with quant="int4"
    python scripts/bench_sizes.py --rope default       # files without Llama 3's rope_freqs tensor

Files (made once under --work, each written to a temporary name and renamed): a random bf16 HF Llama
checkpoint of the shape (normals of std 0.02, norms 1, written tensor by tensor) with SmolLM2-135M's
49,152-token tokenizer (from aotlm's converted ``smollm2``); llama.cpp's own ``convert_hf_to_gguf.py
--outtype q8_0`` gives the Q8_0 file (the script from the llama-cpp-python sdist, fetched with ``pip
download``, or $LLAMA_CPP_CONVERT) and ``llama_model_quantize`` the others (Q4_0, Q4_K_M; Q5_K_M, Q6_K
on request). Shapes: ``1b`` Llama-3.2-1B (16 x 2048, ffn 8192, 32/8 heads of 64, tied), ``8b``
Llama-3.1-8B (32 x 4096, ffn 14336, 32/8 heads of 128, untied), ``tiny`` (4 x 512) to try the
pipeline; rope theta 500000 and, with
``--rope llama3`` (the default, as Llama 3.x ships), llama3 rope scaling, which puts a ``rope_freqs``
tensor in the file (``--rope default``: none).

Per file, every measurement in a child process (peak RSS: that process's ``ru_maxrss``):
* aotlm: ``from_pretrained(file, batch_size=B, n_positions=longest prompt + new rounded up to 128,
  context_length_estimate=the prompt lengths)`` + ``compile()``, aotlm's default weight storage for the
  file and each ``--aotlm-quant``. "cold": empty $AOTLM_GGUF_CACHE, weight and compile cache dirs;
  "warm": a second process on the same dirs; "disk": those dirs after the cold load. Peak RSS "cold /
  warm" (the warm process also runs the batch-1 measurements).
* llama.cpp (llama-cpp-python): ``Llama(file, n_ctx, n_threads=cores, n_batch=512)``; cold / warm are
  its first and second process (the page cache holds the file both times, for aotlm too); disk 0.
Load s = from_pretrained + compile / Llama(), imports excluded. Prefill ms: one prompt of random ids of
each --prompt length, batch 1 (aotlm ``forward``, llama.cpp ``eval``). Decode tok/s = B x (new - 1) /
(generate time - the time of the same call making 1 token; llama.cpp: its prefill), prompt = the first
--prompt length at batch 1, --batch-prompt (16) above (B x 128 prompt tokens, ~50 s of prefill at 8B in
both calls, drowned the difference in their noise): aotlm ``sample(min_new_tokens=new)`` (``forward``
would be no baseline: it returns the logits of every position, at batch 8 x 128 an lm_head pass of
seconds at 8B), llama.cpp one ``eval`` per token at batch 1 and ``bench_peers.llama_cpp_runner`` (its
batched API) above; medians of --runs after a warm-up. "B1 % bw": bytes per token (the file's tensor
bytes, less the token embedding when the lm_head is separate) x B1 tok/s / the read bandwidth
``bench.read_bandwidth`` measured just before the row's batch-1 process ("bw GB/s"; "load": the 1-minute
load average then, as other processes load a shared machine, llama.cpp's spinning threads suffer most).
Compare rows of one run."""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tarfile
import time
from functools import partial
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
BASE = dict(vocab_size=49152, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0)
SHAPES = {
    "tiny": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, rope_factor=32.0),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_factor=32.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_factor=8.0),
}  # fmt: skip
TYPES = ["Q4_0", "Q4_K_M", "Q8_0"]  # Q8_0: the converter's own output; the others llama.cpp's quantizer
MORE_TYPES = ["Q5_K_M", "Q6_K", "Q5_0", "Q5_1"]  # on request (--types)
TOK_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["1b"])
    ap.add_argument("--types", nargs="+", choices=TYPES + MORE_TYPES, default=TYPES)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batches (1 always)")
    ap.add_argument("--prompt", type=int, nargs="+", default=[128, 512], help="prefill lengths")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens generated")
    ap.add_argument("--batch-prompt", type=int, default=16, help="prompt length of the batched decode rows")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (medians)")
    ap.add_argument("--work", default="/tmp/aotlm-bench-sizes", help="files made here once, reused")
    ap.add_argument("--engines", nargs="+", choices=["aotlm", "llama"], default=["aotlm", "llama"])
    ap.add_argument("--aotlm-quant", nargs="+", default=[], help="more aotlm rows: quant=... (e.g. int4)")
    ap.add_argument("--rope", choices=["llama3", "default"], default="llama3", help="rope scaling, files")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


# ------------------------------------------------------------------ making the files
def hf_config(shape: str, rope: str, tok: Path) -> dict:
    s = dict(SHAPES[shape])
    factor = s.pop("rope_factor")
    gen = json.loads((tok / "generation_config.json").read_text())
    cfg = dict(BASE, **s, architectures=["LlamaForCausalLM"], model_type="llama", dtype="bfloat16",
               max_position_embeddings=131072, attention_bias=False, mlp_bias=False,
               bos_token_id=gen.get("bos_token_id"), eos_token_id=gen.get("eos_token_id"))  # fmt: skip
    if rope == "llama3":
        cfg["rope_scaling"] = dict(rope_type="llama3", factor=factor, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192)  # fmt: skip
    return cfg


def tensor_specs(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, hd, i = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layer = [("input_layernorm", (h,)), ("post_attention_layernorm", (h,)), ("self_attn.q_proj", (q, h)),
             ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
             ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)), ("mlp.down_proj", (h, i))]  # fmt: skip
    out = [("model.embed_tokens.weight", (c["vocab_size"], h)), ("model.norm.weight", (h,))]
    out += [
        (f"model.layers.{n}.{k}.weight", dims) for n in range(c["num_hidden_layers"]) for k, dims in layer
    ]
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (c["vocab_size"], h)))
    return out


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> None:
    """bf16 safetensors written tensor by tensor, in chunks of 16M values (never the whole model in
    RAM): 1-d tensors (norms) ones, matrices normals of std 0.02 (f32 rounded down to bf16)."""
    import numpy as np

    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in specs:
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for _, shape in specs:
            left = int(np.prod(shape))
            while left:
                n = min(left, 1 << 24)
                if len(shape) == 1:
                    f.write(np.full(n, 0x3F80, np.uint16).tobytes())  # bf16 1.0
                else:
                    x = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
                    f.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
                left -= n


def checkpoint(shape: str, args) -> Path:
    """The random bf16 HF checkpoint of ``shape`` (made once: a directory renamed into place)."""
    from aotlm.models.checkpoint.resolve import resolve

    out = Path(args.work) / f"hf-{shape}-{args.rope}"
    if (out / "config.json").is_file():
        return out
    tok = Path(resolve("smollm2"))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOK_FILES:
        if (tok / name).is_file():
            shutil.copy(tok / name, tmp / name)
    cfg = hf_config(shape, args.rope, tok)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id")}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=1))
    print(f"writing {out.name} ...", file=sys.stderr, flush=True)
    write_safetensors(tmp / "model.safetensors", tensor_specs(cfg))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tmp.rename(out)
    return out


def converter(work: Path) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` (with its ``conversion`` and ``gguf-py``) from the sdist
    of the installed llama-cpp-python, unpacked once; $LLAMA_CPP_CONVERT wins."""
    if os.environ.get("LLAMA_CPP_CONVERT"):
        return Path(os.environ["LLAMA_CPP_CONVERT"])
    import llama_cpp

    root = work / f"llama.cpp-{llama_cpp.__version__}"
    if not (root / "convert_hf_to_gguf.py").is_file():
        tgz = work / "sdist" / f"llama_cpp_python-{llama_cpp.__version__}.tar.gz"
        if not tgz.is_file():
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d"]
            subprocess.run([*pip, str(tgz.parent), f"llama-cpp-python=={llama_cpp.__version__}"], check=True)
        keep = re.compile(r"^[^/]+/vendor/llama\.cpp/(convert_hf_to_gguf\.py$|conversion/|gguf-py/)")
        tmp = root.with_name(root.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(tgz) as tf:
            members = [m for m in tf.getmembers() if keep.match(m.name)]
            for m in members:
                m.name = m.name.split("/vendor/llama.cpp/", 1)[1]
            tf.extractall(tmp, members=members, filter="data")
        tmp.rename(root)
    return root / "convert_hf_to_gguf.py"


def make_gguf(shape: str, typ: str, args) -> Path:
    """The ``typ`` GGUF file of ``shape``: Q8_0 by the converter, the rest requantized from it."""
    import llama_cpp

    work = Path(args.work)
    out = work / f"{shape}-{args.rope}-{typ}.gguf"
    if out.is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    if typ == "Q8_0":
        src = checkpoint(shape, args)
        print(f"converting {src.name} -> {out.name} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, str(converter(work)), str(src), "--outfile", str(tmp), "--outtype", "q8_0"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"convert_hf_to_gguf.py failed: {p.stderr.strip()[-500:]}")
    else:
        src = make_gguf(shape, "Q8_0", args)
        print(f"quantizing {src.name} -> {out.name} ...", file=sys.stderr, flush=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{typ}")
        params.allow_requantize = True
        params.nthread = os.cpu_count() or 1
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"llama_model_quantize could not make {typ} from {src.name}")
    tmp.replace(out)
    return out


def step_bytes(gguf: Path) -> int:
    """Bytes a decode step reads from the file: every tensor but a separate lm_head's embedding."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors}
    return sum(sizes.values()) - (sizes["token_embd.weight"] if "output.weight" in sizes else 0)


# ------------------------------------------------------------------ child processes
def timed(fns: list, runs: int) -> list[float]:
    """Median seconds of each of ``fns``, called round robin (noise hits them alike) after a warm-up."""
    ts: list[list[float]] = [[] for _ in fns]
    for i in range(runs + 1):
        for t, fn in zip(ts, fns, strict=True):
            t0 = time.perf_counter()
            fn()
            t += [time.perf_counter() - t0] if i else []
    return [statistics.median(t) for t in ts]


def measure(prefill, generate, s: dict, first=None) -> dict:
    """Prefill ms per prompt length (batch 1 only) and decode tok/s at the spec's batch: ``generate``'s
    time less ``first``'s (the same call making its first token only; default ``prefill``)."""
    import numpy as np

    rng, b, p0 = np.random.default_rng(0), s["batch"], s["prompts"][0]
    lens = s["prompts"] if b == 1 else [p0]
    ids = {p: rng.integers(0, s["vocab"], (b, p)) for p in lens}
    calls = [partial(prefill, ids[p]) for p in lens] + [
        partial(first or prefill, ids[p0]),
        partial(generate, ids[p0]),
    ]
    *t_pre, t_first, t_gen = timed(calls, s["runs"])
    out = {f"prefill {p} ms": 1e3 * t for p, t in zip(lens, t_pre, strict=True)} if b == 1 else {}
    return out | {f"decode B{b} tok/s": b * (s["new"] - 1) / (t_gen - t_first)}


def aotlm_child(s: dict) -> dict:
    from aotlm import AutoModelForSampling
    from aotlm.core.compile_cache import CompileCounter

    quant, ctx = ({"quant": s["quant"]} if s["quant"] else {}), sorted(s["prompts"])
    counter, t0, b, n = CompileCounter(), time.perf_counter(), s["batch"], s["n_positions"]
    model = AutoModelForSampling.from_pretrained(
        s["gguf"], batch_size=b, n_positions=n, context_length_estimate=ctx, **quant
    ).compile()
    out = {"load s": time.perf_counter() - t0, "storage": model.precision.describe()}
    out["XLA compiles"] = counter.counts["compiles"]  # a warm load compiles ~nothing: a cache hit
    if s["measure"]:
        gen = partial(model.sample, max_new_tokens=s["new"], min_new_tokens=s["new"])
        one = partial(
            model.sample, max_new_tokens=1, min_new_tokens=1
        )  # not forward: its logits at every position
        out.update(measure(model.forward, gen, s, first=one))
    return out


def llama_child(s: dict) -> dict:
    import llama_cpp
    import numpy as np

    if s["batch"] > 1:  # the batched API of bench.py's llama.cpp peers
        sys.path.insert(0, str(SCRIPTS))
        from bench_peers import llama_cpp_runner

        ids = np.random.default_rng(0).integers(0, s["vocab"], (s["batch"], s["prompts"][0])).tolist()
        t0 = time.perf_counter()
        pre, gen = llama_cpp_runner(Path(s["gguf"]), ids, s["new"])
        out = {"load s": time.perf_counter() - t0}
        return out | (measure(lambda _: pre(), lambda _: gen(), s) if s["measure"] else {})
    t0, cores = time.perf_counter(), os.cpu_count() or 1
    llm = llama_cpp.Llama(s["gguf"], n_ctx=s["n_positions"], n_threads=cores, n_threads_batch=cores,
                          n_batch=512, logits_all=False, verbose=False)  # fmt: skip
    out = {"load s": time.perf_counter() - t0}
    last = lambda: llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)  # the last token's logits
    argmax = lambda: int(np.ctypeslib.as_array(last(), (llm.n_vocab(),)).argmax())

    def prefill(ids) -> int:
        llm.reset()
        llm.eval([int(t) for t in ids[0]])
        return argmax()

    def generate(ids) -> None:
        tok = prefill(ids)
        for _ in range(s["new"] - 1):
            llm.eval([tok])
            tok = argmax()

    return out | (measure(prefill, generate, s) if s["measure"] else {})


def child_main(spec: str) -> int:
    s = json.loads(spec)
    out = (aotlm_child if s["engine"] == "aotlm" else llama_child)(s)
    out["rss GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # skip interpreter teardown (jax / llama.cpp finalizers): the result is out


def run_child(spec: dict, env: dict | None, what: str) -> dict:
    """One measurement in a fresh process: its RESULT line, or ``{"error": last stderr line}``."""
    name = " ".join(filter(None, [Path(spec["gguf"]).name, spec["engine"], spec["quant"]]))
    print(f"{name}: {what}", file=sys.stderr)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    err = [ln for ln in p.stderr.strip().splitlines() if ln.strip()] or [f"exit status {p.returncode}"]
    print(p.stderr[-3000:], file=sys.stderr)
    return {"error": err[-1][:300]}


# ------------------------------------------------------------------ parent
def bench_engine(engine: str, quant: str | None, gguf: Path, args, base: dict) -> dict:
    """One table row: cold and warm loads, batch-1 measurements, then each larger batch."""
    row: dict = {"engine": "llama.cpp" if engine == "llama" else " ".join(["aotlm", quant or ""]).strip()}
    spec, env = dict(base, engine=engine, gguf=str(gguf), quant=quant, batch=1), None
    if engine == "aotlm":
        d = Path(args.work) / "aotlm" / f"{gguf.stem}-{quant or 'default'}"
        shutil.rmtree(d, ignore_errors=True)
        env = {"AOTLM_GGUF_CACHE": str(d / "gguf"), "AOTLM_CACHE_DIR": str(d / "compile"),
               "AOTLM_WEIGHT_CACHE": str(d / "weights")}  # fmt: skip
    cold = run_child(dict(spec, measure=False), env, "cold load")
    files = [f for f in d.rglob("*") if f.is_file()] if engine == "aotlm" else []
    row["disk GB"] = sum(f.stat().st_size for f in files) / 1e9  # the GGUF, weight and compile caches
    from bench import read_bandwidth  # scripts/ is on sys.path

    row |= {"bw GB/s": read_bandwidth()[0], "load": os.getloadavg()[0]}  # both drift on a shared machine
    warm = run_child(dict(spec, measure=True), env, "warm load, batch 1") if "error" not in cold else cold
    row |= {"cold s": cold.get("load s"), "warm s": warm.get("load s"), "rss cold GB": cold.get("rss GB")}
    row |= {"rss warm GB": warm.get("rss GB"), "storage": warm.get("storage", cold.get("storage"))}
    row["XLA compiles"] = [cold.get("XLA compiles"), warm.get("XLA compiles")]
    row |= {k: v for k, v in warm.items() if k.startswith(("prefill", "decode"))}
    errors = [r["error"] for r in (cold, warm) if "error" in r]
    for b in args.batch[1:] if not errors else []:
        res = run_child(dict(spec, batch=b, measure=True, prompts=[args.batch_prompt]), env, f"batch {b}")
        row[f"decode B{b} tok/s"], row[f"rss B{b} GB"] = res.get(f"decode B{b} tok/s"), res.get("rss GB")
        errors += [f"batch {b}: {res['error']}"] if "error" in res else []
    row["error"] = errors[0] if errors else None
    return row


def cell(v) -> str:
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float) and abs(v) < 10 else (
        f"{v:.1f}" if isinstance(v, float) else str(v))  # fmt: skip


def ratio(a, b) -> float | None:
    return a / b if a and b else None


def table(rows: list[dict], cols: list[str]) -> None:
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(r[c] if isinstance(r.get(c), str) else cell(r.get(c)) for c in cols) + " |")


def report(rows: list[dict], args) -> None:
    pre = [f"prefill {p} ms" for p in args.prompt]
    dec = [f"decode B{b} tok/s" for b in args.batch]
    for r in rows:
        r["peak RSS GB"] = f"{cell(r.get('rss cold GB'))} / {cell(r.get('rss warm GB'))}"
    cols = ["model", "type", "engine", "cold s", "warm s", "peak RSS GB", "disk GB", *pre, dec[0], "B1 % bw"]
    print("\nload s (first: cold, then warm), peak RSS GB (cold / warm), disk GB besides the file:\n")
    table(rows, cols + dec[1:] + ["bw GB/s", "load"])
    ratio_rows = []
    for r in rows:
        peer = next((p for p in rows if p["engine"] == "llama.cpp" and p["file"] == r["file"]), None)
        if r["engine"].startswith("aotlm") and peer:
            q = {c: ratio(r.get(c), peer.get(c)) for c in ["cold s", "warm s"] + pre + dec}
            rss = ratio(r.get("rss warm GB"), peer.get("rss warm GB"))
            ratio_rows.append({**{k: r[k] for k in ("model", "type", "engine")}, **q, "peak RSS GB": rss})
    if ratio_rows:
        print("\naotlm / llama.cpp (times and RSS: lower is better for aotlm; tok/s: higher; RSS: warm):\n")
        table(ratio_rows, ["model", "type", "engine", "cold s", "warm s", "peak RSS GB", *pre, *dec])
    print()
    for r in rows:  # what aotlm stored (its default for the file, or --aotlm-quant), and errors
        if r.get("storage") or r.get("error"):
            note = (
                r.get("error") or f"{r['storage']}; XLA compiles in the cold, warm load: {r['XLA compiles']}"
            )
            print(f"{r['model']} {r['type']} {r['engine']}: {note}")


def versions() -> str:
    from importlib.metadata import version

    import llama_cpp

    from aotlm import kernels

    git = ["git", "-C", str(SCRIPTS), "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True).stdout.strip() or "?"
    pkgs = ", ".join(f"{p} {version(p)}" for p in ("aotlm", "jax", "jaxlib", "gguf"))
    ll = f"llama-cpp-python {llama_cpp.__version__} ({llama_cpp.llama_print_system_info().decode().strip()})"
    return f"{pkgs}, {ll}; aotlm commit {commit}, kernels {kernels.cache_tag()} ({kernels.threads()} threads)"


def main() -> int:
    args = parse()
    if args.child:
        return child_main(args.child)
    args.batch = [1] + [b for b in args.batch if b != 1]  # batch 1 always (prefill, load, B1 % bw)
    sys.path.insert(0, str(SCRIPTS))
    from aotlm.tiny import cpu_model

    Path(args.work).mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_model()}\n{versions()}", flush=True)
    n_pos = -(-(max(args.prompt) + args.new) // 128) * 128
    args.prompt = list(dict.fromkeys(args.prompt))
    base = dict(prompts=args.prompt, new=args.new, runs=args.runs, n_positions=n_pos, vocab=49152)
    rows = []
    engines = [(e, q) for e in args.engines for q in ([None, *args.aotlm_quant] if e == "aotlm" else [None])]
    for shape in args.shapes:
        for typ in args.types:
            gguf = make_gguf(shape, typ, args)
            info = {"model": shape, "type": typ, "file": gguf.name, "file GB": gguf.stat().st_size / 1e9}
            info["step GB"] = step_bytes(gguf) / 1e9
            for engine, quant in engines:
                rows.append(info | bench_engine(engine, quant, gguf, args, base))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for r in rows:
        tps = r.get("decode B1 tok/s")
        r["B1 % bw"] = 100 * r["step GB"] * tps / r["bw GB/s"] if tps else None
    print(f"\nprompts {args.prompt}, {args.new} new tokens, greedy, decode prompt {args.prompt[0]}", end=", ")
    print(f"batched decode prompt {args.batch_prompt}", end=", ")
    print(f"median of {args.runs}; n_positions {n_pos}")
    report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
