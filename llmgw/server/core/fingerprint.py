"""An engine profile's fingerprint: what of a profile changes the running engine process.

:func:`profile_fingerprint` hashes it. Each replica is placed with its profile's fingerprint,
and one whose fingerprint is no longer its deployment's profile's is replaced
(``llmgw.server.core.reconciler``). The profiles themselves: ``llmgw.server.core.profiles``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import PurePosixPath

from llmgw.api.llmgw.v1 import EngineProfile
from llmgw.server.core.profiles import CPU_CLASS

__all__ = ["profile_fingerprint", "remembered"]


# -- fingerprint ---------------------------------------------------------------------------


def profile_fingerprint(profile: EngineProfile) -> str:
    """``fp-`` and 16 hex digits of SHA-256 over what changes the running engine process.

    Included: engine, gpu_class, tp, pp, gpus_per_node, nodes, args (in order: a later flag
    overrides an earlier one), env (as a set: order means nothing to a process), model_path,
    served_model_name, adapters (as a set: vLLM's ``--lora-modules`` order changes nothing),
    kv_events and cpu_threads. Left out: the name (renaming a profile must not restart its
    engines) and min_gpu_memory_bytes (it only steers placement). Unset sizes hash as their
    defaults (tp 0 as 1, an empty served_model_name as model_path's last component), so a
    profile from the API that left them out matches the same profile from a file. A field
    added later must be hashed only when set, so existing fingerprints stay the same.
    """
    tp, pp, nodes = profile.tp or 1, profile.pp or 1, profile.nodes or 1
    per_node = profile.gpus_per_node
    if not per_node and profile.gpu_class != CPU_CLASS:
        per_node = tp * pp // nodes
    canonical = {
        "engine": profile.engine,
        "gpu_class": profile.gpu_class,
        "tp": tp,
        "pp": pp,
        "gpus_per_node": per_node,
        "nodes": nodes,
        "args": list(profile.args),
        "env": dict(sorted(profile.env.items())),
        "model_path": profile.model_path,
        "served_model_name": profile.served_model_name or PurePosixPath(profile.model_path).name,
        "adapters": sorted([a.name, a.path] for a in profile.adapters),
        "kv_events": profile.kv_events,
        "cpu_threads": profile.cpu_threads,
    }
    blob = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "fp-" + hashlib.sha256(blob.encode("ascii")).hexdigest()[:16]


def remembered(
    of: Callable[[EngineProfile], str] = profile_fingerprint,
) -> Callable[[EngineProfile], str]:
    """``of`` (a fingerprint, a refusal) computed once per profile *object*: for one round's
    snapshot, whose profiles stay the same objects, unchanged, while it runs (thousands of
    deployments of a few profiles ask the same few questions each round). Keep it no
    longer than the snapshot: a profile changed in place would keep its old answer."""
    seen: dict[int, tuple[EngineProfile, str]] = {}

    def cached(profile: EngineProfile) -> str:
        hit = seen.get(id(profile))
        if hit is not None and hit[0] is profile:  # the object held: its id is not reused
            return hit[1]
        value = of(profile)
        seen[id(profile)] = (profile, value)
        return value

    return cached
