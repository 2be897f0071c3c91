"""ironserve: infrastructure as code from a bare R740 to a monitored LLM inference service."""
