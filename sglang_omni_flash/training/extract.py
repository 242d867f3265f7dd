"""Teacher extraction: the frozen target's own greedy transcripts and its history states, on disk.

For every clip: the target's greedy continuation with the engine's prompt and logit rules, and from
ONE teacher-forced pass over prompt + continuation the residual stream after the history blocks and the
target's top-k next-token log-probabilities at every position (soft labels for a tree-aware loss).
The encoder output E(x) (what the drafter's acoustic attention reads) is 1500 x d per clip, the largest
thing by far and cheap to recompute, so it is stored only with `store_encoder` (clips without an audio
file, e.g. a `datasets` folder, need it); otherwise each record keeps its audio path and training runs
the encoder again, at the extraction's dtype.

The greedy continuation is computed exactly but cheaply: the engine's speculative loop runs with a
`ReferenceLookupProposer` that proposes the clip's reference text (re-synchronised on the last emitted
tokens); the target verifies every guess, so the tokens are the target's greedy output token for token,
and most clips take a handful of target calls instead of one per token.

Layout of the output folder (fp16 tensors, safetensors):

    teacher.json             what was extracted with what; the list of finished shards
    shard-00000.safetensors  history [sum L, n_hist, d], tokens [sum L] int32, offsets [U + 1] int64
                             (utterance u owns rows offsets[u]:offsets[u+1]), prompt_len [U] int32,
                             top_ids [sum L, k] int32 and top_logprob [sum L, k] (row p: the target's
                             distribution of the token at p + 1), encoder [U, T_enc, d] if stored
    shard-00000.json         per utterance: id, speaker, duration, audio path, reference and greedy text

Shard k always holds clips [k * shard_size, (k + 1) * shard_size) of the input list minus the excluded
ones (no EOS within the token budget, or fewer than two generated tokens), so an interrupted run
resumes at the first unfinished shard and reaches the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_omni_flash.engine.proposers import OracleProposer
from sglang_omni_flash.errors import UserError
from sglang_omni_flash.training.sources import Clip

INDEX = "teacher.json"
FORMAT_VERSION = 2


@dataclass(frozen=True)
class ExtractOptions:
    model: str = "base"  # embedded name or transformers Whisper directory
    history_layers: tuple[int, ...] | None = None  # None: default_history_layers(target depth)
    shard_size: int = 64  # clips per shard (before exclusions)
    batch_size: int = 8  # clips decoded together
    lookup_block: int = 12  # candidates per round of the reference-lookup proposer
    language: str | None = None  # as the engine: None = detect per clip (multilingual models)
    threads: int | None = None
    dtype: str = "auto"  # the engine's rule (hardware.choose_dtype): bfloat16 on a CPU with AMX-BF16 or AVX512-BF16, else float32
    store_encoder: bool = False  # False: training recomputes E(x) from the audio file (1.5 MB per clip saved, base)
    teacher_top: int = 8  # k of the stored top-k next-token log-probabilities (0: none)
    # decode with Whisper's timestamp tokens (no <|notimestamps|>, timestamp rules on): the continuations a
    # drafter must predict for srt / vtt / verbose_json requests
    timestamps: bool = False


# ------------------------------------------------------------------------------ proposer


class ReferenceLookupProposer(OracleProposer):
    """Proposes the reference transcript's continuation after the last emitted tokens.

    Exactness never depends on it (the target verifies every candidate); it only decides how many
    target calls the greedy run takes. The continuation is looked up after the latest occurrence of
    the last two emitted text tokens in the reference (then the last one), else by position; emitted
    timestamp tokens (ids >= `timestamp_begin`) are skipped, as the reference has none. Everything
    but the lookup is the oracle's (`continuations` holds the references by request id).
    """

    def __init__(self, continuations, block_size: int = 8, pad: int = 0, timestamp_begin: int | None = None):
        super().__init__(continuations, block_size, pad)
        self.timestamp_begin = timestamp_begin

    def guess(self, rid: int, generated: list[int]) -> list[int]:
        ref = self.continuations[rid]
        if self.timestamp_begin is not None:
            generated = [t for t in generated if t < self.timestamp_begin]
        start = None
        for n in (2, 1):
            if len(generated) >= n:
                tail = generated[-n:]
                for i in range(len(ref) - n, -1, -1):
                    if ref[i : i + n] == tail:
                        start = i + n
                        break
            if start is not None:
                break
        if start is None:
            start = len(generated)
        out = ref[start : start + self.block_size]
        return out + [self.pad] * (self.block_size - len(out))


# ------------------------------------------------------------------------------- helpers


def clip_list_digest(clips: list[Clip]) -> str:
    return hashlib.sha256("\n".join(c.id for c in clips).encode()).hexdigest()[:16]


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def read_index(out_dir: Path) -> dict | None:
    path = Path(out_dir) / INDEX
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------ extractor


class TeacherExtractor:
    """Holds the engine and the teacher-forced history target; `extract(clips, out_dir)` writes shards."""

    def __init__(self, options: ExtractOptions):
        from sglang_omni_flash.engine.backends import SLACK
        from sglang_omni_flash.engine.engine import WhisperFlashEngine
        from sglang_omni_flash.engine.options import EngineOptions
        from sglang_omni_flash.engine.target import WhisperTarget
        from sglang_omni_flash.flash.checkpoint import TargetIdentity
        from sglang_omni_flash.flash.drafter import default_history_layers

        self.options = options
        self.engine = WhisperFlashEngine(
            EngineOptions(
                model=options.model, speculative=False, batch_size=options.batch_size,
                language=options.language, device="auto",
                threads=options.threads, dtype=options.dtype, timestamps=options.timestamps,
            )
        )
        model = self.engine.model
        layers = options.history_layers or default_history_layers(model.config.decoder_layers)
        self.history_layers = tuple(int(i) for i in layers)
        self.history_target = WhisperTarget(model, self.history_layers)
        self.slack = SLACK
        self.identity = TargetIdentity.of_target(model)

    def describe(self, clips: list[Clip]) -> dict:
        cfg = self.engine.model.config
        return {
            "format_version": FORMAT_VERSION,
            "model": str(self.engine.model_dir),
            "dtype": self.engine.dtype_choice.name,
            "embedding_fingerprint": self.identity.fingerprint,
            "embedding_probe": list(self.identity.probe),
            "d_model": cfg.d_model,
            "vocab_size": cfg.vocab_size,
            "n_target_layers": cfg.decoder_layers,
            "history_layers": list(self.history_layers),
            "eos": self.engine.special.eos,
            "language": self.options.language,
            "shard_size": self.options.shard_size,
            "store_encoder": self.options.store_encoder,
            "teacher_top": self.options.teacher_top,
            "n_clips": len(clips),
            "clips_digest": clip_list_digest(clips),
        } | ({"timestamps": True} if self.options.timestamps else {})  # absent: extractions made before the key

    # -- one batch --------------------------------------------------------------------------
    @torch.inference_mode()
    def _batch(self, clips: list[Clip]):
        eng = self.engine
        waves = [c.load() for c in clips]
        durations = [len(w) / 16000 for w in waves]
        encoder_out = eng.encode(eng.log_mel(waves))  # [n, T_enc, d]
        tok = eng.tokenizer
        eos = eng.special.eos
        refs = [tok.encode(" " + c.text.strip(), add_special_tokens=False) + [eos] for c in clips]
        proposer = ReferenceLookupProposer(refs, block_size=self.options.lookup_block, pad=eos,
                                           timestamp_begin=eng.special.timestamp_begin if self.options.timestamps else None)
        results = eng.decode(encoder_out=encoder_out, speculative=True, proposer=proposer)

        sequences = [r.prompt + r.tokens for r in results]
        states, tops = self._history(encoder_out, sequences)
        return encoder_out, results, states, tops, durations

    def _history(self, encoder_out: torch.Tensor, sequences: list[list[int]]):
        """One teacher-forced pass over each full sequence -> per clip, history states [L, n_hist, d] and
        the top-k (log-prob [L, k], id [L, k]) of the target's next-token distribution (None if k = 0)."""
        tg = self.history_target
        n, longest = len(sequences), max(len(s) for s in sequences)
        tokens = torch.zeros(n, longest, dtype=torch.long, device=tg.device)
        for i, s in enumerate(sequences):
            tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        positions = torch.arange(longest, device=tg.device).expand(n, longest)
        cache = tg.new_cache(n, self.slack)
        cross = tg.new_cross(n, encoder_out.shape[1])
        tg.fill_cross(encoder_out.to(tg.dtype), cross)
        logits, history = tg.forward(tokens, positions, cache, cross, kv_len=longest, masked=True)
        k = self.options.teacher_top
        tops = [None] * n
        if k:
            top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
            tops = [(top.values[i, : len(s)], top.indices[i, : len(s)]) for i, s in enumerate(sequences)]
        return [history[i, : len(s)] for i, s in enumerate(sequences)], tops

    # -- everything ---------------------------------------------------------------------------
    def extract(self, clips: list[Clip], out_dir: Path, progress: bool = True) -> dict:
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        if not self.options.store_encoder:
            pathless = [c.id for c in clips if not c.path]
            if pathless:
                raise UserError(
                    f"{len(pathless)} clips (e.g. {pathless[0]}) have no audio file to re-read during training: "
                    "extract them with --store-encoder"
                )
        out_dir.mkdir(parents=True, exist_ok=True)
        header = self.describe(clips)
        index = read_index(out_dir)
        if index is not None:
            fixed = {k: v for k, v in index.items() if k not in ("shards", "totals")}
            if fixed != header:
                changed = sorted(k for k in header if fixed.get(k) != header[k])
                raise UserError(
                    f"{out_dir} holds an extraction made with other settings ({', '.join(changed)} differ): "
                    "use another --out or delete it"
                )
        else:
            index = dict(header, shards=[])
        done = {s["name"] for s in index["shards"]}
        size = self.options.shard_size
        n_shards = (len(clips) + size - 1) // size
        bar = tqdm(total=len(clips), desc="extract", unit="clip", file=sys.stderr, disable=not progress, dynamic_ncols=True)
        with bar:
            for k in range(n_shards):
                name = f"shard-{k:05d}"
                chunk = clips[k * size : (k + 1) * size]
                if name in done and (out_dir / f"{name}.safetensors").is_file():
                    bar.update(len(chunk))
                    continue
                tensors, records = self._shard(chunk, bar)
                save_file(tensors, str(out_dir / f"{name}.safetensors.tmp"))
                os.replace(out_dir / f"{name}.safetensors.tmp", out_dir / f"{name}.safetensors")
                _write_json(out_dir / f"{name}.json", records)
                kept = [r for r in records if not r.get("excluded")]
                index["shards"] = [s for s in index["shards"] if s["name"] != name] + [
                    {"name": name, "clips": len(chunk), "kept": len(kept),
                     "tokens": sum(r["n_generated"] for r in kept),
                     "target_calls": sum(r["target_calls"] for r in records)}
                ]
                index["shards"].sort(key=lambda s: s["name"])
                index["totals"] = _totals(index["shards"])
                _write_json(out_dir / INDEX, index)
        return index

    def _shard(self, chunk: list[Clip], bar) -> tuple[dict, list[dict]]:
        eng = self.engine
        eos = eng.special.eos
        bs = self.options.batch_size
        encoders, histories, token_rows, prompt_lens, records = [], [], [], [], []
        top_logprobs, top_ids = [], []
        for start in range(0, len(chunk), bs):
            part = chunk[start : start + bs]
            encoder_out, results, states, tops, durations = self._batch(part)
            for i, (clip, res) in enumerate(zip(part, results)):
                record = {
                    "id": clip.id, "speaker": clip.speaker, "duration": round(durations[i], 3),
                    "audio": clip.path, "reference": clip.text, "greedy": res.text, "n_generated": len(res.tokens),
                    "target_calls": res.target_calls,
                }
                reason = None
                if not res.tokens or res.tokens[-1] != eos:
                    reason = "no EOS within the token budget"
                elif len(res.tokens) < 2:
                    reason = "fewer than two generated tokens"
                if reason:
                    record["excluded"] = reason
                else:
                    if self.options.store_encoder:
                        encoders.append(encoder_out[i].to(torch.float16).cpu())
                    histories.append(states[i].to(torch.float16).cpu())
                    if tops[i] is not None:
                        top_logprobs.append(tops[i][0].to(torch.float16).cpu())
                        top_ids.append(tops[i][1].to(torch.int32).cpu())
                    token_rows.append(torch.tensor(res.prompt + res.tokens, dtype=torch.int32))
                    prompt_lens.append(len(res.prompt))
                records.append(record)
            bar.update(len(part))
        lengths = torch.tensor([0] + [len(t) for t in token_rows], dtype=torch.int64)
        d = eng.model.config.d_model
        k = self.options.teacher_top
        tensors = {
            "history": torch.cat(histories) if histories else torch.zeros(0, len(self.history_layers), d, dtype=torch.float16),
            "tokens": torch.cat(token_rows) if token_rows else torch.zeros(0, dtype=torch.int32),
            "offsets": lengths.cumsum(0),
            "prompt_len": torch.tensor(prompt_lens, dtype=torch.int32),
        }
        if self.options.store_encoder:
            tensors["encoder"] = torch.stack(encoders) if encoders else torch.zeros(0, 1, d, dtype=torch.float16)
        if k:
            tensors["top_logprob"] = torch.cat(top_logprobs) if top_logprobs else torch.zeros(0, k, dtype=torch.float16)
            tensors["top_ids"] = torch.cat(top_ids) if top_ids else torch.zeros(0, k, dtype=torch.int32)
        return {k: v.contiguous() for k, v in tensors.items()}, records


