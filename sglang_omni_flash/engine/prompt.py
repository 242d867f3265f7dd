"""The decoder prompt (sot, language, task, notimestamps) and language detection.

Multilingual models: `<|startoftranscript|><|lang|><|task|>[<|notimestamps|>]`.
English-only `.en` models: `<|startoftranscript|>[<|notimestamps|>]`.
`<|notimestamps|>` is left out when timestamps are requested.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_omni_flash.errors import UserError


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids and generation defaults of one Whisper checkpoint (from its generation config)."""

    sot: int
    eos: int
    no_timestamps: int
    multilingual: bool
    lang_to_id: dict  # "<|en|>" -> id (empty for .en models)
    task_to_id: dict  # "transcribe" / "translate" -> id
    suppress_tokens: tuple
    begin_suppress_tokens: tuple
    max_initial_timestamp_index: int | None
    max_target_positions: int

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @classmethod
    def from_model(cls, model) -> "SpecialTokens":
        gen = model.generation_config
        cfg = model.config
        eos = gen.eos_token_id if gen.eos_token_id is not None else cfg.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0]
        lang_to_id = dict(getattr(gen, "lang_to_id", None) or {})
        multilingual = getattr(gen, "is_multilingual", None)
        if multilingual is None:
            multilingual = bool(lang_to_id) and cfg.vocab_size >= 51865
        task_to_id = dict(getattr(gen, "task_to_id", None) or {})
        if multilingual and not task_to_id:
            task_to_id = {"translate": gen.no_timestamps_token_id - 5, "transcribe": gen.no_timestamps_token_id - 4}
        return cls(
            sot=int(gen.decoder_start_token_id if gen.decoder_start_token_id is not None else cfg.decoder_start_token_id),
            eos=int(eos),
            no_timestamps=int(gen.no_timestamps_token_id),
            multilingual=bool(multilingual),
            lang_to_id=lang_to_id,
            task_to_id=task_to_id,
            suppress_tokens=tuple(getattr(gen, "suppress_tokens", None) or ()),
            begin_suppress_tokens=tuple(getattr(gen, "begin_suppress_tokens", None) or ()),
            max_initial_timestamp_index=getattr(gen, "max_initial_timestamp_index", 50),
            max_target_positions=int(cfg.max_target_positions),
        )

    def language_token(self, language: str) -> int:
        code = language.strip().lower()
        key = code if code.startswith("<|") else f"<|{code}|>"
        if key not in self.lang_to_id:
            raise UserError(f"unknown language {language!r} (expected a code such as 'en', 'de', 'fr')")
        return int(self.lang_to_id[key])

    def language_code(self, token: int) -> str:
        for key, value in self.lang_to_id.items():
            if value == token:
                return key.strip("<|>")
        return "en"


def build_prompt(special: SpecialTokens, language_token: int | None, task: str, timestamps: bool) -> list[int]:
    """The prompt of one request; `language_token` is ignored for `.en` models."""
    prompt = [special.sot]
    if special.multilingual:
        if language_token is None:
            raise ValueError("a multilingual prompt needs a language token (given or detected)")
        if task not in special.task_to_id:
            raise UserError(f"unknown task {task!r} (expected 'transcribe' or 'translate')")
        prompt += [language_token, int(special.task_to_id[task])]
    if not timestamps:
        prompt.append(special.no_timestamps)
    return prompt


def detect_language(sot_logits: torch.Tensor, special: SpecialTokens) -> list[int]:
    """Language token per row, from the logits [B, V] of one decoder step over <|startoftranscript|>
    (argmax over the language tokens only, as openai whisper's `detect_language`)."""
    lang_ids = torch.tensor(sorted(special.lang_to_id.values()), device=sot_logits.device)
    best = sot_logits.float().index_select(-1, lang_ids).argmax(dim=-1)
    return lang_ids[best].tolist()
