"""MLflow: runs and their records, lineage, promotion, comparing runs, the run summary."""
