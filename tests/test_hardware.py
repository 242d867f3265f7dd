"""dtype by CPU, and a drafter/target identity that does not depend on the dtype the target runs in."""

from __future__ import annotations

import pytest
import torch

from sglang_omni_flash.errors import UserError
from sglang_omni_flash.hardware import DtypeChoice, choose_dtype, cpu_flags, cpu_summary

AMX_CPU = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX512_BF16_CPU = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
AVX2_CPU = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx f16c avx2\n"
ARM_CPU = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes bf16\n"


def test_cpu_flags_are_read_from_cpuinfo_text():
    assert "amx_bf16" in cpu_flags(AMX_CPU)
    assert cpu_flags(AVX2_CPU) == frozenset({"fpu", "sse", "avx", "f16c", "avx2"})
    assert "asimd" in cpu_flags(ARM_CPU)
    assert cpu_flags("no flags here") == frozenset()


@pytest.mark.parametrize("cpuinfo, dtype", [
    (AMX_CPU, "bfloat16"),          # bf16 tiles: the 2.2x measured on AMX
    (AVX512_BF16_CPU, "bfloat16"),  # bf16 dot products: 1.4-1.6x measured on an AVX512-BF16 EPYC
    (AVX2_CPU, "float32"),
    (ARM_CPU, "float32"),
])
def test_auto_dtype_on_cpu_follows_native_bf16_matrix_units(cpuinfo, dtype):
    choice = choose_dtype("auto", "cpu", cpu_flags(cpuinfo))
    assert choice.name == dtype
    assert choice.reason.startswith("auto: ")
    assert ("CPU has" in choice.reason) == (dtype == "bfloat16")  # the flag that decided is named


def test_auto_dtype_on_cuda_is_float16_and_a_named_dtype_wins_everywhere():
    assert choose_dtype("auto", "cuda", frozenset()).name == "float16"
    for requested in ("float32", "bfloat16", "float16"):
        assert choose_dtype(requested, "cpu", cpu_flags(AMX_CPU)) == DtypeChoice(requested, "asked for")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        choose_dtype("fp8", "cpu")


def test_cpu_summary_names_the_features_that_decide():
    assert cpu_summary(cpu_flags(AMX_CPU)) == "CPU amx_bf16 avx512_bf16 avx512f avx2"
    assert cpu_summary(cpu_flags(ARM_CPU)).startswith("CPU without ")


def test_round_cost_defaults_follow_device_and_dtype():
    from sglang_omni_flash.flash.options import SpecOptions

    fp32, bf16 = SpecOptions().resolved("cpu", torch.float32), SpecOptions().resolved("cpu", "bfloat16", amx=True)
    # fp32 CPU: every verify row costs -> cut blocks, 8-node trees, int8 drafter, paced
    assert fp32.min_draft_prob > 0 and fp32.tree_nodes == 8 and fp32.drafter_int8 and fp32.pace
    # bf16 CPU with AMX: rows nearly free -> whole blocks, a larger tree, the drafter keeps bf16 weights
    assert bf16.min_draft_prob == 0.0 and bf16.tree_nodes > fp32.tree_nodes and not bf16.drafter_int8
    # bf16 CPU without AMX (AVX512-BF16): whole blocks, the fp32 CPU's 8 nodes (rows cost there), bf16's threshold
    no_amx = SpecOptions().resolved("cpu", "bfloat16", amx=False)
    assert no_amx.min_draft_prob == 0.0 and not no_amx.drafter_int8 and no_amx.pace
    assert (no_amx.tree_nodes, no_amx.tree_min_prob) == (fp32.tree_nodes, bf16.tree_min_prob)
    # CUDA: the paper's whole chain, unpaced
    cuda = SpecOptions().resolved("cuda", torch.float16)
    assert (cuda.tree_nodes, cuda.tree_min_prob, cuda.min_draft_prob, cuda.pace) == (0, 0.0, 0.0, False)
    assert not SpecOptions().resolved("cuda", torch.float32).drafter_int8
    # what a caller set is kept
    assert SpecOptions(tree_nodes=3, pace=True).resolved("cuda", torch.float16).tree_nodes == 3


