"""spill: stream a model larger than memory through a big batch of prompts."""
