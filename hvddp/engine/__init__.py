"""The background engine: negotiation by name, a response cache, fusion and execution."""
