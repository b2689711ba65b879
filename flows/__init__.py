"""Prefect flows. `retrain` is the main job; deployments are declared in prefect.yaml."""
