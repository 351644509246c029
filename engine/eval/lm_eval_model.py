"""An EleutherAI lm-evaluation-harness backend: ``LMEvalModel``, registered as ``--model aotlm``.

Most evaluation is scoring, not generation, so the three request types map onto aotlm's
compiled graphs: ``loglikelihood`` and ``loglikelihood_rolling`` onto the score graphs
(``aotlm.text.scoring``: log-softmax and the gather happen in the graph, only one float and one
flag per token reach the host), ``generate_until`` onto the in-graph sampler
(``aotlm.generate.rows``). Everything is compiled ahead of time when the backend is built, so an
evaluation run compiles nothing while it runs.

The numbers equal lm-eval's own ``hf`` backend on the same checkpoint because the requests are
tokenized the way it tokenizes them for causal models (the behaviour, re-implemented here):

* a context's trailing whitespace moves into the continuation, the whole string is encoded and
  split where the encoded context ends (so the word-boundary merge the tokenizer makes is kept);
* an empty context becomes the prefix token (bos, else eos), unless the continuation already
  starts with it;
* a pair longer than the model keeps its last tokens (``scoring.loglikelihood`` truncates);
* generation contexts keep their last ``n_positions - max_gen_toks`` tokens, and the text is cut
  before the first ``until`` string (the eos text is always one of them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's table of its own models; see register())
from lm_eval.api.model import LM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import simple_parse_args_string

from aotlm import progress
from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.generate import rows
from aotlm.generate.params import SAMPLING_FIELDS
from aotlm.jobs.model_refs import AMP_NAMES
from aotlm.models.checkpoint.bundled import BUNDLED_MODELS
from aotlm.models.checkpoint.resolve import validate_checkpoint
from aotlm.text import scoring
from aotlm.text.defaults import merged, sampling_defaults
from aotlm.text.tokens import eos_ids, load_tokenizer

log = logging.getLogger("aotlm.eval")

MODEL_NAME = "aotlm"  # the name lm-eval's ``--model`` takes
# lm-eval passes these to every model (``--batch_size``'s companions); aotlm has no use for them
IGNORED_ARGS = ("device", "max_batch_size")
CHUNK_BATCHES = 8  # batches per scoring call: the progress bar's step


def _int(value: Any, name: str, minimum: int = 1) -> int:
    """``--model_args`` values may arrive as strings; a non-integer is an error, never rounded."""
    try:
        out = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer") from None
    if out < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return out


def _bool(value: Any, name: str) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} must be true or false")


def _checkpoint_name(pretrained: str) -> str:
    """A bundled model may be named without its ``aotlm/`` prefix (``pretrained=tiny-py``)."""
    short = f"aotlm/{pretrained}"
    if short in BUNDLED_MODELS and not os.path.exists(os.path.expanduser(pretrained)):
        return short
    return pretrained


def _batch_size(value: Any) -> int:
    """``--batch_size auto`` asks the hf backend to probe memory; aotlm's batch is compiled into
    the graphs, so ``auto`` means the default of 4."""
    if isinstance(value, str) and value.strip().lower().startswith("auto"):
        log.warning("batch_size=%s: aotlm compiles a fixed batch; using 4 (set batch_size=N)", value)
        return 4
    return _int(value, "batch_size")


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the earliest stop string (lm-eval's ``until``: the stop is not kept)."""
    ends = [text.find(s) for s in stops if s and s in text]
    return text[: min(ends)] if ends else text


