"""``aotlm.pipeline("text-generation", ...)``: transformers' text-generation pipeline on aotlm.

Same call shape and same output as ``transformers.pipeline("text-generation")`` (greedy
text is equal, tested), over a model compiled for a fixed batch size: any number of
prompts is sorted by token length and cut into batches of the compiled size, so prompts
of one context bucket run together with little padding; results come back in input order.
Generation defaults come from the checkpoint's ``generation_config.json`` as in transformers
(``aotlm.text.defaults``); explicit arguments win.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from aotlm import progress as progress_mod
from aotlm.api.arguments import check_names
from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.generate import stopping
from aotlm.generate.constraints import Constraint, Grammars
from aotlm.generate.lookup import NAMES as LOOKUP
from aotlm.generate.params import FIELDS
from aotlm.generate.sampler import Sampler
from aotlm.models.checkpoint.resolve import default_model, validate_checkpoint
from aotlm.text import call_args, chats, defaults, lengths, preprocess
from aotlm.text import tokens as text
from aotlm.text.call_args import PER_PROMPT
from aotlm.text.unicode import check_text

_CALL_HINTS = {  # transformers' call keywords that have another place here
    "num_beams": "; beam search: model.sample(ids, num_beams=N) (a compiled batch of prompts x N rows) or "
    "the HF adapter's generate()",
    "batch_size": "; the batch size is compiled: give it when loading, aotlm.pipeline(..., batch_size=N)",
    "attention_mask": "; the pipeline pads the prompts and makes their mask (token ids: model.sample())",
}


@dataclass
class Generation:
    """One prompt's result, with what the CLI reports about it."""

    prompt: str
    text: str  # the generated text (without the prompt)
    tokens: list[int]  # the generated token ids (up to and including an eos)
    prompt_tokens: int
    finish_reason: str  # "eos" | "stop_sequence" | "length"
    time_to_first_token: float | None  # seconds from the start of its batch
    seconds: float  # wall time of its batch
    extra: dict = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)  # the prompt's token ids, as encoded


