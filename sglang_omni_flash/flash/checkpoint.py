"""Drafter checkpoints: a directory with `config.json` and `model.safetensors`.

`config.json` is `DrafterConfig.to_dict()` plus `format_version` and `dtype`. Its target identity
fields -- `d_model`, `vocab_size`, `n_target_layers` and the token embedding's `embedding_probe`
(`embedding_fingerprint` for checkpoints saved before it) -- must match the target the drafter is
loaded against, whatever dtype that target runs in. `model.safetensors` holds the drafter's own weights only; the
token embedding and output head belong to the target and are re-attached by `bind_target`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.flash.drafter import DrafterConfig, WhisperFlashDrafter

if TYPE_CHECKING:
    from transformers import WhisperForConditionalGeneration

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SHIPPED_DRAFTERS_DIR = Path(__file__).resolve().parent.parent / "drafters"


def embedding_fingerprint(target: "WhisperForConditionalGeneration") -> str:
    """sha256 of the target's token-embedding matrix as FP16 bytes, first 16 hex characters (a name
    for messages and logs; identity itself is decided by `embedding_probe`, which survives casts)."""
    return fingerprint_tensor(target.model.decoder.embed_tokens.weight)


def fingerprint_tensor(weight: torch.Tensor) -> str:
    data = weight.detach().to("cpu", torch.float16).contiguous().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


# The embedding probe: PROBE_SIZE values at fixed, evenly spread positions of the flattened matrix.
# A hash of the bytes changes with the dtype the target is served in (bf16 keeps 8 mantissa bits, and
# fp32 -> fp16 -> bf16 rounds twice), so the probe is compared with a tolerance that covers any
# cast between fp32, fp16 and bf16 (relative 2^-9 each) and nothing more: two different Whisper
# checkpoints differ by far more than 1% in 32 values.
PROBE_SIZE = 32
PROBE_RTOL = 2.0**-7
PROBE_ATOL = 1e-6  # fp16 subnormals (|x| < 6.1e-5) keep only an absolute precision of 6e-8


def embedding_probe(weight: torch.Tensor) -> tuple[float, ...]:
    flat = weight.detach().reshape(-1)
    n = flat.numel()
    index = torch.tensor([(2 * i + 1) * n // (2 * PROBE_SIZE) for i in range(PROBE_SIZE)], device=flat.device)
    return tuple(float(x) for x in flat.index_select(0, index).float().cpu())


def probes_agree(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= PROBE_RTOL * max(abs(x), abs(y)) + PROBE_ATOL for x, y in zip(a, b))


@dataclass(frozen=True)
class TargetIdentity:
    """What a drafter checkpoint (or a teacher extraction) must agree with in its target."""

    d_model: int
    vocab_size: int
    n_layers: int  # decoder blocks
    fingerprint: str  # "" = unknown
    probe: tuple[float, ...] = ()  # embedding_probe; () = unknown (then the fingerprint decides)

    @classmethod
    def of_target(cls, target: "WhisperForConditionalGeneration") -> "TargetIdentity":
        c = target.config
        weight = target.model.decoder.embed_tokens.weight
        return cls(c.d_model, c.vocab_size, c.decoder_layers, embedding_fingerprint(target), embedding_probe(weight))

    @classmethod
    def of_record(cls, record) -> "TargetIdentity":
        """From a drafter config.json or a teacher.json (same key names)."""
        return cls(int(record["d_model"]), int(record["vocab_size"]), int(record["n_target_layers"]),
                   record.get("embedding_fingerprint", ""), tuple(record.get("embedding_probe", ())))

    @classmethod
    def of_drafter(cls, config: DrafterConfig) -> "TargetIdentity":
        return cls.of_record(config.to_dict())

    def differences(self, other: "TargetIdentity") -> list[str]:
        out = [name for name in ("d_model", "vocab_size", "n_layers") if getattr(self, name) != getattr(other, name)]
        if self.probe and other.probe:
            same = probes_agree(self.probe, other.probe)
        else:  # a record from before the probe: the float16 bytes (a bf16 target never matches them)
            same = not (self.fingerprint and other.fingerprint) or self.fingerprint == other.fingerprint
        if not same:
            out.append("embedding fingerprint")
        return out

    @property
    def known(self) -> bool:
        return bool(self.probe or self.fingerprint)

    def describe(self) -> str:
        return (
            f"d_model={self.d_model}, vocab {self.vocab_size}, {self.n_layers} decoder layers "
            f"(fingerprint {self.fingerprint or 'unknown'})"
        )


def save_drafter(drafter: WhisperFlashDrafter, out_dir: str | Path, *, dtype: torch.dtype = torch.float16) -> Path:
    """Write `config.json` + `model.safetensors` (drafter-owned weights only) to out_dir; returns it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
        for k, v in drafter.state_dict().items()
    }
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt", "architecture": drafter.config.architecture})
    config = drafter.config.to_dict() | {"format_version": FORMAT_VERSION, "dtype": str(dtype).removeprefix("torch.")}
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_drafter_config(path: str | Path) -> DrafterConfig:
    """Parse and check `path/config.json`; a missing or garbled file is a UserError."""
    path = Path(path)
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        raise UserError(f"no drafter checkpoint at {path} ({CONFIG_NAME} missing)")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"drafter config {config_path} is unreadable: {exc}") from None
    if not isinstance(raw, dict) or raw.get("architecture") != "WhisperFlashDrafter":
        raise UserError(f"{config_path} is not a WhisperFlashDrafter config")
    if int(raw.get("format_version", FORMAT_VERSION)) > FORMAT_VERSION:
        raise UserError(
            f"drafter {path} has format version {raw['format_version']}; this package reads up to {FORMAT_VERSION}"
        )
    try:
        return DrafterConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise UserError(f"drafter config {config_path} is invalid: {exc}") from None


