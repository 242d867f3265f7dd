"""SGLang-Omni integration: the only package that imports sglang / sglang-omni internals.

Importing this package is cheap and imports nothing from sglang-omni; the submodules do:

* ``config``        -- ``WhisperFlashASRPipelineConfig``: the stock Whisper ASR pipeline plus
                       ``--asr.speculative whisper-flash`` and its typed options.
* ``registration``  -- puts that config class into sglang-omni's pipeline registry.
* ``_autoload``     -- the lazy post-import hook that ``sglang_omni_flash_autoload.pth`` installs,
                       so registration happens in every process without anyone calling it.
* ``stages``        -- the stage factory the config points at (stock behaviour without
                       ``speculative``).
* ``engine_builder``  -- the plugin's ``WhisperASREngineBuilder`` subclasses (``.en`` prefix fix;
                       the Whisper-Flash worker's drafter loading, hooks, runner, streaming).
* ``spec_runner``     -- ``WhisperFlashModelRunner``: the speculative decode step.
* ``verify``          -- the verify pass over the paged KV cache (new rows only).
* ``streaming``       -- stream deltas for steps that emit several tokens.

docs/integration.md describes the mechanism.
"""
