"""vLLM block hashing and KV event decoding (the KV-index issue).

Imports nothing else of llmgw.
"""
