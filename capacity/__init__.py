"""Capacity shifting: one set of LLM replicas shared by the real-time and batch pools."""
