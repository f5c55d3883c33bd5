"""The Textual console (its own issue). Imports only llmgw.api and llmgw.client."""
