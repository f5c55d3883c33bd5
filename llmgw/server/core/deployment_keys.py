"""``[deployments.NAME]`` as operators write it, its autoscale policy included: read by key
path, checked, and written back (``llmgw.server.core.profiles`` reads whole documents)::

    [deployments.chat]
    profile = "chat-tp2"            # required: a profile of this same document
    replicas = 2                    # 0 to 10,000, default 1; not with autoscale mode "act"
    pool = "gpu-a"                  # default: any pool
    labels = { zone = "eu-1" }      # node labels a replica's nodes must carry
    priority = 10                   # -1,000 to 1,000, default 0: under a pool's GPU budget
                                    # (llmgw server --gpu-budget) a higher one goes first

    [deployments.chat.autoscale]
    min = 1                         # 0 to 10,000, default 1; 0 allows scale to zero
    max = 8                         # required: at least min, and at least 1
    ttft_p90_ms = 800               # time to first token, p90: 1 to 600,000 ms
    itl_p90_ms = 50                 # inter-token latency, p90: 1 to 60,000 ms
    scale_down_after_s = 300        # below target this long before a replica goes (0 to 86,400)
    mode = "act"                    # "act" (default): the autoscaler sets the count;
                                    # "advise": it decides and reports, and changes nothing

At least one of the two targets is set. In mode "act" the autoscaler owns the count, so a
table that also sets ``replicas`` is refused naming both keys; the parsed deployment holds
``replicas = min`` (where a new deployment starts), and an apply over a stored one keeps
the stored count within the new ``[min, max]`` (:func:`kept_count`, called by
``llmgw.server.state.desired``): applying the file again never undoes the autoscaler. In mode
"advise" ``replicas`` is the operator's as without a policy.
"""

from __future__ import annotations

import re

from llmgw.api.llmgw.v1 import AutoscalePolicy, Deployment
from llmgw.server.core.autoscale import ACT, ADVISE
from llmgw.server.core.tomlkeys import (
    NAME,
    NAME_MAX,
    NAME_RULE,
    Table,
    key_path,
    render_table,
    show,
)

__all__ = [
    "DEPLOYMENT_KEYS", "MAX_PRIORITY", "MAX_REPLICAS", "MODES", "is_act",
    "kept_count", "read_deployment", "render_deployment",
]  # fmt: skip

MAX_REPLICAS = 10_000
MAX_PRIORITY = 1_000  # priorities run from -MAX_PRIORITY to MAX_PRIORITY
MAX_TTFT_MS = 600_000  # ten minutes
MAX_ITL_MS = 60_000
MAX_SCALE_DOWN_AFTER_S = 86_400  # a day
DEFAULT_SCALE_DOWN_AFTER_S = 300
MODES = (ACT, ADVISE)

DEPLOYMENT_KEYS = ("profile", "replicas", "pool", "labels", "priority", "autoscale")
_AUTOSCALE_KEYS = ("min", "max", "ttft_p90_ms", "itl_p90_ms", "scale_down_after_s", "mode")
_TARGETS = (("ttft_p90_ms", MAX_TTFT_MS), ("itl_p90_ms", MAX_ITL_MS))
_MAX_LABEL_KEY = 256
_LABEL_KEY = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?")


def is_act(deployment: Deployment) -> bool:
    """Whether the autoscaler owns ``deployment``'s count (a policy in mode "act")."""
    policy = deployment.autoscale
    return policy is not None and (policy.mode or ACT) == ACT


def kept_count(applied: Deployment, stored: Deployment | None) -> int:
    """The count an apply of ``applied`` stores: in mode "act", ``stored``'s count within
    the new ``[min, max]`` (``min`` for a new deployment); otherwise the applied count."""
    policy = applied.autoscale
    if policy is None or not is_act(applied):
        return applied.replicas
    if stored is None:
        return policy.min
    return max(policy.min, min(policy.max, stored.replicas))


# -- reading -------------------------------------------------------------------------------


