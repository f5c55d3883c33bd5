"""The precise tier checking itself: predicted reuse against what engines report cached.

For each answered request whose engine reported ``usage.prompt_tokens_details.cached_tokens``
(vLLM with ``--enable-prompt-tokens-details``; a stream only with
``stream_options.include_usage``), the gateway adds the cached tokens to its tier's counter;
for a precise decision it also compares them with the tokens the tier predicted
(``llmgw.gateway.routing.explain.predicted_reuse``). With the index right, the two agree to
within a block; a tokenizer, block-key or event-format mismatch between the gateway and the
engines shows here first: the index predicts nothing (or too much) while the engines keep
hitting (or missing), before hit rates quietly collapse. Requests whose engine says nothing
are not checked; the engines' own prefix-cache counters (``llmgw_reuse_tokens_total
{stage="delivered"}``) are then the only comparison, in aggregate.

Families (``llmgw.promtext`` text, rendered by `ReuseCheck.lines`)::

    llmgw_route_cached_tokens_total{tier}       cached prompt tokens engines reported
    llmgw_route_answers_total{tier}             answers that reported them
    llmgw_route_predicted_tokens_total{tier}    what the precise tier predicted for those
    llmgw_route_gap_tokens_total{tier}          sum over them of |predicted - cached|
    llmgw_route_checked_prompt_tokens_total{tier}  their prompt tokens
    llmgw_route_reuse_gap_ratio{tier}           histogram: |predicted - cached| / prompt
                                                tokens, per checked request

``rate(llmgw_route_gap_tokens_total[5m]) / rate(llmgw_route_checked_prompt_tokens_total[5m])``
is the drift the console warns about (``llmgw.tui.routes``: over 10 % of the prompt tokens,
with at least 20 checked requests in its window).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.gateway.metrics import Histogram, labelled
from llmgw.promtext import family, quote_label

GAP_BUCKETS: tuple[float, ...] = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)

__all__ = ["GAP_BUCKETS", "ReuseCheck", "ReuseTotals"]


@dataclass(frozen=True, slots=True)
class ReuseTotals:
    """The precise tier's check, cumulative (RouterStats fields 21..25)."""

    predicted: int = 0
    cached: int = 0
    gap: int = 0
    checked: int = 0
    prompt: int = 0


class ReuseCheck:
    """The counters of the module docstring, kept per tier."""

    def __init__(self) -> None:
        self.cached: dict[str, int] = {}
        self.answers: dict[str, int] = {}
        self.predicted: dict[str, int] = {}
        self.gap: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        self.checked: dict[str, int] = {}
        self.checked_cached: dict[str, int] = {}  # the cached tokens of checked requests
        self.gap_ratio: dict[str, Histogram] = {}

    def answered(
        self, tier: str, cached: int | None, predicted: int | None, prompt_tokens: int
    ) -> None:
        """One answer: the engine's cached tokens (None: it said nothing), the precise
        tier's prediction (None: another tier decided) and the prompt's tokens."""
        if cached is None:
            return
        self.cached[tier] = self.cached.get(tier, 0) + cached
        self.answers[tier] = self.answers.get(tier, 0) + 1
        if predicted is None or prompt_tokens <= 0:
            return
        gap = abs(predicted - cached)
        self.predicted[tier] = self.predicted.get(tier, 0) + predicted
        self.gap[tier] = self.gap.get(tier, 0) + gap
        self.prompt[tier] = self.prompt.get(tier, 0) + prompt_tokens
        self.checked[tier] = self.checked.get(tier, 0) + 1
        self.checked_cached[tier] = self.checked_cached.get(tier, 0) + cached
        histogram = self.gap_ratio.get(tier)
        if histogram is None:
            histogram = self.gap_ratio[tier] = Histogram(GAP_BUCKETS)
        histogram.observe(min(1.0, gap / prompt_tokens))

    def totals(self) -> ReuseTotals:
        """Every tier's check added up (only the precise tier predicts)."""
        return ReuseTotals(
            predicted=sum(self.predicted.values()),
            cached=sum(self.checked_cached.values()),
            gap=sum(self.gap.values()),
            checked=sum(self.checked.values()),
            prompt=sum(self.prompt.values()),
        )

    def lines(self) -> Iterable[str]:
        out: list[str] = []
        counters = (
            ("llmgw_route_cached_tokens_total", "Cached prompt tokens engines reported, by "
             "the tier that chose them", self.cached),
            ("llmgw_route_answers_total", "Answers whose engine reported cached tokens",
             self.answers),
            ("llmgw_route_predicted_tokens_total", "Cached tokens the precise tier predicted "
             "for the answers that reported them", self.predicted),
            ("llmgw_route_gap_tokens_total", "Sum of |predicted - reported| cached tokens "
             "per checked request", self.gap),
            ("llmgw_route_checked_prompt_tokens_total", "Prompt tokens of the checked "
             "requests", self.prompt),
        )  # fmt: skip
        for name, help_, counts in counters:
            labelled(out, name, "counter", help_, "tier", counts)
        name = "llmgw_route_reuse_gap_ratio"
        help_ = "Per checked request: |predicted - reported cached tokens| / prompt tokens"
        family(out, name, "histogram", help_)
        for tier, histogram in sorted(self.gap_ratio.items()):
            out.extend(histogram.lines(name, f"tier={quote_label(tier)},"))
        return out