def test_the_bf16_tree_follows_this_cpus_amx_when_not_told(monkeypatch):
    import sglang_omni_flash.hardware as hardware
    from sglang_omni_flash.flash.options import SpecOptions

    monkeypatch.setattr(hardware, "cpu_flags", lambda cpuinfo=None: cpu_flags(AMX_CPU))
    assert SpecOptions().resolved("cpu", "bfloat16").tree_nodes == 16
    monkeypatch.setattr(hardware, "cpu_flags", lambda cpuinfo=None: frozenset({"avx512_bf16", "avx512f", "avx2"}))
    assert SpecOptions().resolved("cpu", "bfloat16").tree_nodes == 8
    assert SpecOptions(tree_nodes=12).resolved("cpu", "bfloat16").tree_nodes == 12  # what the caller set


def test_engine_names_its_dtype_and_refuses_an_unknown_one(tiny_en_model_dir):
    from sglang_omni_flash.engine.engine import WhisperFlashEngine
    from sglang_omni_flash.engine.options import EngineOptions

    engine = WhisperFlashEngine(EngineOptions(model=str(tiny_en_model_dir), dtype="float32", speculative=False))
    assert engine.dtype == torch.float32 and engine.dtype_choice == DtypeChoice("float32", "asked for")
    auto = WhisperFlashEngine(EngineOptions(model=str(tiny_en_model_dir), speculative=False))
    assert auto.dtype_choice == choose_dtype("auto", "cpu")  # this machine's rule, whichever CPU it is
    with pytest.raises(UserError, match="unknown dtype"):
        WhisperFlashEngine(EngineOptions(model=str(tiny_en_model_dir), dtype="int4"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shipped_drafters_fit_their_target_at_every_dtype(base_model_dir, tiny_en_model_dir, dtype):
    """The identity check reads the embedding with a tolerance that covers any cast between
    float32, float16 and bfloat16 (a bf16 target once refused its own drafter: hashes of bytes)."""
    from transformers import WhisperForConditionalGeneration

    from sglang_omni_flash.flash.checkpoint import SHIPPED_DRAFTERS_DIR, find_shipped_drafter, load_drafter

    for name, model_dir in (("base", base_model_dir), ("tiny.en", tiny_en_model_dir)):
        target = WhisperForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype)
        found = find_shipped_drafter(target)
        assert found == SHIPPED_DRAFTERS_DIR / name
        drafter = load_drafter(found, target)
        assert drafter.mask.dtype == dtype
    other = WhisperForConditionalGeneration.from_pretrained(str(base_model_dir), dtype=dtype)
    with torch.no_grad():
        other.model.decoder.embed_tokens.weight.mul_(1.05)  # another checkpoint of the same shape
    assert find_shipped_drafter(other) is None
    with pytest.raises(UserError, match="embedding fingerprint"):
        load_drafter(SHIPPED_DRAFTERS_DIR / "base", other)


def test_server_plan_carries_the_dtype(base_model_dir):
    import yaml

    from sglang_omni_flash.serving.launch import ServeOptions, plan_launch

    for requested in ("auto", "bfloat16", "float32"):
        plan = plan_launch(ServeOptions(model=str(base_model_dir), device="cpu", dtype=requested))
        expected = choose_dtype(requested, "cpu")
        config = yaml.safe_load(plan.config_file.read_text())
        assert config["stages"]["asr"]["engine"]["dtype"] == expected.name
        assert plan.dtype == expected.describe()
    with pytest.raises(UserError, match="unknown dtype"):
        plan_launch(ServeOptions(model=str(base_model_dir), device="cpu", dtype="half"))
