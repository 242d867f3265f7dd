"""`--asr.speculative whisper-flash` parses and routes, in fresh processes, after a plain install.

Every check runs in a new interpreter: the point is that the plugin's .pth hook registers
`WhisperFlashASRPipelineConfig` by itself, with no import of ours in the process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("sglang_omni")

PLUGIN_FACTORY = "sglang_omni_flash.integration.serve.stages.create_whisper_flash_asr_executor"
STOCK_FACTORY = "sglang_omni.models.whisper_asr.stages.create_sglang_whisper_asr_executor"
SGL_OMNI = str(Path(sys.executable).with_name("sgl-omni"))

# Resolves like `sgl-omni serve` does (sglang-omni's own resolve_sources), then asks
# sglang-omni's runtime for the kwargs the stage worker would pass to the factory.
RESOLVE = textwrap.dedent("""
    import json, sys
    from sglang_omni.cli.config import resolve_sources
    from sglang_omni.config.runtime import resolve_stage_factory_args
    from sglang_omni.models.whisper_asr.config import WhisperASRPipelineConfig

    def describe(config):
        stage = config.stage_named("asr")
        kwargs = resolve_stage_factory_args(stage, config)
        return {"config_cls": type(config).__name__, "factory_path": stage.factory_path,
                "http_routes": list(stage.http_routes), "kwargs": {k: v for k, v in kwargs.items()}}

    out = {}
    for name, source in json.loads(sys.argv[1]).items():
        res = resolve_sources(model_path=source.get("model_path"), config_file=source.get("config"),
                              text_only=False, variant=None, mem_fraction_static=None,
                              argv=source.get("argv", []))
        out[name] = describe(res.resolved.config)
    out["stock_class"] = describe(WhisperASRPipelineConfig(model_path=sys.argv[2]))
    print("RESULT " + json.dumps(out, default=str))
""")


def fresh_python(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def resolved(base_model_dir, tmp_path_factory):
    yaml_dir = tmp_path_factory.mktemp("configs")
    flash_yaml = yaml_dir / "flash.yaml"
    flash_yaml.write_text(textwrap.dedent(f"""\
        config_cls: WhisperFlashASRPipelineConfig
        model_path: {base_model_dir}
        stages:
          asr:
            speculative: whisper-flash
            speculative_num_draft_tokens: 4
        """))
    stock_yaml = yaml_dir / "stock.yaml"
    stock_yaml.write_text(f"config_cls: WhisperASRPipelineConfig\nmodel_path: {base_model_dir}\n")
    sources = {
        "plain": {"model_path": str(base_model_dir)},
        "flag": {"model_path": str(base_model_dir),
                 "argv": ["--asr.speculative", "whisper-flash", "--asr.speculative_num_draft_tokens", "6",
                          "--asr.speculative_draft_model_path", "/some/drafter",
                          "--asr.speculative_min_draft_prob", "0.3", "--asr.speculative_drafter_int8", "false",
                          "--asr.speculative_tree_nodes", "12", "--asr.speculative_tree_min_prob", "0.1"]},
        "flash_yaml": {"config": str(flash_yaml)},
        "stock_yaml": {"config": str(stock_yaml)},
        "no_fallback": {"model_path": str(base_model_dir),
                        "argv": ["--asr.temperature_fallback", "false", "--asr.compression_ratio_threshold", "inf",
                                 "--asr.logprob_threshold", "-0.5", "--asr.no_speech_threshold", "0.9"]},
    }
    proc = fresh_python("-c", RESOLVE, json.dumps(sources), str(base_model_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_pth_hook_is_installed_and_recorded_for_uninstall():
    site = sysconfig.get_paths()["purelib"]
    (dist,) = [d for d in metadata.distributions(path=[site]) if d.metadata["Name"] == "sglang-omni-flash"]
    assert "sglang_omni_flash_autoload.pth" in {str(f) for f in dist.files or ()}  # pip uninstall removes it
    assert (Path(site) / "sglang_omni_flash_autoload.pth").is_file()


def test_interpreter_start_imports_nothing_heavy():
    proc = fresh_python("-c", "import sys; print(sorted(m for m in sys.modules if m.startswith(('sglang', 'torch'))))")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == "['sglang_omni_flash', 'sglang_omni_flash.integration', " \
        "'sglang_omni_flash.integration.serve', 'sglang_omni_flash.integration.serve._autoload']"


def test_flag_resolves_to_the_plugin_config_and_reaches_the_factory(resolved):
    flag = resolved["flag"]
    assert flag["config_cls"] == "WhisperFlashASRPipelineConfig"
    assert flag["factory_path"] == PLUGIN_FACTORY
    assert flag["kwargs"]["speculative"] == "whisper-flash"
    assert flag["kwargs"]["speculative_draft_model_path"] == "/some/drafter"
    # every SpecOptions field, by its own name: the factory makes the one SpecOptions of them
    from sglang_omni_flash.flash.options import SpecOptions

    assert SpecOptions(**flag["kwargs"]["speculative_options"]) == SpecOptions(
        num_draft_tokens=6, min_draft_prob=0.3, drafter_int8=False, tree_nodes=12, tree_min_prob=0.1)


def test_without_the_flag_the_factory_gets_exactly_the_stock_kwargs(resolved):
    plain, stock = resolved["plain"], resolved["stock_class"]
    assert plain["factory_path"] == PLUGIN_FACTORY
    assert stock["factory_path"] == STOCK_FACTORY
    assert not any(k.startswith("speculative") for k in plain["kwargs"])
    fallback = {"temperature_fallback": True, "compression_ratio_threshold": 2.4, "logprob_threshold": -1.0,
                "no_speech_threshold": 0.6}  # openai-whisper's; the plugin's factory takes them off
    assert plain["kwargs"] == {**stock["kwargs"], **fallback}


def test_fallback_fields_reach_the_factory(resolved):
    kwargs = resolved["no_fallback"]["kwargs"]
    assert kwargs["temperature_fallback"] is False and kwargs["compression_ratio_threshold"] == float("inf")
    assert kwargs["logprob_threshold"] == -0.5 and kwargs["no_speech_threshold"] == 0.9


def test_the_metrics_route_comes_with_speculation_or_fallback(resolved):
    """The worker's metrics are served by the ASR stage itself (sglang-omni stage http_routes)."""
    assert resolved["flag"]["http_routes"] == resolved["flash_yaml"]["http_routes"] == ["/whisper-flash"]
    assert resolved["plain"]["http_routes"] == ["/whisper-flash"]  # fallback counts
    assert resolved["no_fallback"]["http_routes"] == resolved["stock_class"]["http_routes"] == []


