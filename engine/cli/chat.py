"""``aotlm chat``: a conversation in the terminal, through the model's chat template.

Three ways in, one loop:

* ``aotlm chat --model smollm2 "question"``: one-shot, prints the answer and exits;
* ``aotlm chat --model smollm2`` at a terminal: a ``>`` prompt per turn, ``/reset`` forgets the
  conversation (keeps ``--system``), ``/exit`` (or Ctrl-D) leaves;
* piped standard input: every non-empty line is the next user turn of one conversation.

Answers stream as they are generated; a line per answer on stderr gives the tokens, tokens/s and
time to the first token (``--quiet`` drops it). Defaults come from the checkpoint's
``generation_config.json`` as in ``aotlm generate``. Each turn renders the whole conversation with
the template and prefills it again (the engine keeps no KV cache between calls); when the
conversation no longer fits the compiled window, the oldest turns are dropped (the system
prompt stays) and a line says so.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field

from aotlm import progress
from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.cli.common import (
    add_model_args,
    add_sampling_args,
    default_window,
    generation_settings,
    graphs_ready,
    model_kwargs,
    setup_logging,
)
from aotlm.cli.templates import add_template_args, template_variables, use_template
from aotlm.cli.text import needed_graphs, prepare_graph
from aotlm.models.checkpoint.resolve import default_model, validate_checkpoint
from aotlm.serve.chat import render
from aotlm.text import tokens as text
from aotlm.text.pipeline import TextGenerationPipeline

log = logging.getLogger("aotlm")

DEFAULT_MAX_NEW_TOKENS = 512  # per answer, when generation_config.json gives no length
DEFAULT_WINDOW = 2048  # the compiled context: the checkpoint's window, capped here (--n-positions)
COMMANDS = "/reset forgets the conversation, /exit leaves"


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model through its chat template (streamed)")
    p.add_argument("message", nargs="?", default=None, help="one-shot: answer this message and exit")
    p.add_argument(
        "--model",
        default=default_model(),
        help="model name (aotlm models), .gguf file, checkpoint dir or bundled name",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: next to the checkpoint)")
    p.add_argument(
        "--system",
        default=None,
        help="system prompt, kept through /reset ('': an empty one, which drops a template's default)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"per answer (default: generation_config.json, else {DEFAULT_MAX_NEW_TOKENS})",
    )
    add_template_args(p, "variables for the chat template, e.g. '{\"enable_thinking\": false}' (Qwen3)")
    add_sampling_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars, log or speed lines")
    add_model_args(p, checkpoint=False)
    p.set_defaults(fn=cmd_chat)


@dataclass
class Conversation:
    """The messages so far; ``system`` survives :meth:`reset` and trimming."""

    system: str | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        # --system '' is an empty system message (a template then leaves out its default one)
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        return head + self.turns

    def reset(self) -> None:
        self.turns.clear()

    def drop_oldest(self) -> bool:
        """Forget the oldest user turn and its answer; False when only the newest turn is left."""
        if len(self.turns) <= 1:
            return False
        del self.turns[:2]  # a user turn and its answer (the newest turn has none yet)
        return True


class ChatSession:
    """One model, one tokenizer, one conversation: :meth:`answer` runs a turn."""

    def __init__(self, args, files, tok, asked: bool, variables: dict | None = None):
        """``asked``: ``--max-new-tokens`` was given (else the default is capped at half the window);
        ``variables``: the chat template's (``--chat-template-kwargs``)."""
        self.args, self.files, self.tok = args, files, tok
        self.conversation = Conversation(args.system)
        self.variables = variables or {}
        kw = model_kwargs(args)
        kw.setdefault("batch_size", 1)
        if kw.get("n_positions") is None:
            kw["n_positions"] = default_window(str(files.checkpoint), DEFAULT_WINDOW)
        self.model = AutoModelForSampling.from_pretrained(files.checkpoint, **kw)
        self.pipe = TextGenerationPipeline(self.model, tok, progress_bars=not args.quiet)
        self.new = args.max_new_tokens
        if not asked:  # a default (e.g. generation_config's max_length) leaves room for the conversation
            self.new = min(self.new, self.model.n_positions // 2)

    def _prompt(self, new: int) -> tuple[str, bool, int]:
        """``(text, add special tokens, its token count)`` of the rendered conversation, trimmed from
        the oldest turn until prompt + answer fit."""
        while True:
            prompt, add_special = render(self.tok, self.conversation.messages(), (), self.variables)
            n = len(text.encode(self.tok, [prompt], add_special)[0])
            if n + new <= self.model.n_positions:
                return prompt, add_special, n
            if not self.conversation.drop_oldest():
                raise ValueError(
                    f"this message needs {n} prompt tokens + {new} new ones, more than the "
                    f"{self.model.n_positions} positions compiled; shorten it, lower --max-new-tokens "
                    "or raise --n-positions"
                )
            print("aotlm chat: (dropped the oldest turn to fit the context)", file=sys.stderr)

    def _generate(self):
        """Stream the answer to the conversation so far (compiling the graphs it needs first)."""
        prompt, add_special, n = self._prompt(self.new)
        needed = needed_graphs(self.model, [n], self.new, self.args.gen)
        self._compile([k for k in needed if not self.model.is_compiled(k)])
        return self.pipe.generate(
            [prompt],
            max_new_tokens=self.new,
            stop=self.args.stop,
            streamer=text.TextStreamer(self.tok),
            add_special_tokens=add_special,
            **self.args.gen,
        )[0]

    def _compile(self, keys: list[tuple]) -> None:
        """Compile (or load from the cache) the graphs a turn needs, with a bar, then one line."""
        if not keys:
            return
        t0, before = time.perf_counter(), len(self.model.compile_report)
        for key in progress.bar(keys, "compiling buckets", len(keys), "graph"):
            prepare_graph(self.model, key)
        log.info("%s", graphs_ready(self.model, time.perf_counter() - t0, before))

    def answer(self, message: str) -> str:
        """Add the user's message, stream the answer to stdout, remember it; returns its text."""
        self.conversation.turns.append({"role": "user", "content": message})
        try:
            gen = self._generate()
        except Exception:  # a failed turn leaves no unanswered message in the history
            self.conversation.turns.pop()
            raise
        sys.stdout.write("\n")
        sys.stdout.flush()
        self.conversation.turns.append({"role": "assistant", "content": gen.text})
        if not self.args.quiet:
            rate = len(gen.tokens) / gen.seconds if gen.seconds > 0 else 0.0
            first = gen.time_to_first_token or 0.0
            print(
                f"[{len(gen.tokens)} tokens, {rate:.1f} tok/s, first token {first:.2f}s, "
                f"prompt {gen.prompt_tokens} tokens, {gen.finish_reason}]",
                file=sys.stderr,
            )
        return gen.text


def _turns(interactive: bool):
    """User messages: ``>`` prompts at a terminal, else the lines of standard input."""
    if not interactive:
        for line in sys.stdin:
            if line.strip():
                yield line.rstrip("\n")
        return
    print(f"aotlm chat: {COMMANDS}", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if line.strip():
            yield line


def cmd_chat(args) -> int:
    if args.quiet:
        progress.set_enabled(False)
    setup_logging(args.quiet)
    if args.message is not None and not args.message.strip():
        raise ValueError("the message is empty; give some text, or none for an interactive chat")
    variables = template_variables(args.chat_template_kwargs)  # checked before anything loads
    files = validate_checkpoint(args.model, args.tokenizer)
    tok = text.load_tokenizer(files.tokenizer)
    use_template(tok, args.chat_template, variables)
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            f"{args.model} has no chat template (a base model?); for plain text completion use "
            f"aotlm generate --model {args.model} --prompt TEXT"
        )
    asked = args.max_new_tokens is not None
    generation_settings(args, files.checkpoint, [1], DEFAULT_MAX_NEW_TOKENS, tok)
    session = ChatSession(args, files, tok, asked, variables)
    if args.message is not None:
        session.answer(args.message)
        return 0
    try:
        return _loop(session, interactive=sys.stdin.isatty())
    except KeyboardInterrupt:
        print("\naotlm chat: interrupted", file=sys.stderr)
        return 130


def _loop(session: ChatSession, interactive: bool) -> int:
    """Turns until ``/exit`` or the end of input; 2 when a piped turn failed (its error printed)."""
    failed = False
    for message in _turns(interactive):
        command = message.strip().lower()
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            session.conversation.reset()
            print("aotlm chat: (conversation reset)", file=sys.stderr)
            continue
        try:
            session.answer(message)
        except ValueError as e:  # one turn too long: say so and keep the conversation going
            print(f"aotlm chat: error: {e}", file=sys.stderr)
            failed = True
    return 2 if failed and not interactive else 0
