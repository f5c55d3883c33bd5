"""The Textual console (``llmgw console``): of llmgw it imports only api, client and printable.

Pure core (no Textual, no I/O): ``rows`` (frozen rows built from wire messages),
``model`` (``ClusterModel``: Watch events → ``ConsoleSnapshot``; ``diff_rows``), ``rates``
(windowed counter rates robust to resets), ``routes`` (the router view's last decisions
and the reuse drift warning), ``summary`` (the overview's counts), ``report``
(``--once`` JSON and tables), ``registry`` (the one action registry: keys, footer,
read-only, views and ``:`` words). The worker: ``stream`` (``WatchSession``: follows Watch,
reconnects with backoff, reports ``LinkStatus``). The app: ``app`` (``ConsoleApp``),
``views`` (one widget per view; ``views.table.TableView`` applies keyed diffs) and
``widgets`` (``KeyedTable``, the badge, the ``:`` prompt, the detail page, cell formats).

Nothing is re-exported here, so that ``--once`` and the pure modules do not import Textual;
import from the modules.
"""

__all__: list[str] = []
