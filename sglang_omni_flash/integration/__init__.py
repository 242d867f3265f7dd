"""SGLang-Omni integration: the only package that imports sglang / sglang-omni internals.

Importing this package is cheap and imports nothing from sglang-omni; its four folders do:

* ``serve/``    plugin registration and configuration: the ``.pth`` autoload hook, the registry
                entry, ``WhisperFlashASRPipelineConfig`` (``--asr.speculative`` and its options),
                the stage factory and the engine builders that assemble the ASR stage;
* ``worker/``   the decode worker: ``WhisperFlashModelRunner`` executing ``flash.rounds`` inside
                the stage, the drafter's memories, the verify pass and the row-invariant CPU model;
* ``scoring/``  what temperature fallback judges (log-probabilities, ``<|nospeech|>``) and the
                acceptance and fallback metrics;
* ``routes/``   the HTTP side: the audio routes for long files, timestamped formats and fallback,
                verbose_json segments, and the OpenAI error envelope.

docs/architecture.md shows how they fit; docs/integration.md describes the mechanism.
"""