def _text_stop(toks, stops: Sequence[str], decode) -> int | None:
    """The fewest leading tokens whose text holds a stop string, as transformers' ``stop_strings`` stop
    (at the token that completes one, however the tokens spell it); None when none appears."""
    if not stops or not any(s in decode(toks) for s in stops):
        return None
    lo, hi = 1, len(toks)  # holding a stop string only grows with the prefix: bisect
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(toks[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


class _TextStop:
    """A stopping criterion (``(input_ids, scores) -> bool``) that ends the one streamed row once its
    generated text holds a stop string, so a stream stops where the result is cut (the in-graph
    match only sees a stop spelt by its own tokens)."""

    def __init__(self, p_len: int, stops: Sequence[str], decode):
        self.p_len, self.stops, self.decode = p_len, tuple(stops), decode

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        row = [int(t) for t in input_ids[0][self.p_len :]]
        return bool(row) and any(s in self.decode(row) for s in self.stops)


def _record(kind: str, full, g: Generation) -> dict:
    if kind == "ids":
        return {"generated_token_ids": [*map(int, g.prompt_ids), *map(int, g.tokens)]}
    return {"generated_text": full if kind == "full" else g.text}


def _sample_params(model) -> set[str]:
    """The keyword arguments ``model.sample`` takes (its signature plus GenerationConfig fields) less
    those the pipeline makes itself (the padded ids and their mask, the result's form)."""
    made = {"self", "input_ids", "generation_kwargs", "attention_mask", "return_dict"}
    return (set(inspect.signature(model.sample).parameters) | FIELDS | set(LOOKUP)) - made


class TextGenerationPipeline:
    """Prompts (text) in, generated text out, over an aotlm model. Build with :func:`pipeline`."""

    def __init__(self, model, tokenizer, progress_bars: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.progress = progress_bars
        self.eos = text.eos_ids(model.path, model.hf_config, tokenizer)
        # the checkpoint's generation_config.json: defaults under explicit arguments (text.defaults)
        found = defaults.sampling_defaults(model.path)
        self.defaults = {k: v for k, v in found.items() if k not in defaults.LENGTH_KEYS}
        self.lengths = lengths.Lengths(
            model.n_positions, found.get("max_new_tokens"), found.get("max_length")
        )
        self._sample_params = _sample_params(model)
        self._grammars: Grammars | None = None  # structured outputs, built on first use

    # ------------------------------------------------------------------ transformers-shaped call
    def __call__(
        self,
        text_inputs,
        return_full_text: bool | None = None,
        continue_final_message: bool | None = None,
        tools: Sequence[dict] | None = None,
        return_text: bool | None = None,
        return_tensors: bool | None = None,
        stop_sequence: str | Sequence[str] | None = None,
        prefix: str | None = None,
        handle_long_generation: str | None = None,
        truncation: bool | str | None = None,
        padding: bool | str | None = None,
        tokenizer_encode_kwargs: dict | None = None,
        documents: Sequence[dict] | None = None,
        **kwargs,
    ):
        """``[{"generated_text": ...}]`` for one prompt or chat, ``[[{...}], ...]`` for a list.

        ``text_inputs``: a string, a list of strings, a chat (a list of ``{"role", "content"}``
        messages, rendered by the tokenizer's chat template; ``tools`` go to the template) or a list
        of chats. As in transformers, ``generated_text`` is the prompt followed by the new text, or
        for a chat the messages followed by the new assistant message (a chat ending in the
        assistant's message is continued: ``continue_final_message``); ``return_full_text=False``
        gives only the new text, ``return_tensors`` ``{"generated_token_ids": prompt + new ids}``.
        Other keywords: ``max_new_tokens``, the sampling parameters of ``sample()``, ``stop`` (or
        ``stop_sequence``: strings), ``num_return_sequences`` (with sampling: that many records per
        prompt, each copy its own seed), ``skip_special_tokens``, ``clean_up_tokenization_spaces``,
        ``streamer``, prompt lookup decoding (``prompt_lookup_num_tokens``, ``max_matching_ngram_size``:
        the same text in fewer target forwards where the answer quotes its input); transformers' prompt
        options ``prefix``, ``handle_long_generation``, ``truncation``, ``padding``,
        ``tokenizer_encode_kwargs`` (:mod:`aotlm.text.preprocess`) and, for chats, ``documents``.
        """
        length = kwargs.get("max_length")
        if isinstance(text_inputs, Iterator):  # a generator of prompts or of chats, as transformers takes
            text_inputs = list(text_inputs)
        convs, single = chats.split(text_inputs)
        encode, template = preprocess.tokenizer_kwargs(
            truncation, padding, length, tokenizer_encode_kwargs, chat=convs is not None
        )
        kwargs = call_args.with_config(kwargs)
        k = call_args.return_sequences(kwargs)
        kind = call_args.return_type(return_full_text, return_text, return_tensors)
        if stop_sequence is not None:  # transformers' name for stop strings
            if kwargs.get("stop") is not None:
                raise TypeError("give stop or stop_sequence, not both")
            kwargs["stop"] = [stop_sequence] if isinstance(stop_sequence, str) else list(stop_sequence)
        if convs is not None:
            if prefix:
                raise ValueError("prefix goes before a text prompt; begin a chat with a system message")
            kwargs.pop("add_special_tokens", None)  # the template writes them (transformers ignores it too)
            encode.pop("add_special_tokens", None)
            finals = [chats.continues(c, continue_final_message) for c in convs]
            template.update(tools=tools, documents=documents)
            render = functools.partial(chats.render, self.tokenizer, **template)
            prompts = [render(c, f) for c, f in zip(convs, finals, strict=True)]
        else:
            if tools is not None or documents is not None:
                raise ValueError("tools and documents go to a chat template: give the prompt as a chat")
            single = isinstance(text_inputs, str)
            prompts = [text_inputs] if single else call_args.text_prompts(text_inputs)
        sampling = bool(defaults.merged(self.defaults, kwargs).get("do_sample"))
        kwargs = call_args.repeated(kwargs, len(prompts), k, sampling)
        kwargs.update(prefix=prefix, handle_long_generation=handle_long_generation, tokenizer_kwargs=encode)
        if "add_special_tokens" in encode:
            kwargs["add_special_tokens"] = encode.pop("add_special_tokens")
        gens = self.generate([p for p in prompts for _ in range(k)], **kwargs)
        if convs is not None:
            texts = [chats.reply(convs[i // k], g.text, finals[i // k]) for i, g in enumerate(gens)]
        else:
            texts = [g.prompt + g.text for g in gens]
        records = [_record(kind, t, g) for t, g in zip(texts, gens, strict=True)]
        out = [records[i : i + k] for i in range(0, len(records), k)]
        return out[0] if single else out

    # ------------------------------------------------------------------ the work
    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int | Sequence[int] | None = None,
        stop: Sequence[str] | None = None,
        skip_special_tokens: bool = True,
        clean_up_tokenization_spaces: bool | None = None,
        streamer=None,
        add_special_tokens: bool = True,
        json_schema=None,
        constraint=None,
        prefix: str | None = None,
        handle_long_generation: str | None = None,
        tokenizer_kwargs: dict | None = None,
        **generation_kwargs,
    ) -> list[Generation]:
        """Generate for every prompt; results in input order (see the module docstring).

        ``add_special_tokens=False`` for prompts that hold their own (a chat template's text).
        Structured outputs: ``json_schema`` (a dict or JSON text) or ``constraint`` (an
        ``aotlm.generate.constraints.Constraint``: regex, grammar, any JSON object), one for
        every prompt or a list with one (or None) per prompt. ``prefix``, ``handle_long_generation``
        and ``tokenizer_kwargs``: transformers' prompt options (:mod:`aotlm.text.preprocess`).

        Time to first token is measured by ``sample()`` (``GenerateOutput.time_to_first_token``).
        """
        generation_kwargs = call_args.with_config(generation_kwargs)
        from_config = generation_kwargs.pop("max_new_tokens", None)
        max_new_tokens = from_config if max_new_tokens is None else max_new_tokens
        hole = preprocess.hole_check(handle_long_generation)
        rows, offset = self._encode(prompts, add_special_tokens, prefix, tokenizer_kwargs or {})
        n = len(rows)
        generation_kwargs = preprocess.shifted(defaults.merged(self.defaults, generation_kwargs), offset)
        per_prompt = {"max_new_tokens": max_new_tokens, **generation_kwargs}
        for k, v in per_prompt.items():
            if k in PER_PROMPT and isinstance(v, list | tuple) and len(v) != n:
                raise ValueError(f"{k} has {len(v)} values for {n} prompts; give one value or one per prompt")
        stop = [stop] if isinstance(stop, str) else stop  # one stop string, not its characters
        if stop:
            generation_kwargs["stop_sequences"] = self._stop_ids(stop)
        unknown = set(generation_kwargs) - self._sample_params
        if unknown:
            hints = "".join(h for k, h in _CALL_HINTS.items() if k in unknown)
            raise TypeError(
                f"pipeline() does not take {sorted(unknown)}{hints}; it takes: {sorted(self._sample_params)}"
            )
        if streamer is not None and n != 1:
            raise ValueError(f"a streamer follows one prompt, got {n}")
        specs = self._constraints(n, json_schema, constraint)
        if specs is not None:
            generation_kwargs["constraints"] = specs
        decode_kw = dict(
            skip_special=skip_special_tokens, cleanup=clean_up_tokenization_spaces, stops=tuple(stop or ())
        )
        given = {k: generation_kwargs.pop(k, None) for k in ("eos_token_id", "pad_token_id", "max_length")}
        decode_kw["eos"] = call_args.token_ids(given["eos_token_id"], "eos_token_id", self.eos)
        decode_kw["pad"] = call_args.pad_id(given["pad_token_id"])
        length = call_args.max_length(given["max_length"])  # prompt + new tokens, as transformers
        rows, new = self._counts(rows, max_new_tokens, length, offset, hole)
        b = self.model.batch_size
        order = sorted(range(n), key=lambda i: len(rows[i]))  # stable: equal lengths keep input order
        batches = [order[s : s + b] for s in range(0, n, b)]
        results: list[Generation | None] = [None] * n
        with progress_mod.quiet(not self.progress):  # also the bars of graphs compiled on first use
            for idx in progress_mod.bar(batches, "generating", unit="batch") if n > b else batches:
                pick = {k: self._slice(k, v, idx) for k, v in generation_kwargs.items()}
                gens = self._run([rows[i] for i in idx], [new[i] for i in idx], pick, streamer, **decode_kw)
                for i, g in zip(idx, gens, strict=True):
                    g.prompt = prompts[i]
                    results[i] = g
        return results  # type: ignore[return-value]

    @staticmethod
    def _pick(value, i: int):
        return value[i] if isinstance(value, list | tuple) else value

    def _encode(self, prompts, add_special_tokens: bool, prefix, tokenizer_kwargs: dict):
        """``(rows, offset)``: each prompt's ids (after ``prefix`` when given), the prefix's token count."""
        if prefix is None or prefix == "":
            return text.encode(self.tokenizer, prompts, add_special_tokens, **tokenizer_kwargs), 0
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, got {type(prefix).__name__}")
        check_text(prefix, "prefix")
        for i, p in enumerate(prompts):  # named as given (not with the prefix before them)
            if not isinstance(p, str):
                raise TypeError(f"prompt {i} must be a string, got {type(p).__name__}")
        joined = [prefix + p for p in prompts]
        rows = text.encode(self.tokenizer, joined, add_special_tokens, **tokenizer_kwargs)
        return rows, len(self.tokenizer(prefix, add_special_tokens=False)["input_ids"])

    def _counts(self, rows, max_new_tokens, length: int | None, offset: int, hole: bool):
        """``(rows, new)``: each prompt's new-token count (``self.lengths``' rules), the prompts cut
        first to leave room for it with ``hole``; a prefix's tokens count in ``max_length`` too."""
        asked = [self._pick(max_new_tokens, i) for i in range(len(rows))]
        if length is not None and max_new_tokens is None:
            length += offset
        if hole:  # counted before the cut, then given as max_new_tokens
            asked = [self.lengths.wanted(i, len(r), asked[i], length, offset) for i, r in enumerate(rows)]
            limit = min(self.model.n_positions, getattr(self.tokenizer, "model_max_length", None) or 1 << 62)
            rows, length = preprocess.hole(rows, asked, limit), None
        count = self.lengths.new_tokens
        return rows, [count(i, len(r), asked[i], length, offset) for i, r in enumerate(rows)]

    def _stop_ids(self, stop: Sequence[str]) -> list[list[int]]:
        for i, s in enumerate(stop):
            check_text(s, f"stop string {i}")
        stops = [self.tokenizer.encode(s, add_special_tokens=False) for s in stop]
        if any(not s for s in stops):
            raise ValueError("a stop string is empty; give at least one character")
        return stops

    def _constraints(self, n: int, json_schema, constraint) -> list | None:
        """One ``Constraint`` or None per prompt (None: no prompt is constrained); checked now."""
        if json_schema is not None and constraint is not None:
            raise ValueError("give json_schema or constraint, not both")
        given = json_schema if json_schema is not None else constraint
        if given is None:
            return None
        many = isinstance(given, list | tuple)
        if many and len(given) != n:
            raise ValueError(f"{len(given)} constraints for {n} prompts; give one, or one per prompt")
        make = Constraint.json_schema if json_schema is not None else (lambda c: c)
        specs = [None if g is None else make(g) for g in (given if many else [given] * n)]
        if any(c is not None and not isinstance(c, Constraint) for c in specs):
            raise TypeError("constraint must be an aotlm.generate.constraints.Constraint (or one per prompt)")
        for c in specs:
            if c is not None:
                self.grammars().compile(c)  # a bad schema or grammar fails before any device work
        return specs

    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model.cfg.vocab_size, self.eos)
        return self._grammars

    @staticmethod
    def _slice(key: str, value, idx: list[int]):
        if key == "constraints":
            return [value[i] for i in idx]
        if key in PER_PROMPT and isinstance(value, list | tuple):
            return [value[i] for i in idx]
        return value

    def _run(self, rows, new, kwargs, streamer, skip_special, cleanup, stops, eos, pad) -> list[Generation]:
        pad = self.tokenizer.pad_token_id if pad is None else pad
        pad = int(pad) if pad is not None else (eos[0] if eos else 0)
        ids, mask = text.left_pad(rows, pad)
        p_len = ids.shape[1]
        call = dict(kwargs, attention_mask=mask, max_new_tokens=new, return_dict=True, streamer=streamer)
        call.update(eos_token_id=eos or None, pad_token_id=pad)
        decode = functools.partial(
            self.tokenizer.decode, skip_special_tokens=skip_special, clean_up_tokenization_spaces=cleanup
        )
        if streamer is not None and stops:  # the stream stops at a text stop too, not only the result
            key = "stopping_criteria_list" if call.get("stopping_criteria") is None else "stopping_criteria"
            given = stopping.criteria_list(call.get(key))
            call[key] = [*given, _TextStop(p_len, stops, decode)]
        if "constraints" in call:  # fresh matchers for this batch's rows
            call["constraints"] = [
                None if c is None else self.grammars().matcher(c) for c in call["constraints"]
            ]
        t0 = time.perf_counter()
        out = self.model.sample(ids, **call)
        seconds = time.perf_counter() - t0
        seqs, first = out.sequences, out.time_to_first_token
        reasons = list(out.finish_reason)
        gens = []
        for r, row in enumerate(seqs[: len(rows)]):
            toks = text.cut_at_eos(row[p_len : p_len + new[r]], eos)
            reason = reasons[r]
            k = _text_stop(toks, stops, decode)
            if k is not None:  # a stop string the token match missed (other tokens spell it): cut there
                toks, reason = toks[:k], "stop_sequence"
            words = decode(toks)
            gens.append(Generation("", words, toks, len(rows[r]), reason, first, seconds, prompt_ids=rows[r]))
        return gens


def pipeline(
    task: str = "text-generation",
    model=None,
    tokenizer=None,
    progress: bool = True,
    **model_kwargs,
) -> TextGenerationPipeline:
    """A text-generation pipeline over an aotlm model, shaped like ``transformers.pipeline``.

    ``model``: an aotlm model object, or anything ``resolve`` accepts (a checkpoint
    directory, a training run, ``"aotlm/tiny-py"``; default: the bundled model), loaded with
    ``model_kwargs`` (``batch_size``, ``n_positions``, ``amp``, ``compile_cache``...).
    ``tokenizer``: a tokenizer object or directory; default: found next to the checkpoint or
    at the training run root. ``progress=False`` turns off the progress bars.
    """
    if task != "text-generation":
        raise ValueError(f"aotlm.pipeline supports task='text-generation', got {task!r}")

    check_names(model_kwargs, AutoModelForSampling.model_arguments(), "pipeline()")
    text.quiet_transformers()
    if model is None:
        model = default_model()
    with progress_mod.quiet(not progress):
        if isinstance(model, Sampler):
            if model_kwargs:
                raise TypeError(f"model is already loaded; {sorted(model_kwargs)} apply to a model path only")
            tok = text.tokenizer_for(model.path, tokenizer)
        else:
            if not isinstance(model, str | os.PathLike):
                raise TypeError(
                    f"model must be a path, a bundled name or an aotlm model, not {type(model).__name__}"
                )
            tok_obj = None if tokenizer is None or isinstance(tokenizer, str | os.PathLike) else tokenizer
            files = validate_checkpoint(
                model, None if tok_obj else tokenizer, require_tokenizer=tok_obj is None
            )
            tok = tok_obj or text.load_tokenizer(files.tokenizer)
            model = AutoModelForSampling.from_pretrained(files.checkpoint, **model_kwargs)
    return TextGenerationPipeline(model, tok, progress)
