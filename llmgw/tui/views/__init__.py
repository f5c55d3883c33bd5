"""The console's views: one widget each, shown in a ContentSwitcher (``ConsoleApp``).

``table.TableView`` is the base of the tabular ones (``topology``, ``replicas``,
``events``); ``pulse`` has the overview and the router view; ``details`` builds the detail
pages Enter opens.
"""
