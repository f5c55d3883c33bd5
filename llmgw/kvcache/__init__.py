"""The block hashing and KV event decoding of vLLM (the KV-index issue builds it). Imports nothing else of llmgw."""
