"""The kernel choices as engine arguments (core/kernel_settings.py): validated naming the argument,
and a profile's recorded settings compared with an engine's."""

from __future__ import annotations

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.core.kernel_settings import KernelSettings, kernel_settings_mismatch

FIELDS = ("cpu_attention", "fused_decode", "fused_packed", "quant_activations")


def test_defaults_are_the_fast_kernels_and_engine_args_carry_them() -> None:
    assert KernelSettings() == KernelSettings("native", True, True, "int8")
    assert KernelSettings.field_names() == FIELDS
    assert EngineArgs().kernel_settings() == KernelSettings()
    args = EngineArgs(cpu_attention="torch", fused_decode=False, fused_packed=False,
                      quant_activations="fp32")
    assert args.kernel_settings() == KernelSettings("torch", False, False, "fp32")
    assert not args.kernel_settings().int8_activations and KernelSettings().int8_activations


@pytest.mark.parametrize(("field", "value", "message"), [
    ("cpu_attention", "fast", "cpu_attention must be one of native, torch; got 'fast'"),
    ("quant_activations", "int4", "quant_activations must be one of int8, fp32; got 'int4'"),
    ("fused_decode", 1, "fused_decode must be true or false, got 1"),
    ("fused_packed", "yes", "fused_packed must be true or false, got 'yes'"),
])
def test_bad_settings_are_refused_naming_the_field(field: str, value: object,
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KernelSettings(**{field: value})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("cpu_attention", "fast", "LLM: cpu_attention must be one of native, torch; got 'fast'"),
    ("quant_activations", "int4", "LLM: quant_activations must be one of int8, fp32"),
    ("fused_decode", "yes", "LLM: fused_decode must be a boolean, got 'yes'"),
])
def test_engine_arguments_refuse_bad_kernel_values(field: str, value: object,
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_mapping({field: value}, "LLM")


def test_mismatch_names_each_differing_setting() -> None:
    engine = KernelSettings()
    assert kernel_settings_mismatch({"kernel_settings": engine.to_dict()}, engine) is None
    other = KernelSettings(cpu_attention="torch", quant_activations="fp32")
    text = kernel_settings_mismatch({"kernel_settings": other.to_dict()}, engine)
    assert text == ("cpu_attention: profile 'torch', engine 'native'; "
                    "quant_activations: profile 'fp32', engine 'int8'")


def test_mismatch_reports_a_profile_without_settings() -> None:
    for meta in ({}, {"kernel_settings": {}}):
        text = kernel_settings_mismatch(meta, KernelSettings(fused_decode=False))
        assert text is not None and "records no kernel settings" in text
        assert "fused_decode=False" in text


def test_mismatch_refuses_a_malformed_record() -> None:
    with pytest.raises(ValueError, match="kernel settings lack fused_packed"):
        kernel_settings_mismatch({"kernel_settings": {"cpu_attention": "native",
                                                      "fused_decode": True,
                                                      "quant_activations": "int8"}},
                                 KernelSettings())
    with pytest.raises(ValueError, match="kernel_settings must be a mapping"):
        kernel_settings_mismatch({"kernel_settings": "native"}, KernelSettings())
