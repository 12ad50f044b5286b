"""The streamer: model plan, weight reader and the layer loop."""
