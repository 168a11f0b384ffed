"""The model runner a specops proposer needs: vLLM's V1 model runner, the one that runs `custom_class`
proposers. Model Runner V2 runs none (vLLM's main: "does not yet support: speculative method
'custom_class'"; on CPU without Triton, "Model Runner V2 requires Triton"). vLLM picks V1 for them by
itself, unless `VLLM_USE_V2_MODEL_RUNNER=1` forces V2: then its refusal names neither specops nor what to
do. Where that variable asks for V2, `require_v1` (called by the plugin, before vLLM builds its config) makes
the V2 check refuse a specops proposer first, saying why and what to set.
"""

from __future__ import annotations

import os

__all__ = ["is_specops", "require_v1"]

_PREFIX = "specops.vllm."


def is_specops(spec) -> bool:
    """Whether a vLLM speculative config names a specops proposer (a custom_class in specops.vllm)."""
    model = getattr(spec, "model", None)
    return getattr(spec, "method", None) == "custom_class" and isinstance(model, str) and model.startswith(_PREFIX)


def refusal(config) -> str | None:
    """The message for a vLLM config that asks Model Runner V2 to run a specops proposer, else None."""
    spec = getattr(config, "speculative_config", None)
    if not is_specops(spec):
        return None
    model = spec.model
    return (f"{model} is a vLLM custom_class proposer, and only vLLM's V1 model runner runs those; "
            f"VLLM_USE_V2_MODEL_RUNNER={os.environ.get('VLLM_USE_V2_MODEL_RUNNER')} asks for Model Runner V2. "
            "Unset VLLM_USE_V2_MODEL_RUNNER (vLLM then takes V1 for a custom_class proposer) or set it to 0.")


def require_v1() -> bool:
    """Where VLLM_USE_V2_MODEL_RUNNER asks for V2, wrap vLLM's V2 check so that it refuses a specops proposer
    with `refusal`'s message; returns whether it did (nothing is touched otherwise)."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() not in ("1", "true", "yes"):
        return False
    try:
        from vllm.config.vllm import VllmConfig
    except ImportError:  # another vLLM layout
        return False
    check = getattr(VllmConfig, "_validate_v2_model_runner", None)
    if check is None or getattr(check, "specops", False):
        return False

    def validate(self, *args, **kwargs):
        message = refusal(self)
        if message is not None:
            raise ValueError(message)
        return check(self, *args, **kwargs)

    validate.specops = True
    VllmConfig._validate_v2_model_runner = validate
    return True
