"""Correctness and performance gates, their statistics and their reports."""
