"""Text in and out: encoding, chat templates (jinja2), streaming detokenization, stop strings."""

from __future__ import annotations

from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from specdec.models.errors import GenerationError
from specdec.models.manifest import TokenizerSpec


class TextCodec:
    """The artifact's tokenizer, loaded with the `tokenizers` library (no transformers)."""

    def __init__(self, artifact_dir: str | Path, spec: TokenizerSpec):
        self.spec = spec
        self.tokenizer = Tokenizer.from_file(str(Path(artifact_dir) / spec.tokenizer_json))
        self._template = None
        if spec.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(spec.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Return the token ids of `text`."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        """Return the text of `token_ids`, special tokens left out."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        """Return whether the tokenizer carries a chat template (else only plain prompts can be encoded)."""
        return self._template is not None

    @property
    def knows_tools(self) -> bool:
        """Return whether the chat template renders `tools` (and tool calls) itself."""
        return self.spec.chat_template is not None and "tools" in self.spec.chat_template

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Return the prompt text for chat `messages` (and `tools`, for a template that renders them), ending where
        the assistant's reply starts."""
        if self._template is None:
            raise GenerationError("this artifact's tokenizer has no chat template; drop --chat")
        special = {}
        for name, token_id in (("bos_token", self.spec.bos_token_id),
                               ("eos_token", (self.spec.eos_token_ids or [None])[0])):
            special[name] = self.tokenizer.id_to_token(token_id) if token_id is not None else ""
        return self._template.render(messages=messages, add_generation_prompt=True, **special,
                                     **({"tools": tools} if tools else {}))

    def decode_stream(self) -> "StreamingDecoder":
        """Return a fresh incremental decoder for one generation."""
        return StreamingDecoder(self.tokenizer)


def _raise_template_error(message: str) -> None:
    raise GenerationError(f"chat template error: {message}")


class StreamingDecoder:
    """Turns committed token ids into text pieces, correct across multi-byte characters.

    Uses `tokenizers`' DecodeStream, which holds back bytes until they form whole characters.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Return the new text that `token_id` completes ('' if it completes none yet)."""
        return self._stream.step(self._tokenizer, int(token_id)) or ""


class StopStringFilter:
    """Releases streamed text, holding back any tail that could still grow into a stop string."""

    def __init__(self, stop_strings: tuple[str, ...]):
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.text = ""  # everything received
        self.released = 0  # how much of `text` has been handed out
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add a piece; return the text now safe to show (nothing after a stop string)."""
        if self.stopped:
            return ""
        self.text += piece
        hits = [i for i in (self.text.find(s) for s in self.stop_strings) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(min(hits))
        hold = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:size]):
                    hold = max(hold, size)
                    break
        return self._release(len(self.text) - hold)

    def flush(self) -> str:
        """Return the held-back text at the end of a generation that hit no stop string."""
        return "" if self.stopped else self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        piece = self.text[self.released:upto]
        self.released = upto
        return piece

    @property
    def final_text(self) -> str:
        """Return the output text: up to the first stop string, or everything."""
        return self.text[: self.released] if self.stopped else self.text


def tokens_released(text_ends: list[int | None], released: int, start: int = 0) -> int:
    """Return how many leading tokens the first `released` characters of a stream's text hold whole, counting on
    from `start` (a count already known): up to the last token whose text ends within them. `text_ends[i]` is
    where token i's text ends, None while it has none of its own (half a character: it goes with the token that
    completes it). Example: ends [3, None, 5, 9] with 6 released -> 3; with 4 released -> 1."""
    count = start
    for index in range(start, len(text_ends)):
        end = text_ends[index]
        if end is None:
            continue
        if end > released:
            break
        count = index + 1
    return count
