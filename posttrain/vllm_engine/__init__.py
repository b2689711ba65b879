"""Drivers of real vLLM engines, each started in a process of its own (vLLM spawns
workers, so it must start under `__main__`): `check` loads a model with a fixed KV
memory and reports vLLM's own capacity, `sample` samples held-out prompts for the
evaluation, `loadtest` serves a model behind vLLM's OpenAI server on loopback."""
