"""Streaming deltas when one decode step emits several tokens.

sglang-omni's ``ExactWhisperStreamOutputBuilder`` turns the one sampled token of a step into a
text delta. A Whisper-Flash step emits the accepted candidates and then the target's token;
the runner records them per request (``WhisperFlashModelRunner.step_tokens``) and this builder
feeds them to the stock builder one by one, so the deltas still concatenate to the final text.
"""

from __future__ import annotations

from sglang_omni.models.whisper_asr.text_streaming import ExactWhisperStreamOutputBuilder
from sglang_omni.scheduling.types import RequestOutput


class MultiTokenStreamOutputBuilder(ExactWhisperStreamOutputBuilder):
    def __init__(self, tokenizer, interval_seconds: float, step_tokens: dict[str, list[int]]):
        super().__init__(tokenizer, interval_seconds)
        self.step_tokens = step_tokens  # shared with the runner: rid -> [accepted..., next token]

    def __call__(self, request_id, request_data, request_output):
        tokens = self.step_tokens.pop(request_id, None)
        if not tokens or len(tokens) == 1 or request_output.data is None:
            return super().__call__(request_id, request_data, request_output)
        messages = []
        for token in tokens[:-1]:
            messages += super().__call__(request_id, request_data, RequestOutput(request_id=request_id, data=token))
        return messages + super().__call__(request_id, request_data, request_output)
