"""Model files from elsewhere: GGUF import, the models posttrain can fetch."""
