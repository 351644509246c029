"""Helpers every command module shares: the model flags (``add_model_args``) and the
keyword arguments they give ``from_pretrained`` (``model_kwargs``), small argument types, tables."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from aotlm.cli.lookup_flags import add_lookup_args, lookup_settings
from aotlm.core import distributed, sampler_params
from aotlm.core.spec import MODEL_KEYS
from aotlm.generate.params import SAMPLING_FIELDS
from aotlm.models.checkpoint.resolve import expand, resolve
from aotlm.models.quant import INT4_NAMES
from aotlm.text import defaults
from aotlm.text.tokens import bad_word_ids

log = logging.getLogger("aotlm")


def int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def bucket_list(text: str) -> list[int]:
    """``--n-positions`` / ``--context-length-estimate``: bucket lengths, each >= 1."""
    try:
        out = int_list(text)
    except argparse.ArgumentTypeError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated bucket lengths >= 1, got {text!r}")
    return out


def positive_int(text: str) -> int:
    """A count of devices or rows: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def shard_arg(text: str) -> tuple[int, int]:
    """``I/N`` with 0 <= I < N (SLURM: ``--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT``)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--shard expects I/N (e.g. 0/4), got {text!r}") from e
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= I < N")
    return i, n


def add_job_args(p: argparse.ArgumentParser, shard_help: str) -> None:
    """The batch front ends' run controls: ``--dry-run``, ``--resume``, ``--overwrite``, ``--shard``."""
    p.add_argument("--dry-run", action="store_true", help="pre-flight, print the plan, load nothing")
    p.add_argument("--resume", action="store_true", help="skip records already in --output")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--shard", type=shard_arg, default=(0, 1), help=shard_help)


def check_room(lengths: list[int], max_new: int, n_positions: int | list[int], fix: str) -> None:
    """Refuse the longest prompt when its tokens plus ``max_new`` overrun the cache (``n_positions``:
    the largest bucket, or the bucket list); ``fix`` is the command's own way out."""
    n = max(n_positions) if isinstance(n_positions, list) else int(n_positions)
    i = max(range(len(lengths)), key=lengths.__getitem__)
    need = lengths[i] + max_new
    if need > n:
        raise ValueError(
            f"prompt {i + 1} has {lengths[i]} tokens; with --max-new-tokens {max_new} it needs {need} "
            f"positions, more than n_positions={n}: {fix.format(need=need)}"
        )


def counted(n: int, noun: str) -> str:
    """``1 record`` / ``2 records``: a count with its noun, as summaries print it."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def graphs_ready(model, seconds: float, since: int = 0) -> str:
    """``N graphs ready in S s (H from the compile cache at DIR)``: what a command logs once compiled
    (the graphs of ``model.compile_report[since:]``)."""
    report = model.compile_report[since:]
    hits = sum(r.get("hit", False) for r in report)
    d = model.compile_cache.dir
    cached = f"{hits} from the compile cache at {os.path.abspath(d)}" if d else "no compile cache on disk"
    return f"{counted(len(report), 'graph')} ready in {seconds:.2f}s ({cached})"


def distinct_files(source: str | None, output: str | None, flags: str) -> None:
    """A one-line error when ``output`` names the file ``source`` is (``--overwrite`` or a crash
    would lose the input); stdin (``-``) or a missing path never clashes."""
    if not source or not output or "-" in (source, output):
        return
    a, b = (os.path.realpath(expand(p)) for p in (source, output))
    if a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)):
        raise ValueError(f"{flags} name the same file {source}; write the output to another file")


def setup_logging(quiet: bool) -> None:
    """INFO lines of aotlm's own loggers to stderr (third-party loggers untouched)."""
    root = logging.getLogger("aotlm")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("aotlm: %(message)s"))
        root.addHandler(h)
        root.propagate = False
    root.setLevel(logging.WARNING if quiet else logging.INFO)


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = float("nan")
    if not 0 <= days < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of days >= 0, got {text!r}")
    return days


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the problem and where the fix is, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


# value types a --config file may hold (flags are typed by argparse)
_CONFIG_TYPES = {
    "batch_size": "int",
    "n_positions": "ints",
    "context_length_estimate": "ints",
    "tp_degree": "int",
    "pp_degree": "int",
    "gqa": "str",
    "amp": "str",
    "quant": "str",
    "fuse_qkv": "bool",
    "kv_cache_dtype": "str",
}


def _config_value_ok(kind: str, v) -> bool:
    is_int = lambda x: isinstance(x, int) and not isinstance(x, bool)
    if kind == "int":
        return is_int(v)
    if kind == "ints":
        return is_int(v) or (isinstance(v, list) and all(map(is_int, v)))
    return v is None or isinstance(v, {"str": str, "bool": bool}[kind])


