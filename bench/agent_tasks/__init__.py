"""Agents finishing real tasks through Ember (issue #41): ``python -m bench.agent_tasks``."""
