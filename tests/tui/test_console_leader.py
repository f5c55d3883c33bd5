"""The console's overview says which server of the database leads (issue #17)."""

from __future__ import annotations

from rich.console import Console

from llmgw.api.llmgw.v1 import Cluster, Leadership
from llmgw.tui.leader import leader_words
from llmgw.tui.model import ClusterModel
from llmgw.tui.summary import summarize
from llmgw.tui.views.pulse import overview_text


def _shown(leader: str) -> str:
    snapshot = ClusterModel().snapshot(0)
    console = Console(width=100, record=True)
    console.print(overview_text(summarize(snapshot), snapshot.router, "http://a:8080", leader))
    return console.export_text()


def test_the_overview_names_the_leader_and_whether_it_is_the_server_answering() -> None:
    model = ClusterModel()
    leading = Leadership(server_id="a", leader_id="a", leader_address="h:1", epoch=4, leading=True)
    model.reset(Cluster(revision=1, leadership=leading), 0)
    assert model.snapshot(0).leader == "a at h:1, epoch 4 (this server)"
    text = _shown(model.snapshot(0).leader)
    assert "leader" in text and "a at h:1, epoch 4 (this server)" in text


def test_a_leader_named_by_its_address_and_no_leadership_at_all() -> None:
    other = Leadership(server_id="b", leader_id="h:1", leader_address="h:1", epoch=2)
    assert leader_words(other) == "at h:1, epoch 2 (not this server)"
    assert leader_words(None) == leader_words(Leadership()) == ""
    assert "leader" not in _shown("")