VLLM_NAMES = (  # vLLM's flags for the shape options: (names, dest, type)
    (("--max-model-len",), "n_positions", bucket_list),
    (("--max-num-seqs",), "batch_size", int),
    (("--tensor-parallel-size", "-tp"), "tp_degree", int),
    (("--pipeline-parallel-size", "-pp"), "pp_degree", int),
)


def add_model_args(p: argparse.ArgumentParser, checkpoint: bool = True) -> None:
    """The shape options of ``compile``; ``checkpoint=False`` leaves out the positional model path."""
    if checkpoint:
        p.add_argument(
            "checkpoint",
            nargs="?",
            default=None,
            help="checkpoint dir, training run dir or bundled name (default: the bundled model)",
        )
    p.add_argument("--batch-size", type=int, default=None, help="compiled batch size (default 1; serve: 8)")
    p.add_argument(
        "--n-positions", type=bucket_list, default=None,
        help="token-generation buckets, e.g. 64,128 (one number: powers of two up to it, the context)",
    )  # fmt: skip
    p.add_argument(
        "--context-length-estimate", type=bucket_list, default=None, help="context buckets, e.g. 16,32"
    )
    p.add_argument("--tp-degree", type=int, default=None, help="tensor-parallel degree (default 1)")
    p.add_argument("--pp-degree", type=int, default=None, help="pipeline stages (default 1; pp x tp devices)")
    for names, dest, kind in VLLM_NAMES:  # so that a vLLM command line runs as it is
        flag = "--" + dest.replace("_", "-")
        p.add_argument(*names, dest=dest, type=kind, default=None, help=f"vLLM's name for {flag}")
    p.add_argument("--gqa", default=None, help="shard-over-heads | replicated-heads | shard-over-batch")
    p.add_argument("--amp", default=None, choices=["f32", "bf16", "f16"], help="compute dtype (default f32)")
    p.add_argument(
        "--quant",
        default=None,
        choices=["int8", "w8a8", "bf16", "bf16a", "fp8", "none", *INT4_NAMES],
        help="int8 (per-channel scales) or bf16 weight storage; w8a8: int8 weights and matmul activations; "
        "bf16a: bf16 weights and prefill activations; fp8: e4m3 weights and matmul activations (GPUs with "
        "fp8 tensor cores); "
        "int4[-g64|-g128][-asym][-a16|-f32a]: 4-bit groups of 32 (64, 128) with f16 scales (+ minimums), "
        "activations rounded to int8 per group (-a16: int16, 2x the products; -f32a: held as f32 holds "
        "them, 3x); "
        "none: f32 (a GGUF model defaults to int8)",
    )
    p.add_argument("--fuse-qkv", action="store_true", default=None, help="one q/k/v and one gate/up matmul")
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["f32", "bf16", "f16"],
        help="KV cache storage (default: follows --amp; f32 on CPU with the kernels)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="DIR|NAME=DIR",
        help="a PEFT LoRA adapter: DIR is merged into the weights at load; NAME=DIR (repeatable) goes into "
        "an adapter slot requests name (serve: the request's model; batch-generate: a record's adapter)",
    )
    p.add_argument(
        "--lora-modules", nargs="+", action="extend", dest="lora", type=lora_module, metavar="NAME=DIR",
        help="vLLM's form of --lora NAME=DIR (several at once; also its JSON {\"name\": .., \"path\": ..})",
    )  # fmt: skip
    p.add_argument(
        "--enable-lora", action="store_true", help="vLLM's switch: adapter slots (one without --max-loras)"
    )
    p.add_argument(
        "--max-loras", type=int, default=None, help="adapter slots (default: the NAME=DIR adapters)"
    )
    p.add_argument(
        "--max-lora-rank", type=int, default=None, help="the largest adapter rank the slots take (default 16)"
    )
    p.add_argument(
        "--cache-dir", default=None, help="compile cache dir (default $AOTLM_CACHE_DIR or ./compile_cache)"
    )
    p.add_argument("--config", default=None, help="JSON file with any of the options above (flags win)")
    p.add_argument("--coordinator", default=None, help="multi-host: host:port of process 0")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: process count")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's rank")


def add_table_flags(p: argparse.ArgumentParser) -> None:
    """One flag per transformers-named setting of ``aotlm.core.sampler_params.TABLE`` (``--top-p``,
    ``--do-sample``, ...), each None when not given."""
    for q in sampler_params.TABLE:
        if q.hf is None:
            continue
        flag = "--" + q.hf.replace("_", "-")
        if q.dtype == "bool":
            p.add_argument(flag, action="store_true", default=None, help=q.help)
        else:
            p.add_argument(flag, type=int if q.integer else float, default=None, help=q.help)


