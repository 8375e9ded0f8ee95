"""litgpt's Tokenizer, with a text stream in whole characters.

Byte-level BPE tokenizers (SmolLM2's, Llama 3's, GPT-2's) spread a rare character's UTF-8 bytes over several
tokens: an emoji, most CJK characters. litgpt's `decode_stream` decodes each token alone, so every part of such a
character comes out as U+FFFD: SmolLM2 streams "日本語" as "���本���" in chat and in `serve --stream`. Here a
token whose text ends inside a character is held back until the character is whole.
"""
from typing import Iterable, Iterator, List, Optional

import torch
from litgpt.tokenizer import Tokenizer as LitgptTokenizer

REPLACEMENT_CHARACTER = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character
MOST_TOKENS_HELD = 4  # a character has at most 4 UTF-8 bytes and a token at least one: past this, the bytes are bad


class Tokenizer(LitgptTokenizer):
    def decode_stream(self, token_stream: Iterable[torch.Tensor],
                      device: Optional[torch.device] = None) -> Iterator[str]:
        """The text of `token_stream`, one string a token as litgpt's (its chat counts them as tokens): the new text
        once it ends in a whole character, else "". Ctrl-C ends the stream, as in litgpt.

        Each new piece is decoded after the piece before it and cut off its text, so a tokenizer that drops a
        leading space when it decodes a token alone (SentencePiece-style ones) keeps that space. The text streamed is
        the whole answer's decoded text."""
        if self.backend != "huggingface":  # litgpt decodes sentencepiece's whole text at every token already
            yield from super().decode_stream(token_stream, device)
            return
        previous: List[int] = []  # the tokens of the last piece given, which ends in a whole character
        held: List[int] = []
        try:
            for token in token_stream:
                held += token.view(-1).tolist()
                text = self.processor.decode(previous + held) if previous else self.decode(torch.tensor(held))
                if text.endswith(REPLACEMENT_CHARACTER) and len(held) < MOST_TOKENS_HELD:
                    yield ""
                    continue
                before = self.processor.decode(previous) if previous else ""
                yield text[len(before):] if text.startswith(before) else self.decode(torch.tensor(held))
                previous, held = held, []
        except KeyboardInterrupt:
            return
        if held:  # the stream ended inside a character
            yield self.decode(torch.tensor(held))
