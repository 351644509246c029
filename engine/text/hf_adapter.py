"""``HuggingFaceGenerationModelAdapter``: transformers' ``generate()`` on aotlm's compiled graphs.

Code written for ``model.generate(input_ids=..., attention_mask=..., **kwargs)`` keeps
working: the adapter reads HF's generation arguments (a ``GenerationConfig`` and/or keyword
arguments, with HF's defaults taken from the model config), takes and returns torch tensors,
and routes greedy search, sampling, beam search and ``num_return_sequences`` to aotlm's
in-graph implementations: no per-token host loop (transformers-neuronx's adapter called the
device once per token through HF's loop).

``assistant_model`` (an aotlm model with the same tokenizer and batch size) is transformers' assisted
generation as aotlm's speculative decoding, its rounds in the graph: ``num_assistant_tokens`` proposals
a round, or the target's compiled ``speculation_length`` when it was built for others (the output is
plain decoding's either way); ``prompt_lookup_num_tokens`` (with ``max_matching_ngram_size``) takes the
proposals from the sequence's own earlier n-grams instead (``aotlm.generate.lookup``). ``stop_strings``
(with ``tokenizer=``, as transformers asks) and ``max_time`` end rows through transformers' own
``StopStringCriteria`` / ``MaxTimeCriteria``, checked after each token like any ``stopping_criteria``
(the decode loop then runs one token per call).

Batch rule: the transformers-neuronx guide asks for a compiled batch of ``runtime batch x
num_return_sequences x num_beams`` rows. That product is always enough here; the exact need is
``runtime batch x num_beams`` for beam search (the returned sequences are beams, so
``num_return_sequences <= num_beams`` costs nothing extra) and ``runtime batch x
num_return_sequences`` otherwise. A smaller compiled batch is a ``ValueError`` naming the
numbers, before any device work.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np

from aotlm.core import sampler_params
from aotlm.generate import bans
from aotlm.text.call_args import integer

_NO_OPS = {  # transformers' generation arguments with their no-op values
    "num_beam_groups": (1, None),
    "penalty_alpha": (None,),
    "constraints": (None,),
    "force_words_ids": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "diversity_penalty": (0.0, None),
    "encoder_repetition_penalty": (1.0, None),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0),
    "low_memory": (None, False),
    # what would change the output, or its promises, if dropped: refused, never ignored
    "token_healing": (None, False),
    "watermarking_config": (None,),
    "dola_layers": (None,),
}
# the arguments aotlm does not implement (not in the sampler's table): only their no-op values pass
_ALLOWED_DEFAULTS = {k: v for k, v in _NO_OPS.items() if k not in sampler_params.BY_HF}
# the sampler's per-row settings the adapter passes on when sampling
_SAMPLING = tuple(p.hf for p in sampler_params.ROW if p.hf and p.name not in ("do_sample", "seed"))
# what the adapter applies (the rest of transformers' GenerationConfig must keep its default)
SUPPORTED = (
    "max_length",
    "max_new_tokens",
    "min_length",
    "min_new_tokens",
    "do_sample",
    *_SAMPLING,
    "num_beams",
    "num_return_sequences",
    "length_penalty",
    "early_stopping",
    "eos_token_id",
    "pad_token_id",
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
    "seed",
    "streamer",
    "stopping_criteria",
    "stop_strings",
    "tokenizer",
    "max_time",
    "assistant_model",
    "num_assistant_tokens",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    *bans.FIELDS,
)


class HuggingFaceGenerationModelAdapter:
    """``HuggingFaceGenerationModelAdapter(config, model)``: ``generate()`` with HF's signature."""

    def __init__(self, config, model):
        import transformers  # local: slow to import (~1-2 s): kept out of `import aotlm` until text is needed

        self.config = config
        self.model = model
        # as transformers' from_pretrained: the checkpoint's generation_config.json, else the model config
        path = getattr(model, "path", None)
        if path is not None and (Path(path) / "generation_config.json").is_file():
            self.generation_config = transformers.GenerationConfig.from_pretrained(path)
        else:
            self.generation_config = transformers.GenerationConfig.from_model_config(config)
        self.main_input_name = "input_ids"

    def reset_generation(self) -> None:
        """transformers-neuronx resets its KV-cache position between ``generate()`` calls; aotlm
        keeps no state across calls (each call encodes its prompt from slot 0), so there is
        nothing to reset. Kept so that code written for transformers-neuronx runs unchanged."""

    @property
    def device(self):
        import torch  # local: optional (HF interop / .bin checkpoints): kept out of `import aotlm`

        return torch.device("cpu")

    def _config(self, generation_config, kwargs: dict):
        cfg = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        unknown = {k: v for k, v in kwargs.items() if not hasattr(cfg, k)}
        if unknown:
            raise TypeError(
                f"generate() got unsupported arguments {sorted(unknown)}; supported: {', '.join(SUPPORTED)}"
            )
        for k, v in kwargs.items():
            setattr(cfg, k, v)
        defaults = getattr(type(cfg), "_get_default_generation_params", lambda: {})()
        for k, v in defaults.items():  # transformers 5 leaves unset fields None until generate()
            if getattr(cfg, k, None) is None:
                setattr(cfg, k, v)
        for name, ok in _ALLOWED_DEFAULTS.items():
            if getattr(cfg, name, None) not in ok:
                raise ValueError(
                    f"{name}={getattr(cfg, name)!r} is not supported by aotlm's generate adapter; "
                    f"supported: {', '.join(SUPPORTED)}"
                )
        return cfg

    def generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs) -> Any:
        """transformers ``generate`` for decoder-only models: torch tensors in, torch tensors out."""
        import torch  # local: optional (HF interop / .bin checkpoints): kept out of `import aotlm`

        seed = kwargs.pop("seed", None)
        tokenizer = kwargs.pop("tokenizer", None)
        assistant = _assistant(kwargs.pop("assistant_model", None))
        listeners = {k: kwargs.pop(k, None) for k in ("streamer", "stopping_criteria")}
        if kwargs.pop("logits_processor", None):
            raise ValueError(
                "logits_processor is not supported (aotlm's processors run in the graph); "
                f"supported: {', '.join(SUPPORTED)}"
            )
        cfg = self._config(generation_config, kwargs)
        listeners["stopping_criteria"] = _with_own_criteria(listeners["stopping_criteria"], cfg, tokenizer)
        ids, mask, eos_list, pad = _prompts(input_ids, attention_mask, cfg)
        n, plen = ids.shape
        nb, nrs = int(cfg.num_beams or 1), int(cfg.num_return_sequences or 1)
        self._check_rows(n, nb, nrs)
        _check_outputs(cfg, nb)
        name = "max_new_tokens" if cfg.max_new_tokens is not None else "max_length"
        count = integer(getattr(cfg, name), f"{name} must be an int, got {getattr(cfg, name)!r}")
        new = count if name == "max_new_tokens" else count - plen
        if new < 1:
            raise ValueError(f"max_length={cfg.max_length} leaves no room after the {plen}-token prompt")
        call: dict = dict(
            max_new_tokens=new, attention_mask=mask, eos_token_id=eos_list or None, pad_token_id=pad
        )
        for name in ("min_new_tokens", "min_length"):
            if getattr(cfg, name, None):
                call[name] = int(getattr(cfg, name))
        call.update({k: getattr(cfg, k) for k in bans.FIELDS if getattr(cfg, k, None) is not None})
        call.update(self._assisted(cfg, assistant, nb))
        if nb > 1:
            beams = self._beam_search(ids, cfg, call, listeners, nb, nrs)
            out = beams.sequences
        else:
            beams = None
            steps = _step_outputs(cfg)
            call.update(steps)
            out = self._sample(ids, cfg, call, listeners, nrs, seed)
        sequences = torch.from_numpy(np.ascontiguousarray(getattr(out, "sequences", out)).astype(np.int64))
        if not cfg.return_dict_in_generate:
            return sequences
        # local: slow to import (~1-2 s): kept out of `import aotlm` until text is needed
        from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

        if beams is not None:
            scores = torch.from_numpy(np.array(beams.sequences_scores)) if cfg.output_scores else None
            return GenerateBeamDecoderOnlyOutput(sequences=sequences, sequences_scores=scores)
        tensors = lambda xs: None if xs is None else tuple(torch.from_numpy(x) for x in xs)  # noqa: E731
        if not steps:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return GenerateDecoderOnlyOutput(
            sequences=sequences, scores=tensors(out.scores), logits=tensors(out.logits)
        )

    def _assisted(self, cfg, assistant, nb: int) -> dict:
        """transformers' assisted generation as aotlm's speculative rounds: ``assistant_model`` (a
        draft) or ``prompt_lookup_num_tokens`` (proposals from the sequence's own n-grams)."""
        lookup = getattr(cfg, "prompt_lookup_num_tokens", None)
        if assistant is None and lookup is None:
            return {}
        if nb > 1:
            what = "assistant_model" if assistant is not None else "prompt_lookup_num_tokens"
            raise ValueError(f"{what} runs with greedy search or sampling, not beams (as transformers)")
        if lookup is not None:
            if assistant is not None:
                raise ValueError("give assistant_model or prompt_lookup_num_tokens, not both")
            return dict(prompt_lookup_num_tokens=lookup, max_matching_ngram_size=cfg.max_matching_ngram_size)
        k, built = int(cfg.num_assistant_tokens or 20), self.model.strategies.speculation_length
        return dict(draft_model=assistant, speculation_length=built[0] if built and k not in built else k)

    def _check_rows(self, n: int, nb: int, nrs: int) -> None:
        rows = n * nb if nb > 1 else n * nrs
        if rows > self.model.batch_size:
            what = f"num_beams {nb}" if nb > 1 else f"num_return_sequences {nrs}"
            raise ValueError(
                f"runtime batch {n} x {what} = {rows} rows exceed the compiled batch_size="
                f"{self.model.batch_size} (compiled batch = runtime batch x num_return_sequences x num_beams "
                "is always enough); load the model with a larger batch_size"
            )

    def _beam_search(self, ids: np.ndarray, cfg, call: dict, listeners: dict, nb: int, nrs: int):
        if any(v is not None for v in listeners.values()):
            raise ValueError(
                "streamer / stopping_criteria / stop_strings / max_time run with greedy search or sampling, "
                "not beams"
            )
        for name, off in (("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0)):
            if (getattr(cfg, name, None) or off) != off:  # transformers would apply it: never drop it
                raise ValueError(
                    f"{name}={getattr(cfg, name)} (from the arguments or generation_config.json) is not "
                    f"supported with num_beams > 1; pass {name}={off}"
                )
        if cfg.do_sample:
            raise ValueError("beam sampling (num_beams > 1 with do_sample=True) is not supported")
        return self.model.sample(
            ids,
            num_beams=nb,
            num_return_sequences=nrs,
            length_penalty=float(cfg.length_penalty),
            early_stopping=cfg.early_stopping,
            return_dict=True,
            **call,
        )

    def _sample(self, ids: np.ndarray, cfg, call: dict, listeners: dict, nrs: int, seed) -> np.ndarray:
        if cfg.do_sample:
            base = self._seed(seed)  # prompt i's rows get seeds base + i*nrs + j: all rows differ
            call.update(do_sample=True, seed=[base + i * nrs for i in range(ids.shape[0])])
            for name in _SAMPLING:
                value = getattr(cfg, name, None)
                if value is not None:
                    call[name] = value
        elif (cfg.repetition_penalty or 1.0) != 1.0 or (cfg.no_repeat_ngram_size or 0) > 0:
            call.update(
                repetition_penalty=cfg.repetition_penalty, no_repeat_ngram_size=cfg.no_repeat_ngram_size
            )
        if nrs > 1:
            call["num_return_sequences"] = nrs
        call.update({k: v for k, v in listeners.items() if v is not None})
        return self.model.sample(ids, **call)

    @staticmethod
    def _seed(seed) -> int:
        """An explicit ``seed``, else one drawn from torch's generator (``torch.manual_seed`` reproduces)."""
        if seed is not None:
            return seed
        import torch  # local: optional (HF interop / .bin checkpoints): kept out of `import aotlm`

        return int(torch.randint(0, 2**31 - 1, (1,)).item())

    def __call__(self, *args, **kwargs):
        raise TypeError("the adapter only generates; use model.forward() for logits")


def _prompts(input_ids, attention_mask, cfg) -> tuple[np.ndarray, np.ndarray, list[int], int | None]:
    """``(ids [n, L], mask [n, L], eos ids, pad id)`` from torch or numpy inputs, as generate reads them."""
    if input_ids is None:
        raise ValueError("generate() needs input_ids")
    ids = input_ids.detach().cpu().numpy() if hasattr(input_ids, "detach") else np.asarray(input_ids)
    ids = ids.astype(np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    eos = cfg.eos_token_id
    eos_list = [] if eos is None else [int(e) for e in np.atleast_1d(eos)]
    pad = cfg.pad_token_id
    if pad is None and eos_list:
        pad = eos_list[0]  # as generate does (it warns)
    if isinstance(pad, list | tuple):
        pad = pad[0]
    if attention_mask is None:  # HF infers the mask from pad tokens when pad != eos
        infer = pad is not None and (ids == pad).any() and pad not in eos_list
        mask = (ids != pad).astype(np.int64) if infer else np.ones_like(ids)
    else:
        mask = attention_mask.detach().cpu().numpy() if hasattr(attention_mask, "detach") else attention_mask
        mask = np.asarray(mask, np.int64)
    return ids, mask, eos_list, pad


def _assistant(model):
    """The aotlm model behind ``assistant_model`` (an aotlm model or its adapter), or None."""
    if model is None:
        return None
    model = model.model if isinstance(model, HuggingFaceGenerationModelAdapter) else model
    if not callable(getattr(model, "sample", None)) or getattr(model, "strategies", None) is None:
        raise TypeError(
            f"assistant_model must be an aotlm model (AutoModelForSampling or its "
            f"HuggingFaceGenerationModelAdapter) with the target's tokenizer and batch_size, got "
            f"{type(model).__name__}: a torch model cannot run in aotlm's graphs"
        )
    return model


def _with_own_criteria(criteria, cfg, tokenizer):
    """``criteria`` plus the ones transformers' ``generate`` makes itself: ``MaxTimeCriteria`` for
    ``cfg.max_time`` (counted from this call) and ``StopStringCriteria`` for ``cfg.stop_strings`` (a
    row ends at the token that completes one, however the tokens spell it; needs the tokenizer)."""
    # local: slow to import (~1-2 s): kept out of `import aotlm` until text is needed
    from transformers.generation.stopping_criteria import MaxTimeCriteria, StopStringCriteria

    own = []
    if getattr(cfg, "max_time", None) is not None:
        own.append(MaxTimeCriteria(max_time=cfg.max_time))
    stops = getattr(cfg, "stop_strings", None)
    if stops:
        if tokenizer is None:
            raise ValueError(
                f"stop_strings={stops!r} need the model's tokenizer: pass "
                "generate(..., tokenizer=tokenizer), as transformers asks"
            )
        own.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stops))
    if not own:
        return criteria
    if criteria is None:
        return own
    return [*(criteria if isinstance(criteria, list | tuple) else [criteria]), *own]


_OUTPUTS = ("output_attentions", "output_hidden_states")


def _check_outputs(cfg, nb: int) -> None:
    """What a ``return_dict_in_generate`` output would hold that the graphs do not return."""
    if not cfg.return_dict_in_generate:
        return  # transformers ignores the output_* flags then
    extras = [k for k in _OUTPUTS if getattr(cfg, k, None)]
    if extras:
        raise ValueError(
            f"{extras[0]}=True is not supported by aotlm's generate adapter (the graphs return tokens, "
            "scores and logits only); pass return_dict_in_generate=False or drop it"
        )
    if cfg.output_logits and nb > 1:
        raise ValueError("output_logits runs with greedy search or sampling, not beams; drop it")


def _step_outputs(cfg) -> dict:
    """``sample()``'s keywords for transformers' per-step ``scores`` / ``logits`` (greedy or sampled)."""
    if not cfg.return_dict_in_generate or not (cfg.output_scores or cfg.output_logits):
        return {}
    return dict(
        return_dict=True, output_scores=bool(cfg.output_scores), output_logits=bool(cfg.output_logits)
    )