def _totals(shards: list[dict]) -> dict:
    return {key: sum(s[key] for s in shards) for key in ("clips", "kept", "tokens", "target_calls")}


# --------------------------------------------------------------------------------- reading


@dataclass
class TeacherUtterance:
    id: str
    speaker: str
    duration: float
    tokens: torch.Tensor  # [L] long: prompt + greedy continuation (EOS last)
    prompt_len: int
    history: torch.Tensor  # [L, n_hist, d] fp16: target states at each position
    encoder: torch.Tensor | None  # [T_enc, d] fp16, or None until training recomputes it from `audio`
    audio: str = ""  # the clip's audio file
    top_logprob: torch.Tensor | None = None  # [L, k]: row p = the target's top-k log-probs for token p + 1
    top_ids: torch.Tensor | None = None  # [L, k] their token ids

    @property
    def n_generated(self) -> int:
        return self.tokens.numel() - self.prompt_len


def load_teacher(folder: str | Path, progress: bool = False) -> tuple[dict, list[TeacherUtterance]]:
    """Every kept utterance of a finished (or partial) extraction, in memory."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = read_index(folder)
    if index is None:
        raise UserError(f"{folder} holds no teacher extraction ({INDEX} missing): run `whisper-flash extract` first")
    out = []
    for shard in tqdm(index["shards"], desc="load teacher", unit="shard", file=sys.stderr, disable=not progress):
        tensors = load_file(str(folder / f"{shard['name']}.safetensors"))
        records = [r for r in json.loads((folder / f"{shard['name']}.json").read_text()) if not r.get("excluded")]
        off = tensors["offsets"].tolist()
        tops = "top_ids" in tensors
        for u, rec in enumerate(records):
            a, b = off[u], off[u + 1]
            out.append(
                TeacherUtterance(
                    rec["id"], rec["speaker"], rec["duration"], tensors["tokens"][a:b].long(),
                    int(tensors["prompt_len"][u]), tensors["history"][a:b],
                    tensors["encoder"][u] if "encoder" in tensors else None, rec.get("audio", ""),
                    tensors["top_logprob"][a:b] if tops else None, tensors["top_ids"][a:b].long() if tops else None,
                )
            )
    return index, out


def options_dict(options: ExtractOptions) -> dict:
    return asdict(options)


@torch.inference_mode()
def recompute_encoders(utterances: list[TeacherUtterance], index: dict, batch_size: int = 8,
                       progress: bool = False, known: dict | None = None) -> None:
    """Fill `encoder` of every utterance extracted without it: log-mel + the target's encoder on its audio
    file, with the engine and dtype the extraction used (stored fp16, as a stored one would be).
    `known` (audio path, dtype) -> encoder output is read and filled, so clips that two teacher folders
    share (the same audio decoded with and without timestamps) are encoded and held once."""
    known = {} if known is None else known
    for u in utterances:
        if u.encoder is None and (u.audio, index["dtype"]) in known:
            u.encoder = known[(u.audio, index["dtype"])]
    todo = [u for u in utterances if u.encoder is None]
    if not todo:
        return
    from sglang_omni_flash.engine.audio import load_audio
    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.engine.options import EngineOptions

    missing = [u.audio or u.id for u in todo if not u.audio or not Path(u.audio).is_file()]
    if missing:
        raise UserError(f"the audio of {len(missing)} teacher utterances is gone (e.g. {missing[0]}): "
                        "restore it or extract again")
    engine = WhisperFlashEngine(EngineOptions(model=index["model"], speculative=False, dtype=index["dtype"],
                                              device="auto"))
    by_audio: dict[str, list[TeacherUtterance]] = {}  # one encoder pass per audio file
    for u in todo:
        by_audio.setdefault(u.audio, []).append(u)
    audios = list(by_audio)
    bar = tqdm(total=len(audios), desc="encode", unit="clip", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    with bar:
        for start in range(0, len(audios), batch_size):
            part = audios[start : start + batch_size]
            encoded = engine.encode(engine.log_mel([load_audio(a) for a in part]))
            for audio, e in zip(part, encoded):
                known[(audio, index["dtype"])] = e.to(torch.float16).cpu().clone()
                for u in by_audio[audio]:
                    u.encoder = known[(audio, index["dtype"])]
            bar.update(len(part))
