"""The node agent: discovery and the link to the control server."""
