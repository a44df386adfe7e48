"""Renderers: pure functions of a Trace (terminal tree, JSON)."""