def test_yaml_config_cls_resolves_plugin_and_stock_classes(resolved):
    assert resolved["flash_yaml"]["config_cls"] == "WhisperFlashASRPipelineConfig"
    assert resolved["flash_yaml"]["kwargs"]["speculative"] == "whisper-flash"
    options = resolved["flash_yaml"]["kwargs"]["speculative_options"]
    assert options["num_draft_tokens"] == 4
    # unset: by the target's device and dtype (SpecOptions.resolved)
    assert options["min_draft_prob"] is options["drafter_int8"] is options["tree_nodes"] is None
    assert options["tree_min_prob"] is options["pace"] is None
    assert resolved["stock_yaml"]["config_cls"] == "WhisperASRPipelineConfig"
    assert resolved["stock_yaml"]["factory_path"] == STOCK_FACTORY


def test_cli_config_resolve_shows_the_flag(base_model_dir):
    proc = subprocess.run(
        [SGL_OMNI, "config", "resolve", "--model-path", str(base_model_dir),
         "--asr.speculative", "whisper-flash", "--show", "diff"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stages.asr.speculative: None -> 'whisper-flash'" in proc.stdout


def test_cli_refuses_an_unknown_algorithm_with_a_clear_message(base_model_dir):
    proc = subprocess.run(
        [SGL_OMNI, "config", "resolve", "--model-path", str(base_model_dir), "--asr.speculative", "medusa"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode != 0
    message = proc.stdout + proc.stderr
    assert "asr.speculative='medusa' is not supported" in message, message[-2000:]
    assert "'whisper-flash'" in message


def test_draft_options_without_the_switch_are_refused(base_model_dir):
    proc = subprocess.run(
        [SGL_OMNI, "config", "resolve", "--model-path", str(base_model_dir),
         "--asr.speculative_num_draft_tokens", "4"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"})
    assert proc.returncode != 0
    assert "add --asr.speculative whisper-flash" in proc.stdout + proc.stderr


def test_opt_out_restores_the_stock_registry():
    proc = fresh_python(
        "-c", "from sglang_omni.models.registry import PIPELINE_CONFIG_REGISTRY as R;"
              "print(R.configs['WhisperForConditionalGeneration'].__name__)",
        env={"SGLANG_OMNI_FLASH_AUTOLOAD": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "WhisperASRPipelineConfig"


@pytest.mark.server
def test_serve_with_a_wrong_drafter_stops_at_startup_with_a_clear_message(base_model_dir, tiny_en_model_dir,
                                                                         tmp_path):
    """The real `sgl-omni serve` parses the flag and the stage worker gets it (tiny.en drafter, base target)."""
    import torch
    from transformers import WhisperForConditionalGeneration

    from conftest import free_port
    from sglang_omni_flash.flash.checkpoint import save_drafter
    from sglang_omni_flash.flash.drafter import WhisperFlashDrafter
    from sglang_omni_flash.serving.launch import Server, ServeOptions

    wrong = WhisperForConditionalGeneration.from_pretrained(tiny_en_model_dir, torch_dtype=torch.float32)
    drafter_dir = save_drafter(WhisperFlashDrafter.from_target(wrong), tmp_path / "tiny-en-drafter")
    log = tmp_path / "sgl-omni.log"
    options = ServeOptions(dtype="float32", model=str(base_model_dir), port=free_port(), log_file=log, startup_timeout_s=300,
                           extra_args=("--asr.speculative", "whisper-flash",
                                       "--asr.speculative_draft_model_path", str(drafter_dir)))
    srv = Server(options)
    srv.start()
    try:
        with pytest.raises(RuntimeError, match="exited with code"):
            srv.wait_ready()
    finally:
        srv.stop()
    text = " ".join(log.read_text(errors="replace").split())  # rich wraps long lines
    assert f"--asr.speculative_draft_model_path {drafter_dir} does not fit" in text, text[-3000:]
