"""Plugin registration and configuration: how ``sgl-omni serve --asr.speculative whisper-flash``
reaches the plugin. ``sglang_omni_flash_autoload.pth`` (installed at the top of site-packages)
imports ``_autoload`` at interpreter start, which registers ``config.WhisperFlashASRPipelineConfig``
(``registration``) once sglang-omni builds its registry; that config points the ASR stage at
``stages.create_whisper_flash_asr_executor``, which picks the drafter (``drafter_source``) and
builds the stage with ``engine_builder`` (the ``.en`` prompt fix of ``english_only``, the
scheduler's ``idle_wait``, and on a CPU the row-invariant model of ``worker.cpu_model``)."""
