"""One entry module per pipeline stage, each with `main(config, ...) -> dict[str, float]`.

The stage order lives in dvc.yaml alone; these modules do not know about each other.
"""