def check_target(config: DrafterConfig, target: "WhisperForConditionalGeneration", *, where: str = "drafter") -> None:
    """UserError naming the mismatch if the drafter was trained for a different target."""
    want, have = TargetIdentity.of_drafter(config), TargetIdentity.of_target(target)
    diff = want.differences(have)
    if diff:
        raise UserError(
            f"{where} does not fit this Whisper model ({', '.join(diff)} differ): the drafter was trained for "
            f"{want.describe()}, but the target has {have.describe()}"
        )


def load_drafter(
    path: str | Path,
    target: "WhisperForConditionalGeneration",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> WhisperFlashDrafter:
    """Load a checkpoint directory for `target` (on the target embedding's device/dtype by default)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config = read_drafter_config(path)
    check_target(config, target, where=f"drafter {path}")
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise UserError(f"drafter {path} has no {WEIGHTS_NAME}")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"drafter weights {weights} are unreadable (corrupt or truncated?): {exc}") from None

    with torch.device("meta"):
        drafter = WhisperFlashDrafter(config)
    try:
        drafter.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise UserError(f"drafter weights {weights} do not match its config.json: {exc}") from None

    emb = target.model.decoder.embed_tokens.weight
    drafter.to(device=device or emb.device, dtype=dtype or emb.dtype)
    drafter.bind_target(target)
    return drafter.eval()


def find_shipped_drafter(
    target: "WhisperForConditionalGeneration", *, search_dir: str | Path | None = None
) -> Path | None:
    """The first `drafters/*/` (package data, or search_dir) whose config fits `target`, else None."""
    root = Path(search_dir) if search_dir is not None else SHIPPED_DRAFTERS_DIR
    if not root.is_dir():
        return None
    have: TargetIdentity | None = None
    for config_path in sorted(root.glob(f"*/{CONFIG_NAME}")):
        try:
            want = TargetIdentity.of_drafter(read_drafter_config(config_path.parent))
        except UserError:
            continue
        have = have or TargetIdentity.of_target(target)
        if not want.differences(have) and want.known:
            return config_path.parent
    return None
