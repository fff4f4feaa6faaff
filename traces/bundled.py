"""The traces bundled with twinserve, by name (their files and licences under ``data/``)."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
BUNDLED_TRACES: dict[str, Path] = {
    "azure-conv": DATA_DIR / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv",
    "azure-code": DATA_DIR / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv",
    "mooncake": DATA_DIR / "mooncake" / "conversation_trace.jsonl",
}