def read_deployment(name: str, t: Table, known: list[str]) -> Deployment | None:
    """The deployment in table ``t``; None, with its problems recorded, when it is bad."""
    before = len(t.problems)
    t.check_keys(DEPLOYMENT_KEYS)
    profile = t.string("profile")
    if profile is not None and profile not in known:
        listed = ", ".join(known[:10]) + (", …" if len(known) > 10 else "") if known else "none"
        t.problem("profile", f"no profile named {show(profile)} (known: {listed})")
    replicas = t.integer("replicas", 0, MAX_REPLICAS, 1)
    pool = t.data.get("pool", "")
    if not isinstance(pool, str) or (pool and not NAME.fullmatch(pool) or len(pool) > NAME_MAX):
        t.problem("pool", f"not a valid pool name: {NAME_RULE}; got {show(pool)}")
    labels = t.string_table("labels", _label_key_problem)
    priority = t.integer("priority", -MAX_PRIORITY, MAX_PRIORITY, 0)
    policy = _read_autoscale(t)
    if policy is not None and policy.mode == ACT and "replicas" in t.data:
        autoscale = f"[{key_path(*t.path, 'autoscale')}]"
        t.problem(
            "replicas",
            f'set together with {autoscale} in mode "act", where the autoscaler owns the '
            f"count: remove replicas (a new deployment starts at autoscale.min), or set "
            f'autoscale.mode = "advise"',
        )
    if len(t.problems) != before:
        return None
    return Deployment(
        name=name,
        profile=profile or "",
        replicas=policy.min if policy is not None and policy.mode == ACT else replicas or 0,
        pool=pool,
        labels=labels or {},
        priority=priority or 0,
        autoscale=policy,
    )


def _label_key_problem(key: str) -> str | None:
    if len(key) > _MAX_LABEL_KEY or not _LABEL_KEY.fullmatch(key):
        return "not a label name (letters, digits, -, _, . and /, starting and ending with a letter or digit)"  # noqa: E501
    return None


def _read_autoscale(parent: Table) -> AutoscalePolicy | None:
    """``[deployments.NAME.autoscale]``, checked; None when absent or bad (problems recorded)."""
    if "autoscale" not in parent.data:
        return None
    value = parent.data["autoscale"]
    if not isinstance(value, dict):
        parent.problem("autoscale", f"must be a table, got {show(value)}")
        return None
    t = Table(value, (*parent.path, "autoscale"), parent.problems)
    before = len(t.problems)
    t.check_keys(_AUTOSCALE_KEYS)
    low = t.integer("min", 0, MAX_REPLICAS, 1)
    high = t.integer("max", 1, MAX_REPLICAS, 0) if "max" in t.data else None
    if "max" not in t.data:
        t.problem("max", "required: the most replicas the autoscaler may run (at least 1)")
    elif low is not None and high is not None and high < low:
        t.problem("max", f"must be at least min ({low}), got {high}")
    targets = [t.integer(key, 1, limit, 0) if key in t.data else 0 for key, limit in _TARGETS]
    if not any(key in t.data for key, _ in _TARGETS):
        t.problem("ttft_p90_ms", "set a latency target: ttft_p90_ms, itl_p90_ms or both")
    after = t.integer("scale_down_after_s", 0, MAX_SCALE_DOWN_AFTER_S, DEFAULT_SCALE_DOWN_AFTER_S)
    mode = t.data.get("mode", ACT)
    if mode not in MODES:
        t.problem("mode", f'must be "act" or "advise", got {show(mode)}')
    if len(t.problems) != before:
        return None
    return AutoscalePolicy(
        min=low or 0,
        max=high or 0,
        ttft_p90_ms=targets[0] or 0,
        itl_p90_ms=targets[1] or 0,
        scale_down_after_s=after or 0,
        mode=str(mode),
    )


# -- writing -------------------------------------------------------------------------------


def render_deployment(d: Deployment) -> str:
    """``d`` as TOML tables that :func:`read_deployment` reads back to an equal message.

    In mode "act" ``replicas`` is left out when it is 0 (unset) or ``min`` (what reading
    gives); any other count is written, so that a request carrying one is refused.
    """
    fields: list[tuple[str, object]] = [("profile", d.profile)]
    policy = d.autoscale
    if not is_act(d) or (policy is not None and d.replicas not in (0, policy.min)):
        fields.append(("replicas", d.replicas))
    fields += [(k, v) for k, v in (("pool", d.pool), ("labels", dict(d.labels))) if v]
    if d.priority:
        fields.append(("priority", d.priority))
    text = render_table(("deployments", d.name), fields)
    if policy is not None:
        text += render_table(("deployments", d.name, "autoscale"), _policy_fields(policy))
    return text


def _policy_fields(policy: AutoscalePolicy) -> list[tuple[str, object]]:
    fields: list[tuple[str, object]] = [("min", policy.min), ("max", policy.max)]
    fields += [(k, v) for k, v in (("ttft_p90_ms", policy.ttft_p90_ms),) if v]
    fields += [(k, v) for k, v in (("itl_p90_ms", policy.itl_p90_ms),) if v]
    fields += [("scale_down_after_s", policy.scale_down_after_s), ("mode", policy.mode or ACT)]
    return fields
