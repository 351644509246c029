"""``Sampler``: ``sample()`` for any model that can run a request on its devices.

Both ``CausalLMForSampling`` (one compiled program per bucket, ``generation.run``) and
``PipelineForSampling`` (stages chained by the host, ``pp_run.run``) subclass it honestly: the
request's checks, its generation settings and token budgets are here, once; each subclass
only says how the request runs (``_run``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from aotlm.core import graphs, inputs, sampling
from aotlm.core.model import locked
from aotlm.core.spec import SpecAttributes
from aotlm.generate import bans, generation, params, sequence_bias, stopping

# what a transformers (torch) user reaches for on a model, and where it is here
_TORCH_HABITS = {
    "generate": "sample(input_ids, max_new_tokens=N, ...) takes transformers' generation parameters (numpy "
    "out); for transformers' generate() itself (torch tensors, generation_config.json defaults) wrap the "
    "model: aotlm.HuggingFaceGenerationModelAdapter(hf_config, model)",
    "to": "its devices are JAX's, fixed when it is loaded (tp_degree=, pp_degree=): there is nothing to move",
    "cuda": "its devices are JAX's, fixed when it is loaded (a GPU jaxlib puts it on the GPU)",
    "eval": "it only runs inference: there is no training mode to leave",
    "half": "its dtypes are chosen when it is loaded: from_pretrained(..., amp='f16' or 'bf16')",
}


class Sampler(SpecAttributes):
    """Generation over a model's ``spec``; a subclass sets ``spec``, ``lock`` and
    ``default_generation`` and implements ``_run``."""

    def __getattr__(self, name: str):
        """Only for names not found: a torch habit (``generate``, ``to``, ``eval``...) says where it is."""
        hint = _TORCH_HABITS.get(name)
        if hint is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(f"{type(self).__name__} has no {name}(): {hint}")

    lock: threading.RLock
    default_generation: params.GenerationConfig

    @locked
    def sample(
        self,
        input_ids,
        max_new_tokens: int | Sequence[int] | None = None,
        sequence_length: int | None = None,
        attention_mask=None,
        start_ids=None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        *,
        generation_config: params.GenerationConfig | None = None,
        streamer=None,
        stopping_criteria=None,
        stopping_criteria_list=None,
        return_dict: bool = False,
        output_scores: bool = False,
        output_logits: bool = False,
        constraints=None,
        adapter=None,
        **generation_kwargs,
    ) -> np.ndarray | generation.GenerateOutput:
        """Generate: ``[batch, prompt_len + new]`` (prompt as given, then new tokens), or a
        ``GenerateOutput`` with ``return_dict=True``.

        Greedy by default. ``generation_kwargs`` are ``GenerationConfig`` fields with HF names (the
        sampling settings of ``aotlm.core.sampler_params.TABLE``: ``do_sample``, ``temperature``,
        ``top_k``, ``top_p``, ``repetition_penalty``, ``seed``, ...; ``stop_sequences``,
        ``top_logprobs``); each sampling
        value and ``max_new_tokens`` may be one value or one per row. They override
        ``generation_config``, which defaults to the model's (``NeuronConfig(on_device_generation=
        ...)``, else greedy). ``sequence_length`` (total length, transformers-neuronx style),
        ``max_new_tokens`` or the config's ``max_length`` bound the output; none means "up to
        n_positions". ``min_new_tokens`` / ``min_length`` hold eos back until reached. A row stops
        at an eos id, at a stop sequence (kept in the output) or at its length; finished rows
        are filled with ``pad_token_id`` (default: the first eos id) and the output is trimmed
        to the longest row, as transformers does. ``streamer`` (HF ``BaseStreamer``: ``put``
        gets the prompt, then each new token as it is produced: one ``[batch]`` array per step) and
        ``stopping_criteria`` (HF ``StoppingCriteria``, or ``stopping_criteria_list`` as
        transformers-neuronx calls it; checked after every token) make the decode loop run one
        token per call (``generation.STREAM_CHUNK``). ``constraints`` (structured outputs): one
        ``aotlm.generate.constraints.Matcher`` or None per prompt (``Grammars.matcher``; the text
        pipeline's ``json_schema=`` builds them); those rows follow their grammars, one token
        per call. ``adapter``: a LoRA adapter's name (or None) for all, or one per prompt (``load_adapter``).
        ``output_scores`` / ``output_logits`` (with ``return_dict``): each step's ``[batch, vocab]``
        processed scores / logits in ``GenerateOutput.scores`` / ``.logits``, as transformers' generate
        gives them (the loop then runs one token per call and reads them after each).
        """
        cfg = _base_config(generation_config, generation_kwargs) or self.default_generation
        if stopping_criteria is not None and stopping_criteria_list is not None:
            raise ValueError("give stopping_criteria or stopping_criteria_list, not both")
        given = dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id, max_new_tokens=max_new_tokens)
        cfg = cfg.replace(**{k: v for k, v in given.items() if v is not None}, **generation_kwargs)
        if not isinstance(cfg.top_logprobs, int) or not 0 <= cfg.top_logprobs <= sampling.TOP_LOGPROBS_MAX:
            raise ValueError(f"top_logprobs must be an int in [0, {sampling.TOP_LOGPROBS_MAX}]")
        generation.check_streamer(streamer)
        inputs.eos_ids(cfg.eos_token_id, graphs.MAX_EOS), inputs.count(cfg.pad_token_id, "pad_token_id")
        criteria = stopping.criteria_list(
            stopping_criteria if stopping_criteria is not None else stopping_criteria_list
        )
        ids, mask, n = self.prepare(input_ids, attention_mask, start_ids)
        if sequence_length is None and cfg.max_new_tokens is None and cfg.max_length is not None:
            sequence_length = cfg.max_length
        new = self.token_budget(ids.shape[1], n, cfg.max_new_tokens, sequence_length)
        cfg = cfg.replace(max_new_tokens=None, max_length=None)
        self._validate(cfg, ids, mask, n)
        want = bool(return_dict or cfg.top_logprobs)
        kw = {} if adapter is None else {"lora": self.adapter_rows(adapter, n)}  # each row's adapter slot
        if output_scores or output_logits:
            kw["scores"] = self._step_scores(return_dict)
        if constraints is not None:
            kw["matchers"] = self._matchers(constraints, n)
        out = self._run(ids, mask, n, new, cfg, streamer, criteria, want, **kw)
        return _outputs(out, output_scores, output_logits)

    def _matchers(self, constraints, n: int) -> dict:
        """``{row: Matcher}`` of the constrained rows (one entry or None per prompt), checked."""
        if not getattr(self, "constrained_decoding", False):
            raise ValueError(
                f"constraints are not supported by {type(self).__name__}; use CausalLMForSampling"
            )
        if len(constraints) != n:
            raise ValueError(f"constraints: {len(constraints)} entries for {n} prompts; give one per prompt")
        return {i: m for i, m in enumerate(constraints) if m is not None}

    def _validate(self, cfg: params.GenerationConfig, ids, mask, n: int) -> None:
        """The settings checked before any device work: sampling values, stop sequences, bans."""
        generation.sampling_params(cfg, n, self.batch_size)
        generation.stop_array(cfg.stop_sequences, n, self.batch_size, self.cfg.vocab_size)
        if any(getattr(cfg, f) is not None for f in bans.FIELDS):
            if not getattr(self, "constrained_decoding", False):
                raise ValueError(f"{', '.join(bans.FIELDS)}: not supported by {type(self).__name__}")
            bans.build(cfg, ids, mask, self.cfg.vocab_size, inputs.eos_ids(cfg.eos_token_id, graphs.MAX_EOS))
            sequence_bias.build(cfg, ids, mask, self.cfg.vocab_size, sampling.MAX_LOGIT_BIAS)

    def _step_scores(self, return_dict: bool) -> bool:
        """``output_scores`` / ``output_logits`` checked: they come in a ``GenerateOutput``, from
        the decode loop of one compiled program (``step_scores``)."""
        if not return_dict:
            raise ValueError(
                "output_scores / output_logits come in the GenerateOutput: pass return_dict=True"
            )
        if not getattr(self, "step_scores", False):
            raise ValueError(
                f"output_scores / output_logits are not supported by {type(self).__name__}; "
                "use a model with pp_degree=1"
            )
        return True

    def _run(
        self,
        ids: np.ndarray,
        mask: np.ndarray,
        n: int,
        new: np.ndarray,
        cfg: params.GenerationConfig,
        streamer,
        criteria: list,
        want_dict: bool,
    ) -> np.ndarray | generation.GenerateOutput:
        """The request on the device: the subclass's decode loop."""
        raise NotImplementedError

    def adapter_rows(self, adapter, n: int) -> np.ndarray | None:
        """Each row's LoRA adapter slot for ``sample(adapter=...)``, or None (a subclass with
        adapter slots says; without them a named adapter is refused)."""
        if adapter is not None:
            raise ValueError(f"{type(self).__name__} has no LoRA adapter slots; sample() without adapter=")
        return None

    def prepare(self, input_ids, attention_mask, start_ids) -> tuple[np.ndarray, np.ndarray, int]:
        """Checked prompts padded to ``batch_size`` rows: ``(ids, mask, real rows)``."""
        return inputs.padded_batch(input_ids, attention_mask, start_ids, self.cfg.vocab_size, self.batch_size)

    def token_budget(self, p_len: int, n: int, max_new_tokens, sequence_length: int | None) -> np.ndarray:
        """Per-row new-token budgets ``[n]`` (one value may serve every row)."""
        if max_new_tokens is not None and sequence_length is not None:
            raise ValueError("give max_new_tokens or sequence_length, not both")
        if sequence_length is not None:
            max_new_tokens = inputs.count(sequence_length, "sequence_length") - p_len
        if max_new_tokens is None:
            max_new_tokens = self.n_positions - p_len
        new = generation.per_row(max_new_tokens, "max_new_tokens", n, np.int64)
        if (new < 1).any():
            raise ValueError(f"max_new_tokens must be >= 1 (prompt has {p_len} tokens), got {new.min()}")
        top = int(new.max())
        if p_len + top > self.n_positions:
            raise ValueError(
                f"prompt ({p_len} tokens) + max_new_tokens ({top}) = {p_len + top} "
                f"exceeds n_positions={self.n_positions}; shorten the request or load the model with "
                f"n_positions >= {p_len + top}"
            )
        return new.astype(np.int32)


def _outputs(out, output_scores: bool, output_logits: bool):
    """Only the per-step arrays asked for (transformers returns ``scores`` / ``logits`` apart)."""
    if isinstance(out, generation.GenerateOutput):
        out.scores = out.scores if output_scores else None
        out.logits = out.logits if output_logits else None
    return out


def _base_config(generation_config, generation_kwargs: dict) -> params.GenerationConfig | None:
    """``generation_config`` checked to be aotlm's (transformers' has other fields and semantics), and
    the keywords checked to be its fields."""
    if generation_config is not None and not isinstance(generation_config, params.GenerationConfig):
        kind = type(generation_config)
        raise TypeError(
            f"generation_config must be an aotlm.GenerationConfig, got {kind.__module__}.{kind.__name__}; "
            "pass its fields as keywords, or transformers' GenerationConfig to "
            "HuggingFaceGenerationModelAdapter.generate()"
        )
    unknown = set(generation_kwargs) - params.FIELDS
    if unknown:
        raise TypeError(
            f"sample() got unknown generation arguments {sorted(unknown)}; known: {sorted(params.FIELDS)}"
        )
    return generation_config
