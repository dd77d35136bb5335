"""Talking to upstreams: the HTTP client with its limits, and the SSRF policy."""