def table_values(args: argparse.Namespace) -> dict:
    """The table's settings given on the command line (``add_table_flags``), by transformers' name."""
    return {k: getattr(args, k) for k in sampler_params.HF_NAMES if getattr(args, k, None) is not None}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The generation flags of the text front ends (``generate``, ``chat``); unset flags fall back to
    the checkpoint's ``generation_config.json`` (see :func:`generation_settings`)."""
    add_table_flags(p)
    p.add_argument(
        "--greedy", action="store_true", help="argmax decoding, whatever generation_config.json says"
    )
    p.add_argument("--stop", action="append", default=None, help="stop text (repeatable)")
    p.add_argument(
        "--bad-words",
        action="append",
        default=None,
        metavar="WORD",
        help="a word never generated (repeatable; banned as written and after a space, as vLLM's bad_words)",
    )
    p.add_argument(
        "--suppress-tokens",
        type=int_list,
        default=None,
        metavar="IDS",
        help="token ids never generated: 13,198",
    )
    add_lookup_args(p)


def generation_settings(args, checkpoint, lengths: list[int], default_max: int, tokenizer=None) -> None:
    """Set ``args.gen`` (sampling settings) and ``args.max_new_tokens``: the flags over the
    checkpoint's ``generation_config.json`` (``aotlm.text.defaults``), as transformers does;
    ``default_max`` when neither gives a length. ``--bad-words`` are encoded with ``tokenizer``."""
    if args.greedy and args.do_sample:
        raise ValueError("give --greedy or --do-sample, not both")
    found = defaults.sampling_defaults(checkpoint)
    given = {k: getattr(args, k) for k in SAMPLING_FIELDS}
    if args.greedy:
        given["do_sample"] = False
    args.gen = defaults.merged({k: v for k, v in found.items() if k not in defaults.LENGTH_KEYS}, given)
    bad = sampler_params.violations(args.gen)  # before the weights load and the graphs compile
    if bad:
        raise ValueError(bad[0][1])
    idle = [k for k in sampler_params.WARPERS if given.get(k) is not None]
    if idle and not args.gen.get("do_sample"):  # as transformers' GenerationConfig warns
        flags = ", ".join("--" + k.replace("_", "-") for k in idle)
        why = "--greedy is given" if args.greedy else "neither --do-sample nor generation_config.json samples"
        log.warning("%s apply only when sampling, and %s: decoding is greedy (add --do-sample)", flags, why)
    if "" in (getattr(args, "stop", None) or []):
        raise ValueError("a stop string is empty; give at least one character")
    if getattr(args, "suppress_tokens", None) is not None:
        if any(t < 0 for t in args.suppress_tokens):
            raise ValueError(f"--suppress-tokens takes token ids (>= 0), got {args.suppress_tokens}")
        args.gen["suppress_tokens"] = args.suppress_tokens
    if getattr(args, "bad_words", None):
        if any(not w.strip() for w in args.bad_words):
            raise ValueError("a --bad-words word is empty; give at least one character")
        args.gen["bad_words_ids"] = bad_word_ids(tokenizer, args.bad_words)
    if args.max_new_tokens is None:
        if "max_new_tokens" in found:
            args.max_new_tokens = int(found["max_new_tokens"])
        elif "max_length" in found:
            args.max_new_tokens = max(1, int(found["max_length"]) - max(lengths))
        else:
            args.max_new_tokens = default_max
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    args.gen.update(lookup_settings(args, args.gen))


def model_kwargs(args) -> dict:
    # joins a multi-host run when flags or $AOTLM_* say so; a no-op for one process
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    if hasattr(args, "checkpoint"):  # a run dir, a bundled name, ~ or $VARS; none: the bundled model
        args.checkpoint = str(resolve(args.checkpoint))
    keys = MODEL_KEYS
    kw: dict = {}
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as f:
                loaded = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read --config {args.config} ({e}); give a readable JSON file") from e
        if not isinstance(loaded, dict):
            raise ValueError(f'--config {args.config} must hold a JSON object, e.g. {{"batch_size": 2}}')
        unknown = set(loaded) - set(keys)
        if unknown:
            raise ValueError(f"unknown keys in {args.config}: {sorted(unknown)}; allowed: {list(keys)}")
        for k, v in loaded.items():
            if not _config_value_ok(_CONFIG_TYPES[k], v):
                raise ValueError(f"{args.config}: {k}={v!r} has the wrong type; expected {_CONFIG_TYPES[k]}")
        kw.update(loaded)
    for k in keys:
        v = getattr(args, k)
        if v is not None:
            # a single --n-positions N means "powers of two up to N"; a list in --config is exact
            kw[k] = v[0] if k == "n_positions" and isinstance(v, list) and len(v) == 1 else v
    kw["compile_cache"] = args.cache_dir
    given, slots = getattr(args, "lora", None) or [], getattr(args, "max_loras", None)
    if getattr(args, "enable_lora", False) and slots is None and not given:
        slots = 1  # vLLM's --enable-lora alone: one slot, adapters loaded at run time
    kw.update(lora_kwargs(given, slots, getattr(args, "max_lora_rank", None)))
    return kw


