"""Judging models: rewards, guardrails, sampling and scoring, statistics, the gate, the SQL sandbox."""