class LMEvalModel(LM):
    """lm-eval's ``LM`` over an aotlm model: ``lm_eval --model aotlm --model_args pretrained=DIR,...``
    (through ``python -m aotlm.eval``) or ``lm_eval.simple_evaluate(model=LMEvalModel(...))``.

    Arguments (strings from ``--model_args`` are converted): ``pretrained`` a checkpoint dir, a
    training run, a bundled name (``tiny-py``) or an already built aotlm model; ``tokenizer`` a
    directory (default: next to the checkpoint) or a tokenizer object; ``batch_size`` the compiled
    batch; ``n_positions`` the longest sequence (lm-eval's ``max_length``); ``dtype`` float32 |
    bfloat16 | float16; ``quant`` int8 | bf16 | f16 weights; ``tp_degree``; ``cache_dir`` the
    compile cache; ``max_gen_toks`` (256 as ``hf``, at most half of n_positions);
    ``prefix_token_id`` (default bos, else eos); ``seed`` the base seed of sampled rows (request
    ``i`` gets ``seed + i``); ``compile`` (true: every graph is compiled or loaded from the cache
    before the first request).
    """

    def __init__(
        self,
        pretrained: Any = "aotlm/tiny-py",
        tokenizer: Any = None,
        batch_size: int | str = 1,
        n_positions: int | str | None = None,
        dtype: str = "float32",
        quant: str | None = None,
        tp_degree: int | str = 1,
        cache_dir: str | None = None,
        max_gen_toks: int | str | None = None,
        prefix_token_id: int | str | None = None,
        seed: int | str = 1234,
        compile: bool | str = True,
        **ignored: Any,
    ) -> None:
        super().__init__()
        unknown = sorted(set(ignored) - set(IGNORED_ARGS))
        if unknown:
            known = "pretrained, tokenizer, batch_size, n_positions, dtype, quant, tp_degree, cache_dir, "
            raise TypeError(
                f"unknown model argument(s) {unknown} for --model aotlm; known: {known}"
                "max_gen_toks, prefix_token_id, seed, compile"
            )
        self.seed = _int(seed, "seed", minimum=0)
        if isinstance(pretrained, str | os.PathLike):
            self.model = self._build(pretrained, batch_size, n_positions, dtype, quant, tp_degree, cache_dir)
            path = str(pretrained)
        else:  # an aotlm model built by the caller (its own shapes and cache)
            self.model, path = pretrained, pretrained.path
        if tokenizer is None or isinstance(tokenizer, str | os.PathLike):
            files = validate_checkpoint(_checkpoint_name(path), tokenizer)
            tokenizer = load_tokenizer(files.tokenizer)
        self.tokenizer = tokenizer
        self._prefix = None if prefix_token_id is None else _int(prefix_token_id, "prefix_token_id", 0)
        self.eos = eos_ids(self.model.path, self.model.hf_config, tokenizer)
        # the checkpoint's generation_config.json under each request's settings, as hf's generate
        self._gen_defaults = {
            k: v for k, v in sampling_defaults(self.model.path).items() if k in SAMPLING_FIELDS
        }
        # hf's 256, unless that leaves a small model no room for a context (checked per request)
        default = min(256, self.max_length // 2)
        self._max_gen_toks = default if max_gen_toks is None else _int(max_gen_toks, "max_gen_toks")
        if _bool(compile, "compile"):
            self.model.compile()

    @staticmethod
    def _build(pretrained, batch_size, n_positions, dtype, quant, tp_degree, cache_dir):
        amp = AMP_NAMES.get(str(dtype).lower())
        if amp is None:
            raise ValueError(
                f"model argument dtype={dtype!r} is not supported; use one of {sorted(AMP_NAMES)}"
            )
        return AutoModelForSampling.from_pretrained(
            _checkpoint_name(str(pretrained)),
            batch_size=_batch_size(batch_size),
            n_positions=None if n_positions is None else _int(n_positions, "n_positions", 2),
            amp=amp,
            quant=quant,
            tp_degree=_int(tp_degree, "tp_degree"),
            compile_cache=cache_dir,
            scoring=True,
        )

    # -- construction from lm-eval's command line -------------------------------------------

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LMEvalModel:
        """``--model_args`` as a string: like lm-eval's, except that a value given there (say
        ``batch_size=4``) wins over the harness-wide one instead of being a duplicate argument."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> LMEvalModel:
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # -- properties lm-eval reads -----------------------------------------------------------

    @property
    def max_length(self) -> int:
        return int(self.model.n_positions)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return int(self.model.batch_size)

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context (and every rolling window's start) is conditioned on."""
        if self._prefix is not None:
            return self._prefix
        tok = self.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    @property
    def batch_sizes(self) -> dict[int, int]:
        """What lm-eval reports as the batch sizes used (the harness-wide ``batch_size`` it reports
        next to it is only what it was given)."""
        return {0: self.batch_size}

    def get_model_info(self) -> dict:
        m = self.model
        return {"model_path": m.path, "amp": m.amp, "n_positions": m.n_positions, "tp_degree": m.tp_degree}

    # -- tokenization (the hf backend's behaviour for causal models) --------------------------

    def tok_encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids as the hf backend encodes them (``aotlm.text.scoring.tok_encode``)."""
        return scoring.tok_encode(self.tokenizer, text, self.prefix_token_id, add_special_tokens)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as lm-eval scores them (``scoring.encode_pair``)."""
        return scoring.encode_pair(self.tokenizer, context, continuation, self.prefix_token_id)

    # -- the three request types ------------------------------------------------------------

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), every continuation token is the argmax) each."""
        pairs = []
        for i, req in enumerate(requests):
            context, continuation = req.args
            ctx, cont = self.encode_pair(context, continuation)
            if not cont:
                raise ValueError(
                    f"loglikelihood request {i}: the continuation {continuation!r} encodes to no tokens; "
                    "every continuation needs at least one token to score"
                )
            if len(cont) > self.max_length:
                raise ValueError(
                    f"loglikelihood request {i}: the continuation is {len(cont)} tokens, more than "
                    f"n_positions={self.max_length}; raise n_positions"
                )
            pairs.append((ctx, cont))
        out = self._score_unique(pairs, disable_tqdm)
        for req, res in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def _score_unique(
        self, pairs: list[tuple[list[int], list[int]]], quiet: bool
    ) -> list[tuple[float, bool]]:
        """Each distinct pair scored once, longest first (batches of similar length, and an
        out-of-memory error comes at once rather than at the end), results in request order."""
        keys = [(tuple(c), tuple(t)) for c, t in pairs]
        distinct = sorted(set(keys), key=lambda k: (-(len(k[0]) + len(k[1])), k))
        step = self.batch_size * CHUNK_BATCHES
        scored: dict = {}
        with progress.quiet(quiet):
            chunks = range(0, len(distinct), step)
            for lo in progress.bar(chunks, "loglikelihood", total=len(chunks), unit="chunk"):
                part = distinct[lo : lo + step]
                results = scoring.loglikelihood(self.model, [(list(c), list(t)) for c, t in part])
                scored.update(zip(part, ((float(lp), bool(g)) for lp, g in results), strict=True))
        return [scored[k] for k in keys]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text, in windows of ``n_positions`` (lm-eval's rolling
        windows with a context of one token, the prefix token before the first)."""
        token_lists = [self.tok_encode(req.args[0]) for req in requests]
        order = sorted(range(len(requests)), key=lambda i: -len(token_lists[i]))
        out: list[float] = [0.0] * len(requests)
        step = self.batch_size * CHUNK_BATCHES
        with progress.quiet(disable_tqdm):
            chunks = range(0, len(order), step)
            for lo in progress.bar(chunks, "loglikelihood_rolling", total=len(chunks), unit="chunk"):
                part = [i for i in order[lo : lo + step] if token_lists[i]]  # an empty text scores 0
                results = scoring.loglikelihood_rolling(
                    self.model, [token_lists[i] for i in part], self.prefix_token_id, self.max_length
                )
                for i, value in zip(part, results, strict=True):
                    out[i] = float(value)
        for req, value in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, value)
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Text generated for each context, cut before the first ``until`` string; greedy unless
        ``do_sample`` (or a temperature > 0) is in the request's generation arguments."""
        eos_text = self.tokenizer.decode(self.eos[:1], skip_special_tokens=False) if self.eos else ""
        jobs = [self._generation_job(i, req.args, eos_text) for i, req in enumerate(requests)]
        # one call per max_gen_toks (each row's context fits n_positions - max_gen_toks, so a
        # padded batch of them does too), rows sorted by context length to keep padding small
        order = sorted(range(len(jobs)), key=lambda i: (jobs[i]["max_new"], len(jobs[i]["ids"])))
        out: list[str] = [""] * len(jobs)
        with progress.quiet(disable_tqdm):
            groups = [order[lo : lo + self.batch_size] for lo in range(0, len(order), self.batch_size)]
            for batch in progress.bar(groups, "generate_until", unit="batch"):
                for limit in sorted({jobs[i]["max_new"] for i in batch}):
                    part = [i for i in batch if jobs[i]["max_new"] == limit]
                    results = rows.generate(
                        self.model,
                        [jobs[i]["ids"] for i in part],
                        [limit] * len(part),
                        [jobs[i]["sampling"] for i in part],
                        eos_token_id=self.eos,
                        row_stop_sequences=[jobs[i]["stop_ids"] for i in part],
                    )
                    for i, res in zip(part, results, strict=True):
                        text = self.tokenizer.decode(res.tokens, skip_special_tokens=True)
                        out[i] = cut_at_stop(text, jobs[i]["until"])
        for req, text in zip(requests, out, strict=True):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def _generation_job(self, i: int, args: tuple, eos_text: str) -> dict:
        context, gen_kwargs = args
        if not isinstance(gen_kwargs, dict):
            raise TypeError(
                f"generate_until request {i}: generation arguments must be a dict: {gen_kwargs!r}"
            )
        kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = [s for s in kw.pop("until") if isinstance(s, str) and s]
        if eos_text and eos_text not in until:
            until.append(eos_text)
        limit = _int(kw.pop("max_gen_toks"), f"generate_until request {i}: max_gen_toks")
        if limit >= self.max_length:
            raise ValueError(
                f"generate_until request {i}: max_gen_toks={limit} leaves no room for a context in "
                f"n_positions={self.max_length}; lower max_gen_toks or raise n_positions"
            )
        ids = self.tok_encode(context)[-(self.max_length - limit) :] or [self.prefix_token_id]
        stop_ids = [self.tok_encode(s, add_special_tokens=False) for s in until if s != eos_text]
        return {"ids": ids, "max_new": limit, "until": until, "stop_ids": stop_ids,
                "sampling": self._sampling(i, kw)}  # fmt: skip

    def _sampling(self, i: int, kw: dict) -> dict:
        """The sampler settings of one request over the checkpoint's generation defaults (as
        transformers' ``generate`` in the hf backend): greedy unless it samples; a sampled row
        without a seed gets ``seed + i`` so a rerun draws the same text."""
        unknown = sorted(set(kw) - set(SAMPLING_FIELDS))
        if unknown:
            raise ValueError(
                f"generate_until request {i}: generation argument(s) {unknown} are not supported by "
                f"aotlm; supported: until, max_gen_toks, {', '.join(SAMPLING_FIELDS)}"
            )
        row = merged(self._gen_defaults, kw)
        if not row.get("do_sample"):
            return {k: v for k, v in row.items() if k not in ("do_sample", "temperature", "seed")}
        return {**row, "seed": int(row.get("seed", self.seed + i))}


def register() -> None:
    """Make ``--model aotlm`` known to lm-eval (idempotent). lm-eval 0.4 has no plugin entry
    points for models, so this runs when ``aotlm.eval`` is imported. Its own models are
    registered first (the import above): lm-eval only adds them to an *empty* registry."""
    if MODEL_NAME not in model_registry:
        register_model(MODEL_NAME)(LMEvalModel)
