"""Renderers: pure functions of a Trace (terminal tree, JSON) or of check reports (findings table, JUnit XML,
GitHub annotations)."""