def lora_module(text: str) -> str:
    """A ``--lora-modules`` item (``NAME=DIR`` or vLLM's ``{"name": .., "path": ..}``) as ``NAME=DIR``."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError:
            item = None
        if isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("path"), str):
            return f"{item['name']}={item['path']}"
    elif "=" in text:
        return text
    raise argparse.ArgumentTypeError(f'expected NAME=DIR or {{"name": NAME, "path": DIR}}, got {text!r}')


def lora_kwargs(given: list[str], max_loras: int | None, max_lora_rank: int | None) -> dict:
    """``--lora`` / ``--max-loras`` / ``--max-lora-rank`` as ``from_pretrained`` arguments (models/README.md:
    LoRA adapters): one ``DIR`` merged, or ``NAME=DIR`` adapters in slots."""
    named = [x for x in given if "=" in x and not os.path.isdir(x)]
    merged = [x for x in given if x not in named]
    if merged and (named or len(merged) > 1 or max_loras):
        raise ValueError(
            "--lora DIR merges one adapter into the weights; for several, or with --max-loras, give "
            "--lora NAME=DIR for each (served per row from adapter slots)"
        )
    if merged:
        return dict(lora_adapters={"lora": merged[0]}, merge_lora=True)
    pairs = [x.split("=", 1) for x in named]
    if any(not n or not d for n, d in pairs) or len({n for n, _ in pairs}) != len(pairs):
        raise ValueError(f"--lora NAME=DIR takes a name and a directory, each name once; got {named}")
    kw = dict(lora_adapters=dict(pairs)) if pairs else {}
    if max_loras is not None:
        kw["max_loras"] = max_loras
    if max_lora_rank is not None:
        kw["max_lora_rank"] = max_lora_rank
    if kw and "lora_adapters" not in kw and "max_loras" not in kw:
        raise ValueError("--max-lora-rank sizes adapter slots: give --max-loras N or --lora NAME=DIR too")
    return kw


SERVE_BATCH = 8  # slots of `aotlm serve` (and `aotlm compile --serve`) when --batch-size is not given
SERVE_MAX_POSITIONS = 4096  # the default context of a server: the checkpoint's window, capped here


def checkpoint_window(checkpoint: str) -> int | None:
    """The context window the checkpoint's config.json declares (None: it does not say)."""
    try:
        with open(f"{checkpoint}/config.json", encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None  # from_pretrained reports an unreadable checkpoint with its own message
    for k in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"):
        if isinstance(cfg.get(k), int) and cfg[k] > 0:
            return cfg[k]
    return None


def serve_kwargs(kw: dict, checkpoint: str, prompt_logprobs: bool = False, embeddings: bool = False) -> dict:
    """``model_kwargs`` for serving: slot graphs, 8 slots and the checkpoint's whole window
    (capped at 4096, token buckets as usual) unless the flags or ``--config`` say otherwise;
    ``prompt_logprobs`` (``--prompt-logprobs``) adds the graphs that score prompts, ``embeddings``
    (``--embeddings``) those that embed them. ``aotlm serve``
    and ``aotlm compile --serve`` share it, so both compile the same graphs."""
    out = dict(kw, continuous_batching=True)
    if prompt_logprobs:
        out["prompt_logprobs"] = True
    if embeddings:
        out["embeddings"] = True
    out.setdefault("batch_size", SERVE_BATCH)
    if out.get("n_positions") is None:
        out["n_positions"] = default_window(checkpoint, SERVE_MAX_POSITIONS)
    return out


def default_window(checkpoint: str, cap: int) -> int:
    """The positions to compile when none are given: the checkpoint's window, capped at ``cap``."""
    return min(checkpoint_window(checkpoint) or cap, cap)


def table(rows: Sequence[Sequence], header: Sequence[str]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


def _gb(n: float) -> str:
    return f"{n / 2**30:.3f} GB"
