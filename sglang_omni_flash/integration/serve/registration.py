"""Put ``WhisperFlashASRPipelineConfig`` into sglang-omni's pipeline config registry.

sglang-omni picks a pipeline config class by the checkpoint's HF architecture
(``PIPELINE_CONFIG_REGISTRY.configs[arch]``) or, for ``--config`` files, by the
``config_cls`` name among the registered classes. It scans only ``sglang_omni.models`` and
has no plugin entry points, so this module registers the plugin class itself:

* ``configs["WhisperForConditionalGeneration"]`` -> ``WhisperFlashASRPipelineConfig``, so
  ``sgl-omni serve --model-path <whisper> --asr.speculative whisper-flash`` parses;
* the stock class stays registered under ``STOCK_KEY``, so YAML files that name
  ``config_cls: WhisperASRPipelineConfig`` keep resolving to it.

Without ``--asr.speculative`` the plugin class builds the stock stage factory with the
stock kwargs, so replacing the default changes nothing for plain serving.
``register()`` is idempotent; ``_autoload`` calls it in every process (see its docstring).

``install_openai_errors()`` is the second hook ``_autoload`` runs: when sglang-omni's HTTP
module is imported, the apps it builds get the OpenAI error envelope and request
validation of ``openai_errors`` on the audio endpoints.
"""

from __future__ import annotations

ARCHITECTURE = "WhisperForConditionalGeneration"
STOCK_KEY = f"{ARCHITECTURE}:sglang-omni"


def register() -> None:
    from sglang_omni.models.registry import PIPELINE_CONFIG_REGISTRY

    from sglang_omni_flash.integration.serve.config import WhisperFlashASRPipelineConfig

    configs = PIPELINE_CONFIG_REGISTRY.configs
    current = configs.get(ARCHITECTURE)
    if current is WhisperFlashASRPipelineConfig:
        return
    if current is not None:
        configs.setdefault(STOCK_KEY, current)
    configs[ARCHITECTURE] = WhisperFlashASRPipelineConfig


def is_registered() -> bool:
    from sglang_omni.models.registry import PIPELINE_CONFIG_REGISTRY

    from sglang_omni_flash.integration.serve.config import WhisperFlashASRPipelineConfig

    return PIPELINE_CONFIG_REGISTRY.configs.get(ARCHITECTURE) is WhisperFlashASRPipelineConfig


def install_openai_errors() -> None:
    from sglang_omni_flash.integration.routes.openai_errors import install

    install()
