"""llmgw/server/core/fingerprint.py: ``remembered`` asks once per profile object."""

from __future__ import annotations

from llmgw.api.llmgw.v1 import EngineProfile
from llmgw.server.core.fingerprint import profile_fingerprint, remembered


def test_remembered_computes_once_per_profile_object() -> None:
    calls: list[str] = []

    def counting(profile: EngineProfile) -> str:
        calls.append(profile.name)
        return profile_fingerprint(profile)

    cached = remembered(counting)
    one = EngineProfile(name="a", engine="sim", gpu_class="cpu", model_path="/m")
    assert cached(one) == cached(one) == profile_fingerprint(one)
    assert calls == ["a"]
    other = EngineProfile(name="a", engine="sim", gpu_class="cpu", model_path="/m2")
    assert cached(other) != cached(one)  # another object: asked again
    assert calls == ["a", "a"]
