"""Metering per tenant, key and model (issue #18): what ``/metrics`` and the report show.

Per (tenant, key_id, model), cumulative since the gateway process started:

- ``requests``: answered by a replica (any status);
- ``refused``: refused by the gateway (by reason: ``model``, ``rpm``, ``tpm``,
  ``concurrency``);
- ``prompt_tokens``, of which ``cached`` (``usage.prompt_tokens_details.cached_tokens``
  when the engine sends it, else 0), and ``completion_tokens``: from the engine's ``usage``
  in the answer (proxy.py reads it from a whole answer or a stream's last usage chunk); an
  answer without usage adds no tokens;
- ``gpu_seconds``: attributed as **one GPU × the request's upstream time** (from the request
  written to the replica to its answer's end): the replica's GPU count is not on the feed's
  ``RouteTarget``.

``model`` is the gateway's label for the request's model (a model it serves, else
``unknown``), so the label values stay bounded whatever clients ask for. Each request costs
one dict look-up; :meth:`TenantMeter.lines` (the ``/metrics`` families) and
:meth:`TenantMeter.usage` (``RouterReport.usage`` rows) walk every row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.api.llmgw.v1 import TenantKey, TenantUsage
from llmgw.promtext import family, go_float, label_set

Row = tuple[str, str, str]  # (tenant, key_id, model)


@dataclass(frozen=True, slots=True)
class Usage:
    """An answer's token counts as the engine's ``usage`` gave them (None: not said)."""

    prompt: int | None = None
    completion: int | None = None
    cached: int | None = None


@dataclass(slots=True)
class Counts:
    """One row's cumulative figures."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0


class TenantMeter:
    """Cumulative figures per (tenant, key_id, model), and refusals per reason."""

    def __init__(self) -> None:
        self.rows: dict[Row, Counts] = {}
        self.refusals: dict[tuple[Row, str], int] = {}

    def _row(self, key: TenantKey, model: str) -> Counts:
        row = (key.tenant, key.key_id, model)
        counts = self.rows.get(row)
        if counts is None:
            counts = self.rows[row] = Counts()
        return counts

    def answered(self, key: TenantKey, model: str, usage: Usage, upstream_s: float) -> None:
        counts = self._row(key, model)
        counts.requests += 1
        prompt = usage.prompt or 0
        counts.prompt_tokens += prompt
        counts.cached_tokens += min(usage.cached or 0, prompt)  # never more than the prompt
        counts.completion_tokens += usage.completion or 0
        counts.gpu_seconds += max(0.0, upstream_s)

    def refused(self, key: TenantKey, model: str, reason: str) -> None:
        self._row(key, model)  # a row for every key seen, refused or not
        at = ((key.tenant, key.key_id, model), reason)
        self.refusals[at] = self.refusals.get(at, 0) + 1

    def usage(self) -> list[TenantUsage]:
        """Every row as ``TenantUsage`` (cumulative), by tenant, key and model."""
        refused: dict[Row, int] = {}
        for (row, _), count in self.refusals.items():
            refused[row] = refused.get(row, 0) + count
        return [
            TenantUsage(
                tenant=tenant,
                key_id=key_id,
                model=model,
                requests=c.requests,
                refused=refused.get((tenant, key_id, model), 0),
                prompt_tokens=c.prompt_tokens,
                cached_prompt_tokens=c.cached_tokens,
                completion_tokens=c.completion_tokens,
                gpu_seconds=c.gpu_seconds,
            )
            for (tenant, key_id, model), c in sorted(self.rows.items())
        ]

    def lines(self) -> Iterable[str]:
        """The ``llmgw_tenant_*`` families (a ``GatewayMetrics`` collector)."""
        out: list[str] = []
        rows = sorted(self.rows.items())
        family(out, "llmgw_tenant_requests_total", "counter", "Requests a replica answered.")
        out.extend(f"llmgw_tenant_requests_total{_labels(r)} {c.requests}" for r, c in rows)
        family(
            out,
            "llmgw_tenant_tokens_total",
            "counter",
            "Tokens by the engine's usage: prompt_cached, prompt_uncached, completion.",
        )
        for row, c in rows:
            for kind, value in (
                ("prompt_cached", c.cached_tokens),
                ("prompt_uncached", c.prompt_tokens - c.cached_tokens),
                ("completion", c.completion_tokens),
            ):
                out.append(f"llmgw_tenant_tokens_total{_labels(row, ('kind', kind))} {value}")
        family(
            out,
            "llmgw_tenant_refused_total",
            "counter",
            "Requests the gateway refused: model, rpm, tpm, concurrency.",
        )
        out.extend(
            f"llmgw_tenant_refused_total{_labels(row, ('reason', reason))} {count}"
            for (row, reason), count in sorted(self.refusals.items())
        )
        family(
            out,
            "llmgw_tenant_gpu_seconds_total",
            "counter",
            "GPU-seconds attributed: 1 GPU x the request's upstream time.",
        )
        out.extend(
            f"llmgw_tenant_gpu_seconds_total{_labels(r)} {go_float(c.gpu_seconds)}" for r, c in rows
        )
        return out


def _labels(row: Row, *more: tuple[str, str]) -> str:
    tenant, key_id, model = row
    return label_set((("tenant", tenant), ("key", key_id), ("model", model), *more))


__all__ = ["Counts", "Row", "TenantMeter", "Usage"]
