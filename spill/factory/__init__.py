"""Random-weight models of real shapes in Hugging Face layout, for tests, benchmarks and the demo."""
