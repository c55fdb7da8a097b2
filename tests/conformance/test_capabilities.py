"""Every registered backend declares each capability, in its class and in docs/backends.md.

Runs for all backends in the default suite: their modules import without their engine packages.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tandem.rollout.base import (CAPABILITIES, CAPABILITY_FALLBACKS, CAPABILITY_LEVELS,
                                 BaseRollout)
from tandem.rollout.registry import _ROLLOUT_BACKENDS, rollout_backend_names

DOC = Path(__file__).resolve().parents[2] / "docs" / "backends.md"


def backend_class(name: str) -> type:
    module, attribute = _ROLLOUT_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attribute)


def doc_table() -> dict[str, dict[str, str]]:
    """docs/backends.md's capability table: backend -> capability -> level."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| capability"))
    names = [cell.strip() for cell in lines[start].strip("|").split("|")][1:]
    table: dict[str, dict[str, str]] = {name: {} for name in names}
    for row in lines[start + 2:]:
        if not row.startswith("|"):
            break
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        for name, cell in zip(names, cells[1:]):
            table[name][cells[0].strip("`")] = cell
    return table


@pytest.mark.parametrize("name", rollout_backend_names())
def test_capability_table_is_complete_and_documented(name):
    cls = backend_class(name)
    assert issubclass(cls, BaseRollout)
    assert set(cls.capabilities) == set(CAPABILITIES), name
    assert all(level in CAPABILITY_LEVELS for level in cls.capabilities.values())
    assert doc_table()[name] == dict(cls.capabilities)


def test_every_capability_has_a_documented_fallback():
    assert set(CAPABILITY_FALLBACKS) == set(CAPABILITIES)
    text = DOC.read_text()
    assert all(f"`{name}`" in text for name in CAPABILITIES)


def test_supports_resolves_gpu_only_capabilities():
    class Probe(BaseRollout):
        capabilities = {**{name: "yes" for name in CAPABILITIES}, "sleep_weights": "gpu",
                        "per_request_seed": "no"}

    assert Probe.supports("sleep_weights", "cuda:0") and not Probe.supports("sleep_weights", "cpu")
    assert not Probe.supports("per_request_seed", "cuda")
    assert Probe.supports("abort_partial", "cpu")


@pytest.mark.parametrize("name", rollout_backend_names())
def test_request_fields_a_backend_does_not_serve_are_refused_naming_them(name):
    from tandem.types import GenerateRequest

    cls = backend_class(name)
    plain = GenerateRequest("r", [1, 2], {"max_tokens": 2})
    cls.check_request(plain)
    image = plain.replace(multi_modal_data={"image": [b"..."]})
    adapter = plain.replace(adapter="math-lora")
    for request, capability, field in ((image, "multi_modal_inputs", "multi_modal_data"),
                                       (adapter, "adapters", "adapter")):
        if cls.supports(capability):
            cls.check_request(request)
        else:
            with pytest.raises(ValueError, match=f"GenerateRequest.{field}"):
                cls.check_request(request)
