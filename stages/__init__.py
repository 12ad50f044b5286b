"""Pipeline stages over MLX's distributed backend: a model's layers split over ranks (`split`), the link
between them (`link`, `relay`), the streamer core on one stage running the group's plans (`staged`, `plans`,
`serve`), a fixed-batch micro-batched round (`pipeline`), and the stage model the integration and the
estimate follow (`model`)."""
